"""The progress directory's inotify events, through watchdog's inotify layer, read by the loop.

watchdog (``watchdog.observers.inotify_c.InotifyFD``) makes the inotify instance, adds the one
watch, reads the descriptor and parses its records into ``InotifyEvent``; its thread is never
started. The descriptor joins the loop's other waitables, so a progress file replaced wakes the
loop directly, and ``read`` (called by the loop each turn) lets watchdog read only when the
descriptor is readable, one buffer of at most ``_READ_BYTES`` a call: a flood of events is read
over several turns of the loop, never in one. watchdog's observer (three threads) is not used:
it spent about as much CPU as the loop itself spent per published batch (BENCHMARKS.md).

Events watched: ``IN_MOVED_TO`` (a trainer's atomic replace, ``progress.write``),
``IN_CLOSE_WRITE`` (a file written in place), ``IN_DELETE`` and ``IN_MOVED_FROM`` (a file that
went). Creating a name without writing it (a symlink, a FIFO, a directory, a hard link) and
writes that are never closed are seen by the snapshot diff on the watcher's poll timer, as every
change is without inotify.

watchdog internals used, hence the pinned range in pyproject.toml (``watchdog>=7.1,<8``, checked
at both ends by ``tests/test_watchdog_range.py``): an ``InotifyFD`` built directly and never
started (7.0 built and started a shared one when ``inotify_c`` was imported, 6.x has no
``InotifyFD``); its ``_inotify_fd`` (the descriptor to poll) and ``_is_reading`` (set false so
that ``close`` closes the descriptor itself instead of waking a reader thread there is none of).
"""

from __future__ import annotations

import os
import select

from watchdog.observers.inotify_c import InotifyConstants as _IN
from watchdog.observers.inotify_c import InotifyFD

WATCH_MASK = _IN.IN_MOVED_TO | _IN.IN_CLOSE_WRITE | _IN.IN_DELETE | _IN.IN_MOVED_FROM

_READ_BYTES = 65536  # per call: up to ~2,000 events of short names


class _NoDispatch:
    """watchdog's ``WatchCallback`` for the one watch: events are read by ``Inotify.read``, never
    dispatched through ``InotifyFD.handle_event``, so nothing calls these."""

    def on_event(self, event) -> None:  # pragma: no cover
        pass

    def on_watch_deleted(self, wd) -> None:  # pragma: no cover
        pass

    def on_queue_overflow(self) -> None:  # pragma: no cover
        pass


class Inotify:
    """watchdog's inotify instance watching one directory's entries, read without a thread."""

    def __init__(self, directory: str, mask: int = WATCH_MASK):
        ifd = InotifyFD()  # a Thread object, never started
        try:
            fd = ifd._inotify_fd
            os.set_inheritable(fd, False)  # watchdog's inotify_init() does not set close-on-exec
            os.set_blocking(fd, False)  # belt and braces: ``read`` polls before watchdog reads
            wd = ifd.add_callback(os.fsencode(directory), mask, _NoDispatch(), 0)
            if wd < 0:  # watchdog returns EACCES's -1 instead of raising
                raise PermissionError(13, "inotify_add_watch: permission denied")
        except BaseException:
            self._close(ifd)
            raise
        self._ifd = ifd
        self.fd = fd
        self._ready = select.poll()
        self._ready.register(fd, select.POLLIN)
        self.gone = False  # the watch ended (the directory removed or its file system unmounted)

    def fileno(self) -> int:
        return self.fd

    def read(self) -> tuple[list[str], bool]:
        """The names events came for since the last call (one per event, in order), and whether
        the kernel's queue overflowed meanwhile (events were lost). Never blocks: watchdog reads
        only when the descriptor is readable."""
        if self.fd < 0 or not self._ready.poll(0):
            return [], False
        try:
            events = self._ifd.read_events(event_buffer_size=_READ_BYTES)
        except BlockingIOError:  # pragma: no cover - readable a moment ago, and no one else reads it
            self._ifd._is_reading = False
            return [], False
        names: list[str] = []
        overflow = False
        for ev in events:
            if ev.is_queue_overflow:
                overflow = True
            elif ev.is_ignored:
                self.gone = True
            elif ev.name:
                names.append(os.fsdecode(ev.name))
        return names, overflow

    def close(self) -> None:
        if self.fd >= 0:
            self._close(self._ifd)
            self.fd = -1

    @staticmethod
    def _close(ifd: InotifyFD) -> None:
        ifd._is_reading = False  # no reader thread to wake: close() closes the descriptors now
        ifd.close()
