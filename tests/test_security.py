"""The buffer directory and its files are trusted only when they are what the daemon made."""

from __future__ import annotations

import grp
import itertools
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import yaml
from conftest import pixels, small_config, wait_until
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


@pytest.mark.parametrize("umask", [0o077, 0o000], ids=["umask077", "umask000"])
def test_quarantine_list_and_worker_temp_files_are_0640_whatever_the_umask(tmp_path, umask):
    import numpy as np

    from prefetchd.daemon.quarantine import QuarantineLog
    from prefetchd.executors.worker import Quarantined, Task, write_temp

    old = os.umask(umask)
    try:
        q = QuarantineLog(str(tmp_path), "ds", lambda i: f"img{i}")
        q.add(Quarantined(3, "img3", "broken"), 0)
        task = Task(0, 0, 0, 8, np.arange(2, dtype=np.int64))
        res = write_temp(str(tmp_path), task, 1, 0, pixels(np.zeros((2, 8, 8, 3), np.uint8)), np.arange(2),
                         np.zeros(2, np.int64), np.full(2, -1), [], 0.0)
    finally:
        os.umask(old)
    assert res.error is None
    assert stat.S_IMODE(os.stat(q.path).st_mode) == 0o640
    assert stat.S_IMODE(os.stat(res.tmp_path).st_mode) == 0o640


