"""Ranks whose trainer has stopped moving: what ``status``, the metrics and the log say of them.

A rank is stalled once ``STALL_AFTER_S`` have passed since the last progress record the daemon
read from its trainer (train or validation lane), while it has batches left to read. Its record
says since when and what its trainer's process is doing, from the pid in the progress file
(``format.procstate``): ``running`` (a breakpoint, a long checkpoint write, a collective waiting
on another rank), ``stopped`` (SIGSTOP, ``scontrol suspend``, Ctrl-Z), ``gone`` (it exited or
died, its pid perhaps another process's now) or ``unknown`` (a trainer in another pid namespace:
a container, a pod's other container; its pid means nothing to the daemon). The log says it once when a rank passes the threshold and once when it moves again.

``STALL_AFTER_S`` is 30 s, or the environment's ``PREFETCHD_STALL_AFTER_S``.

Not stalled: a rank no trainer has written to since the daemon started whose last trainer is
not known to run (gone, or unknown: a progress file left by an earlier run, nobody is reading),
and a rank that is done.
"""

from __future__ import annotations

import logging
import os

from prefetchd.format import procstate
from prefetchd.format.status import describe_stall

log = logging.getLogger("prefetchd")

# a trainer writes a record per batch read: 30 s without one is no slow step (the environment's
# PREFETCHD_STALL_AFTER_S, in seconds, overrides it: a job whose steps are longer, the tests)
STALL_AFTER_S = float(os.environ.get("PREFETCHD_STALL_AFTER_S") or 30.0)


class StallWatch:
    """Which ranks are stalled (``check``, once per status record), logging each change once."""

    def __init__(self, after_s: float = STALL_AFTER_S):
        self.after_s = after_s
        self._stalled: dict[int, float] = {}  # rank -> the last record's time when it was found stalled

    def check(self, rank: int, now: float, seen: float | None, pid: int | None, done: bool, live: bool,
              identity: tuple[int, int] = (0, 0)) -> dict | None:
        """The stall of ``rank`` (``{"since", "age_s", "pid", "process"}``), or None when it
        moves. ``seen``: when its last record was read (wall clock); ``live``: a record was
        read since the daemon started; ``identity``: the trainer's (start, pid namespace)."""
        stall = None
        if seen is not None and not done and now - seen >= self.after_s:
            state = procstate.state(pid, *identity) if pid else procstate.GONE
            if live or state in (procstate.RUNNING, procstate.STOPPED):
                stall = {"since": seen, "age_s": now - seen, "pid": pid, "process": state}
        was = self._stalled.get(rank)
        if stall is not None and was is None:
            self._stalled[rank] = seen
            log.warning("rank %d: %s", rank, describe_stall(stall))
        elif stall is None and was is not None:
            del self._stalled[rank]
            if seen is not None and seen > was:
                log.info("rank %d moves again after %.0f s without progress", rank, seen - was)
        return stall
