"""What the daemon learns as it runs: each rank's pace and how long its trainer waited.

At each status write (once a second) ``Pacer.observe`` takes the status record and

* adds to each rank ``waited_share`` (the share of the last minute its trainer waited for a
  batch) and, for a data-bound rank (``DATA_BOUND`` of the minute or more), ``would_help``: what
  would give it batches sooner, from the workers' utilisation and the augmentation;
* with ``buffer.capacity: auto``, sets the capacity to ``buffer.lead_s`` seconds of the fastest
  rank's measured pace (``core.limits.auto_capacity``: within max_bytes, never below what
  refill_at needs), changing it only when it moves by more than a tenth, at most every
  ``_RETUNE_S``; returns the published batches the new capacity leaves outside a window.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import replace

from prefetchd.core.limits import auto_capacity
from prefetchd.format import batchfile

log = logging.getLogger("prefetchd")

WINDOW_S = 60.0
DATA_BOUND = 0.2  # a trainer that waited a fifth of the last minute is limited by its data
_RETUNE_S = 10.0


def advice(share: float, utilisation: float, decode: str, output_size: int) -> str:
    """What would help a rank whose trainer waited ``share`` of the last minute."""
    if utilisation < 0.8:
        return (f"the workers were busy only {utilisation:.0%}: the ring is held back (see 'waiting'; "
                f"buffer.max_bytes, capacity) or batches fail")
    tips = ["more cores for the workers (workers.count, the CPU quota)"]
    if decode == "cpu":
        tips.append("hybrid decode (augment.decode: hybrid) to move JPEG decoding to the GPU")
    tips.append(f"a smaller augmentation (augment.output_size {output_size}, scale_max)")
    return "; ".join(tips)


class Pacer:
    def __init__(self, capacity_auto: bool, refill_auto: bool):
        self.capacity_auto = capacity_auto
        self.refill_auto = refill_auto
        self.seen: dict[str, deque] = {}  # rank -> (time, wait_s, linear position)
        self._tuned_at = 0.0
        self.why: str | None = None

    def observe(self, rec: dict, d) -> list:
        now = time.monotonic()
        bpe = d.sampler.batches_per_epoch
        fastest = None
        for r, rs in rec["ranks"].items():
            e, b = rs.get("position", [0, 0])
            q = self.seen.setdefault(r, deque())
            q.append((now, rs.get("wait_s", 0.0), e * bpe + b))
            while q and q[0][0] < now - WINDOW_S:
                q.popleft()
            t0, w0, p0 = q[0]
            span = now - t0
            if span < 5.0:
                continue
            share = min(1.0, max(0.0, (rs.get("wait_s", 0.0) - w0) / span))
            rs["waited_share"] = share
            if share >= DATA_BOUND:
                rs["would_help"] = advice(share, rec.get("worker_utilisation", 0.0), d.cfg.augment.decode,
                                          d.cfg.augment.output_size)
            pace = (e * bpe + b - p0) / span
            fastest = pace if fastest is None else max(fastest, pace)
        if not self.capacity_auto or fastest is None or now - self._tuned_at < _RETUNE_S:
            return []
        self._tuned_at = now
        B = d.cfg.buffer
        cap, why = auto_capacity(B.max_bytes, batchfile.views_file_size(d.cfg.loader.batch_size, d.view_shapes),
                                 len(d.ranks),
                                 B.lead_s, fastest if fastest > 0 else None, None if self.refill_auto else B.refill_at)
        self.why = d.sizing.why["capacity"] = why
        if abs(cap - B.capacity) <= max(1, B.capacity // 10):
            return []
        new = replace(B, capacity=cap, refill_at=None if self.refill_auto else B.refill_at)
        d.cfg = replace(d.cfg, buffer=new)
        log.info("buffer: %s (was %d)", why, B.capacity)
        return d.planner.set_limits(replace(d.planner.limits, capacity=new.capacity, refill_at=new.refill_at))
