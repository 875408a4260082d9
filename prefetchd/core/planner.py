"""The planner: which batches to evict and which to make next. Pure: no files, no processes, no
clock of its own (the caller passes ``now``), so every policy decision is unit-testable.

Positions are linear: batch ``b`` of epoch ``e`` is ``g = e * batches_per_epoch + b``. A rank at
``pos`` has the *window* ``[pos, min(pos + capacity, end))``, where ``end`` is
``epochs * batches_per_epoch`` (no end when training is endless). State per rank, kept up to date
as events arrive instead of being recomputed:

* ``ready``: published batches, all inside the window (a move of the position evicts what left
  it, found by walking the positions that left, never by scanning the ring);
* ``inflight``: batches being made, inside the window; one that leaves the window while being made
  becomes an *orphan*, still counted in the bytes until its result arrives and is thrown away;
* ``holes``: batches that were handed out and came back unmade (a failed batch waits out its
  back-off, ``retry_at``; a dead worker's batch is due at once);
* ``cursor``: every batch in ``[pos, cursor)`` is ready, in flight or a hole, so the next batch to
  hand out is the earliest due hole or ``cursor`` (amortised O(1) per batch).

Pass-bounded lanes (the validation stream: ``pass_len`` given). A lane's window also ends at
the end of its position's pass (``pass_len(rank)`` batches, which may differ between ranks; the
linear position still uses ``batches_per_epoch``, the largest), and a lane has a window only
while it is *active* (``set_active``: its trainer iterates a pass). Lanes start inactive; going
inactive evicts the whole window. So nothing is made before a trainer asks, nothing is made
ahead across passes, and what a finished or abandoned pass left is deleted.

Policy (``plan``): a rank starts *filling* when fewer than ``refill_at`` batches, counted
contiguously from its position, are ready or in flight, and stops when its window is covered
(``capacity`` ready or in flight, or nothing left to make). Each free worker slot goes to the
filling rank with the fewest batches ready or in flight contiguously from its position (batches
held behind a gap do not count: the trainer cannot read them), so a slow (full) rank never starves
the others. A due gap at a rank's front (a failed or lost batch the trainer waits for) goes
before everything else and is exempt from ``max_bytes``: room is made by evicting that rank's
farthest ready batches (see ``_front_holes``). Any other batch is handed out only if ready +
in-flight bytes + its estimate stay within the planner's *budget*, ``max_bytes - others``
(``others``: what another stream sharing ``buffer.max_bytes`` holds or keeps), and the filesystem keeps ``min_free_bytes`` free after the part of the in-flight
bytes not yet on disk is written (temp files already written are in ``free_bytes``: counted once).

Sharing ``max_bytes`` between the train stream and the validation lanes (the loop's part, with
two planners): the val planner's ``room_wanted`` is what it holds plus what each active lane
misses of its next batches, as many as keep the workers busy (``ceil(workers / lanes) + 1``,
within the val capacity; train is not read while its trainers validate); the train planner's
``others`` is that, so a pass being read always has room for its next batches, and ``shrink``
takes train's excess back from the far end of its fullest windows (never a rank's front batch:
the one its trainer reads next). When the pass ends its lanes hold nothing and want nothing:
train's budget is ``max_bytes`` again.
Filling ranks wait in a heap keyed by what they hold, and a plan looks again only at ranks whose
state changed since the last one: O(log ranks) per batch handed out; a position move costs
O(batches that left the window) (a jump back also walks the new window once). Nothing walks
a whole window or every rank per step.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

Key = tuple[int, int, int]  # (rank, epoch, batch)

RETRY_BASE_S = 1.0  # a failed batch waits this long, doubling with each failure in a row
RETRY_MAX_S = 60.0


@dataclass(frozen=True)
class Limits:
    capacity: int
    refill_at: int
    max_bytes: int
    min_free_bytes: int
    others: int = 0  # bytes of max_bytes another stream holds or keeps: this planner's budget is the rest


@dataclass(frozen=True)
class Plan:
    submit: list[Key]
    blocked: str | None = None  # why production waits, if it does
    evictions: list[Key] = field(default_factory=list)  # published batches dropped to make room: delete them
    cause: str | None = None  # what blocks, in one word ("max_bytes", "too_small", "disk"): a spell's identity


@dataclass
class _Rank:
    pos: int = 0
    ready: dict[int, int] = field(default_factory=dict)  # g -> bytes
    inflight: dict[int, int] = field(default_factory=dict)  # g -> estimated bytes
    holes: dict[int, float] = field(default_factory=dict)  # g -> when it may be handed out again
    cursor: int = 0
    ready_front: int = 0  # every batch in [pos, ready_front) is ready
    filling: bool = True
    active: bool = True  # False: no window at all (a pass-bounded lane no trainer reads)
    held: bool = False  # True: keeps its window, but nothing new is made for it (see ``hold``)


def retry_delay_s(failures: int) -> float:
    """Back-off before a batch that failed ``failures`` times in a row is tried again."""
    return min(RETRY_MAX_S, RETRY_BASE_S * 2.0 ** min(failures - 1, 30))


def _beyond_front(s: _Rank) -> bool:
    """Whether the rank has a ready batch past its front (all ready batches are in its window)."""
    return len(s.ready) > (s.pos in s.ready)


def _size(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} B"


class Planner:
    def __init__(self, ranks: Iterable[int], batches_per_epoch: int, epochs: int | None, limits: Limits,
                 estimate: Callable[[Key], int], pass_len: Callable[[int], int] | None = None):
        """``estimate(key)``: an upper bound on the file size of the batch ``key`` (rank, epoch, batch).
        ``pass_len(rank)``: batches of the rank's pass, for pass-bounded lanes (they start inactive)."""
        if batches_per_epoch < 1:
            raise ValueError("batches_per_epoch must be positive")
        self.bpe = batches_per_epoch
        self.end = None if epochs is None else epochs * batches_per_epoch
        self.limits = limits
        self._estimate = estimate
        self._pass_len = pass_len
        self.name, self._other = ("validation", "train") if pass_len is not None else ("train", "validation")
        self._batch = "validation batch" if pass_len is not None else "batch"
        self.ranks: dict[int, _Rank] = {r: _Rank(active=pass_len is None) for r in ranks}
        self._active: set[int] = set() if pass_len is not None else set(self.ranks)
        self._orphans: dict[Key, list[int]] = {}  # in flight but no longer wanted: estimates
        self.failures: dict[Key, int] = {}  # failures in a row per batch (cleared by a success)
        self.bytes_ready = 0
        self.bytes_inflight = 0  # estimates of everything being made, orphans included
        self._check: set[int] = set(self.ranks)  # ranks whose watermark must be looked at again
        self._holed: set[int] = set()  # ranks with batches waiting to be retried
        self._heap: list[tuple[int, int, int]] = []  # (ready + in flight, rank, version): filling ranks
        self._ver = dict.fromkeys(self.ranks, 0)

    # --- positions ---------------------------------------------------------------------------------

    def key(self, r: int, g: int) -> Key:
        return (r, g // self.bpe, g % self.bpe)

    def linear(self, epoch: int, batch: int) -> int:
        return epoch * self.bpe + batch

    def position(self, r: int) -> tuple[int, int]:
        g = self.ranks[r].pos
        return (g // self.bpe, g % self.bpe)

    def window_end(self, r: int) -> int:
        s = self.ranks[r]
        if not s.active:
            return s.pos
        top = s.pos + self.limits.capacity
        if self._pass_len is not None:
            top = min(top, s.pos - s.pos % self.bpe + self._pass_len(r))
        return top if self.end is None else min(top, self.end)

    def set_active(self, r: int, active: bool) -> list[Key]:
        """A pass-bounded lane's trainer starts (True) or stops (False) reading. Going inactive
        empties the window: returns the published batches to delete."""
        s = self.ranks[r]
        if active == s.active:
            return []
        hi = self.window_end(r)
        s.active = active
        (self._active.add if active else self._active.discard)(r)
        self._check.add(r)
        if active:
            s.filling = True
            return []
        evicted = self._drop(r, s, range(s.pos, hi))
        s.cursor = s.ready_front = s.pos
        return evicted

    def set_position(self, r: int, epoch: int, batch: int) -> list[Key]:
        """Move rank ``r`` to ``(epoch, batch)``; ``batch`` may run past the epoch. Returns the
        published batches that left the window, to be deleted."""
        s = self.ranks[r]
        new = self.linear(epoch, batch)
        old_lo, old_hi = s.pos, self.window_end(r)
        if new == old_lo:
            return []
        s.pos = new
        self._check.add(r)
        new_hi = self.window_end(r)
        if new > old_lo:  # forward: what lies below the new position, and nothing else, leaves
            gone: Iterable[int] = range(old_lo, min(new, old_hi))
        else:  # a jump back: what lies beyond the new window leaves
            gone = range(max(new_hi, old_lo), old_hi)
        evicted = self._drop(r, s, gone)
        for key in [k for k in self._orphans if k[0] == r]:  # back inside: wanted again, no need to remake
            g = self.linear(key[1], key[2])
            if new <= g < new_hi and g not in s.ready and g not in s.inflight:
                ests = self._orphans[key]
                s.inflight[g] = ests.pop()
                if not ests:
                    del self._orphans[key]
        if new > old_lo:
            s.cursor = max(s.cursor, new)
            s.ready_front = max(s.ready_front, new)
        else:
            s.cursor = s.ready_front = new
        return evicted

    def _drop(self, r: int, s: _Rank, gs: Iterable[int]) -> list[Key]:
        evicted = []
        if len(s.ready) + len(s.inflight) + len(s.holes) == 0:
            return evicted
        for g in gs:
            size = s.ready.pop(g, None)
            if size is not None:
                self.bytes_ready -= size
                evicted.append(self.key(r, g))
            est = s.inflight.pop(g, None)
            if est is not None:
                self._orphans.setdefault(self.key(r, g), []).append(est)
            if (s.holes.pop(g, None) is not None or est is not None) and self.failures:
                self.failures.pop(self.key(r, g), None)  # left the window: its count of failures too
        return evicted

    def forget(self, r: int) -> list[Key]:
        """Empty rank ``r``'s window where it stands: what it holds was made for another
        segmentation of its epoch (a resume at another world size). Returns the published batches
        to delete; those in flight become orphans (see ``stale``)."""
        s = self.ranks[r]
        evicted = self._drop(r, s, range(s.pos, self.window_end(r)))
        s.cursor = s.ready_front = s.pos
        s.filling = True
        self._check.add(r)
        return evicted

    def hold(self, r: int, held: bool) -> None:
        """A held rank keeps what it has (nothing is evicted) but nothing new is made for it, until
        released: the daemon does not know which segmentation it will read (its trainers disagree)."""
        s = self.ranks[r]
        if s.held != held:
            s.held = held
            s.filling = True
            self._check.add(r)

    def stale(self, key: Key) -> None:
        """A result made for a segmentation no longer read came back (its file is thrown away).
        Its orphan's bytes are released; if a move took its key back into the window meanwhile
        (in flight again, now for the new segmentation), that batch is made again."""
        ests = self._orphans.get(key)
        if ests:
            self.bytes_inflight -= ests.pop()
            if not ests:
                del self._orphans[key]
        elif self.is_inflight(key):
            self._unmade(key, 0.0)

    def set_limits(self, limits: Limits) -> list[Key]:
        """New capacity or byte limits (a reload). Returns published batches now outside a window."""
        old = self.limits
        self.limits = limits
        evicted = []
        for r, s in self.ranks.items():
            if limits.capacity < old.capacity:
                evicted += self._drop(r, s, range(s.pos + limits.capacity, s.pos + old.capacity))
                s.cursor = min(s.cursor, self.window_end(r))
            s.filling = True
        self._check.update(self.ranks)
        return evicted

    # --- events ------------------------------------------------------------------------------------

    def adopt(self, key: Key, size: int) -> bool:
        """A batch found published at start-up: kept if some window wants it (else delete it)."""
        r, e, b = key
        s = self.ranks.get(r)
        if s is None or not 0 <= b < self.bpe:
            return False
        g = self.linear(e, b)
        if not s.pos <= g < self.window_end(r) or g in s.ready:
            return False
        s.ready[g] = size
        self.bytes_ready += size
        self._check.add(r)
        return True

    def is_inflight(self, key: Key) -> bool:
        s = self.ranks.get(key[0])
        return s is not None and self.linear(key[1], key[2]) in s.inflight

    def finished(self, key: Key) -> bool:
        """A batch's result came back. True: publish it, then call ``published``; False: it is
        no longer wanted (an orphan, or already ready), throw it away."""
        r, e, b = key
        s = self.ranks.get(r)
        g = self.linear(e, b)
        if s is not None and g in s.inflight:
            self.bytes_inflight -= s.inflight.pop(g)
            s.inflight[g] = 0  # still covered until published or failed
            return True
        ests = self._orphans.get(key)
        if ests:
            self.bytes_inflight -= ests.pop()
            if not ests:
                del self._orphans[key]
        return False

    def published(self, key: Key, size: int) -> None:
        r, e, b = key
        s = self.ranks[r]
        g = self.linear(e, b)
        s.inflight.pop(g, None)
        s.ready[g] = size
        self.bytes_ready += size
        self.failures.pop(key, None)

    def failed(self, key: Key, now: float) -> float:
        """The batch could not be made (or published): it is tried again after a back-off that
        doubles per failure in a row. Other batches and ranks go on. Returns the delay."""
        n = self.failures.get(key, 0) + 1
        self.failures[key] = n
        delay = retry_delay_s(n)
        self._unmade(key, now + delay)
        return delay

    def deferred(self, key: Key, retry_at: float) -> None:
        """The batch could not be made through no fault of its own (the dataset's storage was
        unreadable): it is tried again at ``retry_at``, and its back-off is left as it was."""
        self._unmade(key, retry_at)

    def lost(self, key: Key) -> None:
        """The batch's worker died or was given up on: make it again, now."""
        self._unmade(key, 0.0)

    def _unmade(self, key: Key, retry_at: float) -> None:
        r, e, b = key
        s = self.ranks[r]
        g = self.linear(e, b)
        est = s.inflight.pop(g, None)
        if est is not None:
            self.bytes_inflight -= est
            s.holes[g] = retry_at
            self._holed.add(r)
            self._check.add(r)
            return
        ests = self._orphans.get(key)  # a lost orphan: nothing to remake
        if ests:
            self.bytes_inflight -= ests.pop()
            if not ests:
                del self._orphans[key]

    # --- the plan ----------------------------------------------------------------------------------

    def ahead(self, r: int) -> int:
        """Batches ready or in flight contiguously from the position (what the watermark counts)."""
        s = self.ranks[r]
        self._advance(s)
        front = min(s.holes) if s.holes else s.cursor
        return max(0, front - s.pos)

    def ready_ahead(self, r: int) -> int:
        """Batches ready contiguously from the position (what the trainer can read right now)."""
        s = self.ranks[r]
        f = max(s.ready_front, s.pos)
        while f in s.ready:
            f += 1
        s.ready_front = f
        return f - s.pos

    def _advance(self, s: _Rank) -> None:
        c = max(s.cursor, s.pos)
        while c in s.ready or c in s.inflight or c in s.holes:
            c += 1
        s.cursor = c

    def _candidate(self, r: int, s: _Rank, now: float) -> int | None:
        if s.holes:
            due = [g for g, t in s.holes.items() if t <= now]
            if due:
                return min(due)
        self._advance(s)
        return s.cursor if s.cursor < self.window_end(r) else None

    def plan(self, slots: int, now: float, free_bytes: int, temp_bytes: int = 0) -> Plan:
        """Up to ``slots`` batches to make now (marked in flight here), emptiest filling rank first.
        ``free_bytes``: the buffer filesystem's free space; ``temp_bytes``: what the batches in
        flight have already written there. Costs O(log ranks) per batch handed out plus O(ranks
        whose state changed since the last plan), not O(ranks)."""
        lim = self.limits
        for r in self._check | self._holed:  # only these can have fallen below the watermark
            s = self.ranks[r]
            if not s.holes:
                self._holed.discard(r)
            if not s.filling and self.ahead(r) < lim.refill_at:
                s.filling = True
            if s.filling and not s.held:
                self._push(r)
        self._check.clear()
        out: list[Key] = []
        evictions: list[Key] = []
        blocked = self._front_holes(slots, now, free_bytes, temp_bytes, out, evictions)
        cause = "disk" if blocked else None
        heap = self._heap
        while len(out) < slots and heap:
            have, r, ver = heapq.heappop(heap)
            s = self.ranks[r]
            if ver != self._ver[r] or not s.filling or s.held:
                continue  # stale: the rank's count changed, or it stopped filling (or is held)
            g = self._candidate(r, s, now)
            if g is None or have >= lim.capacity:
                s.filling = False
                continue
            key = self.key(r, g)
            est = self._estimate(key)
            if self.held + est > self.budget:
                blocked, cause = self._over_bytes(est)
                heapq.heappush(heap, (have, r, ver))
                break
            unwritten = max(0, self.bytes_inflight - temp_bytes)
            if free_bytes - unwritten - est < lim.min_free_bytes:
                blocked, cause = self._disk_full(free_bytes, est), "disk"
                heapq.heappush(heap, (have, r, ver))
                break
            s.holes.pop(g, None)
            s.inflight[g] = est
            self.bytes_inflight += est
            out.append(key)
            self._push(r)
        if len(heap) > 4 * len(self.ranks) + 64:  # drop stale entries now and then
            self._heap = [e for e in heap if e[2] == self._ver[e[1]] and self.ranks[e[1]].filling]
            heapq.heapify(self._heap)
        return Plan(out, blocked, evictions, cause)

    @property
    def held(self) -> int:
        """Bytes this planner holds: published plus the estimates of what is being made."""
        return self.bytes_ready + self.bytes_inflight

    @property
    def budget(self) -> int:
        """What this planner may hold: ``max_bytes`` less what the other stream holds or keeps."""
        return self.limits.max_bytes - self.limits.others

    def _over_bytes(self, est: int) -> tuple[str, str]:
        lim = self.limits
        if est > lim.max_bytes:
            return (f"one {self._batch} needs {_size(est)} but buffer.max_bytes is {_size(lim.max_bytes)}; "
                    "raise buffer.max_bytes"), "too_small"
        left = max(0, lim.max_bytes - self.held - lim.others)
        return (f"buffer.max_bytes ({_size(lim.max_bytes)}) reached: {self.name} holds {_size(self.held)}, "
                f"{self._other} {_size(lim.others)}, {_size(left)} left; a {self._batch} needs {_size(est)}",
                "max_bytes")

    def _disk_full(self, free_bytes: int, est: int) -> str:
        return (f"the buffer filesystem has {_size(free_bytes)} free; a batch needs {_size(est)} "
                f"and buffer.min_free_bytes keeps {_size(self.limits.min_free_bytes)}")

    def room_wanted(self, workers: int = 0) -> int:
        """For a pass-bounded planner: the bytes it must be able to hold, what it holds plus the
        batches its active lanes (those with batches left in their pass) miss of their next
        ``depth``: one each (the batch the trainer waits for), or with ``workers`` enough to keep
        that many workers busy, ``ceil(workers / lanes) + 1`` each, within ``capacity`` and the
        pass. O(active lanes x depth)."""
        room = self.held
        lanes = [r for r in self._active if self.ranks[r].pos < self.window_end(r)]
        if not lanes:
            return room
        depth = max(1, min(self.limits.capacity, -(-workers // len(lanes)) + 1)) if workers else 1
        for r in lanes:
            s = self.ranks[r]
            for g in range(s.pos, min(s.pos + depth, self.window_end(r))):
                if g not in s.ready and g not in s.inflight:
                    room += self._estimate(self.key(r, g))
        return room

    def shrink(self, budget: int) -> list[Key]:
        """Give bytes back until this planner holds at most ``budget``: evict the farthest ready
        batch of the rank holding the most, again and again (so windows shrink evenly from their
        far end). A rank's front batch (its position: what its trainer reads next) stays; what
        is in flight counts until it lands. Returns the published batches to delete. O(1) when
        within the budget; else O(ranks + evicted x (log ranks + window)): only when another
        stream takes room."""
        if self.held <= budget:
            return []
        heap = [(-(len(s.ready) + len(s.inflight)), r) for r, s in self.ranks.items() if _beyond_front(s)]
        heapq.heapify(heap)
        evicted = []
        while self.held > budget and heap:
            _, r = heapq.heappop(heap)
            s = self.ranks[r]
            far = max(s.ready)
            if far <= s.pos:
                continue
            self.bytes_ready -= s.ready.pop(far)
            s.cursor = min(s.cursor, far)
            s.ready_front = min(s.ready_front, far)
            evicted.append(self.key(r, far))
            self._check.add(r)
            if _beyond_front(s):
                heapq.heappush(heap, (-(len(s.ready) + len(s.inflight)), r))
        return evicted

    def _front_holes(self, slots: int, now: float, free_bytes: int, temp_bytes: int, out: list[Key],
                     evictions: list[Key]) -> str | None:
        """Due holes at a rank's front (its first missing batch, below the watermark) go first:
        the trainer waits for exactly that batch, so ``max_bytes`` must not hold it back. Room is
        made by evicting the rank's own farthest ready batches (made again later); if that is not
        enough it goes out anyway, over ``max_bytes`` by at most one batch per such rank: with
        the rank's later batches already filling the buffer, waiting would never end. O(ranks
        with holes) per plan."""
        lim = self.limits
        blocked = None
        fronts = []
        for r in self._holed:
            s = self.ranks[r]
            if s.holes and not s.held:
                g = min(s.holes)
                if s.holes[g] <= now and g - s.pos < max(1, lim.refill_at):
                    fronts.append((g - s.pos, r, g))
        for _, r, g in sorted(fronts):
            if len(out) >= slots:
                break
            s = self.ranks[r]
            key = self.key(r, g)
            est = self._estimate(key)
            if est > lim.max_bytes:
                continue  # can never fit: the heap pass below says so
            while self.held + est > self.budget and s.ready:
                far = max(s.ready)  # a walk of the window, but only on this rare path
                if far < g:
                    break
                self.bytes_ready -= s.ready.pop(far)
                s.cursor = min(s.cursor, far)
                evictions.append(self.key(r, far))
            unwritten = max(0, self.bytes_inflight - temp_bytes)
            if free_bytes - unwritten - est < lim.min_free_bytes:
                blocked = self._disk_full(free_bytes, est)
                continue
            del s.holes[g]
            s.inflight[g] = est
            self.bytes_inflight += est
            out.append(key)
            self._push(r)
        return blocked

    def _push(self, r: int) -> None:
        self._ver[r] += 1
        heapq.heappush(self._heap, (self.ahead(r), r, self._ver[r]))

    def next_retry(self, now: float) -> float | None:
        """When the earliest failed batch not yet due may be tried again (for the loop's wait), if
        any. A batch already due but held back (no free slot, no room) is not a reason to wake:
        a worker finishing or a trainer reading (both wake the loop) is what can change that."""
        ts = [t for r in self._holed for t in self.ranks[r].holes.values() if t > now]
        return min(ts) if ts else None

    # --- reporting ---------------------------------------------------------------------------------

    def rank_status(self, r: int) -> dict:
        s = self.ranks[r]
        return {"position": list(self.position(r)), "ready": len(s.ready), "ahead": self.ready_ahead(r),
                "in_flight": len(s.inflight), "retrying": len(s.holes), "filling": s.filling,
                "done": self.end is not None and s.pos >= self.end, "active": s.active, "held": s.held}

    def busy(self) -> bool:
        """Anything being made (orphans included)? O(1)."""
        return self.bytes_inflight > 0
