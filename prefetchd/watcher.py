"""Learning where each trainer is: the progress files, watched with inotify and polled.

watchdog's inotify observer wakes the daemon's loop as soon as a progress file is replaced; the
loop also polls (one ``stat`` per rank) every ``progress.poll_interval_s``, which is the whole
mechanism where inotify is unavailable (NFS, exhausted watches, ``progress.inotify: false``).
A file that cannot be parsed leaves the last good value in place and is reported once until
it is good again.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from . import progress as progress_fmt

log = logging.getLogger("prefetchd.watcher")


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

    def start(self) -> None:
        if not self._use_inotify:
            return
        try:
            from watchdog.events import FileSystemEventHandler
            from watchdog.observers import Observer
            from watchdog.observers.inotify import InotifyObserver  # noqa: F401  (Linux only)

            wake = self._wake

            class _Handler(FileSystemEventHandler):
                def on_any_event(self, event):  # runs on watchdog's thread: only wake the loop
                    name = os.path.basename(getattr(event, "dest_path", "") or event.src_path)
                    if name.startswith("progress-r"):
                        wake()

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

    def poll(self) -> dict[int, progress_fmt.Progress]:
        """Progress records that changed since the last poll, by rank."""
        changed: dict[int, progress_fmt.Progress] = {}
        for r in self.ranks:
            path = progress_fmt.progress_path(self.dir, r)
            try:
                st = os.stat(path)
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
            except progress_fmt.ProgressError as e:
                self._report(r, f"ignoring {path}: {e}; keeping the last good position "
                                f"{self.last[r].position if r in self.last else 'none'}")
                continue
            if p.rank != r:
                self._report(r, f"ignoring {path}: it names rank {p.rank}")
                continue
            self._bad.pop(r, None)
            self.last[r] = p
            changed[r] = p
        return changed

    def _report(self, rank: int, msg: str) -> None:
        if rank not in self._bad:  # once per bad spell; a good read clears it
            log.warning("%s", msg)
        self._bad[rank] = msg
