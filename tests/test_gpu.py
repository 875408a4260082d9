"""The client's CUDA path: pinned buffers, side-stream copies, events, on full-size batches
(256 x 224 x 224). Runs where a GPU is present (this project's CI machines have none: there these
tests are reported as skipped, not passed). The same multi-buffer logic runs everywhere in
test_client_memory.py against a stand-in for pinned memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import small_config, wait_until
from prefetchd_client import PrefetchClient, normalize
from prefetchd_client.memory import CudaTransfer
from test_daemon import published
from test_hybrid_daemon import mixed_root  # noqa: F401 - a fixture

from prefetchd.format import batchfile
from prefetchd.tools.samples import make_image_folder

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
EPOCHS, PER_EPOCH = 2, 3
BATCHES = EPOCHS * PER_EPOCH


@pytest.fixture(scope="module")
def big_root(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("big"))
    make_image_folder(root, classes=4, per_class=200, seed=5, long_side=160)  # 800 images: 3 batches of 256 an epoch
    return root


def _full_ring(tmp_path, root, daemon_factory):
    """A daemon making 256 x 224 x 224 batches with the first BATCHES of them published; and those
    files' own bytes, read before the client takes them."""
    cfg = small_config(tmp_path, root, loader={"batch_size": 256, "epochs": None, "drop_last": True},
                       workers={"count": 4}, augment={"output_size": 224, "scale_min": 224, "scale_max": 256},
                       buffer={"capacity": BATCHES, "refill_at": BATCHES, "max_bytes": "1GiB"})
    d = daemon_factory(cfg)
    buf = str(tmp_path / "buffer")
    wait_until(lambda: len(published(buf)) >= BATCHES, 300, "a full ring of 256-image batches")
    files = {}
    for e in range(EPOCHS):
        for i in range(PER_EPOCH):
            b = batchfile.read_file(f"{buf}/{batchfile.batch_name(0, e, i)}")
            assert b.images.shape == (256, 224, 224, 3)
            files[(e, i)] = (b.images.copy(), b.labels.copy())
    return cfg, d, files


def _busy_gpu(pinned_src: torch.Tensor, other: torch.cuda.Stream, a: torch.Tensor) -> torch.Tensor:
    """Queue another host-to-device copy on another stream and work on the trainer's stream, so
    the client's copies wait behind them."""
    with torch.cuda.stream(other):
        dst = pinned_src.to("cuda", non_blocking=True)
    for _ in range(4):
        a = a @ a
        a = a / a.norm()
    return dst


@needs_cuda
def test_full_size_batches_arrive_on_the_gpu_as_the_files_hold_them_with_other_copies_queued(
        tmp_path, big_root, daemon_factory):
    cfg, d, files = _full_ring(tmp_path, big_root, daemon_factory)
    other = torch.cuda.Stream()
    pinned_src = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    a = torch.randn(4096, 4096, device="cuda")
    kept = []
    with PrefetchClient(cfg, device="cuda", timeout=120, prefetch=2) as c:
        for e in range(EPOCHS):
            for i, (x, y) in enumerate(c.iter_epoch(e)):
                _check(files[(e, i)], x, y)
                kept.append(((e, i), x, y))
                _busy_gpu(pinned_src, other, a)  # before the next batch's copy is waited for
        assert c.pin_memory and all(t.is_pinned() for t, _ in c._pool._free)
    torch.cuda.synchronize()
    for key, x, _y in kept:  # held across the run: never written again
        assert torch.equal(x.permute(0, 2, 3, 1).cpu(), torch.from_numpy(files[key][0])), f"{key} changed"
    assert d.stop() == 0


def _check(file, x, y) -> None:
    assert x.is_cuda and y.is_cuda and x.dtype == torch.uint8 and y.dtype == torch.int64
    assert x.is_contiguous(memory_format=torch.channels_last)
    x2 = x * 1  # work on the trainer's stream, while the next copies run on the side stream
    assert torch.equal(x2.permute(0, 2, 3, 1).cpu(), torch.from_numpy(file[0])), "bytes differ from the file's"
    assert torch.equal(y.cpu(), torch.from_numpy(file[1]))


