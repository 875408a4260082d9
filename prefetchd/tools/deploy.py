"""What ``prefetchd check`` says about a deployment: users, groups, modes, the RAM disk.

The model it checks (docs/systemd.md): the daemon runs as its own user with the
group ``buffer.group`` (the unit's ``Group=``); trainers of other users are members of that
group. The buffer directory is the daemon's, mode 0750 (0700 without a group), its files 0640;
the progress directory is 0770 (trainers replace their files there), progress files 0644. A
group that is not the daemon's own also needs the setgid bit on both directories.

Each finding is one line: ``problem: ...`` (the deployment does not work as configured) or
``warning: ...`` (it works, slower or less safely than it could). Permissions are judged from
the mode bits, owners and group memberships (ACLs are not read), so a check run as root can
speak for the daemon's user and the trainers.
"""

from __future__ import annotations

import errno
import fcntl
import grp
import json
import os
import pwd
import stat
from dataclasses import dataclass

from prefetchd.core.config import Config, format_size
from prefetchd.daemon.ring import PRIVATE_DIR_MODE, SETGID, dir_mode
from prefetchd.format.status import LOCK_NAME

HUGE_OK = ("within_size", "always", "advise")
_THP_SHMEM = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"


@dataclass(frozen=True)
class Account:
    """A user as the kernel's permission checks see it."""

    name: str
    uid: int
    gids: frozenset[int]

    @classmethod
    def lookup(cls, name: str) -> Account:
        try:
            pw = pwd.getpwnam(name) if not name.isdigit() else pwd.getpwuid(int(name))
        except KeyError:
            raise ValueError(f"user {name!r} is not known") from None
        gids = {pw.pw_gid} | {g.gr_gid for g in grp.getgrall() if pw.pw_name in g.gr_mem}
        return cls(pw.pw_name, pw.pw_uid, frozenset(gids))

    def may(self, st: os.stat_result, bits: int) -> bool:
        """May this user do ``bits`` (a mask of 4 read, 2 write, 1 execute) to the file of ``st``?"""
        if self.uid == 0:
            return True
        mode = st.st_mode
        shift = 6 if st.st_uid == self.uid else 3 if st.st_gid in self.gids else 0
        return (mode >> shift) & bits == bits


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _who(st: os.stat_result) -> str:
    return f"{_user_name(st.st_uid)}:{_group_name(st.st_gid)} {stat.S_IMODE(st.st_mode):04o}"


def mount_of(path: str, mountinfo: str = "/proc/self/mountinfo") -> tuple[str, str, list[str]] | None:
    """(mount point, filesystem type, mount and superblock options) of the mount holding ``path``."""
    real = os.path.realpath(path)
    best = None
    with open(mountinfo, encoding="utf-8", errors="replace") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            if len(fields) < 6 or len(rfields) < 3:
                continue
            mp = fields[4].replace("\\040", " ")
            if real == mp or real.startswith(mp.rstrip("/") + "/"):
                if best is None or len(mp) >= len(best[0]):  # the last of equals is the one on top
                    best = (mp, rfields[0], fields[5].split(",") + rfields[2].split(","))
    return best


def _reachable(acct: Account, path: str) -> str | None:
    """The first directory on the way to ``path`` that ``acct`` cannot pass, if any."""
    parts = os.path.realpath(path).split("/")[1:-1]
    cur = "/"
    for p in parts:
        cur = os.path.join(cur, p)
        try:
            st = os.stat(cur)
        except OSError:
            return None
        if not acct.may(st, 1):
            return cur
    return None


