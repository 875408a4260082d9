"""Time a process spent running: what timeouts measure, less the spells it was stopped.

Shared by the trainer's client (``prefetchd_client.clock``: its waits and their timeouts) and the
daemon (``RunClock``: its workers' task deadlines, its stall and watchdog ages), so that a job
suspended whole (``scontrol suspend``, Ctrl-Z, SIGSTOP to its process group, a cgroup freezer)
and continued fires no timeout on its own stopped time.

A waiting loop ticks a ``WaitClock`` at least every ``STOPPED_STEP_S`` / 2. A tick counts the
monotonic time since the last one, unless that step is longer than ``STOPPED_STEP_S``: a loop
that ticks that often cannot take that long while the process runs, so the process did not run
meanwhile (SIGSTOP, a Slurm ``scontrol suspend``, a freezer cgroup, a debugger holding every
thread, a C call holding the GIL for seconds). Such a step is the process's own pause, not the
other side's lack of progress: it counts neither toward a timeout nor as waiting (``frozen``
keeps it, for the message). A suspended machine stops the monotonic clock itself.

A long step is not always a pause: on a host so loaded that the ticking thread waits for a CPU
for seconds, every step may be long, and leaving them all out would let a dead peer hang the
process for ever. So the part of a long step that the ticking thread spent runnable, waiting on
the scheduler's run queue (Linux's ``/proc/thread-self/schedstat``, its second field), counts:
a stopped process is on no run queue, a starved one is. The daemon, whose loop does work between
ticks, also counts the time the thread ran on a CPU (the file's first field: ``ran_or_queued``).
Where that file cannot be read, a long step is a pause as above.

Pure: the clock and run-queue functions are parameters (tests pass ones that jump).
"""

from __future__ import annotations

import time
from collections.abc import Callable

STOPPED_STEP_S = 1.0  # a step of a poll loop longer than this: the process was not running
TICK_S = STOPPED_STEP_S / 2  # so a loop ticking a clock does it at least this often (the daemon's waits)
_DELAY_EVERY_S = 0.1  # the run-queue baseline is read at most this often (not at every fast poll)


def _schedstat() -> tuple[float, float] | None:
    """The calling thread's seconds on a CPU and runnable waiting for one, or None."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            fields = f.read(128).split()
            return int(fields[0]) / 1e9, int(fields[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def run_queue_delay() -> float | None:
    """Seconds the calling thread has spent runnable but waiting for a CPU, or None."""
    s = _schedstat()
    return None if s is None else s[1]


def ran_or_queued() -> float | None:
    """Seconds the calling thread has spent on a CPU or waiting for one, or None: what of a long
    step counts for a thread that works between its ticks (the daemon's loop)."""
    s = _schedstat()
    return None if s is None else s[0] + s[1]


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


class RunClock:
    """The daemon's clock for its deadlines: ``time.monotonic()`` less the spells the process was
    stopped (a ``WaitClock`` over ``ran_or_queued``). Call it from one thread only (the schedstat
    read is that thread's), at least every ``STOPPED_STEP_S`` / 2 while a deadline runs; each
    call ticks. Its values start at the monotonic clock's, and fall behind it by ``stopped_s``."""

    def __init__(self, now: Callable[[], float] = time.monotonic,
                 delay: Callable[[], float | None] = ran_or_queued):
        self._origin = now()
        self._clock = WaitClock(now, delay)

    def __call__(self) -> float:
        return self._origin + self._clock.tick()

    @property
    def stopped_s(self) -> float:
        """Seconds left out so far: the process was stopped (or blocked in a call for that long)."""
        return self._clock.frozen
