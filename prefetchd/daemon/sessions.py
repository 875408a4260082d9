"""Where each trainer is: progress records in, position moves out.

A record's position is taken unless it goes backwards within the trainer session that wrote
the last one (a stale copy restored, say): then the last good position is kept, with one
warning per session. A new session that goes back is a jump (a resume, a seek): a client starts
one at every move of its trainer's (``seek``, ``set_epoch``, ``load_state_dict``), and so is a
record that moves the rank into another segmentation of an epoch (``segments``). Positions are
linear batch numbers (``epoch * batches_per_epoch + batch``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from prefetchd.format import procstate
from prefetchd.format.progress import Progress, split_lane

log = logging.getLogger("prefetchd")


@dataclass(frozen=True)
class Move:
    rank: int
    epoch: int
    batch: int
    consumed: int  # batches passed going forward (0 for a jump back)


class Sessions:
    def __init__(self, ranks, batches_per_epoch: int, fingerprint: str):
        self.bpe = batches_per_epoch
        self.fingerprint = fingerprint
        self.pos = {r: 0 for r in ranks}
        self.session: dict[int, str] = {}
        self.wait_s = {r: 0.0 for r in ranks}
        self.echoed = {r: 0 for r in ranks}
        self.gpu_fallbacks = {r: 0 for r in ranks}
        self.last_seen: dict[int, float] = {}  # wall-clock time of the last record per rank
        self.pid: dict[int, int] = {}  # the trainer's pid, from its last record
        self.pid_identity: dict[int, tuple[int, int]] = {}  # and its (start, pid namespace)
        self.live: set[int] = set()  # ranks with a record read since the daemon started
        self.closed: set[int] = set()  # ranks whose last record says the trainer is done with them
        self.waiting_since: dict[int, float] = {}  # ranks whose trainer's next() waits, since (wall clock)
        self.consumed = {r: 0 for r in ranks}  # batches passed going forward, since the daemon started
        self._warned: dict[int, str] = {}
        self._pairs: dict[int, frozenset] = {}  # rank -> the two trainers' pids last said to share it

    def _two_trainers(self, r: int, p: Progress) -> None:
        """Say once (per pair) that two live trainers write rank ``r``'s progress: each moves the
        rank's position away from the other's, and one of them waits for batches made for the other."""
        old = self.pid.get(r)
        if not old or not p.pid or old == p.pid or self._pairs.get(r) == {old, p.pid}:
            return
        if procstate.state(old, *self.pid_identity.get(r, (0, 0))) in (procstate.RUNNING, procstate.STOPPED):
            self._pairs[r] = frozenset((old, p.pid))
            log.warning("%s: two trainers write its progress, pids %d and %d, both alive: two trainers "
                        "started with the same rank? give each its own rank (RANK)", _who(r), old, p.pid)

    def apply(self, r: int, p: Progress, now: float, initial: bool = False, jump: bool = False) -> Move | None:
        """The move a record asks for, or None when it is ignored or moves nothing. ``jump``: the
        record moves the rank into another segmentation (``segments``), taken whatever its session."""
        new = p.epoch * self.bpe + p.batch
        old = self.pos[r]
        self.last_seen[r] = now
        if not initial and r in self.live:
            self._two_trainers(r, p)
        self.pid[r] = p.pid
        self.pid_identity[r] = (p.pid_start, p.pid_ns)
        if not initial:
            self.live.add(r)
        self.wait_s[r] = p.wait_s
        self.echoed[r] = p.echoed
        self.gpu_fallbacks[r] = p.gpu_fallbacks
        if p.closed:
            self.closed.add(r)
        else:
            self.closed.discard(r)
        if p.waiting_since and not p.closed:
            self.waiting_since[r] = p.waiting_since
        else:
            self.waiting_since.pop(r, None)
        if new < old and not initial and not jump and p.session and p.session == self.session.get(r):
            if self._warned.get(r) != p.session:
                log.warning("%s's progress went back from epoch %d batch %d to epoch %d batch %d within one "
                            "trainer session; ignoring it and keeping the last good position",
                            _who(r), *divmod(old, self.bpe), *divmod(new, self.bpe))
                self._warned[r] = p.session
            return None
        self.session[r] = p.session
        if p.fingerprint and p.fingerprint != self.fingerprint and not initial:
            log.warning("%s's trainer expects stream %s but this daemon makes %s (a config differs)",
                        _who(r), p.fingerprint, self.fingerprint)
        if new == old:
            return None
        if new < old and not initial:
            log.info("%s jumped back from epoch %d batch %d to epoch %d batch %d (a resume?)",
                     _who(r), *divmod(old, self.bpe), *divmod(new, self.bpe))
        self.pos[r] = new
        e, b = divmod(new, self.bpe)
        move = Move(r, e, b, new - old if new > old and not initial else 0)
        self.consumed[r] += move.consumed
        return move


def _who(lane: int) -> str:
    """A lane as its trainer knows it: "rank 3", or "rank 3 (validation)" for a validation lane."""
    stream, rank = split_lane(lane)
    return f"rank {rank}" + (" (validation)" if stream == "val" else "")
