"""Just enough inotify for the progress watcher: one watch on a directory, read from the loop.

No thread: the descriptor is non-blocking and joins the loop's other waitables, so a progress
file replaced wakes the loop directly, and events cost only their parsing in the loop (watchdog's
observer, used before, spent about as much CPU in its three threads as the loop itself spent
per published batch).

Events watched: ``IN_MOVED_TO`` (a trainer's atomic replace, ``progress.write``),
``IN_CLOSE_WRITE`` (a file written in place), ``IN_DELETE`` and ``IN_MOVED_FROM`` (a file that
went). Creating a name without writing it (a symlink, a FIFO, a directory, a hard link) and
writes that are never closed are seen on the watcher's poll timer, as every change is without
inotify. A record (``struct inotify_event``) is ``wd, mask, cookie, len`` (native ``iIII``)
and ``len`` bytes of NUL-padded name.
"""

from __future__ import annotations

import ctypes
import os
import struct

IN_CLOSE_WRITE = 0x8
IN_MOVED_FROM = 0x40
IN_MOVED_TO = 0x80
IN_DELETE = 0x200
IN_Q_OVERFLOW = 0x4000
WATCH_MASK = IN_MOVED_TO | IN_CLOSE_WRITE | IN_DELETE | IN_MOVED_FROM

_HEADER = struct.Struct("iIII")
_READ_BYTES = 65536
_MAX_READS = 4  # per call: a flood is read over several turns of the loop, never in one


class Inotify:
    """A non-blocking inotify descriptor watching one directory's entries."""

    def __init__(self, directory: str, mask: int = WATCH_MASK):
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"inotify_init1: {os.strerror(e)}")
        if libc.inotify_add_watch(fd, os.fsencode(directory), mask) < 0:
            e = ctypes.get_errno()
            os.close(fd)
            raise OSError(e, f"inotify_add_watch: {os.strerror(e)}")
        self.fd = fd

    def fileno(self) -> int:
        return self.fd

    def read(self) -> tuple[list[str], bool]:
        """The names events came for since the last call (one per event, in order), and whether
        the kernel's queue overflowed meanwhile (events were lost). Never blocks."""
        names: list[str] = []
        overflow = False
        for _ in range(_MAX_READS):
            try:
                buf = os.read(self.fd, _READ_BYTES)
            except BlockingIOError:
                break
            i = 0
            while i + _HEADER.size <= len(buf):
                _, mask, _, n = _HEADER.unpack_from(buf, i)
                if mask & IN_Q_OVERFLOW:
                    overflow = True
                elif n:
                    names.append(os.fsdecode(buf[i + _HEADER.size:i + _HEADER.size + n].rstrip(b"\0")))
                i += _HEADER.size + n
        return names, overflow

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
