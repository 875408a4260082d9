"""examples/slurm/train.sbatch under a real Slurm: Debian's slurm-wlm with munge, started by the
test in private namespaces, a 2-rank job that reads 2 epochs through the client and ends clean,
and a job that ``scancel`` stops leaving nothing behind.

The cluster is one node, ``node1``, inside ``unshare --pid --fork --mount-proc --mount --uts
--net --ipc``: its own network (loopback plus a veth pair, so that ``getaddrinfo`` finds an
address), a fresh tmpfs over ``/run`` (munge's key and socket, Slurm's config, state and spool)
and over ``/dev/shm`` (where the job's rings go), ``/etc/hosts`` naming ``node1`` (a bind mount
in the namespace), ``SLURM_CONF`` pointing at the generated config. munged, slurmctld and slurmd
run as root in it; the test drives it with ``nsenter -t PID -a``. At the end the namespace's
PID 1 is killed, which ends every process in it.

Where slurm-wlm or munge is missing, the test installs them with apt when run as root (apt-get
update first; ``policy-rc.d`` keeps the packages' services from starting on the host) and
otherwise skips, saying why.
"""

from __future__ import annotations

import ctypes
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap

import aptools
import pytest
from conftest import small_config, wait_until

ROOT = pathlib.Path(__file__).resolve().parent.parent
SBATCH = ROOT / "examples" / "slurm" / "train.sbatch"
BIN = os.path.dirname(sys.executable)  # prefetchd, torchrun and python of this environment
TOOLS = ("slurmctld", "slurmd", "sbatch", "srun", "scancel", "squeue", "munged")
BOOT_TIMEOUT_S = 60
_PR_SET_PDEATHSIG = 1

BOOT = r"""
set -eu
S=$1
mount --make-rprivate /
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
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
KillWait=30
SlurmctldLogFile=$S/slurmctld.log
SlurmdLogFile=$S/slurmd.log
NodeName=node1 NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=node1 Default=YES MaxTime=INFINITE State=UP
CONF
export SLURM_CONF=/run/slurm/slurm.conf
slurmctld -D -f $SLURM_CONF > $S/slurmctld.out 2>&1 &
slurmd -D -f $SLURM_CONF > $S/slurmd.out 2>&1 &
wait
"""

# Each rank reads through the client (its config from $PREFETCHD_CONFIG, its rank from torchrun);
# with "forever" it reads on, endlessly, noting that it is alive.
TRAINER = textwrap.dedent("""
    import json, os, sys, time
    from prefetchd_client import PrefetchClient
    out, forever = sys.argv[1], len(sys.argv) > 2
    seen = []
    with PrefetchClient(as_numpy=True, timeout=60) as loader:
        epoch = 0
        while forever or epoch < 2:
            for x, y in loader:
                seen.append([loader.rank, loader.last_batch.epoch, loader.last_batch.batch])
                if forever:
                    open(f"{out}/alive-{loader.rank}", "w").write(str(os.getpid()))
                    time.sleep(0.2)
            epoch += 1
    json.dump(seen, open(f"{out}/seen-{os.environ['RANK']}.json", "w"))
""")


def _set_pdeathsig() -> None:  # the namespace goes if pytest dies (unshare --kill-child does the rest)
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class Cluster:
    def __init__(self, logs: pathlib.Path):
        self.logs = logs
        self.proc = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "--mount", "--uts", "--net", "--ipc",
             "bash", "-c", BOOT, "boot", str(logs)],
            stdout=open(logs / "boot.out", "wb"), stderr=subprocess.STDOUT, preexec_fn=_set_pdeathsig)
        self.pid = wait_until(self._init_pid, 20, "the namespace's PID 1")

    def _init_pid(self) -> int | None:
        try:
            kids = pathlib.Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        except OSError:
            return None
        return int(kids[0]) if kids else None

    def run(self, *cmd: str, timeout: float = 60, check: bool = False) -> subprocess.CompletedProcess:
        env = {"PATH": f"{BIN}:/usr/sbin:/usr/bin:/sbin:/bin", "SLURM_CONF": "/run/slurm/slurm.conf",
               "HOME": os.environ.get("HOME", "/root"), "NPROC_PER_NODE": "2"}
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
    c = Cluster(logs)
    try:
        try:
            wait_until(lambda: c.proc.poll() is not None or c.idle(), BOOT_TIMEOUT_S,
                       "slurmd to register with slurmctld (logs in " + str(logs) + ")", 0.5)
        except AssertionError:
            c.proc.poll()
        if c.proc.returncode is not None:  # the boot script failed: a missing kernel feature is a skip
            said = (logs / "boot.out").read_text(errors="replace").strip().splitlines()[-1:] or ["(nothing)"]
            if any(w in said[0] for w in ("unshare:", "veth", "Operation not permitted", "RTNETLINK")):
                pytest.skip(f"cannot make the test's namespaces here: {said[0]}")
            raise AssertionError(f"the Slurm namespace did not boot: {said[0]} (logs in {logs})")
        assert c.idle(), f"slurmd did not register with slurmctld within {BOOT_TIMEOUT_S} s (logs in {logs})"
        yield c
    finally:
        c.stop()
    assert not [p for p in __import__("psutil").process_iter(["name"])
                if p.info["name"] in ("munged", "slurmctld", "slurmd", "slurmstepd")], "a Slurm process outlived its namespace"