def test_a_group_the_daemon_may_not_use_is_one_clear_line(request):
    """Not root and not a member of buffer.group (as under systemd, where chown is refused too)."""
    top = tempfile.mkdtemp(dir="/dev/shm")  # pytest's base dir is root's alone: nobody cannot reach tmp_path
    buf = os.path.join(top, "buffer")
    os.chmod(top, 0o755)
    os.mkdir(buf, 0o700)
    os.chown(buf, NOBODY, NOBODY)
    request.addfinalizer(lambda: shutil.rmtree(top))
    # modules are imported as root: the interpreter lives under /root, which nobody cannot read
    r = subprocess.run([sys.executable, "-c", "import os, sys; from prefetchd.daemon.ring import prepare_dirs, RingError; "
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


# --- prefetchd check: what is wrong with a deployment, one line each ---------------------------------


def _check(cfg: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefetchd", "check", "--config", cfg, *args], capture_output=True,
                          text=True, timeout=60)


def _findings(r: subprocess.CompletedProcess) -> list[str]:
    return [line for line in r.stdout.splitlines() if line.startswith(("problem:", "warning:"))]


def test_check_passes_a_private_buffer_for_its_own_user(tmp_path, image_root):
    r = _check(small_config(tmp_path, image_root))
    assert r.returncode == 0 and "deployment (daemon user root): no problems" in r.stdout, r.stdout + r.stderr
    assert not [f for f in _findings(r) if f.startswith("problem:")]


def test_check_says_a_trainer_of_another_user_needs_a_group(tmp_path, image_root):
    r = _check(small_config(tmp_path, image_root), "--trainer", "nobody")
    assert r.returncode == 1, r.stdout + r.stderr
    problems = [f for f in _findings(r) if f.startswith("problem:")]
    assert problems == ["problem: buffer.group is not set: only root can read the buffer, not trainer nobody; set "
                        "buffer.group to the daemon's group and add nobody to it"], problems


def test_check_says_a_trainer_outside_the_group_once(tmp_path, image_root):
    cfg = small_config(tmp_path, image_root, buffer={"group": "root"})
    r = _check(cfg, "--trainer", "nobody")
    assert r.returncode == 1
    problems = [f for f in _findings(r) if f.startswith("problem:")]
    assert problems == ["problem: trainer nobody is not in buffer.group root: it cannot read batches; "
                        "`usermod -aG root nobody`, then log in again"], problems


def test_check_finds_open_modes_wrong_owner_and_unreadable_progress(tmp_path, image_root):
    cfg = small_config(tmp_path, image_root)
    buf = tmp_path / "buffer"
    (buf / "progress").mkdir(parents=True)
    os.chmod(buf, 0o755)
    p = buf / "progress" / "progress-r0000.json"
    p.write_text("{}")
    os.chmod(p, 0o600)
    os.chown(p, NOBODY, NOBODY)
    os.chown(buf / "progress", NOBODY, NOBODY)
    r = _check(cfg, "--user", "nobody")
    problems = [f for f in _findings(r) if f.startswith("problem:")]
    assert r.returncode == 1
    assert any(f"buffer.dir {buf} is owned by root, not by the daemon's user nobody" in f for f in problems), problems
    assert any(f"buffer.dir {buf} (root:root 0755) is open to users outside its group" in f for f in problems), problems
    # nobody owns its 0600 progress file (the daemon reads it), but cannot get into tmp_path at all
    assert any("the daemon's user nobody cannot reach buffer.dir" in f for f in problems), problems
    r = _check(cfg)  # as root: the progress file of another user, mode 0600, is unreadable to a non-root daemon only
    assert not any("progress-r0000.json" in f for f in _findings(r))


def test_check_reads_the_mount_options_of_the_buffer(tmp_path, image_root):
    from prefetchd.core.config import load
    from prefetchd.tools.deploy import Account, check_deployment

    cfg = load(small_config(tmp_path, image_root, buffer={"dir": "/dev/shm/prefetchd-check-test/buffer"}))
    findings = check_deployment(cfg, Account.lookup("root"), [])
    # /dev/shm is shared with the trainer's DataLoader and NCCL, and has no huge pages here
    assert any("buffer.dir is on /dev/shm" in f for f in findings), findings
    assert not os.path.exists("/dev/shm/prefetchd-check-test")


def test_mount_of_parses_mountinfo(tmp_path):
    from prefetchd.tools.deploy import mount_of

    info = tmp_path / "mountinfo"
    info.write_text("22 1 254:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw\n"
                    "90 22 0:50 / /run/prefetchd rw,nosuid,nodev,noexec,relatime shared:40 - tmpfs tmpfs "
                    "rw,size=262144k,nr_inodes=65536,mode=755,huge=within_size\n")
    mp, fstype, opts = mount_of("/run/prefetchd/buffer/x", str(info))
    assert (mp, fstype) == ("/run/prefetchd", "tmpfs") and "huge=within_size" in opts and "nosuid" in opts
    assert mount_of("/srv/data", str(info))[:2] == ("/", "ext4")


def test_a_trainer_outside_the_group_is_told_permission_is_denied(tmp_path, image_root, request):
    """A buffer of the daemon's group (0750, files 0640) and a trainer of another user outside it:
    the error says permission is denied and which group to join, not a timeout with a made-up age."""
    from prefetchd.format import status

    top = tempfile.mkdtemp(dir="/dev/shm")  # pytest's base dir is root's alone: nobody cannot reach tmp_path
    request.addfinalizer(lambda: shutil.rmtree(top))
    os.chmod(top, 0o755)
    buf = os.path.join(top, "buffer")
    os.mkdir(buf, 0o750)
    status.write_json(buf, status.META_NAME, {"format": "prefetchd-meta", "pid": 1})
    open(os.path.join(buf, status.LOCK_NAME), "w").close()
    cfg = small_config(tmp_path, image_root, buffer={"dir": buf})
    # modules and config are loaded as root: the interpreter lives under /root, which nobody cannot read
    code = ("import os, sys; from prefetchd_client import PrefetchClient; from prefetchd.core.config import load\n"
            "cfg = load(sys.argv[1]); os.setgroups([]); os.setgid(65534); os.setuid(65534)\n"
            "c = PrefetchClient(cfg, timeout=0.5, as_numpy=True)\n"
            "try: c.meta()\n"
            "except Exception as e: print(type(e).__name__, e)\n")
    r = subprocess.run([sys.executable, "-c", code, cfg], capture_output=True, text=True, timeout=60)
    out = r.stdout + r.stderr
    assert f"cannot read {buf}/meta.json: permission denied" in out, out
    assert "group root (buffer.group)" in out, out
    assert " s old" not in out, out


# --- what a trainer can put in the progress directory: no kind of file hangs or stops the daemon -------


def _fifo(path) -> str:
    os.mkfifo(path, 0o644)
    return str(path)


def _socket_at(path) -> None:
    """A Unix socket file at ``path``: bound from inside its directory (sun_path holds 108 bytes)."""
    subprocess.run([sys.executable, "-c", "import socket, sys; socket.socket(socket.AF_UNIX).bind(sys.argv[1])",
                    os.path.basename(path)], cwd=os.path.dirname(path), check=True, timeout=30)


def _returns_within(fn, timeout_s: float = 5.0):
    """``fn()``'s result or exception; fails the test if it has not returned after ``timeout_s``
    (a read blocked on a FIFO would never return)."""
    box: dict = {}

    def call():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(timeout_s)
    assert box, f"{fn} did not return within {timeout_s:.0f} s"
    return box.get("error", box.get("value"))


@pytest.mark.parametrize("what", ["fifo", "symlink to a fifo", "symlink to a file", "symlink to /dev/zero",
                                  "directory", "socket", "too large"])
def test_read_regular_refuses_what_is_not_a_regular_file_at_once(tmp_path, what):
    from prefetchd.format import untrusted

    path = tmp_path / "progress-r0000.json"
    (tmp_path / "file").write_text("{}")
    if what == "fifo":
        _fifo(path)
    elif what == "symlink to a fifo":
        os.symlink(_fifo(tmp_path / "fifo"), path)
    elif what == "symlink to a file":  # one the reader may read and the writer may not, say
        os.symlink(tmp_path / "file", path)
    elif what == "symlink to /dev/zero":
        os.symlink("/dev/zero", path)
    elif what == "directory":
        path.mkdir()
    elif what == "socket":
        _socket_at(str(path))
    else:
        path.write_bytes(b" " * 65537)
    got = _returns_within(lambda: untrusted.read_regular(str(path), 65536))
    assert isinstance(got, untrusted.NotRegular), got
    want = {"fifo": "a FIFO", "directory": "a directory", "socket": "a socket", "too large": "larger than 65536 bytes"}
    assert want.get(what, "a symbolic link") in str(got)
    assert untrusted.read_regular(str(tmp_path / "file"), 65536) == b"{}"


def test_the_watcher_ignores_bad_kinds_with_one_warning_per_bad_spell(tmp_path, caplog):
    from prefetchd.daemon.watcher import ProgressWatcher
    from prefetchd.format import progress

    val0 = progress.lane("val", 0)
    w = ProgressWatcher(str(tmp_path), (0, 1, val0), lambda: None, use_inotify=False)
    p1 = str(tmp_path / progress.progress_name(1))
    pv = str(tmp_path / progress.progress_name(val0))
    _fifo(pv)  # a validation lane's name too
    progress.write(str(tmp_path), progress.Progress(1, 0, 3, session="s"))
    caplog.set_level("WARNING", logger="prefetchd.watcher")
    assert _returns_within(w.poll)[1].position == (0, 3)
    assert [r.getMessage() for r in caplog.records] == [f"ignoring {pv}: it is a FIFO, not a regular file; keeping "
                                                        "the last good position none"]
    caplog.clear()
    # one bad spell, whatever the name becomes meanwhile: one warning; the position is kept
    steps = [lambda: os.replace(_fifo(tmp_path / ".f"), p1), lambda: os.replace(tmp_path / ".l", p1),
             lambda: (os.unlink(p1), os.mkdir(p1)), lambda: (os.rmdir(p1), _socket_at(p1))]
    os.symlink(_fifo(tmp_path / "elsewhere"), tmp_path / ".l")
    for step in steps:
        step()
        assert _returns_within(w.poll) == {}
    assert [r.getMessage() for r in caplog.records] == [f"ignoring {p1}: it is a FIFO, not a regular file; keeping "
                                                        "the last good position (0, 3)"]
    os.unlink(p1)
    progress.write(str(tmp_path), progress.Progress(1, 0, 4, session="s"))  # a good file ends the spell...
    assert _returns_within(w.poll)[1].position == (0, 4)
    os.replace(_fifo(tmp_path / ".f"), p1)  # ...so the next bad one is said again
    assert _returns_within(w.poll) == {}
    assert len(caplog.records) == 2 and w.last[1].position == (0, 4)


def test_stray_names_in_the_progress_directory_cost_one_warning_and_no_dirty_marks(tmp_path, caplog):
    from prefetchd.daemon.watcher import ProgressWatcher

    woken = []
    w = ProgressWatcher(str(tmp_path), (0,), lambda: woken.append(1), use_inotify=False)
    caplog.set_level("WARNING", logger="prefetchd.watcher")
    for i in range(20_000):  # the inotify events a trainer making 20,000 files there causes
        w._mark(f"junk-{i}")
    w._mark("progress-r0007.json")  # a rank this daemon does not serve
    w._mark(".progress-abc.tmp")  # a client's temp file: not stray
    assert not w._dirty and not woken
    assert w.poll() == {} and w.poll() == {}
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "20001 change(s) to entries that are not progress files" in msgs[0], msgs
    w._mark("progress-r0000.json")
    assert w._dirty == {0} and woken == [1]


def test_stop_guard_ends_a_stuck_process_after_its_deadline_and_not_a_clean_one():
    from prefetchd.daemon.stopguard import StopGuard

    exits = []
    g = StopGuard(lambda: [], deadline_s=0.3, exit=exits.append).start()
    g.arm()
    wait_until(lambda: exits, 10, "the guard's exit")
    assert exits == [0] and g.fired
    g.done()
    g = StopGuard(lambda: [], deadline_s=0.3, exit=exits.append).start()
    g.arm()
    g.done()  # the clean stop came first
    time.sleep(0.6)
    assert exits == [0] and not g.fired


def test_stop_guard_gives_a_running_teardown_until_the_total_deadline():
    """The loop returned in time: a clean but slow teardown is not cut short at the loop's
    deadline, and a teardown that hangs still ends at the total one."""
    from prefetchd.daemon.stopguard import STOP_DEADLINE_S, STOP_TOTAL_S, StopGuard

    assert STOP_DEADLINE_S < STOP_TOTAL_S < 10  # the stop's promise: within 10 s (the unit allows 20)
    exits = []
    g = StopGuard(lambda: [], deadline_s=0.3, total_s=1.5, exit=exits.append).start()
    g.arm()
    time.sleep(0.1)
    g.tearing_down()  # the loop is back; stopping the workers and the helpers takes a while
    time.sleep(0.8)
    g.done()
    assert exits == [] and not g.fired
    g = StopGuard(lambda: [], deadline_s=0.3, total_s=1.5, exit=exits.append).start()
    g.tearing_down()  # the loop ended by itself; a signal comes while the teardown runs
    t0 = time.monotonic()
    g.arm()
    wait_until(lambda: exits, 10, "the guard's exit")
    assert 1.3 < time.monotonic() - t0 < 5 and exits == [0] and g.fired
    g.done()


def _status_age(buf) -> float:
    from prefetchd.format import status

    s = status.read_json(str(buf), status.STATUS_NAME) or {}
    return time.time() - s.get("updated", 0)


def test_no_file_a_trainer_can_make_in_the_progress_directory_stalls_another_trainer(tmp_path, image_root,
                                                                                     daemon_factory):
    """A FIFO at a progress name before start; then, while rank 0 reads, rank 1's name becomes a
    FIFO, a symlink to a FIFO, a directory, a socket, and 20,000 stray files appear: rank 0 never
    waits more than 5 s for a batch, and SIGTERM stops the daemon within 10 s with status 0."""
    from prefetchd.format import progress

    cfg = small_config(tmp_path, image_root, loader={"epochs": None, "world_size": 2})
    buf = tmp_path / "buffer"
    pdir = buf / "progress"
    pdir.mkdir(parents=True, mode=0o700)
    os.chmod(buf, 0o700)
    for r in (0, 1):
        _fifo(pdir / progress.progress_name(r))
    p1 = str(pdir / progress.progress_name(1))
    d = daemon_factory(cfg)
    waits: list[float] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def read():
        try:
            with PrefetchClient(cfg, rank=0, timeout=60, as_numpy=True) as c:
                for e in itertools.count():
                    it = iter(c.iter_epoch(e))
                    while not stop.is_set():
                        t = time.monotonic()
                        if next(it, None) is None:
                            break
                        waits.append(time.monotonic() - t)
                        time.sleep(0.02)  # a trainer's step
                    if stop.is_set():
                        return
        except BaseException as e:  # noqa: BLE001 - handed to the test
            errors.append(e)

    t0 = time.monotonic()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    wait_until(lambda: waits or errors, 20, "rank 0's first batch with a FIFO at both progress names")
    assert not errors and time.monotonic() - t0 < 20

    def rank1_position():
        s = json.loads((buf / "status.json").read_text())
        return s["ranks"]["1"]["position"]

    progress.write(str(pdir), progress.Progress(1, 0, 2, session="s"))  # ends the start-up FIFO's bad spell
    wait_until(lambda: rank1_position() == [0, 2], 20, "rank 1 at batch 2")
    os.symlink(_fifo(tmp_path / "fifo"), pdir / ".link")
    for step in (lambda: os.replace(_fifo(pdir / ".fifo"), p1), lambda: os.replace(pdir / ".link", p1),
                 lambda: (os.unlink(p1), os.mkdir(p1)), lambda: (os.rmdir(p1), _socket_at(p1)),
                 lambda: [open(pdir / f"stray-{i}", "w").close() for i in range(20_000)]):
        n = len(waits)
        step()
        wait_until(lambda: len(waits) >= n + 10 or errors, 30, "rank 0's next 10 batches")  # noqa: B023
        assert not errors and d.proc.poll() is None
        assert _status_age(buf) < 5, "status.json is not kept up to date"
    stop.set()
    reader.join(30)
    assert not errors, errors
    assert max(waits) <= 5.0, f"rank 0 waited {max(waits):.1f} s for a batch"
    assert rank1_position() == [0, 2]  # the last good position is kept
    t = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(10) == 0 and time.monotonic() - t < 10
    log = d.log()
    bad = [line for line in log.splitlines() if f"ignoring {p1}" in line]
    assert len(bad) == 2, bad  # the start-up FIFO, then one spell for everything after the good file
    assert "it is a FIFO, not a regular file" in bad[0] and "keeping the last good position (0, 2)" in bad[1]
    strays = [line for line in log.splitlines() if "entries that are not progress files" in line]
    assert 1 <= len(strays) <= 2, strays
    assert "Traceback" not in log


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_ends_a_daemon_whose_loop_is_stuck_within_10_s(tmp_path, image_root, daemon_factory, sig):
    """The stop guard, not the loop: the loop is blocked (fault injection) when the signal comes."""
    cfg = small_config(tmp_path, image_root, loader={"epochs": None})
    buf = tmp_path / "buffer"
    marker = tmp_path / "stuck"
    d = daemon_factory(cfg, env={"PREFETCHD_FAULT_STUCK_LOOP": str(marker)})
    wait_until(lambda: len(published(str(buf))) == 4 and (buf / "status.json").exists(), 30, "a full buffer")
    st = json.loads((buf / "status.json").read_text())
    workers, helpers = st["worker_pids"], [p for p in st["helper_pids"].values() if p]
    assert len(helpers) == 2  # the forkserver and the resource tracker
    marker.touch()
    wait_until(lambda: _status_age(buf) > 2, 20, "the loop to be stuck (status.json no longer rewritten)")
    forkserver = st["helper_pids"]["forkserver"]
    os.kill(forkserver, signal.SIGSTOP)  # stopped, it would never go by itself once its daemon is gone
    try:
        t = time.monotonic()
        d.proc.send_signal(sig)
        assert d.proc.wait(10) == 0 and time.monotonic() - t < 10
        log = d.log()
        assert "after the stop signal (the main thread is at loop.py:" in log and " _loop < loop.py:" in log, log[-2000:]
        for pid in workers + helpers:  # killed, not left to run on (or stopped) without their daemon
            wait_until(lambda: not _alive(pid), 10, f"child {pid} to be gone")  # noqa: B023
    finally:
        if _alive(forkserver):
            os.kill(forkserver, signal.SIGKILL)
    # the next start cleans up after it (temp files of the killed workers) and serves
    d2 = daemon_factory(cfg)
    wait_until(lambda: json.loads((buf / "status.json").read_text()).get("pid") == d2.pid, 30, "the next daemon's status")
    assert collect(cfg, epochs=(0,), timeout=30)
    assert not [n for n in os.listdir(buf) if n.startswith(".tmp-") and int(n.rsplit("-", 1)[1]) in workers]
    assert d2.stop() == 0


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_status_reads_neither_a_fifo_nor_a_symlink(tmp_path, image_root):
    """`prefetchd status` (often run by root) returns at once whatever sits at status.json."""
    cfg = small_config(tmp_path, image_root)
    buf = tmp_path / "buffer"
    buf.mkdir(mode=0o700)
    _fifo(buf / "status.json")
    _fifo(buf / "daemon.lock")
    r = subprocess.run([sys.executable, "-m", "prefetchd", "status", "--config", cfg], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 3 and "no status in" in r.stdout, r.stdout + r.stderr  # 3: not known to run
    os.unlink(buf / "status.json")
    (tmp_path / "secret.json").write_text('{"format": "prefetchd-status", "pid": 4242}')
    os.symlink(tmp_path / "secret.json", buf / "status.json")
    r = subprocess.run([sys.executable, "-m", "prefetchd", "status", "--json", "--config", cfg], capture_output=True,
                       text=True, timeout=30)
    assert json.loads(r.stdout)["status"] is None, r.stdout
