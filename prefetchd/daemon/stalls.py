"""Ranks whose trainer has stopped moving: what ``status``, the metrics and the log say of them.

A rank is stalled once ``STALL_AFTER_S`` have passed since the last progress record the daemon
read from its trainer (train or validation lane), while it has batches left to read. Its record
says since when and what its trainer's process is doing, from the pid in the progress file
(``format.procstate``): ``running`` (a breakpoint, a long checkpoint write, a collective waiting
on another rank), ``stopped`` (SIGSTOP, ``scontrol suspend``, Ctrl-Z), ``gone`` (it exited or
died, its pid perhaps another process's now) or ``unknown`` (a trainer in another pid namespace:
a container, a pod's other container; its pid means nothing to the daemon). The log says it once when a rank passes the threshold and once when it moves again.

``STALL_AFTER_S`` is 30 s, or the environment's ``PREFETCHD_STALL_AFTER_S``.

Ages are measured on the monotonic clock from the moment a record is first looked at (its wall
clock age then, the records' times being wall clock): a step of the wall clock (NTP, ``date -s``)
neither stalls every rank at once nor hides a stalled one for as long as a step back. The daemon
passes its ``RunClock``, which leaves out the time it was stopped itself: a job suspended whole
(trainers and daemon) is not taken on resuming for trainers that stopped moving.

Not stalled: a rank no trainer has written to since the daemon started whose last trainer is
not known to run (gone, or unknown: a progress file left by an earlier run, nobody is reading),
and a rank that is done.
"""

from __future__ import annotations

import logging
import os
import time

from prefetchd.format import procstate
from prefetchd.format.status import describe_stall

log = logging.getLogger("prefetchd")

# a trainer writes a record per batch read: 30 s without one is no slow step (the environment's
# PREFETCHD_STALL_AFTER_S, in seconds, overrides it: a job whose steps are longer, the tests)
STALL_AFTER_S = float(os.environ.get("PREFETCHD_STALL_AFTER_S") or 30.0)


class StallWatch:
    """Which ranks are stalled (``check``, once per status record), logging each change once."""

    def __init__(self, after_s: float = STALL_AFTER_S, clock=time.monotonic):
        self.after_s = after_s
        self._clock = clock
        self._zero: dict[int, tuple[float, float]] = {}  # rank -> (last record's time, monotonic time of its age 0)
        self._stalled: dict[int, float] = {}  # rank -> the monotonic time of age 0 of the record found stalled

    def age(self, rank: int, now: float, seen: float | None) -> float | None:
        """Seconds since ``rank``'s last record (wall time ``seen``; ``now`` the wall clock), on the
        monotonic clock once the record has been looked at."""
        if seen is None:
            return None
        mono = self._clock()
        zero = self._zero.get(rank)
        if zero is None or zero[0] != seen:
            zero = self._zero[rank] = (seen, mono - max(0.0, now - seen))
        return mono - zero[1]

    def check(self, rank: int, now: float, seen: float | None, pid: int | None, done: bool, live: bool,
              identity: tuple[int, int] = (0, 0)) -> dict | None:
        """The stall of ``rank`` (``{"since", "age_s", "pid", "process"}``), or None when it
        moves. ``seen``: when its last record was read (wall clock); ``live``: a record was
        read since the daemon started; ``identity``: the trainer's (start, pid namespace)."""
        stall = None
        age = self.age(rank, now, seen)
        if age is not None and not done and age >= self.after_s:
            state = procstate.state(pid, *identity) if pid else procstate.GONE
            if live or state in (procstate.RUNNING, procstate.STOPPED):
                stall = {"since": seen, "age_s": age, "pid": pid, "process": state}
        was = self._stalled.get(rank)
        if stall is not None and was is None:
            self._stalled[rank] = self._zero[rank][1]
            log.warning("rank %d: %s", rank, describe_stall(stall))
        elif stall is None and was is not None:
            del self._stalled[rank]
            if seen is not None and self._zero[rank][1] > was:
                log.info("rank %d moves again after %.0f s without progress", rank, self._zero[rank][1] - was)
        return stall
