"""The service under a real systemd: PID 1 in private namespaces, docs/systemd.md's steps, a trainer
of another user.

Isolation comes first. systemd's boot empties ``/tmp`` (``systemd-tmpfiles --remove``) and
starts whatever is enabled, so before exec'ing it, inside a new mount namespace (``unshare
--pid --fork --mount-proc --mount --uts --ipc --cgroup``) the boot script makes every mount
private, puts overlays (their upper layers on a private tmpfs) over ``/etc``, ``/usr/local``,
``/srv``, ``/home``, ``/var``, ``/opt`` and ``/root``, fresh tmpfs over ``/tmp``, ``/var/tmp``,
``/run``, ``/var/log`` and ``/dev/shm``, read-only ``/sys`` and ``/proc/sys``, a cgroup2 of
its own (a child of this process's cgroup, seen through a cgroup namespace), masks the units
that touch the kernel (sysctl, modules, udev, clock, binfmt, remount) and boots to
``basic.target`` only: no host service (PostgreSQL here) starts. It is driven with ``nsenter
-t PID -a``. At the end, whatever happens (fixture finalizer and ``atexit``), PID 1 is killed,
its cgroup removed, and the test checks that no process, cgroup or mount is left and that an
old file in the host's ``/tmp`` is still there.

Skipped, with the reason, only where systemd cannot boot (not root, no systemd, no cgroup2).
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml
from conftest import wait_until

from prefetchd.tools.samples import make_image_folder

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEMD = "/lib/systemd/systemd"
SHARE = "/srv/prefetchd-test"  # the host's share directory, read-only inside
BOOT_TIMEOUT_S = 60
TRAINER = "alice"
_PR_SET_PDEATHSIG = 1

# The namespace's config: config.example.yaml with these keys set (README step 3), small and fast.
SETTINGS = {
    "dataset": {"root": "/srv/imagenet"},
    "loader": {"batch_size": 6, "seed": 7, "epochs": None},
    "workers": {"count": 2},
    "buffer": {"dir": "/run/prefetchd/buffer", "group": "prefetchd", "capacity": 4, "max_bytes": "64MiB",
               "min_free_bytes": "1MiB"},
    "progress": {"poll_interval_s": 0.05},
    "augment": {"output_size": 64, "scale_min": 72, "scale_max": 120},
}

# Units that would touch the host's kernel, devices or clock: masked in the overlaid /etc.
MASKED = ["systemd-remount-fs.service", "systemd-modules-load.service", "systemd-sysctl.service",
          "systemd-binfmt.service", "systemd-udevd.service", "systemd-udev-trigger.service",
          "systemd-hwdb-update.service", "systemd-timesyncd.service", "systemd-pstore.service",
          "systemd-firstboot.service", "systemd-random-seed.service", "systemd-repart.service",
          "proc-sys-fs-binfmt_misc.automount", "systemd-journald-audit.socket"]

BOOT_SCRIPT = r"""
set -eu
mount --make-rprivate /
# the overlays' upper layers live on a private tmpfs, later hidden by the fresh /run
mount -t tmpfs -o mode=0700 prefetchd-test-state /run
for d in /etc /usr/local /srv /home /var /opt /root; do
  n=$(echo "$d" | tr / _)
  mkdir -p /run/up/$n /run/work/$n
  mount -t overlay overlay -o lowerdir=$d,upperdir=/run/up/$n,workdir=/run/work/$n $d
