"""Where a dataset's bytes are: the one storage interface every layout reads and lists through.

A layout (``folder``, ``imagenet``, ``webdataset``, ...) decides *which* bytes a sample is (a
file, or a byte range of an archive) and what they must belong to (an archive's identity); the
store only fetches them. One implementation today, ``LocalStore`` (a POSIX file system, local or
network-mounted: NFS, Lustre, a FUSE mount); object storage would be another class with the same
calls, the layouts unchanged:

* ``read(path) -> bytes``: a whole file (an ImageFolder's or a file list's sample);
* ``open(path, on_open) -> handle``: a handle to an archive, kept for the next read (the
  ``MAX_OPEN`` most recently used); ``on_open(handle)`` runs when it is freshly opened (the
  identity check), and a handle it refuses is forgotten;
* ``pread(handle, size, offset) -> bytes``: a byte range of an open archive;
* ``identity(handle)``: what changes when a byte of it may have moved (``identity_of``: device,
  inode, size, mtime, ctime here; an object store's would be its size and ETag);
* ``forget(path)``: drop a kept handle (a read failed: the next one opens the path again).

Descriptors kept by a parent are not used by a forked child (each process opens its own).
"""

from __future__ import annotations

import os

from prefetchd.sources.base import read_all

MAX_OPEN = 64  # archives a worker keeps open (a folder of 1,000 class tars must not exhaust RLIMIT_NOFILE)


def identity_of(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """An archive's identity (``TarIndex.identity``): what changes when a byte of it may have moved."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


class LocalStore:
    """The local file system (see the module docstring for the interface)."""

    def __init__(self, max_open: int = MAX_OPEN):
        self.max_open = max_open
        self._fds: dict[str, int] = {}  # in least recently used order
        self._pid = 0

    def read(self, path: str) -> bytes:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return read_all(fd)
        finally:
            os.close(fd)

    def open(self, path: str, on_open=None) -> int:
        """A read-only descriptor of ``path``, kept open for the next read; ``on_open(fd)`` checks a
        fresh one (it may raise: the descriptor is then closed and forgotten)."""
        if self._pid != os.getpid():  # a forked child: the parent's descriptors are its own business
            self._fds.clear()
            self._pid = os.getpid()
        fd = self._fds.pop(path, None)
        if fd is None:
            if len(self._fds) >= self.max_open:
                os.close(self._fds.pop(next(iter(self._fds))))
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            self._fds[path] = fd
            if on_open is not None:
                try:
                    on_open(fd)
                except BaseException:
                    self.forget(path)
                    raise
        self._fds[path] = fd
        return fd

    @staticmethod
    def pread(fd: int, size: int, offset: int) -> bytes:
        return os.pread(fd, size, offset)

    @staticmethod
    def identity(fd: int) -> tuple[int, int, int, int, int]:
        return identity_of(os.fstat(fd))

    def forget(self, path: str) -> None:
        """Close the kept descriptor of ``path``, if any."""
        fd = self._fds.pop(path, None) if self._pid == os.getpid() else None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


LOCAL = LocalStore()  # the store of every layout today
