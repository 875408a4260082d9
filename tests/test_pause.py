"""A trainer paused, stalled or suspended (issue 35): a pause of the trainer (SIGSTOP, a breakpoint,
a long checkpoint write) never ends its run nor counts as waiting for data; a daemon that really
makes nothing still times it out, saying so; and the daemon names a rank whose trainer stopped
moving, with since when and its process's state."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import aptools
import pytest
from conftest import small_config, wait_until
from test_daemon import published

from prefetchd.format import procstate, status

TIMEOUT_S = 2.0
PAUSE_S = 3 * TIMEOUT_S

# a trainer of epoch 0 that prints, after each batch, its number and the client's wait counter;
# after batch 3 it pauses in Python for argv[2] seconds; argv[3] is its timeout (a breakpoint, a checkpoint write)
_TRAINER = """
import json, sys, time
from prefetchd_client import PrefetchClient
cfg, pause_s, timeout = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
with PrefetchClient(cfg, timeout=timeout, as_numpy=True) as c:
    for x, y in c.iter_epoch(0):
        print(json.dumps({"batch": c.last_batch.batch, "wait_s": c.wait_s}), flush=True)
        if c.last_batch.batch == 3 and pause_s:
            time.sleep(pause_s)
print(json.dumps({"done": True, "wait_s": c.wait_s}), flush=True)
"""


class Trainer:
    """The trainer script in a process of its own (so it can be stopped), its lines collected."""

    def __init__(self, cfg: str, pause_s: float = 0.0):
        self.err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-c", _TRAINER, cfg, str(pause_s), str(TIMEOUT_S)], stdout=subprocess.PIPE,
                                     stderr=self.err, text=True, start_new_session=True)
        self.lines: list[dict] = []
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.lines.append(json.loads(line))

    def after(self, batch: int) -> dict | None:
        return next((x for x in self.lines if x.get("batch") == batch), None)

    def finish(self, timeout: float = 60.0) -> str:
        try:
            self.proc.wait(timeout)
        finally:
            self.kill()
        self._t.join(5)
        self.err.seek(0)
        return self.err.read().decode(errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)


def _stalled_reader(tmp_path, image_root, daemon_factory, pause_s: float = 0.0):
    """A daemon stopped with 4 batches ready, and a trainer that read them and waits for batch 4."""
    cfg = small_config(tmp_path, image_root, loader={"epochs": 1})
    buf = str(tmp_path / "buffer")
    d = daemon_factory(cfg)
    wait_until(lambda: len(published(buf)) == 4, 30, "a full buffer")
    os.killpg(d.pid, signal.SIGSTOP)
    t = Trainer(cfg, pause_s)
    wait_until(lambda: t.after(3), 60, "the trainer's first 4 batches")
    return d, t


def _reads_on_without_counting_the_pause(t: Trainer) -> None:
    err = t.finish()
    assert t.proc.returncode == 0, err
    assert [x["batch"] for x in t.lines[:-1]] == list(range(8)) and t.lines[-1]["done"]
    grew = t.after(4)["wait_s"] - t.after(3)["wait_s"]
    assert grew < 1.0, f"the pause of {PAUSE_S} s counted as {grew:.1f} s of waiting for batch 4"


@pytest.mark.parametrize("daemon_too", [False, True], ids=["trainer-stopped", "trainer-and-daemon-stopped"])
def test_a_trainer_sigstopped_for_three_timeouts_reads_on_and_counts_no_wait(tmp_path, image_root, daemon_factory,
                                                                             daemon_too):
    d, t = _stalled_reader(tmp_path, image_root, daemon_factory)
    try:
        wait_until(lambda: procstate.state(t.proc.pid) == "running", 5, "the trainer")
        threading.Event().wait(0.3)  # the trainer is in next(), waiting for batch 4 (its reader too)
        os.kill(t.proc.pid, signal.SIGSTOP)  # Slurm's `scontrol suspend`, a shell's Ctrl-Z
        wait_until(lambda: procstate.state(t.proc.pid) == "stopped", 5, "the trainer stopped")
        if not daemon_too:  # the daemon makes batch 4 while the trainer is stopped
            os.killpg(d.pid, signal.SIGCONT)
        threading.Event().wait(PAUSE_S)  # the pause under test
        # both stopped (a whole job suspended): batch 4 is made only once they go on
        os.killpg(d.pid, signal.SIGCONT)
        os.kill(t.proc.pid, signal.SIGCONT)
        _reads_on_without_counting_the_pause(t)
    finally:
        os.killpg(d.pid, signal.SIGCONT)
        t.kill()
    assert d.stop() == 0


def test_a_trainer_paused_in_python_for_three_timeouts_reads_on_and_counts_no_wait(tmp_path, image_root,
                                                                                   daemon_factory):
    # the trainer sleeps PAUSE_S after batch 3 (a breakpoint, a checkpoint write); its reader waits
    # for batch 4, which the daemon, stalled for longer than the timeout meanwhile, makes only
    # before the trainer asks for it: the timeout runs from the trainer's asking, not the reader's
    d, t = _stalled_reader(tmp_path, image_root, daemon_factory, pause_s=PAUSE_S)
    try:
        threading.Event().wait(TIMEOUT_S + 1.0)  # longer than the timeout into the pause
        os.killpg(d.pid, signal.SIGCONT)
        _reads_on_without_counting_the_pause(t)
    finally:
        os.killpg(d.pid, signal.SIGCONT)
        t.kill()
    assert d.stop() == 0


def test_process_state_reads_proc():
    assert procstate.state(os.getpid()) == "running"
    assert procstate.parse_stat(b"42 (a) b (c)) T 1 2 3") == "T"
    assert procstate.parse_stat(b"garbage") is None
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(p.pid, signal.SIGSTOP)
        wait_until(lambda: procstate.state(p.pid) == "stopped", 5, "stopped")
        os.kill(p.pid, signal.SIGCONT)
        wait_until(lambda: procstate.state(p.pid) == "running", 5, "running")
    finally:
        p.kill()
        p.wait(5)
    assert procstate.state(p.pid) == "gone" and procstate.state(0) == "gone"


def test_a_daemon_that_makes_nothing_still_times_the_trainer_out_saying_so(tmp_path, image_root, daemon_factory):
    from prefetchd_client import PrefetchClient, PrefetchTimeout

    cfg = small_config(tmp_path, image_root, loader={"epochs": 1})
    buf = str(tmp_path / "buffer")
    d = daemon_factory(cfg)
    wait_until(lambda: len(published(buf)) == 4, 30, "a full buffer")
    os.killpg(d.pid, signal.SIGSTOP)
    try:
        with PrefetchClient(cfg, timeout=TIMEOUT_S, as_numpy=True) as c:
            it = c.iter_epoch(0)
            for _ in range(4):
                next(it)
            t0 = time.monotonic()
            with pytest.raises(PrefetchTimeout) as ei:
                next(it)
            took = time.monotonic() - t0
            wait_s = c.wait_s
    finally:
        os.killpg(d.pid, signal.SIGCONT)
    msg = str(ei.value)
    assert TIMEOUT_S <= took < TIMEOUT_S + 5 and wait_s >= TIMEOUT_S, (took, wait_s)
    assert msg.startswith("waited 2.0 s for rank 0 epoch 0 batch 4") and "not counting" not in msg, msg
    assert f"the daemon (pid {d.pid}) is alive but stopped, making nothing" in msg and f"kill -CONT {d.pid}" in msg
    assert d.stop() == 0


def test_the_wait_clock_leaves_out_the_spells_the_process_did_not_run():
    from prefetchd_client.clock import WaitClock

    t = [100.0]
    c = WaitClock(lambda: t[0], delay=lambda: 0.0)  # never on a run queue: not a loaded host
    for step in (0.005, 0.05, 30.0, 0.005, 0.5):  # a 30 s SIGSTOP between two polls
        t[0] += step
        c.tick()
    assert c.waited == pytest.approx(0.56) and c.frozen == pytest.approx(30.0)
    assert c.said() == "0.6 s (not counting 30 s in which this process was stopped)"
    assert c.said(limit=0.5) == "0.5 s (not counting 30 s in which this process was stopped)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> str:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return ""


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefetchd", *args], capture_output=True, text=True, timeout=60)


def test_a_stalled_rank_is_named_with_since_when_and_its_trainers_state_in_status_metrics_and_log(
        tmp_path, image_root, daemon_factory):
    port = _free_port()
    cfg = small_config(tmp_path, image_root, metrics={"enabled": True, "port": port})  # 2 epochs: never done here
    buf = str(tmp_path / "buffer")
    d = daemon_factory(cfg, env={"PREFETCHD_STALL_AFTER_S": "2"})

    def stall():
        return ((status.read_json(buf, status.STATUS_NAME) or {}).get("ranks", {}).get("0", {}).get("stalled")
                or {})

    t = Trainer(cfg, pause_s=10.0)  # reads 4 batches, then pauses in Python (its reader fills its queue)
    try:
        wait_until(lambda: t.after(3), 60, "the trainer's first 4 batches")
        st = wait_until(lambda: stall().get("process") == "running" and stall(), 30, "rank 0 stalled, running")
        assert st["pid"] == t.proc.pid and st["age_s"] >= 2
        os.kill(t.proc.pid, signal.SIGSTOP)
        st = wait_until(lambda: stall().get("process") == "stopped" and stall(), 30, "rank 0 stalled, stopped")
        since = time.strftime("%H:%M:%S", time.localtime(st["since"]))
        text = _cli("status", "--config", cfg).stdout
        assert re.search(rf"rank 0: .*; STALLED: no progress for \d+ s \(since {since}; pid {t.proc.pid} stopped\)",
                         text), text
        js = json.loads(_cli("status", "--json", "--config", cfg).stdout)["status"]["ranks"]["0"]["stalled"]
        assert js["pid"] == t.proc.pid and js["process"] == "stopped" and js["since"] == st["since"]
        m = wait_until(lambda: (x := _scrape(port)) and 'state="stopped"} 1.0' in x and x, 15, "metrics")
        assert 'prefetchd_rank_stalled{rank="0"} 1.0' in m
        assert 'prefetchd_rank_stalled_process{rank="0",state="running"} 0.0' in m
        ts = re.search(r'^prefetchd_rank_last_progress_timestamp_seconds\{rank="0"\} (\S+)$', m, re.M)
        assert ts and float(ts.group(1)) == pytest.approx(st["since"]), m
        os.kill(t.proc.pid, signal.SIGCONT)
        # it reads on (the daemon says so once), finishes epoch 0, closes its loader and exits 0:
        # rank 0 is finished, not stalled nor gone (its trainer has gone, but said it was done)
        err = t.finish()
        assert t.proc.returncode == 0, err
        m = wait_until(lambda: (x := _scrape(port)) and 'prefetchd_rank_trainer{rank="0",state="finished"} 1.0' in x
                       and x, 30, "rank 0 finished in the metrics")
        assert 'prefetchd_rank_stalled{rank="0"} 0.0' in m and 'state="gone"} 1.0' not in m, m
        # status.json is rewritten every second, not with the metrics: it says so at its next write
        wait_until(lambda: not stall(), 15, "status.json no longer saying rank 0 stalled")
    finally:
        t.kill()
    # said once each way: stall and move (or finished) lines alternate (a loaded machine may add a
    # spell as the trainer reads on or exits), the first of the Python pause, while its process ran
    said = re.findall(rf"rank 0: no progress for \d+ s \(since [\d:]+; pid {t.proc.pid} (\w+)\)|"
                      r"rank 0( moves again|'s trainer finished) after \d+ s without progress", d.log())
    kinds = ["stall" if x else "move" for x, _ in said]
    assert kinds[:2] == ["stall", "move"] and said[0][0] == "running", d.log()
    assert all(a != b for a, b in zip(kinds, kinds[1:], strict=False)), d.log()
    assert "process_resident_memory_bytes" in m and "process_cpu_seconds_total" in m
    assert re.search(r'^prefetchd_rank_consumed_batches_total\{rank="0"\} 8\.0$', m, re.M), m
    assert re.search(r"^prefetchd_consumed_batches_total 8\.0$", m, re.M), m
    assert re.search(r'^prefetchd_rank_ready_ratio\{rank="0"\} (0\.\d+|1\.0)$', m, re.M), m
    assert re.search(r"^prefetchd_samples_quarantined_total 0\.0$", m, re.M), m
    aptools.ensure({"promtool": "prometheus"})
    promtool = shutil.which("promtool")
    if promtool:
        r = subprocess.run([promtool, "check", "metrics"], input=m, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
    assert d.stop() == 0


ALERTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "prometheus")


def test_the_example_alert_rules_pass_promtool():
    aptools.ensure({"promtool": "prometheus"})
    promtool = shutil.which("promtool")
    for args in (["check", "rules", "alerts.yml"], ["test", "rules", "alerts_test.yml"]):
        r = subprocess.run([promtool, *args], cwd=ALERTS, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr


def test_status_says_a_stalled_rank_on_its_line():
    since = time.time() - 32
    rec = {"updated": time.time(), "state": "running", "capacity": 4, "ranks": {
        "0": {"position": [3, 7], "ready": 4, "ahead": 4,
              "stalled": {"since": since, "age_s": 32.4, "pid": 4242, "process": "stopped"}},
        "1": {"position": [3, 9], "ready": 2, "ahead": 2, "stalled": None}}}
    lines = status.format_status(rec, True).splitlines()
    hhmmss = time.strftime("%H:%M:%S", time.localtime(since))
    assert lines[-2].startswith("  rank 0: trainer at epoch 3 batch 7")
    assert lines[-2].endswith(f"; STALLED: no progress for 32 s (since {hhmmss}; pid 4242 stopped)")
    assert "STALLED" not in lines[-1]


def test_stall_watch_says_each_change_once_and_leaves_idle_or_done_ranks_alone(caplog):
    from prefetchd.daemon.stalls import StallWatch

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(30)
    w = StallWatch(after_s=30, clock=lambda: mono[0])
    mono = [0.0]
    check = w.check

    def check_at(rank, now, *args):  # the monotonic clock moves with the wall clock here
        mono[0] = now
        return check(rank, now, *args)

    w.check = check_at
    me = os.getpid()
    with caplog.at_level("INFO", logger="prefetchd"):
        assert w.check(0, 100.0, 90.0, me, False, True) is None
        st = w.check(0, 125.0, 90.0, me, False, True)
        assert st == {"since": 90.0, "age_s": 35.0, "pid": me, "process": "running"}
        assert w.check(0, 126.0, 90.0, me, False, True)["age_s"] == 36.0
        assert w.check(0, 127.0, 126.5, me, False, True) is None  # a record: it moves again
        assert w.check(1, 1000.0, 10.0, dead.pid, False, False) is None  # a file left by an earlier run
        assert w.check(1, 1000.0, 10.0, dead.pid, False, True)["process"] == "gone"  # read, then gone
        assert w.check(2, 1000.0, 10.0, me, True, True) is None  # done: nothing left to read
    said = [r.getMessage() for r in caplog.records]
    assert said[0] == f"rank 0: no progress for 35 s (since {time.strftime('%H:%M:%S', time.localtime(90))}; pid {me} running)"
    assert said[1] == "rank 0 moves again after 36 s without progress"
    assert said[2].startswith("rank 1: no progress for 990 s") and said[2].endswith(f"pid {dead.pid} gone)")
    assert len(said) == 3
