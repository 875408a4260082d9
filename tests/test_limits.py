"""The node's limits and what ``auto`` makes of them (issue 30): the pure rules of core.limits and
core.sizing, the reader over fake /proc and cgroup trees (v1 and v2), and process tests: the
workers' CPU priority, and ``workers.count: auto`` in a real cgroup with a 1-core CPU quota."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import pytest
from conftest import DaemonProc, rmdir_gone, small_config, wait_until

from prefetchd.core import config as C
from prefetchd.core.hostread import read_host
from prefetchd.core.limits import (
    Bound,
    Host,
    auto_capacity,
    auto_max_bytes,
    auto_workers,
    cpu_bound,
    over_limits,
    parse_cfs,
    parse_cpu_list,
    parse_cpu_max,
    parse_memory_limit,
)
from prefetchd.core.sizing import resolve

GiB = 1 << 30


# --- parsing ---------------------------------------------------------------------------------------


def test_parses_what_the_kernel_writes():
    assert parse_cpu_list("0-3,8,10-11\n") == 7 and parse_cpu_list("5") == 1 and parse_cpu_list("\n") == 0
    assert parse_cpu_max("max 100000\n") is None and parse_cpu_max("150000 100000\n") == 1.5
    assert parse_cfs("-1\n", "100000\n") is None and parse_cfs("100000", "100000") == 1.0
    assert parse_cfs("50000", "100000") == 0.5
    assert parse_memory_limit("max\n") is None
    assert parse_memory_limit("9223372036854771712\n") is None  # v1's "unlimited", page-rounded 2**63
    assert parse_memory_limit(str(32 * GiB), memory_total=16 * GiB) is None  # above the machine: no limit
    assert parse_memory_limit(str(2 * GiB), memory_total=16 * GiB) == 2 * GiB


# --- the rules -------------------------------------------------------------------------------------


def test_workers_auto_takes_the_least_bound_and_says_which():
    assert auto_workers(Host(affinity=2)) == (2, "2 workers: 2 CPUs in the affinity mask (sched_getaffinity)")
    quota = Bound(1.0, "", "cgroup v1 /sys/fs/cgroup/cpu/x/cpu.cfs_quota_us / cpu.cfs_period_us")
    n, why = auto_workers(Host(affinity=128, cpu_quota=quota))
    assert n == 1 and why.startswith("1 worker: the CPU quota of 1 core (cgroup v1 ")
    n, why = auto_workers(Host(affinity=128, cpuset=Bound(4, "", "cgroup v2 cpuset.cpus.effective"),
                               cpu_quota=Bound(6.5, "", "cgroup v2 cpu.max")))
    assert n == 4 and "4 CPUs in the cpuset" in why
    assert auto_workers(Host(affinity=128, cpu_quota=Bound(2.5, "", "q")))[0] == 2  # rounded down
    assert auto_workers(Host(affinity=128, cpu_quota=Bound(0.3, "", "q")))[0] == 1  # never 0
    n, why = auto_workers(Host(affinity=8), reserve_cores=2)  # the old key keeps working
    assert n == 6 and why.endswith("less reserve_cores 2")
    assert auto_workers(Host(affinity=2), reserve_cores=5)[0] == 1
    assert cpu_bound(Host(affinity=3)).value == 3


def test_max_bytes_auto_is_the_least_of_disk_and_memory_and_says_which():
    host = Host(affinity=2, memory_limit=Bound(12.5 * GiB, "", "cgroup v2 /sys/fs/cgroup/pod/memory.max"),
                memory_total=64 * GiB, fs_size=32 * GiB, fs_type="tmpfs", fs_mount="/dev/shm")
    n, why = auto_max_bytes(host, 256 << 20)
    assert n == int(12.5 * GiB * 0.25)
    assert why == "max_bytes 3.1 GiB: 25% of the 12.5 GiB memory limit (cgroup v2 /sys/fs/cgroup/pod/memory.max)"
    n, why = auto_max_bytes(Host(affinity=2, memory_total=64 * GiB, fs_size=4 * GiB, fs_type="tmpfs",
                                 fs_mount="/run/prefetchd"), 1 * GiB)
    assert n == 3 * GiB and "tmpfs filesystem's 4.0 GiB at /run/prefetchd less min_free_bytes" in why
    n, why = auto_max_bytes(Host(affinity=2, memory_total=24 * GiB, fs_size=250 * GiB), 0)
    assert n == 6 * GiB and "25% of the machine's 24.0 GiB memory" in why


def test_capacity_auto_keeps_lead_s_within_max_bytes_and_never_below_refill():
    mb = 1 << 20
    assert auto_capacity(GiB, mb, 8, 60, None, None)[0] == 64  # nothing measured yet
    n, why = auto_capacity(GiB, mb, 2, 60, 2.0, None)
    assert n == 120 and "60 s at 2.00 batches/s" in why
    n, why = auto_capacity(64 * mb, mb, 8, 60, 2.0, None)
    assert n == 8 and "cut to what max_bytes holds for 8 ranks" in why
    n, why = auto_capacity(64 * mb, mb, 8, 60, 2.0, 12)
    assert n == 13 and "raised to the least refilling needs" in why


def test_explicit_numbers_win_and_check_warns_when_they_exceed_a_limit(tmp_path):
    host = Host(affinity=16, cpu_quota=Bound(4.0, "", "cgroup v2 cpu.max"),
                memory_limit=Bound(16 * GiB, "", "cgroup v2 memory.max"), memory_total=128 * GiB,
                fs_size=64 * GiB, fs_type="tmpfs", fs_mount="/dev/shm")
    cfg = C.from_dict({"dataset": {"root": str(tmp_path)}})
    assert cfg.workers.count == "auto" and cfg.buffer.max_bytes == "auto"  # the defaults
    assert cfg.workers.priority == "idle"  # BENCHMARKS.md, "Sharing the node"
    s = resolve(cfg, host)
    assert s.cfg.workers.count == 4 and s.cfg.buffer.max_bytes == 4 * GiB and not s.warnings
    assert s.why["workers"].startswith("4 workers: the CPU quota of 4 cores")
    cfg = C.from_dict({"dataset": {"root": str(tmp_path)}, "workers": {"count": 12},
                       "buffer": {"max_bytes": "12GiB"}})
    s = resolve(cfg, host)
    assert s.cfg.workers.count == 12 and s.cfg.buffer.max_bytes == 12 * GiB
    assert s.why == {"workers": "12 workers: workers.count in the config",
                     "max_bytes": "max_bytes 12.0 GiB: buffer.max_bytes in the config"}
    assert any(w.startswith("workers.count 12 exceeds the CPU quota of 4 cores") for w in s.warnings)
    assert any(w.startswith("buffer.max_bytes 12.0 GiB is over half the 16.0 GiB memory limit") for w in s.warnings)


def test_check_warns_of_max_bytes_over_half_the_machine_without_a_memory_cgroup():
    host = Host(affinity=2, memory_total=24 * GiB, fs_size=250 * GiB, fs_type="ext4", fs_mount="/")
    assert over_limits(host, 2, 8 * GiB) == []
    (w,) = over_limits(host, 2, 30 * GiB)
    assert w == ("buffer.max_bytes 30.0 GiB is over half the machine's 24.0 GiB memory: batches in the page cache "
                 "or on a tmpfs take it from the trainers; 'auto' takes 6.0 GiB")


def test_config_keys_refuse_bad_values_naming_the_key(tmp_path):
    with pytest.raises(C.ConfigError, match=r"^workers.priority must be one of idle, batch, nice, normal"):
        C.from_dict({"dataset": {"root": str(tmp_path)}, "workers": {"priority": "low"}})
    with pytest.raises(C.ConfigError, match=r"^buffer.max_bytes must be a size"):
        C.from_dict({"dataset": {"root": str(tmp_path)}, "buffer": {"max_bytes": "lots"}})


# --- the reader, over fake trees --------------------------------------------------------------------


def _fake(tmp_path, cgroup: str, mounts: list[tuple[str, str, str, str]], files: dict[str, str]) -> str:
    """A fake /proc (self/cgroup, self/mountinfo, meminfo) and cgroup files under tmp_path."""
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup)
    lines = [f"{30 + i} 1 0:{i} {root} {tmp_path}{point} rw - {fstype} {fstype} {opts}"
             for i, (root, point, fstype, opts) in enumerate(mounts)]
    (proc / "self" / "mountinfo").write_text("\n".join(lines) + "\n")
    (proc / "meminfo").write_text(f"MemTotal:       {16 * 1024 * 1024} kB\n")
    for rel, text in files.items():
        p = tmp_path / rel.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return str(proc)


def test_reader_cgroup_v2_takes_the_tightest_ancestor(tmp_path):
    proc = _fake(tmp_path, "0::/kubepods/pod1/ctr\n", [("/", "/cg", "cgroup2", "rw")], {
        "/cg/kubepods/cpu.max": "max 100000\n",
        "/cg/kubepods/pod1/cpu.max": "400000 100000\n",
        "/cg/kubepods/pod1/ctr/cpu.max": "max 100000\n",
        "/cg/kubepods/pod1/ctr/cpuset.cpus.effective": "0-7\n",
        "/cg/kubepods/pod1/memory.max": f"{4 * GiB}\n",
        "/cg/kubepods/pod1/ctr/memory.max": "max\n",
    })
    h = read_host(None, proc)
    assert h.cpu_quota.value == 4.0 and h.cpu_quota.source.endswith("/cg/kubepods/pod1/cpu.max")
    assert h.cpuset.value == 8 and h.memory_limit.value == 4 * GiB and h.memory_total == 16 * GiB
    assert auto_workers(h)[0] == min(4, h.affinity)


def test_reader_cgroup_v1_quota_and_memory(tmp_path):
    proc = _fake(tmp_path, "4:memory:/job/7\n3:cpuset:/\n1:cpu,cpuacct:/job/7\n0::/\n", [
        ("/", "/cg/cpu,cpuacct", "cgroup", "rw,cpu,cpuacct"),
        ("/", "/cg/memory", "cgroup", "rw,memory"),
        ("/", "/cg/cpuset", "cgroup", "rw,cpuset"),
    ], {
        "/cg/cpu,cpuacct/job/7/cpu.cfs_quota_us": "100000\n",
        "/cg/cpu,cpuacct/job/7/cpu.cfs_period_us": "100000\n",
        "/cg/cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
        "/cg/cpu,cpuacct/cpu.cfs_period_us": "100000\n",
        "/cg/memory/job/7/memory.limit_in_bytes": f"{2 * GiB}\n",
        "/cg/memory/memory.limit_in_bytes": "9223372036854771712\n",
        "/cg/cpuset/cpuset.cpus": "0-1\n",
    })
    h = read_host(str(tmp_path), proc)
    assert h.cpu_quota.value == 1.0 and "cgroup v1" in h.cpu_quota.source
    assert h.memory_limit.value == 2 * GiB and h.cpuset.value == 2
    assert auto_workers(h) == (1, f"1 worker: the CPU quota of 1 core ({h.cpu_quota.source})")


def test_reader_without_cgroups_is_the_affinity_mask(tmp_path):
    proc = _fake(tmp_path, "", [], {})
    h = read_host(None, proc)
    assert h.cpu_quota is None and h.memory_limit is None and h.affinity == len(os.sched_getaffinity(0))


# --- processes ---------------------------------------------------------------------------------------


def _status(buffer: str) -> dict | None:
    try:
        with open(os.path.join(buffer, "status.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _sched(pid: int) -> tuple[int, int]:
    """(policy, nice) of a process, from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[38]), int(fields[16])  # policy (field 41), nice (field 19)


