"""The client's CUDA path: pinned buffers, side-stream copies, events. Runs where a GPU is present
(this project's CI machines have none: there these tests are reported as skipped, not passed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import small_config
from prefetchd_client import PrefetchClient, normalize
from test_daemon import reference_batches

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


@needs_cuda
def test_batches_arrive_on_the_gpu_bit_identical_through_pinned_buffers(tmp_path, image_root, daemon_factory):
    cfg = small_config(tmp_path, image_root)
    d = daemon_factory(cfg)
    ref, _ = reference_batches(cfg)
    with PrefetchClient(cfg, device="cuda", timeout=60) as c:
        for e in (0, 1):
            for b, (x, y) in enumerate(c.iter_epoch(e)):
                assert x.is_cuda and y.is_cuda and x.dtype == torch.uint8 and y.dtype == torch.int64
                x = x * 1  # work on the trainer's stream, while the next copy runs on the side stream
                assert np.array_equal(x.permute(0, 2, 3, 1).cpu().numpy(), ref[(0, e, b)][0])
                assert np.array_equal(y.cpu().numpy(), ref[(0, e, b)][1])
                assert normalize(x, dtype=torch.float16).is_cuda
        assert c.pin_memory and all(t.is_pinned() for t in c._pinned)
    assert d.stop() == 0
