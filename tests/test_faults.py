"""Faults the daemon must survive, each done to the real daemon as the world would do it."""

from __future__ import annotations

import os
import shutil
import signal
import time

import numpy as np
import pytest
from conftest import pixels, small_config, wait_until
from prefetchd_client import PrefetchClient, PrefetchTimeout
from test_daemon import collect, digest, published, reference_batches

from prefetchd.format import progress, status


def test_daemon_sigkilled_repeatedly_restarts_and_the_trainer_sees_every_batch_once(tmp_path, image_root, daemon_factory):
    cfg = small_config(tmp_path, image_root, buffer={"capacity": 6, "refill_at": 6})
    buf = str(tmp_path / "buffer")
    got = {}
    rng = np.random.default_rng(0)
    d = daemon_factory(cfg)
    with PrefetchClient(cfg, timeout=60, as_numpy=True) as c:
        for e in (0, 1):
            for b, (x, y) in enumerate(c.iter_epoch(e)):
                got[(0, e, b)] = (np.ascontiguousarray(x.transpose(0, 2, 3, 1)), y.copy())
                if rng.random() < 0.5:  # kill it at a random moment, then start it again
                    d.stop(signal.SIGKILL)
                    d = daemon_factory(cfg)
    wait_until(lambda: status.daemon_alive(buf), 30, "the last daemon")
    assert d.stop() == 0
    ref, _ = reference_batches(cfg)
    assert digest(got) == digest({k: v[:2] for k, v in ref.items()})
    assert not [n for n in os.listdir(buf) if n.startswith(".tmp-")]


def test_restart_keeps_good_batches_and_remakes_torn_or_corrupt_ones(tmp_path, image_root, daemon_factory):
    cfg = small_config(tmp_path, image_root)
    buf = str(tmp_path / "buffer")
    d = daemon_factory(cfg)
    wait_until(lambda: len(published(buf)) == 4, 30, "a full buffer")
    d.stop(signal.SIGKILL)
    names = published(buf)
    with open(os.path.join(buf, names[0]), "r+b") as f:  # a bit flip
        f.seek(5000)
        byte = f.read(1)
        f.seek(5000)
        f.write(bytes([byte[0] ^ 1]))
    with open(os.path.join(buf, names[1]), "r+b") as f:  # torn
        f.truncate(1000)
    with open(os.path.join(buf, ".tmp-r0000-e000000-b00000009-w0-1"), "wb") as f:  # an unfinished batch
        f.write(b"partial")
    d = daemon_factory(cfg)
    got = collect(cfg)
    ref, _ = reference_batches(cfg)
    assert digest(got) == digest({k: v[:2] for k, v in ref.items()})
    assert d.stop() == 0
    assert "kept 2 batches; removed 1 temp, 2 torn or corrupt" in d.log()


def test_worker_killed_mid_batch_is_noticed_replaced_and_its_batch_made_again(tmp_path, image_root, daemon_factory):
    cfg = small_config(tmp_path, image_root, workers={"count": 1})
    buf = str(tmp_path / "buffer")
    d = daemon_factory(cfg)
    pids = wait_until(lambda: (status.read_json(buf, status.STATUS_NAME) or {}).get("worker_pids"), 30, "worker pids")
    with PrefetchClient(cfg, timeout=60, as_numpy=True) as c:
        it = c.iter_epoch(0)
        next(it)
        os.kill(pids[0], signal.SIGKILL)
        wait_until(lambda: "killed by SIGKILL, perhaps out of memory?" in d.log(), 30, "the worker's death in the log")
        rest = list(it)
        assert len(rest) == 7
        got = collect(cfg, epochs=(1,))
    assert d.stop() == 0
    ref, _ = reference_batches(cfg)
    for k, (x, _) in got.items():
        assert np.array_equal(x, ref[k][0])
    assert f"worker 0 (pid {pids[0]}) was killed by SIGKILL" in d.log()


