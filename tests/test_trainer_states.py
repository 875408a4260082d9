"""What a rank's trainer is doing, told apart in ``status``, its JSON and the metrics (issue 41,
items 3 and 4): finished (it closed its loader, or exited cleanly), waiting for data (blocked in
``next()``, its wait counted while it lasts), stalled with its process stopped (SIGSTOP) or gone
(it died without closing). A finished trainer is not stalled, a starved one is not to blame."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from conftest import small_config, wait_until
from test_pause import _free_port, _scrape

from prefetchd.format import procstate, progress, status

# a trainer of rank argv[2] that reads argv[4] batches of epoch 0 (2 epochs: never done here), says
# "read", then ends as argv[3] says
_TRAINER = """
import sys, time
from prefetchd_client import PrefetchClient, PrefetchTimeout
cfg, rank, how, n = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
timeout = float(sys.argv[5])

def read(c):
    it = c.iter_epoch(0)
    for _ in range(n):
        next(it)
    return it

if how == "epoch":  # reads all of epoch 0, then exits 0 (its loader open) when told
    c = PrefetchClient(cfg, rank=rank, as_numpy=True, timeout=timeout)
    for _ in c.iter_epoch(0):
        pass
    print("read", flush=True)
    sys.stdin.readline()
    sys.exit(0)

if how == "gc":  # the loader made in a function that returned: the garbage collector closes it
    def main():
        read(PrefetchClient(cfg, rank=rank, as_numpy=True, timeout=timeout))
    main()
    print("read", flush=True)
    sys.exit(0)
c = PrefetchClient(cfg, rank=rank, as_numpy=True, timeout=timeout)
try:
    it = read(c)
except PrefetchTimeout as e:
    print("timeout", e, flush=True)
    time.sleep(600)
print("read", flush=True)
if how == "close":
    c.close()
elif how == "raise":
    raise RuntimeError("the trainer failed")
elif how == "hold":  # to be stopped or killed
    time.sleep(600)
