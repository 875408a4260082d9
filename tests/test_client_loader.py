"""The client as a DataLoader user expects it: epochs by `for`, set_epoch, len, a StatefulDataLoader-shaped
state, normalisation; and its reader thread: errors in the trainer's thread, nothing left behind."""

from __future__ import annotations

import _thread
import gc
import json
import os
import signal
import threading
import time

import numpy as np
import pytest
import torch
from conftest import small_config, wait_until
from prefetchd_client import PrefetchClient, PrefetchError, PrefetchTimeout, normalize
from test_daemon import published, reference_batches

from prefetchd.format import batchfile, progress


def _readers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("prefetchd-reader")]


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _opened_since(before: set[str]) -> dict[str, str]:
    out = {}
    for fd in _fds() - before:
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass  # the listing's own descriptor, closed by now
    return out


def test_for_runs_one_epoch_then_the_next_like_a_dataloader(tmp_path, image_root, daemon_factory):
    cfg = small_config(tmp_path, image_root)
    d = daemon_factory(cfg)
    ref, _ = reference_batches(cfg)
    with PrefetchClient(cfg, timeout=60, as_numpy=True) as loader:
        assert (loader.batch_size, loader.drop_last, loader.world_size, loader.rank) == (6, True, 1, 0)
        assert len(loader) == 8
        for epoch in range(2):
            loader.set_epoch(epoch)  # the habit: same epoch as the position, so nothing moves
            seen = [(loader.last_batch.epoch, loader.last_batch.batch, x.copy()) for x, _ in loader]
            assert [(e, b) for e, b, _ in seen] == [(epoch, b) for b in range(8)]
            assert all(np.array_equal(x.transpose(0, 2, 3, 1), ref[(0, epoch, b)][0]) for _, b, x in seen)
            assert (loader.epoch, loader.batch) == (epoch + 1, 0)
        with pytest.raises(PrefetchError, match="past loader.epochs"):
            next(iter(loader))
        assert d.stop() == 0
        t0 = time.monotonic()
        assert len(loader) == 8 and time.monotonic() - t0 < 0.5  # known once: never waits again


def test_set_epoch_to_another_epoch_starts_it_at_batch_zero(tmp_path, image_root, daemon_factory):
    cfg = small_config(tmp_path, image_root)
    d = daemon_factory(cfg)
    with PrefetchClient(cfg, timeout=60, as_numpy=True) as loader:
        it = iter(loader)
        for _ in range(3):
            next(it)
        del it
        loader.set_epoch(0)  # the current epoch: a resume keeps its place
        assert (loader.epoch, loader.batch) == (0, 3)
        assert next(iter(loader)) is not None and loader.last_batch.batch == 3
        loader.set_epoch(1)
        assert (loader.epoch, loader.batch) == (1, 0)
        next(iter(loader))
        assert (loader.last_batch.epoch, loader.last_batch.batch) == (1, 0)
    assert d.stop() == 0


def test_state_dict_is_the_trainers_position_not_the_readers(tmp_path, image_root, daemon_factory):
    cfg = small_config(tmp_path, image_root)
    d = daemon_factory(cfg)
    with PrefetchClient(cfg, timeout=60, as_numpy=True, prefetch=3) as loader:
        it = iter(loader)
        next(it)
        # the reader has read ahead (and told the daemon), the trainer has one batch
        wait_until(lambda: progress.read(progress.progress_path(loader.progress_dir, 0)).batch >= 4, 20,
                   "the reader to run ahead")
        sd = loader.state_dict()
        assert (sd["epoch"], sd["batch"], sd["_num_yielded"], sd["_sampler_iter_state"]) == (0, 1, 1, {"epoch": 0, "batch": 1})
        assert (sd["rank"], sd["world_size"], sd["fingerprint"]) == (0, 1, loader.meta()["fingerprint"])
        json.dumps(sd)  # a checkpoint can hold it as it is
        del it
    assert d.stop() == 0