def test_corrupt_and_unreadable_images_are_quarantined_and_training_goes_on(tmp_path, image_root, daemon_factory):
    root = tmp_path / "root"
    shutil.copytree(image_root, root)
    victims = sorted(p for p in root.rglob("*.JPEG"))[:3]
    victims[0].write_bytes(victims[0].read_bytes()[:300])  # truncated
    victims[1].write_bytes(b"")  # empty
    victims[2].unlink()
    victims[2].symlink_to(tmp_path / "gone.jpg")  # unreadable (dangling)
    digests = []
    for run in range(2):  # the replacements are deterministic: a second daemon gives the same bytes
        run_dir = tmp_path / f"run{run}"
        run_dir.mkdir()
        cfg = small_config(run_dir, str(root))
        d = daemon_factory(cfg)
        got = collect(cfg)
        assert all(x.shape == (6, 64, 64, 3) for x, _ in got.values())
        digests.append(digest(got))
        buf = str(run_dir / "buffer")
        wait_until(lambda buf=buf: (status.read_json(buf, status.STATUS_NAME) or {}).get("quarantined") == 3,
                   10, "3 quarantined samples in status.json")
        assert d.stop() == 0
        q = (run_dir / "buffer" / status.QUARANTINE_NAME).read_text()
        assert all(str(v) in q for v in victims)
        lines = [line for line in d.log().splitlines() if "quarantined sample" in line]
        assert len(lines) == 3 and all(sum(str(v) in line for line in lines) == 1 for v in victims)  # once each
        assert all("0x" not in line for line in lines + q.splitlines())
    assert digests[0] == digests[1]


def test_garbage_progress_files_keep_the_last_good_position(tmp_path, image_root, daemon_factory):
    cfg = small_config(tmp_path, image_root, loader={"epochs": None})
    buf = str(tmp_path / "buffer")
    d = daemon_factory(cfg)
    pdir = os.path.join(buf, "progress")
    path = progress.progress_path(pdir, 0)
    wait_until(lambda: len(published(buf)) == 4, 30, "a full buffer")
    progress.write(os.path.join(buf, "progress"), progress.Progress(rank=0, epoch=0, batch=3))

    def pos():
        return (status.read_json(buf, status.STATUS_NAME) or {}).get("ranks", {}).get("0", {}).get("position")

    wait_until(lambda: pos() == [0, 3], 10, "position 0/3")
    for bad in (b"", b"{not json", b'{"format": "prefetchd-progress", "version": 1, "rank": 0, "epoch": "x", "batch": 1}'):
        with open(path, "wb") as f:
            f.write(bad)
        wait_until(lambda: "ignoring" in d.log(), 10, "a warning")
    os.unlink(path)
    for _ in range(300):  # rewritten hundreds of times a second
        progress.write(os.path.join(buf, "progress"), progress.Progress(rank=0, epoch=1, batch=2))
    wait_until(lambda: pos() == [1, 2], 10, "position 1/2")
    assert d.log().count("ignoring") == 1  # warned once for the whole bad spell
    wait_until(lambda: {n[:-6].split("-b")[1] for n in published(buf)} >= {"00000002", "00000003"}, 10, "refill at 1/2")
    assert d.stop() == 0


def test_progress_polling_works_without_inotify(tmp_path, image_root, daemon_factory):
    cfg = small_config(tmp_path, image_root, progress={"inotify": False, "poll_interval_s": 0.1})
    d = daemon_factory(cfg)
    got = collect(cfg)
    assert len(got) == 16
    assert d.stop() == 0


def test_a_sample_that_kills_its_worker_every_time_is_quarantined_after_a_second_try(tmp_path, image_root,
                                                                                       daemon_factory):
    cfg = small_config(tmp_path, image_root)
    from prefetchd.core.sampler import Sampler
    from prefetchd.sources.dataset import load_index

    index, _ = load_index(image_root, None, (".jpeg", ".jpg", ".png"), str(tmp_path / "cache"))
    victim = int(Sampler(len(index), 6, seed=7).batch_indices(0, 0, 2)[3])  # in batch 2 of epoch 0
    path = index.path(victim)
    d = daemon_factory(cfg, env={"PREFETCHD_FAULT_CRASH_ON": os.path.basename(path)})
    got = collect(cfg)
    assert len(got) == 16 and all(x.shape == (6, 64, 64, 3) for x, _ in got.values())
    log = d.log()
    assert log.count("was killed by SIGSEGV") >= 2 and f"(at sample {victim})" in log
    assert f"quarantined sample {victim} ({path}): its worker was killed by SIGSEGV twice" in log
    assert d.stop() == 0
    # the stand-in is the same deterministic replacement a broken file gets
    from prefetchd.executors.worker import replacement

    stand_in = replacement(7, 0, victim, 1, len(index))
    assert got[(0, 0, 2)][1][3] == index.labels[stand_in]


def test_max_bytes_below_one_batch_waits_and_says_why(tmp_path, image_root, daemon_factory):
    cfg = small_config(tmp_path, image_root, buffer={"max_bytes": 10_000})
    buf = str(tmp_path / "buffer")
    d = daemon_factory(cfg)
    s = wait_until(lambda: (status.read_json(buf, status.STATUS_NAME) or {}).get("blocked"), 30, "a blocked status")
    assert "one batch needs 76.0 KiB but buffer.max_bytes is 9.8 KiB; raise buffer.max_bytes" in s
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "prefetchd", "status", "--config", cfg], capture_output=True, text=True,
                       timeout=30)
    assert "waiting: one batch needs" in r.stdout
    assert d.proc.poll() is None and not published(buf)
    assert d.stop() == 0


