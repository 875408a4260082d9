"""The ring buffer directory: one published file per ready batch, and the daemon's lock.

Invariants kept here:

* the directory is a real directory (not a symlink) owned by the daemon's user, mode 0700, or
  0750 with ``buffer.group`` so a trainer running as another user of that group can read
  (``prepare_dir`` says how the modes and groups fit together); every file in it is 0640;
* only one daemon serves a directory (``flock`` on ``daemon.lock``);
* a file named ``*.batch`` is complete and was made for this stream: workers write ``.tmp-*``
  files, only ``publish`` renames them, and ``recover`` checks every leftover file (length and
  checksum) on start, deleting temp files and torn, corrupt or foreign batches;
* ``bytes_used`` is the sum of the published files' sizes, so ``buffer.max_bytes`` can be kept.
"""

from __future__ import annotations

import errno
import fcntl
import grp
import logging
import os
import stat
import time

from prefetchd.core.bufferdir import is_tmpfs  # noqa: F401 - the daemon's callers import it from here
from prefetchd.format import batchfile, jpegbatch
from prefetchd.format.progress import VAL_LANE
from prefetchd.format.status import FILE_MODE, LOCK_NAME

log = logging.getLogger("prefetchd.ring")

Key = tuple[int, int, int]  # (rank, epoch, batch)


class RingError(RuntimeError):
    """The buffer directory cannot be used; the message says why (a configuration error)."""


class BufferBusy(RingError):
    """Another daemon holds the buffer directory's lock (not a configuration error)."""


# Modes, set explicitly (fchmod/chmod) so the umask of whoever starts the daemon does not matter.
PRIVATE_DIR_MODE = 0o700  # no buffer.group: the daemon's user alone
GROUP_DIR_MODE = 0o750  # buffer dir with buffer.group: the group reads, only the daemon writes
GROUP_PROGRESS_DIR_MODE = 0o770  # progress dir with buffer.group: trainers replace their files
# With a group other than the daemon's own, the directories also need the setgid bit so that
# what the daemon creates there gets the group (systemd's RestrictSUIDSGID=yes refuses that bit:
# under the shipped units the group is the unit's Group=, and no setgid bit is needed).
SETGID = stat.S_ISGID


def _gid(group: str) -> int:
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        if group.isdigit():
            return int(group)
        raise RingError(f"buffer.group {group!r} is not a known group") from None


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def dir_mode(group: str | None, progress: bool = False) -> int:
    """The mode a buffer (or progress) directory must have, without the setgid bit."""
    if not group:
        return PRIVATE_DIR_MODE
    return GROUP_PROGRESS_DIR_MODE if progress else GROUP_DIR_MODE


def prepare_dirs(buffer_dir: str, progress_dir: str, group: str | None = None) -> None:
    """Create or check the buffer directory and the progress directory (see ``prepare_dir``)."""
    prepare_dir(buffer_dir, group)
    prepare_dir(progress_dir, group, progress=True, key="progress.dir")