def check_deployment(cfg: Config, daemon: Account, trainers: list[Account]) -> list[str]:
    out: list[str] = []
    problem = lambda msg: out.append(f"problem: {msg}")  # noqa: E731
    warning = lambda msg: out.append(f"warning: {msg}")  # noqa: E731
    note = lambda msg: out.append(f"note: {msg}")  # noqa: E731
    group = cfg.buffer.group
    gid = None
    if group:
        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError:
            gid = int(group) if group.isdigit() else None
        if gid is None:
            problem(f"buffer.group {group!r} is not a known group: `groupadd {group}` or set the unit's Group=")
        elif gid not in daemon.gids and daemon.uid != 0:
            problem(f"the daemon's user {daemon.name} is not in buffer.group {group}: set Group={group} in the unit "
                    f"(or `usermod -aG {group} {daemon.name}`)")
        for t in trainers:
            if gid is not None and gid not in t.gids and t.uid != daemon.uid:
                problem(f"trainer {t.name} is not in buffer.group {group}: it cannot read batches; "
                        f"`usermod -aG {group} {t.name}`, then log in again")
    else:
        for t in trainers:
            if t.uid != daemon.uid and t.uid != 0:
                problem(f"buffer.group is not set: only {daemon.name} can read the buffer, not trainer {t.name}; set "
                        f"buffer.group to the daemon's group and add {t.name} to it")
    # a trainer already said to be outside the group is not said again for every directory
    trainers = [t for t in trainers if not any(f"trainer {t.name} " in line for line in out)]
    _check_dir(cfg.buffer.dir, "buffer.dir", False, cfg, gid, daemon, trainers, problem, warning)
    _check_dir(cfg.progress_dir, "progress.dir", True, cfg, gid, daemon, trainers, problem, warning)
    for msg in try_dirs(cfg, daemon, gid):
        if not any(msg.split(":", 1)[0] in line and "cannot" in line for line in out):  # said once per directory
            problem(msg)
    _check_files(cfg, daemon, problem)
    _check_mount(cfg, problem, warning, note)
    _check_progress_fs(cfg, note)
    return out


def _existing(path: str) -> str:
    """``path``, or its nearest ancestor that exists (where it will be created)."""
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _check_progress_fs(cfg: Config, note) -> None:
    """The progress files on the batches' filesystem (the default): a disk filled by something
    else also stops the trainers' progress writes; the client reads on from the ring and retries,
    but the daemon makes nothing new until a write gets through. A note, not a warning: it is the
    default, and what it costs is a delay while something else holds the RAM disk full, which
    ``buffer.min_free_bytes`` and a RAM disk of the buffer's own already guard against."""
    try:
        same = os.stat(_existing(cfg.progress_dir)).st_dev == os.stat(_existing(cfg.buffer.dir)).st_dev
    except OSError:
        return
    if same:
        note(f"progress.dir {cfg.progress_dir} shares a filesystem with buffer.dir {cfg.buffer.dir} (the default): "
             f"should something else fill it, trainers' progress reports are delayed (the client retries and reads "
             f"on from the ring; the daemon makes no new batch until a report gets through); a small tmpfs of its "
             f"own for progress.dir avoids that")


def _check_dir(path, key, progress, cfg, gid, daemon, trainers, problem, warning) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        parent = path
        while not os.path.exists(parent) and os.path.dirname(parent) != parent:
            parent = os.path.dirname(parent)
        pst = os.stat(parent)
        inside = path.startswith(cfg.buffer.dir.rstrip(os.sep) + os.sep)  # said for buffer.dir already
        if not _can_act_as(daemon) and not daemon.may(pst, 3) and not inside:  # else ``try_dirs`` tries
            problem(f"{key} {path} does not exist and {daemon.name} cannot create it in {parent} ({_who(pst)}): "
                    f"`prefetchd run` as {daemon.name} would fail; the unit's RuntimeDirectory= must make it "
                    f"(docs/systemd.md), or make it yourself")
        return
    except OSError as e:
        problem(f"{key} {path}: {e.strerror}")
        return
    if stat.S_ISLNK(st.st_mode):
        problem(f"{key} {path} is a symlink; the daemon refuses it: point {key} at the real directory")
        return
    if not stat.S_ISDIR(st.st_mode):
        problem(f"{key} {path} is not a directory")
        return
    if st.st_uid != daemon.uid:
        problem(f"{key} {path} is owned by {_user_name(st.st_uid)}, not by the daemon's user {daemon.name}: "
                f"`chown {daemon.name} {path}` (or remove it and let systemd make it)")
    mode = stat.S_IMODE(st.st_mode)
    want = dir_mode(cfg.buffer.group, progress)
    if gid is not None and gid not in daemon.gids:
        want |= SETGID
    if mode & 0o007:
        problem(f"{key} {path} ({_who(st)}) is open to users outside its group; the daemon makes it {want:04o}")
    elif mode & ~SETGID != want & ~SETGID:
        warning(f"{key} {path} has mode {mode:04o}; the daemon sets {want:04o} when it starts")
    if gid is not None and st.st_gid != gid:
        problem(f"{key} {path} has group {_group_name(st.st_gid)}, not buffer.group {cfg.buffer.group}: "
                f"`chgrp {cfg.buffer.group} {path}`, or remove it and let systemd make it")
    for t in trainers:
        blocked = _reachable(t, os.path.join(path, "x"))
        if blocked:
            problem(f"trainer {t.name} cannot reach {key} {path}: {blocked} ({_who(os.stat(blocked))}) is closed to it")
    blocked = _reachable(daemon, os.path.join(path, "x"))
    if blocked:
        problem(f"the daemon's user {daemon.name} cannot reach {key} {path}: {blocked} ({_who(os.stat(blocked))}) "
                f"is closed to it")


