"""Who else uses a daemon that ``prefetchd launch`` or ``serve()`` started: the users file.

A launch (or ``serve()``) that finds a daemon already serving its ``buffer.dir`` uses it as a
*guest*; before, the launch that started it stopped it when its own command ended, and the
guest's trainers waited for batches until their timeout: a lost run. Now each guest holds a
shared ``flock`` on ``USERS_NAME`` in the progress directory (the directory every trainer of the
daemon can write) for as long as it uses the daemon, and the one that started it, once its
command has ended, takes the lock exclusively before it stops the daemon: it waits while a guest
holds it, naming the guests' pids in one line, and a stop signal (Ctrl-C, ``scancel``'s SIGTERM)
ends the wait at once. It keeps the exclusive lock until the daemon is stopped and its
directories removed, so a guest arriving meanwhile waits for that, finds no daemon, and starts
its own.

The lock is the kernel's: a guest that dies releases it, and nothing is left to clean up. Only
read access is needed (``flock`` works on a descriptor opened read-only), so a file made by one
trainer's user serves another's: its maker gives it mode 0644 whatever its umask. A name that is
not a regular file (a FIFO, a symlink, planted by another user of a shared directory), a file it
cannot open, or a filesystem without ``flock`` is never waited on: the guest goes without the
hold, and says so in one line. A process forked from a guest (a DataLoader's worker,
multiprocessing's ``fork``) shares the guest's open file and with it the lock: the child's copy is
closed at the fork, or the starter would wait for that worker after the guest let go.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import time
from collections.abc import Callable

from prefetchd.format.progress import USERS_NAME

_log = logging.getLogger("prefetchd_client")
_WAIT_TICK_S = 0.2
FILE_MODE = 0o644  # each user of the daemon opens it to read (only the group reaches the progress dir)
_held: set[int] = set()  # the descriptors holding a lock now, closed in a forked child


def _close_in_child() -> None:
    """In a child forked while a lock is held: close the copies (the lock stays with the parent's)."""
    for fd in _held:
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)


def _close(fd: int) -> None:
    _held.discard(fd)
    os.close(fd)


def users_path(progress_dir: str) -> str:
    return os.path.join(progress_dir, USERS_NAME)


def _open(progress_dir: str, write: bool = False) -> tuple[int | None, str]:
    """The users file, opened read-only (made when missing), or None and why it cannot be (no
    such directory, no permission, not a regular file). ``write``: read-write where it may be,
    as an exclusive lock needs on NFS (flock is emulated there with POSIX locks)."""
    path = users_path(progress_dir)
    flags = os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        try:
            fd = os.open(path, flags | (os.O_RDWR if write else os.O_RDONLY), FILE_MODE)
        except PermissionError:
            if not write:
                raise
            fd = os.open(path, flags | os.O_RDONLY, FILE_MODE)  # another user's file: read-only will do locally
    except OSError as e:
        return None, f"cannot open {path} ({'a symlink' if e.errno == errno.ELOOP else e.strerror})"
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        return None, f"{path} is not a regular file"
    if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != FILE_MODE:  # made under a umask of 077
        with contextlib.suppress(OSError):
            os.fchmod(fd, FILE_MODE)
    return fd, ""


def _lock(fd: int, how: int) -> str | None:
    """``flock``: None when taken (held until ``_close``), "busy" when another holds it
    (``LOCK_NB``), else why it cannot be taken."""
    try:
        fcntl.flock(fd, how)
    except BlockingIOError:
        return "busy"
    except OSError as e:  # a filesystem without flock: Lustre without -o flock (ENOSYS), some NFS and FUSE mounts
        return e.strerror or str(e)
    _held.add(fd)
    return None


class _Hold:
    """A lock on the users file, held through ``fd`` (None: nothing held) until closed."""

    def __init__(self, fd: int | None):
        self._fd = fd
        self._pid = os.getpid()  # a forked child's copy was closed at the fork: its number is not ours

    @property
    def held(self) -> bool:
        return self._fd is not None

    def close(self) -> None:
        if self._fd is not None and self._pid == os.getpid():
            _close(self._fd)
        self._fd = None