@needs_cuda
def test_normalize_makes_no_host_sync_and_normalize_true_matches_it(tmp_path, big_root, daemon_factory):
    cfg, d, files = _full_ring(tmp_path, big_root, daemon_factory)
    with PrefetchClient(cfg, device="cuda", timeout=120, normalize=True, dtype=torch.bfloat16) as c:
        got = list(c.iter_epoch(0))
    torch.cuda.synchronize()
    x = torch.from_numpy(files[(0, 0)][0]).permute(0, 3, 1, 2).cuda()
    s = torch.cuda.Stream()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.stream(s):  # a stream never seen: the constants are made under the check
            out = normalize(x, dtype=torch.float16)
            out = normalize(x, dtype=torch.bfloat16)
        out2 = normalize(x, dtype=torch.bfloat16)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.equal(out, out2) and out.is_contiguous(memory_format=torch.channels_last)
    assert got[0][0].dtype == torch.bfloat16 and torch.equal(got[0][0], out2)
    assert d.stop() == 0


@needs_cuda
def test_pin_memory_without_a_device_yields_fresh_pinned_cpu_tensors(tmp_path, big_root, daemon_factory):
    cfg, d, files = _full_ring(tmp_path, big_root, daemon_factory)
    with PrefetchClient(cfg, pin_memory=True, timeout=120) as c:
        kept = list(c.iter_epoch(0))
    for i, (x, y) in enumerate(kept):
        assert x.is_pinned() and y.is_pinned() and not x.is_cuda
        assert np.array_equal(x.permute(0, 2, 3, 1).numpy(), files[(0, i)][0]), f"batch {i} changed after it was yielded"
    assert d.stop() == 0


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_the_device_is_the_current_one_at_first_use_not_at_construction(tmp_path, big_root, daemon_factory):
    cfg, d, files = _full_ring(tmp_path, big_root, daemon_factory)
    torch.cuda.set_device(0)
    c = PrefetchClient(cfg, device="cuda", timeout=120)
    torch.cuda.set_device(1)  # as a torchrun script does after building its loader
    try:
        x, _ = next(iter(c.iter_epoch(0)))
        assert x.device == torch.device("cuda", 1) and c.device == torch.device("cuda", 1)
        assert torch.equal(x.permute(0, 2, 3, 1).cpu(), torch.from_numpy(files[(0, 0)][0]))
    finally:
        c.close()
        torch.cuda.set_device(0)
    assert d.stop() == 0


def _sums(images: torch.Tensor) -> torch.Tensor:
    """Per image, per channel and row: the sums of its bytes (any swapped or unwritten part shows)."""
    return images.sum(dim=-1, dtype=torch.int64)


@needs_cuda
def test_batches_dropped_at_once_so_the_allocator_reuses_their_memory_still_arrive_whole(
        tmp_path, big_root, daemon_factory):
    # the trainer keeps only checksums (computed on its stream): each batch's device memory is
    # freed and handed to the next copies, which record_stream and the event must order correctly
    cfg, d, files = _full_ring(tmp_path, big_root, daemon_factory)
    other = torch.cuda.Stream()
    pinned_src = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    a = torch.randn(4096, 4096, device="cuda")
    got = {}
    for pin in (True, False):
        with PrefetchClient(cfg, device="cuda", timeout=120, prefetch=2, pin_memory=pin) as c:
            c.seek(0, 0)
            for e in range(EPOCHS):
                for i, (x, y) in enumerate(c.iter_epoch(e)):
                    got[(pin, e, i)] = (_sums(x), y.sum())  # queued on the trainer's stream; x, y dropped
                    del x, y
                    _busy_gpu(pinned_src, other, a)
    torch.cuda.synchronize()
    for (pin, e, i), (sums, ysum) in got.items():
        want = _sums(torch.from_numpy(files[(e, i)][0]).permute(0, 3, 1, 2))
        assert torch.equal(sums.cpu(), want), f"pin_memory={pin} epoch {e} batch {i} differs from its file"
        assert int(ysum) == int(files[(e, i)][1].sum())
    assert d.stop() == 0


