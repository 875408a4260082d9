"""The dataset looked at again on SIGHUP, on a thread, and one line saying what changed.

A SIGHUP that changes only a tunable costs a look at the index cache's stamps (one stat per tar
archive, the scanned folders' mtimes): the dataset unchanged since the index was read is not
scanned again. Only a dataset that may have changed is scanned and compared, on the rescan's
thread, never the loop's. The running stream keeps the index it started with: its batches are
a function of it, and trainers check the stream's fingerprint. A sample gone since is found
unreadable when a batch reaches it and replaced, as any unreadable one; samples added are
served after a restart (a new stream). Archives rewritten in place with the same members are
named, not called unchanged: their batches wait for a restart (unless only
the ctime moved and every member is where it was: ``sources.tarrecheck``). Workers never look at the
dataset to start (``executors.pool.Pool._worker_setup``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

log = logging.getLogger("prefetchd")


class Rescan:
    """One rescan under way, all of it on a thread (a large tree takes a while; the comparison
    of two large indexes too): first ``unchanged()`` (the index cache's stamps, cheap), and only
    if that cannot vouch for the dataset ``scan()`` and a comparison with ``current``.
    ``wake()`` tells the loop it is done; the loop then calls ``report``, which only logs."""

    def __init__(self, current, unchanged: Callable[[], bool], scan: Callable[[], object],
                 wake: Callable[[], None]):
        self._said: tuple[int, str] | None = None

        def run():
            try:
                self._said = _verdict(current, unchanged, scan)
            except Exception as e:  # handed to the loop
                self._said = (logging.WARNING, f"dataset rescan (SIGHUP): {e}; serving the index read at start")
            wake()

        threading.Thread(target=run, name="prefetchd-rescan", daemon=True).start()

    def done(self) -> bool:
        return self._said is not None

    def report(self) -> None:
        """Say whether the dataset changed since the index the stream serves was read."""
        assert self._said is not None
        log.log(*self._said)


def _verdict(current, unchanged: Callable[[], bool], scan: Callable[[], object]) -> tuple[int, str]:
    if unchanged():
        return logging.INFO, (f"dataset rescan (SIGHUP): unchanged, {len(current)} samples (the index cache's stamps "
                              "hold: not scanned again)")
    new = scan()  # no cache write: the daemon's workers map the cache files of the running index
    if new.fingerprint == current.fingerprint:
        moved = changed_archives(current, new)
        if moved:  # same members, other bytes possible: the workers' reads of them wait (archive._check)
            return logging.WARNING, (
                f"dataset rescan (SIGHUP): the same {len(new)} samples, but {len(moved)} archive(s) changed since "
                f"this daemon indexed them ({', '.join(moved[:3])}{' ...' if len(moved) > 3 else ''}: rewritten in "
                "place, copied over, or their mode, owner or links changed): batches from an archive whose ctime "
                "alone changed are made if every member's header is where it was indexed, the others wait; restart "
                "the daemon to index them again")
        return logging.INFO, f"dataset rescan (SIGHUP): unchanged, {len(new)} samples"
    added, gone = dataset_diff(current, new)
    return logging.WARNING, (
        f"dataset rescan (SIGHUP): the dataset changed since this daemon read it ({added} samples added, {gone} "
        f"gone, {len(new.classes)} classes now): this stream keeps the index it started with ({len(current)} "
        "samples); gone samples are replaced as batches reach them; restart the daemon to serve the new index "
        "(a new stream)")


def changed_archives(old, new) -> list[str]:
    """The archives (a tar index's, by path) whose identity differs between two indexes of the same
    samples; [] for other kinds."""
    ids_old, ids_new = getattr(old, "identity", ()), getattr(new, "identity", ())
    if not ids_old or len(ids_old) != len(ids_new) or old.archives != new.archives:
        return []
    return [os.path.join(old.root, a) if a else old.root
            for a, x, y in zip(old.archives, ids_old, ids_new, strict=True) if tuple(x) != tuple(y)]


def dataset_diff(old, new) -> tuple[int, int]:
    """(samples added, samples gone) between two indexes, by path and label."""
    def keys(index):
        return {(index.relpath(i), index.classes[int(index.labels[i])]) for i in range(len(index))}

    a, b = keys(old), keys(new)
    return len(b - a), len(a - b)
