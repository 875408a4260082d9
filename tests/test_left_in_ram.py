"""Batches left in RAM (issue 42, item 4). After a hard kill of ``prefetchd launch`` (SIGKILL:
Slurm's KillWait running out, the OOM killer) its ring stays in the tmpfs; the next clean launch
of that config takes it over (``status.CREATED_NAME``) and removes it at its end, where it used to
remove only the lock and leave every batch, run after run. A stopped ``prefetchd run`` keeps its
batches for its next start and says so, with how to free them (``prefetchd clean``, ``rm -r``);
``clean`` refuses while a daemon serves the buffer."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys

from conftest import small_config, wait_until
from test_daemon import published
from test_launch import UNTIL, _finish, _launch

from prefetchd.format import status


def _clean(cfg: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefetchd", "clean", "--config", cfg], capture_output=True,
                          text=True, timeout=120)


def test_after_a_sigkill_of_launch_the_next_clean_launch_leaves_no_batch_in_ram(tmp_path, image_root):
    shm = tmp_path / "shm"  # the job's directory in /dev/shm: made by the launch
    buf = str(shm / "ring")
    cfg = small_config(tmp_path, image_root, buffer={"dir": buf})
    until = str(tmp_path / "until")
    p = _launch(tmp_path, cfg, sys.executable, "-c", UNTIL, until)
    try:
        wait_until(lambda: os.path.exists(until + ".started"), 90, "the command, the daemon ready")
        wait_until(lambda: len(published(buf)) == 4, 60, "a full ring")
        daemon = status.lock_pid(buf)
        os.kill(p.pid, signal.SIGKILL)  # launch alone: KillWait ran out, the OOM killer
        wait_until(lambda: status.daemon_alive(buf) is False, 30, "the daemon gone with its launch")
    finally:
        os.killpg(p.pid, signal.SIGKILL)  # the command, in launch's group
        p.wait(10)
    assert published(buf) and daemon, "a hard kill leaves its ring"  # what the next launch must not keep

    rc, out, err = _finish(_launch(tmp_path, cfg, sys.executable, "-c", "pass"))
    assert rc == 0, err
    assert not os.path.exists(buf), os.listdir(buf)  # no batch left in RAM, nor the directories
    assert not shm.exists()


def test_a_launch_in_a_directory_it_did_not_make_keeps_the_batches_for_the_next_start(tmp_path, image_root):
    """A buffer directory someone made (a unit's RuntimeDirectory=, a mount) is not a killed
    launch's: its batches are kept for the next start, as documented."""
    buf = tmp_path / "buffer"
    buf.mkdir(mode=0o700)
    cfg = small_config(tmp_path, image_root)
    rc, _, err = _finish(_launch(tmp_path, cfg, sys.executable, "-c", "pass"))
    assert rc == 0, err
    assert published(str(buf)) and not (buf / status.CREATED_NAME).exists() and not (buf / status.LOCK_NAME).exists()


def test_a_stopped_run_says_what_it_left_and_clean_frees_it_but_not_under_a_daemon(tmp_path, image_root,
                                                                                   daemon_factory):
    cfg = small_config(tmp_path, image_root)
    buf = str(tmp_path / "buffer")
    d = daemon_factory(cfg)
    wait_until(lambda: len(published(buf)) == 4, 60, "a full ring")
    r = _clean(cfg)
    assert r.returncode == 1 and "stop it first" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert len(published(buf)) == 4
    assert d.stop() == 0
    line = next((x for x in d.log().splitlines() if "left 4 batches" in x), None)
    assert line is not None, d.log()[-2000:]
    assert f"prefetchd clean --config {shlex.quote(cfg)}" in line and f"rm -r {shlex.quote(buf)}" in line, line
    r = _clean(cfg)
    assert r.returncode == 0 and "removed 4 batches" in r.stderr, r.stderr
    assert not os.path.exists(buf)
    r = _clean(cfg)  # nothing left: nothing to do
    assert r.returncode == 0, r.stderr


def test_the_stop_line_names_the_way_to_free_the_ring_unless_a_live_launch_removes_it(tmp_path):
    import json

    from prefetchd.daemon.teardown import _made_by_a_live_start, left_behind

    assert left_behind(0, 0, "/dev/shm/r", "/c.yaml", False) is None
    line = left_behind(1, 4096, "/dev/shm/a b", "/etc/x.yaml", False)
    assert line == ("stopped; left 1 batch (4.0 KiB) in /dev/shm/a b for the next start of this config to reuse; "
                    "to free that memory now: prefetchd clean --config /etc/x.yaml (or rm -r '/dev/shm/a b')")
    assert left_behind(3, 4096, "/dev/shm/r", None, True).endswith("the launch (or serve()) that made the directory removes it")
    assert not _made_by_a_live_start(str(tmp_path))
    (tmp_path / status.CREATED_NAME).write_text(json.dumps({"pid": os.getpid()}))
    assert _made_by_a_live_start(str(tmp_path))  # its launch runs: it removes the ring
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / status.CREATED_NAME).write_text(json.dumps({"pid": gone.pid}))
    assert not _made_by_a_live_start(str(tmp_path))  # killed outright: clean is the way


def test_a_directory_made_by_a_start_that_still_runs_is_not_taken_over(tmp_path):
    """Its launch's daemon between two tries (no lock held) is no leftover: another start of the
    config must not take the directory, and remove that launch's ring at its own end."""
    from prefetchd_client.child import _left_by_a_killed_start

    buf = str(tmp_path / "buffer")
    os.makedirs(buf)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        for pid, taken in ((alive.pid, {}), (dead.pid, {buf: buf}), (os.getpid(), {buf: buf})):
            status.write_json(buf, status.CREATED_NAME, {"format": "prefetchd-created", "version": 1, "pid": pid,
                                                         "made": [[buf, buf]]})
            assert _left_by_a_killed_start(buf, (buf,)) == taken, pid
    finally:
        alive.kill()
        alive.wait()
