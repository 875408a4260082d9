"""Reading a file that someone else may have put there: never blocks, never follows, bounded.

Shared by the daemon and the client; standard library only.

The progress directory is writable by every trainer of the node (mode 0770, group
``buffer.group``), so what sits at a progress file's name may be anything a member of the group
can make: a FIFO (a plain ``open()`` waits for a writer forever, and is retried after a signal
handler runs, so not even SIGTERM ends the wait), a symlink to one, to ``/dev/zero`` or to a
file the daemon may read and the trainer may not, a directory, a socket, a file of gigabytes.
``read_regular`` reads such a path safely:

* ``lstat`` first: anything but a regular file (a symlink included) is refused before it is
  opened, so nothing but a regular file is opened unless the name is swapped meanwhile;
* ``open(O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_NOCTTY)``: if the name was swapped between the
  ``lstat`` and the ``open``, a FIFO opens at once (no writer is waited for), a symlink fails
  (``ELOOP``), a socket fails (``ENXIO``);
* ``fstat`` of what was opened: a regular file or nothing, and at most ``limit`` bytes long;
* at most ``limit + 1`` bytes read, so a file growing under the reader is refused, not followed.

A refusal raises ``NotRegular`` (a ``ValueError``) whose text says why: "it is a FIFO, not a
regular file", "it is larger than 65536 bytes". A missing file raises ``FileNotFoundError``;
any other failure the ``OSError`` of the call that failed.
"""

from __future__ import annotations

import errno
import os
import stat

_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC


class NotRegular(ValueError):
    """The path is not a regular file of at most the given size; the text says what it is."""


def kind(mode: int) -> str:
    """What a ``st_mode`` is, with its article: "a FIFO", "a directory", ..."""
    for test, name in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return f"of unknown type {stat.S_IFMT(mode):o}"


def check_regular(st: os.stat_result, limit: int) -> None:
    """Raise ``NotRegular`` unless ``st`` (an ``lstat`` or ``fstat``) is a regular file of at
    most ``limit`` bytes."""
    if not stat.S_ISREG(st.st_mode):
        raise NotRegular(f"it is {kind(st.st_mode)}, not a regular file")
    if st.st_size > limit:
        raise NotRegular(f"it is larger than {limit} bytes")


def read_regular(path: str, limit: int) -> bytes:
    """The whole content of the regular file at ``path`` (at most ``limit`` bytes), read without
    ever blocking on what a file's writer controls. See the module's docstring."""
    mode = os.lstat(path).st_mode
    if not stat.S_ISREG(mode):
        raise NotRegular(f"it is {kind(mode)}, not a regular file")
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as e:  # replaced since the lstat
        if e.errno in (errno.ELOOP, errno.ENXIO):
            try:
                what = kind(os.lstat(path).st_mode)
            except OSError:
                what = "a symbolic link" if e.errno == errno.ELOOP else "a socket"
            raise NotRegular(f"it is {what}, not a regular file") from None
        raise
    try:
        check_regular(os.fstat(fd), limit)
        chunks, n = [], 0
        while n <= limit:
            chunk = os.read(fd, limit + 1 - n)
            if not chunk:
                break
            chunks.append(chunk)
            n += len(chunk)
        if n > limit:
            raise NotRegular(f"it is larger than {limit} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)