@needs_cuda
def test_pageable_device_batches_with_normalize_are_waited_for(tmp_path, big_root, daemon_factory):
    # pin_memory=False: the copy and normalize still run on the side stream; the trainer's stream
    # waits on their event (test_client_memory.py checks the same with the stand-in)
    cfg, d, files = _full_ring(tmp_path, big_root, daemon_factory)
    other = torch.cuda.Stream()
    pinned_src = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    a = torch.randn(4096, 4096, device="cuda")
    got = {}
    with PrefetchClient(cfg, device="cuda", timeout=120, prefetch=2, pin_memory=False, normalize=True) as c:
        assert not c.pin_memory
        for i, (x, y) in enumerate(c.iter_epoch(0)):
            assert x.is_cuda and y.is_cuda and x.dtype == torch.float32
            got[i] = (x * 1, y * 1)  # work on the trainer's stream, as a model would do
            del x, y
            _busy_gpu(pinned_src, other, a)
    torch.cuda.synchronize()
    for i, (x, y) in got.items():
        want = normalize(torch.from_numpy(files[(0, i)][0]).permute(0, 3, 1, 2).cuda())
        assert torch.equal(x, want), f"batch {i} differs from normalize() of its file"
        assert torch.equal(y.cpu(), torch.from_numpy(files[(0, i)][1]))
    assert d.stop() == 0


# --- the synchronisation, with the side stream delayed on purpose -------------------------------------
#
# Each test below fails if one of the three orderings is removed: the trainer's stream waiting on
# the copy's event (``wait_event``), the batch's memory marked as used on the trainer's stream
# (``record_stream``), and a pinned buffer going back to the pool only once its copy is done (the
# release event). The side stream sleeps before every copy, so without the ordering the trainer
# (or the reader) runs ahead of the copy; values are taken on the trainer's stream right after
# next(), with no synchronisation in between.

_SLEEP_CYCLES = 50_000_000  # about 25-50 ms of GPU clock


class SlowSideStream(CudaTransfer):
    """The client's CUDA transfer, with the side stream held up before each copy."""

    def to_device(self, tensor, device):
        torch.cuda._sleep(_SLEEP_CYCLES)  # on the current stream: the reader's side stream
        return super().to_device(tensor, device)

    def copy_(self, dst, src):
        torch.cuda._sleep(_SLEEP_CYCLES)
        return super().copy_(dst, src)


@needs_cuda
def test_values_taken_right_after_next_with_a_slow_side_stream_are_the_files(tmp_path, big_root, daemon_factory):
    # without wait_event the trainer's clone runs before the delayed copy has written the batch
    cfg, d, files = _full_ring(tmp_path, big_root, daemon_factory)
    snaps = {}
    with PrefetchClient(cfg, device="cuda", timeout=120, prefetch=2, transfer=SlowSideStream()) as c:
        for e in range(EPOCHS):
            for i, (x, y) in enumerate(c.iter_epoch(e)):
                snaps[(e, i)] = (x.clone(), y.clone())  # queued on the trainer's stream at once; no sync
                del x, y
    torch.cuda.synchronize()
    for key, (x, y) in snaps.items():
        assert torch.equal(x.permute(0, 2, 3, 1).cpu(), torch.from_numpy(files[key][0])), f"{key} read before its copy"
        assert torch.equal(y.cpu(), torch.from_numpy(files[key][1])), key
    assert d.stop() == 0


@needs_cuda
def test_a_slow_trainer_dropping_each_batch_at_once_still_reads_it_whole(tmp_path, big_root, daemon_factory):
    # the trainer's stream sleeps before it reads each batch, and drops the batch at once: without
    # record_stream the allocator hands its memory to the next copy on the side stream, which
    # overwrites it before the trainer's stream has read it
    cfg, d, files = _full_ring(tmp_path, big_root, daemon_factory)
    got = {}
    with PrefetchClient(cfg, device="cuda", timeout=120, prefetch=2) as c:
        for e in range(EPOCHS):
            for i, (x, y) in enumerate(c.iter_epoch(e)):
                torch.cuda._sleep(4 * _SLEEP_CYCLES)  # on the trainer's stream
                got[(e, i)] = (_sums(x), y.sum())
                del x, y
    torch.cuda.synchronize()
    for key, (sums, ysum) in got.items():
        assert torch.equal(sums.cpu(), _sums(torch.from_numpy(files[key][0]).permute(0, 3, 1, 2))), key
        assert int(ysum) == int(files[key][1].sum())
    assert d.stop() == 0