def test_filesystem_free_space_is_respected(tmp_path, image_root, daemon_factory):
    cfg = small_config(tmp_path, image_root, buffer={"min_free_bytes": "100000TiB"})
    buf = str(tmp_path / "buffer")
    d = daemon_factory(cfg)
    s = wait_until(lambda: (status.read_json(buf, status.STATUS_NAME) or {}).get("blocked"), 30, "a blocked status")
    assert "the buffer filesystem has" in s and "buffer.min_free_bytes keeps" in s
    assert not published(buf) and d.stop() == 0


def _mount_small_tmpfs(path) -> bool:
    import subprocess

    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(path)], capture_output=True)
    return r.returncode == 0


def test_a_full_tmpfs_leaves_no_partial_file_and_recovers(tmp_path, image_root, daemon_factory):
    import subprocess

    from prefetchd.core.config import load as load_config
    from prefetchd.core.sampler import Sampler
    from prefetchd.executors.worker import BatchMaker, Task, WorkerSetup
    from prefetchd.sources.dataset import load_index

    mnt = tmp_path / "small"
    if not _mount_small_tmpfs(mnt):  # needs root (CI and this project's machines run as root)
        raise AssertionError("cannot mount a tmpfs for this test: run the suite as root")
    try:
        buf = mnt / "buffer"
        cfg = small_config(tmp_path, image_root, buffer={"dir": str(buf), "min_free_bytes": 1, "capacity": 4})
        # a worker that meets ENOSPC reports it and leaves no partial file
        buf.mkdir(mode=0o700)
        filler = mnt / "filler"
        filler.write_bytes(b"\0" * (150 * 1024))  # leaves room for status.json, not for a batch
        c = load_config(cfg)
        index, _ = load_index(image_root, None, c.dataset.extensions, c.dataset.cache_dir)
        maker = BatchMaker(WorkerSetup(c, index.files_dir, None, 0, str(buf)))
        res = maker.make(Task(0, 0, 0, 8, Sampler(len(index), 6, seed=7).batch_indices(0, 0, 0)))
        assert res.tmp_path is None and "No space left on device" in res.error
        assert os.listdir(buf) == []
        # the daemon on the full filesystem waits and says why, then fills once space is freed
        d = daemon_factory(cfg)
        s = wait_until(lambda: (status.read_json(str(buf), status.STATUS_NAME) or {}).get("blocked"), 30, "blocked")
        assert "the buffer filesystem has" in s and d.proc.poll() is None
        assert "waiting: the buffer filesystem has" in d.log()
        filler.unlink()
        got = collect(cfg, epochs=(0,))  # two 76 KiB batches fit in 200 KiB at a time
        ref, _ = reference_batches(cfg, epochs=1)
        for k, (x, y) in got.items():
            assert np.array_equal(x, ref[k][0]) and np.array_equal(y, ref[k][1])
        assert len(got) == 8 and d.stop() == 0
        assert not [n for n in os.listdir(buf) if n.startswith(".tmp-")]
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


def test_stuck_daemon_makes_the_client_time_out_saying_so(tmp_path, image_root, daemon_factory):
    cfg = small_config(tmp_path, image_root)
    buf = str(tmp_path / "buffer")
    d = daemon_factory(cfg)
    wait_until(lambda: len(published(buf)) == 4, 30, "a full buffer")
    os.killpg(d.pid, signal.SIGSTOP)
    try:
        with PrefetchClient(cfg, timeout=1.5, as_numpy=True) as c:
            with pytest.raises(PrefetchTimeout) as ei:
                for _ in c.iter_epoch(0):
                    pass
    finally:
        os.killpg(d.pid, signal.SIGCONT)
    msg = str(ei.value)
    assert "rank 0 epoch 0 batch 4" in msg and "is alive" in msg and "status is" in msg
    assert d.stop() == 0


