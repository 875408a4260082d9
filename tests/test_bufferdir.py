"""Issue 46: a config without buffer.dir works on a workstation. The default is a per-user,
per-config directory under $XDG_RUNTIME_DIR (the login session's tmpfs); root without one keeps
/run/prefetchd (the systemd units' RAM disk); anyone else is told in one line to set it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml
from conftest import wait_until

from prefetchd.core import config as C
from prefetchd.core.bufferdir import default_buffer_dir
from prefetchd.core.configvalues import ConfigError

NOBODY = 65534


def test_login_session_gives_a_directory_per_config_under_xdg_runtime_dir(tmp_path):
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    a = default_buffer_dir(env, 1000, "/home/alice/exp1/train.yaml")
    b = default_buffer_dir(env, 1000, "/home/alice/exp2/train.yaml")
    assert os.path.dirname(a) == str(tmp_path / "prefetchd") and os.path.basename(a).startswith("train-")
    assert a != b  # two configs of one name never share a ring
    assert a == default_buffer_dir(env, 1000, "/home/alice/exp1/train.yaml")  # the daemon and the trainer agree
    assert default_buffer_dir(env, 0, "/etc/x.yaml").startswith(str(tmp_path))  # root in a session too


@pytest.mark.parametrize("env", [{}, {"XDG_RUNTIME_DIR": ""}, {"XDG_RUNTIME_DIR": "run/user/0"},
                                 {"XDG_RUNTIME_DIR": "/no/such/run/user/0"}])
def test_root_without_a_session_keeps_run_prefetchd(env):
    assert default_buffer_dir(env, 0, "/etc/prefetchd/prefetchd.yaml") == "/run/prefetchd"


def test_a_user_without_a_session_is_told_to_set_it_in_one_line():
    with pytest.raises(ConfigError) as e:
        default_buffer_dir({}, 1000, "/home/alice/train.yaml")
    msg = str(e.value)
    assert msg.startswith("buffer.dir is not set and $XDG_RUNTIME_DIR is not set") and "\n" not in msg, msg
    assert "set buffer.dir" in msg and "/dev/shm/prefetchd-1000/" in msg
    with pytest.raises(ConfigError, match=r"\$XDG_RUNTIME_DIR \(/run/user/1000\) is not a directory here"):
        default_buffer_dir({"XDG_RUNTIME_DIR": "/run/user/1000"}, 1000, "/x.yaml", isdir=lambda p: False)


def test_load_resolves_the_default_and_keeps_an_explicit_dir(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
    (tmp_path / "train.yaml").write_text("dataset: {root: data}\n")
    (tmp_path / "nulled.yaml").write_text("dataset: {root: data}\nbuffer: {dir: null, capacity: 8}\n")
    (tmp_path / "set.yaml").write_text("dataset: {root: data}\nbuffer: {dir: ring}\n")
    cfg = C.load(str(tmp_path / "train.yaml"))
    assert cfg.buffer.dir == default_buffer_dir(os.environ, 1000, str(tmp_path / "train.yaml"))
    assert cfg.progress_dir == os.path.join(cfg.buffer.dir, "progress")
    nulled = C.load(str(tmp_path / "nulled.yaml"))
    assert os.path.dirname(nulled.buffer.dir) == str(run / "prefetchd") and nulled.buffer.capacity == 8
    assert C.load(str(tmp_path / "set.yaml")).buffer.dir == str(tmp_path / "ring")
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ConfigError, match="^buffer.dir is not set"):
        C.load(str(tmp_path / "train.yaml"))
    assert C.load(str(tmp_path / "set.yaml")).buffer.dir == str(tmp_path / "ring")  # set: no session needed
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert C.load(str(tmp_path / "train.yaml")).buffer.dir == "/run/prefetchd"


def test_check_notes_a_shared_ram_disk_without_warning(tmp_path, image_root):
    """/dev/shm (the Slurm example's ring, the demo's without a session) is a note: nothing to act on."""
    from prefetchd.tools.deploy import Account, check_deployment

    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({"dataset": {"root": image_root},
                                 "buffer": {"dir": "/dev/shm/prefetchd-check-test-46/buffer", "max_bytes": "64MiB"}}))
    findings = check_deployment(C.load(str(p)), Account.lookup("root"), [])
    assert any(f.startswith("note: buffer.dir is on /dev/shm") for f in findings), findings
    assert not any(f.startswith("warning:") and ("/dev/shm" in f) for f in findings), findings
    assert not os.path.exists("/dev/shm/prefetchd-check-test-46")


def test_a_config_without_buffer_dir_runs_as_a_user_would(tmp_path, image_root):
    """A login session's $XDG_RUNTIME_DIR, a config of dataset.root and a few keys, no buffer.dir:
    ``prefetchd check`` passes, ``prefetchd launch -- python train.py`` reads batches from a ring
    under the session's directory, and removes it at the end."""
    run = tmp_path / "run-user"
    run.mkdir(mode=0o700)
    cfg = tmp_path / "train.yaml"
    cfg.write_text(yaml.safe_dump({"dataset": {"root": image_root, "cache_dir": str(tmp_path / "cache")},
                                   "loader": {"batch_size": 6}, "workers": {"count": 1},
                                   "augment": {"output_size": 32, "scale_min": 36, "scale_max": 48}}))
    env = {**os.environ, "XDG_RUNTIME_DIR": str(run)}
    r = subprocess.run([sys.executable, "-m", "prefetchd", "check", "--config", str(cfg)], capture_output=True,
                       text=True, timeout=120, env=env, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    ring = default_buffer_dir(env, os.geteuid(), os.path.realpath(cfg))
    assert ring.startswith(str(run / "prefetchd")), ring
    train = tmp_path / "train.py"
    train.write_text("import os, sys\nfrom prefetchd_client import PrefetchClient\n"
                     "loader = PrefetchClient(timeout=60, as_numpy=True)\n"
                     "x, y = next(iter(loader))\n"
                     "print('batch of', len(x))\n"
                     f"assert os.path.isdir({ring!r}), 'no ring'\n"
                     "loader.close()\n")
    r = subprocess.run([sys.executable, "-m", "prefetchd", "launch", "--config", str(cfg), "--",
                        sys.executable, str(train)], capture_output=True, text=True, timeout=300, env=env,
                       cwd=str(tmp_path))
    assert r.returncode == 0 and "batch of 6" in r.stdout, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    wait_until(lambda: not os.path.exists(ring), 10, "the launch's ring removed")


def test_a_user_without_a_session_gets_exit_78_and_one_line(tmp_path, image_root):
    """As a user (nobody) with no $XDG_RUNTIME_DIR: ``prefetchd check`` says to set buffer.dir."""
    if os.geteuid() != 0:
        pytest.skip("needs root to become another user")
    cfg = "/dev/shm/prefetchd-46-nobody.yaml"  # tmp_path is root's alone
    with open(cfg, "w") as f:
        yaml.safe_dump({"dataset": {"root": image_root}}, f)
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    try:
        # the interpreter lives under /root, which nobody cannot read: import first, then become nobody
        r = subprocess.run([sys.executable, "-c", "import locale, os, sys; from prefetchd.cli import build_parser, main\n"
                            "build_parser().format_help()\n"
                            "import prefetchd.sources.classlike, prefetchd.sources.dataset, prefetchd.core.sampler, "
                            "prefetchd.daemon.ring, prefetchd.format.batchfile\n"
                            f"os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})\n"
                            "sys.exit(main(['check', '--config', sys.argv[1]]))", cfg],
                           capture_output=True, text=True, timeout=120, env=env, cwd="/")
    finally:
        os.unlink(cfg)
    assert r.returncode == 78, r.stdout + r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "buffer.dir is not set and $XDG_RUNTIME_DIR is not set" in lines[0], r.stderr
