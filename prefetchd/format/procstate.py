"""Whether a process is running, stopped or gone, by pid: what the trainer says of a daemon that
makes nothing, and what the daemon says of a trainer that reads nothing.

``state(pid)`` reads the state letter of ``/proc/<pid>/stat`` (Linux): ``T`` (SIGSTOP, a job
suspended by Slurm or a shell's Ctrl-Z) and ``t`` (held by a debugger or strace) are
``"stopped"``; ``Z``, ``X`` and no such process are ``"gone"``; everything else (running,
sleeping, waiting on a disk) is ``"running"``. Without ``/proc`` it falls back to ``kill(pid, 0)``,
which tells ``"running"`` from ``"gone"`` only; a process ``/proc`` hides (``hidepid=2``: another
user's) is ``"unknown"``. Standard library only; never blocks.

A pid is not a process: once a trainer exits, its pid may be given to another process, and a
pid seen from another pid namespace (a trainer in a container or a Kubernetes pod's other
container, the daemon outside) names another process or none (a container's pid 1 is the host's
init). So the trainer says who it is (``identity()``: its start time and its pid namespace) and
``state(pid, start, ns)`` answers ``"unknown"`` for a pid of another namespace, and ``"gone"``
for a pid whose process started at another time (the trainer's pid reused).
"""

from __future__ import annotations

import ctypes
import os

RUNNING, STOPPED, GONE, UNKNOWN = "running", "stopped", "gone", "unknown"
STATES = (RUNNING, STOPPED, GONE, UNKNOWN)


def identity() -> tuple[int, int]:
    """This process's ``(start, ns)``: its start time (``/proc/self/stat``'s field 22, clock ticks
    after boot) and its pid namespace (the inode of ``/proc/self/ns/pid``); 0 for one unknown."""
    return _start(os.getpid()), pid_namespace()


def pid_namespace() -> int:
    """The inode of this process's pid namespace, or 0 where it cannot be read."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


PID_MAX_LIMIT = 4 * 1024 * 1024  # Linux's ceiling on /proc/sys/kernel/pid_max (include/linux/threads.h)


def state(pid: int, start: int = 0, ns: int = 0) -> str:
    """``"running"``, ``"stopped"``, ``"gone"`` or ``"unknown"`` (see the module docstring). ``start``
    and ``ns`` (0: not known) are the process's ``identity()`` as it said it."""
    if not isinstance(pid, int) or pid <= 0 or pid > PID_MAX_LIMIT:
        return GONE  # no process can have it (a hostile progress file may say 2**62)
    if ns and pid_namespace() not in (0, ns):
        return UNKNOWN  # its pid means nothing here
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read(4096)
    except FileNotFoundError:
        if not os.path.isdir("/proc/self"):
            return _by_signal(pid)
        # no such process, or one /proc hides from this user (mounted hidepid=2, as hardened hosts
        # and clusters do: a trainer of another user): the signal tells which, not its state
        return UNKNOWN if _by_signal(pid) == RUNNING else GONE
    except OSError:
        return _by_signal(pid)
    letter = parse_stat(data)
    if letter is None:
        return _by_signal(pid)
    if start and parse_start(data) not in (None, start):
        return GONE  # another process took its pid
    if letter in "Tt":
        return STOPPED
    return GONE if letter in "ZXx" else RUNNING


def parse_stat(data: bytes) -> str | None:
    """The state letter of a ``/proc/<pid>/stat`` line: after the command name, which is in
    parentheses and may itself hold spaces and parentheses (so the last ``)`` ends it)."""
    end = data.rfind(b")")
    if end < 0 or len(data) < end + 3:
        return None
    return data[end + 2: end + 3].decode("ascii", "replace")


def parse_start(data: bytes) -> int | None:
    """The start time (field 22) of a ``/proc/<pid>/stat`` line, or None."""
    fields = data[data.rfind(b")") + 2:].split()
    try:
        return int(fields[19])  # the fields after the name start at field 3 (the state)
    except (IndexError, ValueError):
        return None


def _start(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return parse_start(f.read(4096)) or 0
    except OSError:
        return 0


def exists(pid) -> bool:
    """Whether a process ``pid`` exists (another user's too); False for anything not a pid."""
    return isinstance(pid, int) and pid > 0 and _by_signal(pid) != GONE


def _by_signal(pid: int) -> str:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # OverflowError: beyond a pid_t
        return GONE
    except OSError:  # EPERM: it exists, another user's
        return RUNNING
    return RUNNING


_PR_SET_PDEATHSIG = 1
PARENT_ENV = "PREFETCHD_DIE_WITH_PARENT"  # a daemon started by a trainer (``serve()``): its parent's pid


def die_with_parent(parent: int, sig: int) -> bool:
    """Ask the kernel for ``sig`` when the thread that started this process ends (Linux's
    ``PR_SET_PDEATHSIG``); False if ``parent`` is not this process's parent (it ended before the
    call and this process was handed to another, or another process started it: the caller says
    so and exits). Called by the child itself, first thing: a ``preexec_fn`` doing this runs Python
    between fork and exec, which is unsafe in a threaded parent (a trainer is one)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - not Linux: the child may outlive its parent
        return True
    return os.getppid() == parent
