"""Batches a previous run left, adopted at start, hold the stream's views: a user transform's
module imports code of its own (a helper) that the stream's fingerprint does not cover; after
the helper changed the number of views, the batches of the old views were served beside the new
ones in the same epoch (3 views for batches 2-4, then 2 for 5-7 in the trainer's loop)."""

from __future__ import annotations

import os
import textwrap

from conftest import small_config, wait_until
from prefetchd_client import PrefetchClient

from prefetchd.core.config import load as load_config
from prefetchd.format import status

MAIN = textwrap.dedent('''
    import numpy as np
    from uvr_helper import crops


    def make():
        def views(im):
            return crops(np.asarray(im.resize((16, 16))))
        return views
''')
TWO = "def crops(a):\n    return (a, a[:8, :8].copy())\n"
THREE = "def crops(a):\n    return (a, a[:8, :8].copy(), a[:4, :4].copy())\n"


def test_batches_left_with_other_views_are_not_adopted_after_the_transforms_helper_changed(
        tmp_path, image_root, daemon_factory):
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "uvr_main.py").write_text(MAIN)
    (mods / "uvr_helper.py").write_text(TWO)
    cfg = small_config(tmp_path, image_root, loader={"epochs": 1}, buffer={"capacity": 6, "refill_at": 6},
                       augment={"output_size": 16, "transform": "uvr_main:make", "transform_path": str(mods)})
    buf = load_config(cfg).buffer.dir
    d = daemon_factory(cfg)
    with PrefetchClient(cfg, rank=0, timeout=60, as_numpy=True) as c:
        it = c.iter_epoch(0)
        for _ in range(2):
            assert len(next(it)) == 3  # two views and the labels
        wait_until(lambda: len([n for n in os.listdir(buf) if n.endswith(".batch")]) >= 3, 30, "batches left")
        state = c.state_dict()
        it.close()
    assert d.stop() == 0
    (mods / "uvr_helper.py").write_text(THREE)  # uvr_main.py, the file the fingerprint reads, is unchanged
    d = daemon_factory(cfg)
    wait_until(lambda: status.daemon_alive(buf), 60, "the second daemon")
    seen = []
    with PrefetchClient(cfg, rank=0, timeout=60, as_numpy=True) as c:
        c.load_state_dict(state)
        for batch in c.iter_epoch(0):
            seen.append([tuple(v.shape[2:]) for v in batch[:-1]])
    assert d.stop() == 0
    assert seen == [[(16, 16), (8, 8), (4, 4)]] * 6, seen
    assert "3 views (16x16, 8x8, 4x4)" in d.log() and "from another stream" in d.log()
