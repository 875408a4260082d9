"""The buffer directory and its files are trusted only when they are what the daemon made."""

from __future__ import annotations

import grp
import os
import signal
import stat
import subprocess
import sys

import pytest
import yaml
from conftest import small_config, wait_until
from prefetchd_client import PrefetchClient, PrefetchError
from test_daemon import collect, digest, published, reference_batches

NOBODY = 65534


def _run(cfg: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefetchd", "run", "--config", cfg], capture_output=True, text=True,
                          timeout=60)


def test_buffer_dir_symlink_is_refused(tmp_path, image_root):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    cfg = small_config(tmp_path, image_root)
    os.symlink(real, tmp_path / "buffer")
    r = _run(cfg)
    assert r.returncode == 78 and "is a symlink" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_buffer_dir_owned_by_another_user_is_refused(tmp_path, image_root):
    buf = tmp_path / "buffer"
    buf.mkdir(mode=0o700)
    os.chown(buf, NOBODY, NOBODY)  # the suite runs as root, like CI
    r = _run(small_config(tmp_path, image_root))
    assert r.returncode == 78 and f"owned by uid {NOBODY}" in r.stderr


def test_buffer_dir_is_created_private_or_group_readable(tmp_path, image_root, daemon_factory):
    cfg = small_config(tmp_path, image_root)
    d = daemon_factory(cfg)
    buf = tmp_path / "buffer"
    wait_until(lambda: published(str(buf)), 30, "a batch")
    assert stat.S_IMODE(os.stat(buf).st_mode) == 0o700
    assert d.stop() == 0
    group = grp.getgrgid(NOBODY).gr_name
    progress_dir = tmp_path / "progress"
    cfg = small_config(tmp_path, image_root, buffer={"group": group}, progress={"dir": str(progress_dir)})
    d = daemon_factory(cfg)
    wait_until(lambda: stat.S_IMODE(os.stat(buf).st_mode) == 0o750, 30, "mode 0750")
    assert os.stat(buf).st_gid == NOBODY
    # the trainer (a member of the group) writes its progress files here
    assert stat.S_IMODE(os.stat(progress_dir).st_mode) == 0o2770 and os.stat(progress_dir).st_gid == NOBODY
    assert d.stop() == 0


def test_unknown_group_is_a_config_error(tmp_path, image_root):
    r = _run(small_config(tmp_path, image_root, buffer={"group": "no-such-group-here"}))
    assert r.returncode == 78 and "buffer.group 'no-such-group-here' is not a known group" in r.stderr


def test_client_refuses_a_batch_file_it_did_not_get_from_the_daemon(tmp_path, image_root, daemon_factory):
    cfg = small_config(tmp_path, image_root)
    buf = tmp_path / "buffer"
    d = daemon_factory(cfg)
    wait_until(lambda: len(published(str(buf))) == 4, 30, "a full buffer")
    first = buf / published(str(buf))[0]
    os.chown(first, NOBODY, NOBODY)
    with PrefetchClient(cfg, timeout=10, as_numpy=True) as c, pytest.raises(PrefetchError, match=f"owned by uid {NOBODY}"):
        next(iter(c.iter_epoch(0)))
    assert d.stop() == 0


def test_batches_of_another_stream_are_never_served(tmp_path, image_root, daemon_factory):
    cfg = small_config(tmp_path, image_root)
    d = daemon_factory(cfg)
    wait_until(lambda: len(published(str(tmp_path / "buffer"))) == 4, 30, "a full buffer")
    d.stop(signal.SIGKILL)
    data = yaml.safe_load(open(cfg))
    data["loader"]["seed"] = 8  # same file names, different bytes
    open(cfg, "w").write(yaml.safe_dump(data))
    d = daemon_factory(cfg)
    got = collect(cfg)
    ref, _ = reference_batches(cfg)
    assert digest(got) == digest({k: v[:2] for k, v in ref.items()})
    assert d.stop() == 0 and "4 from another stream" in d.log()


def test_a_client_with_a_different_config_is_told_so(tmp_path, image_root, daemon_factory):
    cfg = small_config(tmp_path, image_root)
    d = daemon_factory(cfg)
    other = tmp_path / "other.yaml"
    data = yaml.safe_load(open(cfg))
    data["augment"]["flip"] = False
    other.write_text(yaml.safe_dump(data))
    with PrefetchClient(str(other), timeout=30) as c, pytest.raises(PrefetchError, match="makes a different stream"):
        c.meta()
    assert d.stop() == 0