def prepare_dir(path: str, group: str | None = None, progress: bool = False, key: str = "buffer.dir") -> None:
    """Create or check a directory the daemon serves: a real directory owned by us, and

    * without ``group``: mode 0700, the daemon's user alone;
    * with ``group``: that group, mode 0750 (0770 for the progress directory, where trainers of
      the group replace their progress files); plus the setgid bit when the group is not the
      daemon's own, so that the files it creates there get the group.

    Needs no capability when the directory is already right (systemd's ``RuntimeDirectory=``
    makes it so) or the group is the daemon's own; otherwise it changes group and mode itself,
    and says what to do where it may not.
    """
    want = dir_mode(group, progress)
    try:
        os.mkdir(path, PRIVATE_DIR_MODE)  # private until its group and mode are right
    except FileExistsError:
        pass
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.mkdir(path, PRIVATE_DIR_MODE)
    except PermissionError:
        raise RingError(f"{key} {path}: cannot create it (permission denied)") from None
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise RingError(f"{key} {path} is a symlink; point {key} at the real directory")
    if not stat.S_ISDIR(st.st_mode):
        raise RingError(f"{key} {path} exists and is not a directory")
    if st.st_uid != os.geteuid():
        raise RingError(f"{key} {path} is owned by uid {st.st_uid}, not by this daemon's uid {os.geteuid()}")
    if group:
        gid = _gid(group)
        if gid != os.getegid():
            want |= SETGID
        if st.st_gid != gid:
            try:
                os.chown(path, -1, gid)
            except PermissionError:
                raise RingError(f"{key} {path} has group {_group_name(st.st_gid)}, not buffer.group {group}, and this "
                                f"daemon may not change it; run it with {group} as its group (Group={group} in "
                                f"the unit) or `chgrp {group} {path}`") from None
            _regroup_files(path, gid)
    mode = stat.S_IMODE(st.st_mode)
    if mode != want and not (group and mode == want | SETGID):
        try:
            os.chmod(path, want)
        except PermissionError:
            raise RingError(f"{key} {path} has mode {mode:04o}, needs {want:04o}, and this daemon may not set "
                            f"it; `chmod {want:04o} {path}`") from None


def _regroup_files(path: str, gid: int) -> None:
    """buffer.group changed: give what a previous run left (kept batches, the lock) the new group."""
    with os.scandir(path) as it:
        for e in it:
            if e.is_file(follow_symlinks=False) and e.stat(follow_symlinks=False).st_uid == os.geteuid():
                os.chown(e.path, -1, gid, follow_symlinks=False)


class Lock:
    """An exclusive ``flock`` on the buffer directory itself, and on ``daemon.lock`` in it; the
    kernel drops both when the daemon dies.

    The directory's lock is the truth: it cannot be lost by deleting a file, so a second daemon
    started after someone removed ``daemon.lock`` still finds the first one and never deletes the
    batches of the stream it serves. ``daemon.lock`` holds the pid, and older tools take a shared
    lock on it to see whether a daemon runs (``status.daemon_alive`` asks the directory first,
    then the file, for daemons of older versions)."""

    def __init__(self, directory: str):
        self.dir = directory
        self.path = os.path.join(directory, LOCK_NAME)
        self.fd = -1
        self.dir_fd = -1

    def acquire(self) -> None:
        dfd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if not _flock_exclusive(dfd):
                raise BufferBusy(f"another prefetchd (pid {_holder(self.dir)}) already serves {self.dir}")
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
        except BaseException:
            os.close(dfd)
            raise
        os.fchmod(fd, FILE_MODE)  # clients of the group take a shared lock to see if we run
        try:
            busy = not _flock_exclusive(fd)
        except BaseException:
            os.close(fd)
            os.close(dfd)
            raise
        if busy:  # a daemon of an older version, which locks only the file
            other = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            os.close(dfd)
            raise BufferBusy(f"another prefetchd (pid {other or '?'}) already serves {self.dir}")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd, self.dir_fd = fd, dfd

    def restore(self) -> bool:
        """Make ``daemon.lock`` again if someone removed or replaced it (clients look at it to see
        whether a daemon runs, and which). True if it was made again. Call now and then."""
        if self.fd < 0:
            return False
        try:
            if os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(self.fd).st_ino:
                return False
        except FileNotFoundError:
            pass
        tmp = f"{self.path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
        try:
            os.fchmod(fd, FILE_MODE)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: nobody else holds it
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            os.rename(tmp, self.path)  # whole, locked and with our pid from its first moment
        except BaseException:
            os.close(fd)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        os.close(self.fd)
        self.fd = fd
        return True

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.dir_fd >= 0:
            os.close(self.dir_fd)
            self.dir_fd = -1


def _flock_exclusive(fd: int) -> bool:
    """Take an exclusive flock on ``fd``; False if another process holds it."""
    deadline = time.monotonic() + 0.5  # a `status` or client probe holds it shared for microseconds
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)


