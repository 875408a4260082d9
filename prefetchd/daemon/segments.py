"""Resumed epochs in the daemon: which segmentation each rank reads, and whether the ranks agree.

A job resumed at another world size or batch size than the one that saved its position reads
the rest of that epoch as a *segment*: the epoch's permutation from sample ``offset`` on, shared
out among this config's ranks (``core.sampler``). Its progress files say the offset
(``format.progress``); its batches have names and header fingerprints of their own
(``format.batchfile``), so they are never mistaken for another segmentation's.

The planner knows nothing of segments. It keeps linear positions ``epoch * bpe + batch`` (``bpe``:
batches per whole epoch), and a resumed epoch's ``n`` batches are the *last* ``n`` of its epoch's
range: planner batch ``skip + b`` is batch ``b`` of the segment (``skip = bpe - n``), so a rank's
positions run on without a gap into the whole epochs after it. This module translates:

* a planner key ``(rank, epoch, batch)`` into the batch it stands for, ``real``:
  ``(rank, epoch, batch - skip, offset)`` in the rank's resumed epoch, ``(rank, epoch, batch, 0)``
  elsewhere; the ring names files by ``file_key`` (``batchfile.parse_name``'s keys);
* a result or a file of segment ``(epoch, offset)`` into its planner key, and whether the rank
  reads that segment now (``planner_key``): a result of another segmentation is stale and thrown
  away (``Planner.stale``), a file of one is removed at start.

A rank's segmentation changes only when its progress says so: a new offset (a resume), or a whole
epoch at or before its resumed one (a seek back). Its window is then emptied first (``Planner.
forget``: made for the old one) and its files deleted under their old names.

Agreement. Every rank of a job resumes an epoch at the same sample. Among the ranks' latest
records (those with this stream's fingerprint, or none), records at one epoch with different
offsets disagree: none of them is applied, the ranks at that epoch are held (``Planner.hold``:
they keep their batches and get no new ones), one error names two of the positions, and
``status.json`` says it (``resume.conflict``, also ``blocked``, which a waiting trainer's timeout
reports) until the records agree; then they are applied. At start the records are applied as
they are (the batches each rank has are kept) and ranks that disagree are held.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import replace

from prefetchd.core.config import Config
from prefetchd.core.planner import Planner
from prefetchd.core.sampler import Sampler
from prefetchd.daemon.sessions import Sessions
from prefetchd.executors.worker import Task
from prefetchd.format.progress import Progress

log = logging.getLogger("prefetchd")

Key = tuple[int, int, int]


def sample_fingerprint(cfg: Config, dataset_fingerprint: str, transform_code: str | None = None) -> str:
    """16 hex digits naming what makes each sample's pixels and the epochs' permutations (seed,
    shuffle, augmentation, dataset), and not how they are cut into batches (world size, batch
    size, drop_last): a state saved at another world or batch size resumes only where they match."""
    L = cfg.loader
    d = {"seed": L.seed, "shuffle": L.shuffle_key(), "augment": cfg.augment.stream_dict()}
    if transform_code:  # the user's transform's module file (core.augment.transform): absent, the digits are as before
        d["transform_code"] = transform_code
    text = json.dumps(d, sort_keys=True, default=list)
    return hashlib.sha256(f"{text}|{dataset_fingerprint}".encode()).hexdigest()[:16]


def disagreements(records: dict[int, Progress], fingerprint: str) -> dict[int, list[tuple[int, int]]]:
    """Per epoch whose records name more than one offset: ``(rank, offset)`` of each record at it.
    Records of another stream (a fingerprint that is not ours, left by another job) do not count."""
    by_epoch: dict[int, list[tuple[int, int]]] = {}
    for r in sorted(records):
        p = records[r]
        if not p.fingerprint or p.fingerprint == fingerprint:
            by_epoch.setdefault(p.epoch, []).append((r, p.offset))
    return {e: rs for e, rs in by_epoch.items() if len({o for _, o in rs}) > 1}


class WholeEpochs:
    """Keys as they are: no rank reads a resumed epoch (a daemon before ``Segments`` is set up,
    as tests that drive parts of one find it)."""

    conflict = None

    def real(self, key: Key) -> tuple[int, int, int, int]:
        return (*key, 0)

    def planner_key(self, r: int, e: int, b: int, offset: int) -> tuple[Key, bool]:
        return (r, e, b), offset == 0

    def user_position(self, r: int, position) -> dict:
        """A planner position ``[epoch, batch]`` of rank ``r`` as its trainer numbers it (the batch of
        its resumed epoch's segment, and the segment's ``offset``), for status.json and messages."""
        if position is None:
            return {}
        _, e, b, o = self.real((r, *position))
        return {"position": [e, b], "offset": o}

    def discard(self, planner: Planner, key: Key, tmp_path: str | None) -> None:
        """A result of a segmentation no longer read: its file goes, the planner is told (``stale``)."""
        planner.stale(key)
        if tmp_path:
            try:
                os.unlink(tmp_path)
            except FileNotFoundError:
                pass


class Segments(WholeEpochs):
    """The train ranks' segmentations: progress records in, planner moves and evictions out."""

    def __init__(self, sampler: Sampler, ranks, fingerprint: str, sessions: Sessions, planner: Planner):
        self.sampler = sampler
        self.bpe = sampler.batches_per_epoch
        self.fingerprint = fingerprint
        self.sessions = sessions
        self.planner = planner
        self.ranks = frozenset(ranks)
        self.resumed: dict[int, tuple[int, int]] = {}  # rank -> (epoch, offset) of its resumed epoch
        self.latest: dict[int, Progress] = {}
        self.held: set[int] = set()
        self.conflict: str | None = None
        self._resuming = 0  # latest records with an offset: without one no two can disagree

    # --- keys ---------------------------------------------------------------------------------------

    def skip(self, offset: int) -> int:
        return self.bpe - self.sampler.batches_in(offset) if offset else 0

    def real(self, key: Key) -> tuple[int, int, int, int]:
        """``(rank, epoch, batch, offset)``: the batch of its segment a planner key stands for."""
        r, e, b = key
        seg = self.resumed.get(r)
        if seg is not None and seg[0] == e:
            return (r, e, b - self.skip(seg[1]), seg[1])
        return (r, e, b, 0)

    def file_key(self, key: Key) -> tuple:
        r, e, b, o = self.real(key)
        return (r, e, b, o) if o else (r, e, b)

    def planner_key(self, r: int, e: int, b: int, offset: int) -> tuple[Key, bool]:
        """The planner key of batch ``b`` of segment ``(e, offset)``, and whether rank ``r`` reads
        that segment now."""
        if not 0 <= offset < self.sampler.num_samples:
            return (r, e, b), False
        seg = self.resumed.get(r)
        return (r, e, b + self.skip(offset)), offset == (seg[1] if seg is not None and seg[0] == e else 0)

    def from_file(self, fkey: tuple) -> Key | None:
        """The planner key of a published file (``batchfile.parse_name``), if its rank reads its segment."""
        key, current = self.planner_key(*fkey[:3], fkey[3] if len(fkey) > 3 else 0)
        return key if current else None

    def task(self, key: Key, crashers, budget: int) -> Task:
        r, e, b, o = self.real(key)
        return Task(r, e, b, self.sampler.batches_in(o), self.sampler.batch_indices(e, r, b, o), crashers, budget,
                    offset=o)

    def lost(self, planner: Planner, task: Task) -> None:
        """An executor gave ``task`` up (its worker died): made again, if its segment is still read."""
        key, current = self.planner_key(task.rank, task.epoch, task.batch, task.offset)
        (planner.lost if current else planner.stale)(key)

    # --- progress -----------------------------------------------------------------------------------

    def apply(self, changed: dict[int, Progress], now: float, initial: bool, evict) -> int:
        """The train ranks' new records: segmentations, agreement, moves. ``evict(key)`` deletes a
        published batch. Returns the batches consumed going forward."""
        if not changed:
            return 0
        for r, p in changed.items():
            if r in self.ranks and self._valid(r, p):
                old = self.latest.get(r)
                self._resuming += (p.offset > 0) - (old is not None and old.offset > 0)
                self.latest[r] = p
        # O(ranks) only while some rank reads a resumed epoch (or they disagree): O(changed) otherwise
        held = self._agreement() if self._resuming or self.conflict else set()
        todo = [r for r in changed if r in self.latest and (initial or r not in held)]
        todo += sorted(self.held - held - set(todo))  # released: their latest records count now
        for r in self.held ^ held:
            self.planner.hold(r, r in held)
        self.held = held
        consumed = 0
        for r in todo:
            p = self.latest[r]
            # a new segmentation is a jump whatever its session says: the positions of the old one
            # are no measure of the new one's (a resumed epoch's batches sit after the epoch's own)
            jump = self._segment(r, p.epoch, p.offset, evict)
            move = self.sessions.apply(r, replace(p, batch=p.batch + self.skip(p.offset)), now, initial, jump)
            if move is None:
                continue
            for key in self.planner.set_position(r, move.epoch, move.batch):
                evict(key)
            consumed += move.consumed
        return consumed

    def _valid(self, r: int, p: Progress) -> bool:
        if p.offset < self.sampler.num_samples:
            return True
        log.warning("rank %d's progress says epoch %d resumes at sample %d, past the epoch's %d samples; ignoring it",
                    r, p.epoch, p.offset, self.sampler.num_samples)
        return False

    def _segment(self, r: int, epoch: int, offset: int, evict) -> bool:
        """Rank ``r`` reads segment ``(epoch, offset)``: whether its segmentation changed."""
        old = self.resumed.get(r)
        if offset:
            new = (epoch, offset)
        else:  # a whole epoch: after its resumed one (read on), or at or before it (a seek back)
            new = old if old is not None and epoch > old[0] else None
        if new == old:
            return False
        for key in self.planner.forget(r):  # made for the old segmentation, deleted under its names
            evict(key)
        if new is None:
            del self.resumed[r]
            return True
        self.resumed[r] = new
        n = self.sampler.batches_in(offset)
        log.info("rank %d reads epoch %d from sample %d of %d: %d batches of %d at world size %d (a resumed epoch)",
                 r, epoch, offset, self.sampler.num_samples, n, self.sampler.batch_size, self.sampler.world_size)
        return True

    def _agreement(self) -> set[int]:
        """The ranks to hold; says (once per change) where the ranks disagree, or that they agree again."""
        bad = disagreements(self.latest, self.fingerprint)
        msg = None
        if bad:
            e = min(bad)
            (r1, o1), (r2, o2) = bad[e][0], next(x for x in bad[e] if x[1] != bad[e][0][1])
            msg = (f"ranks disagree on where epoch {e} resumes: rank {r1} reads it from sample {o1}, rank {r2} from "
                   f"sample {o2} (of {self.sampler.num_samples}); every rank must load the same checkpoint step "
                   f"(nothing is made or deleted for ranks {sorted(r for rs in bad.values() for r, _ in rs)} until "
                   "they agree)")
        if msg != self.conflict:
            if msg:
                log.error("%s", msg)
            else:
                log.info("the ranks agree again on where their epochs start")
        self.conflict = msg
        return {r for rs in bad.values() for r, _ in rs}

    def status(self) -> dict:
        return {"conflict": self.conflict, "held": sorted(self.held),
                "resumed": {str(r): list(seg) for r, seg in sorted(self.resumed.items())}}