def test_resume_from_state_dict_continues_the_stream_byte_for_byte(tmp_path, image_root, daemon_factory):
    cfg = small_config(tmp_path, image_root)
    d = daemon_factory(cfg)
    ref, _ = reference_batches(cfg)
    with PrefetchClient(cfg, timeout=60, as_numpy=True) as loader:
        it = iter(loader)
        for _ in range(5):
            next(it)
        state = json.loads(json.dumps(loader.state_dict()))
        del it
    with PrefetchClient(cfg, timeout=60, as_numpy=True) as loader:
        loader.load_state_dict(state)
        rest = [(loader.last_batch.epoch, loader.last_batch.batch, x.copy()) for x, _ in loader]
        rest += [(loader.last_batch.epoch, loader.last_batch.batch, x.copy()) for x, _ in loader]
    assert [(e, b) for e, b, _ in rest] == [(0, b) for b in range(5, 8)] + [(1, b) for b in range(8)]
    assert all(np.array_equal(x.transpose(0, 2, 3, 1), ref[(0, e, b)][0]) for e, b, x in rest)
    assert d.stop() == 0


def test_load_state_dict_takes_any_ranks_state_refuses_another_stream_and_takes_old_dicts(
        tmp_path, image_root, daemon_factory):
    cfg = small_config(tmp_path, image_root)
    d = daemon_factory(cfg)
    with PrefetchClient(cfg, timeout=60, as_numpy=True) as loader:
        good = loader.state_dict() | {"fingerprint": loader.meta()["fingerprint"]}
        loader.load_state_dict(good | {"rank": 1})  # any rank's state of the job: they step in lock-step
        # another world size resumes by samples (tests/test_resume.py); a state that cannot say
        # which samples it read (an older prefetchd's) is refused
        with pytest.raises(PrefetchError, match="world_size 4, batch_size 6 and does not say what its samples were"):
            loader.load_state_dict(good | {"world_size": 4, "sample_fingerprint": None})
        with pytest.raises(PrefetchError, match="is for stream 0123abcd.*changed"):
            loader.load_state_dict(good | {"fingerprint": "0123abcd"})
        with pytest.raises(PrefetchError, match="not a prefetchd loader state"):
            loader.load_state_dict({"model": 1})
        with pytest.raises(PrefetchError, match="batch must be a non-negative integer, got 'x'"):
            loader.load_state_dict({"epoch": 0, "batch": "x"})
        with pytest.raises(PrefetchError, match="names no stream .* allow_unverified=True"):
            loader.load_state_dict({"epoch": 1, "batch": 2, "rank": 0, "fingerprint": None})
        # the old shape, its position taken on the caller's word
        loader.load_state_dict({"epoch": 1, "batch": 2, "rank": 0, "fingerprint": None}, allow_unverified=True)
        assert (loader.epoch, loader.batch) == (1, 2)
        next(iter(loader))
        assert (loader.last_batch.epoch, loader.last_batch.batch) == (1, 2)
    assert d.stop() == 0


def test_seek_before_the_daemon_made_its_directories_waits_for_it(tmp_path, image_root, daemon_factory):
    cfg = small_config(tmp_path, image_root)
    assert not (tmp_path / "buffer").exists()
    timer = threading.Timer(1.0, daemon_factory, args=(cfg,))
    timer.start()
    try:
        with PrefetchClient(cfg, timeout=60, as_numpy=True) as loader:
            # a position without a stream, daemon starting too
            loader.load_state_dict({"epoch": 1, "batch": 6, "rank": 0}, allow_unverified=True)
            got = [loader.last_batch.batch for _ in loader]
    finally:
        timer.join()
    assert got == [6, 7]


def test_seek_without_a_daemon_times_out_saying_so(tmp_path, image_root):
    with PrefetchClient(small_config(tmp_path, image_root), timeout=0.5) as loader:
        t0 = time.monotonic()
        with pytest.raises(PrefetchTimeout, match="progress directory .* to appear; no daemon holds"):
            loader.seek(0, 3)
        assert time.monotonic() - t0 < 5


