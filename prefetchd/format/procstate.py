"""Whether a process is running, stopped or gone, by pid: what the trainer says of a daemon that
makes nothing, and what the daemon says of a trainer that reads nothing.

``state(pid)`` reads the state letter of ``/proc/<pid>/stat`` (Linux): ``T`` (SIGSTOP, a job
suspended by Slurm or a shell's Ctrl-Z) and ``t`` (held by a debugger or strace) are
``"stopped"``; ``Z``, ``X`` and no such process are ``"gone"``; everything else (running,
sleeping, waiting on a disk) is ``"running"``. Without ``/proc`` it falls back to ``kill(pid, 0)``,
which tells ``"running"`` from ``"gone"`` only. Standard library only; never blocks.

A pid seen from another pid namespace (a trainer in a container, the daemon outside) may name
another process or none: the answer describes the pid as this process sees it.
"""

from __future__ import annotations

import os

RUNNING, STOPPED, GONE = "running", "stopped", "gone"
STATES = (RUNNING, STOPPED, GONE)


def state(pid: int) -> str:
    """``"running"``, ``"stopped"`` or ``"gone"`` (see the module docstring)."""
    if not isinstance(pid, int) or pid <= 0:
        return GONE
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read(4096)
    except FileNotFoundError:
        return GONE if os.path.isdir("/proc/self") else _by_signal(pid)
    except OSError:
        return _by_signal(pid)
    letter = parse_stat(data)
    if letter is None:
        return _by_signal(pid)
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


def _by_signal(pid: int) -> str:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return GONE
    except OSError:  # EPERM: it exists, another user's
        return RUNNING
    return RUNNING
