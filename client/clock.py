"""The trainer's waiting time: what its timeouts and its wait counter measure.

A wait polls (every few milliseconds to ``_QUEUE_POLL_S``) and ticks a ``WaitClock`` each time.
A tick counts the monotonic time since the last one, unless that step is longer than
``STOPPED_STEP_S``: a poll that short cannot take that long while the process runs, so the
process did not run meanwhile (SIGSTOP, a Slurm ``scontrol suspend``, a debugger holding every
thread, a C call holding the GIL for seconds). Such a step is the trainer's own pause, not the
daemon's lack of progress: it counts neither toward a timeout nor as waiting for data (``frozen``
keeps it, for the message). A suspended machine stops the monotonic clock itself.

A long step is not always a pause: on a host so loaded that the polling thread waits for a CPU
for seconds, every step may be long, and leaving them all out would let a dead daemon hang the
trainer for ever. So the part of a long step that the polling thread spent runnable, waiting on
the scheduler's run queue (Linux's ``/proc/thread-self/schedstat``, its second field), counts as
waited: a stopped process is on no run queue, a starved one is. Where that file cannot be read,
a long step is a pause as above.

Pure: the clock and run-queue functions are parameters (tests pass ones that jump).
"""

from __future__ import annotations

import time
from collections.abc import Callable

STOPPED_STEP_S = 1.0  # a step of a poll loop longer than this: the process was not running
_DELAY_EVERY_S = 0.1  # the run-queue baseline is read at most this often (not at every fast poll)


def run_queue_delay() -> float | None:
    """Seconds the calling thread has spent runnable but waiting for a CPU, or None."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read(128).split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


class WaitClock:
    """Seconds waited since it was made (``waited``), less the spells the process did not run
    (``frozen``). Tick it at least every ``STOPPED_STEP_S`` while waiting, in one thread (the
    run-queue delay read is the ticking thread's)."""

    def __init__(self, now: Callable[[], float] = time.monotonic,
                 delay: Callable[[], float | None] = run_queue_delay):
        self._now = now
        self._delay = delay
        self._last = now()
        self._base: float | None = None  # the run-queue delay when last read, and when
        self._base_at = -float("inf")
        self.waited = 0.0
        self.frozen = 0.0

    def tick(self, final: bool = False) -> float:
        """Count the time since the last tick; returns ``waited``. ``final``: the wait is over, so
        no run-queue baseline is read for a tick to come (a wait that found its batch at once, the
        trainer's fast path, then reads nothing: the read opens a /proc file, and that system
        call hands the GIL to the reader thread, which the trainer then waits to get back)."""
        t = self._now()
        step, self._last = t - self._last, t
        if step > STOPPED_STEP_S:
            d = self._delay() if self._base is not None else None
            starved = min(step, max(0.0, d - self._base)) if d is not None else 0.0
            self.waited += starved  # runnable, waiting for a CPU: the host is loaded, not paused
            self.frozen += step - starved
            self._base_at = t if d is not None else -float("inf")  # else read a baseline below
            self._base = d
        elif step > 0:
            self.waited += step
        if not final and t - self._base_at >= _DELAY_EVERY_S:  # first read at the first tick
            self._base, self._base_at = self._delay(), t
        return self.waited

    def said(self, limit: float | None = None) -> str:
        """``waited`` as a message says it (``limit`` when it is past that timeout: the polls'
        granularity is no news); the pause left out is named, so no wait is claimed that did
        not happen."""
        waited = limit if limit is not None and self.waited >= limit else self.waited
        extra = f" (not counting {self.frozen:.0f} s in which this process was stopped)" if self.frozen >= 1 else ""
        return f"{waited:.1f} s{extra}"
