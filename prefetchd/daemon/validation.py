"""The validation stream in the daemon: its lanes' sampler, planner and sessions.

A lane per rank (``progress.lane("val", rank)``), pass-bounded: a lane's window ends at the end of
its pass and exists only while its trainer iterates a pass (``reading`` in its progress file).
Eval augmentation, the val index relabelled with the train classes, a fingerprint of its own.
The daemon's loop plans it beside the train stream.

Sharing ``buffer.max_bytes`` with train (``make_room``, ``take_rest``): train is planned first,
but its budget leaves room for what validation holds plus the next batches of every lane being
read, as many as keep the workers busy (``ceil(workers / lanes read) + 1`` per lane, within
``validation.capacity``: ``Planner.room_wanted``), and train gives back what it holds beyond that
from the far end of its windows (never a rank's front batch). Train is not read while its
trainers validate, so what it gives up costs nothing until the pass ends, when its lanes hold
nothing and train's budget is ``max_bytes`` again. So a pass always makes progress at the
workers' speed, whatever train's windows would take. If train's front batches alone fill
``max_bytes``, validation goes over it by at most one batch per lane being read (``prefetchd
check`` warns of such a configuration).
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

from prefetchd.core.config import Config
from prefetchd.core.planner import Limits, Planner
from prefetchd.core.sampler import ValSampler
from prefetchd.daemon.sessions import Sessions
from prefetchd.executors.worker import Task
from prefetchd.format import batchfile
from prefetchd.format.progress import VAL_LANE, lane


class ValStream:
    """The validation stream's state in the daemon: sampler, planner and sessions of its lanes."""

    def __init__(self, cfg: Config, index, ranks, train_fingerprint: str):
        V = cfg.validation
        self.index = index
        self.sampler = ValSampler(len(index), V.batch_size, cfg.loader.world_size, V.pad)
        self.ranks = tuple(ranks)
        self.lanes = tuple(lane("val", r) for r in ranks)
        self.stream_fingerprint = cfg.val_stream_fingerprint()
        self.fingerprint_hex = hashlib.sha256(
            f"{cfg.val_stream_fingerprint()}|{train_fingerprint}|{index.fingerprint}".encode()).hexdigest()[:16]
        self.fingerprint = batchfile.fingerprint_u64(self.fingerprint_hex)
        bpp = max(1, self.sampler.max_batches)
        size = cfg.augment.output_size
        self.planner = Planner(self.lanes, bpp, None, Limits(V.capacity, V.capacity, cfg.buffer.max_bytes,
                                                             cfg.buffer.min_free_bytes),
                               lambda key: batchfile.max_file_size(V.batch_size, size, size),
                               pass_len=lambda r: self.sampler.batches(r - VAL_LANE))
        self.sessions = Sessions(self.lanes, bpp, self.fingerprint_hex)

    def make_room(self, train: Planner, workers: int = 0) -> list:
        """Before each plan: train's budget leaves room for what this stream holds and the next
        batches of its lanes being read, enough to keep ``workers`` busy; train gives back its
        excess. Returns train's batches to delete."""
        room = self.planner.room_wanted(workers)
        train.limits = replace(train.limits, others=room)
        return train.shrink(train.budget)

    def take_rest(self, train: Planner) -> None:
        """After train's plan: validation may hold what train leaves, and never less than one
        batch per lane being read (over ``max_bytes`` only when train's front batches alone
        fill it)."""
        most = self.planner.limits.max_bytes
        self.planner.limits = replace(self.planner.limits,
                                      others=min(train.held, max(0, most - self.planner.room_wanted())))

    def worker_setup(self, cfg: Config, train):
        """What a worker needs to make this stream's batches: the eval augmentation, the val
        batch size, the val index (labels mapped to the train classes), this stream's fingerprint."""
        vcfg = replace(cfg, augment=cfg.val_augment(),
                       loader=replace(cfg.loader, batch_size=cfg.validation.batch_size))
        return replace(train, config=vcfg, index_dir=None, index=self.index, fingerprint=self.fingerprint,
                       bad=frozenset(), view_shapes=None)  # one centre crop, whatever train's views

    def task(self, r: int, e: int, b: int) -> Task:
        rank = r - VAL_LANE
        return Task(r, e, b, self.sampler.batches(rank), self.sampler.batch_indices(rank, b), ())

    def apply(self, r: int, p, now: float, initial: bool) -> list:
        """A lane's progress record: moves, then starts or stops the lane. Returns batches to delete."""
        evicted = []
        move = self.sessions.apply(r, p, now, initial)
        if move is not None:
            evicted += self.planner.set_position(r, move.epoch, move.batch)
        # a pass is made only while its trainer reads it (also after a daemon restart mid-pass)
        evicted += self.planner.set_active(r, p.reading)
        return evicted

    def meta(self) -> dict:
        s = self.sampler
        return {"fingerprint": self.fingerprint_hex, "stream_fingerprint": self.stream_fingerprint,
                "num_samples": s.num_samples, "batch_size": s.batch_size, "pad": s.pad,
                "batches": {str(r): s.batches(r) for r in self.ranks},
                "samples": {str(r): s.share(r) for r in self.ranks}}

    def status(self, now: float) -> dict:
        out = {}
        for r, lane_id in zip(self.ranks, self.lanes, strict=True):
            rs = self.planner.rank_status(lane_id)
            rs["position"] = list(divmod(self.planner.ranks[lane_id].pos, self.planner.bpe))
            seen = self.sessions.last_seen.get(lane_id)
            rs.update(pass_batches=self.sampler.batches(r), wait_s=self.sessions.wait_s[lane_id],
                      last_progress_age_s=None if seen is None else now - seen)
            out[str(r)] = rs
        return out
