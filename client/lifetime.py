"""The loader's lifetime and what the trainer tells the daemon of it beside its position: a
``next()`` waiting for data (``waiting_since``), a trainer done with its lane (``closed``; see
``prefetchd.format.progress``). A mixin of ``PrefetchClient``: ``self`` is the loader.

A trainer is finished when it calls ``close()``, leaves a ``with`` block without an exception, or
its process exits without an uncaught exception (an ``atexit`` hook says it for the clients it
left open, or to the garbage collector); one killed, ended by ``os._exit`` or by an uncaught
exception is not, and the daemon says its rank gone."""

from __future__ import annotations

import atexit
import os
import sys
import time
import weakref
from dataclasses import replace

from prefetchd.format import progress

from .common import _OWNERS, _lane_lock, _owns_lane


class Lifetime:
    """``close()``, ``with``, the garbage collector's end of a loader, and the records that say them."""

    def _say_waiting(self, since: float, block: bool = True) -> bool:
        """Tell the daemon that the trainer's ``next()`` waits for a batch since ``since`` (wall
        clock), or (0) no longer; only after a first poll missed, never for a batch that is ready.
        ``block=False``: not while the reader writes a record (False; the next poll tries again)."""
        if not self._progress_lock.acquire(blocking=block):
            return False
        try:
            self._waiting_since = since
            self._rewrite_last()
        finally:
            self._progress_lock.release()
        return True

    def _rewrite_last(self) -> None:
        """The last record again with what the trainer does now (its wait counter, waiting,
        closed): it moves nothing. Said only by the process that wrote it and owns the lane; a
        failed write is not the trainer's business (the next record says it all). Lock held."""
        last = self._last_record
        with _lane_lock((self.progress_dir, self._lane)):  # (the owner looked at and the write, as one)
            if last is None or last.pid != os.getpid() or not _owns_lane((self.progress_dir, self._lane), self):
                return
            if self._finished and not _still_ours(self.progress_dir, last):
                return
            p = self._last_record = replace(last, time=time.time(), wait_s=round(self.wait_s, 6),
                                            waiting_since=self._waiting_since, closed=self._finished)
            try:
                progress.write(self.progress_dir, p)
            except OSError:
                return
        self._unsaved = None

    def _say_finished(self) -> None:
        """Tell the daemon this trainer is done with its lane: finished, neither stalled nor gone."""
        with self._progress_lock:
            self._finished = True
            self._waiting_since = 0.0
            self._rewrite_last()
        _UNFINISHED.discard(self)


    def close(self) -> None:
        """Stop the reader thread and free the pinned buffers (after their copies are done), and
        tell the daemon this trainer is done with its rank (``closed`` in its progress file):
        ``prefetchd status`` says it finished, no stall alert fires. A trainer that exits without
        an uncaught exception says the same of the clients it left open (or to the garbage
        collector); one killed or ended by an exception does not: its rank is said gone."""
        self._close(finished=True)

    def _close(self, finished: bool) -> None:
        if not self._closed:
            self._closed = True
            self._stop_reader()
            if self._pool is not None:
                self._pool.close()
            if self._reading and self.split == "val":  # closed mid-pass: the daemon stops making it
                try:
                    self._end_pass(take=False)
                except Exception:
                    pass
        if finished and not self._finished:
            self._say_finished()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self._close(finished=exc_type is None)  # left by an exception: finished only if the process exits cleanly

    def __del__(self) -> None:
        try:
            self._close(finished=False)
            if not self._finished and self._last_record is not None:  # said at a clean exit (_at_exit)
                key = (self.progress_dir, self._lane)
                ref = _OWNERS.get(key)  # no lock here: the collector may run while this thread holds it
                if ref is None or ref() in (None, self):
                    _LEFT[key] = self._last_record
        except Exception:
            pass


# Clients whose trainer has not said it is done with them, and the last records of those the
# garbage collector took first (a loader made in a function that returned): a process that exits
# without an uncaught exception says them closed (progress.py: ``closed``), so its ranks are
# finished, not gone. Not for os._exit, a signal, or an uncaught exception (sys.last_value set).
_UNFINISHED: weakref.WeakSet = weakref.WeakSet()
# Iterations (iter_epoch's generators) still alive: those left unfinished (it = iter(c); next(it))
# are ended at exit while the interpreter is whole, not by the garbage collector once module
# globals are gone (their clean-up then failed, "Exception ignored in: <generator ...>").
_ITERATIONS: weakref.WeakSet = weakref.WeakSet()
_LEFT: dict[tuple[str, int], progress.Progress] = {}  # (progress dir, lane) -> its last record


def _still_ours(directory: str, last: progress.Progress) -> bool:
    """Whether the lane's progress file still holds this client's session: a closing record
    written over another process's newer one (the rank's next trainer, already started) would
    move the daemon back to this one's position, as a jump."""
    try:
        return progress.read(progress.progress_path(directory, last.rank)).session == last.session
    except progress.ProgressError:
        return False


@atexit.register
def _at_exit() -> None:
    if getattr(sys, "last_value", None) is not None:  # ended by an uncaught exception: not finished
        return
    for c in list(_UNFINISHED):
        try:
            c._close(finished=True)
        except Exception:
            pass
    for it in list(_ITERATIONS):  # after the clients' close: an iteration's clean-up then says nothing
        try:
            it.close()
        except Exception:  # ValueError: one still running (atexit from inside its loop)
            pass
    for key, p in list(_LEFT.items()):
        directory = key[0]
        with _lane_lock(key):
            if p.pid != os.getpid() or not _owns_lane(key, None) or not _still_ours(directory, p):
                continue  # another client of this process, or another process, took the lane since
            try:
                progress.write(directory, replace(p, time=time.time(), waiting_since=0.0, closed=True))
            except OSError:
                pass