@needs_cuda
def test_a_pinned_buffer_is_not_refilled_while_its_slow_copy_is_pending(tmp_path, big_root, daemon_factory):
    # the copies lag far behind the reader: without the release event a buffer would be handed out
    # again, and the next file read into it, before the GPU had copied the batch out of it
    cfg, d, files = _full_ring(tmp_path, big_root, daemon_factory)
    kept = {}
    with PrefetchClient(cfg, device="cuda", timeout=120, prefetch=3, transfer=SlowSideStream()) as c:
        for e in range(EPOCHS):
            for i, (x, y) in enumerate(c.iter_epoch(e)):
                kept[(e, i)] = (x, y)
        assert c._pool.peak <= 4
    torch.cuda.synchronize()
    for key, (x, _y) in kept.items():
        assert torch.equal(x.permute(0, 2, 3, 1).cpu(), torch.from_numpy(files[key][0])), f"{key} has another file's bytes"
    assert d.stop() == 0


# --- hybrid decode, the client's whole path on the GPU ---------------------------------------------------


def _has_nvimgcodec() -> bool:
    try:
        from nvidia import nvimgcodec  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(not _has_nvimgcodec(), reason="needs CUDA and nvImageCodec (pip install 'prefetchd[gpu]')")
def test_hybrid_decode_through_the_client_on_the_gpu_matches_the_cpu_path(tmp_path, mixed_root, daemon_factory):  # noqa: F811
    """The real thing: the daemon with augment.decode: gpu, the client with its default decoder
    (nvImageCodec) on the reader thread, the side stream (held up before each copy), the pinned
    pool and the event; values taken right after next(). Against the CPU stand-in's pixels
    within test_hybrid's tolerances, labels exact, and no sample fell back to the CPU."""
    from test_hybrid_daemon import MEAN_TOL, P99_TOL, _config, _reference

    cfg = _config(tmp_path, mixed_root, "gpu", "gpu")
    d = daemon_factory(cfg)
    ref = _reference(cfg)
    snaps = {}
    with PrefetchClient(cfg, device="cuda", timeout=120, prefetch=2, transfer=SlowSideStream()) as c:
        for e in (0, 1):
            for b, (x, y) in enumerate(c.iter_epoch(e)):
                assert x.is_cuda and x.is_contiguous(memory_format=torch.channels_last) and y.dtype == torch.int64
                snaps[(e, b)] = (x.clone(), y.clone())
                del x, y
        stage = c._stage
        assert stage.batches == len(snaps) and stage.fallbacks == 0, (stage.fallbacks, stage.batches)
        assert stage.host_s / stage.batches < 1.0  # host time per batch (a loose bound: the report says it)
    torch.cuda.synchronize()
    assert sorted(snaps) == sorted(ref)
    for key, (x, y) in snaps.items():
        assert torch.equal(y.cpu(), torch.from_numpy(ref[key][1])), key
        got = x.permute(0, 2, 3, 1).cpu().numpy().astype(int)
        for k in range(len(got)):
            diff = np.abs(got[k] - ref[key][0][k].astype(int))
            assert diff.mean() < MEAN_TOL and np.percentile(diff, 99) <= P99_TOL, (key, k, diff.mean())
    assert d.stop() == 0


@pytest.mark.skipif(not _has_nvimgcodec(), reason="needs CUDA and nvImageCodec (pip install 'prefetchd[gpu]')")
def test_the_gpu_decoder_starts_in_a_trainer_that_imported_torchvision_first():
    """Seen on an H100 (torchvision 0.26): a trainer that imports torchvision before the client
    has torchvision's own copy of nvJPEG mapped under a hashed name, which nvImageCodec's back-end
    then uses; the start-up check took that for a missing back-end and refused hybrid and gpu
    decoding in every such trainer. In a fresh process, as a trainer starts."""
    import subprocess
    import sys

    pytest.importorskip("torchvision")
    code = ("import torch, torchvision\n"
            "from prefetchd_client.gpudecode import DecodeStage, nvjpeg_registered\n"
            "DecodeStage('cuda')\n"
            "print('registered', nvjpeg_registered())\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "registered True" in r.stdout, r.stderr[-2000:]
