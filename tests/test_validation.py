"""The validation stream with the real daemon: two ranks, every val sample exactly once per pass
with the train set's labels, nothing made before a trainer asks, identical passes, and a train
stream that validation leaves byte for byte unchanged."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import small_config, wait_until
from prefetchd_client import PrefetchClient, PrefetchError, PrefetchTimeout
from test_daemon import collect, reference_batches

from prefetchd.core.config import ConfigError
from prefetchd.core.config import load as load_config
from prefetchd.core.sampler import ValSampler
from prefetchd.executors.worker import BatchMaker, WorkerSetup
from prefetchd.format import batchfile, status
from prefetchd.sources.dataset import load_index, val_labels
from prefetchd.tools.samples import make_image_folder


@pytest.fixture(scope="module")
def val_root(tmp_path_factory) -> str:
    """17 val images in 3 of the train set's 4 class folders (n00000000 absent: the val set's own
    sorted mapping would differ from the train set's), so ranks get 9 and 8 samples."""
    root = str(tmp_path_factory.mktemp("valfolder"))
    make_image_folder(root, classes=4, per_class=6, seed=11, long_side=120)
    shutil.rmtree(os.path.join(root, "n00000000"))
    os.unlink(os.path.join(root, "n00000003", "img_00005.JPEG"))
    return root


def val_files(buffer_dir: str) -> list[str]:
    return sorted(n for n in os.listdir(buffer_dir) if n.startswith("v") and n.endswith(".batch"))


def read_pass(c: PrefetchClient) -> list:
    out = []
    for x, y in c:
        out.append((np.ascontiguousarray(x.transpose(0, 2, 3, 1)), y.copy(), c.last_batch.indices.copy()))
    return out


def val_reference(cfg_path: str, rank: int) -> list:
    """The rank's val batches made in-process (eval augmentation, train labels)."""
    cfg = load_config(cfg_path)
    train, _ = load_index(cfg.dataset.root, None, cfg.dataset.extensions, cfg.dataset.cache_dir)
    val, _ = load_index(cfg.validation.root, None, cfg.dataset.extensions, cfg.dataset.cache_dir)
    val = val_labels(val, train)
    from dataclasses import replace

    vcfg = replace(cfg, augment=cfg.val_augment(), loader=replace(cfg.loader, batch_size=cfg.validation.batch_size))
    maker = BatchMaker(WorkerSetup(vcfg, None, val, 0, cfg.buffer.dir))
    s = ValSampler(len(val), cfg.validation.batch_size, cfg.loader.world_size, cfg.validation.pad)
    out = []
    for b in range(s.batches(rank)):
        images, used, labels, _, _ = maker.fill(0, s.batch_indices(rank, b))
        out.append((images.copy(), labels.copy(), used.copy()))
    return out