def test_progress_going_backwards_within_a_session_is_ignored_but_a_new_session_jumps(tmp_path, image_root,
                                                                                      daemon_factory):
    cfg = small_config(tmp_path, image_root, loader={"epochs": None})
    buf = str(tmp_path / "buffer")
    d = daemon_factory(cfg)

    def pos():
        return (status.read_json(buf, status.STATUS_NAME) or {}).get("ranks", {}).get("0", {}).get("position")

    wait_until(lambda: pos() == [0, 0], 30, "the daemon's first status")
    progress.write(os.path.join(buf, "progress"), progress.Progress(rank=0, epoch=2, batch=5, session="a.0"))
    wait_until(lambda: pos() == [2, 5], 10, "position 2/5")
    progress.write(os.path.join(buf, "progress"), progress.Progress(rank=0, epoch=1, batch=0, session="a.0"))  # a stale copy, say
    wait_until(lambda: "went back from epoch 2 batch 5 to epoch 1 batch 0 within one trainer session" in d.log(), 10,
               "a warning")
    assert pos() == [2, 5]
    progress.write(os.path.join(buf, "progress"), progress.Progress(rank=0, epoch=1, batch=0, session="b.0"))  # a resumed trainer
    wait_until(lambda: pos() == [1, 0], 10, "the jump to 1/0")
    assert d.stop() == 0


def test_buffer_on_a_disk_is_warned_about(tmp_path, image_root, daemon_factory):
    import tempfile

    from prefetchd.daemon.ring import is_tmpfs

    # tmp_path is on the root disk on these machines; elsewhere /tmp may be a tmpfs
    parent = str(tmp_path) if not is_tmpfs(str(tmp_path)) else tempfile.mkdtemp(dir=os.path.dirname(__file__))
    assert not is_tmpfs(parent), "no disk-backed directory to try"
    try:
        d = daemon_factory(small_config(tmp_path, image_root, buffer={"dir": os.path.join(parent, "buffer")}))
        wait_until(lambda: "is not on tmpfs" in d.log(), 30, "the tmpfs warning")
        assert d.stop() == 0
    finally:
        if parent != str(tmp_path):
            import shutil

            shutil.rmtree(parent, ignore_errors=True)