done
mkdir -p {share}
mount --bind "$SHARE_SRC" {share}
mount -o remount,bind,ro {share}
for d in /tmp /var/tmp /run /var/log /dev/shm; do mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs $d; done
chmod 0755 /run /var/log
mount --bind /sys /sys
mount -o remount,bind,ro /sys
mount -t cgroup2 cgroup2 /sys/fs/cgroup
mount --bind /proc/sys /proc/sys
mount -o remount,bind,ro /proc/sys
: > /etc/fstab
rm -f /etc/systemd/system/*.wants/*
for u in {masked}; do ln -sf /dev/null /etc/systemd/system/$u; done
ln -sf /lib/systemd/system/basic.target /etc/systemd/system/default.target
echo prefetchd-test > /etc/hostname
hostname prefetchd-test
exec env -i container=prefetchd-test {systemd} --unit=basic.target
"""


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root (it boots systemd in namespaces)"
    for tool in ("unshare", "nsenter", "runuser"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if not os.access(SYSTEMD, os.X_OK):
        return f"{SYSTEMD} is not installed"
    if _cgroup2_mount() is None:
        return "no cgroup2 hierarchy is mounted (systemd needs one)"
    for d in ("/etc", "/usr/local", "/srv", "/home", "/var", "/opt", "/root"):
        if not os.path.isdir(d):
            return f"{d} does not exist (the test overlays it)"
    r = subprocess.run(["/usr/bin/python3", "-c", "import venv, ensurepip"], capture_output=True)
    if r.returncode != 0:
        return "/usr/bin/python3 has no venv/ensurepip (apt-get install python3-venv)"
    return None


def _cgroup2_mount() -> str | None:
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            if right.split()[:1] == ["cgroup2"]:
                return left.split()[4]
    return None


def _own_cgroup2() -> str:
    with open("/proc/self/cgroup") as f:
        for line in f:
            if line.startswith("0::"):
                return line[3:].strip()
    return "/"


def _mounts() -> set[str]:
    with open("/proc/self/mountinfo") as f:
        return {" ".join(line.split()[3:5]) for line in f}


def _rmdir_tree(cgroup: str) -> None:
    """Remove an empty cgroup and its children (rmdir only: cgroup files cannot be unlinked)."""
    for root, dirs, _ in os.walk(cgroup, topdown=False):
        for d in dirs:
            try:
                os.rmdir(os.path.join(root, d))
            except OSError:
                pass
    os.rmdir(cgroup)


class Machine:
    """systemd as PID 1 in its own namespaces; ``run`` executes a command inside."""

    def __init__(self, share: str):
        self.share = share
        self.cgroup = os.path.join(_cgroup2_mount(), _own_cgroup2().lstrip("/"), f"prefetchd-test-{os.getpid()}")
        self.mounts_before = _mounts()
        self.proc: subprocess.Popen | None = None
        self.pid = 0
        self.pidns = ""
        self.log_path = os.path.join(share, "..", "boot.log")
        self._done = False

    def boot(self) -> None:
        self._remove_stale_cgroups()
        os.mkdir(self.cgroup)
        script = BOOT_SCRIPT.format(share=SHARE, masked=" ".join(MASKED), systemd=SYSTEMD)
        cg = self.cgroup

        def enter_cgroup():
            with open(os.path.join(cg, "cgroup.procs"), "w") as f:
                f.write("0")
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)

        log = open(self.log_path, "wb")
        # --kill-child and the parent-death signal: PID 1 dies with pytest even if pytest is killed
        self.proc = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "--mount", "--uts", "--ipc", "--cgroup",
             "/bin/sh", "-c", script], env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "SHARE_SRC": self.share},
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=enter_cgroup,
            start_new_session=True)
        log.close()
        atexit.register(self.teardown)
        self.pid = wait_until(self._child, 20, "the namespace's PID 1")
        self.pidns = os.readlink(f"/proc/{self.pid}/ns/pid")
        state = ""
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            r = self.run("systemctl is-system-running", check=False, timeout=10)
            state = r.stdout.strip()
            if state in ("running", "degraded"):
                return
            time.sleep(0.2)
        failed = self.run("systemctl --failed --no-legend --plain", check=False, timeout=10).stdout if self.proc.poll() is None else ""
        raise RuntimeError(f"systemd did not boot (state {state!r}); failed units: {failed.strip()}; log: {self.boot_log()}")

    def _remove_stale_cgroups(self) -> None:
        """An earlier run killed outright (its PID 1 died with it) leaves an empty cgroup: remove it."""
        parent = os.path.dirname(self.cgroup)
        for name in os.listdir(parent):
            m = re.fullmatch(r"prefetchd-test-(\d+)", name)
            if m and not os.path.exists(f"/proc/{m.group(1)}"):
                _rmdir_tree(os.path.join(parent, name))

    def _child(self) -> int | None:
        try:
            kids = open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read().split()
        except OSError:
            return None
        if not kids:
            return None
        try:
            comm = open(f"/proc/{kids[0]}/comm").read().strip()
        except OSError:
            return None
        return int(kids[0]) if comm == "systemd" else None

    def boot_log(self) -> str:
        try:
            return open(self.log_path, errors="replace").read()[-2000:]
        except OSError:
            return ""

    def env(self) -> dict[str, str]:
        keep = {k: v for k, v in os.environ.items() if k.startswith("PIP_") or k.lower() in
                ("http_proxy", "https_proxy", "no_proxy")}
        return {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root",
                "LANG": "C.UTF-8", **keep}

    def argv(self, cmd: str, user: str | None = None, cwd: str = "/") -> list[str]:
        cmd = f"cd {cwd} && {cmd}"  # (nsenter --wd resolves the directory outside the namespace)
        inner = ["runuser", "-u", user, "--", "/bin/sh", "-c", cmd] if user else ["/bin/sh", "-c", cmd]
        return ["nsenter", "-t", str(self.pid), "-a", *inner]

    def run(self, cmd: str, user: str | None = None, cwd: str = "/", check: bool = True, timeout: float = 120,
            input: str | None = None) -> subprocess.CompletedProcess:
        r = subprocess.run(self.argv(cmd, user, cwd), capture_output=True, text=True, timeout=timeout,
                           env=self.env(), input=input)
        if check and r.returncode != 0:
            log = ""
            if "systemctl" in cmd:  # what the service said
                log = subprocess.run(self.argv("journalctl -n 25 --no-pager -u 'prefetchd*'"), capture_output=True,
                                     text=True, timeout=30, env=self.env()).stdout
            raise AssertionError(f"`{cmd}` exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}\n{log}")
        return r

    def popen(self, cmd: str, user: str | None = None, cwd: str = "/") -> subprocess.Popen:
        return subprocess.Popen(self.argv(cmd, user, cwd), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=self.env())

    def teardown(self) -> None:
        if self._done:
            return
        self._done = True
        if self.pid:
            try:
                os.kill(self.pid, signal.SIGKILL)  # the namespace's PID 1: every process in it dies
            except ProcessLookupError:
                pass
        if self.proc is not None:
            try:
                self.proc.wait(10)  # unshare reaps PID 1 and exits
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        kill = os.path.join(self.cgroup, "cgroup.kill")
        if os.path.exists(kill):
            with open(kill, "w") as f:
                f.write("1")
        deadline = time.monotonic() + 20
        while os.path.isdir(self.cgroup):
            try:
                _rmdir_tree(self.cgroup)
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def leftovers(self) -> list[str]:
        """What the namespace left on the host: must be nothing."""
        out = []
        if os.path.exists(self.cgroup):
            out.append(f"cgroup {self.cgroup}")
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    ns = os.readlink(f"/proc/{pid}/ns/pid")
                except OSError:
                    continue
                if ns == self.pidns:
                    out.append(f"process {pid}")
        new = _mounts() - self.mounts_before
        out += [f"mount {m}" for m in new]
        return out


# --- the machine and docs/systemd.md's deployment, once per module --------------------------------------


def _wheel(dest: str) -> str:
    """A wheel of this worktree (without build isolation where setuptools is at hand: no download)."""
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", dest, REPO]
    if subprocess.run([*cmd, "--no-build-isolation"], capture_output=True, timeout=300).returncode != 0:
        subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    return next(os.path.join(dest, n) for n in os.listdir(dest) if n.endswith(".whl"))


def _readme_section() -> str:
    return open(os.path.join(REPO, "docs", "systemd.md")).read()  # the service's steps, moved from the README


def readme_command(prefix: str) -> str:
    """docs/systemd.md's inline command that starts with ``prefix``, verbatim."""
    spans = re.findall(r"`([^`\n]+)`", _readme_section())
    found = [s for s in spans if s.startswith(prefix)]
    assert found, f"docs/systemd.md has no command starting {prefix!r}"
    return found[0]


def readme_block(after: str) -> str:
    sec = _readme_section()
    return re.search(r"```sh\n(.*?)```", sec[sec.index(after):], re.S).group(1)


@pytest.fixture(scope="module")
def machine(tmp_path_factory):
    why = _why_not()
    if why:
        print(f"test_systemd skipped: {why}")
        pytest.skip(why)
    top = tmp_path_factory.mktemp("systemd")
    share = top / "share"
    share.mkdir()
    # an old file in the host's /tmp: systemd-tmpfiles would delete it if it saw the host's /tmp
    sentinel = f"/tmp/prefetchd-test-sentinel-{os.getpid()}"
    open(sentinel, "w").close()
    os.utime(sentinel, (time.time() - 90 * 86400,) * 2)
    _wheel(str(share))
    shutil.copytree(os.path.join(REPO, "systemd"), share / "src" / "systemd")
    for f in ("config.example.yaml", "README.md"):
        shutil.copy(os.path.join(REPO, f), share / "src" / f)
    make_image_folder(str(share / "imagenet"), classes=4, per_class=12, seed=3, long_side=160)
    shutil.copy(os.path.join(os.path.dirname(__file__), "systemd_trainer.py"), share / "trainer.py")
    for root, dirs, files in os.walk(top):
        for n in dirs + files:
            os.chmod(os.path.join(root, n), 0o755 if n in dirs else 0o644)
    os.chmod(top, 0o755)
    os.chmod(share, 0o755)
    m = Machine(str(share))
    try:
        m.boot()
    except RuntimeError as e:
        m.teardown()
        os.unlink(sentinel)
        print(f"test_systemd skipped: {e}")
        pytest.skip(str(e))
    yield m
    try:  # the whole journal, for whoever reads a failure: <pytest tmp>/systemd*/journal.txt
        (top / "journal.txt").write_text(m.run("journalctl --no-pager -o short-monotonic", timeout=60).stdout)
    except Exception as e:  # noqa: BLE001 - the teardown below must run
        print(f"could not save the journal: {e}")
    m.teardown()
    try:
        wait_until(lambda: not m.leftovers(), 10, "nothing left of the namespace")
    except AssertionError:
        pass
    left = m.leftovers()
    kept = os.path.exists(sentinel)
    if kept:
        os.unlink(sentinel)
    assert not left, f"the namespace left {left}"
    assert kept, "the host's /tmp lost a file during the test"


