"""The watchdog internals the progress watcher uses (``daemon/inotify.py`` says which) hold across
pyproject's pinned range: the watcher's unit tests run against the lowest release of the range
and against the newest one, each installed alone (``pip install --target``, no venv) and put
ahead of the venv's copy in a fresh interpreter. The installs come from the package index; where
none is reachable the test is skipped, saying so."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _pinned_range() -> tuple[str, str]:
    m = re.search(r'"watchdog>=([\d.]+),<([\d.]+)"', (ROOT / "pyproject.toml").read_text())
    assert m, "pyproject.toml pins watchdog as watchdog>=LOW,<HIGH"
    return m.group(1), m.group(2)


@pytest.mark.parametrize("end", ["lowest", "newest"])
def test_the_watchers_tests_pass_at_both_ends_of_the_pinned_watchdog_range(tmp_path, end):
    low, high = _pinned_range()
    spec = f"watchdog=={low}" if end == "lowest" else f"watchdog>={low},<{high}"
    site = tmp_path / "site"
    got = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
                          "--disable-pip-version-check", "--target", str(site), spec],
                         capture_output=True, text=True, timeout=120)
    if got.returncode != 0:
        pytest.skip(f"cannot install {spec}: {(got.stderr.strip().splitlines() or ['?'])[-1]}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p),
           "PREFETCHD_TEST_WATCHDOG_DIR": str(site)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "not daemon",
                          "tests/test_watcher.py", "tests/test_loop_cost.py"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    version = next(iter(site.glob("watchdog-*.dist-info"))).name
    assert run.returncode == 0, f"{version}:\n{run.stdout[-4000:]}{run.stderr[-2000:]}"
