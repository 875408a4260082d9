"""Policies in the real daemon: batches are a pure function of (seed, epoch, rank, batch) with
RandAugment, TrivialAugmentWide, AutoAugment, a timm string and random erasing, whatever the
worker count, and across a restart mid-epoch."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import small_config
from test_daemon import collect, read_across_a_restart, reference_batches, same_batches

POLICY_AUGMENTS = {
    "randaugment": {"policy": "randaugment", "policy_args": {"num_ops": 2, "magnitude": 9},
                    "random_erasing": {"p": 0.5, "mode": "pixel"}},
    "trivialaugment": {"policy": "trivialaugment", "random_erasing": {"p": 0.5, "mode": "rand", "count": [1, 2]},
                       "ops": {"vflip": 0.5, "grayscale": 0.2, "blur": 0.3, "blur_kernel": 5}},
    "autoaugment": {"policy": "autoaugment"},
    "timm": {"policy": "rand-m9-mstd0.5-inc1", "random_erasing": {"p": 0.25, "mode": "pixel"}},
}


def _cfg(tmp_path, image_root, policy, workers=2):
    aug = {"mode": "random_resized_crop", **POLICY_AUGMENTS[policy]}
    return small_config(tmp_path, image_root, workers={"count": workers}, augment=aug)


@pytest.mark.parametrize("policy", list(POLICY_AUGMENTS))
def test_a_policy_gives_the_same_batches_with_one_and_two_workers(tmp_path, image_root, daemon_factory, policy):
    got = []
    for workers in (1, 2):
        run = tmp_path / f"w{workers}"
        run.mkdir()
        cfg = _cfg(run, image_root, policy, workers)
        d = daemon_factory(cfg)
        got.append(collect(cfg))
        assert d.stop() == 0
        assert "Traceback" not in d.log()
    same_batches(got[0], got[1])
    ref, _ = reference_batches(cfg)  # made in this process, one sample after another
    same_batches(got[1], ref)
    # the policy is in the pixels: the same config without it gives other batches
    plain = tmp_path / "plain"
    plain.mkdir()
    base, _ = reference_batches(small_config(plain, image_root, augment={"mode": "random_resized_crop"}), epochs=1)
    assert not np.array_equal(base[(0, 0, 0)][0], ref[(0, 0, 0)][0])


@pytest.mark.parametrize("policy", ["randaugment", "trivialaugment"])
def test_a_daemon_restart_mid_epoch_with_a_policy_is_bit_identical(tmp_path, image_root, daemon_factory, policy):
    cfg = _cfg(tmp_path, image_root, policy)
    same_batches(read_across_a_restart(cfg, daemon_factory), reference_batches(cfg)[0])
