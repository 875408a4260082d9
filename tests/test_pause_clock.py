"""The trainer's wait clock on a loaded host (issue 35's pause detection attacked): a poll step
longer than the pause threshold is the trainer's own pause only when the polling thread was not
waiting for a CPU; a host so loaded that every poll takes over a second must not hide a daemon
that makes nothing (the trainer would hang for ever, saying nothing)."""

from __future__ import annotations

import contextlib
import threading

import pytest
from prefetchd_client import PrefetchTimeout, clock, reader
from prefetchd_client.common import _Stopped


class _Host:
    """A monotonic clock and a run-queue delay that move by ``step`` and ``queued`` at each poll."""

    def __init__(self, step: float, queued: float):
        self.t, self.d, self.step, self.queued, self.calls = 1000.0, 5.0, step, queued, 0

    def now(self) -> float:
        self.calls += 1
        if self.calls > 300:
            raise AssertionError("the wait never ended")
        self.t += self.step
        return self.t

    def delay(self) -> float:
        self.d += self.queued  # read once per step
        return self.d


def test_a_long_step_spent_waiting_for_a_cpu_counts_as_waited_a_stop_does_not():
    t, d = [0.0], [0.0]
    c = clock.WaitClock(lambda: t[0], delay=lambda: d[0])
    t[0] += 0.05
    c.tick()  # the first poll: the run-queue baseline is read
    t[0] += 1.5
    d[0] += 1.45  # on the run queue nearly all along: a loaded host
    c.tick()
    assert c.waited == pytest.approx(1.5) and c.frozen == pytest.approx(0.05)
    t[0] += 30.0  # SIGSTOP: on no run queue
    c.tick()
    assert c.waited == pytest.approx(1.5) and c.frozen == pytest.approx(30.05)
    t[0] += 1.2
    d[0] += 0.3  # part of both (stopped, then waited for a CPU once continued)
    c.tick()
    assert c.waited == pytest.approx(1.8) and c.frozen == pytest.approx(30.95)


def test_without_schedstat_a_long_step_is_a_pause_as_before():
    t = [0.0]
    c = clock.WaitClock(lambda: t[0], delay=lambda: None)
    for step in (0.05, 1.5, 0.05, 1.5):
        t[0] += step
        c.tick()
    assert c.waited == pytest.approx(0.1) and c.frozen == pytest.approx(3.0)


def test_the_run_queue_delay_is_read_from_proc():
    d = clock.run_queue_delay()
    assert d is not None and d >= 0


class _NoBatch:
    """A client whose daemon makes nothing: its reader waits until stopped."""

    rank = 0

    def _reader_context(self):
        return contextlib.nullcontext()

    def _load(self, epoch, batch, stop, opened, timeout):
        stop.wait()
        raise _Stopped()

    def _path(self, epoch, batch):
        return "/nonexistent/batch"

    def _timeout_message(self, epoch, batch, wc, limit, in_hand):
        return f"waited {wc.said(limit)} for batch {batch}"

    def _say_waiting(self, since, block=True):  # the progress record's waiting_since: nothing to write here
        return True


@pytest.mark.parametrize("queued", [1.45, 0.0], ids=["starved-host", "stopped-trainer"])
def test_a_daemon_making_nothing_times_out_a_starved_trainer_but_not_a_stopped_one(monkeypatch, queued):
    host = _Host(step=1.5, queued=queued)  # every poll takes 1.5 s
    monkeypatch.setattr(reader, "WaitClock", lambda: clock.WaitClock(host.now, delay=host.delay))
    ra = reader.ReadAhead(_NoBatch(), 0, 0, 4, 2)
    try:
        if queued:
            with pytest.raises(PrefetchTimeout, match=r"^waited 5\.0 s .*for batch 0"):
                ra.get(0, timeout=5.0)
        else:  # a stop of 40 polls of 1.5 s is the trainer's own pause: no timeout
            stopper = threading.Timer(40 * 0.05, ra.stop.set)
            stopper.start()
            with pytest.raises(Exception, match="ended by seek"):
                ra.get(0, timeout=5.0)
            stopper.join()
            assert host.calls > 20 and ra.waited == 0.0
    finally:
        ra.close()


class _Ready(_NoBatch):
    """A client whose every batch is there at once (a full ring)."""

    def _load(self, epoch, batch, stop, opened, timeout):
        return ("images", "labels", None, batch)


def test_a_batch_ready_at_once_reads_no_run_queue_delay(monkeypatch):
    # the trainer's fast path: the schedstat read costs about 0.14 ms of the trainer's thread
    # (an open of /proc/thread-self, which also hands the GIL to the reader thread)
    reads = []
    monkeypatch.setattr(reader, "WaitClock", lambda: clock.WaitClock(delay=lambda: reads.append(1) or 0.0))
    ra = reader.ReadAhead(_Ready(), 0, 0, 4, 4)
    try:
        for b in range(4):
            while not ra.ready():
                ra.stop.wait(0.001)
            assert ra.get(b, timeout=5.0)[3] == b
            assert ra.waited < 1.0
    finally:
        ra.close()
    assert reads == []