@pytest.mark.parametrize("priority,policy,nice", [("batch", os.SCHED_BATCH, 19), ("idle", os.SCHED_IDLE, 0),
                                                   ("normal", os.SCHED_OTHER, 0)])
def test_workers_run_below_the_trainers_cpu_priority(tmp_path, image_root, daemon_factory, priority, policy, nice):
    cfg = small_config(tmp_path, image_root, workers={"count": 2, "priority": priority})
    d = daemon_factory(cfg)
    buf = str(tmp_path / "buffer")
    st = wait_until(lambda: (s := _status(buf)) and len(s.get("worker_pids", [])) == 2 and s, 60, "two workers")
    pids = st["worker_pids"]
    wait_until(lambda: "workers run at CPU priority" in d.log(), 30, "the priority logged")
    # each worker lowers itself as it starts (the second may still be starting)
    wait_until(lambda: all(_sched(pid) == (policy, nice) for pid in pids), 30, f"both workers at {priority}")
    assert _sched(d.pid) == (os.SCHED_OTHER, 0)  # the loop answers the trainers at their priority
    assert d.stop() == 0


def _v1_cpu_root() -> str | None:
    for line in open("/proc/self/mountinfo"):
        left, _, right = line.partition(" - ")
        r = right.split()
        if r and r[0] == "cgroup" and "cpu" in r[2].split(",") and left.split()[5].startswith("rw"):
            return left.split()[4]
    return None


