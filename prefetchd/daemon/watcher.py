"""Learning where each trainer is: the progress files, watched with inotify and polled.

watchdog's inotify observer wakes the daemon's loop as soon as a progress file is replaced; the
loop also polls (one ``stat`` per rank) every ``progress.poll_interval_s``, which is the whole
mechanism where inotify is unavailable (NFS, exhausted watches, ``progress.inotify: false``).
Events are coalesced: inotify only marks a rank's file dirty, and each wake-up of the loop reads
each dirty file once (all files on the poll timer). A file that cannot be parsed, for whatever
reason, leaves the last good value in place and is reported in one line, once per bad spell
(until a good file is read), never raising into the loop.

Every trainer of the node can write the directory, so nothing found there may block or flood
the loop:

* the directory is never listed: a wake-up looks up the served lanes' names only (one
  ``lstat``, and one bounded read when it changed, per lane), so entries beside them (20,000
  stray files, say) cost their inotify events and nothing else, and one warning per spell
  (``_STRAY_QUIET_S`` without such a change ends it);
* a name that is not a regular file (a FIFO, a symlink to anything, a directory, a socket) is
  refused without anything waiting on it (``untrusted.read_regular``), with one warning per
  bad spell like bad content;
* the set of dirty names holds served lanes only, so events cannot grow it;
* when the kernel's inotify queue overflows (watchdog logs "Inotify queue overflowed"), marks
  are lost, and the poll timer, which runs whatever inotify says, reads every lane again.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from prefetchd.format import progress as progress_fmt

log = logging.getLogger("prefetchd.watcher")

_STRAY_QUIET_S = 30.0  # a spell of changes to names that are not progress files ends after this long without one


class ProgressWatcher:
    def __init__(self, directory: str, ranks: tuple[int, ...], wake: Callable[[], None], use_inotify: bool):
        self.dir = directory
        self.ranks = ranks
        self._wake = wake
        self._use_inotify = use_inotify
        self._observer = None
        self._stamps: dict[int, tuple | None] = {r: None for r in ranks}
        self._bad: dict[int, str] = {}
        self.last: dict[int, progress_fmt.Progress] = {}
        self.mode = "polling"
        self._dirty: set[int] = set()
        self._dirty_lock = threading.Lock()
        # changes to names that are no progress file of ours, counted by watchdog's thread
        self._strays = 0
        self._stray_name = ""
        self._stray_last = 0.0
        self._stray_spell = False

    def start(self) -> None:
        if not self._use_inotify:
            return
        try:
            from watchdog.events import FileSystemEventHandler
            from watchdog.observers import Observer
            from watchdog.observers.inotify import InotifyObserver  # noqa: F401  (Linux only)

            mark, top = self._mark, os.path.normpath(self.dir)

            class _Handler(FileSystemEventHandler):
                def on_any_event(self, event):  # runs on watchdog's thread: only mark and wake
                    path = os.path.normpath(os.fsdecode(getattr(event, "dest_path", "") or event.src_path))
                    if path != top:  # not the directory itself (modified when an entry changes)
                        mark(os.path.basename(path))

            obs = Observer()
            obs.schedule(_Handler(), self.dir, recursive=False)
            obs.daemon = True
            obs.start()
            self._observer = obs
            self.mode = "inotify+polling"
        except Exception as e:  # no inotify (limits, filesystem, platform): polling still works
            log.warning("cannot watch %s with inotify (%s); polling every interval instead", self.dir, e)
            self._observer = None

    def stop(self) -> None:
        if self._observer is not None:
            # watchdog logs a harmless "queue_events() called when the thread is inactive" error
            # when its emitter is stopped mid-read; not worth an ERROR line in the journal
            logging.getLogger("watchdog.observers.inotify").setLevel(logging.CRITICAL)
            try:
                self._observer.stop()
                self._observer.join(timeout=2)
            except Exception:  # pragma: no cover - teardown must not fail the stop
                pass
            self._observer = None

    def _mark(self, name: str) -> None:
        r = progress_fmt.parse_progress_name(name)
        if r is None or r not in self._stamps:
            if not (name.startswith(".progress-") and name.endswith(".tmp")) and name:  # a client's temp file is ours
                self._strays += 1
                self._stray_name = name
                self._stray_last = time.monotonic()
            return
        with self._dirty_lock:
            self._dirty.add(r)
        self._wake()

    def poll(self, full: bool = True) -> dict[int, progress_fmt.Progress]:
        """Progress records that changed since the last poll, by rank: every rank's file when
        ``full``, else only those inotify said were touched."""
        with self._dirty_lock:
            dirty, self._dirty = self._dirty, set()
        if full:
            self._check_strays()
        changed: dict[int, progress_fmt.Progress] = {}
        for r in (self.ranks if full else [r for r in dirty if r in self._stamps]):
            path = progress_fmt.progress_path(self.dir, r)
            try:
                st = os.lstat(path)  # a symlink's own stamp: it is refused, whatever it points to
                stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
            except FileNotFoundError:
                stamp = None
            except OSError as e:
                self._report(r, f"cannot stat {path}: {e.strerror}")
                continue
            if stamp == self._stamps[r]:
                continue
            self._stamps[r] = stamp
            if stamp is None:
                if r in self.last:
                    self._report(r, f"{path} was deleted; keeping the last position {self.last[r].position}")
                continue
            try:
                p = progress_fmt.read(path)
            except Exception as e:  # ProgressError; anything else is a bug, but must not stop the daemon
                why = str(e) if isinstance(e, progress_fmt.ProgressError) else f"{type(e).__name__}: {e}"
                self._report(r, f"ignoring {path}: {why}; keeping the last good position "
                                f"{self.last[r].position if r in self.last else 'none'}")
                continue
            if p.rank != r:
                self._report(r, f"ignoring {path}: it names rank {p.rank}")
                continue
            self._bad.pop(r, None)
            self.last[r] = p
            changed[r] = p
        return changed

    def _check_strays(self) -> None:
        n, self._strays = self._strays, 0  # (a change counted meanwhile by watchdog's thread may be lost: harmless)
        if n and not self._stray_spell:
            log.warning("progress.dir %s: %d change(s) to entries that are not progress files of the ranks served here "
                        "(e.g. %r); they are ignored (a trainer writes only its progress-rNNNN.json and "
                        "progress-vNNNN.json there)", self.dir, n, self._stray_name)
            self._stray_spell = True
        elif self._stray_spell and not n and time.monotonic() - self._stray_last > _STRAY_QUIET_S:
            self._stray_spell = False

    def _report(self, rank: int, msg: str) -> None:
        # once per bad spell (a file rewritten badly many times a second must not flood the
        # journal); a good read clears it
        if rank not in self._bad:
            log.warning("%s", msg)
        self._bad[rank] = msg
