"""What a trainer sees across a daemon killed mid-epoch and started again with another worker
count, the trainer's ``for`` loop going on throughout: each policy (RandAugment,
TrivialAugmentWide, AutoAugment, a timm string, with random erasing and single ops) and the
built-in views give the batches made in-process one sample after another, bit for bit."""

from __future__ import annotations

import signal

import numpy as np
import pytest
import yaml
from conftest import small_config, wait_until
from prefetchd_client import PrefetchClient
from test_daemon import reference_batches
from test_policies_daemon import POLICY_AUGMENTS
from test_views_daemon import VIEWS
from test_views_daemon import reference as views_reference

from prefetchd.core.config import load as load_config
from prefetchd.format import status

CASES = {**{k: {"mode": "random_resized_crop", **v} for k, v in POLICY_AUGMENTS.items()},
         "ops": {"mode": "random_resized_crop", "ops": {"solarize": 0.5, "posterize": 0.5, "posterize_bits": 3,
                                                        "grayscale": 0.3, "vflip": 0.5},
                 "random_erasing": {"p": 0.7, "mode": "const", "value": [124, 116, 104], "count": [1, 3]}},
         "views": {"views": VIEWS}}


def _workers(cfg: str, n: int) -> None:
    with open(cfg) as f:
        data = yaml.safe_load(f)
    data["workers"]["count"] = n
    with open(cfg, "w") as f:
        yaml.safe_dump(data, f)


@pytest.mark.parametrize("case", list(CASES))
def test_a_daemon_killed_mid_epoch_and_restarted_with_other_workers_gives_the_same_batches(
        tmp_path, image_root, daemon_factory, case):
    cfg = small_config(tmp_path, image_root, workers={"count": 1}, augment=CASES[case])
    buf = load_config(cfg).buffer.dir
    d = daemon_factory(cfg)
    got, restarts = {}, 0
    with PrefetchClient(cfg, rank=0, timeout=60, as_numpy=True) as c:
        for e in (0, 1):
            for b, batch in enumerate(c.iter_epoch(e)):
                *views, y = batch
                got[(0, e, b)] = tuple(np.ascontiguousarray(v.transpose(0, 2, 3, 1)) for v in views) + (y.copy(),)
                if (e, b) in ((0, 2), (1, 5)):  # killed as the OOM killer would, started again by its unit
                    d.stop(signal.SIGKILL)
                    _workers(cfg, 3 if restarts % 2 == 0 else 2)
                    restarts += 1
                    d = daemon_factory(cfg)
    wait_until(lambda: status.daemon_alive(buf), 60, "the last daemon")
    assert d.stop() == 0 and restarts == 2
    if case == "views":
        ref = views_reference(cfg)
    else:
        ref = {k: (v[0], v[1]) for k, v in reference_batches(cfg)[0].items()}
    assert sorted(got) == sorted(ref)
    for k in ref:
        assert len(got[k]) == len(ref[k]), k
        for g, r in zip(got[k], ref[k], strict=True):
            assert np.array_equal(g, r), (case, k)
    assert "Traceback" not in d.log()