def test_run_on_a_root_without_images_exits_78(tmp_path):
    import subprocess
    import sys

    (tmp_path / "root" / "cls").mkdir(parents=True)
    cfg = small_config(tmp_path, str(tmp_path / "root"))
    r = subprocess.run([sys.executable, "-m", "prefetchd", "run", "--config", cfg], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 78 and "holds no images" in r.stderr


# --- issue 10: hostile input and faults that used to stop or slow the daemon ---------------------

_HOSTILE = [
    b'{"format": "prefetchd-progress", "version": 1, "rank": 0, "epoch": ' + b"7" * 5000 + b', "batch": 1}',
    b'{"format": "prefetchd-progress", "version": 1, "rank": 0, "epoch": 1, "batch": 1, "wait_s": 1e400}',
    b'{"format": "prefetchd-progress", "version": 1, "rank": 0, "epoch": ' + str(10**400).encode() + b', "batch": 1}',
    b'{"format": "prefetchd-progress", "version": 1, "rank": 0, "epoch": 4294967296, "batch": 1}',
    b'{"format": "prefetchd-progress", "version": 1, "rank": 0, "epoch": 1, "batch": 1, "echoed": NaN}',
    b"[" * 50000,
]


@pytest.mark.parametrize("bad", _HOSTILE, ids=["5000-digits", "1e400", "10**400", "epoch-2**32", "NaN", "nested"])
def test_hostile_progress_file_is_rejected_with_one_warning_also_at_start_up(tmp_path, image_root, daemon_factory, bad):
    cfg = small_config(tmp_path, image_root, loader={"epochs": None})
    buf = str(tmp_path / "buffer")
    pdir = os.path.join(buf, "progress")
    os.makedirs(pdir)
    with open(progress.progress_path(pdir, 0), "wb") as f:  # there before the daemon starts
        f.write(bad)
    d = daemon_factory(cfg)
    wait_until(lambda: len(published(buf)) == 4, 30, "a full buffer")
    progress.write(pdir, progress.Progress(rank=0, epoch=0, batch=2))
    wait_until(lambda: _position(buf) == [0, 2], 10, "position 0/2")
    with open(progress.progress_path(pdir, 0), "wb") as f:  # and again while it runs
        f.write(bad)
    wait_until(lambda: d.log().count("ignoring") == 2, 10, "a second warning")
    progress.write(pdir, progress.Progress(rank=0, epoch=0, batch=3))
    wait_until(lambda: _position(buf) == [0, 3], 10, "position 0/3")
    assert d.proc.poll() is None and d.stop() == 0
    log = d.log()
    assert "Traceback" not in log and log.count("ignoring") == 2
    # one short line, not the file echoed (the paths of the test's own folder not counted: pytest-xdist's are longer)
    assert all(len(line.replace(str(tmp_path), "T")) < 400 for line in log.splitlines())


def _position(buf):
    return (status.read_json(buf, status.STATUS_NAME) or {}).get("ranks", {}).get("0", {}).get("position")


def test_write_temp_leaves_nothing_behind_whatever_fails(tmp_path):
    from prefetchd.executors.worker import Task, write_temp

    task = Task(0, 1 << 32, 0, 8, np.arange(2, dtype=np.int64))  # overflows the header's 32-bit epoch
    imgs = np.zeros((2, 8, 8, 3), np.uint8)
    args = (str(tmp_path), task, 1, 0, pixels(imgs), np.arange(2), np.zeros(2, np.int64), np.full(2, -1), [], 0.0)
    for _ in range(2):  # the second try must not find the first's temp file in its way
        res = write_temp(*args)
        assert res.error and "File exists" not in res.error and res.tmp_path is None
    assert os.listdir(tmp_path) == []


def test_a_death_while_writing_blames_no_sample(tmp_path, image_root, monkeypatch):
    from prefetchd.core.config import load as load_config
    from prefetchd.executors import worker
    from prefetchd.sources.dataset import load_index

    cfg = load_config(small_config(tmp_path, image_root))
    index, _ = load_index(image_root, None, (".jpg", ".jpeg"), str(tmp_path / "cache"))
    current = np.full(1, -1, np.int64)
    maker = worker.BatchMaker(worker.WorkerSetup(cfg, None, index, 1, str(tmp_path)), 0, current)
    seen = []
    real = worker.write_temp
    monkeypatch.setattr(worker, "write_temp", lambda *a: seen.append(int(current[0])) or real(*a))
    maker.make(worker.Task(0, 0, 0, 8, np.arange(6, dtype=np.int64)))
    assert seen == [-1]  # an out-of-memory kill here must not quarantine sample 5


def test_quarantine_reasons_carry_no_object_addresses(tmp_path, image_root):
    from prefetchd.executors.worker import clean_reason

    msg = "cannot identify image file <_io.BytesIO object at 0x7f3a2c1e9d50>"
    assert clean_reason(msg) == "cannot identify image file the file"
    assert "0x" not in clean_reason("<PIL.Image object at 0xDEADBEEF> broke")


def test_sigterm_during_the_index_scan_stops_at_once(tmp_path, daemon_factory):
    listing = tmp_path / "list.txt"
    with open(listing, "wb") as f:  # a big file list: scanning it takes seconds
        f.write(b"".join(b"d/img_%07d.jpg %d\n" % (i, i % 1000) for i in range(3_000_000)))
    cfg = small_config(tmp_path, "/nonexistent", dataset={"root": None, "file_list": str(listing)})
    d = daemon_factory(cfg)
    wait_until(lambda: os.path.exists(tmp_path / "buffer" / "daemon.lock"), 20, "the lock")
    assert "dataset:" not in d.log()
    t0 = time.monotonic()
    assert d.stop(timeout=10) == 0
    assert time.monotonic() - t0 < 2.0
    assert "stopping during the dataset scan" in d.log()


def test_teardown_releases_the_lock_even_if_a_step_raises(tmp_path, image_root):
    from prefetchd.core.config import load as load_config
    from prefetchd.daemon.loop import Daemon
    from prefetchd.daemon.ring import Lock

    d = Daemon(load_config(small_config(tmp_path, image_root)))
    d.lock = Lock(str(tmp_path))
    d.lock.acquire()

    class Broken:
        def stop(self):
            raise RuntimeError("broken")

        def remove_temp_files(self):
            raise OSError(5, "I/O error")

    d.watcher = d.pool = d.ring = Broken()
    d.status_record = Broken().stop
    d._teardown()
    other = Lock(str(tmp_path))
    other.acquire()  # would raise BufferBusy with the lock still held
    other.release()


def test_images_are_read_with_a_buffer_sized_to_the_file(tmp_path):
    import tracemalloc

    from prefetchd.sources.dataset import read_all as _read_all

    path = tmp_path / "img"
    data = os.urandom(100_000)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        tracemalloc.start()
        got = _read_all(fd)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    finally:
        os.close(fd)
    assert got == data and peak < 1 << 20  # not a 1 GiB buffer per image


def test_a_batch_with_padding_does_not_copy_the_permutation():
    import tracemalloc

    from prefetchd.core.sampler import Sampler

    s = Sampler(1_000_003, 256, seed=1, world_size=8)  # padding applies: 1,000,003 is not a multiple of 8
    s.batch_indices(0, 3, 0)  # the permutation itself is made (and cached) once per epoch
    tracemalloc.start()
    idx = s.batch_indices(0, 7, s.batches_per_epoch - 1)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 64 * 1024  # the old way copied all 8 MB of the permutation for every batch
    lo = (s.batches_per_epoch - 1) * 256
    assert np.array_equal(idx, s.rank_indices(0, 7)[lo: lo + 256])


def test_a_failing_batch_neither_pauses_other_ranks_nor_feeds_the_watchdog(tmp_path, image_root):
    from prefetchd.core.config import load as load_config
    from prefetchd.core.planner import Limits, Planner
    from prefetchd.daemon.loop import Daemon
    from prefetchd.daemon.quarantine import QuarantineLog
    from prefetchd.daemon.report import stuck_s
    from prefetchd.executors.worker import Result

    d = Daemon(load_config(small_config(tmp_path, image_root)))
    d.planner = Planner((0, 1), 8, 2, Limits(4, 4, 1 << 30, 0), lambda b: 1000)
    d.quarantine = QuarantineLog(str(tmp_path), "x", str)
    first = d.planner.plan(2, time.monotonic(), 1 << 40).submit
    assert first == [(0, 0, 0), (1, 0, 0)]
    d.last_activity = before = time.monotonic() - 100
    d._handle(Result(0, 0, 0, None, error="cannot write a batch: No space left on device"))
    assert d.last_activity == before  # a failure is not progress: the watchdog (and status --live) may still fire
    assert stuck_s(d) >= 100
    nxt = d.planner.plan(8, time.monotonic(), 1 << 40).submit
    assert (0, 0, 1) in nxt and (1, 0, 1) in nxt and (0, 0, 0) not in nxt  # only the failed batch waits


def test_workers_that_keep_dying_are_replaced_with_a_growing_delay(tmp_path, image_root, daemon_factory):
    cfg = small_config(tmp_path, image_root, workers={"count": 1})
    t0 = time.monotonic()
    d = daemon_factory(cfg, env={"PREFETCHD_FAULT_CRASH_ON": ".JPEG"})  # every sample crashes its worker
    assert d.proc.wait(60) == 1  # a crash loop before the first batch stops the daemon...
    elapsed = time.monotonic() - t0
    log = d.log()
    # ...but only after waiting 0.1, 0.2, 0.4, 0.8, 1.6 and 3.2 s between the 8 deaths, not in a tight loop
    assert "replacing it in 0.1 s" in log and "replacing it in 3.2 s" in log
    assert elapsed > 6.3 and "workers died 8 times before the first batch" in log


def test_workers_killed_from_outside_before_the_first_batch_do_not_stop_the_daemon(tmp_path, image_root,
                                                                                   daemon_factory):
    """The OOM killer (or an operator) SIGKILLs every worker before it makes a batch, more times
    than the crash-loop guard allows crashes: kills are no sign of a broken set-up, so the daemon
    replaces them and serves once they are left alone."""
    import psutil

    cfg = small_config(tmp_path, image_root, workers={"count": 1}, loader={"epochs": 1})
    marker = tmp_path / "hung"  # each worker stops (SIGSTOP) at its first sample while this is absent
    d = daemon_factory(cfg, env={"PREFETCHD_FAULT_HANG_ONCE": f"img_:{marker}"})
    kills = 0
    deadline = time.monotonic() + 120
    while kills < 9:  # one more than the crash-loop guard's 8
        assert time.monotonic() < deadline, f"only {kills} workers were killed in 120 s"
        assert d.proc.poll() is None, d.log()[-2000:]
        try:
            stopped = [p for p in psutil.Process(d.pid).children(recursive=True)
                       if p.status() == psutil.STATUS_STOPPED]
        except psutil.Error:
            stopped = []
        for p in stopped:
            p.kill()
            kills += 1
        if stopped and kills < 9:
            gone = stopped
            wait_until(lambda: all(_gone(p) for p in gone), 10, "the killed worker gone")  # noqa: B023
            marker.unlink()  # the next worker stops too
        time.sleep(0.01)
    got = collect(cfg, epochs=(0,), timeout=60)  # the marker stays: the next worker serves
    assert len(got) == 8 and d.proc.poll() is None
    log = d.log()
    assert log.count("killed by SIGKILL") >= 9 and "before the first batch" not in log, log[-3000:]
    assert d.stop() == 0


def _gone(p) -> bool:
    import psutil

    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_only_crashes_of_workers_that_never_made_a_batch_count_towards_the_crash_loop(tmp_path):
    """The crash-loop guard's count: an exit status > 0 or a crash signal of a worker that made
    no batch; not SIGKILL (the OOM killer, task_timeout_s), not an unknown status, not a worker
    that had made batches."""
    from collections import deque
    from multiprocessing import Pipe
    from types import SimpleNamespace

    from prefetchd.executors.pool import Pool, Worker

    pool = Pool(SimpleNamespace(buffer_dir=str(tmp_path)), 0)
    cases = [(-signal.SIGKILL, False, 0), (None, False, 0), (-signal.SIGTERM, False, 0), (-signal.SIGSEGV, True, 0),
             (1, True, 0), (-signal.SIGSEGV, False, 1), (-signal.SIGBUS, False, 1), (-signal.SIGABRT, False, 1),
             (1, False, 1), (255, False, 1)]
    for wid, (code, made, counted) in enumerate(cases):
        before = pool.crashes_before_a_batch
        a, b = Pipe()
        b.close()
        w = Worker(wid, SimpleNamespace(), a, tasks=deque(), code=code, made=made)
        pool.workers[wid] = w
        pool._bury(w)
        assert pool.crashes_before_a_batch - before == counted, (code, made)
    assert pool.restarts == len(cases)  # every death is still counted as a restart


def test_lowering_the_worker_count_does_not_stall_the_loop_and_leaves_shared_helpers_alone(tmp_path, image_root):
    """A surplus worker that does not exit at once (here: stopped) is reaped later, escalating
    to a kill, while ``results()`` returns at once; ``Pool.stop`` leaves the process-wide
    forkserver to the CLI's exit, for other multiprocessing users of this process."""
    from multiprocessing import forkserver

    from prefetchd.core.config import load as load_config
    from prefetchd.daemon.loop import Daemon

    d = Daemon(load_config(small_config(tmp_path, image_root, workers={"count": 2})))
    assert d._setup()
    try:
        pool = d.pool
        wait_until(lambda: pool.results() and all(w.ready for w in pool.workers.values()), 30, "workers ready")
        ws = list(pool.workers.values())
        for w in ws:
            os.kill(w.process.pid, signal.SIGSTOP)
        pool.resize(1)
        t0 = time.monotonic()
        pool.results()
        assert time.monotonic() - t0 < 1.0  # was 3 + 2 + 1 s of joins per surplus worker
        assert len(pool.workers) == 1
        gone = [w for w in ws if w.wid not in pool.workers]
        wait_until(lambda: pool.results() is not None and not pool._stopping, 15, "the surplus worker reaped")
        assert not gone[0].process.is_alive()
        for w in pool.workers.values():
            os.kill(w.process.pid, signal.SIGCONT)
        server = forkserver._forkserver._forkserver_pid
    finally:
        d._teardown()
    assert server is not None and forkserver._forkserver._forkserver_pid == server
    os.kill(server, 0)  # still running: only `prefetchd run`'s exit stops it


def test_deaths_once_the_daemon_is_stopping_are_neither_said_nor_replaced(tmp_path, image_root, caplog):
    """A stop signal recorded, the loop's last turn finds workers and the forkserver dead (a
    group SIGKILL, a helper that went its own way): part of the stop, not a fault. They were
    said as ERRORs, counted as restarts and replaced, the new processes killed moments later."""
    from prefetchd.core.config import load as load_config
    from prefetchd.daemon.loop import Daemon
    from prefetchd.executors import helpers

    d = Daemon(load_config(small_config(tmp_path, image_root, workers={"count": 2})))
    assert d._setup()
    try:
        pool = d.pool
        wait_until(lambda: pool.results() and all(w.ready for w in pool.workers.values()), 30, "workers ready")
        fs = pool.helpers.pids()[helpers.FORKSERVER]
        workers = pool.pids()
        d._stop = True  # what the stop signal's handler records
        for pid in [*workers, fs]:
            os.kill(pid, signal.SIGKILL)
        wait_until(lambda: pool.results() is not None and not pool.workers, 10, "the deaths noticed")
        for _ in range(3):
            pool.results()
        assert pool.restarts == 0 and pool.helpers.restarts == {helpers.FORKSERVER: 0, helpers.TRACKER: 0}
        assert pool.helpers.pids()[helpers.FORKSERVER] == fs and not pool.workers  # none started anew
        assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    finally:
        d._teardown()


def test_a_due_retry_with_no_free_slot_does_not_spin_the_loop(tmp_path, image_root):
    """A failed batch past its back-off that cannot go out (every worker slot taken) must not
    make the loop wait 0 s: it would spin a core. Worker results and progress wake it."""
    import threading

    from prefetchd.core.config import load as load_config
    from prefetchd.daemon.loop import Daemon

    d = Daemon(load_config(small_config(tmp_path, image_root, workers={"count": 1, "max_tasks_in_flight": 2},
                                        progress={"poll_interval_s": 0.5})))
    assert d._setup()
    pool = d.pool
    try:
        wait_until(lambda: pool.results() and all(w.ready for w in pool.workers.values()), 30, "workers ready")
        for w in pool.workers.values():
            os.kill(w.process.pid, signal.SIGSTOP)  # they keep their tasks: no slot comes free
        d._schedule()
        assert pool.idle() == 0
        key = next(iter(pool.workers.values())).tasks[0]
        key = (key.rank, key.epoch, key.batch)
        assert d.planner.finished(key)
        d.planner.failed(key, time.monotonic() - 100)  # due long ago
        calls = []
        schedule = d._schedule
        d._schedule = lambda: (calls.append(1), schedule())
        threading.Timer(1.0, lambda: (setattr(d, "_stop", True), d._wake())).start()
        d._loop()
        assert len(calls) < 50, f"{len(calls)} loop turns in 1 s"  # spinning made tens of thousands
    finally:
        for w in pool.workers.values():
            os.kill(w.process.pid, signal.SIGCONT)
        d._teardown()


def test_a_replaced_lock_file_does_not_make_a_running_daemon_look_stopped(tmp_path, image_root, daemon_factory):
    """`rm daemon.lock; touch daemon.lock`: a new, unlocked file; the directory's lock is the truth."""
    cfg = small_config(tmp_path, image_root)
    buf = str(tmp_path / "buffer")
    d = daemon_factory(cfg)
    wait_until(lambda: len(published(buf)) == 4, 30, "a full buffer")
    os.kill(d.pid, signal.SIGSTOP)  # it would make the file again within a second
    try:
        os.unlink(os.path.join(buf, status.LOCK_NAME))
        open(os.path.join(buf, status.LOCK_NAME), "w").close()
        assert status.daemon_alive(buf) is True
    finally:
        os.kill(d.pid, signal.SIGCONT)
    assert d.stop() == 0
    assert status.daemon_alive(buf) is False  # stopped: neither lock is held


def test_a_deleted_lock_file_does_not_let_a_second_daemon_take_the_buffer(tmp_path, image_root, daemon_factory):
    cfg = small_config(tmp_path, image_root)
    buf = str(tmp_path / "buffer")
    d = daemon_factory(cfg)
    wait_until(lambda: len(published(buf)) == 4, 30, "a full buffer")
    os.unlink(os.path.join(buf, status.LOCK_NAME))
    assert status.daemon_alive(buf) is True  # the directory's lock still says so
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    other = small_config(other_dir, image_root, loader={"seed": 8}, buffer={"dir": buf})
    d2 = daemon_factory(other)
    assert d2.proc.wait(60) == 1
    assert f"another prefetchd (pid {d.pid}) already serves {buf}" in d2.log()
    assert len(published(buf)) == 4  # its batches are the first daemon's still
    wait_until(lambda: status.lock_pid(buf) == d.pid, 30, "daemon.lock made again by its daemon")
    # the file is made before the line is logged: wait for the line, not only the file
    wait_until(lambda: "was removed or replaced; made it again" in d.log(), 10, "the line saying so")
    got = collect(cfg)
    ref, _ = reference_batches(cfg)
    assert digest(got) == digest({k: v[:2] for k, v in ref.items()})
    assert d.stop() == 0


def test_a_scan_ending_after_a_stop_during_it_writes_to_no_closed_descriptor(tmp_path, image_root, monkeypatch):
    """A stop during the dataset scan: the daemon returns and closes its wake pipe while the scan
    thread still runs; when the scan ends it must not write to the closed descriptor (a traceback
    in the journal, or a byte into whatever file took the number since)."""
    import threading

    from prefetchd.core.config import load as load_config
    from prefetchd.daemon import loop

    d = loop.Daemon(load_config(small_config(tmp_path, image_root)))
    release, errors = threading.Event(), []
    real = loop.load_index

    def slow(*a, **kw):
        os.kill(os.getpid(), signal.SIGTERM)  # the stop arrives during the scan, handled on the main thread as always
        release.wait(30)
        return real(*a, **kw)

    monkeypatch.setattr(loop, "load_index", slow)
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    assert d.run() == 0  # returned during the scan: its wake pipe is closed
    files = [str(tmp_path / f"later-{k}") for k in range(4)]  # the numbers reused, as later opens would
    taken = [os.open(f, os.O_WRONLY | os.O_CREAT) for f in files]
    try:
        release.set()
        for t in [t for t in threading.enumerate() if t.name == "prefetchd-index"]:
            t.join(30)
    finally:
        for fd in taken:
            os.close(fd)
    assert not errors, errors  # (EBADF: the number not reused)
    assert [os.path.getsize(f) for f in files] == [0] * 4  # (a byte in another file: the number reused)
