"""Read the node's limits into a ``limits.Host``: the thin shell around ``core.limits``.

The cgroup directories come from ``/proc/self/cgroup`` joined to the mounts in
``/proc/self/mountinfo`` (so a container's namespaced view works as the host's does); each limit
is the tightest along the cgroup's ancestors up to the mount. cgroup v2 (``cpu.max``,
``cpuset.cpus.effective``, ``memory.max``) and v1 (``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``,
``cpuset.effective_cpus`` or ``cpuset.cpus``, ``memory.limit_in_bytes``) are both read; a file
that is missing or unreadable is no limit. ``PREFETCHD_PROC`` (tests) reads another root.
"""

from __future__ import annotations

import os

from prefetchd.core.limits import (
    Bound,
    Host,
    parse_cfs,
    parse_cpu_list,
    parse_cpu_max,
    parse_meminfo_total,
    parse_memory_limit,
    tightest,
)


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()
    except (OSError, ValueError):
        return None


def _phys_memory() -> int | None:
    """The machine's memory from sysinfo (``/proc/meminfo`` is hidden by systemd's ``ProcSubset=pid``)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def _mounts(proc: str) -> list[tuple[str, str, str, set[str]]]:
    """(root, mount point, fstype, super options) of each cgroup mount."""
    out = []
    for line in (_read(f"{proc}/self/mountinfo") or "").splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        f, r = left.split(), right.split()
        if len(f) >= 5 and len(r) >= 3 and r[0] in ("cgroup", "cgroup2"):
            out.append((f[3], f[4].replace("\\040", " "), r[0], set(r[2].split(","))))
    return out


def cgroup_dirs(proc: str = "/proc") -> dict[str, str]:
    """{controller or "v2": this process's cgroup directory}."""
    mounts = _mounts(proc)
    dirs: dict[str, str] = {}
    for line in (_read(f"{proc}/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, ctrls, path = parts
        names = ["v2"] if ctrls == "" else ctrls.split(",")
        for name in names:
            for root, point, fstype, opts in mounts:
                if (name == "v2") != (fstype == "cgroup2") or (name != "v2" and name not in opts):
                    continue
                rel = path[len(root):] if root != "/" and path.startswith(root) else path
                d = os.path.normpath(point + "/" + rel.lstrip("/"))
                if os.path.isdir(d):
                    dirs[name] = d
                    break
    return dirs


def _ancestors(d: str, top: str) -> list[str]:
    out = [d]
    while d != top and len(d) > len(top):
        d = os.path.dirname(d)
        out.append(d)
    return out


def _mount_of(d: str, proc: str) -> str:
    best = "/"
    for _root, point, _, _ in _mounts(proc):
        if d.startswith(point.rstrip("/") + "/") or d == point:
            best = max(best, point, key=len)
    return best


def _walk(d: str, proc: str, read_one) -> list[Bound]:
    top = _mount_of(d, proc)
    found = []
    for a in _ancestors(d, top):
        b = read_one(a)
        if b is not None:
            found.append(b)
    return found


def read_host(buffer_dir: str | None = None, proc: str | None = None) -> Host:
    proc = proc or os.environ.get("PREFETCHD_PROC", "/proc")
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        affinity = os.cpu_count() or 1
    total = parse_meminfo_total(_read(f"{proc}/meminfo") or "") or _phys_memory()
    dirs = cgroup_dirs(proc)
    quotas: list[Bound] = []
    cpusets: list[Bound] = []
    mems: list[Bound] = []

    def v2_cpu(a: str) -> Bound | None:
        t = _read(f"{a}/cpu.max")
        q = parse_cpu_max(t) if t else None
        return Bound(q, "", f"cgroup v2 {a}/cpu.max") if q else None

    def v1_cpu(a: str) -> Bound | None:
        qt, pt = _read(f"{a}/cpu.cfs_quota_us"), _read(f"{a}/cpu.cfs_period_us")
        q = parse_cfs(qt, pt) if qt and pt else None
        return Bound(q, "", f"cgroup v1 {a}/cpu.cfs_quota_us / cpu.cfs_period_us") if q else None

    def cpuset(name: str, version: str):
        def one(a: str) -> Bound | None:
            t = _read(f"{a}/{name}")
            n = parse_cpu_list(t) if t and t.strip() else 0
            return Bound(n, "", f"cgroup {version} {a}/{name}") if n else None
        return one

    def mem(name: str, version: str):
        def one(a: str) -> Bound | None:
            t = _read(f"{a}/{name}")
            n = parse_memory_limit(t, total) if t else None
            return Bound(n, "", f"cgroup {version} {a}/{name}") if n else None
        return one

    if "v2" in dirs:
        quotas += _walk(dirs["v2"], proc, v2_cpu)
        cpusets += _walk(dirs["v2"], proc, cpuset("cpuset.cpus.effective", "v2"))[:1]
        mems += _walk(dirs["v2"], proc, mem("memory.max", "v2"))
    if "cpu" in dirs:
        quotas += _walk(dirs["cpu"], proc, v1_cpu)
    if "cpuset" in dirs:
        for name in ("cpuset.effective_cpus", "cpuset.cpus"):
            found = _walk(dirs["cpuset"], proc, cpuset(name, "v1"))[:1]
            if found:
                cpusets += found
                break
    if "memory" in dirs:
        mems += _walk(dirs["memory"], proc, mem("memory.limit_in_bytes", "v1"))
    fs_size = fs_type = fs_mount = None
    if buffer_dir:
        fs_size, fs_type, fs_mount = _filesystem(buffer_dir, proc)
    return Host(affinity=affinity, cpuset=tightest(cpusets), cpu_quota=tightest(quotas),
                memory_limit=tightest(mems), memory_total=total, fs_size=fs_size, fs_type=fs_type, fs_mount=fs_mount)


def _filesystem(path: str, proc: str) -> tuple[int | None, str | None, str | None]:
    """(size, type, mount point) of the filesystem that holds ``path`` (or would: its nearest
    existing ancestor, since the daemon creates the buffer directory)."""
    p = os.path.abspath(path)
    while not os.path.exists(p) and p != "/":
        p = os.path.dirname(p)
    try:
        st = os.statvfs(p)
    except OSError:
        return None, None, None
    size = st.f_blocks * st.f_frsize
    real = os.path.realpath(p)
    best, fstype = "/", None
    for line in (_read(f"{proc}/self/mountinfo") or "").splitlines():
        left, sep, right = line.partition(" - ")
        f, r = left.split(), right.split()
        if not sep or len(f) < 5 or not r:
            continue
        point = f[4].replace("\\040", " ")
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, fstype = point, r[0]
    return size, fstype, best
