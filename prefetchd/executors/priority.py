"""The local workers' CPU priority: below the trainers', so a trainer's thread wins a contended core.

``workers.priority`` (a worker applies it to itself as it starts, before its first batch):

* ``batch`` (the default): ``SCHED_BATCH`` at nice 19. A worker's share of a core the trainer
  also wants is about 1.5% (nice 19's weight, 15, against nice 0's 1024), and as a batch task it
  never preempts the trainer when it wakes. Measured against the others in BENCHMARKS.md
  ("Sharing the node").
* ``idle``: ``SCHED_IDLE``: runs only on a core nothing else wants, also below other niced jobs.
* ``nice``: nice 19, the normal policy.
* ``normal``: as the daemon (before 0.x: every worker competed with the trainers as an equal).

A worker that may not change its priority (a seccomp filter, as the shipped systemd unit's
``SystemCallFilter=~@resources``, whose ``Nice=``/``CPUWeight=`` do the same for the whole
unit) keeps the one it inherited; ``apply`` says what it got.
"""

from __future__ import annotations

import os

NICE = 19


def apply(priority: str) -> str:
    """Lower this process's CPU priority as ``priority`` says; a phrase for the log."""
    if priority == "normal":
        return "normal"
    got = []
    try:
        if priority in ("batch", "nice"):
            os.setpriority(os.PRIO_PROCESS, 0, max(NICE, os.getpriority(os.PRIO_PROCESS, 0)))
            got.append(f"nice {os.getpriority(os.PRIO_PROCESS, 0)}")
        if priority == "batch":
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
            got.insert(0, "SCHED_BATCH")
        elif priority == "idle":
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            got.insert(0, "SCHED_IDLE")
    except (OSError, AttributeError) as e:  # refused (seccomp, a container's policy) or not Linux
        reason = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        got.append(f"left as inherited ({reason})")
    return ", ".join(got)