def _v2_cpu_root() -> str | None:
    for line in open("/proc/self/mountinfo"):
        left, _, right = line.partition(" - ")
        if right.split()[:1] == ["cgroup2"]:
            point = left.split()[4]
            try:
                if "cpu" in open(os.path.join(point, "cgroup.controllers")).read().split():
                    return point
            except OSError:
                pass
    return None


def _quota_cgroup(version: str) -> str:
    root = _v1_cpu_root() if version == "v1" else _v2_cpu_root()
    if root is None or os.geteuid() != 0:
        pytest.skip(f"no writable cgroup {version} cpu controller here (needs root)")
    path = os.path.join(root, f"prefetchd-test-{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(path)
        if version == "v1":
            with open(os.path.join(path, "cpu.cfs_period_us"), "w") as f:
                f.write("100000")
            with open(os.path.join(path, "cpu.cfs_quota_us"), "w") as f:
                f.write("100000")
        else:
            with open(os.path.join(path, "cpu.max"), "w") as f:
                f.write("100000 100000")
    except OSError as e:
        pytest.skip(f"cannot make a cgroup {version} with a CPU quota here: {e}")
    return path


class _InCgroup(DaemonProc):
    """The daemon started inside a cgroup (it joins before exec, so it reads its own limits)."""

    def __init__(self, config: str, log_path: str, cgroup: str):
        self.config, self.log_path = config, log_path
        self._log = open(log_path, "ab")

        def join():
            with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))

        self.proc = subprocess.Popen([sys.executable, "-m", "prefetchd", "run", "--config", config],
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=join)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_auto_makes_one_worker_in_a_one_core_quota_and_says_so(tmp_path, image_root, version):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs to tell a quota of 1 from the affinity mask")
    cgroup = _quota_cgroup(version)
    cfg = small_config(tmp_path, image_root, workers={"count": "auto"})
    d = _InCgroup(cfg, str(tmp_path / "daemon.log"), cgroup)
    try:
        buf = str(tmp_path / "buffer")
        st = wait_until(lambda: (s := _status(buf)) and s.get("workers_alive") and s, 60, "the daemon's status")
        assert st["workers"] == 1, st["workers"]
        ours = [w for w in st["sizing"] if "worker" in w][0]
        assert ours.startswith("1 worker: the CPU quota of 1 core (cgroup "), ours
        assert cgroup in ours
        assert "sizing: 1 worker: the CPU quota of 1 core" in d.log()
        assert d.stop() == 0
    finally:
        d.kill_group()
        wait_until(lambda: rmdir_gone(cgroup), 10, "the test cgroup removed")


