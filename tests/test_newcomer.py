"""Issue 34: a newcomer's first hour. ``check`` tries what ``run`` does with the directories (as
the daemon's user); ``bench --root`` skips and counts the files it cannot decode; the messages a
newcomer meets name the keys and the values to set, in one line, without a traceback."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile

import pytest
import yaml
from conftest import small_config

NOBODY = pwd.getpwnam("nobody").pw_uid if os.geteuid() == 0 else None
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="acts as another user (nobody)")


def _run(*args: str, user: str | None = None, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefetchd", *args], capture_output=True, text=True,
                          timeout=timeout, user=user, **kw)


# --- item 3: check tries create, write and lock as the daemon's user ------------------------------


@pytest.fixture
def closed_parent():
    """A directory nobody may enter but not create in (root's, 0755), outside pytest's 0700 tmp."""
    d = tempfile.mkdtemp(prefix="prefetchd-closed-")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@needs_root
def test_check_says_what_run_refuses_a_buffer_dir_the_daemon_user_cannot_create(tmp_path, image_root, closed_parent):
    buf = os.path.join(closed_parent, "buffer")
    cfg = small_config(tmp_path, image_root, buffer={"dir": buf})
    r = _run("check", "--config", cfg, "--user", "nobody")
    problems = [x for x in r.stdout.splitlines() if x.startswith("problem:")]
    assert r.returncode == 1, r.stdout + r.stderr
    assert any(f"buffer.dir {buf}: nobody cannot create {buf} in {closed_parent} (root:root 0755): Permission denied"
               in p and "`prefetchd run` as nobody would fail" in p for p in problems), problems
    assert "deployment (daemon user nobody): 1 problem" in r.stdout, r.stdout  # progress.dir is not said again
    assert os.listdir(closed_parent) == []  # the trial left nothing behind
    assert _prepare_as(NOBODY, buf) == f"buffer.dir {buf}: cannot create it (permission denied)"  # as `run` fails


def _prepare_as(uid: int, buf: str) -> str:
    """What ``run``'s first step (``ring.prepare_dirs``) says as user ``uid`` (a forked child)."""
    from prefetchd.daemon.ring import prepare_dirs

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            prepare_dirs(buf, os.path.join(buf, "progress"))
            os.write(w, b"ok")
        except BaseException as e:
            os.write(w, str(e).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read().decode()
    os.waitpid(pid, 0)
    return out


@needs_root
def test_check_says_the_daemon_user_cannot_write_or_lock_an_existing_buffer(tmp_path, image_root, closed_parent):
    buf = os.path.join(closed_parent, "buffer")
    os.mkdir(buf, 0o700)
    os.chown(buf, NOBODY, -1)
    lock = os.path.join(buf, "daemon.lock")
    open(lock, "w").close()
    os.chmod(lock, 0o644)  # root's, left by a daemon that ran as root: nobody cannot open it to write
    r = _run("check", "--config", small_config(tmp_path, image_root, buffer={"dir": buf}), "--user", "nobody")
    problems = [x for x in r.stdout.splitlines() if x.startswith("problem:")]
    assert r.returncode == 1 and any(f"buffer.dir {buf}: nobody cannot take its lock ({lock}: Permission denied)"
                                     in p for p in problems), problems
    assert sorted(os.listdir(buf)) == ["daemon.lock"] and not os.path.exists(os.path.join(buf, "progress"))


def test_check_as_the_daemon_user_itself_creates_nothing(tmp_path, image_root):
    buf = tmp_path / "a" / "b" / "buffer"
    r = _run("check", "--config", small_config(tmp_path, image_root, buffer={"dir": str(buf)}))
    assert r.returncode == 0 and "no problems" in r.stdout, r.stdout + r.stderr
    assert not (tmp_path / "a").exists()


# --- item 2: bench --root skips and counts what it cannot decode ------------------------------------


def make_bad_folder(root: str) -> dict[str, str]:
    """3 classes x 8 JPEGs plus a JPEG cut in half, an empty file and a PNG named .JPEG (a user's own
    small dataset with the bad files users have). Returns the bad files by kind."""
    import io

    from PIL import Image

    from prefetchd.tools.samples import make_image_folder

    make_image_folder(root, classes=3, per_class=8, seed=1, long_side=120)
    c = sorted(os.listdir(root))
    bad = {"truncated": os.path.join(root, c[0], "cut.JPEG"), "empty": os.path.join(root, c[1], "empty.JPEG"),
           "png": os.path.join(root, c[2], "png.JPEG")}
    first = os.path.join(root, c[0], sorted(os.listdir(os.path.join(root, c[0])))[0])
    data = open(first, "rb").read()
    with open(bad["truncated"], "wb") as f:
        f.write(data[: len(data) // 2])
    open(bad["empty"], "wb").close()
    png = io.BytesIO()
    Image.new("RGB", (50, 40), (200, 10, 10)).save(png, "PNG")
    with open(bad["png"], "wb") as f:
        f.write(png.getvalue())
    return bad


def test_bench_root_skips_and_counts_files_it_cannot_decode(tmp_path):
    bad = make_bad_folder(str(tmp_path / "mine"))
    r = _run("bench", "--root", "mine", "--epochs", "1", "--batch-size", "8", "--workers", "2", "-q",
             cwd=str(tmp_path), timeout=300)  # a relative root, as a user types it
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout + r.stderr
    skipped = next(x for x in r.stdout.splitlines() if x.startswith("decode-only limit: skipped"))
    assert skipped.startswith("decode-only limit: skipped 2 files Pillow cannot decode"), skipped
    assert f"{bad['truncated']}: image file is truncated" in skipped and bad["empty"] in skipped, skipped
    line = next(x for x in r.stdout.splitlines() if x.startswith("[1/1] decode-only limit"))
    limit = line.split("decode-only limit (2 procs) ")[1].split(" img/s")[0]
    assert f"x the decode-only limit of {limit} img/s (Pillow decoding alone" in line, line


def test_bench_says_why_its_daemon_did_not_start(tmp_path):
    (tmp_path / "empty" / "a").mkdir(parents=True)
    r = _run("bench", "--root", str(tmp_path / "empty"), "--epochs", "1", "--workers", "1", "-q", timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("prefetchd bench: "), r.stderr


# --- item 5: each message names the keys and the values to set ---------------------------------------


def test_a_trainer_of_another_stream_is_told_which_keys_differ(tmp_path, image_root, daemon_factory):
    from prefetchd_client import PrefetchClient, PrefetchError

    cfg = small_config(tmp_path, image_root)
    d = daemon_factory(cfg)
    data = yaml.safe_load(open(cfg))
    data["loader"]["batch_size"] = 4
    data["augment"]["flip"] = False
    other = tmp_path / "trainer.yaml"
    other.write_text(yaml.safe_dump(data))
    with PrefetchClient(str(other), timeout=60) as c, pytest.raises(PrefetchError) as e:
        c.meta()
    msg = str(e.value)
    assert "(augment.flip false here, true in the daemon's config; loader.batch_size 4 here, 6 in the daemon's " \
           "config)" in msg, msg
    assert f"use the daemon's config file ({cfg}) or restart the daemon with this one" in msg, msg
    assert d.stop() == 0


def test_world_size_and_rank_mismatches_say_what_to_set(tmp_path, image_root, monkeypatch):
    from prefetchd_client import PrefetchClient

    from prefetchd.core.config import ConfigError

    cfg = small_config(tmp_path, image_root)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError) as e:
        PrefetchClient(cfg)
    assert str(e.value) == (f"loader.world_size is 1 in {cfg} but WORLD_SIZE=2 in the environment (the job's world "
                            "size): set loader.world_size: 2 and restart the daemon with that config (the stream "
                            "depends on it)")
    assert e.value.__cause__ is None and e.value.__suppress_context__ is False and e.value.__context__ is None
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ConfigError) as e:
        PrefetchClient(cfg)
    assert str(e.value).startswith("loader.ranks [0] does not include rank 1 (RANK=1 in the environment; ranks: all "
                                   f"at world size 1 in {cfg}): set loader.world_size to the job's world size"), e.value


def test_a_trainer_with_no_daemon_says_at_once_that_it_waits_and_how_long(tmp_path, image_root, caplog):
    import time

    from prefetchd_client import PrefetchClient, PrefetchTimeout

    cfg = small_config(tmp_path, image_root)
    t0 = time.time()
    with caplog.at_level("WARNING", logger="prefetchd_client"), PrefetchClient(cfg, timeout=3) as c, \
            pytest.raises(PrefetchTimeout):
        next(iter(c))
    said = [r for r in caplog.records if "no daemon holds" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    assert said[0].created - t0 < 1.5  # at once, not after the 3 s timeout
    assert f"no daemon holds {tmp_path / 'buffer'}" in said[0].getMessage()
    assert f"waiting up to 3 s (timeout=) for one to start: prefetchd run --config {cfg}" in said[0].getMessage()


def test_check_says_the_real_batch_size_when_the_batch_is_larger_than_the_set(tmp_path, image_root):
    r = _run("check", "--config", small_config(tmp_path, image_root, loader={"batch_size": 512, "drop_last": False,
                                                                            "epochs": 1}))
    assert r.returncode == 0, r.stdout + r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("stream: "))
    assert line.startswith("stream: 1 batch of 48 (loader.batch_size 512 is more than a rank's 48 samples: with "
                           "drop_last: false its one batch holds 48) per epoch"), line
    assert ", 1 epoch, " in line and "1 batches" not in r.stdout and "1 classes" not in r.stdout, r.stdout
    r = _run("check", "--config", small_config(tmp_path, image_root, loader={"batch_size": 10, "drop_last": False}))
    assert "stream: 5 batches of 10 (the last of 8) per epoch" in r.stdout, r.stdout


@pytest.mark.parametrize("text, line, words", [
    ("dataset:\n\troot: /x\n", "2, column 1 ('\\troot: /x')", "a tab: YAML indents with spaces only"),
    ("dataset:\n  root: /x: y\n", "2, column 11 ('  root: /x: y')", "a ':' where no key can start: a value holding ': ' must be quoted"),
    ("dataset:\n  root: /x\n loader: 3\n", "3, column 2 (' loader: 3')", "the indentation does not line up"),
    ("loader:\n  ranks: [0, 1\n", "2, column 10 ('  ranks: [0, 1')", "a list opened with '[' here is never closed"),
    ("dataset:\n  root: \"/x\n", "2, column 9 ('  root: \"/x')", "a quote opened here is never closed"),
])
def test_invalid_yaml_says_the_line_its_text_and_what_is_wrong(tmp_path, text, line, words):
    from prefetchd.core.config import ConfigError, load

    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        load(str(p))
    msg = str(e.value)
    assert f"{p}: invalid YAML at line {line}: {words}" in msg and "\n" not in msg, msg
    r = _run("check", "--config", str(p))
    assert r.returncode == 78 and r.stderr.count("\n") == 1 and f"invalid YAML at line {line}" in r.stderr, r.stderr


def test_status_piped_into_head_ends_quietly(tmp_path, image_root):
    cfg = small_config(tmp_path, image_root)
    r = subprocess.run(f"set -o pipefail; {sys.executable} -m prefetchd status --json --watch --interval 0.02 "
                       f"--config {cfg} | head -1", shell=True, executable="/bin/bash", capture_output=True, text=True,
                       timeout=60)
    assert r.stdout == "{\n" and r.stderr == "" and r.returncode == 141, (r.returncode, r.stderr)


def test_a_stopped_daemons_status_says_no_worker_is_about_to_start():
    import time

    from prefetchd.format.status import format_status

    rec = {"state": "stopped", "pid": 7, "updated": time.time() - 5, "worker_respawn_in_s": 0.0, "produced_batches": 1}
    text = format_status(rec, alive=False)
    assert "next worker starts" not in text and "(1 batch)" in text, text
    rec["state"] = "running"
    assert "the next worker starts in 0.0 s (back-off)" in format_status(rec, alive=True)


@needs_root
def test_check_that_cannot_act_as_the_daemon_user_judges_by_the_mode_bits(tmp_path, image_root, closed_parent,
                                                                           monkeypatch):
    from prefetchd.core.config import load
    from prefetchd.tools import deploy

    buf = os.path.join(closed_parent, "buffer")
    cfg = load(small_config(tmp_path, image_root, buffer={"dir": buf}))
    monkeypatch.setattr(deploy.os, "geteuid", lambda: 4242)  # a user that is neither root nor nobody
    problems = [x for x in deploy.check_deployment(cfg, deploy.Account.lookup("nobody"), []) if x.startswith("problem:")]
    assert problems == [f"problem: buffer.dir {buf} does not exist and nobody cannot create it in {closed_parent} "
                        f"(root:root 0755): `prefetchd run` as nobody would fail; the unit's RuntimeDirectory= must "
                        f"make it (docs/systemd.md), or make it yourself"], problems


@needs_root
def test_check_says_when_it_could_not_act_as_the_daemons_user(tmp_path, image_root, closed_parent, monkeypatch):
    """Where root cannot take another uid (a container without CAP_SETUID/CAP_SETGID: setgroups
    fails EPERM), the trial's child died before trying anything, the parent read no findings and
    returned none: check said "no problems" though neither the trial nor the mode bits (skipped
    for a process that can act as the user) judged the directory, and `run` as nobody fails."""
    from prefetchd.core.config import load
    from prefetchd.tools.deploy import Account, try_dirs

    def no_setgroups(groups):
        raise PermissionError(1, "Operation not permitted")

    buf = os.path.join(closed_parent, "buffer")
    cfg = load(small_config(tmp_path, image_root, buffer={"dir": buf}))
    monkeypatch.setattr(os, "setgroups", no_setgroups)  # the forked child inherits it
    found = try_dirs(cfg, Account.lookup("nobody"))
    assert len(found) == 1 and f"buffer.dir {buf}: check could not try it as nobody (PermissionError" in found[0], found
    assert "run `prefetchd check` as nobody" in found[0]
    monkeypatch.undo()
    assert "nobody cannot create" in try_dirs(cfg, Account.lookup("nobody"))[0]


def test_a_stopped_daemons_status_says_since_when_not_up():
    """A stopped daemon is not "up 9 s": its status says it stopped, when, and how long it ran;
    one that died without a final status says it was up so long at its last one."""
    import time

    from prefetchd.format.status import format_status

    at = time.time() - 30
    rec = {"state": "stopped", "pid": 7, "updated": at, "uptime_s": 9.0}
    first = format_status(rec, alive=False).splitlines()[0]
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))
    assert "up 9 s" not in first and f"stopped since {when} (30 s ago), after 9 s up" in first, first
    assert "not running" in first and "said 'stopped'" not in first, first
    killed = format_status({**rec, "state": "running"}, alive=False).splitlines()[0]
    assert f"up 9 s at its last status ({when}), then ended without a final one" in killed, killed
    assert format_status({**rec, "state": "running", "updated": time.time()}, alive=True).startswith(
        "prefetchd pid 7: running; up 9 s;")
