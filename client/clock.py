"""The trainer's waiting time: what its timeouts and its wait counter measure.

The clock itself is shared with the daemon (``prefetchd.core.runclock``, its docstring says what
it counts): a wait polls (every few milliseconds to ``_QUEUE_POLL_S``) and ticks a ``WaitClock``
each time; a step of the poll longer than ``STOPPED_STEP_S`` while the polling thread was on no
run queue is the trainer's own stop (SIGSTOP, ``scontrol suspend``, a debugger), and counts
neither toward a timeout nor as waiting for data.
"""

from __future__ import annotations

from prefetchd.core.runclock import STOPPED_STEP_S, WaitClock, run_queue_delay

__all__ = ["STOPPED_STEP_S", "WaitClock", "run_queue_delay"]