def _can_act_as(daemon: Account) -> bool:
    """Can this process try things as ``daemon`` (it is that user, or root)?"""
    return daemon.uid == os.geteuid() or os.geteuid() == 0


def try_dirs(cfg: Config, daemon: Account, gid: int | None = None) -> list[str]:
    """Do with ``buffer.dir`` and ``progress.dir`` what ``prefetchd run`` does first, as the
    daemon's user (``daemon``; a child process takes its uid and groups when this one is root):
    create each one that is missing (with its missing parents), create and remove a file in it,
    and take the buffer directory's lock (held by a running daemon: fine) and open ``daemon.lock``
    for writing. What this created is removed again. Returns one line per failure, each naming
    the key, the path, what failed and what to do; ``[]`` when everything worked, or when this
    process cannot act as ``daemon`` (not root, another user: the mode bits were judged)."""
    if not _can_act_as(daemon):
        return []
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: become the daemon's user, try, write the findings, exit
        code = 0
        try:
            os.close(r)
            if daemon.uid != os.geteuid():
                primary = gid if gid is not None and gid in daemon.gids else pwd.getpwuid(daemon.uid).pw_gid
                os.setgroups(sorted(daemon.gids))
                os.setgid(primary)
                os.setuid(daemon.uid)
            found = _try_dir(cfg.buffer.dir, "buffer.dir", daemon.name, lock=True)
            if not (found and cfg.progress_dir.startswith(cfg.buffer.dir.rstrip(os.sep) + os.sep)):  # said once
                found += _try_dir(cfg.progress_dir, "progress.dir", daemon.name, lock=False)
            os.write(w, json.dumps(found).encode())
        except BaseException as e:  # said by the parent: nothing was tried (the mode bits were not judged either)
            code = 1
            os.write(w, f"{type(e).__name__}: {e}".encode(errors="replace")[:2000])
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    try:
        if os.waitstatus_to_exitcode(status) == 0:
            return list(json.loads(data))
    except ValueError:
        pass
    why = data.decode(errors="replace").strip() or f"its trial process ended with status {status}"
    return [f"buffer.dir {cfg.buffer.dir}: check could not try it as {daemon.name} ({why}), so whether `prefetchd "
            f"run` as {daemon.name} can create, write and lock it is not known: run `prefetchd check` as "
            f"{daemon.name} to try it"]


def _try_dir(path: str, key: str, user: str, lock: bool) -> list[str]:
    """``try_dirs`` for one directory, in the process acting as the daemon's user ``user``."""
    made: list[str] = []  # what this created, deepest last: removed again
    try:
        missing, p = [], path
        while not os.path.lexists(p) and os.path.dirname(p) != p:
            missing.append(p)
            p = os.path.dirname(p)
        for d in reversed(missing):
            try:
                os.mkdir(d, PRIVATE_DIR_MODE)
            except OSError as e:
                parent = os.path.dirname(d)
                try:
                    where = f" ({_who(os.stat(parent))})"
                except OSError:
                    where = ""
                return [f"{key} {path}: {user} cannot create {d} in {parent}{where}: {e.strerror}; `prefetchd run` "
                        f"as {user} would fail: create it for {user} (`install -d -o {user} -m 0700 {path}`), or "
                        f"start the unit whose RuntimeDirectory= makes it first"]
            made.append(d)
        if not os.path.isdir(path) or os.path.islink(path):
            return []  # said by the mode-bit checks
        probe = os.path.join(path, f".prefetchd-check-{os.getpid()}.tmp")
        try:
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
            os.unlink(probe)
        except OSError as e:
            return [f"{key} {path}: {user} cannot create a file in it: {e.strerror}; `prefetchd run` as {user} "
                    f"would fail: make {user} its owner (`chown {user} {path}`)"]
        if lock:
            return _try_lock(path, key, user)
        return []
    finally:
        for d in reversed(made):
            try:
                os.rmdir(d)
            except OSError:
                pass


