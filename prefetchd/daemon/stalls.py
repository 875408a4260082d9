"""What each rank's trainer is doing, and ranks whose trainer has stopped moving: what ``status``,
the metrics and the log say of them.

A rank's trainer (``trainer`` in its status record, ``prefetchd_rank_trainer{state=...}``) is
``finished`` once its last record says ``closed`` (``close()``, or its process exited cleanly:
``format.progress``) or the rank is done; ``waiting`` while its last record says its ``next()``
waits for a batch (``waiting_since``) and its process runs (its state is not ``stopped`` or
``gone``); ``stalled`` as below; ``reading`` otherwise; None with no trainer (no record, or one
left by an earlier run's trainer that is not known to run). A waiting trainer is starved by the
daemon, not stalled: its wait is counted while it lasts (``wait_s``, and ``waiting``'s
``for_s``), on the monotonic clock while its process runs, so the data-bound figures
(``waited_share``, ``rate(prefetchd_trainer_wait_seconds_total)``) see it before it ends, or if
it ends in a timeout; the counter shown never goes back for one trainer client (the client's own
count, which leaves out its process's stopped spells, replaces the daemon's when the wait ends).

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

Not stalled: a finished rank, a waiting one, a rank no trainer has written to since the daemon
started whose last trainer is not known to run (gone, or unknown: a progress file left by an
earlier run, nobody is reading), and a rank that is done.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from prefetchd.format import procstate
from prefetchd.format.status import describe_stall

log = logging.getLogger("prefetchd")

# a trainer writes a record per batch read: 30 s without one is no slow step (the environment's
# PREFETCHD_STALL_AFTER_S, in seconds, overrides it: a job whose steps are longer, the tests)
STALL_AFTER_S = float(os.environ.get("PREFETCHD_STALL_AFTER_S") or 30.0)

READING, WAITING, FINISHED, STALLED = "reading", "waiting", "finished", "stalled"
TRAINER_STATES = (READING, WAITING, FINISHED, STALLED)


@dataclass(frozen=True)
class Seen:
    """What the daemon last read of a rank's trainer (``daemon.sessions``), as ``StallWatch.trainer`` needs it."""

    time: float | None  # when its last record was read (wall clock); None: never
    pid: int | None = None
    identity: tuple[int, int] = (0, 0)  # the trainer's (start, pid namespace)
    live: bool = False  # a record was read since the daemon started
    closed: bool = False
    waiting_since: float = 0.0
    wait_s: float = 0.0  # its wait counter as last written
    client: str = ""  # which client of which process wrote it (its wait counter's owner)
    wait_is_own: bool = True  # False: the wait is of another lane's (validation) than wait_s: not added to it


class StallWatch:
    """Which ranks are stalled (``check``, once per status record), logging each change once."""

    def __init__(self, after_s: float = STALL_AFTER_S, clock=time.monotonic):
        self.after_s = after_s
        self._clock = clock
        self._zero: dict[int, tuple[float, float]] = {}  # rank -> (last record's time, monotonic time of its age 0)
        self._stalled: dict[int, float] = {}  # rank -> the monotonic time of age 0 of the record found stalled
        self._waits: dict[int, list] = {}  # rank -> [waiting_since, seconds counted, monotonic time last looked]
        self._shown: dict[int, tuple[str, float]] = {}  # rank -> (client, the wait counter last shown)

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

    def trainer(self, rank: int, now: float, seen: Seen, done: bool) -> dict:
        """What ``rank``'s trainer is doing: ``{"trainer", "stalled", "waiting", "wait_s"}`` (see
        the module docstring); ``waiting`` is ``{"since", "for_s"}`` or None."""
        waiting = None
        counting = False
        if seen.waiting_since and not seen.closed and not done:
            proc = procstate.state(seen.pid, *seen.identity) if seen.pid else procstate.UNKNOWN
            counting = proc in (procstate.RUNNING, procstate.UNKNOWN)  # stopped or gone: no wait of the daemon's
        if seen.wait_is_own:
            for_s, wait_s = self._count_wait(rank, now, seen.waiting_since, seen, counting)
        else:  # a validation wait: said, not added to the train counter
            wait_s = self._count_wait(rank, now, 0.0, seen, False)[1]
            for_s = max(0.0, now - seen.waiting_since)
        if counting:
            waiting = {"since": seen.waiting_since, "for_s": for_s}
        stall = self.check(rank, now, seen.time, seen.pid, done or seen.closed, seen.live, seen.identity,
                           waiting=counting)
        if seen.time is None:
            state = None
        elif done or seen.closed:
            state = FINISHED
        elif waiting:
            state = WAITING
        elif stall:
            state = STALLED
        elif not seen.live and (self.age(rank, now, seen.time) or 0.0) >= self.after_s:
            state = None  # a record of an earlier run's, its trainer not known to run: nobody reads
        else:
            state = READING
        return {"trainer": state, "stalled": stall, "waiting": waiting, "wait_s": wait_s}

    def _count_wait(self, rank: int, now: float, since: float, seen: Seen, counting: bool) -> tuple[float, float]:
        """(seconds of the wait in progress, the wait counter to show): the record's ``wait_s``
        plus the wait in progress since ``since`` (0: none), counted on the monotonic clock while
        ``counting`` (from ``since`` when first seen), never less than last shown for the same client."""
        mono = self._clock()
        w = self._waits.get(rank)
        if not since or seen.closed:
            self._waits.pop(rank, None)
            pending = 0.0
        elif w is None or w[0] != since:  # a new wait
            pending = max(0.0, now - since) if counting else 0.0
            self._waits[rank] = [since, pending, mono]
        else:
            if counting:
                w[1] += max(0.0, mono - w[2])
            w[2] = mono
            pending = w[1]
        shown = seen.wait_s + pending
        last = self._shown.get(rank)
        if last is not None and last[0] == seen.client and last[1] > shown:
            shown = last[1]  # the client counted less (its stopped spells): the counter holds, it never goes back
        self._shown[rank] = (seen.client, shown)
        return pending, shown

    def check(self, rank: int, now: float, seen: float | None, pid: int | None, done: bool, live: bool,
              identity: tuple[int, int] = (0, 0), waiting: bool = False) -> dict | None:
        """The stall of ``rank`` (``{"since", "age_s", "pid", "process"}``), or None when it
        moves. ``seen``: when its last record was read (wall clock); ``done``: nothing left to
        read, or the trainer finished; ``live``: a record was read since the daemon started;
        ``identity``: the trainer's (start, pid namespace); ``waiting``: its ``next()`` waits
        for a batch, its process running (starved, not stalled)."""
        stall = None
        age = self.age(rank, now, seen)
        if age is not None and not done and not waiting and age >= self.after_s:
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
                log.info("rank %d%s after %.0f s without progress", rank,
                         "'s trainer finished" if done else " moves again", self._zero[rank][1] - was)
        return stall