def _holder(directory: str) -> str:
    """The pid of the daemon that holds ``directory``, as its lock file or meta.json says."""
    from prefetchd.format.status import META_NAME, lock_pid, read_json

    pid = lock_pid(directory) or (read_json(directory, META_NAME) or {}).get("pid")
    return str(pid) if pid else "?"


class Ring:
    def __init__(self, directory: str, keys=None):
        self.dir = directory
        self.ready: dict[Key, int] = {}  # published batches and their sizes
        self.bytes_used = 0
        # the planner's keys to file keys and back (``segments.Segments``: resumed epochs'
        # batches are named for their segment); None: they are the same
        self.keys = keys

    def path(self, key: Key) -> str:
        return os.path.join(self.dir, batchfile.batch_name(*(self.keys.file_key(key) if self.keys else key)))

    def recover(self, fingerprint: int, val_fingerprint: int | None = None,
                view_shapes: tuple[tuple[int, int], ...] | None = None) -> dict[str, int]:
        """Adopt the valid batches a previous run left; delete everything else of ours. Batches
        of the validation stream's lanes carry ``val_fingerprint``; a train batch of pixels must
        hold ``view_shapes`` (the stream's views, as the probe learnt them: a transform's module
        may import code of its own that changed, which the fingerprint does not cover)."""
        counts = {"kept": 0, "temp": 0, "bad": 0, "foreign": 0}
        with os.scandir(self.dir) as it:
            entries = list(it)
        for e in entries:
            if e.name.startswith(batchfile.TMP_PREFIX):
                self._unlink(e.path)
                counts["temp"] += 1
                continue
            key = batchfile.parse_name(e.name)
            if key is None:
                continue
            if not e.is_file(follow_symlinks=False):
                self._unlink(e.path)
                counts["bad"] += 1
                continue
            try:
                b = jpegbatch.read_file(e.path, verify=True)  # either kind of batch
            except (batchfile.BatchFileError, OSError) as err:
                log.warning("removing %s: %s", e.name, err)
                self._unlink(e.path)
                counts["bad"] += 1
                continue
            want = val_fingerprint if key[0] >= VAL_LANE else fingerprint
            if len(key) > 3 and want is not None:  # a resumed epoch's segment (see batchfile)
                want = batchfile.segment_fingerprint(want, key[1], key[3])
            views = getattr(b, "views", None)  # (a compact batch has one view, of the config's size)
            shapes_ok = (view_shapes is None or key[0] >= VAL_LANE or not views
                         or tuple(map(tuple, b.shapes)) == tuple(map(tuple, view_shapes)))
            if b.fingerprint == want and (b.rank, b.epoch, b.batch) == key[:3] and shapes_ok:
                # the planner's key, if its rank reads that segment now
                key = self.keys.from_file(key) if self.keys else key if len(key) == 3 else None
            else:
                key = None
            if key is None:
                self._unlink(e.path)
                counts["foreign"] += 1
                continue
            self.ready[key] = b.file_size
            self.bytes_used += b.file_size
            counts["kept"] += 1
        return counts

    def publish(self, tmp_path: str, key: Key, size: int) -> None:
        os.chmod(tmp_path, FILE_MODE)  # whatever umask the worker had: the group reads it
        os.rename(tmp_path, self.path(key))
        self.ready[key] = size
        self.bytes_used += size

    def evict(self, key: Key) -> None:
        size = self.ready.pop(key, None)
        if size is not None:
            self.bytes_used -= size
            self._unlink(self.path(key))

    def free_bytes(self) -> int:
        try:
            st = os.statvfs(self.dir)  # what psutil.disk_usage(...).free says, without its wrapping
            return st.f_bavail * st.f_frsize
        except OSError:
            return 0

    def remove_temp_files(self) -> int:
        n = 0
        with os.scandir(self.dir) as it:
            for e in it:
                if e.name.startswith(batchfile.TMP_PREFIX):
                    self._unlink(e.path)
                    n += 1
        return n

    @staticmethod
    def _unlink(path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