def test_validation_stream_two_ranks(tmp_path, image_root, val_root, daemon_factory):
    cfg = small_config(tmp_path, image_root, loader={"world_size": 2, "ranks": [0, 1]},
                       validation={"enabled": True, "root": val_root, "batch_size": 4, "capacity": 2,
                                   "pad": False})
    buf = load_config(cfg).buffer.dir
    d = daemon_factory(cfg)
    # train is served at once; no val batch is made while no trainer iterates a val pass
    wait_until(lambda: (s := status.read_json(buf, status.STATUS_NAME)) and all(
        r["ahead"] >= 3 for r in s["ranks"].values()), 60, "both train windows filled")
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        assert val_files(buf) == [], "a val batch was made before any client asked"
        time.sleep(0.05)
    s = status.read_json(buf, status.STATUS_NAME)
    assert set(s["val_ranks"]) == {"0", "1"} and not any(v["active"] for v in s["val_ranks"].values())
    assert "rank 1 validation: idle (next pass 0)" in status.format_status(s, True)

    train_index, _ = load_index(image_root, None, (".jpeg", ".jpg", ".png"), str(tmp_path / "cache"))
    val_index, _ = load_index(val_root, None, (".jpeg", ".jpg", ".png"), str(tmp_path / "cache"))
    seen = []
    passes = {}
    for rank in (0, 1):
        with PrefetchClient(cfg, rank=rank, split="val", as_numpy=True, timeout=60) as c:
            assert c.batch_size == 4 and not c.drop_last
            # what pytorch/examples' validate() reads: no sample left out by a DistributedSampler-like pad
            assert len(c.dataset) == 17 and len(c.sampler) == 9 and not len(c.sampler) * 2 < len(c.dataset)
            assert len(c) == (3 if rank == 0 else 2)  # 9 and 8 samples: batch counts differ by one
            p0, p1 = read_pass(c), read_pass(c)
            assert c.epoch == 2  # the pass counter
        assert [len(y) for _, y, _ in p0] == ([4, 4, 1] if rank == 0 else [4, 4])  # last partial kept
        for (x0, y0, i0), (x1, y1, i1) in zip(p0, p1, strict=True):  # two passes, identical bytes
            assert np.array_equal(x0, x1) and np.array_equal(y0, y1) and np.array_equal(i0, i1)
        ref = val_reference(cfg, rank)
        for (x, y, i), (rx, ry, ri) in zip(p0, ref, strict=True):
            assert np.array_equal(x, rx) and np.array_equal(y, ry) and np.array_equal(i, ri)
        for _, y, idx in p0:
            for label, i in zip(y.tolist(), idx.tolist(), strict=True):
                folder = os.path.basename(os.path.dirname(val_index.path(i)))
                assert label == train_index.classes.index(folder)  # the TRAIN set's mapping
            seen += idx.tolist()
        passes[rank] = p0
    assert sorted(seen) == list(range(17))  # every val sample exactly once across the ranks
    # what the finished passes left is deleted, and nothing is made for the next pass
    wait_until(lambda: val_files(buf) == [], 20, "the finished passes' val batches deleted")

    # a pass abandoned early (break) is over: its batches go, the next `for` is a new pass
    with PrefetchClient(cfg, rank=0, split="val", as_numpy=True, timeout=60) as c:
        for _ in c:
            break
        assert c.epoch == 1
        wait_until(lambda: val_files(buf) == [], 20, "the abandoned pass's val batches deleted")
        again = read_pass(c)
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(again, passes[0], strict=True))

    # a train reader never takes a val file, nor the reverse: names, lanes and fingerprints differ
    with PrefetchClient(cfg, rank=0, split="val", as_numpy=True, timeout=60) as c:
        assert c._fingerprint() != c.meta()["fingerprint"]
        assert os.path.basename(c._path(0, 0)).startswith("v0000-")

    # the train stream is byte for byte what it is without validation
    got = {}
    for rank in (0, 1):
        got.update(collect(cfg, rank=rank))
    ref, _ = reference_batches(cfg)
    assert sorted(got) == sorted(ref)
    for key, (images, labels) in got.items():
        assert np.array_equal(images, ref[key][0]) and np.array_equal(labels, ref[key][1]), key
    assert d.stop() == 0


def test_split_val_needs_validation_enabled(tmp_path, image_root):
    cfg = small_config(tmp_path, image_root)
    with pytest.raises(ConfigError, match="validation.enabled"):
        PrefetchClient(cfg, split="val")
    with pytest.raises(ValueError, match="split"):
        PrefetchClient(cfg, split="test")


def test_val_class_missing_from_train_is_a_clear_error(tmp_path, image_root, val_root):
    train, _ = load_index(image_root, None, (".jpeg",), None)
    val, _ = load_index(val_root, None, (".jpeg",), None)
    assert val_labels(val, train).classes == train.classes
    odd = str(tmp_path / "odd")
    shutil.copytree(val_root, odd)
    os.rename(os.path.join(odd, "n00000001"), os.path.join(odd, "cats"))
    bad, _ = load_index(odd, None, (".jpeg",), None)
    with pytest.raises(ValueError, match=r"\['cats'\] are not in the train set"):
        val_labels(bad, train)


