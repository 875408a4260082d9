"""examples/slurm/train.sbatch under a real Slurm: Debian's slurm-wlm with munge, started by the
test in private namespaces, with ``TaskPlugin=task/affinity,task/cgroup``: a 2-rank job of each
shape (one task per node running torchrun; one task per GPU, ``--ntasks-per-node=2``, where the
node's first task starts the daemon, the other uses it, and each client takes its rank from
``SLURM_PROCID``) reads 2 epochs through the client and ends clean, each rank on the CPUs the
binding gives it and the daemon on the node's; a job that ``scancel`` stops leaves nothing behind;
with task/cgroup, the job's processes (the daemon's too) are in its cpuset and memory cgroups,
limited to ``--mem``, and the ring's tmpfs pages are charged there.

The cluster is one node, ``node1`` (2 CPUs, RealMemory 8192 MB, ``CR_Core_Memory`` so ``--mem``
is the job's memory limit), inside ``unshare --pid --fork --mount-proc --mount --uts --net --ipc
--cgroup``: its own network (loopback plus a veth pair, so that ``getaddrinfo`` finds an
address), a fresh tmpfs over ``/run`` (munge's key and socket, Slurm's config, state and spool)
and over ``/dev/shm`` (where the job's rings go), ``/etc/hosts`` naming ``node1`` (a bind mount
in the namespace), ``SLURM_CONF`` pointing at the generated config. For task/cgroup the test makes
its own cgroup in cgroup v1's cpuset and memory hierarchies under its own, joins it before the
cgroup namespace is made, and mounts those hierarchies in the namespace: Slurm's
``/slurm_node1/...`` nests inside the test's cgroup, beside no other test's, and goes with it.
Where cgroup v1 is missing or refused (a cgroup v2-only machine: Debian 12's Slurm 22.05 is
driven with cgroup/v1 here), the cluster runs with task/affinity alone and only the cgroup test
skips, saying why. munged, slurmctld and slurmd run as root in it; the test drives it with
``nsenter -t PID -a``. At the end the namespace's PID 1 is killed, which ends every process in it,
and the test's cgroups are removed.

Where slurm-wlm or munge is missing, the test installs them with apt when run as root (apt-get
update first; ``policy-rc.d`` keeps the packages' services from starting on the host) and
otherwise skips, saying why.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import textwrap

import aptools
import psutil
import pytest
from conftest import small_config, wait_until

ROOT = pathlib.Path(__file__).resolve().parent.parent
SBATCH = ROOT / "examples" / "slurm" / "train.sbatch"
BIN = os.path.dirname(sys.executable)  # prefetchd, torchrun and python of this environment
TOOLS = ("slurmctld", "slurmd", "sbatch", "srun", "scancel", "squeue", "munged")
BOOT_TIMEOUT_S = 60
_PR_SET_PDEATHSIG = 1
JOB_MEM_MB = 4096  # the job's --mem: the node's RealMemory is 8192
CGROUP_CONTROLLERS = ("cpuset", "memory")  # task/cgroup's ConstrainCores, ConstrainRAMSpace

BOOT = r"""
set -eu
S=$1 TASKPLUGIN=$2 CGROUP=$3
mount --make-rprivate /
if [ "$CGROUP" = 1 ]; then
  # cgroup v1 hierarchies seen from this cgroup namespace: their root is the test's own cgroup
  # (made and joined before unshare), so Slurm's /slurm/... nests inside it and no other test's
  mount -t tmpfs -o mode=0755 cgroup /sys/fs/cgroup
  for c in cpuset memory; do mkdir /sys/fs/cgroup/$c; mount -t cgroup -o $c cgroup /sys/fs/cgroup/$c; done
fi
mount -t tmpfs -o mode=0755 prefetchd-slurm-run /run
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /dev/shm
ip link set lo up
# getaddrinfo(AI_ADDRCONFIG) wants an address besides loopback: a veth pair of our own
ip link add pfd0 type veth peer name pfd1
ip addr add 10.254.0.1/24 dev pfd0
ip link set pfd0 up
ip link set pfd1 up
hostname node1
echo "127.0.0.1 localhost node1" > /run/hosts
mount --bind /run/hosts /etc/hosts
mkdir -p /run/munge /run/slurm/state /run/slurm/spool
dd if=/dev/urandom of=/run/munge/munge.key bs=1024 count=1 status=none
chmod 0400 /run/munge/munge.key
munged --force --key-file=/run/munge/munge.key --socket=/run/munge/munge.socket.2 \
  --pid-file=/run/munge/munged.pid --log-file=$S/munged.log --seed-file=/run/munge/seed
