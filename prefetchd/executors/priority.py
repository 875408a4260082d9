"""The local workers' CPU priority: below the trainers', so a trainer's thread wins a contended core.

``workers.priority`` (a worker applies it to itself as it starts, before its first batch):

* ``idle`` (the default, chosen by ``prefetchd bench --share``: BENCHMARKS.md, "Sharing the
  node"): ``SCHED_IDLE``. A worker runs on what no other thread wants: a trainer's thread that
  wakes preempts it at once, and the scheduler counts a core running only idle tasks as free
  when it places a waking trainer thread. The price: a worker preempted while it holds a kernel
  lock a trainer also takes (the ring directory's, for the microseconds of a create) waits for a
  free core; ``batch`` bounds that wait by a slice.
* ``batch``: ``SCHED_BATCH`` at nice 19: about 1.5% of a core a nice-0 thread also wants (weight
  15 against 1,024), never preempting on wake-up.
* ``nice``: nice 19, the normal policy.
* ``normal``: as the daemon (before 0.x: every worker competed with the trainers as an equal).

A worker that may not change its priority (a seccomp filter such as ``SystemCallFilter=~@resources``
without the ``setpriority sched_setscheduler`` the shipped units allow again, or a container
without the capability) keeps the one it inherited; ``apply`` says what it got.
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
