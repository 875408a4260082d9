"""Process tests: the real daemon, started as a user starts it, driven through the real client."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import small_config, wait_until
from prefetchd_client import PrefetchClient, PrefetchTimeout

from prefetchd.core.config import load as load_config
from prefetchd.core.sampler import for_index
from prefetchd.executors.worker import BatchMaker, WorkerSetup
from prefetchd.format import batchfile, status
from prefetchd.sources.dataset import load_index


def reference_batches(cfg_path: str, epochs: int = 2):
    """Every batch made in-process, one at a time: what the daemon must deliver, byte for byte."""
    cfg = load_config(cfg_path)
    index, _ = load_index(cfg.dataset.root, None, cfg.dataset.extensions, cfg.dataset.cache_dir)
    L = cfg.loader
    sampler = for_index(L, index)
    maker = BatchMaker(WorkerSetup(cfg, index.files_dir, None, 0, cfg.buffer.dir))
    out = {}
    for e in range(epochs):
        for r in L.ranks:
            for b in range(sampler.batches_per_epoch):
                images, used, labels, _, _ = maker.fill(e, sampler.batch_indices(e, r, b))
                out[(r, e, b)] = (images.copy(), labels.copy(), used.copy())
    return out, index


def collect(cfg_path: str, rank: int = 0, epochs=(0, 1), timeout: float = 60):
    got = {}
    with PrefetchClient(cfg_path, rank=rank, timeout=timeout, as_numpy=True) as c:
        for e in epochs:
            for b, (x, y) in enumerate(c.iter_epoch(e)):
                got[(rank, e, b)] = (np.ascontiguousarray(x.transpose(0, 2, 3, 1)), y.copy())
    return got


def digest(batches) -> str:
    h = hashlib.sha256()
    for k in sorted(batches):
        h.update(repr(k).encode())
        for a in batches[k][:2]:
            h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def published(buffer_dir: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir(buffer_dir) if n.endswith(batchfile.SUFFIX))
    except FileNotFoundError:
        return []


def same_batches(got: dict, ref: dict) -> None:
    """``got`` holds every batch of ``ref`` (``reference_batches``), images and labels byte for byte."""
    assert sorted(got) == sorted(ref)
    for key in ref:
        assert np.array_equal(got[key][0], ref[key][0]) and np.array_equal(got[key][1], ref[key][1]), key


def _hwc(x, y) -> tuple:
    return np.ascontiguousarray(x.transpose(0, 2, 3, 1)), y.copy()


def read_across_a_restart(cfg: str, daemon_factory, after: int = 3, take=_hwc, **client) -> dict:
    """Rank 0's batches of epochs 0 and 1 as a trainer reads them when the daemon is stopped after
    its first ``after`` and started again, the trainer resuming from its ``state_dict`` (both daemons
    stop cleanly, with no traceback): ``take(images, labels)`` of each, read by a ``PrefetchClient``
    with ``client``'s options (default ``as_numpy=True``)."""
    buf = load_config(cfg).buffer.dir
    client = {"as_numpy": True, **client}
    d = daemon_factory(cfg)
    got = {}
    with PrefetchClient(cfg, rank=0, timeout=60, **client) as c:
        for b, (x, y) in enumerate(c.iter_epoch(0)):
            got[(0, 0, b)] = take(x, y)
            if b + 1 == after:
                break
        state = c.state_dict()
    assert d.stop() == 0
    d2 = daemon_factory(cfg)
    wait_until(lambda: status.daemon_alive(buf), 60, "the second daemon")
    with PrefetchClient(cfg, rank=0, timeout=60, **client) as c:
        c.load_state_dict(state)
        for e in (0, 1):
            for b, (x, y) in enumerate(c.iter_epoch(e), start=c.batch if e == c.epoch else 0):
                got[(0, e, b)] = take(x, y)
    assert d2.stop() == 0
    assert "Traceback" not in d.log() + d2.log()
    return got