@pytest.mark.parametrize("cmd", ["check", "run"])
def test_val_class_folder_missing_from_train_exits_78_with_one_line(tmp_path, image_root, val_root, cmd):
    odd = str(tmp_path / "odd")
    shutil.copytree(val_root, odd)
    os.rename(os.path.join(odd, "n00000001"), os.path.join(odd, "cats"))
    cfg = small_config(tmp_path, image_root, validation={"enabled": True, "root": odd})
    r = subprocess.run([sys.executable, "-m", "prefetchd", cmd, "--config", cfg], capture_output=True, text=True,
                       timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 78 and "['cats'] are not in the train set's classes" in lines[-1], r.stderr


def test_cli_check_summarises_the_validation_stream(tmp_path, image_root, val_root):
    cfg = small_config(tmp_path, image_root, loader={"world_size": 2, "ranks": [0, 1]},
                       validation={"enabled": True, "root": val_root, "batch_size": 4})
    r = subprocess.run([sys.executable, "-m", "prefetchd", "check", "--config", cfg], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    val_name = os.path.basename(val_root.rstrip("/"))
    assert (f"validation: 17 samples ({val_name}, an ImageFolder); [3, 3] batches of up to 4 per pass for ranks "
            "[0, 1] (padded: 1 sample repeated, marked in BatchInfo.padding); eval resize 74") in r.stdout, r.stdout
    unpadded = small_config(tmp_path, image_root, loader={"world_size": 2, "ranks": [0, 1]},
                            validation={"enabled": True, "root": val_root, "batch_size": 4, "pad": False})
    r = subprocess.run([sys.executable, "-m", "prefetchd", "check", "--config", unpadded], capture_output=True,
                       text=True, timeout=120)
    assert ("[3, 2] batches of up to 4 per pass for ranks [0, 1] (each sample once (validation.pad: false): batch "
            "counts may differ); eval resize 74") in r.stdout, r.stdout
    assert f"; {os.path.basename(image_root.rstrip('/'))}, an ImageFolder" in r.stdout, r.stdout


_TRAIN_BATCH = batchfile.max_file_size(8, 32, 32)  # 28 KiB: issue 23's repro
_VAL_BATCH = batchfile.max_file_size(4, 32, 32)


def _full_train_config(tmp_path, image_root, val_root, ranks: int) -> tuple[str, int]:
    """Issue 23's repro: train windows of up to 6 batches of 28 KiB fill ``buffer.max_bytes``
    (6 batches at 1 rank, 12 at 3 ranks: fewer than ranks x capacity)."""
    max_bytes = (6 if ranks == 1 else 4 * ranks) * _TRAIN_BATCH
    cfg = small_config(tmp_path, image_root, loader={"world_size": ranks, "ranks": list(range(ranks)),
                                                     "batch_size": 8, "epochs": None},
                       augment={"output_size": 32, "scale_min": 36, "scale_max": 60},
                       buffer={"capacity": 6, "refill_at": 6, "max_bytes": max_bytes},
                       validation={"enabled": True, "root": val_root, "batch_size": 4, "capacity": 2,
                                   "pad": False})
    return cfg, max_bytes


class _Trainer(threading.Thread):
    """A train reader at a trainer's pace until stopped; what it read and what went wrong."""

    def __init__(self, cfg: str, rank: int):
        super().__init__(daemon=True)
        self.cfg, self.rank, self.read, self.error = cfg, rank, 0, None
        self.stop = threading.Event()

    def run(self):
        try:
            with PrefetchClient(self.cfg, rank=self.rank, as_numpy=True, timeout=60) as c:
                while not self.stop.is_set():
                    for _ in c:
                        self.read += 1
                        time.sleep(0.02)  # a step
                        if self.stop.is_set():
                            break
        except BaseException as e:
            self.error = e


def _val_passes(cfg: str, rank: int, passes: int, out: dict, step_s: float = 0.0) -> None:
    try:
        with PrefetchClient(cfg, rank=rank, split="val", as_numpy=True, timeout=60) as c:
            for _ in range(passes):
                got = []
                for _x, _y in c:
                    got += c.last_batch.indices.tolist()
                    time.sleep(step_s)
                out.setdefault(rank, []).append(got)
    except BaseException as e:
        out[("error", rank)] = e


@pytest.mark.parametrize("ranks", [1, 3])
def test_validation_makes_progress_when_train_windows_fill_max_bytes(tmp_path, image_root, val_root,
                                                                     daemon_factory, ranks):
    cfg, max_bytes = _full_train_config(tmp_path, image_root, val_root, ranks)
    buf = load_config(cfg).buffer.dir
    d = daemon_factory(cfg)
    wait_until(lambda: (s := status.read_json(buf, status.STATUS_NAME)) and s["train_bytes"] == max_bytes,
               60, "train's windows to fill max_bytes")
    trainers = [_Trainer(cfg, r) for r in range(ranks)]
    for t in trainers:
        t.start()
    wait_until(lambda: all(t.read >= 2 or t.error for t in trainers), 60, "the trainers reading")
    before = [t.read for t in trainers]
    out: dict = {}
    # each val batch held 1.2 s, longer than the daemon's status period (1 s): every pass is seen
    # in the status at least once, however few batches a rank's share has (one, at 3 ranks)
    vals = [threading.Thread(target=_val_passes, args=(cfg, r, 2, out, 1.2), daemon=True) for r in range(ranks)]
    samples = []
    for v in vals:
        v.start()
    deadline = time.monotonic() + 120
    while any(v.is_alive() for v in vals) and time.monotonic() < deadline:
        s = status.read_json(buf, status.STATUS_NAME)
        if s and any(v["active"] for v in s["val_ranks"].values()):
            samples.append(s)
        time.sleep(0.05)
    assert not any(v.is_alive() for v in vals), "the validation passes did not finish in 120 s"
    assert not [e for k, e in out.items() if isinstance(k, tuple)], out
    during = [t.read - b for t, b in zip(trainers, before, strict=True)]
    for t in trainers:
        t.stop.set()
    for t in trainers:
        t.join(30)
        assert t.error is None, t.error
    # every pass complete, every val sample exactly once per pass across the ranks
    for p in range(2):
        assert sorted(i for r in range(ranks) for i in out[r][p]) == list(range(17)), p
    # train kept reading meanwhile, from windows that gave up no more than validation's room
    assert all(n >= 2 for n in during), during
    assert samples, "no status was written while a pass was read"
    for s in samples:
        assert s["val_bytes"] <= ranks * 2 * _VAL_BATCH  # validation.capacity 2 per lane at most
        # train gave room back (its windows are more than their front batches): within max_bytes
        assert s["train_bytes"] + s["val_bytes"] <= max_bytes, s
    # the passes are over: train takes its bytes back
    wait_until(lambda: (s := status.read_json(buf, status.STATUS_NAME)) and s["val_bytes"] == 0
               and s["train_bytes"] == max_bytes, 60, "train to take the bytes back")
    assert d.stop() == 0
    # one warning per spell of waiting (per stream), not a flood while a lane is limited
    waits = [ln for ln in d.log().splitlines() if "waiting:" in ln]
    assert len(waits) <= 2 * 2 * ranks, waits
    assert not any("buffer.max_bytes is 0 B" in ln for ln in waits), waits


class _Slots:
    """The loop's executors, as ``Daemon._schedule`` sees them: ``count`` workers of 2 slots."""

    def __init__(self, count: int):
        self.count, self.tasks = count, []

    def idle(self) -> int:
        return 2 * self.count - len(self.tasks)

    def submit(self, task) -> bool:
        self.tasks.append(task)
        return True

    def temp_bytes(self) -> int:
        return 0


class _Ring:
    def __init__(self):
        self.evicted = []

    def evict(self, key) -> None:
        self.evicted.append(key)

    def free_bytes(self) -> int:
        return 1 << 50


def test_validation_at_8_ranks_with_default_sizes_keeps_every_worker_busy(tmp_path, image_root, val_root):
    """One daemon per 8-GPU node, default sizes: train's windows (8 x 64 x 38.5 MB) fill the
    8 GiB. While the 8 lanes read a pass, validation must have enough batches in flight to keep
    the 32 workers busy (ceil(32 / 8) + 1 = 5 per lane), not one per lane (half the workers
    idle, each rank's pass at one worker's speed), taken from train's far end, within max_bytes;
    when the pass ends train takes the bytes back. The real loop's ``_schedule`` with the real
    planners and ``ValStream``; only the workers and the ring are stand-ins."""
    from prefetchd.core.planner import Planner
    from prefetchd.core.sampler import Sampler
    from prefetchd.daemon.loop import Daemon, _limits
    from prefetchd.daemon.quarantine import QuarantineLog
    from prefetchd.daemon.segments import Segments
    from prefetchd.daemon.sessions import Sessions
    from prefetchd.daemon.validation import ValStream

    cfg = load_config(small_config(tmp_path, image_root, loader={"world_size": 8, "batch_size": 256, "epochs": None},
                                   augment={"output_size": 224, "scale_min": 256, "scale_max": 480},
                                   workers={"count": 32},
                                   buffer={"capacity": 64, "refill_at": 48, "max_bytes": "8GiB"},
                                   validation={"enabled": True, "root": val_root}))
    assert cfg.validation.capacity == 64 and cfg.validation.batch_size == 256 and len(cfg.loader.ranks) == 8
    batch = batchfile.max_file_size(256, 224, 224)
    d = Daemon(cfg)
    d.planner = Planner(cfg.loader.ranks, 625, None, _limits(cfg.buffer), lambda k: batch)
    d.val = ValStream(cfg, _FakeIndex(50_000), cfg.loader.ranks, "0" * 16)
    d.pool, d.remote, d.ring = _Slots(32), None, _Ring()
    d.sampler = Sampler(625 * 256 * 8, 256, 7, True, True, 8)  # train's tasks, once the pass is over
    d.segments = Segments(d.sampler, cfg.loader.ranks, "0" * 16, Sessions(cfg.loader.ranks, 625, "0" * 16), d.planner)
    d.quarantine = QuarantineLog(str(tmp_path), "x", str)
    train, val = d.planner, d.val.planner
    while (plan := train.plan(1000, 0.0, 1 << 50)).submit:  # train's windows, made and published
        for k in plan.submit:
            train.finished(k)
            train.published(k, batch)
    assert train.held > cfg.buffer.max_bytes - batch  # 8 GiB of train batches: fewer than 8 x 64
    for lane_id in d.val.lanes:  # every rank validates
        val.set_active(lane_id, True)
    d._schedule()
    per_lane = {lane_id: sum(t.rank == lane_id for t in d.pool.tasks) for lane_id in d.val.lanes}
    assert per_lane == dict.fromkeys(d.val.lanes, 5), per_lane  # 40 batches for 32 workers: none idle
    assert all(t.rank in d.val.lanes for t in d.pool.tasks)  # train is not read meanwhile: it makes nothing
    assert train.held + val.held <= cfg.buffer.max_bytes
    assert d.ring.evicted and all(g > 0 for _, _, g in d.ring.evicted)  # from train's far end, never a front
    # the trainers read: each lane's batches land, one is read, the next goes out; 5 per lane stay
    for _ in range(3):
        for t in list(d.pool.tasks):
            key = (t.rank, t.epoch, t.batch)
            assert val.finished(key)
            val.published(key, batch)
        d.pool.tasks.clear()
        for lane_id in d.val.lanes:
            e, b = val.position(lane_id)
            val.set_position(lane_id, e, b + 1)
        d._schedule()
        assert {lane_id: val.rank_status(lane_id)["ready"] + val.rank_status(lane_id)["in_flight"]
                for lane_id in d.val.lanes} == dict.fromkeys(d.val.lanes, 5)
        assert train.held + val.held <= cfg.buffer.max_bytes
    # the pass ends: validation holds nothing, train refills to max_bytes
    for lane_id in d.val.lanes:
        val.set_active(lane_id, False)
    for t in d.pool.tasks:  # what was still being made is no longer wanted
        assert not val.finished((t.rank, t.epoch, t.batch))
    d.pool.tasks.clear()
    for _ in range(4):
        d._schedule()
    assert val.held == 0 and len(d.pool.tasks) > 0 and all(t.rank in cfg.loader.ranks for t in d.pool.tasks)


class _FakeIndex:
    """What ``ValStream`` asks of the val index: its length and fingerprint."""

    def __init__(self, n: int):
        self.n, self.fingerprint = n, "e" * 16

    def __len__(self) -> int:
        return self.n


def test_check_says_what_validation_takes_from_train_and_warns_only_when_max_bytes_cannot_hold_it(
        tmp_path, image_root, val_root):
    def check(cfg: str) -> str:
        r = subprocess.run([sys.executable, "-m", "prefetchd", "check", "--config", cfg], capture_output=True,
                           text=True, timeout=120)
        return r.stdout + r.stderr

    # issue 23's repro: train's windows fill max_bytes; a pass takes 2 batches a lane (validation.capacity 2)
    cfg, _ = _full_train_config(tmp_path, image_root, val_root, 1)
    out = check(cfg)
    assert ("note: while a validation pass is read, train's windows give up to 32.0 KiB from their far end for "
            "validation (1 rank(s) x 2 validation batch(es) of 16.0 KiB = 32.0 KiB, enough to keep 2 workers busy); "
            "they are made again once the pass ends") in out, out
    assert "warning: buffer.max_bytes" not in out, out
    # max_bytes of 2 train batches: train's front batch and 2 val batches do not fit, one of each does
    tight = small_config(tmp_path, image_root, loader={"batch_size": 8, "epochs": None},
                         augment={"output_size": 32, "scale_min": 36, "scale_max": 60},
                         buffer={"capacity": 6, "refill_at": 6, "max_bytes": 2 * _TRAIN_BATCH},
                         validation={"enabled": True, "root": val_root, "batch_size": 4, "capacity": 2,
                                   "pad": False})
    out = check(tight)
    assert ("warning: buffer.max_bytes (56.0 KiB) cannot hold train's front batches (1 x 28.0 KiB = 28.0 KiB) plus "
            "what a validation pass keeps in flight (1 rank(s) x 2 validation batch(es) of 16.0 KiB = 32.0 KiB, "
            "enough to keep 2 workers busy): validation gets 1 batch(es) per rank at a time and is slower; raise "
            "buffer.max_bytes to 60.0 KiB to keep the workers busy") in out, out
    assert "cannot even hold one train batch" not in out, out
    # one daemon per 8-GPU node at the default sizes (8 GiB, capacity 64, 38.5 MB batches): what a pass
    # needs beside train's front batches fits, so no advice to raise max_bytes to hold every window
    node = small_config(tmp_path, image_root, loader={"world_size": 8, "batch_size": 256, "drop_last": False},
                        augment={"output_size": 224, "scale_min": 256, "scale_max": 480},
                        buffer={"capacity": 64, "refill_at": 48, "max_bytes": "8GiB"}, workers={"count": 32},
                        validation={"enabled": True, "root": val_root})
    out = check(node)
    assert ("note: while a validation pass is read, train's windows give up to 1.4 GiB from their far end for "
            "validation (8 rank(s) x 5 validation batch(es) of 36.8 MiB = 1.4 GiB, enough to keep 32 workers "
            "busy)") in out, out
    assert "warning: buffer.max_bytes" not in out and "raise buffer.max_bytes" not in out, out
    roomy = small_config(tmp_path, image_root, validation={"enabled": True, "root": val_root})
    assert "validation batch" not in check(roomy)


def test_a_val_clients_timeout_quotes_its_own_val_lane(tmp_path, image_root, val_root, daemon_factory):
    cfg = small_config(tmp_path, image_root, validation={"enabled": True, "root": val_root, "batch_size": 4})
    buf = load_config(cfg).buffer.dir
    d = daemon_factory(cfg)
    wait_until(lambda: (s := status.read_json(buf, status.STATUS_NAME)) and s["ranks"]["0"]["ahead"] >= 3, 60,
               "the train window filled")
    with PrefetchClient(cfg, split="val", as_numpy=True, timeout=3) as c:
        c.meta()
        os.kill(d.pid, signal.SIGSTOP)  # the daemon makes nothing: the val pass waits out its timeout
        try:
            with pytest.raises(PrefetchTimeout) as err:
                next(iter(c))
        finally:
            os.kill(d.pid, signal.SIGCONT)
    msg = str(err.value)
    assert "waited 3.0 s for rank 0 epoch 0 batch 0" in msg and "/v0000-" in msg, msg
    assert "rank 0's validation lane" in msg and "at pass/batch [0, 0] of 5 batches" in msg, msg
    assert "epoch/batch" not in msg, msg  # the train rank's figures are not this lane's
    assert d.stop() == 0


def test_loader_states_name_their_stream_and_split_and_stay_inside_the_epoch(tmp_path, image_root, val_root,
                                                                              daemon_factory):
    cfg = small_config(tmp_path, image_root, validation={"enabled": True, "root": val_root, "batch_size": 4})
    (tmp_path / "other").mkdir()
    other = small_config(tmp_path / "other", image_root, loader={"seed": 99})  # another stream, its own daemon
    d, d2 = daemon_factory(cfg), daemon_factory(other)
    with PrefetchClient(cfg, as_numpy=True, timeout=60) as t:
        fresh = t.state_dict()  # before the first batch, meta.json not read yet: fetched for it
        assert fresh["fingerprint"] == t.meta()["fingerprint"] and fresh["split"] == "train"
    with PrefetchClient(cfg, as_numpy=True, timeout=60) as t:
        t.seek(1, 3)  # only a seek
        sought = t.state_dict()
        assert (sought["epoch"], sought["batch"], sought["fingerprint"]) == (1, 3, fresh["fingerprint"])
    with PrefetchClient(other, as_numpy=True, timeout=60) as o:  # another dataset or seed refuses both
        for state in (fresh, sought):
            with pytest.raises(PrefetchError, match=f"is for stream {fresh['fingerprint']}.*changed"):
                o.load_state_dict(state)
        with pytest.raises(PrefetchError, match=r"names no stream .* allow_unverified=True"):
            o.load_state_dict(fresh | {"fingerprint": None})
        o.load_state_dict(sought | {"fingerprint": None}, allow_unverified=True)  # on the caller's word
        assert (o.epoch, o.batch) == (1, 3)
    with PrefetchClient(cfg, split="val", as_numpy=True, timeout=60) as v:
        vstate = v.state_dict()
        assert vstate["fingerprint"] == v.meta()["validation"]["fingerprint"] and vstate["split"] == "val"
        with pytest.raises(PrefetchError, match="split='train' loader's, this client reads split='val'"):
            v.load_state_dict(sought)
        older = {k: sought[k] for k in ("epoch", "batch", "rank", "fingerprint")}  # no "split": its fingerprint says
        with pytest.raises(PrefetchError, match="split='train' loader's, this client reads split='val'"):
            v.load_state_dict(older)
        with pytest.raises(PrefetchError, match="batch 6 of pass 0, which has 5 batches: past its end"):
            v.load_state_dict(vstate | {"batch": 6, "_sampler_iter_state": {"epoch": 0, "batch": 6}})
    with PrefetchClient(cfg, as_numpy=True, timeout=60) as t:
        with pytest.raises(PrefetchError, match="split='val' loader's, this client reads split='train'"):
            t.load_state_dict(vstate)
        with pytest.raises(PrefetchError, match="batch 50 of epoch 0, which has 8 batches: past its end"):
            t.load_state_dict(fresh | {"batch": 50, "_sampler_iter_state": {"epoch": 0, "batch": 50}})
        t.load_state_dict(sought)
        assert (t.epoch, t.batch) == (1, 3)
    assert d.stop() == 0 and d2.stop() == 0


def test_each_val_for_is_a_new_pass_ending_an_iteration_still_held(tmp_path, image_root, val_root, daemon_factory):
    cfg = small_config(tmp_path, image_root, validation={"enabled": True, "root": val_root, "batch_size": 4})
    buf = load_config(cfg).buffer.dir
    d = daemon_factory(cfg)
    with PrefetchClient(cfg, split="val", as_numpy=True, timeout=60) as v:
        it = iter(v)
        next(it)
        next(it)
        assert (v.epoch, v.batch) == (0, 2)
        got = []
        for _ in v:  # a new pass from its first batch, not the rest of the held one
            got.append((v.last_batch.epoch, v.last_batch.batch, v.last_batch.indices.tolist()))
        assert [(e, b) for e, b, _ in got] == [(1, b) for b in range(5)]
        assert sorted(i for *_, idx in got for i in idx) == list(range(17))  # every sample in this pass
        with pytest.raises(PrefetchError, match="ended by"):
            next(it)  # the held iteration was ended; its end leaves the new position alone
        del it
        assert (v.epoch, v.batch) == (2, 0)
        wait_until(lambda: val_files(buf) == [], 20, "the finished pass's val batches deleted")
    # train keeps "from the current position": a new `for` goes on where the held one was
    with PrefetchClient(cfg, as_numpy=True, timeout=60) as t:
        it = iter(t)
        next(it)
        next(it)
        assert [t.last_batch.batch for _ in t] == list(range(2, 8))
        del it
    assert d.stop() == 0


def test_a_val_index_read_after_the_train_index_is_waited_for(tmp_path, image_root, val_root, daemon_factory):
    """The val scan ends after the train index is loaded (cached here): the daemon waits for both.
    The val file list is a FIFO the test fills only once the daemon has opened it (the train
    index is read by then) and it has had 3 s to give up waiting."""
    load_index(image_root, None, (".jpeg", ".jpg", ".png"), str(tmp_path / "cache"))  # train: cached
    val, _ = load_index(val_root, None, (".jpeg", ".jpg", ".png"), None, use_cache=False)
    lines = "".join(f"{val.path(i)} {int(val.labels[i])}\n" for i in range(len(val)))
    fifo = str(tmp_path / "val.txt")
    os.mkfifo(fifo)
    cfg = small_config(tmp_path, image_root, validation={"enabled": True, "file_list": fifo, "batch_size": 4})
    buf = load_config(cfg).buffer.dir
    d = daemon_factory(cfg)

    def opened():
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO until the daemon opens it to read
        except OSError:
            assert d.proc.poll() is None, d.log()
            return None

    fd = wait_until(opened, 60, "the daemon reading the val file list")
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:  # the train index is loaded; the val scan goes on
        assert d.proc.poll() is None, f"the daemon ended while the val index was read:\n{d.log()}"
        time.sleep(0.05)
    os.set_blocking(fd, True)
    os.write(fd, lines.encode())
    os.close(fd)
    wait_until(lambda: (s := status.read_json(buf, status.STATUS_NAME)) and s.get("val_ranks"), 60,
               "the daemon serving validation")
    with PrefetchClient(cfg, rank=0, split="val", as_numpy=True, timeout=60) as c:
        assert sum(len(y) for _, y, _ in read_pass(c)) == len(val)
    assert "AttributeError" not in d.log()
    assert d.stop() == 0


def test_a_devkit_that_is_a_fifo_is_refused_in_one_line(tmp_path, image_root):
    fifo = str(tmp_path / "devkit.tar.gz")
    os.mkfifo(fifo)
    from prefetchd.sources.devkit import DevkitError, read_devkit

    with pytest.raises(DevkitError, match="not a regular file or a folder"):
        read_devkit(fifo)


_ALLREDUCE_RANK = r"""
import json, sys
import torch
import torch.distributed as dist
from prefetchd_client import PrefetchClient

cfg, rank, store, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
passes = []
with PrefetchClient(cfg, rank=rank, split="val", padding_mask=True, timeout=60) as c:
    for _ in range(2):
        seen, batches = [], 0
        for x, y, pad in c:
            t = torch.tensor([float((~pad).sum())])
            dist.all_reduce(t)  # a metric reduced every step, as timm's validate() and sync_dist do
            assert pad.dtype == torch.bool and len(pad) == len(y) == len(c.last_batch.indices)
            seen += [[int(i), int(l)] for i, l, p in zip(c.last_batch.indices, y, pad) if not p]
            batches += 1
        passes.append({"batches": batches, "len": len(c), "seen": seen})
dist.destroy_process_group()
json.dump(passes, open(out, "w"))
"""


def test_a_loop_that_all_reduces_every_val_batch_finishes_every_pass(tmp_path, image_root, daemon_factory):
    """65 val images on 2 ranks at batch 32: both ranks' passes have 2 batches (the second rank's
    last one padded with sample 0), a gloo all-reduce per batch never waits on a rank that ran
    out, and the samples the padding mask keeps are each val sample exactly once."""
    pytest.importorskip("torch.distributed")
    val = tmp_path / "val65"
    make_image_folder(str(val), classes=4, per_class=17, seed=5, long_side=64)
    for name in ("img_00016.JPEG", "img_00015.JPEG", "img_00014.JPEG"):
        os.unlink(val / "n00000003" / name)
    cfg = small_config(tmp_path, image_root, loader={"world_size": 2, "ranks": [0, 1]},
                       validation={"enabled": True, "root": str(val), "batch_size": 32})
    d = daemon_factory(cfg)
    script = tmp_path / "rank.py"
    script.write_text(_ALLREDUCE_RANK)
    outs = [tmp_path / f"rank{r}.json" for r in (0, 1)]
    procs = [subprocess.Popen([sys.executable, str(script), cfg, str(r), str(tmp_path / "store"), str(outs[r])],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in (0, 1)]
    try:
        for p in procs:
            out, _ = p.communicate(timeout=120)  # a hang (rank 0 waiting in its second all-reduce) fails here
            assert p.returncode == 0, out.decode(errors="replace")[-3000:]
    finally:
        for p in procs:
            p.kill()
    got = [json.loads(o.read_text()) for o in outs]
    index, _ = load_index(str(val), None, (".jpeg", ".jpg", ".png"), None, use_cache=False)
    train, _ = load_index(image_root, None, (".jpeg", ".jpg", ".png"), None, use_cache=False)
    labels = val_labels(index, train).labels
    for p in range(2):
        assert [g[p]["batches"] for g in got] == [2, 2] and [g[p]["len"] for g in got] == [2, 2]
        seen = sorted(tuple(s) for g in got for s in g[p]["seen"])
        # the masked metric is the exactly-once one: every sample once, with its own label
        assert seen == [(i, int(labels[i])) for i in range(65)]
    assert d.stop() == 0