# --- what the daemon learns as it runs (daemon/autosize.py) -----------------------------------------


class _FakePlanner:
    def __init__(self, limits):
        self.limits = limits
        self.set = []

    def set_limits(self, limits):
        self.limits = limits
        self.set.append(limits)
        return [("evicted",)]


class _FakeDaemon:
    def __init__(self, tmp_path, **buffer):
        from types import SimpleNamespace

        from prefetchd.core.planner import Limits

        raw = C.from_dict({"dataset": {"root": str(tmp_path)}, "loader": {"batch_size": 8, "world_size": 2},
                           "augment": {"output_size": 64, "scale_min": 72, "scale_max": 120}, "buffer": buffer})
        self.sizing = resolve(raw, Host(affinity=2, memory_total=64 * GiB, fs_size=64 * GiB))
        self.cfg = self.sizing.cfg
        self.ranks = (0, 1)
        self.sampler = SimpleNamespace(batches_per_epoch=100)
        self.view_shapes = ((64, 64),)  # the daemon's (loop.py): one view of output_size
        B = self.cfg.buffer
        self.planner = _FakePlanner(Limits(B.capacity, B.refill_at, B.max_bytes, B.min_free_bytes, others=7))


def _rec(pos0, pos1, wait0, wait1, util=1.0):
    return {"worker_utilisation": util, "ranks": {"0": {"position": [0, pos0], "wait_s": wait0},
                                                   "1": {"position": [0, pos1], "wait_s": wait1}}}


