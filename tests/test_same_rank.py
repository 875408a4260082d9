"""Two trainers started with the same rank by mistake (FIRST-CONTACT's habits): each moves the
daemon's position of the rank away from the other's, so one waits for batches made for the other
and times out. The daemon says it once, naming both pids; the trainer that times out is told that
another process wrote its rank's progress and what to change, not only that its rank has nothing
ready."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import small_config

from prefetchd.daemon.sessions import Sessions
from prefetchd.format.progress import VAL_LANE, Progress

# Both trainers have their loader before either reads, and both keep it open until both are done
# (barriers of files): else, on a loaded machine, one could read both epochs and close before the
# other read at all, and the other's moves were then a restart of the rank, rightly not called two
# trainers by the daemon (the other was gone)
_TRAINER = """
import json, os, sys, time
from prefetchd_client import PrefetchClient

def barrier(name):
    open(os.path.join(sys.argv[2], f"{name}-{os.getpid()}"), "w").close()
    deadline = time.monotonic() + 60
    while sum(f.startswith(name) for f in os.listdir(sys.argv[2])) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)

got = []
try:
    with PrefetchClient(sys.argv[1], timeout=6, as_numpy=True) as c:
        barrier("ready")
        try:
            for e in range(2):
                for x, y in c.iter_epoch(e):
                    got.append(c.last_batch.batch)
                    time.sleep(0.05)
        finally:
            barrier("done")
    print(json.dumps({"ok": True, "n": len(got)}))
except Exception as ex:
    print(json.dumps({"ok": False, "n": len(got), "err": str(ex)}))
"""


def test_two_trainers_of_one_rank_are_said_by_the_daemon_and_to_the_trainer_that_waits(
        tmp_path, image_root, daemon_factory):
    cfg = small_config(tmp_path, image_root)
    d = daemon_factory(cfg)
    barriers = tmp_path / "barriers"
    barriers.mkdir()
    ps = [subprocess.Popen([sys.executable, "-c", _TRAINER, cfg, str(barriers)], stdout=subprocess.PIPE, text=True)
          for _ in range(2)]
    outs = [json.loads(p.communicate(timeout=180)[0].strip().splitlines()[-1]) for p in ps]
    failed = [o for o in outs if not o["ok"]]
    for o in failed:  # a timeout (which one, and whether, is the machine's timing)
        assert "two trainers read rank 0 (started with the same RANK?); give each trainer its own rank" in o["err"], o
        assert any(f"another process (pid {p.pid}," in o["err"] for p in ps), o
    log = d.log()
    assert d.stop() == 0
    if failed or log.count("jumped back") or "two trainers" in log:
        said = [ln for ln in log.splitlines() if "two trainers write its progress" in ln]
        assert len(said) == 1, log
        assert all(str(p.pid) in said[0] for p in ps) and "give each its own rank (RANK)" in said[0], said


def test_sessions_say_two_live_trainers_of_a_rank_once_and_a_restarted_trainer_not_at_all(caplog):
    import os

    s = Sessions([0], 8, "fp")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(10)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with caplog.at_level("WARNING", logger="prefetchd"):
            s.apply(0, Progress(0, 0, 1, "fp", pid=gone.pid, session="a.0"), 1.0)
            s.apply(0, Progress(0, 0, 0, "fp", pid=os.getpid(), session="b.0"), 2.0)  # restarted: the old is gone
            assert "two trainers" not in caplog.text
            for i in range(3):
                s.apply(0, Progress(0, 0, 2 + i, "fp", pid=other.pid, session="c.0"), 3.0 + i)
                s.apply(0, Progress(0, 0, 1 + i, "fp", pid=os.getpid(), session=f"b.{i + 1}"), 3.5 + i)
    finally:
        other.kill()
        other.wait(5)
    said = [r.getMessage() for r in caplog.records if "two trainers" in r.getMessage()]
    assert said == [f"rank 0: two trainers write its progress, pids {os.getpid()} and {other.pid}, both alive: two "
                    "trainers started with the same rank? give each its own rank (RANK)"], said
    s = Sessions([VAL_LANE], 8, "fp")
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with caplog.at_level("WARNING", logger="prefetchd"):
            s.apply(VAL_LANE, Progress(VAL_LANE, 0, 1, "fp", pid=other.pid, session="d.0"), 1.0)
            s.apply(VAL_LANE, Progress(VAL_LANE, 0, 2, "fp", pid=os.getpid(), session="e.0"), 2.0)
    finally:
        other.kill()
        other.wait(5)
    assert caplog.records[-1].getMessage().startswith(f"rank 0 (validation): two trainers write its progress, pids "
                                                      f"{other.pid} and {os.getpid()}")


def test_a_validation_lane_is_named_as_its_trainer_knows_it_in_every_sessions_line(caplog):
    """The lines about a lane's progress name "rank N (validation)", not the lane number (2^24 + N)
    that no trainer knows."""
    import os

    s = Sessions([VAL_LANE + 3], 8, "fp")
    with caplog.at_level("INFO", logger="prefetchd"):
        s.apply(VAL_LANE + 3, Progress(VAL_LANE + 3, 0, 5, "fp", pid=os.getpid(), session="a.0"), 1.0)
        s.apply(VAL_LANE + 3, Progress(VAL_LANE + 3, 0, 2, "fp", pid=os.getpid(), session="a.0"), 2.0)  # back, same session
        s.apply(VAL_LANE + 3, Progress(VAL_LANE + 3, 0, 1, "other", pid=os.getpid(), session="b.0"), 3.0)  # back: a resume
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("rank 3 (validation)'s progress went back from epoch 0 batch 5") for m in said), said
    assert any(m.startswith("rank 3 (validation)'s trainer expects stream other") for m in said), said
    assert any(m.startswith("rank 3 (validation) jumped back from epoch 0 batch 5 to epoch 0 batch 1") for m in said), said
    assert not any(str(VAL_LANE) in m for m in said), said
