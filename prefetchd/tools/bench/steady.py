"""Steady state for ``bench --train``: when a feed's backlog has stopped flattering the trainer.

A feed that started before the trainer holds a backlog: batches made and not yet taken (the
ring's ready files, a DataLoader's finished batches). While the trainer eats that backlog it runs
faster than the feed can sustain, so a clock started during it measures the backlog, not the
feed. The steady rows of ``bench --train`` warm up at least ``--warmup`` steps and then until
``settled`` says the backlog no longer shrinks, reading the backlog before each step:

* ``drained``: at most ``floor`` batches are ready (the feed's own read-ahead), so the trainer has
  caught up with the feed and from now on takes batches as fast as they are made;
* ``held``: over the last ``window`` steps the backlog shrank by at most ``tol`` batches, so the
  feed keeps pace (a full ring that stays full: the trainer never waits, which is the truth).

A reading of None (the backlog cannot be seen at this step, e.g. at a DataLoader's epoch edges)
gives no verdict. A run that settles neither way within ``--warmup-max-s`` is measured anyway and says so; each
steady row also gives the backlog at the start and end of its measured window, so what the
window took from the backlog (start - end, when positive) is in plain sight.
"""

from __future__ import annotations

import os

from prefetchd.format import batchfile


def settled(backlog: list[int], floor: int, window: int, tol: int) -> str | None:
    """``backlog``: readings before each warm-up step past the minimum, oldest first. Returns
    ``"drained"``, ``"held"`` or None (not yet)."""
    if not backlog:
        return None
    if backlog[-1] <= floor:
        return "drained"
    if len(backlog) > window and backlog[-1] >= backlog[-1 - window] - tol:
        return "held"
    return None


def ring_backlog(buffer_dir: str, client) -> int:
    """Rank 0's batch files in the ring at or past the client's position: made, not yet taken.
    The daemon deletes a file once the client's read-ahead reports it read, so the up to
    ``prefetch`` batches the read-ahead holds may or may not be counted: the caller's floor."""
    here = (client.epoch, client.batch)
    n = 0
    for name in os.listdir(buffer_dir):
        key = batchfile.parse_name(name)
        if key is not None and key[0] == 0 and (key[1], key[2]) >= here:
            n += 1
    return n


def loader_backlog(dl) -> int | None:
    """A torch DataLoader's finished batches not yet taken: those in its result queue and those
    that arrived out of order and wait in ``_task_info``. None at an epoch's edges, where the
    count says nothing about the pace: before its first batch is taken (every worker is refilling
    at once) and in its tail (no batches left to hand out). This reads the iterator's private
    fields (torch 2.x); None where they are not there, and the caller warms up blind."""
    it = getattr(dl, "_iterator", None)
    if it is None:
        return None
    if getattr(dl, "num_workers", 0) == 0:
        return 0  # made in next() itself: no backlog
    try:
        if it._rcvd_idx == 0 or it._tasks_outstanding < it._prefetch_factor * it._num_workers:
            return None
        return int(it._data_queue.qsize()) + sum(len(v) == 2 for v in it._task_info.values())
    except (AttributeError, NotImplementedError, TypeError):
        return None