class Guest(_Hold):
    """A guest's hold on a daemon it did not start (a shared lock on the users file); ``held``:
    whether the daemon's starter can see this guest."""

    @classmethod
    def join(cls, progress_dir: str, still_serving: Callable[[], bool],
             say: Callable[[str], object] = lambda line: None, stop: Callable[[], bool] = lambda: False) -> Guest | None:
        """Hold the daemon as a guest, then check it still serves (``still_serving``): a hold
        taken while the one that started it was stopping it comes after the stop, and finds no
        daemon. None, holding nothing, when it no longer serves (or ``stop()`` ended the wait for
        that stop: a stop signal); a hold on nothing when it does but cannot be held (the file
        cannot be opened or locked: said in one line)."""
        fd, why = _open(progress_dir)
        if fd is not None and (err := _lock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)) == "busy":
            say(f"the daemon is being stopped by the launch or serve() that started it ({users_path(progress_dir)} "
                f"is held); waiting for that")
            while (err := _lock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)) == "busy":  # until it is stopped and removed
                if stop():
                    os.close(fd)
                    return None
                time.sleep(_WAIT_TICK_S)
        if fd is not None and err is not None:
            os.close(fd)
            fd, why = None, f"cannot lock {users_path(progress_dir)} ({err})"
        try:
            serving = still_serving()
        except BaseException:  # it raised (another stream there now): nothing left held
            if fd is not None:
                _close(fd)
            raise
        if not serving:
            if fd is not None:
                _close(fd)
            return None
        if fd is None:
            say(f"{why}: the launch or serve() that started the daemon cannot know this one uses it, and may "
                f"stop it when its own command ends")
        return cls(fd)


def holders(fd: int) -> list[int]:
    """Pids holding a lock on ``fd``'s file, other than this process (``/proc/locks``)."""
    st = os.fstat(fd)
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = []
    with contextlib.suppress(OSError), open("/proc/locks") as f:
        for line in f:
            parts = line.split()
            if "->" in parts:  # a waiter, not a holder
                continue
            if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == key:
                with contextlib.suppress(ValueError):
                    if (pid := int(parts[4])) not in (os.getpid(), 0):
                        pids.append(pid)
    return sorted(set(pids))


def _describe(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return str(pid)
    return f"{pid} ({cmd[:60]}{'...' if len(cmd) > 60 else ''})" if cmd else str(pid)


class OwnerHold(_Hold):
    """The exclusive hold the daemon's starter takes before stopping it (``wait_for_guests``)."""

    release = _Hold.close


def wait_for_guests(progress_dir: str, daemon_pid: int | None, say: Callable[[str], object],
                    stop: Callable[[], bool]) -> OwnerHold:
    """Before stopping the daemon this process started: wait until no guest holds it, saying once
    who does; ``stop()`` true ends the wait (a stop signal). Returns the hold to release once the
    daemon is stopped and its directories removed (holding nothing when the file cannot be
    opened, or the wait was ended)."""
    fd, why = _open(progress_dir, write=True)
    if fd is None:
        _log.debug("prefetchd: %s", why)
        return OwnerHold(None)
    said = False
    try:
        while True:
            why = _lock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if why is None:
                return OwnerHold(fd)
            if why != "busy":  # no flock here: a guest could not hold it either (each said so)
                say(f"cannot lock {users_path(progress_dir)} ({why}): stopping the daemon (pid {daemon_pid}) without "
                    f"waiting for launches or serve() blocks that may use it")
                break
            if not said:
                pids = holders(fd)
                who = f"pid {', '.join(_describe(p) for p in pids)}" if pids else "another process"
                say(f"the daemon (pid {daemon_pid}) is still used by {who}, which found it serving; waiting "
                    f"for that to end before stopping the daemon (a stop signal stops it now)")
                said = True
            if stop():
                break
            time.sleep(_WAIT_TICK_S)
    except BaseException:  # serve()'s Ctrl-C, in the sleep or anywhere: nothing left open, or held
        _close(fd)
        raise
    os.close(fd)
    return OwnerHold(None)