def test_two_epochs_arrive_in_order_with_correct_labels_and_bytes(tmp_path, image_root, daemon_factory):
    cfg = small_config(tmp_path, image_root)
    d = daemon_factory(cfg)
    got = collect(cfg)
    ref, index = reference_batches(cfg)
    assert sorted(got) == sorted(ref) and len(got) == 16  # 8 batches x 2 epochs, nothing missing or extra
    classes = sorted(os.listdir(image_root))
    for key, (images, labels) in got.items():
        ref_images, ref_labels, used = ref[key]
        # labels: the index of the sample's class folder among the sorted names
        expect = [classes.index(os.path.basename(os.path.dirname(index.path(i)))) for i in used]
        assert labels.tolist() == expect == ref_labels.tolist()
        assert np.array_equal(images, ref_images), key
    assert d.stop() == 0
    assert "Traceback" not in d.log()


def test_bytes_do_not_depend_on_worker_count(tmp_path, image_root, daemon_factory):
    digests = []
    for workers in (1, 3):
        run_dir = tmp_path / f"w{workers}"
        run_dir.mkdir()
        cfg = small_config(run_dir, image_root, workers={"count": workers, "max_tasks_in_flight": 1 + workers % 2})
        d = daemon_factory(cfg)
        digests.append(digest(collect(cfg)))
        assert d.stop() == 0
    assert digests[0] == digests[1]


TRAINER = r"""
import json, sys
import numpy as np
from prefetchd_client import PrefetchClient
cfg, state_path, out_path = sys.argv[1:4]
with PrefetchClient(cfg, timeout=60, as_numpy=True) as c:
    try:
        c.load_state_dict(json.load(open(state_path)))
    except FileNotFoundError:
        pass
    for epoch in range(c.epoch, 2):
        for x, y in c.iter_epoch(epoch):
            with open(out_path, "ab") as f:
                np.save(f, np.ascontiguousarray(x)); np.save(f, y)
            json.dump(c.state_dict(), open(state_path + ".tmp", "w"))
            import os; os.replace(state_path + ".tmp", state_path)
            print("batch", flush=True)
            sys.stdin.readline()  # the test says when to go on: a kill never lands mid-write
"""


def _load_stream(path):
    out = []
    with open(path, "rb") as f:
        while True:
            try:
                out.append((np.load(f), np.load(f)))
            except (EOFError, ValueError):
                return out