def test_pacer_says_which_rank_is_data_bound_and_what_would_help(tmp_path, monkeypatch):
    from prefetchd.daemon import autosize

    clock = [1000.0]
    monkeypatch.setattr(autosize.time, "monotonic", lambda: clock[0])
    d = _FakeDaemon(tmp_path)
    p = autosize.Pacer(capacity_auto=False, refill_auto=True)
    assert p.observe(_rec(0, 0, 0.0, 0.0), d) == []
    clock[0] += 20
    rec = _rec(20, 20, 12.0, 1.0)
    assert p.observe(rec, d) == []  # capacity is a number: never changed
    r0, r1 = rec["ranks"]["0"], rec["ranks"]["1"]
    assert abs(r0["waited_share"] - 0.6) < 1e-9 and abs(r1["waited_share"] - 0.05) < 1e-9
    assert r0["would_help"].startswith("more cores for the workers") and "hybrid decode" in r0["would_help"]
    assert "would_help" not in r1
    from prefetchd.format.status import format_status

    text = format_status({**rec, "state": "running", "updated": 0}, None)
    assert "trainers waited, last minute: rank 0 60% (data-bound), rank 1 5%" in text
    assert "rank 0 is data-bound; would help: more cores" in text
    assert "busy only 30%" in autosize.advice(0.5, 0.3, "cpu", 224)


def test_capacity_auto_follows_the_measured_pace_within_max_bytes(tmp_path, monkeypatch):
    from prefetchd.daemon import autosize

    clock = [1000.0]
    monkeypatch.setattr(autosize.time, "monotonic", lambda: clock[0])
    d = _FakeDaemon(tmp_path, capacity="auto", lead_s=30)
    assert d.cfg.buffer.capacity == 64 and d.cfg.buffer.refill_at == 48  # before any pace is known
    p = autosize.Pacer(capacity_auto=True, refill_auto=True)
    p.observe(_rec(0, 0, 0, 0), d)
    clock[0] += 20
    assert p.observe(_rec(100, 80, 0, 0), d) == [("evicted",)]  # 5 batches/s at the fastest: 150
    assert d.cfg.buffer.capacity == 150 and d.cfg.buffer.refill_at == 112
    lim = d.planner.set[-1]
    assert (lim.capacity, lim.refill_at, lim.others) == (150, 112, 7)  # validation's share kept
    assert d.sizing.why["capacity"] == "capacity 150: 30 s at 5.00 batches/s"
    clock[0] += 5
    assert p.observe(_rec(125, 100, 0, 0), d) == []  # retuned at most every 10 s
    clock[0] += 10
    assert p.observe(_rec(175, 150, 0, 0), d) == []  # within a tenth: kept


def test_status_says_the_share_each_trainer_waited_and_capacity_auto_follows_its_pace(tmp_path, image_root,
                                                                                      daemon_factory):
    from prefetchd_client import PrefetchClient

    from prefetchd.format.status import format_status

    cfg = small_config(tmp_path, image_root, loader={"epochs": None},
                       buffer={"capacity": "auto", "refill_at": None, "lead_s": 1})
    d = daemon_factory(cfg)
    buf = str(tmp_path / "buffer")
    st = wait_until(lambda: (s := _status(buf)) and s.get("sizing") and s, 60, "the daemon's status")
    assert any(w.startswith("capacity 64: no consumption measured yet") for w in st["sizing"]), st["sizing"]
    with PrefetchClient(cfg, timeout=60, as_numpy=True) as c:
        e, deadline = 0, time.monotonic() + 90  # a deadline, not a count: the share needs 5 s of history
        while not (s := _status(buf)) or "waited_share" not in s["ranks"]["0"] or s["capacity"] == 64:
            for _ in c.iter_epoch(e):
                pass
            e += 1
            assert time.monotonic() < deadline, "no waited_share or capacity change in status.json"
    rs = s["ranks"]["0"]
    assert 0.0 <= rs["waited_share"] <= 1.0
    assert any(w.startswith(f"capacity {s['capacity']}: 1 s at ") for w in s["sizing"]), s["sizing"]
    assert "trainers waited, last minute: rank 0 " in format_status(s, True)
    assert "buffer: capacity" in d.log()
    assert d.stop() == 0
