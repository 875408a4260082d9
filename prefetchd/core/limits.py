"""The node's limits, and what ``auto`` makes of them: pure functions over what was read.

``core.hostread.read_host`` reads the machine (the affinity mask, the cgroup's cpuset, CPU quota
and memory limit, v1 or v2, the tightest along the cgroup's ancestors; the machine's memory; the
buffer's filesystem) into a ``Host``; everything here is a function of a ``Host`` and settings,
so each rule is tested without a cgroup. Each choice comes with the sentence that says why
("1 worker: the CPU quota of 1.0 core (cgroup v1 cpu.cfs_quota_us / cpu.cfs_period_us)"), which
``check``, the log and ``status`` print as they are.

Rules:

* ``workers.count: auto`` = the least of the affinity mask's CPUs, the cpuset's CPUs and the CPU
  quota rounded down (at least 1), less ``workers.reserve_cores``, at least 1. A quota of 1.5
  cores makes 1 worker: the workers run below the trainers' priority, but a quota is shared with
  them and a process over it is throttled whatever its priority.
* ``buffer.max_bytes: auto`` = the least of the buffer filesystem's size less ``min_free_bytes``,
  ``MEMORY_SHARE`` of the memory cgroup's limit and ``MEMORY_SHARE`` of the machine's memory.
  Pages written to a tmpfs are charged to the writer's memory cgroup, and batches sit in the page
  cache on any filesystem: a quarter leaves the trainers the rest.
* ``buffer.capacity: auto`` (``auto_capacity``) = ``lead_s`` seconds of the fastest rank's
  consumption, within what ``max_bytes`` holds for every rank, never fewer than ``refill_at``
  needs (one more than it) nor than ``MIN_CAPACITY``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prefetchd.core.configvalues import format_size as fmt_bytes

MEMORY_SHARE = 0.25
MIN_CAPACITY = 4
START_CAPACITY = 64  # capacity: auto before any consumption is measured (today's default)


@dataclass(frozen=True)
class Bound:
    """One limit found: its value, what it is (a phrase) and where it was read."""

    value: float
    what: str
    source: str


@dataclass(frozen=True)
class Host:
    """What ``hostread.read_host`` found; None where there is no such limit (or it is unreadable)."""

    affinity: int
    cpuset: Bound | None = None  # CPUs in the cgroup's cpuset
    cpu_quota: Bound | None = None  # cores (quota / period)
    memory_limit: Bound | None = None  # bytes
    memory_total: int | None = None  # the machine's memory (MemTotal)
    fs_size: int | None = None  # the buffer filesystem's size
    fs_type: str | None = None  # its type (tmpfs, ext4, ...)
    fs_mount: str | None = None  # its mount point


# --- parsing what the kernel writes ------------------------------------------------------------


def parse_cpu_list(text: str) -> int:
    """The number of CPUs in a list such as ``0-3,8,10-11`` (cpuset.cpus); 0 for an empty one."""
    n = 0
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        n += (int(hi) - int(lo) + 1) if hi else 1
    return n


def parse_cpu_max(text: str) -> float | None:
    """cgroup v2 ``cpu.max`` (``"max 100000"`` or ``"150000 100000"``) in cores; None: no quota."""
    parts = text.split()
    if not parts or parts[0] == "max":
        return None
    period = int(parts[1]) if len(parts) > 1 else 100000
    quota = int(parts[0])
    return quota / period if quota > 0 and period > 0 else None


def parse_cfs(quota_text: str, period_text: str) -> float | None:
    """cgroup v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` in cores; None: no quota (-1)."""
    quota, period = int(quota_text.strip()), int(period_text.strip())
    return quota / period if quota > 0 and period > 0 else None


def parse_memory_limit(text: str, memory_total: int | None = None) -> int | None:
    """cgroup v2 ``memory.max`` or v1 ``memory.limit_in_bytes`` in bytes; None: no limit (v2's
    ``max``, v1's page-rounded 2**63, or anything at least the machine's memory)."""
    text = text.strip()
    if not text or text == "max":
        return None
    n = int(text)
    if n <= 0 or n >= (1 << 62) or (memory_total is not None and n >= memory_total):
        return None
    return n


def parse_meminfo_total(text: str) -> int | None:
    for line in text.splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return None


def tightest(bounds: list[Bound]) -> Bound | None:
    """The least of limits found along a cgroup's ancestors (each level caps its descendants)."""
    return min(bounds, key=lambda b: b.value) if bounds else None


# --- what auto makes of them --------------------------------------------------------------------


def cpu_bound(host: Host) -> Bound:
    """The number of cores this process can use, and which limit said so."""
    found = [Bound(host.affinity, f"{host.affinity} CPU{'s' if host.affinity != 1 else ''} in the affinity mask",
                   "sched_getaffinity")]
    if host.cpuset is not None:
        n = int(host.cpuset.value)
        found.append(Bound(n, f"{n} CPU{'s' if n != 1 else ''} in the cpuset", host.cpuset.source))
    if host.cpu_quota is not None:
        q = host.cpu_quota.value
        found.append(Bound(max(1, math.floor(q + 1e-9)), f"the CPU quota of {q:g} core{'s' if q != 1 else ''}",
                           host.cpu_quota.source))
    least = min(found, key=lambda b: b.value)  # the first of equals: the affinity mask, then cpuset
    return Bound(max(1, int(least.value)), least.what, least.source)


def auto_workers(host: Host, reserve_cores: int = 0) -> tuple[int, str]:
    """``workers.count: auto``: (workers, why)."""
    b = cpu_bound(host)
    n = max(1, int(b.value) - reserve_cores)
    less = f", less reserve_cores {reserve_cores}" if reserve_cores else ""
    return n, f"{n} worker{'s' if n != 1 else ''}: {b.what} ({b.source}){less}"


def auto_max_bytes(host: Host, min_free_bytes: int) -> tuple[int, str]:
    """``buffer.max_bytes: auto``: (bytes, why); the least of the rules' bounds."""
    found: list[tuple[int, str]] = []
    if host.fs_size is not None:
        where = f"{host.fs_type} " if host.fs_type else ""
        found.append((host.fs_size - min_free_bytes,
                      f"the {where}filesystem's {fmt_bytes(host.fs_size)} at {host.fs_mount or '?'} less min_free_bytes"))
    pct = f"{MEMORY_SHARE:.0%}"
    if host.memory_limit is not None:
        lim = int(host.memory_limit.value)
        found.append((int(lim * MEMORY_SHARE), f"{pct} of the {fmt_bytes(lim)} memory limit ({host.memory_limit.source})"))
    if host.memory_total is not None:
        found.append((int(host.memory_total * MEMORY_SHARE), f"{pct} of the machine's {fmt_bytes(host.memory_total)} memory"))
    if not found:
        n = 8 << 30
        return n, f"max_bytes {fmt_bytes(n)}: no limit could be read (the old default)"
    n, why = min(found)
    n = max(n, 1 << 20)  # something to start with; check warns that the disk is too small
    return n, f"max_bytes {fmt_bytes(n)}: {why}"


def auto_capacity(max_bytes: int, batch_bytes: int, ranks: int, lead_s: float, batches_per_s: float | None,
                  refill_at: int | None) -> tuple[int, str]:
    """``buffer.capacity: auto``: batches kept ready per rank, (capacity, why).

    ``batches_per_s`` is the fastest rank's measured consumption (None before any is measured);
    what ``max_bytes`` holds for every rank is the ceiling, ``refill_at + 1`` (or ``MIN_CAPACITY``)
    the floor, and the floor wins over the ceiling (``check`` warns when max_bytes is that short).
    """
    fit = max(1, max_bytes // max(1, batch_bytes * max(1, ranks)))
    floor_ = max(MIN_CAPACITY, (refill_at or 0) + 1)
    if batches_per_s is None or batches_per_s <= 0:
        want, why = START_CAPACITY, "no consumption measured yet"
    else:
        want = math.ceil(lead_s * batches_per_s)
        why = f"{lead_s:g} s at {batches_per_s:.2f} batches/s"
    if want > fit:
        want, why = fit, f"{why}, cut to what max_bytes holds for {ranks} rank{'s' if ranks != 1 else ''}"
    if want < floor_:
        want, why = floor_, f"{why}, raised to the least refilling needs"
    return want, f"capacity {want}: {why}"


def auto_refill_at(capacity: int) -> int:
    return max(1, (capacity * 3) // 4)


def over_limits(host: Host, workers: int | None, max_bytes: int | None) -> list[str]:
    """Warnings for explicit numbers beyond what the node allows (the number still wins)."""
    out = []
    b = cpu_bound(host)
    if workers is not None and workers > b.value:
        out.append(f"workers.count {workers} exceeds {b.what} ({b.source}): the workers will contend for "
                   f"{int(b.value)} core{'s' if b.value != 1 else ''}; 'auto' makes {int(b.value)}")
    if max_bytes is not None:
        auto, why = auto_max_bytes(host, 0)
        if host.memory_limit is not None and max_bytes > host.memory_limit.value * MEMORY_SHARE * 2:
            out.append(f"buffer.max_bytes {fmt_bytes(max_bytes)} is over half the "
                       f"{fmt_bytes(host.memory_limit.value)} memory limit ({host.memory_limit.source}): batches in "
                       f"the page cache or on a tmpfs are charged to it; 'auto' takes {fmt_bytes(auto)}")
        elif host.memory_total is not None and max_bytes > host.memory_total * MEMORY_SHARE * 2:
            out.append(f"buffer.max_bytes {fmt_bytes(max_bytes)} is over half the machine's "
                       f"{fmt_bytes(host.memory_total)} memory: batches in the page cache or on a tmpfs take it from "
                       f"the trainers; 'auto' takes {fmt_bytes(auto)}")
        if host.fs_size is not None and max_bytes > host.fs_size and host.fs_type != "tmpfs":  # tmpfs: deploy's
            out.append(f"buffer.max_bytes {fmt_bytes(max_bytes)} exceeds the buffer filesystem's "
                       f"{fmt_bytes(host.fs_size)} ({host.fs_mount}): the disk, not max_bytes, will bound the ring")
    return out


def describe(host: Host) -> list[str]:
    """One line per limit found, for ``check``."""
    lines = [f"CPUs: {host.affinity} in the affinity mask"]
    if host.cpuset is not None:
        lines.append(f"cpuset: {int(host.cpuset.value)} CPUs ({host.cpuset.source})")
    lines.append(f"CPU quota: {host.cpu_quota.value:g} cores ({host.cpu_quota.source})" if host.cpu_quota
                 else "CPU quota: none")
    lines.append(f"memory limit: {fmt_bytes(host.memory_limit.value)} ({host.memory_limit.source})"
                 if host.memory_limit else "memory limit: none")
    if host.memory_total is not None:
        lines.append(f"machine memory: {fmt_bytes(host.memory_total)}")
    if host.fs_size is not None:
        lines.append(f"buffer filesystem: {host.fs_type or '?'} of {fmt_bytes(host.fs_size)} at {host.fs_mount}")
    return lines