# "exit": exits 0 with the loader left open
"""


class Trainer:
    def __init__(self, cfg: str, rank: int, how: str, n: int = 1, timeout: float = 60.0):
        self.err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-c", _TRAINER, cfg, str(rank), how, str(n), str(timeout)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True,
                                     start_new_session=True)

    def said(self, what: str) -> str:
        line = self.proc.stdout.readline()
        assert line.startswith(what), line + self.stderr()
        return line

    def stderr(self) -> str:
        self.err.seek(0)
        return self.err.read().decode(errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


def _metric(text: str, name: str, **labels) -> float | None:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^{name}\{{{re.escape(want)}\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefetchd", *args], capture_output=True, text=True, timeout=60)


def _rank(buf: str, r: int) -> dict:
    return (status.read_json(buf, status.STATUS_NAME) or {}).get("ranks", {}).get(str(r), {})


def test_finished_stopped_and_gone_trainers_are_told_apart_in_status_json_and_metrics(tmp_path, image_root,
                                                                                      daemon_factory):
    port = _free_port()
    cfg = small_config(tmp_path, image_root, loader={"world_size": 6}, metrics={"enabled": True, "port": port})
    buf = str(tmp_path / "buffer")
    d = daemon_factory(cfg, env={"PREFETCHD_STALL_AFTER_S": "1"})
    hows = {0: "close", 1: "exit", 2: "gc", 3: "raise", 4: "hold", 5: "hold"}
    ts = {r: Trainer(cfg, r, how) for r, how in hows.items()}
    try:
        for t in ts.values():
            t.said("read")
        for r in (0, 1, 2):  # closed, exited 0 with its loader open, its loader collected before exit 0
            assert ts[r].proc.wait(60) == 0, ts[r].stderr()
        assert ts[3].proc.wait(60) == 1 and "the trainer failed" in ts[3].stderr()  # an uncaught exception
        os.kill(ts[4].proc.pid, signal.SIGSTOP)
        os.kill(ts[5].proc.pid, signal.SIGKILL)
        ts[5].proc.wait(10)
        want = {0: ("finished", None), 1: ("finished", None), 2: ("finished", None), 3: ("stalled", "gone"),
                4: ("stalled", "stopped"), 5: ("stalled", "gone")}

        def states():
            return {r: (_rank(buf, r).get("trainer"), (_rank(buf, r).get("stalled") or {}).get("process"))
                    for r in want}

        wait_until(lambda: states() == want, 60, f"the trainers' states {want} (have {states()})")
        js = json.loads(_cli("status", "--json", "--config", cfg).stdout)["status"]["ranks"]
        assert {r: (js[str(r)]["trainer"], (js[str(r)]["stalled"] or {}).get("process")) for r in want} == want
        assert js["4"]["stalled"]["pid"] == ts[4].proc.pid and js["0"]["waiting"] is None
        text = _cli("status", "--config", cfg).stdout
        for r in (0, 1, 2):
            line = next(x for x in text.splitlines() if x.startswith(f"  rank {r}: "))
            assert line.endswith("; trainer finished (it closed its loader or exited cleanly)"), line
        assert re.search(rf"  rank 4: .*; STALLED: no progress for \d+ s \(since [\d:]+; pid {ts[4].proc.pid} "
                         r"stopped\)$", text, re.M), text
        assert re.search(rf"  rank 5: .*; STALLED: .*pid {ts[5].proc.pid} gone\)$", text, re.M), text

        def metrics_agree():
            m = _scrape(port)
            return m if all(
                _metric(m, "prefetchd_rank_stalled", rank=r) == (0.0 if r < 3 else 1.0)
                and _metric(m, "prefetchd_rank_trainer", rank=r, state=want[r][0]) == 1.0
                and _metric(m, "prefetchd_rank_stalled_process", rank=r, state="gone") == (want[r][1] == "gone")
                and _metric(m, "prefetchd_rank_stalled_process", rank=r, state="stopped") == (want[r][1] == "stopped")
                for r in want) else None

        m = wait_until(metrics_agree, 30, "the metrics to say the same")
        assert _metric(m, "prefetchd_rank_trainer", rank=0, state="stalled") == 0.0
        assert _metric(m, "prefetchd_rank_waiting_seconds", rank=0) == 0.0
    finally:
        for t in ts.values():
            if t.proc.poll() is None:
                os.kill(t.proc.pid, signal.SIGCONT)
            t.kill()
    assert d.stop() == 0


def test_a_trainer_exiting_after_its_ranks_next_trainer_started_leaves_the_rank_to_it(tmp_path, image_root,
                                                                                       daemon_factory):
    cfg = small_config(tmp_path, image_root)
    d = daemon_factory(cfg)
    path = progress.progress_path(str(tmp_path / "buffer" / "progress"), 0)
    old = Trainer(cfg, 0, "epoch")
    new = None
    try:
        old.said("read")
        new = Trainer(cfg, 0, "hold")  # the rank's next trainer, from epoch 0 batch 0
        new.said("read")
        old.proc.stdin.write("\n")
        old.proc.stdin.flush()
        assert old.proc.wait(60) == 0, old.stderr()
        # its exit said nothing over the new trainer's record: the rank stays the new trainer's
        p = progress.read(path)
        assert p.pid == new.proc.pid and not p.closed and p.epoch == 0, p
    finally:
        old.kill()
        if new is not None:
            new.kill()
    assert d.stop() == 0


def _hung_worker_daemon(tmp_path, image_root, daemon_factory, port: int):
    """A daemon whose only worker stops (SIGSTOP, a read hung in the kernel) at its first sample:
    it makes nothing, its loop and status run on."""
    cfg = small_config(tmp_path, image_root, workers={"count": 1, "task_timeout_s": 600},
                       metrics={"enabled": True, "port": port})
    d = daemon_factory(cfg, env={"PREFETCHD_STALL_AFTER_S": "1",
                                 "PREFETCHD_FAULT_HANG_ONCE": f"img_:{tmp_path / 'hung'}"})
    return cfg, d


def _continue_stopped_workers(d) -> None:
    import psutil

    for p in psutil.Process(d.pid).children(recursive=True):
        try:
            if p.status() == psutil.STATUS_STOPPED:
                p.send_signal(signal.SIGCONT)
        except psutil.Error:
            pass


def test_a_trainer_starved_by_a_hung_worker_is_waiting_and_its_wait_counts_while_it_lasts(tmp_path, image_root,
                                                                                          daemon_factory):
    port = _free_port()
    cfg, d = _hung_worker_daemon(tmp_path, image_root, daemon_factory, port)
    buf = str(tmp_path / "buffer")
    t = Trainer(cfg, 0, "close")
    try:
        rs = wait_until(lambda: (x := _rank(buf, 0)).get("trainer") == "waiting" and x, 60, "rank 0 waiting")
        assert rs["stalled"] is None and rs["waiting"]["since"] <= time.time()
        # the wait grows while it lasts, in the status and the counter the data-bound figures read,
        # and past the stall threshold (1 s here) it is still a wait, not a stall
        first = rs["wait_s"]
        rs = wait_until(lambda: (x := _rank(buf, 0)).get("wait_s", 0) >= first + 3 and x, 30, "the wait to grow")
        assert rs["trainer"] == "waiting" and rs["stalled"] is None and rs["waiting"]["for_s"] >= 3
        assert rs["last_progress_age_s"] >= 3  # no record was written meanwhile
        text = _cli("status", "--config", cfg).stdout
        assert re.search(r"  rank 0: .*; trainer waited \d+\.\d s; WAITING for data: its next\(\) has waited \d+ s "
                         r"for a batch \(since [\d:]+\)$", text, re.M), text
        assert "STALLED" not in text
        # the share of the last minute it waited (status's "trainers waited, last minute") sees the wait too
        wait_until(lambda: (_rank(buf, 0).get("waited_share") or 0) >= 0.5, 30, "rank 0's waited share")
        assert re.search(r"trainers waited, last minute: rank 0 \d+% \(data-bound\)",
                         _cli("status", "--config", cfg).stdout)
        m = wait_until(lambda: (x := _scrape(port)) and _metric(x, "prefetchd_rank_waiting_seconds", rank=0)
                       and x, 15, "metrics")
        assert _metric(m, "prefetchd_rank_trainer", rank=0, state="waiting") == 1.0
        assert _metric(m, "prefetchd_rank_stalled", rank=0) == 0.0
        assert _metric(m, "prefetchd_trainer_wait_seconds_total", rank=0) >= 3
        counted = _rank(buf, 0)["wait_s"]
        # the worker goes on: the batch comes, the trainer reads it and closes; its own count holds
        _continue_stopped_workers(d)
        t.said("read")
        assert t.proc.wait(60) == 0, t.stderr()
        rs = wait_until(lambda: (x := _rank(buf, 0)).get("trainer") == "finished" and x, 30, "rank 0 finished")
        assert rs["waiting"] is None and rs["wait_s"] >= counted
    finally:
        _continue_stopped_workers(d)
        t.kill()
    assert d.stop() == 0


def test_a_wait_that_ends_in_a_timeout_counts(tmp_path, image_root, daemon_factory):
    cfg, d = _hung_worker_daemon(tmp_path, image_root, daemon_factory, _free_port())
    buf = str(tmp_path / "buffer")
    t = Trainer(cfg, 0, "close", timeout=3.0)  # times out after 3 s, then holds (its loader open)
    try:
        assert "waited 3.0 s for rank 0 epoch 0 batch 0" in t.said("timeout")
        # the wait is over: counted whole from the trainer's record, and the rank stalls (running)
        rs = wait_until(lambda: (x := _rank(buf, 0)).get("trainer") == "stalled" and x, 30, "rank 0 stalled")
        assert rs["waiting"] is None and rs["wait_s"] >= 3.0 and rs["stalled"]["process"] == "running"
        p = progress.read(progress.progress_path(str(tmp_path / "buffer" / "progress"), 0))
        assert p.waiting_since == 0 and p.wait_s >= 3.0 and not p.closed
    finally:
        _continue_stopped_workers(d)
        t.kill()
    assert d.stop() == 0


# --- the pure parts -------------------------------------------------------------------------------


def test_an_older_clients_progress_file_still_reads_and_the_new_fields_are_checked():
    old = {"format": "prefetchd-progress", "version": 1, "rank": 2, "epoch": 1, "batch": 5, "pid": 42,
           "time": 1.0, "wait_s": 0.5}
    p = progress.decode(json.dumps(old).encode())
    assert (p.rank, p.epoch, p.batch, p.waiting_since, p.closed) == (2, 1, 5, 0.0, False)
    p = progress.decode(json.dumps({**old, "waiting_since": 12.5, "closed": True}).encode())
    assert (p.waiting_since, p.closed) == (12.5, True)
    assert progress.decode(progress.encode(p)) == p
    for bad, why in (({"closed": 1}, "field 'closed' must be true or false"),
                     ({"waiting_since": -1}, "field 'waiting_since' must be a finite non-negative number"),
                     ({"waiting_since": "now"}, "field 'waiting_since' must be a finite non-negative number")):
        with pytest.raises(progress.ProgressError, match=re.escape(why)):
            progress.decode(json.dumps({**old, **bad}).encode())


def test_the_wait_in_progress_is_counted_while_the_process_runs_and_the_counter_never_goes_back():
    from prefetchd.daemon.stalls import Seen, StallWatch

    mono = [1000.0]
    w = StallWatch(after_s=30, clock=lambda: mono[0])
    me = os.getpid()

    def look(now, wait_s=1.0, since=0.0, client="a", done=False, closed=False):
        mono[0] = now  # the monotonic clock moves with the wall clock here
        return w.trainer(0, now, Seen(100.0, me, procstate.identity(), True, closed, since, wait_s, client), done)

    assert look(100.0) == {"trainer": "reading", "stalled": None, "waiting": None, "wait_s": 1.0}
    x = look(105.0, since=103.0)  # waits since 103: 2 s so far, 3 s more at 108
    assert x["trainer"] == "waiting" and x["waiting"] == {"since": 103.0, "for_s": 2.0} and x["wait_s"] == 3.0
    x = look(140.0, since=103.0)  # 40 s without a record: waiting, not stalled
    assert x["trainer"] == "waiting" and x["stalled"] is None and x["wait_s"] == pytest.approx(38.0)
    # the wait ends; the client counted less (a spell its process was stopped): the counter holds
    assert look(141.0, wait_s=30.0)["wait_s"] == pytest.approx(38.0)
    assert look(142.0, wait_s=40.0)["wait_s"] == 40.0
    assert look(143.0, wait_s=0.5, client="b")["wait_s"] == 0.5  # another client: its own counter
    assert look(144.0, closed=True)["trainer"] == "finished"
    assert look(145.0, done=True, since=144.0)["trainer"] == "finished"
    # waiting for a validation batch (its lane's record the newest): said, not added to the train counter
    x = w.trainer(1, 145.0, Seen(140.0, me, procstate.identity(), True, False, 141.0, 2.0, "a", wait_is_own=False),
                  False)
    assert x["trainer"] == "waiting" and x["waiting"]["for_s"] == 4.0 and x["wait_s"] == 2.0


def test_a_stalled_trainer_that_finishes_is_said_finished_once(caplog):
    from prefetchd.daemon.stalls import Seen, StallWatch

    mono = [0.0]
    w = StallWatch(after_s=30, clock=lambda: mono[0])
    me = os.getpid()
    with caplog.at_level("INFO", logger="prefetchd"):
        for now, seen, closed in ((100.0, 60.0, False), (101.0, 60.0, False), (102.0, 101.5, True), (103.0, 101.5, True)):
            mono[0] = now
            x = w.trainer(0, now, Seen(seen, me, procstate.identity(), True, closed, 0.0, 0.0, "a"), False)
            assert x["trainer"] == ("finished" if closed else "stalled"), (now, x)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and said[0].startswith("rank 0: no progress for 40 s")
    assert said[1] == "rank 0's trainer finished after 42 s without progress"


def test_a_waiting_trainer_whose_process_is_stopped_is_not_waiting():
    from prefetchd.daemon.stalls import Seen, StallWatch

    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(p.pid, signal.SIGSTOP)
        wait_until(lambda: procstate.state(p.pid) == "stopped", 5, "stopped")
        w = StallWatch(after_s=30, clock=lambda: now)
        now = 200.0
        x = w.trainer(0, now, Seen(150.0, p.pid, (0, 0), True, False, 150.0, 1.0, "a"), False)
        assert x["trainer"] == "stalled" and x["stalled"]["process"] == "stopped" and x["waiting"] is None
        assert x["wait_s"] == 1.0  # a stopped trainer's wait is its own pause: not counted
    finally:
        p.kill()
        p.wait(5)


def test_status_says_a_waiting_and_a_finished_trainer_on_their_lines():
    since = time.time() - 12
    rec = {"updated": time.time(), "state": "running", "capacity": 4, "ranks": {
        "0": {"position": [0, 0], "ready": 0, "ahead": 0, "wait_s": 12.3, "trainer": "waiting",
              "waiting": {"since": since, "for_s": 12.1}, "stalled": None},
        "1": {"position": [0, 2], "ready": 4, "ahead": 4, "trainer": "finished", "waiting": None, "stalled": None}}}
    lines = status.format_status(rec, True).splitlines()
    hhmmss = time.strftime("%H:%M:%S", time.localtime(since))
    assert lines[-2].endswith(f"; trainer waited 12.3 s; WAITING for data: its next() has waited 12 s for a batch "
                              f"(since {hhmmss})"), lines[-2]
    assert lines[-1].endswith("; trainer finished (it closed its loader or exited cleanly)"), lines[-1]