def test_normalize_true_yields_model_ready_floats(tmp_path, image_root, daemon_factory):
    cfg = small_config(tmp_path, image_root, loader={"epochs": 1})
    d = daemon_factory(cfg)
    ref, _ = reference_batches(cfg, epochs=1)
    with PrefetchClient(cfg, timeout=60, normalize=True, dtype=torch.bfloat16) as loader:
        for b, (x, y) in enumerate(loader):
            assert x.dtype == torch.bfloat16 and x.is_contiguous(memory_format=torch.channels_last)
            want = normalize(torch.from_numpy(ref[(0, 0, b)][0]).permute(0, 3, 1, 2), dtype=torch.bfloat16)
            assert torch.equal(x, want) and y.dtype == torch.int64
    with PrefetchClient(cfg, timeout=60, as_numpy=True, normalize=True) as loader:
        x, _ = next(iter(loader))
        assert x.dtype == np.float32 and np.allclose(x, normalize(ref[(0, 0, 0)][0].transpose(0, 3, 1, 2)))
    with pytest.raises(ValueError, match="normalize=True"):
        PrefetchClient(cfg, dtype=torch.float16)
    # timm resolves mean and std per model (0.5, 0.5 for many): the loader takes them
    half = (0.5, 0.5, 0.5)
    for as_numpy in (True, False):
        with PrefetchClient(cfg, timeout=60, as_numpy=as_numpy, normalize=True, mean=half, std=half) as loader:
            x, _ = next(iter(loader))
            raw = ref[(0, 0, 0)][0].transpose(0, 3, 1, 2).astype(np.float32)
            assert np.allclose(np.asarray(x), raw / 127.5 - 1.0, atol=1e-6)
    assert d.stop() == 0


@pytest.mark.parametrize("kwargs, match", [
    ({"mean": (0.5, 0.5, 0.5)}, "pass normalize=True with them"),
    ({"normalize": True, "std": (0.5, 0.0, 0.5)}, "std= must be 3 positive numbers"),
    ({"normalize": True, "mean": (0.5, 0.5)}, "mean= must be 3 numbers"),
    ({"normalize": True, "mean": "abc"}, "mean= must be 3 numbers"),
    # mmcv's and detectron2's 0..255 constants: accepted before, every image came out near -2.1
    ({"normalize": True, "mean": (123.675, 116.28, 103.53), "std": (58.395, 57.12, 57.375)},
     r"mean= is in units of x / 255 .* divide it by 255"),
    ({"normalize": True, "std": (58.395, 57.12, 57.375)}, r"std= is in units of x / 255"),
    ({"batch_size": 32}, "batch_size=32 was asked for, but the daemon makes batches of 6 .loader.batch_size in "),
])
def test_dataloader_arguments_that_cannot_hold_are_one_line_errors(tmp_path, image_root, kwargs, match):
    cfg = small_config(tmp_path, image_root)
    with pytest.raises(ValueError, match=match) as e:
        PrefetchClient(cfg, **kwargs)
    assert "\n" not in str(e.value)
    PrefetchClient(cfg, batch_size=6).close()  # the config's own size is fine


