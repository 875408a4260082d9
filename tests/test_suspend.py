"""A job suspended whole (issue 42, item 3): ``scontrol suspend``, a shell's Ctrl-Z or SIGSTOP to
the daemon's process group, for longer than ``workers.task_timeout_s``, then SIGCONT. The daemon's
deadlines are on a clock that leaves out the time it was stopped (``core.runclock.RunClock``), as
the client's timeouts are: no worker holding a batch is taken for hung and killed on resuming, and
the batches are the stream's, byte for byte."""

from __future__ import annotations

import os
import signal
import threading

import psutil
import pytest
from conftest import small_config, wait_until
from test_daemon import published, reference_batches

from prefetchd.core.runclock import STOPPED_STEP_S, RunClock
from prefetchd.format import batchfile, jpegbatch, status

TASK_TIMEOUT_S = 3.0
SUSPEND_S = 3 * TASK_TIMEOUT_S


def _stopped(pgid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] == psutil.STATUS_STOPPED:
                out.append(p)
        except (ProcessLookupError, psutil.Error):
            pass
    return out


def test_a_job_suspended_for_three_task_timeouts_kills_no_worker_and_keeps_its_stream(tmp_path, image_root,
                                                                                      daemon_factory):
    cfg = small_config(tmp_path, image_root, loader={"epochs": 1}, workers={"count": 2, "task_timeout_s": TASK_TIMEOUT_S})
    buf = str(tmp_path / "buffer")
    marker = tmp_path / "hung"  # the first worker to decode a sample stops there (SIGSTOP), holding its batch
    d = daemon_factory(cfg, env={"PREFETCHD_FAULT_HANG_ONCE": f"img_:{marker}"})
    wait_until(marker.exists, 60, "a worker holding a batch")
    wait_until(lambda: _stopped(d.pid), 5, "the worker stopped")
    os.killpg(d.pid, signal.SIGSTOP)  # the whole job: scontrol suspend, Ctrl-Z
    try:
        before = status.read_json(buf, status.STATUS_NAME) or {}
        threading.Event().wait(SUSPEND_S)  # the suspension under test
    finally:
        os.killpg(d.pid, signal.SIGCONT)  # scontrol resume, fg: the stopped worker goes on with the rest
    wait_until(lambda: len(published(buf)) == 4, 60, "the ring filled after the resume")
    # a status written after the held batch was published (the loop's turn that would have killed it)
    wait_until(lambda: (status.read_json(buf, status.STATUS_NAME) or {}).get("produced_batches", 0) >= 4, 10,
               "the status of a full ring")
    rec = status.read_json(buf, status.STATUS_NAME)
    log = d.log()
    assert rec["worker_timeouts"] == 0 and rec["worker_restarts"] == 0, log[-3000:]
    assert "killing it" not in log and " ERROR " not in log, log[-3000:]
    if before.get("worker_pids"):
        assert sorted(rec["worker_pids"]) == sorted(before["worker_pids"])
    ref, _ = reference_batches(cfg, epochs=1)
    for name in published(buf):
        key = batchfile.parse_name(name)[:3]
        b = jpegbatch.read_file(os.path.join(buf, name))
        assert (b.images == ref[key][0]).all() and (b.labels == ref[key][1]).all(), name
    assert d.stop() == 0


@pytest.mark.parametrize("step,ran,queued,counted", [(30.0, 0.0, 0.0, 0.0), (2.0, 2.0, 0.0, 2.0), (2.0, 0.0, 2.0, 2.0),
                                                   (2.0, 0.5, 0.5, 1.0)],
                         ids=["stopped", "working", "starved", "half-stopped"])
def test_the_run_clock_leaves_out_a_stop_but_not_work_or_a_wait_for_a_cpu(step, ran, queued, counted):
    """A long step between two reads: the part the thread neither ran nor waited for a CPU (a
    stop) is left out; what the loop spent working, or runnable on a loaded host, counts."""
    assert step > STOPPED_STEP_S
    t, used = [100.0], [5.0]  # the monotonic clock; the thread's seconds on a CPU or its run queue
    clock = RunClock(lambda: t[0], delay=lambda: used[0])
    start = clock()
    t[0] += 0.2  # a short step counts whole
    assert clock() == pytest.approx(start + 0.2)
    t[0] += step
    used[0] += ran + queued
    assert clock() == pytest.approx(start + 0.2 + counted)
    assert clock.stopped_s == pytest.approx(step - counted)
