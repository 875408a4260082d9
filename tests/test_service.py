"""systemd: the shipped units (checked with systemd-analyze where it is installed) and the
notify protocol, spoken to a real datagram socket."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys

import pytest
from conftest import small_config, wait_until

from prefetchd.daemon.sdnotify import Notifier

UNITS = os.path.join(os.path.dirname(__file__), "..", "systemd")
ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed")


def _unit_copy(tmp_path, name: str, instance: str | None = None) -> str:
    """The shipped unit with ExecStart pointed at this environment's real prefetchd script."""
    text = open(os.path.join(UNITS, name)).read()
    exe = os.path.join(os.path.dirname(sys.executable), "prefetchd")
    assert os.access(exe, os.X_OK), exe
    text = text.replace("/usr/local/bin/prefetchd", exe)
    out = tmp_path / (name.replace("@.", f"@{instance}.") if instance else name)
    out.write_text(text)
    return str(out)


@needs_analyze
@pytest.mark.parametrize("name, instance", [("prefetchd.service", None), ("prefetchd@.service", "train")])
def test_unit_exposure_is_at_most_2_5(tmp_path, name, instance):
    unit = _unit_copy(tmp_path, name, instance)
    r = subprocess.run([ANALYZE, "security", "--offline=yes", unit], capture_output=True, text=True, timeout=60)
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", r.stdout + r.stderr)
    assert m, r.stdout + r.stderr
    assert float(m.group(1)) <= 2.5


@needs_analyze
def test_units_verify_clean(tmp_path):
    units = [_unit_copy(tmp_path, "prefetchd.service"), _unit_copy(tmp_path, "run-prefetchd.mount"),
             _unit_copy(tmp_path, "prefetchd@.service", "train")]
    r = subprocess.run([ANALYZE, "verify", *units], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not r.stderr.strip() and not r.stdout.strip(), r.stdout + r.stderr


def test_template_differs_from_the_unit_only_in_the_instance():
    a = open(os.path.join(UNITS, "prefetchd.service")).read().splitlines()
    b = open(os.path.join(UNITS, "prefetchd@.service")).read().splitlines()
    settings = lambda lines: [line for line in lines if line and not line.startswith("#")]  # noqa: E731
    diff = [(x, y) for x, y in zip(settings(a), settings(b), strict=True) if x != y]
    assert len(settings(a)) == len(settings(b))
    assert all("%i" in y for _, y in diff) and len(diff) == 4, diff


def test_units_have_what_an_admin_relies_on():
    text = open(os.path.join(UNITS, "prefetchd.service")).read()
    for line in ("Type=notify", "NotifyAccess=main", "Restart=on-failure", "RestartPreventExitStatus=78",
                 "KillMode=mixed", "WatchdogSec=", "StartLimitBurst=", "MemoryMax=", "Nice=", "IOSchedulingClass=",
                 "ExecReload=/bin/kill -HUP $MAINPID", "Requires=run-prefetchd.mount",
                 # the cross-user model (docs/systemd.md): systemd makes the buffer
                 # directory for User=/Group=, the daemon needs no chown (which @privileged refuses)
                 "RuntimeDirectory=prefetchd/buffer", "RuntimeDirectoryMode=0750", "Group=prefetchd"):
        assert line in text, line
    mount = open(os.path.join(UNITS, "run-prefetchd.mount")).read()
    options = next(line for line in mount.splitlines() if line.startswith("Options=")).split("=", 1)[1].split(",")
    assert "Where=/run/prefetchd" in mount and "Type=tmpfs" in mount and any(o.startswith("size=") for o in options)
    # the mount point is root's and no one else creates there; X-mount.* is ignored by util-linux 2.38.1
    assert "mode=0755" in options and "huge=within_size" in options and not any("X-mount" in o for o in options)


# --- the notify protocol ---------------------------------------------------------------------------


def _listener(address: str | bytes) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(address)
    s.settimeout(10)
    return s


def test_notify_to_a_path_socket(tmp_path):
    path = str(tmp_path / "notify.sock")
    sock = _listener(path)
    n = Notifier(path, watchdog_usec="30000000", watchdog_pid=str(os.getpid()))
    assert n.ready() and n.status("3 ready") and n.watchdog() and n.reloading() and n.stopping()
    got = [sock.recv(4096).decode() for _ in range(5)]
    assert got[:3] == ["READY=1", "STATUS=3 ready", "WATCHDOG=1"]
    assert got[3].startswith("RELOADING=1\nMONOTONIC_USEC=") and got[4] == "STOPPING=1"
    assert n.watchdog_s == 30.0


def test_notify_to_an_abstract_socket():
    name = f"prefetchd-test-{os.getpid()}"
    sock = _listener("\0" + name)
    assert Notifier("@" + name).ready()
    assert sock.recv(4096) == b"READY=1"


def test_notify_without_socket_is_a_no_op(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    n = Notifier()
    assert not n.enabled and not n.ready()
    assert Notifier("@x", watchdog_usec="5000000", watchdog_pid="1").watchdog_s is None  # not our pid


def test_daemon_speaks_notify_ready_status_watchdog_reloading_stopping(tmp_path, image_root, daemon_factory):
    path = str(tmp_path / "notify.sock")
    sock = _listener(path)
    sock.setblocking(False)  # drained by polling below; the daemon sends STATUS= every second
    cfg = small_config(tmp_path, image_root, loader={"epochs": None})
    msgs: list[str] = []

    def saw(prefix):
        def check():
            try:
                while True:
                    msgs.append(sock.recv(4096).decode())
            except BlockingIOError:
                pass
            return any(m.startswith(prefix) for m in msgs)
        return check

    # WATCHDOG_PID is the daemon's own pid in systemd; here the env is inherited, so leave it out
    d = daemon_factory(cfg, env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "2000000"})
    wait_until(saw("READY=1"), 30, "READY=1")
    wait_until(saw("STATUS="), 10, "STATUS=")
    wait_until(saw("WATCHDOG=1"), 10, "WATCHDOG=1")
    d.proc.send_signal(signal.SIGHUP)
    wait_until(saw("RELOADING=1"), 10, "RELOADING=1")
    assert d.stop() == 0
    wait_until(saw("STOPPING=1"), 10, "STOPPING=1")
    assert msgs.index(next(m for m in msgs if m.startswith("READY=1"))) < msgs.index("STOPPING=1")
