"""Tools some tests compare with or drive (bsdtar, promtool, Slurm), installed with apt when missing.

CI runs the suite as root on a machine that may be new: a test that needs a Debian package's tool
installs it (``apt-get update`` once per run, then ``apt-get install``), with ``policy-rc.d``
keeping the package's services from starting on this host. pytest-xdist's workers install one
at a time (a lock file: two apt-gets at once fail on dpkg's lock). Where that cannot be done (not root, no
apt-get, no network to the archive) the test skips and says why.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import shutil
import subprocess

import pytest

_updated = False
_LOCK = "/tmp/prefetchd-tests-apt.lock"


@contextlib.contextmanager
def _one_at_a_time():
    with open(_LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure(tools: dict[str, str]) -> None:
    """Each tool in ``tools`` (name -> Debian package) on PATH, or skip the calling test."""
    missing = {t: p for t, p in tools.items() if not shutil.which(t)}
    if not missing:
        return
    packages = sorted(set(missing.values()))
    what = f"{', '.join(missing)} missing ({' '.join(packages)})"
    if not shutil.which("apt-get"):
        pytest.skip(f"{what} and no apt-get to install it")
    if os.geteuid() != 0:
        pytest.skip(f"{what}: installing it needs root (apt-get install {' '.join(packages)})")
    with _one_at_a_time():
        if any(not shutil.which(t) for t in missing):  # else another worker installed them meanwhile
            _install(missing, packages, what)
    still = [t for t in missing if not shutil.which(t)]
    if still:
        pytest.skip(f"{', '.join(still)} still missing after apt-get install {' '.join(packages)}")


def _install(missing: dict[str, str], packages: list[str], what: str) -> None:
    global _updated
    policy = pathlib.Path("/usr/sbin/policy-rc.d")
    ours = not policy.exists()
    if ours:
        policy.write_text("#!/bin/sh\nexit 101\n")  # invoke-rc.d / deb-systemd-invoke: start nothing
        policy.chmod(0o755)
    try:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        cmds = [] if _updated else [["apt-get", "update", "-q"]]
        cmds.append(["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages])
        for cmd in cmds:
            r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
            if r.returncode:
                last = (r.stderr.strip() or r.stdout.strip()).splitlines()[-1:] or ["?"]
                pytest.skip(f"{what}: `{' '.join(cmd)}` failed: {last[0]}")
            if cmd[1] == "update":
                _updated = True
    finally:
        if ours:
            policy.unlink()
