"""The trainer's waiting time: what its timeouts and its wait counter measure.

A wait polls (every few milliseconds to ``_QUEUE_POLL_S``) and ticks a ``WaitClock`` each time.
A tick counts the monotonic time since the last one, unless that step is longer than
``STOPPED_STEP_S``: a poll that short cannot take that long while the process runs, so the
process did not run meanwhile (SIGSTOP, a Slurm ``scontrol suspend``, a debugger holding every
thread, a C call holding the GIL for seconds). Such a step is the trainer's own pause, not the
daemon's lack of progress: it counts neither toward a timeout nor as waiting for data (``frozen``
keeps it, for the message). A suspended machine stops the monotonic clock itself.

Pure: the clock function is a parameter (tests pass one that jumps).
"""

from __future__ import annotations

import time
from collections.abc import Callable

STOPPED_STEP_S = 1.0  # a step of a poll loop longer than this: the process was not running


class WaitClock:
    """Seconds waited since it was made (``waited``), less the spells the process did not run
    (``frozen``). Tick it at least every ``STOPPED_STEP_S`` while waiting."""

    def __init__(self, now: Callable[[], float] = time.monotonic):
        self._now = now
        self._last = now()
        self.waited = 0.0
        self.frozen = 0.0

    def tick(self) -> float:
        """Count the time since the last tick; returns ``waited``."""
        t = self._now()
        step, self._last = t - self._last, t
        if step > STOPPED_STEP_S:
            self.frozen += step
        elif step > 0:
            self.waited += step
        return self.waited

    def said(self, limit: float | None = None) -> str:
        """``waited`` as a message says it (``limit`` when it is past that timeout: the polls'
        granularity is no news); the pause left out is named, so no wait is claimed that did
        not happen."""
        waited = limit if limit is not None and self.waited >= limit else self.waited
        extra = f" (not counting {self.frozen:.0f} s in which this process was stopped)" if self.frozen >= 1 else ""
        return f"{waited:.1f} s{extra}"