@pytest.fixture(scope="module")
def deployed(machine):
    """docs/systemd.md, steps 1 to 6, verbatim where the page gives a command."""
    m = machine
    wheel = next(n for n in os.listdir(m.share) if n.endswith(".whl"))
    m.run(readme_command("useradd --system"))
    m.run(f"useradd --create-home {TRAINER} && useradd --create-home outsider")
    m.run(readme_command("usermod -aG prefetchd alice").replace("alice", TRAINER))
    m.run("cp -r /srv/prefetchd-test/imagenet /srv/imagenet")  # world-readable: the README's other way
    m.run(readme_command("/usr/bin/python3 -m venv").replace("/path/to/prefetchd", f"{SHARE}/{wheel}"),
          timeout=600)
    m.run(readme_command("ln -s /opt/prefetchd/bin/prefetchd"))
    m.run(readme_command("install -d /etc/prefetchd"), cwd=f"{SHARE}/src")
    configure(m, "/etc/prefetchd/prefetchd.yaml", {}, fresh=True)
    m.run(readme_command("cp systemd/run-prefetchd.mount"), cwd=f"{SHARE}/src")
    m.run("sed -i 's/size=10G/size=256M/' /etc/systemd/system/run-prefetchd.mount")  # "adjust size="
    m.run(readme_command("systemctl daemon-reload && systemctl enable --now run-prefetchd.mount"))
    m.run(readme_command("cp systemd/prefetchd.service"), cwd=f"{SHARE}/src")
    # the test's only change to the unit: a short watchdog, so the SIGSTOP test is quick
    m.run("mkdir -p /etc/systemd/system/prefetchd.service.d && printf '[Service]\\nWatchdogSec=5\\n"
          "TimeoutAbortSec=5\\n' > /etc/systemd/system/prefetchd.service.d/test-watchdog.conf")
    m.run(readme_command("systemctl daemon-reload && systemctl enable --now prefetchd"), timeout=120)
    return m