def test_sampler_and_batch_sampler_are_shaped_as_a_dataloaders(tmp_path, image_root, daemon_factory):
    """Code written for DistributedSampler: hasattr(loader.sampler, "set_epoch") holds and moving
    it moves the loader; len() of sampler and batch_sampler as a DataLoader's."""
    cfg = small_config(tmp_path, image_root, loader={"epochs": 3, "world_size": 2, "ranks": [0, 1]})
    d = daemon_factory(cfg)
    ref, _ = reference_batches(cfg, epochs=3)
    with PrefetchClient(cfg, rank=1, timeout=60, as_numpy=True) as loader:
        s = loader.sampler
        assert hasattr(s, "set_epoch") and len(s) == 24 and (s.num_replicas, s.rank, s.shuffle) == (2, 1, True)
        s.set_epoch(2)
        assert loader.epoch == 2 and s.epoch == 2
        got = [(loader.last_batch.epoch, loader.last_batch.batch, y.copy()) for _, y in loader]
        assert [(e, b) for e, b, _ in got] == [(2, b) for b in range(4)]
        assert all(np.array_equal(y, ref[(1, 2, b)][1]) for _, b, y in got)
        bs = loader.batch_sampler
        assert (len(bs), bs.batch_size, bs.drop_last, len(bs.sampler)) == (len(loader), 6, loader.drop_last, 24)
    assert d.stop() == 0


def test_a_readers_error_is_raised_in_the_trainers_thread_when_it_gets_there(tmp_path, image_root, daemon_factory):
    cfg = small_config(tmp_path, image_root)
    buf = tmp_path / "buffer"
    d = daemon_factory(cfg)
    wait_until(lambda: len(published(str(buf))) == 4, 30, "a full buffer")
    os.killpg(d.pid, signal.SIGSTOP)  # nobody replaces what we spoil
    try:
        victim = buf / batchfile.batch_name(0, 0, 2)
        data = bytearray(victim.read_bytes())
        data[-1] ^= 0xFF
        tmp = buf / "spoilt"
        tmp.write_bytes(bytes(data))
        os.replace(tmp, victim)
        before = _fds()
        with PrefetchClient(cfg, timeout=5, as_numpy=True, prefetch=4) as loader:
            it = iter(loader)
            next(it)
            next(it)  # the reader found batch 2 spoilt long ago; the trainer hears of it now
            assert loader.state_dict()["batch"] == 2
            with pytest.raises(PrefetchError, match=f"{victim}: checksum mismatch"):
                next(it)
        assert _readers() == [] and _opened_since(before) == {}
    finally:
        os.killpg(d.pid, signal.SIGCONT)
    assert d.stop() == 0


def test_break_close_garbage_collection_and_ctrl_c_leave_no_thread_or_fd(tmp_path, image_root, daemon_factory):
    cfg = small_config(tmp_path, image_root, loader={"epochs": None})
    d = daemon_factory(cfg)
    with PrefetchClient(cfg, timeout=60, as_numpy=True) as warm:  # meta, imports: what stays open anyway
        next(iter(warm))
    before = _fds()
    loader = PrefetchClient(cfg, timeout=60, as_numpy=True)
    for _ in loader:
        assert len(_readers()) == 1
        break  # the for loop drops its iterator: the reader stops
    wait_until(lambda: _readers() == [], 10, "the reader to stop after break")
    it = iter(loader)
    next(it)
    loader.close()  # with an iterator still held
    assert _readers() == [] and _opened_since(before) == {}
    with pytest.raises(PrefetchError, match="ended by"):
        next(it)
    del it
    loader = PrefetchClient(cfg, timeout=60, as_numpy=True)
    it = iter(loader)
    next(it)
    del loader, it  # no close(): garbage collection does it
    gc.collect()
    wait_until(lambda: _readers() == [], 10, "the reader to stop after garbage collection")
    assert _opened_since(before) == {}
    # Ctrl-C while the trainer waits for a batch that does not come (SIGINT handled as Python does
    # by default, also where the suite was started as a background job, which ignores it)
    old_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    os.killpg(d.pid, signal.SIGSTOP)
    try:
        with PrefetchClient(cfg, timeout=30, as_numpy=True) as loader:
            loader.seek(50, 0)
            threading.Timer(0.5, _thread.interrupt_main).start()
            with pytest.raises(KeyboardInterrupt):
                for _ in loader:
                    pass
        assert _readers() == [] and _opened_since(before) == {}
    finally:
        os.killpg(d.pid, signal.SIGCONT)
        signal.signal(signal.SIGINT, old_int)
    assert d.stop() == 0
