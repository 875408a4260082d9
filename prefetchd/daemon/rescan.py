"""The dataset looked at again on SIGHUP: a scan on a thread, and one line saying what changed.

The running stream keeps the index it started with: its batches are a function of it, and
trainers check the stream's fingerprint. A sample gone since is found unreadable when a batch
reaches it and replaced, as any unreadable one; samples added are served after a restart (a new
stream). Workers never look at the dataset to start (``executors.pool.Pool._worker_setup``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("prefetchd")


class Rescan:
    """One rescan under way: ``scan()`` runs on a thread (a large tree takes a while), ``wake()``
    tells the loop it is done; the loop then calls ``report``."""

    def __init__(self, scan: Callable[[], object], wake: Callable[[], None]):
        self._box: dict = {}

        def run():
            try:  # no cache write: the daemon's workers map the cache files of the running index
                self._box["index"] = scan()
            except Exception as e:  # handed to the loop
                self._box["error"] = e
            wake()

        threading.Thread(target=run, name="prefetchd-rescan", daemon=True).start()

    def done(self) -> bool:
        return bool(self._box)

    def report(self, current) -> None:
        """Say whether the dataset changed since ``current`` (the index the stream serves)."""
        if "error" in self._box:
            log.warning("dataset rescan (SIGHUP): %s; serving the index read at start", self._box["error"])
            return
        new = self._box["index"]
        if new.fingerprint == current.fingerprint:
            log.info("dataset rescan (SIGHUP): unchanged, %d samples", len(new))
            return
        added, gone = dataset_diff(current, new)
        log.warning("dataset rescan (SIGHUP): the dataset changed since this daemon read it (%d samples added, "
                    "%d gone, %d classes now): this stream keeps the index it started with (%d samples); gone "
                    "samples are replaced as batches reach them; restart the daemon to serve the new index "
                    "(a new stream)", added, gone, len(new.classes), len(current))


def dataset_diff(old, new) -> tuple[int, int]:
    """(samples added, samples gone) between two indexes, by path and label."""
    def keys(index):
        return {(index.relpath(i), index.classes[int(index.labels[i])]) for i in range(len(index))}

    a, b = keys(old), keys(new)
    return len(b - a), len(a - b)
