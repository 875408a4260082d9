"""A yielded batch is never changed afterwards, whatever the trainer keeps and for how long.

Without a GPU, the multi-buffer logic of the CUDA path runs against a stand-in for pinned memory
and a copy engine (``DeferredCopies``): a copy queued on the "side stream" runs only when its
event is found complete, synchronized or waited for by the trainer, as late as a real GPU may
run it. A pinned buffer handed out again before the event of its last copy completed gives the
trainer the next batch's bytes, and these tests fail.
"""

from __future__ import annotations

import contextlib
import random
import threading

import numpy as np
import pytest
import torch
from conftest import small_config
from prefetchd_client import PrefetchClient, PrefetchError, _normalize_numpy
from test_daemon import reference_batches


class _Event:
    def __init__(self, copies: DeferredCopies, upto: int):
        self._copies = copies
        self._upto = upto

    def query(self) -> bool:
        # a GPU finishes copies when it gets to them: sometimes the answer is "not yet"
        with self._copies.lock:
            if self._copies.done >= self._upto:
                return True
            if self._copies.rng.random() < 0.5:
                return False
            self.synchronize()
            return True

    def synchronize(self) -> None:
        self._copies.run(self._upto)


class DeferredCopies:
    """Stands in for ``CudaTransfer``: host blocks are plain memory, copies run late, in order."""

    def __init__(self, seed: int = 0):
        self.queued: list[tuple[torch.Tensor, torch.Tensor]] = []  # (destination, source view)
        self.done = 0
        self.rng = random.Random(seed)
        self.blocks = 0
        self.waits = 0
        self.waited: list = []  # the tensors each wait marked as used on the trainer's stream
        self.lock = threading.RLock()  # the reader queues and the trainer waits: a stream is thread-safe

    def available(self) -> bool:
        return True

    def resolve(self, device):
        return torch.device("cpu")

    def empty(self, nbytes: int) -> torch.Tensor:
        self.blocks += 1
        return torch.empty(nbytes, dtype=torch.uint8)

    def stream(self, device):
        return "side stream"

    def context(self, device, stream):
        return contextlib.nullcontext()

    def to_device(self, tensor: torch.Tensor, device) -> torch.Tensor:
        dst = torch.empty_like(tensor)  # keeps the channels-last strides, as a CUDA copy does
        with self.lock:
            self.queued.append((dst, tensor))  # reads the source when it runs, not now
        return dst

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        with self.lock:
            self.queued.append((dst, src))
        return dst

    def record(self, stream) -> _Event:
        with self.lock:
            return _Event(self, len(self.queued))

    def run(self, upto: int) -> None:
        with self.lock:
            while self.done < upto:
                dst, src = self.queued[self.done]
                dst.copy_(src)
                self.queued[self.done] = None
                self.done += 1

    def wait(self, event: _Event, device, tensors) -> None:
        self.waits += 1
        self.waited.append(tuple(tensors))
        event.synchronize()  # the trainer's stream runs after the copy: the latest it can happen


def _same(x, y, ref) -> bool:
    return np.array_equal(np.asarray(x.permute(0, 2, 3, 1)), ref[0]) and np.array_equal(np.asarray(y), ref[1])


@pytest.mark.parametrize("prefetch", [1, 3])
def test_device_batches_through_the_pinned_pool_are_never_overwritten(tmp_path, image_root, daemon_factory, prefetch):
    cfg = small_config(tmp_path, image_root)
    d = daemon_factory(cfg)
    ref, _ = reference_batches(cfg)
    copies = DeferredCopies(seed=prefetch)
    kept = []
    with PrefetchClient(cfg, device="cpu", transfer=copies, prefetch=prefetch, timeout=60) as c:
        assert c.pin_memory
        for e in (0, 1):
            for b, (x, y) in enumerate(c):
                assert (c.last_batch.epoch, c.last_batch.batch) == (e, b)
                assert _same(x, y, ref[(0, e, b)]), f"epoch {e} batch {b} arrived with another batch's bytes"
                assert x.is_contiguous(memory_format=torch.channels_last) and y.dtype == torch.int64
                kept.append(((0, e, b), x, y))
        assert copies.blocks <= prefetch + 1  # buffers are reused, not made per batch
        assert copies.waits == 16
        pool = c._pool
    assert pool._free == [] and copies.done == len(copies.queued)  # closed: every copy done, no buffer kept
    for key, x, y in kept:  # held across the whole run, still as they were
        assert _same(x, y, ref[key]), f"{key} changed after it was yielded"
    assert d.stop() == 0


