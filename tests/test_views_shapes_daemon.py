"""A user transform's views of drawn shapes (2 to 5 views, 1 to 40 pixels a side, non-square,
HWC and CHW alike, a 1x1 view) through the real daemon, batches of 5 with a short last one:
the client yields each view as made in-process, as numpy, as pinned CPU tensors, and normalised
((x / 255 - mean) / std computed here in float64)."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
from conftest import small_config
from prefetchd_client import PrefetchClient
from test_views_daemon import _reference_normalized, reference

MODULE = '''
import random

import numpy as np

SHAPES = {shapes!r}


def make():
    def views(im):
        out = []
        for v, (h, w) in enumerate(SHAPES):
            x = int(random.random() * (im.size[0] - 8))
            a = np.asarray(im.crop((x, 0, x + 8, 8)).resize((w, h)))
            out.append(np.ascontiguousarray(a.transpose(2, 0, 1)) if v % 2 else a)
        return tuple(out)
    return views
'''


def _shapes(seed: int) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    return [(int(rng.integers(1, 41)), int(rng.integers(1, 41))) for _ in range(int(rng.integers(2, 6)))]


@pytest.mark.parametrize("name, shapes", [("drawn1", _shapes(1)), ("drawn2", _shapes(2)), ("tiny", [(1, 1), (3, 40)])])
def test_views_of_any_shape_reach_the_trainer_as_made(tmp_path, image_root, daemon_factory, name, shapes):
    torch = pytest.importorskip("torch")
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / f"uv_shapes_{name}.py").write_text(textwrap.dedent(MODULE.format(shapes=shapes)))  # (a name per test:
    # the in-process reference imports it into this process)
    cfg = small_config(tmp_path, image_root, loader={"epochs": 3, "batch_size": 5, "drop_last": False},
                       augment={"output_size": 8, "transform": f"uv_shapes_{name}:make", "transform_path": str(mods)})
    d = daemon_factory(cfg)
    ref = reference(cfg, epochs=3)
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    reads = ({"as_numpy": True}, {"device": "cpu", "pin_memory": True},
             {"device": "cpu", "pin_memory": True, "normalize": True})
    for e, kw in enumerate(reads):
        with PrefetchClient(cfg, rank=0, timeout=60, **kw) as c:
            assert c.meta()["views"] == [list(s) for s in shapes]
            n = 0
            for b, batch in enumerate(c.iter_epoch(e)):
                want = ref[(0, e, b)]
                assert len(batch) == len(shapes) + 1
                for v, (got, w) in enumerate(zip(batch[:-1], want[:-1], strict=True)):
                    g = got.numpy() if isinstance(got, torch.Tensor) else got
                    assert g.shape == (len(w), 3) + shapes[v], (kw, v)
                    if kw.get("normalize"):
                        assert np.abs(g - _reference_normalized(w, mean, std)).max() < 1e-5, (kw, e, b, v)
                    else:
                        assert np.array_equal(g.transpose(0, 2, 3, 1), w), (kw, e, b, v)
                assert np.array_equal(np.asarray(batch[-1]), want[-1])
                n += 1
            assert n == c.batches_per_epoch == 10  # 48 samples: 9 of 5 and one of 3
    assert d.stop() == 0 and "Traceback" not in d.log()