def _try_lock(path: str, key: str, user: str) -> list[str]:
    """Take ``path``'s lock and open its ``daemon.lock`` as ``run`` does (a daemon holding them: fine)."""
    try:
        dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(dfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise
        finally:
            os.close(dfd)
        lock = os.path.join(path, LOCK_NAME)
        if os.path.lexists(lock):
            os.close(os.open(lock, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC))
    except OSError as e:
        return [f"{key} {path}: {user} cannot take its lock ({e.filename or path}: {e.strerror}); `prefetchd run` "
                f"as {user} would fail: make {user} the owner of {path} and what is in it"]
    return []


def _check_files(cfg: Config, daemon: Account, problem) -> None:
    from prefetchd.format import batchfile
    from prefetchd.format.progress import FILE_MODE as PROGRESS_MODE

    try:
        with os.scandir(cfg.buffer.dir) as it:
            entries = [e for e in it if e.is_file(follow_symlinks=False)]
    except OSError:
        entries = []
    foreign = [e.name for e in entries if batchfile.parse_name(e.name) and e.stat(follow_symlinks=False).st_uid != daemon.uid]
    if foreign:
        problem(f"{len(foreign)} batch file(s) in {cfg.buffer.dir} are not the daemon's ({foreign[0]}, ...): "
                f"clients refuse them; remove them")
    try:
        with os.scandir(cfg.progress_dir) as it:
            progress = [e for e in it if e.name.startswith("progress-") and e.is_file(follow_symlinks=False)]
    except OSError:
        progress = []
    for e in progress:
        st = e.stat(follow_symlinks=False)
        if not daemon.may(st, 4):
            problem(f"{e.path} ({_who(st)}) cannot be read by the daemon's user {daemon.name}: its trainer's client "
                    f"must write it {PROGRESS_MODE:04o} (prefetchd >= this version does)")


def _shared_tmpfs(mp: str) -> bool:
    """A RAM disk made for everyone or for a login session (``/dev/shm``, ``/run/user/<uid>``), which
    a user cannot remount: its options are said as notes, not as warnings to act on."""
    return mp == "/dev/shm" or os.path.dirname(mp) == "/run/user"


def _check_mount(cfg: Config, problem, warning, note) -> None:
    path = cfg.buffer.dir
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    m = mount_of(path)
    if m is None:
        return
    mp, fstype, opts = m
    if fstype not in ("tmpfs", "ramfs"):
        warning(f"buffer.dir {cfg.buffer.dir} is on {fstype} ({mp}), not tmpfs: batches go through the page cache "
                f"to disk; mount the RAM disk (systemd/run-prefetchd.mount)")
        return
    try:
        mst = os.stat(mp)
    except OSError:
        mst = None
    if mst is not None and mp not in ("/dev/shm", "/tmp") and stat.S_IMODE(mst.st_mode) & 0o002:
        warning(f"the RAM disk {mp} is writable by everyone ({_who(mst)}): anyone can fill it or squat names "
                f"there; mount it with mode=0755 (X-mount.mode is ignored by util-linux 2.38)")
    huge = next((o.split("=", 1)[1] for o in opts if o.startswith("huge=")), "never")
    shared = _shared_tmpfs(mp)
    if huge not in HUGE_OK:
        (note if shared else warning)(
            f"the RAM disk {mp} has no huge pages (huge={huge}): a tmpfs of its own mounted with huge=within_size "
            f"writes batches faster (systemd/run-prefetchd.mount; BENCHMARKS.md)")
    else:
        try:
            thp = open(_THP_SHMEM).read()
        except OSError:
            thp = ""
        if "[deny]" in thp:
            warning(f"huge pages are denied for all tmpfs ({_THP_SHMEM} is deny): huge={huge} on {mp} has no effect")
    size = next((o.split("=", 1)[1] for o in opts if o.startswith("size=")), None)
    if size is not None and size.endswith("k") and size[:-1].isdigit():
        nbytes = int(size[:-1]) * 1024
        if nbytes < cfg.buffer.max_bytes + cfg.buffer.min_free_bytes:
            warning(f"the RAM disk {mp} holds {format_size(nbytes)}, less than buffer.max_bytes "
                    f"({format_size(cfg.buffer.max_bytes)}) plus min_free_bytes: the disk, not max_bytes, will bound "
                    f"the buffer")
    if mp == "/dev/shm":  # the Slurm example's choice and the demo's without a login session: fine, if counted
        note("buffer.dir is on /dev/shm, which the trainer's DataLoader and NCCL also use: keep buffer.max_bytes "
             "(auto: a quarter of memory) clear of what they need; a service gets a tmpfs of its own "
             "(systemd/run-prefetchd.mount)")
    if not any(o == "nosuid" for o in opts) or not any(o == "nodev" for o in opts):
        (note if shared else warning)(f"the RAM disk {mp} lacks nosuid or nodev")
