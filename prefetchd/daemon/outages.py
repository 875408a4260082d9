"""Storage outages, one per dataset root: each said once when it starts and once when it ends.

A batch that meets unreadable storage (``Result.unavailable``: the root gone, an archive not the
one indexed) starts an outage of its stream's root (the train set's, or the validation set's);
a batch made from that root ends it. The roots are tracked apart: a validation root that stays
unreadable while the train batches are made is one outage, said once, not one per retry. An
archive changed since it was indexed (``StorageChanged``) stays so until the daemon is restarted,
while batches from the other archives of its root are made: it is said once per archive, and is
not ended by those batches.
"""

from __future__ import annotations

import logging

from prefetchd.executors.storage import STORAGE_RETRY_S
from prefetchd.sources.base import StorageChanged

log = logging.getLogger("prefetchd")


class Outages:
    def __init__(self) -> None:
        self._out: dict[str, tuple[float, str]] = {}  # root -> (since, why)
        self._changed: dict[str, str] = {}  # "the archive PATH" -> why: until a restart
        self._counts: dict[int, tuple] = {}  # worker pid -> its latest totals (``objectstore.counts``)

    def counted(self, storage: tuple) -> None:
        """A worker's bucket totals, sent with a result (cumulative: a result lost loses nothing)."""
        if storage:
            self._counts[storage[0]] = storage[1:]

    def storage(self) -> dict | None:
        """The workers' bucket requests, bytes, errors and node-local cache hits, for status and
        metrics; None when no worker has read a bucket."""
        if not self._counts:
            return None
        t = [sum(c[k] for c in self._counts.values()) for k in range(6)]
        return {"requests": t[0], "bytes": t[1], "errors": t[2], "cache_hits": t[3], "cache_misses": t[4],
                "cache_hit_bytes": t[5], "cache_hit_rate": t[3] / (t[3] + t[4]) if t[3] + t[4] else None}

    def failed(self, root: str, why: str, now: float, storage: tuple = ()) -> None:
        """A batch from ``root`` met unreadable storage (``why``: the worker's one line)."""
        self.counted(storage)
        if StorageChanged.MARK in why:
            archive = why.partition(StorageChanged.MARK)[0]
            if archive not in self._changed:
                log.error("%s: batches that need it are tried again every %.1f s; no sample is quarantined meanwhile",
                          why, STORAGE_RETRY_S)
                self._changed[archive] = why
            return
        if root not in self._out:
            log.error("%s: batches are tried again every %.1f s until it is back; no sample is quarantined "
                      "meanwhile", why, STORAGE_RETRY_S)
            self._out[root] = (now, why)

    def succeeded(self, root: str, now: float, storage: tuple = ()) -> None:
        """A batch from ``root`` was made: its outage, if any, is over."""
        self.counted(storage)
        out = self._out.pop(root, None)
        if out is not None:
            log.info("the dataset root is readable again: %s (unreadable for %.1f s)", root, now - out[0])

    def describe(self) -> str | None:
        """What is unreadable now (each names its root or archive), for the status; None if nothing."""
        return "; ".join([why for _, why in self._out.values()] + list(self._changed.values())) or None