def _job(cluster, tmp_path, image_root, epochs, *trainer_args):
    # the dataset's path relative to the template, as users write them: the node's copy is elsewhere
    template = small_config(tmp_path, os.path.relpath(image_root, tmp_path), loader={"epochs": epochs},
                            buffer={"dir": "/set/by/the/script"})
    trainer = tmp_path / "trainer.py"
    trainer.write_text(TRAINER)
    out = tmp_path / "out"
    out.mkdir()
    sbatch = ["sbatch", "--gpus-per-node=0", "--cpus-per-task=2", f"--output={tmp_path}/job-%j.out",
              f"--chdir={tmp_path}"]
    return sbatch, [str(SBATCH), template, str(trainer), str(out), *trainer_args], out


def _nothing_left(cluster) -> bool:
    return not cluster.run("squeue", "-h").stdout.strip() and not cluster.processes() and not cluster.shm()


def test_a_two_rank_job_reads_two_epochs_through_the_client_and_ends_clean(cluster, tmp_path, image_root):
    sbatch, args, out = _job(cluster, tmp_path, image_root, 2)
    r = cluster.run(*sbatch, "--wait", *args, timeout=300)
    logs = "\n".join(p.read_text() for p in tmp_path.glob("job-*.out"))
    assert r.returncode == 0, f"{r.stdout}{r.stderr}\n{logs}"
    for rank in (0, 1):  # 48 samples, world size 2, batches of 6: 4 batches per epoch per rank
        seen = json.loads((out / f"seen-{rank}.json").read_text())
        assert seen == [[rank, e, b] for e in range(2) for b in range(4)]
    assert "serving ranks [0, 1] of world size 2" in logs
    wait_until(lambda: _nothing_left(cluster), 30, "the job's processes and ring to be gone")


def test_scancel_stops_the_trainers_and_the_daemon_and_leaves_nothing(cluster, tmp_path, image_root):
    sbatch, args, out = _job(cluster, tmp_path, image_root, None, "forever")
    job = cluster.run(*sbatch, "--parsable", *args, check=True).stdout.strip().split(";")[0]
    wait_until(lambda: (out / "alive-0").exists() and (out / "alive-1").exists(), 180, "both ranks to read")
    running = cluster.processes()
    assert any("prefetchd run" in p for p in running) and any("trainer.py" in p for p in running), running
    assert cluster.shm() == [f"prefetchd-{job}"]
    cluster.run("scancel", job, check=True)
    wait_until(lambda: _nothing_left(cluster), 60, "scancel to stop the trainers and the daemon, leaving nothing")


def test_a_job_killed_outright_leaves_its_ring_only_until_the_next_job_starts(cluster, tmp_path, image_root):
    """SIGKILL to every process of the job, as slurmstepd sends when KillWait runs out (a trainer
    that outlasts it in a checkpoint write) or as the OOM killer would: nothing runs the script's
    clean-up and the ring stays in the node's RAM; the user's next job on the node removes it,
    Slurm no longer running the killed job. (``scancel --signal=KILL`` is a plain cancel, SIGTERM
    first: the job's processes are killed here as slurmstepd does.)"""
    sbatch, args, out = _job(cluster, tmp_path, image_root, None, "forever")
    job = cluster.run(*sbatch, "--parsable", *args, check=True).stdout.strip().split(";")[0]
    wait_until(lambda: (out / "alive-0").exists() and (out / "alive-1").exists(), 180, "both ranks to read")
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