def test_trainer_killed_and_restarted_resumes_with_identical_batches(tmp_path, image_root, daemon_factory):
    cfg = small_config(tmp_path, image_root)
    d = daemon_factory(cfg)
    state, out = str(tmp_path / "state.json"), str(tmp_path / "seen.npy")
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    p = subprocess.Popen([sys.executable, str(script), cfg, state, out], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    for i in range(5):  # let it train five batches, then kill it without warning
        assert p.stdout.readline().startswith("batch")
        if i < 4:
            p.stdin.write("\n")
            p.stdin.flush()
    p.send_signal(signal.SIGKILL)
    p.wait(10)
    p.stdin.close()
    before = _load_stream(out)
    # state.json is replaced after each saved batch: the killed trainer resumes right after it
    assert json.load(open(state))["batch"] == len(before)
    r = subprocess.run([sys.executable, str(script), cfg, state, out], capture_output=True, text=True, timeout=120,
                       input="\n" * 32)
    assert r.returncode == 0, r.stderr
    seen = _load_stream(out)
    ref = collect_reference_in_order(cfg)
    assert len(seen) == len(ref) == 16
    for (x, y), (rx, ry) in zip(seen, ref, strict=True):
        assert np.array_equal(x, rx) and np.array_equal(y, ry)
    assert d.stop() == 0


def collect_reference_in_order(cfg):
    ref, _ = reference_batches(cfg)
    return [(ref[k][0].transpose(0, 3, 1, 2), ref[k][1]) for k in sorted(ref)]


def test_consumed_batches_are_deleted_and_the_buffer_stays_bounded(tmp_path, image_root, daemon_factory):
    batch_bytes = batchfile.max_file_size(6, 64, 64)
    cfg = small_config(tmp_path, image_root, buffer={"capacity": 4, "refill_at": 2, "max_bytes": 3 * batch_bytes})
    buf = str(tmp_path / "buffer")
    peak = {"files": 0, "bytes": 0}
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            files = [n for n in os.listdir(buf) if n.endswith(".batch") or n.startswith(".tmp-")] if os.path.isdir(buf) else []
            size = 0
            for n in files:
                try:
                    size += os.path.getsize(os.path.join(buf, n))
                except FileNotFoundError:
                    pass
            peak["files"] = max(peak["files"], len(files))
            peak["bytes"] = max(peak["bytes"], size)
            time.sleep(0.002)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    d = daemon_factory(cfg)
    with PrefetchClient(cfg, timeout=60, as_numpy=True) as c:
        for b, _ in enumerate(c.iter_epoch(0)):
            time.sleep(0.05)  # a slow trainer: the daemon runs ahead and must stop at the bounds
            # batches before the one just read are consumed: the daemon deletes them
            wait_until(lambda b=b: all(batchfile.parse_name(n)[2] >= b for n in published(buf)
                                       if batchfile.parse_name(n)[1] == 0), 10, f"eviction of batches before {b}")
    stop.set()
    t.join()
    assert peak["files"] <= 3 and peak["bytes"] <= 3 * batch_bytes, peak  # max_bytes binds before capacity
    assert d.stop() == 0


def test_sigterm_under_load_stops_cleanly_without_temp_files(tmp_path, image_root, daemon_factory):
    cfg = small_config(tmp_path, image_root, loader={"epochs": None}, buffer={"capacity": 30})
    buf = str(tmp_path / "buffer")
    d = daemon_factory(cfg)
    wait_until(lambda: len(published(buf)) >= 2, 30, "the first batches")
    t0 = time.monotonic()
    assert d.stop(signal.SIGTERM, timeout=10) == 0
    assert time.monotonic() - t0 < 5
    assert not [n for n in os.listdir(buf) if n.startswith(".tmp-")]
    assert "stopping" in d.log()


def _session_members(sid: int) -> list[str]:
    """Live processes (zombies aside) of session ``sid``: what systemd would SIGKILL at the stop."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state ppid pgrp session ...
        if int(fields[3]) == sid and fields[0] != "Z":
            out.append(f"{pid} {cmd}")
    return out


def test_sigterm_leaves_no_process_of_the_daemon_behind(tmp_path, image_root, daemon_factory):
    """systemd (KillMode=mixed) SIGKILLs whatever of the unit is alive when the main process exits:
    workers, the forkserver and the resource tracker must all be gone before the daemon exits."""
    cfg = small_config(tmp_path, image_root, loader={"epochs": None}, buffer={"capacity": 30})
    d = daemon_factory(cfg)
    wait_until(lambda: len(published(str(tmp_path / "buffer"))) >= 2, 30, "the first batches")
    assert len(_session_members(d.pid)) >= 4  # the daemon, its forkserver, tracker and workers
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(timeout=10) == 0
    assert _session_members(d.pid) == []


def _took(pid: int, sig: int) -> bool:
    """``pid`` has dealt with ``sig``: it died (of it), or it ignores or blocks it (never will)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            text = f.read()
    except OSError:
        return True
    masks = dict(line.split(":\t", 1) for line in text.splitlines() if line.startswith(("SigIgn", "SigBlk")))
    return "\nState:\tZ" in text or any(int(m, 16) >> (sig - 1) & 1 for m in masks.values())


@pytest.mark.parametrize("daemon_last", [False, True], ids=["at-once", "daemon-last"])
def test_sigterm_to_the_daemons_group_under_load_is_one_quiet_stop(tmp_path, image_root, daemon_factory, daemon_last):
    """``scancel``, ``timeout``, ``kill -TERM -PGID`` signal every process of the daemon's group.
    Its forkserver and busy workers died of it and the daemon, whose loop turned once more, said
    ``ERROR ... the forkserver (pid N) was killed by SIGTERM; started a new one`` and replaced the
    workers, during the stop. ``daemon-last`` holds the daemon (SIGSTOP) until every other process
    of its group has taken the signal, as on a machine where they die before its loop turns."""
    cfg = small_config(tmp_path, image_root, loader={"epochs": None}, workers={"count": 3},
                       buffer={"capacity": 400, "refill_at": 399, "max_bytes": "512MiB"})
    d = daemon_factory(cfg)
    buf = str(tmp_path / "buffer")
    wait_until(lambda: len(published(buf)) >= 2, 30, "the first batches")
    before = {int(m.split()[0]) for m in _session_members(d.pid)}
    assert len(before) >= 6, before  # the daemon, its forkserver, tracker and 3 workers, making batches
    if daemon_last:
        os.kill(d.pid, signal.SIGSTOP)
    os.killpg(d.pid, signal.SIGTERM)
    if daemon_last:
        try:
            wait_until(lambda: all(_took(pid, signal.SIGTERM) for pid in before - {d.pid}), 20,
                       "the daemon's other processes to take the signal")
        finally:
            os.kill(d.pid, signal.SIGCONT)
    seen: set[int] = set()

    def stopped() -> bool:
        seen.update(int(m.split()[0]) for m in _session_members(d.pid))
        return d.proc.poll() is not None

    wait_until(stopped, 15, "the daemon to stop")
    log = d.log()
    assert d.proc.returncode == 0, log
    assert " ERROR " not in log, log
    assert seen <= before, f"started after the signal: {sorted(seen - before)}\n{log}"
    st = status.read_json(buf, status.STATUS_NAME)
    assert st["state"] == "stopped", st
    assert (st["worker_restarts"], st["forkserver_restarts"], st["resource_tracker_restarts"]) == (0, 0, 0), st
    assert _session_members(d.pid) == []


def test_status_command_shows_the_running_daemon(tmp_path, image_root, daemon_factory):
    cfg = small_config(tmp_path, image_root)
    d = daemon_factory(cfg)
    buf = str(tmp_path / "buffer")
    wait_until(lambda: (status.read_json(buf, status.STATUS_NAME) or {}).get("ranks", {}).get("0", {}).get("ready", 0) >= 4,
               30, "a full buffer in status.json")
    r = subprocess.run([sys.executable, "-m", "prefetchd", "status", "--config", cfg, "--json"], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0
    s = json.loads(r.stdout)
    assert s["alive"] is True and s["status"]["pid"] == d.pid
    assert s["status"]["ranks"]["0"]["position"] == [0, 0] and s["status"]["workers"] == 2
    r = subprocess.run([sys.executable, "-m", "prefetchd", "status", "--config", cfg], capture_output=True, text=True,
                       timeout=30)
    assert "rank 0: trainer at epoch 0 batch 0; ready 4/4" in r.stdout
    assert "restarts 0, timeouts 0)" in r.stdout and "failed batches 0" in r.stdout, r.stdout
    d.stop()
    r = subprocess.run([sys.executable, "-m", "prefetchd", "status", "--config", cfg], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 3 and "not running" in r.stdout


def test_status_text_shows_timeouts_failed_batches_and_the_respawn_back_off():
    rec = {"pid": 9, "state": "running", "updated": time.time(), "workers": 4, "workers_alive": 3,
           "worker_restarts": 5, "worker_timeouts": 2, "worker_respawn_in_s": 1.6, "failed_batches": 7,
           "main_cpu_s": 12.34, "capacity": 8,
           "ranks": {"0": {"position": [1, 2], "ready": 3, "in_flight": 1, "retrying": 2, "ahead": 1}}}
    text = status.format_status(rec, True)
    assert ("workers 3/4 (busy 0%, restarts 5, timeouts 2); the next worker starts in 1.6 s (back-off); "
            "forkserver restarts 0, resource tracker restarts 0") in text, text
    rec.update(forkserver_restarts=3, resource_tracker_restarts=1)
    assert "; forkserver restarts 3, resource tracker restarts 1" in status.format_status(rec, True)
    assert "failed batches 7 (each tried again after a back-off)" in text, text
    assert "main process CPU 12.3 s" in text, text
    assert "(+1 in flight, 2 failed waiting to be tried again)" in text, text


def test_client_without_daemon_times_out_saying_what_it_waited_for(tmp_path, image_root):
    cfg = small_config(tmp_path, image_root)
    t0 = time.monotonic()
    with pytest.raises(PrefetchTimeout) as ei:
        with PrefetchClient(cfg, timeout=0.5) as c:
            next(iter(c.iter_epoch(0)))
    assert time.monotonic() - t0 < 5
    assert "meta.json" in str(ei.value) and "no daemon holds" in str(ei.value)


def test_second_daemon_on_the_same_buffer_is_refused(tmp_path, image_root, daemon_factory):
    cfg = small_config(tmp_path, image_root)
    daemon_factory(cfg)
    wait_until(lambda: status.daemon_alive(str(tmp_path / "buffer")), 30, "the first daemon")
    second = daemon_factory(cfg)
    assert second.proc.wait(30) == 1
    assert "already serves" in second.log()