def test_pinned_cpu_tensors_without_a_device_are_fresh_per_batch(tmp_path, image_root, daemon_factory):
    cfg = small_config(tmp_path, image_root, loader={"epochs": 1})
    d = daemon_factory(cfg)
    ref, _ = reference_batches(cfg, epochs=1)
    copies = DeferredCopies()
    with PrefetchClient(cfg, pin_memory=True, transfer=copies, prefetch=2, timeout=60) as c:
        assert c.pin_memory and c.device is None
        kept = [(b, x, y) for b, (x, y) in enumerate(c)]
    assert len(kept) == 8 and copies.blocks == 8
    for b, x, y in kept:
        assert _same(x, y, ref[(0, 0, b)]), f"batch {b} changed after it was yielded"
    assert d.stop() == 0


@pytest.mark.parametrize("as_numpy", [True, False])
def test_numpy_arrays_and_cpu_tensors_kept_by_the_trainer_stay_as_yielded(tmp_path, image_root, daemon_factory,
                                                                            as_numpy):
    cfg = small_config(tmp_path, image_root, loader={"epochs": 1})
    d = daemon_factory(cfg)
    ref, _ = reference_batches(cfg, epochs=1)
    with PrefetchClient(cfg, as_numpy=as_numpy, prefetch=4, timeout=60) as c:
        kept = [(b, x, y) for b, (x, y) in enumerate(c)]
    for b, x, y in kept:
        x = x.transpose(0, 2, 3, 1) if as_numpy else x.permute(0, 2, 3, 1).numpy()
        assert np.array_equal(x, ref[(0, 0, b)][0]) and np.array_equal(np.asarray(y), ref[(0, 0, b)][1])
    assert d.stop() == 0


class EagerCopies(DeferredCopies):
    """Copies run as they are queued (the data is there for work queued after them on the "side
    stream", such as normalize, which the stand-in cannot defer); events and waits as above."""

    def to_device(self, tensor: torch.Tensor, device) -> torch.Tensor:
        dst = super().to_device(tensor, device)
        self.run(len(self.queued))
        return dst


@pytest.mark.parametrize("normalize", [False, True])
def test_pageable_device_batches_are_waited_for_like_pinned_ones(tmp_path, image_root, daemon_factory, normalize):
    # pin_memory=False with a device: the copy (and normalize) still run on the side stream, so
    # the trainer's stream must wait on an event and mark every output (record_stream)
    cfg = small_config(tmp_path, image_root, loader={"epochs": 1})
    d = daemon_factory(cfg)
    ref, _ = reference_batches(cfg, epochs=1)
    copies = EagerCopies() if normalize else DeferredCopies(seed=3)
    kept = []
    with PrefetchClient(cfg, device="cpu", transfer=copies, pin_memory=False, normalize=normalize,
                        prefetch=2, timeout=60) as c:
        assert not c.pin_memory
        for b, (x, y) in enumerate(c):
            assert copies.waited and copies.waited[-1][0] is x and copies.waited[-1][1] is y
            kept.append((b, x, y))
    assert copies.waits == 8 and copies.blocks == 0  # no pinned buffer was made
    for b, x, y in kept:
        want = ref[(0, 0, b)][0].transpose(0, 3, 1, 2)
        if normalize:
            assert x.dtype == torch.float32 and np.allclose(x.numpy(), _normalize_numpy(want), atol=1e-5)
        else:
            assert np.array_equal(x.numpy(), want)
        assert np.array_equal(y.numpy(), ref[(0, 0, b)][1])
    assert d.stop() == 0


def test_a_stop_between_parse_and_report_gives_the_pinned_buffer_back(tmp_path, image_root, daemon_factory):
    # a seek() or break landing after the reader parsed a batch but before it reported it: the
    # buffer must go back to the pool, or after prefetch + 1 of them every acquire times out
    cfg = small_config(tmp_path, image_root, loader={"epochs": 1})
    d = daemon_factory(cfg)
    ref, _ = reference_batches(cfg, epochs=1)
    prefetch = 2
    copies = DeferredCopies(seed=5)
    with PrefetchClient(cfg, device="cpu", transfer=copies, prefetch=prefetch, timeout=5) as c:
        write = c._write_progress
        stops = []

        def stop_at_report(epoch, batch, reader=None, **kw):
            if reader is not None and len(stops) < prefetch + 2:
                stops.append((epoch, batch))
                reader.set()  # as seek() from the trainer's thread would, just here
            return write(epoch, batch, reader=reader, **kw)

        c._write_progress = stop_at_report
        for _ in range(prefetch + 2):
            with pytest.raises(PrefetchError, match="this iteration was ended"):
                next(iter(c))
        assert len(stops) == prefetch + 2
        got = [(b, x, y) for b, (x, y) in enumerate(c)]
        assert len(got) == 8 and all(_same(x, y, ref[(0, 0, b)]) for b, x, y in got)
        assert copies.blocks <= prefetch + 1
    assert d.stop() == 0
