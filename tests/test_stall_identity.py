"""A stalled rank's trainer named by pid (issue 35) attacked: a pid is not a process. The pid of
a trainer that exited may now be another process's, and the pid of a trainer in a container (a
Kubernetes pod's other container) means nothing to a daemon outside its pid namespace: a
container's pid 1 is the host's init, always "running". The trainer says who it is (start time,
pid namespace) in its progress file; the daemon says "gone" for a reused pid and "unknown" for
another namespace's, never the state of an unrelated process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from conftest import small_config, wait_until

from prefetchd.daemon.stalls import StallWatch
from prefetchd.format import procstate, progress, status


def test_a_reused_pid_is_gone_and_another_namespaces_pid_unknown():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with open(f"/proc/{p.pid}/stat", "rb") as f:
            start = procstate.parse_start(f.read())
        me_ns = procstate.pid_namespace()
        assert start and me_ns
        assert procstate.state(p.pid, start, me_ns) == "running"
        assert procstate.state(p.pid, start + 1, me_ns) == "gone"  # the trainer's pid, another process now
        assert procstate.state(p.pid, 0, me_ns + 1) == "unknown"  # a pid of a container's namespace
        assert procstate.state(p.pid) == "running"  # an older trainer that says nothing of itself
    finally:
        p.kill()
        p.wait(5)
    assert procstate.identity() == (procstate.parse_start(open("/proc/self/stat", "rb").read()), me_ns)


def test_stall_watch_names_no_unrelated_process(caplog):
    w = StallWatch(after_s=30.0)
    start, ns = procstate.identity()
    other_ns = (0, ns + 1)
    with caplog.at_level("WARNING", logger="prefetchd"):
        st = w.check(0, 1000.0, 10.0, 1, False, True, other_ns)  # a container's trainer, pid 1 there
        assert st["process"] == "unknown"
        assert w.check(1, 1000.0, 10.0, os.getpid(), False, True, (start + 1, ns))["process"] == "gone"
        assert w.check(2, 1000.0, 10.0, 1, False, False, other_ns) is None  # a file left by an earlier run
    since = time.strftime("%H:%M:%S", time.localtime(10.0))
    assert status.describe_stall(st).endswith(f"(since {since}; pid 1 in another pid namespace, its state unknown)")
    assert "pid 1 in another pid namespace" in caplog.text and "pid 1 running" not in caplog.text


def test_the_daemon_says_a_containers_stalled_trainer_is_unknown_and_a_trainer_says_who_it_is(
        tmp_path, image_root, daemon_factory):
    from prefetchd_client import PrefetchClient

    cfg = small_config(tmp_path, image_root)
    buf = str(tmp_path / "buffer")
    d = daemon_factory(cfg, env={"PREFETCHD_STALL_AFTER_S": "2"})
    with PrefetchClient(cfg, timeout=60, as_numpy=True) as c:
        it = c.iter_epoch(0)
        next(it)
        next(it)
        pdir = c.progress_dir
    p = progress.read(progress.progress_path(pdir, 0))
    assert (p.pid, p.pid_start, p.pid_ns) == (os.getpid(), *procstate.identity())
    # the same rank read from a container: pid 1 in a namespace of its own, then it stops moving
    progress.write(pdir, progress.Progress(rank=0, epoch=0, batch=3, fingerprint=p.fingerprint, pid=1,
                                           time=p.time, session="1-container.0", pid_start=7, pid_ns=p.pid_ns + 1))

    def stall():
        return ((status.read_json(buf, status.STATUS_NAME) or {}).get("ranks", {}).get("0", {}).get("stalled")
                or {})

    st = wait_until(lambda: stall().get("pid") == 1 and stall(), 30, "rank 0 stalled")
    assert st["process"] == "unknown", st
    assert "pid 1 in another pid namespace, its state unknown" in d.log() and "pid 1 running" not in d.log()
    assert d.stop() == 0


def test_a_trainer_does_not_call_a_daemon_of_another_pid_namespace_stopped_by_its_own_pid(tmp_path, monkeypatch):
    """The daemon as a pod's sidecar is pid 1 of its own namespace: the trainer's pid 1 is another
    process, stopped or not; status.json says the daemon's namespace (pid_ns)."""
    from prefetchd_client import reader

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        wait_until(lambda: procstate.state(child.pid) == "stopped", 5, "stopped")

        class Files(reader.BatchFiles):
            dir, split, rank, _lane, progress_dir = str(tmp_path), "train", 0, 0, str(tmp_path)

            def _permission_denied(self):
                return None

        monkeypatch.setattr(reader.status, "daemon_alive", lambda d: True)
        for ns, stopped in ((procstate.pid_namespace(), True), (procstate.pid_namespace() + 1, False)):
            rec = {"pid": child.pid, "pid_ns": ns, "updated": time.time(), "ranks": {}}
            monkeypatch.setattr(reader.status, "read_json", lambda d, name, rec=rec: rec)
            said = Files()._daemon_state()
            assert ("alive but stopped" in said) == stopped, said
    finally:
        child.kill()
        child.wait(5)


def test_a_process_proc_hides_is_unknown_not_gone(monkeypatch):
    """/proc mounted hidepid=2 (hardened hosts, some clusters): a trainer of another user has no
    /proc/<pid> for the daemon's user, yet it runs (kill(pid, 0) says EPERM)."""
    real_open = open

    def hidden(path, *a, **k):
        if str(path).startswith(("/proc/4242/", "/proc/4243/")):
            raise FileNotFoundError(path)
        return real_open(path, *a, **k)

    def kill(pid, sig):
        if pid == 4242:
            raise PermissionError(1, "Operation not permitted")
        raise ProcessLookupError(3, "No such process")

    monkeypatch.setattr("builtins.open", hidden)
    monkeypatch.setattr(procstate.os, "kill", kill)
    assert procstate.state(4242) == "unknown"
    assert procstate.state(4243) == "gone"


def test_a_pid_no_process_can_have_is_gone_and_kills_nothing():
    """A hostile progress file's pid beyond any pid_t (2**31 and up: os.kill raised OverflowError,
    which escaped the loop's status write and the two-trainers check and ended the daemon)."""
    for pid in (2**31, 2**62, procstate.PID_MAX_LIMIT + 1):
        assert procstate.state(pid) == "gone"
        assert procstate.state(pid, 5, procstate.pid_namespace()) == "gone"
    assert procstate._by_signal(2**31) == "gone"
    w = StallWatch(after_s=30.0)
    assert w.check(0, 1000.0, 10.0, 2**62, False, True, (0, 0))["process"] == "gone"