def configure(m: Machine, path: str, changes: dict, fresh: bool = False) -> dict:
    """Set keys of the config at ``path`` as an admin would: ``fresh`` (a copy of
    config.example.yaml) gets the test's SETTINGS first."""
    cfg = yaml.safe_load(m.run(f"cat {path}").stdout)
    for layer in ([SETTINGS] if fresh else []) + [changes]:
        for sec, body in layer.items():
            cfg.setdefault(sec, {}).update(body)
    m.run(f"cat > {path} && chmod 0644 {path}", input=yaml.safe_dump(cfg))
    return cfg


# --- references: every batch made in-process on the host from the same config and images ----------


_REFS: dict = {}


def reference(machine: Machine, config: dict, epochs: int) -> dict[tuple[int, int], str]:
    from test_daemon import reference_batches

    key = json.dumps(config, sort_keys=True, default=str) + str(epochs)
    if key not in _REFS:
        host = json.loads(json.dumps(config))
        tmp = os.path.join(machine.share, "..", f"ref-{len(_REFS)}")
        os.makedirs(tmp, exist_ok=True)
        host["dataset"]["root"] = os.path.join(machine.share, "imagenet")
        host["dataset"]["cache_dir"] = os.path.join(tmp, "cache")
        host["buffer"]["dir"] = os.path.join(tmp, "buffer")
        host["buffer"]["group"] = None
        host.get("metrics", {})["enabled"] = False
        path = os.path.join(tmp, "cfg.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(host, f)
        ref, _ = reference_batches(path, epochs)
        _REFS[key] = {(e, b): hashlib.sha256(np.ascontiguousarray(v[0]).tobytes()
                                             + np.asarray(v[1], np.int64).tobytes()).hexdigest()
                      for (r, e, b), v in ref.items() if r == 0}
    return _REFS[key]


def trainer(m: Machine, config: str, epochs: int, user: str = TRAINER, pause_after: int | None = None,
            go: str | None = None) -> subprocess.Popen:
    cmd = f"/opt/prefetchd/bin/python {SHARE}/trainer.py {config} {epochs}"
    if pause_after is not None:
        cmd += f" {pause_after} {go}"
    return m.popen(cmd, user=user, cwd="/tmp")


def finish(p: subprocess.Popen, timeout: float = 240) -> tuple[dict[tuple[int, int], str], list[tuple[int, int]]]:
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, f"trainer exited {p.returncode}: {err[-3000:]}"
    got, order = {}, []
    for line in out.splitlines():
        if line.startswith("batch "):
            _, e, b, h = line.split()
            got[(int(e), int(b))] = h
            order.append((int(e), int(b)))
    return got, order


def journal(m: Machine, unit: str = "prefetchd", since: str | None = None) -> list[dict]:
    cmd = f"journalctl -u {unit} -o json --no-pager" + (f" --cursor '{since}'" if since else "")
    return [json.loads(line) for line in m.run(cmd).stdout.splitlines() if line.strip()]


def cursor(m: Machine) -> str:
    entries = journal(m)
    return entries[-1]["__CURSOR"] if entries else ""


def show(m: Machine, prop: str, unit: str = "prefetchd") -> str:
    return m.run(f"systemctl show -P {prop} {unit}").stdout.strip()


# --- the tests, in the order an admin meets them ------------------------------------------------------


def test_readme_steps_give_a_running_service_with_the_documented_modes(deployed):
    m = deployed
    assert show(m, "ActiveState") == "active" and show(m, "SubState") == "running"
    wait_until(lambda: show(m, "StatusText"), 30, "a STATUS= line")
    mount = m.run("findmnt -n -o FSTYPE,OPTIONS /run/prefetchd").stdout.split()
    assert mount[0] == "tmpfs" and "huge=within_size" in mount[1] and "mode=755" in mount[1], mount
    ls = m.run("stat -c '%n %U:%G %a' /run/prefetchd /run/prefetchd/buffer /run/prefetchd/buffer/progress "
               "/run/prefetchd/buffer/meta.json").stdout.splitlines()
    assert ls == ["/run/prefetchd root:root 755", "/run/prefetchd/buffer prefetchd:prefetchd 750",
                  "/run/prefetchd/buffer/progress prefetchd:prefetchd 770",
                  "/run/prefetchd/buffer/meta.json prefetchd:prefetchd 640"], ls
    r = m.run(readme_command("runuser -u prefetchd -- prefetchd check").replace("alice", TRAINER))
    assert "deployment (daemon user prefetchd, trainer(s) alice): no problems" in r.stdout, r.stdout
    r = m.run("prefetchd check --config /etc/prefetchd/prefetchd.yaml --user prefetchd --trainer outsider", check=False)
    assert r.returncode == 1 and "problem: trainer outsider is not in buffer.group prefetchd" in r.stdout, r.stdout


def test_workers_run_below_the_trainers_under_the_unit(deployed):
    # the unit's seccomp filter lets a worker lower (never raise) its own priority; the unit's
    # CPUWeight= puts its cgroup below the trainers' (issue 30)
    m = deployed
    wait_until(lambda: any("workers run at CPU priority: SCHED_IDLE" in e.get("MESSAGE", "")
                           for e in journal(m)), 30, "the workers' priority in the journal")
    assert show(m, "CPUWeight") == "10" and show(m, "Nice") == "0"


def test_a_trainer_of_another_user_reads_three_epochs_bit_identical(deployed):
    m = deployed
    cfg = yaml.safe_load(m.run("cat /etc/prefetchd/prefetchd.yaml").stdout)
    got, order = finish(trainer(m, "/etc/prefetchd/prefetchd.yaml", 3))
    ref = reference(m, cfg, 3)
    assert len(order) == len(set(order)) == len(ref) == 24
    assert got == ref
    st = m.run("stat -c '%U:%G %a' /run/prefetchd/buffer/progress/progress-r0000.json").stdout.strip()
    assert st == "alice:alice 644"
    # the daemon (prefetchd, no capability) read alice's progress: it reports her position
    def position():  # status.json is rewritten about once a second
        status = json.loads(m.run("prefetchd status --json --config /etc/prefetchd/prefetchd.yaml",
                                  user=TRAINER).stdout)
        return status["status"]["ranks"]["0"]["position"] == [3, 0]

    wait_until(position, 15, "the daemon to report alice's position, epoch 3 batch 0")
    # nobody outside the group reads or writes anything
    r = m.run("ls /run/prefetchd/buffer; touch /run/prefetchd/buffer/progress/x", user="outsider", check=False)
    assert r.returncode != 0 and r.stderr.count("Permission denied") == 2, r.stderr


def test_reload_applies_a_tunable(deployed):
    m = deployed
    pid = show(m, "MainPID")
    mark = cursor(m)
    configure(m, "/etc/prefetchd/prefetchd.yaml", {"buffer": {"capacity": 6, "refill_at": 5}})
    m.run("systemctl reload prefetchd")
    wait_until(lambda: any("reloaded:" in e.get("MESSAGE", "") and "capacity 6" in e["MESSAGE"]
                           for e in journal(m, since=mark)), 30, "the reload line")
    status = lambda: json.loads(m.run("cat /run/prefetchd/buffer/status.json").stdout)  # noqa: E731
    wait_until(lambda: status()["capacity"] == 6, 10, "capacity 6 in status.json")
    assert show(m, "MainPID") == pid and show(m, "ActiveState") == "active"


def test_watchdog_restarts_a_stopped_daemon_and_the_trainer_loses_nothing(deployed):
    m = deployed
    cfg = yaml.safe_load(m.run("cat /etc/prefetchd/prefetchd.yaml").stdout)
    m.run("rm -f /tmp/go /tmp/paused")
    p = trainer(m, "/etc/prefetchd/prefetchd.yaml", 3, pause_after=5, go="/tmp/go")
    wait_until(lambda: m.run("test -e /tmp/paused", check=False).returncode == 0, 60, "the trainer's pause")
    old = show(m, "MainPID")
    restarts = int(show(m, "NRestarts"))
    m.run(f"kill -STOP {old}")
    m.run("touch /tmp/go")  # the trainer reads the ready batches, then waits for the stopped daemon
    wait_until(lambda: show(m, "MainPID") not in ("0", old) and show(m, "ActiveState") == "active", 90,
               "a watchdog restart")
    assert int(show(m, "NRestarts")) == restarts + 1
    got, order = finish(p)
    assert len(order) == len(set(order)) == 24, order  # no batch lost or repeated
    assert got == reference(m, cfg, 3)
    messages = [e.get("MESSAGE", "") for e in journal(m)]
    assert any("Watchdog timeout" in msg for msg in messages), messages[-20:]


def test_journal_lines_carry_priorities(deployed):
    m = deployed
    mark = cursor(m)
    # a stream change is refused with an error line (priority 3); the tunable reload was info (6)
    configure(m, "/etc/prefetchd/prefetchd.yaml", {"loader": {"seed": 8}})
    m.run("systemctl reload prefetchd")
    wait_until(lambda: any("reload refused" in e.get("MESSAGE", "") for e in journal(m, since=mark)), 30,
               "the refused reload")
    configure(m, "/etc/prefetchd/prefetchd.yaml", {"loader": {"seed": 7}})
    ours = [e for e in journal(m) if e.get("SYSLOG_IDENTIFIER") == "prefetchd" and isinstance(e.get("MESSAGE"), str)]
    by_prio = {}
    for e in ours:
        by_prio.setdefault(e["PRIORITY"], []).append(e["MESSAGE"])
    assert any(msg.startswith("prefetchd: serving ranks") for msg in by_prio.get("6", [])), by_prio
    assert any("reload refused" in msg for msg in by_prio.get("3", [])), by_prio
    # the journal has the time: no timestamp or "<6>" left in the text
    assert not [msg for msg in (e["MESSAGE"] for e in ours) if re.match(r"<\d>|\d\d:\d\d:\d\d", msg)]


def test_a_fifo_at_a_progress_name_neither_hangs_nor_stops_the_service(deployed):
    """A trainer of the group makes a FIFO at a progress file's name, as any member could: the
    service stays active (no watchdog restart), restarts through it, and serves another trainer."""
    m = deployed
    cfg = yaml.safe_load(m.run("cat /etc/prefetchd/prefetchd.yaml").stdout)
    m.run("useradd --create-home bob && usermod -aG prefetchd bob")
    name = "/run/prefetchd/buffer/progress/progress-r0000.json"
    pid, restarts = show(m, "MainPID"), int(show(m, "NRestarts"))
    mark = cursor(m)
    t_fifo = time.time()
    # made beside it and renamed over it: the name is never missing (a deletion would be the
    # bad spell's one warning)
    m.run(f"mkfifo -m 0644 {name}.fifo && mv -f {name}.fifo {name}", user=TRAINER)

    def warned():
        return [e["MESSAGE"] for e in journal(m, since=mark) if f"ignoring {name}" in str(e.get("MESSAGE", ""))]

    assert "it is a FIFO, not a regular file" in wait_until(warned, 30, "the warning")[0]
    status = lambda: json.loads(m.run("cat /run/prefetchd/buffer/status.json").stdout)  # noqa: E731
    # still rewritten after the watchdog (WatchdogSec=5 here) would have restarted a stuck loop
    wait_until(lambda: status()["updated"] > t_fifo + 7, 30, "status.json rewritten 7 s after the FIFO")
    assert show(m, "MainPID") == pid and show(m, "ActiveState") == "active"
    assert int(show(m, "NRestarts")) == restarts
    # at start-up too: the restart gets READY=1 (Type=notify) with the FIFO still there
    m.run("systemctl restart prefetchd", timeout=120)
    assert show(m, "ActiveState") == "active" and m.run(f"test -p {name}", check=False).returncode == 0
    got, order = finish(trainer(m, "/etc/prefetchd/prefetchd.yaml", 1, user="bob"))
    assert got == reference(m, cfg, 1) and len(order) == 8
    assert show(m, "ActiveState") == "active"
    assert len(warned()) == 2, warned()  # one per bad spell: this daemon, and the one before the restart


def test_stop_exits_0_and_leaves_no_temp_files(deployed):
    m = deployed
    mark = cursor(m)
    m.run("systemctl stop prefetchd", timeout=60)
    assert show(m, "ActiveState") == "inactive" and show(m, "Result") == "success"
    # nothing of the daemon (workers, forkserver, resource tracker) was left for systemd to kill
    killed = [e["MESSAGE"] for e in journal(m, since=mark) if "Killing process" in str(e.get("MESSAGE", ""))]
    assert not killed, killed
    assert show(m, "ExecMainStatus") == "0"
    left = m.run("ls -A /run/prefetchd/buffer").stdout.split()
    assert not [n for n in left if n.startswith(".")], left
    m.run("systemctl start prefetchd", timeout=120)


def test_template_serves_two_jobs_at_once(deployed):
    m = deployed
    m.run("cp systemd/prefetchd@.service /etc/systemd/system/", cwd=f"{SHARE}/src")
    cfgs = {}
    for name, seed in (("a", 11), ("b", 12)):
        path = f"/etc/prefetchd/{name}.yaml"
        m.run(f"cp config.example.yaml {path}", cwd=f"{SHARE}/src")
        cfgs[name] = configure(m, path, {"loader": {"seed": seed, "epochs": 1},
                                         "buffer": {"dir": f"/run/prefetchd/{name}"}}, fresh=True)
    m.run("systemctl daemon-reload && systemctl enable --now prefetchd@a prefetchd@b", timeout=120)
    procs = {name: trainer(m, f"/etc/prefetchd/{name}.yaml", 1) for name in cfgs}
    for name, p in procs.items():
        got, order = finish(p)
        assert got == reference(m, cfgs[name], 1) and len(order) == 8, name
    for name in cfgs:
        assert show(m, "ActiveState", f"prefetchd@{name}") == "active"
        assert m.run(f"stat -c '%U:%G %a' /run/prefetchd/{name}").stdout.strip() == "prefetchd:prefetchd 750"
    m.run("systemctl disable --now prefetchd@a prefetchd@b", timeout=60)


def test_metrics_through_the_documented_drop_in(deployed):
    m = deployed
    with socket.socket() as s:  # the namespace shares the host's network: a port free here
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    configure(m, "/etc/prefetchd/prefetchd.yaml", {"metrics": {"enabled": True, "address": "127.0.0.1", "port": port}})
    fetch = (f"/opt/prefetchd/bin/python -c \"import urllib.request; "
             f"print(urllib.request.urlopen('http://127.0.0.1:{port}/metrics', timeout=5).read().decode())\"")
    # as shipped, the unit has no network: the daemon says so (and systemd stops retrying)
    mark = cursor(m)
    m.run("systemctl restart prefetchd", check=False, timeout=60)
    refusal = wait_until(lambda: [e["MESSAGE"] for e in journal(m, since=mark)
                                  if "cannot run" in str(e.get("MESSAGE", ""))], 30, "the refusal")
    assert "Address family not supported" in refusal[0] and 'drop-in of docs/systemd.md, "Metrics under systemd"' \
        in refusal[0], refusal  # the one line says how to fix it
    m.run("systemctl stop prefetchd && systemctl reset-failed prefetchd", check=False)
    m.run(readme_block("## Metrics under systemd"), timeout=120)
    wait_until(lambda: show(m, "ActiveState") == "active", 60, "the service with metrics")
    out = wait_until(lambda: m.run(fetch, check=False).stdout, 30, "the metrics endpoint")
    assert "prefetchd_" in out
