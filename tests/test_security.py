"""The buffer directory and its files are trusted only when they are what the daemon made."""

from __future__ import annotations

import grp
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile

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
    assert stat.S_IMODE(os.stat(buf / "progress").st_mode) == 0o700
    assert d.stop() == 0
    group = grp.getgrgid(NOBODY).gr_name
    progress_dir = tmp_path / "progress"
    cfg = small_config(tmp_path, image_root, buffer={"group": group}, progress={"dir": str(progress_dir)})
    os.unlink(buf / "meta.json")  # the new daemon writes it once its directories are ready
    d = daemon_factory(cfg)
    # a group that is not the daemon's own: setgid, so what the daemon creates gets the group
    wait_until(lambda: (buf / "meta.json").exists() and len(published(str(buf))) == 4, 30, "meta.json, a full buffer")
    assert stat.S_IMODE(os.stat(buf).st_mode) == 0o2750 and os.stat(buf).st_gid == NOBODY
    # the trainer (a member of the group) writes its progress files here
    assert stat.S_IMODE(os.stat(progress_dir).st_mode) == 0o2770 and os.stat(progress_dir).st_gid == NOBODY
    for name in [*published(str(buf)), "meta.json", "daemon.lock"]:
        st = os.stat(buf / name)
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o640, NOBODY), name
    assert d.stop() == 0


def _umask_077():
    os.umask(0o077)


def test_file_modes_do_not_depend_on_the_umask(tmp_path, image_root):
    """Under umask 077 the daemon's files are still 0640 and the client's progress file 0644:
    a trainer of the group reads batches, a daemon of another user reads the progress."""
    cfg = small_config(tmp_path, image_root, buffer={"group": grp.getgrgid(NOBODY).gr_name})
    buf = tmp_path / "buffer"
    log = open(tmp_path / "daemon.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "prefetchd", "run", "--config", cfg], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_umask_077)
    try:
        wait_until(lambda: len(published(str(buf))) == 4 and (buf / "status.json").exists(), 30, "a full buffer")
        code = ("import os, sys; os.umask(0o077); from prefetchd_client import PrefetchClient\n"
                "with PrefetchClient(sys.argv[1], timeout=30, as_numpy=True) as c:\n"
                "    it = c.iter_epoch(0); next(it); next(it)\n")
        subprocess.run([sys.executable, "-c", code, cfg], check=True, timeout=60)
        for name in [*published(str(buf)), "meta.json", "status.json", "daemon.lock"]:
            assert stat.S_IMODE(os.stat(buf / name).st_mode) == 0o640, name
        assert stat.S_IMODE(os.stat(buf / "progress" / "progress-r0000.json").st_mode) == 0o644
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(15) == 0
        log.close()


def test_a_group_the_daemon_may_not_use_is_one_clear_line(request):
    """Not root and not a member of buffer.group (as under systemd, where chown is refused too)."""
    top = tempfile.mkdtemp(dir="/dev/shm")  # pytest's base dir is root's alone: nobody cannot reach tmp_path
    buf = os.path.join(top, "buffer")
    os.chmod(top, 0o755)
    os.mkdir(buf, 0o700)
    os.chown(buf, NOBODY, NOBODY)
    request.addfinalizer(lambda: shutil.rmtree(top))
    # modules are imported as root: the interpreter lives under /root, which nobody cannot read
    r = subprocess.run([sys.executable, "-c", "import os, sys; from prefetchd.ring import prepare_dirs, RingError; "
                        "os.setgroups([]); os.setgid(65534); os.setuid(65534)\n"
                        "try: prepare_dirs(sys.argv[1], sys.argv[1] + '/progress', 'root')\n"
                        "except RingError as e: print(e)", buf], capture_output=True, text=True, timeout=60)
    assert "has group nogroup, not buffer.group root, and this daemon may not change it" in r.stdout, r.stdout + r.stderr
    assert "Group=root" in r.stdout


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