cat > /run/slurm/slurm.conf <<CONF
ClusterName=prefetchd
SlurmctldHost=node1(127.0.0.1)
AuthType=auth/munge
AuthInfo=socket=/run/munge/munge.socket.2
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=/run/slurm/state
SlurmdSpoolDir=/run/slurm/spool
SlurmctldPidFile=/run/slurm/slurmctld.pid
SlurmdPidFile=/run/slurm/slurmd.pid
ProctrackType=proctrack/linuxproc
TaskPlugin=$TASKPLUGIN
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
KillWait=30
SlurmctldLogFile=$S/slurmctld.log
SlurmdLogFile=$S/slurmd.log
NodeName=node1 NodeAddr=127.0.0.1 CPUs=2 RealMemory=8192 State=UNKNOWN
PartitionName=debug Nodes=node1 Default=YES MaxTime=INFINITE State=UP
CONF
cat > /run/slurm/cgroup.conf <<CONF
CgroupPlugin=cgroup/v1
CgroupAutomount=no
ConstrainCores=yes
ConstrainRAMSpace=yes
CONF
export SLURM_CONF=/run/slurm/slurm.conf
slurmctld -D -f $SLURM_CONF > $S/slurmctld.out 2>&1 &
slurmd -D -f $SLURM_CONF > $S/slurmd.out 2>&1 &
wait
"""

# Each rank reads through the client (its config from $PREFETCHD_CONFIG, its rank from torchrun's
# RANK or Slurm's SLURM_PROCID) and notes its CPUs, its cgroups and its daemon's CPUs;
# with "forever" it reads on, endlessly, noting that it is alive.
TRAINER = textwrap.dedent("""
    import json, os, sys, time
    from prefetchd_client import PrefetchClient
    from prefetchd.format.status import lock_pid
    out, forever = sys.argv[1], len(sys.argv) > 2
    seen = []
    with PrefetchClient(as_numpy=True, timeout=60) as loader:
        daemon = lock_pid(loader.dir)
        json.dump({"cpus": sorted(os.sched_getaffinity(0)), "daemon": daemon,
                   "daemon_cpus": sorted(os.sched_getaffinity(daemon)), "cgroup": open("/proc/self/cgroup").read(),
                   "env": {k: os.environ.get(k) for k in ("RANK", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS")}},
                  open(f"{out}/info-{loader.rank}.json", "w"))
        epoch = 0
        while forever or epoch < 2:
            for x, y in loader:
                seen.append([loader.rank, loader.last_batch.epoch, loader.last_batch.batch])
                if forever:
                    open(f"{out}/alive-{loader.rank}", "w").write(str(os.getpid()))
                    time.sleep(0.2)
            epoch += 1
    json.dump(seen, open(f"{out}/seen-{loader.rank}.json", "w"))
""")


def _set_pdeathsig() -> None:  # the namespace goes if pytest dies (unshare --kill-child does the rest)
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _own_cgroups() -> tuple[dict[str, str], str | None]:
    """This test's own cgroup in each cgroup v1 controller that task/cgroup uses, made under this
    process's: ({controller: path}, None), or ({}, why not)."""
    made: dict[str, str] = {}
    name = f"prefetchd-slurm-{os.getpid()}"
    try:
        mine = dict(ln.rstrip("\n").split(":", 2)[1:] for ln in open("/proc/self/cgroup"))
        for c in CGROUP_CONTROLLERS:
            top = pathlib.Path("/sys/fs/cgroup", c)
            if c not in mine or not (top / "cgroup.procs").exists() or (top / "cgroup.controllers").exists():
                return _drop(made), (f"task/cgroup: no cgroup v1 {c} hierarchy at {top} here (Debian's Slurm 22.05 "
                                     "in the test drives cgroup v1)")
            path = top / mine[c].lstrip("/") / name
            path.mkdir()
            made[c] = str(path)
            if c == "cpuset":  # an empty cpuset takes no process: the parent's CPUs and memory nodes
                for f in ("cpuset.cpus", "cpuset.mems"):
                    (path / f).write_text((path.parent / f).read_text())
    except OSError as e:
        return _drop(made), f"task/cgroup: cannot make a cgroup here ({e})"
    return made, None


def _pid_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def _drop(cgroups: dict[str, str]) -> dict[str, str]:
    """Remove the test's cgroups, deepest first (Slurm's job and step cgroups inside them)."""
    for path in cgroups.values():
        for sub in sorted(pathlib.Path(path).rglob("*"), key=lambda p: -len(p.parts)):
            if sub.is_dir():
                with contextlib.suppress(OSError):
                    sub.rmdir()
        with contextlib.suppress(OSError):
            os.rmdir(path)
    return {}


class Cluster:
    def __init__(self, logs: pathlib.Path, cgroups: dict[str, str]):
        self.logs = logs
        self.cgroups = cgroups
        plugin = "task/affinity,task/cgroup" if cgroups else "task/affinity"

        def enter() -> None:  # into the test's cgroups, which become the cgroup namespace's root
            for path in cgroups.values():
                with open(os.path.join(path, "cgroup.procs"), "w") as f:
                    f.write(str(os.getpid()))
            _set_pdeathsig()

        self.proc = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "--mount", "--uts", "--net", "--ipc",
             *(["--cgroup"] if cgroups else []), "bash", "-c", BOOT, "boot", str(logs), plugin,
             "1" if cgroups else "0"],
            stdout=open(logs / "boot.out", "wb"), stderr=subprocess.STDOUT, preexec_fn=enter)
        self.pid = wait_until(self._init_pid, 20, "the namespace's PID 1")
        self.pid_ns = wait_until(lambda: (ns := _pid_ns(self.pid)) != _pid_ns(os.getpid()) and ns, 20,
                                 "the namespace's PID 1 to be in its namespace")

    def _init_pid(self) -> int | None:
        try:
            kids = pathlib.Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        except OSError:
            return None
        return int(kids[0]) if kids else None

    def run(self, *cmd: str, timeout: float = 60, check: bool = False) -> subprocess.CompletedProcess:
        # TMPDIR: the suite's own (conftest.py), where a job killed outright leaves its daemon's
        # forkserver socket and torchrun its logs, as on a node, instead of in /tmp
        env = {"PATH": f"{BIN}:/usr/sbin:/usr/bin:/sbin:/bin", "SLURM_CONF": "/run/slurm/slurm.conf",
               "HOME": os.environ.get("HOME", "/root"), "NPROC_PER_NODE": "2",
               "TMPDIR": os.environ.get("TMPDIR", "/tmp")}
        r = subprocess.run(["nsenter", "-t", str(self.pid), "-a", "env", "-i", *(f"{k}={v}" for k, v in env.items()),
                            *cmd], capture_output=True, text=True, timeout=timeout)
        if check and r.returncode:
            raise AssertionError(f"{' '.join(cmd)}: {r.returncode}\n{r.stdout}\n{r.stderr}")
        return r

    def idle(self) -> bool:
        return self.run("sinfo", "-h", "-o", "%T").stdout.strip() == "idle"

    def processes(self) -> list[str]:
        """What runs in the namespace besides the cluster itself."""
        out = self.run("ps", "-eo", "pid=,args=").stdout.splitlines()
        base = ("bash -c", "munged", "slurmctld", "slurmd", "slurmscriptd", "ps -eo", ": slurmscriptd")
        return [ln.strip() for ln in out if not ln.split(None, 1)[1].startswith(base)]

    def shm(self) -> list[str]:
        return self.run("ls", "-A", "/dev/shm").stdout.split()

    def stop(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)  # PID 1 of the namespace: the kernel ends every process in it
        except ProcessLookupError:
            pass
        self.proc.wait(30)
        if self.cgroups:  # empty once the kernel has ended the namespace's processes
            wait_until(lambda: not _drop(self.cgroups) and not any(os.path.exists(p) for p in self.cgroups.values()),
                       30, "the test's cgroups to be removed")

    def booted(self) -> bool:
        try:
            wait_until(lambda: self.proc.poll() is not None or self.idle(), BOOT_TIMEOUT_S,
                       "slurmd to register with slurmctld (logs in " + str(self.logs) + ")", 0.5)
        except AssertionError:
            self.proc.poll()
        return self.proc.returncode is None and self.idle()

    def last_words(self) -> str:
        """The last line of the boot script's output, else of slurmd's log."""
        for name in ("boot.out", "slurmd.log", "slurmd.out"):
            lines = (self.logs / name).read_text(errors="replace").strip().splitlines() if (
                self.logs / name).exists() else []
            if lines:
                return lines[-1]
        return "(nothing)"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("needs root: it starts munged, slurmctld and slurmd in private namespaces (and installs "
                    "slurm-wlm and munge with apt where missing)")
    for tool in ("unshare", "nsenter", "ip"):
        if not shutil.which(tool):
            pytest.skip(f"{tool} is missing (util-linux, iproute2)")
    aptools.ensure({t: "munge" if t == "munged" else "slurm-wlm" for t in TOOLS})
    logs = tmp_path_factory.mktemp("slurm")
    cgroups, why = _own_cgroups()
    c = Cluster(logs, cgroups)
    try:
        if not c.booted() and cgroups:  # task/cgroup refused here: the rest still runs with task/affinity
            why = f"task/cgroup: Slurm did not start with it here: {c.last_words()} (logs in {logs})"
            c.stop()
            logs = tmp_path_factory.mktemp("slurm")
            c = Cluster(logs, {})
            c.booted()
        c.cgroup_why = why
        if c.proc.returncode is not None:  # the boot script failed: a missing kernel feature is a skip
            said = (logs / "boot.out").read_text(errors="replace").strip().splitlines()[-1:] or ["(nothing)"]
            if any(w in said[0] for w in ("unshare:", "veth", "Operation not permitted", "RTNETLINK")):
                pytest.skip(f"cannot make the test's namespaces here: {said[0]}")
            raise AssertionError(f"the Slurm namespace did not boot: {said[0]} (logs in {logs})")
        assert c.idle(), f"slurmd did not register with slurmctld within {BOOT_TIMEOUT_S} s (logs in {logs})"
        yield c
    finally:
        c.stop()
    # this namespace's only: another test's Slurm may run beside it
    assert not [p for p in psutil.process_iter(["name"]) if p.info["name"] in ("munged", "slurmctld", "slurmd", "slurmstepd")
                and _pid_ns(p.pid) == c.pid_ns], "a Slurm process outlived its namespace"


def _job(cluster, tmp_path, image_root, epochs, *trainer_args, tasks_per_node=1):
    # the dataset's path relative to the template, as users write them: the node's copy is elsewhere
    template = small_config(tmp_path, os.path.relpath(image_root, tmp_path), loader={"epochs": epochs},
                            buffer={"dir": "/set/by/the/script"})
    trainer = tmp_path / "trainer.py"
    trainer.write_text(TRAINER)
    out = tmp_path / "out"
    out.mkdir()
    # one task per node: torchrun's 2 ranks share its 2 CPUs; one task per GPU: 2 tasks of 1 CPU each
    sbatch = ["sbatch", "--gpus-per-node=0", f"--ntasks-per-node={tasks_per_node}",
              f"--cpus-per-task={2 // tasks_per_node}", f"--mem={JOB_MEM_MB}M", f"--output={tmp_path}/job-%j.out",
              f"--chdir={tmp_path}"]
    return sbatch, [str(SBATCH), template, str(trainer), str(out), *trainer_args], out


def _nothing_left(cluster) -> bool:
    return not cluster.run("squeue", "-h").stdout.strip() and not cluster.processes() and not cluster.shm()


def test_scancel_stops_the_trainers_and_the_daemon_and_leaves_nothing(cluster, tmp_path, image_root):
    sbatch, args, out = _job(cluster, tmp_path, image_root, None, "forever")
    job = cluster.run(*sbatch, "--parsable", *args, check=True).stdout.strip().split(";")[0]
    wait_until(lambda: (out / "alive-0").exists() and (out / "alive-1").exists(), 180, "both ranks to read")
    running = cluster.processes()
    assert any("prefetchd run" in p for p in running) and any("trainer.py" in p for p in running), running
    assert cluster.shm() == [f"prefetchd-{job}"]
    cluster.run("scancel", job, check=True)
    wait_until(lambda: _nothing_left(cluster), 60, "scancel to stop the trainers and the daemon, leaving nothing")
    # each process saw the step's SIGTERM once: launch forwarded another to torchrun (its second
    # SignalException broke its shutdown), and the daemon's forkserver and workers died of theirs
    # ("ERROR ... the forkserver (pid N) was killed by SIGTERM; started a new one")
    logs = "\n".join(p.read_text() for p in tmp_path.glob("job-*.out"))
    assert logs.count("Received 15 death signal") == 1 and "another exception occurred" not in logs, logs
    assert " ERROR " not in logs, logs


def _read_two_epochs(cluster, tmp_path, image_root, tasks_per_node):
    sbatch, args, out = _job(cluster, tmp_path, image_root, 2, tasks_per_node=tasks_per_node)
    r = cluster.run(*sbatch, "--wait", *args, timeout=300)
    logs = "\n".join(p.read_text() for p in tmp_path.glob("job-*.out"))
    assert r.returncode == 0, f"{r.stdout}{r.stderr}\n{logs}"
    for rank in (0, 1):  # 48 samples, world size 2, batches of 6: 4 batches per epoch per rank
        seen = json.loads((out / f"seen-{rank}.json").read_text())
        assert seen == [[rank, e, b] for e in range(2) for b in range(4)]
    assert logs.count("serving ranks [0, 1] of world size 2") == 1, logs  # one daemon for the node
    wait_until(lambda: _nothing_left(cluster), 30, "the job's processes and ring to be gone")
    return [json.loads((out / f"info-{rank}.json").read_text()) for rank in (0, 1)], logs


def test_one_task_per_gpu_the_nodes_first_task_starts_the_daemon_the_other_uses_it(cluster, tmp_path, image_root):
    """srun --ntasks-per-node=2 python trainer.py: no torchrun, no RANK; each task bound to its CPU."""
    info, logs = _read_two_epochs(cluster, tmp_path, image_root, tasks_per_node=2)
    for rank, i in enumerate(info):
        assert i["env"] == {"RANK": None, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NTASKS": "2"}
    assert info[0]["daemon"] == info[1]["daemon"]
    assert "using the daemon already serving" in logs  # the second task's launch
    # task/affinity: each rank on its own CPU; the daemon (and its workers) on the node's two
    assert sorted(i["cpus"] for i in info) == [[0], [1]], info
    assert info[0]["daemon_cpus"] == [0, 1], info


def test_one_task_per_node_torchrun_shares_the_tasks_cpus_with_the_daemon(cluster, tmp_path, image_root):
    info, _ = _read_two_epochs(cluster, tmp_path, image_root, tasks_per_node=1)
    assert [i["env"]["RANK"] for i in info] == ["0", "1"]  # torchrun's, over the task's SLURM_PROCID 0
    assert info[0]["cpus"] == info[1]["cpus"] == info[0]["daemon_cpus"] == [0, 1], info


def test_task_cgroup_confines_the_job_and_charges_its_ring_to_it(cluster, tmp_path, image_root):
    """With task/cgroup the job's processes, the daemon included, are in the job's cpuset and
    memory cgroups (limited to --mem), and the ring's tmpfs pages are charged there."""
    if cluster.cgroup_why:
        pytest.skip(cluster.cgroup_why)
    sbatch, args, out = _job(cluster, tmp_path, image_root, None, "forever", tasks_per_node=2)
    job = cluster.run(*sbatch, "--parsable", *args, check=True).stdout.strip().split(";")[0]
    try:
        _the_job_and_its_ring_in_its_cgroups(cluster, job, out)
    finally:  # a failure above left the job running: every later job on the node waited behind it
        cluster.run("scancel", job, check=True)
    wait_until(lambda: _nothing_left(cluster), 60, "scancel to stop the trainers and the daemon, leaving nothing")


def _the_job_and_its_ring_in_its_cgroups(cluster, job: str, out: pathlib.Path) -> None:
    wait_until(lambda: (out / "alive-0").exists() and (out / "alive-1").exists(), 180, "both ranks to read")
    info = [json.loads((out / f"info-{rank}.json").read_text()) for rank in (0, 1)]
    ours = re.compile(rf"^/slurm[^/]*/uid_0/job_{job}/")  # /slurm_<node> where slurmd may run several per host
    for i in info:
        groups = dict(ln.split(":", 2)[1:] for ln in i["cgroup"].splitlines())
        for c in CGROUP_CONTROLLERS:
            assert ours.match(groups[c]), i["cgroup"]
    daemon = cluster.run("cat", f"/proc/{info[0]['daemon']}/cgroup", check=True).stdout
    assert ours.match(dict(ln.split(":", 2)[1:] for ln in daemon.splitlines())["memory"]), daemon
    (memory,) = pathlib.Path(cluster.cgroups["memory"]).glob(f"slurm*/uid_0/job_{job}")
    assert int((memory / "memory.limit_in_bytes").read_text()) == JOB_MEM_MB << 20

    def charged():  # (the job's shmem, the ring's bytes): tmpfs pages are charged to the job's cgroup
        ring = int(cluster.run("du", "-sb", f"/dev/shm/prefetchd-{job}", check=True).stdout.split()[0])
        stat = dict(ln.split() for ln in (memory / "memory.stat").read_text().splitlines())
        return int(stat["total_shmem"]), ring

    # memory.stat's counts are kept per CPU and summed in batches (the kernel flushes them every 2 s or past
    # a threshold): one read came 27 pages short of a ring the daemon had just written (442368 of 551161)
    seen = []
    try:
        wait_until(lambda: seen.append(charged()) or seen[-1][0] >= seen[-1][1] > 0, 20,
                   "the ring's pages charged to the job's memory cgroup", interval=0.2)
    except AssertionError as e:
        raise AssertionError(f"{e}; (shmem, ring) as last read: {seen[-3:]}") from None


def test_a_job_killed_outright_leaves_its_ring_only_until_the_next_job_starts(cluster, tmp_path, image_root):
    """SIGKILL to every process of the job, as slurmstepd sends when KillWait runs out (a trainer
    that outlasts it in a checkpoint write) or as the OOM killer would: nothing runs the script's
    clean-up and the ring stays in the node's RAM; the user's next job on the node removes it,
    Slurm no longer running the killed job. (``scancel --signal=KILL`` is a plain cancel, SIGTERM
    first: the job's processes are killed here as slurmstepd does.)"""
    sbatch, args, out = _job(cluster, tmp_path, image_root, None, "forever")
    job = cluster.run(*sbatch, "--parsable", *args, check=True).stdout.strip().split(";")[0]
    try:
        wait_until(lambda: (out / "alive-0").exists() and (out / "alive-1").exists(), 180, "both ranks to read")
    except AssertionError:  # not left running for every later job on the node to wait behind
        cluster.run("scancel", job)
        raise
    slurm = ("munged", "slurmctld", "slurmd", "slurmstepd", "slurmscriptd", ": slurmscriptd", "ps -eo")
    rows = [ln.split(None, 1) for ln in cluster.run("ps", "-eo", "pid=,args=").stdout.splitlines()]
    pids = [pid for pid, args in rows if pid != "1" and not args.startswith(slurm)]  # 1: the namespace's init
    assert any("prefetchd run" in args for _, args in rows), rows
    cluster.run("kill", "-KILL", *pids)
    wait_until(lambda: not cluster.run("squeue", "-h").stdout.strip() and not cluster.processes(), 60,
               "the killed job to end")
    assert cluster.shm() == [f"prefetchd-{job}"]  # what a hard kill leaves
    following = tmp_path / "next"
    following.mkdir()
    sbatch, args, _ = _job(cluster, following, image_root, 2)
    r = cluster.run(*sbatch, "--wait", *args, timeout=300)
    logs = "\n".join(p.read_text() for p in following.glob("job-*.out"))
    assert r.returncode == 0, f"{r.stdout}{r.stderr}\n{logs}"
    wait_until(lambda: _nothing_left(cluster), 30, "the killed job's ring and the new job's to be gone")
