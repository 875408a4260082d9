"""``prefetchd launch -- CMD`` and ``prefetchd_client.serve()``: the real daemon for the life of a
command or a ``with`` block. Exit statuses, signals, a daemon killed and restarted under a running
trainer, starts that fail in one line, and nothing left behind after any of them."""

from __future__ import annotations

import configparser
import contextlib
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap
import threading

import psutil
import pytest
import yaml
from conftest import DaemonProc, small_config, wait_until

from prefetchd.format import status
from prefetchd.tools import groupsignals, launch

ROOT = pathlib.Path(__file__).resolve().parent.parent

# CMD for the tests: reads EPOCHS epochs through the client (the config from $PREFETCHD_CONFIG),
# notes the daemon's pid and what it saw, and exits with argv[1]; KILL_AT kills the daemon there.
TRAINER = textwrap.dedent("""
    import os, signal, sys, json
    from prefetchd.format import status
    from prefetchd_client import PrefetchClient
    out = sys.argv[2]
    seen = []
    with PrefetchClient(as_numpy=True, timeout=60) as loader:
        pids = [status.lock_pid(loader.dir)]
        for epoch in range(2):
            for x, y in loader:
                seen.append([loader.last_batch.epoch, loader.last_batch.batch])
                if len(seen) == int(os.environ.get("KILL_AT", "-1")):
                    os.kill(pids[0], signal.SIGKILL)
        pids.append(status.lock_pid(loader.dir))
    json.dump({"config": os.environ["PREFETCHD_CONFIG"], "seen": seen, "pids": pids}, open(out, "w"))
    sys.exit(int(sys.argv[1]))
""")

# CMD that waits for signals: SIGHUP is noted in a file; SIGINT and SIGTERM keep their defaults
WAITER = textwrap.dedent("""
    import os, signal, sys, time
    from prefetchd.format import status
    out = sys.argv[1]
    signal.signal(signal.SIGHUP, lambda s, f: open(out + ".hup", "a").write("HUP\\n"))
    import yaml
    buf = yaml.safe_load(open(os.environ["PREFETCHD_CONFIG"]))["buffer"]["dir"]
    open(out, "w").write(str(status.lock_pid(buf)))
    while True:
        time.sleep(0.05)
""")

# CMD that says it started (argv[1] + ".started"), waits for argv[1] to appear, then reads an
# epoch through the client and writes the batches it saw to argv[2]
LATE = textwrap.dedent("""
    import json, os, sys, time
    open(sys.argv[1] + ".started", "w").close()
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.05)
    from prefetchd_client import PrefetchClient
    with PrefetchClient(as_numpy=True, timeout=60) as loader:
        seen = [[loader.last_batch.epoch, loader.last_batch.batch] for _ in loader]
    json.dump(seen, open(sys.argv[2], "w"))
""")

# CMD that waits for argv[1] to appear, then exits 0
UNTIL = ("import os, sys, time\nopen(sys.argv[1] + '.started', 'w').close()\n"
         "while not os.path.exists(sys.argv[1]):\n    time.sleep(0.05)\n")


# CMD that saves a checkpoint (argv[1]) on its first stop signal and aborts without it on a second,
# as a trainer that takes a second Ctrl-C or SIGTERM as "abort now" does (torchrun's shutdown
# breaks on one); the signals it saw go to argv[1] + ".seen", and a saved checkpoint exits 7
CHECKPOINTER = textwrap.dedent("""
    import json, os, signal, sys, time
    out, seen = sys.argv[1], []
    def on_stop(signum, frame):
        seen.append(signum)
        if len(seen) > 1:
            json.dump(seen, open(out + ".seen", "w"))
            os._exit(9)
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, on_stop)
    open(out + ".started", "w").close()
    while not seen:
        time.sleep(0.01)
    saved_at = time.monotonic() + 1.5  # the save takes its time: a second signal lands in it
    while time.monotonic() < saved_at:
        time.sleep(0.01)
    open(out, "w").write("checkpoint")
    json.dump(seen, open(out + ".seen", "w"))
    sys.exit(7)
""")

# argv: a terminal's path, then a command: made the controlling terminal of a new session (whose
# foreground group the command is), with stdin elsewhere, as `prefetchd launch ... < /dev/null`
# typed in a terminal
ON_A_TERMINAL = "import os, sys\nos.setsid()\nos.close(os.open(sys.argv[1], os.O_RDWR))\nos.execv(sys.argv[2], sys.argv[2:])\n"


def _launch(tmp_path, config: str | None, *cmd: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "prefetchd", "launch", *(["--config", config] if config else []),
                             "--", *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, **(env or {})})


def _finish(p: subprocess.Popen, timeout: float = 90) -> tuple[int, str, str]:
    try:
        out, err = p.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return p.returncode, out, err


def _script(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _assert_nothing_left(buffer_dir: str, pids) -> None:
    assert not os.path.exists(buffer_dir), os.listdir(buffer_dir)
    for pid in pids:
        if pid is None:
            continue
        gone = not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        assert gone, f"process {pid} is still there"


@pytest.fixture
def cfg(tmp_path, image_root):
    return small_config(tmp_path, image_root)


@pytest.mark.parametrize("code", [0, 3])
def test_launch_runs_the_command_against_a_ready_daemon_and_exits_with_its_status(tmp_path, cfg, code):
    out = str(tmp_path / "seen.json")
    rc, _, err = _finish(_launch(tmp_path, cfg, sys.executable, _script(tmp_path, "t.py", TRAINER), str(code), out))
    assert rc == code, err
    seen = yaml.safe_load(open(out))
    assert seen["config"] == cfg
    assert len(seen["seen"]) == 16 and seen["pids"][0] == seen["pids"][1]
    _assert_nothing_left(str(tmp_path / "buffer"), seen["pids"])
    assert "prefetchd launch" not in err  # nothing went wrong, nothing said


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_launch_forwards_signals_and_exits_128_plus_the_signal(tmp_path, cfg, sig):
    out = str(tmp_path / "waiter")
    p = _launch(tmp_path, cfg, sys.executable, _script(tmp_path, "w.py", WAITER), out)
    wait_until(lambda: os.path.exists(out) and open(out).read(), 60, "the command to run")
    daemon_pid = int(open(out).read())
    p.send_signal(signal.SIGHUP)  # forwarded: the command notes it and runs on
    wait_until(lambda: os.path.exists(out + ".hup"), 20, "SIGHUP to reach the command")
    assert p.poll() is None
    p.send_signal(sig)
    rc, _, err = _finish(p)
    assert rc == 128 + sig, err
    assert "the command left" not in err, err  # its daemon is not something the command left running
    _assert_nothing_left(str(tmp_path / "buffer"), [daemon_pid])


@pytest.mark.parametrize("how, sig", [
    ("a terminal's Ctrl-C", signal.SIGINT),
    ("to launch's process group", signal.SIGINT),
    ("to launch's process group", signal.SIGTERM),  # Slurm's proctrack/pgid, timeout, kill -TERM -PGID
    ("to every process, one after another", signal.SIGTERM),  # Slurm's proctrack/cgroup, KillMode=control-group
    ("to launch alone", signal.SIGTERM),  # kill PID, a container's PID 1
    ("to launch alone", signal.SIGINT),
])
def test_the_command_sees_each_stop_once_whoever_sends_it(tmp_path, cfg, how, sig):
    """With stdin not a terminal (a script, nohup, CI), a stop signal that reached launch's process
    group (the command's) was forwarded again: the trainer got two KeyboardInterrupts, or two
    SIGTERMs under scancel, and the second landed in its checkpoint's save. Each stop is seen
    once, the checkpoint written, and launch exits with the command's status."""
    out = tmp_path / "ckpt"
    argv = [sys.executable, "-m", "prefetchd", "launch", "--config", cfg, "--", sys.executable,
            _script(tmp_path, "c.py", CHECKPOINTER), str(out)]
    master = None
    if how == "a terminal's Ctrl-C":
        master, slave = os.openpty()
        argv = [sys.executable, "-c", ON_A_TERMINAL, os.ttyname(slave), *argv]
        os.close(slave)
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    else:
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        wait_until(lambda: os.path.exists(f"{out}.started"), 60, "the command to run")
        daemon_pid = status.lock_pid(str(tmp_path / "buffer"))
        if master is not None:
            os.write(master, b"\x03")  # the terminal signals its foreground group
        elif how == "to launch's process group":
            os.killpg(p.pid, sig)
        elif how == "to every process, one after another":
            for proc in [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]:
                os.kill(proc.pid, sig)
        else:
            p.send_signal(sig)
        rc, _, err = _finish(p)
    finally:
        if master is not None:
            os.close(master)
    assert json.loads(open(f"{out}.seen").read()) == [sig], err
    assert out.read_text() == "checkpoint"
    assert rc == 7, err
    assert "the command left" not in err, err
    _assert_nothing_left(str(tmp_path / "buffer"), [daemon_pid])


def test_the_witness_reads_proc_status_masks_and_goes_with_launch_even_when_it_is_killed(tmp_path, cfg):
    """The witness that tells a group's signal from launch's own blocks the stop signals and lives
    only as long as launch: killed outright (SIGKILL), launch leaves no witness behind."""
    text = "Name:\tx\nSigPnd:\t0000000000000000\nShdPnd:\t0000000000004002\nSigBlk:\t0000000000004003\n"
    assert groupsignals.signal_mask(text, "ShdPnd") == {signal.SIGINT, signal.SIGTERM}
    assert groupsignals.signal_mask(text, "SigBlk") == {signal.SIGHUP, signal.SIGINT, signal.SIGTERM}
    assert groupsignals.signal_mask(text, "SigPnd") == set()
    out = str(tmp_path / "waiter")
    p = _launch(tmp_path, cfg, sys.executable, _script(tmp_path, "w.py", WAITER), out)
    try:
        wait_until(lambda: os.path.exists(out) and open(out).read(), 60, "the command to run")
        witness = [c for c in psutil.Process(p.pid).children() if "sigtimedwait" in " ".join(c.cmdline())]
        assert len(witness) == 1, [c.cmdline() for c in psutil.Process(p.pid).children()]
        assert os.getpgid(witness[0].pid) == p.pid  # in launch's group, the command's
        with open(f"/proc/{witness[0].pid}/status") as f:
            assert set(launch.FORWARDED) <= groupsignals.signal_mask(f.read(), "SigBlk")
        os.kill(p.pid, signal.SIGKILL)
        wait_until(lambda: not psutil.pid_exists(witness[0].pid)
                   or psutil.Process(witness[0].pid).status() == psutil.STATUS_ZOMBIE, 20, "the witness to go")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)  # the command, left running by a launch killed outright
        _finish(p)


def test_a_second_stop_signal_kills_a_command_that_ignores_the_first(tmp_path, cfg):
    """A command that ignores SIGTERM (or takes its time on it) kept launch waiting for ever: a
    second SIGTERM or Ctrl-C now kills it (one line), and the daemon goes as after any command."""
    out = str(tmp_path / "waiter")
    stubborn = WAITER.replace("signal.signal(signal.SIGHUP,", "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                              "signal.signal(signal.SIGHUP,")
    p = _launch(tmp_path, cfg, sys.executable, _script(tmp_path, "w.py", stubborn), out)
    wait_until(lambda: os.path.exists(out) and open(out).read(), 60, "the command to run")
    daemon_pid = int(open(out).read())
    p.send_signal(signal.SIGTERM)
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(1.5)  # ignored: launch waits, as it should for a command saving its checkpoint
    p.send_signal(signal.SIGTERM)
    rc, _, err = _finish(p, 30)
    assert rc == 128 + signal.SIGKILL, err
    assert "a second stop signal (SIGTERM): killing the command (pid " in err, err
    _assert_nothing_left(str(tmp_path / "buffer"), [daemon_pid])


def test_a_daemon_killed_while_the_command_runs_is_restarted_and_the_command_reads_on(tmp_path, cfg):
    out = str(tmp_path / "seen.json")
    p = _launch(tmp_path, cfg, sys.executable, _script(tmp_path, "t.py", TRAINER), "0", out, env={"KILL_AT": "5"})
    rc, _, err = _finish(p)
    assert rc == 0, err
    seen = yaml.safe_load(open(out))
    assert seen["seen"] == [[e, b] for e in range(2) for b in range(8)]  # every batch, once, in order
    first, second = seen["pids"]
    assert first != second
    assert f"the daemon (pid {first}) was killed by SIGKILL while the command runs; restarting it in 2 s" in err
    assert "started the daemon again" in err
    _assert_nothing_left(str(tmp_path / "buffer"), [first, second])


def test_a_bad_config_is_one_line_and_78_and_the_command_never_runs(tmp_path, image_root):
    marker = tmp_path / "ran"
    bad = small_config(tmp_path, image_root, buffer={"capacity": 0})
    rc, _, err = _finish(_launch(tmp_path, bad, "touch", str(marker)))
    assert rc == 78
    assert err.splitlines() == ["prefetchd launch: configuration error: buffer.capacity must be a positive "
                                "integer, got 0"], err
    assert not marker.exists() and not (tmp_path / "buffer").exists()


def test_a_dataset_the_daemon_refuses_is_its_one_line_and_78(tmp_path):
    marker = tmp_path / "ran"
    bad = small_config(tmp_path, str(tmp_path / "no-such-dataset"))
    rc, _, err = _finish(_launch(tmp_path, bad, "touch", str(marker)))
    assert rc == 78, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("prefetchd launch: the daemon exited (status 78) before it was "
                                                   "ready: ") and "no-such-dataset" in lines[0], err
    assert not marker.exists() and not (tmp_path / "buffer").exists()


def test_a_stop_signal_while_the_daemon_starts_stops_it_before_the_command_runs(tmp_path, cfg):
    stuck = tmp_path / "stuck"
    stuck.write_text("")  # the daemon's loop blocks before its first READY=1
    marker = tmp_path / "ran"
    p = _launch(tmp_path, cfg, "touch", str(marker), env={"PREFETCHD_FAULT_STUCK_LOOP": str(stuck)})
    wait_until(lambda: status.lock_pid(str(tmp_path / "buffer")), 60, "the daemon to take the buffer")
    daemon_pid = status.lock_pid(str(tmp_path / "buffer"))
    p.send_signal(signal.SIGTERM)
    rc, _, err = _finish(p)
    assert rc == 128 + signal.SIGTERM, err
    assert not marker.exists()
    _assert_nothing_left(str(tmp_path / "buffer"), [daemon_pid])


def test_a_daemon_never_ready_is_one_line_and_1_after_the_ready_timeout(tmp_path, cfg):
    stuck = tmp_path / "stuck"
    stuck.write_text("")
    marker = tmp_path / "ran"
    p = subprocess.Popen([sys.executable, "-m", "prefetchd", "launch", "--config", cfg, "--ready-timeout", "3", "--",
                          "touch", str(marker)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, env={**os.environ, "PREFETCHD_FAULT_STUCK_LOOP": str(stuck)})
    rc, _, err = _finish(p)
    assert rc == 1 and not marker.exists()
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("prefetchd launch: the daemon was not ready within 3 s"), err
    _assert_nothing_left(str(tmp_path / "buffer"), [])


def test_no_config_at_all_is_a_usage_error(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PREFETCHD_CONFIG"}
    p = subprocess.run([sys.executable, "-m", "prefetchd", "launch", "--", "true"], capture_output=True, text=True,
                       env=env, timeout=60)
    assert p.returncode == 2 and "PREFETCHD_CONFIG is not set" in p.stderr


def test_a_daemon_serving_the_buffer_is_used_or_refused_and_left_alone(tmp_path, image_root, cfg):
    d = DaemonProc(cfg, str(tmp_path / "other.log"))
    try:
        wait_until(lambda: status.read_json(str(tmp_path / "buffer"), status.META_NAME), 60, "the other daemon")
        other = tmp_path / "other"
        other.mkdir()
        clash = small_config(other, image_root, loader={"batch_size": 4}, buffer={"dir": str(tmp_path / "buffer")})
        marker = tmp_path / "ran"
        rc, _, err = _finish(_launch(tmp_path, clash, "touch", str(marker)))
        assert rc == 1 and not marker.exists()
        assert err.splitlines() == [f"prefetchd launch: another prefetchd (pid {d.pid}) already serves "
                                    f"{tmp_path / 'buffer'} with loader.batch_size 6, not 4 as in {clash}; stop it, "
                                    f"or set another buffer.dir"], err
        seed = small_config(other, image_root, loader={"seed": 8}, buffer={"dir": str(tmp_path / "buffer")})
        rc, _, err = _finish(_launch(tmp_path, seed, "touch", str(marker)))
        assert rc == 1 and not marker.exists()
        assert "with a different stream than" in err and len(err.splitlines()) == 1, err
        rc, _, err = _finish(_launch(tmp_path, cfg, "touch", str(marker)))  # the same config: used as it is
        assert rc == 0 and marker.exists()
        assert f"using the daemon already serving {tmp_path / 'buffer'} (pid {d.pid}); it is left running" in err
        assert d.proc.poll() is None and status.daemon_alive(str(tmp_path / "buffer"))
    finally:
        assert d.stop() == 0


def test_a_command_that_cannot_run_is_127_and_the_daemon_is_stopped(tmp_path, cfg):
    rc, _, err = _finish(_launch(tmp_path, cfg, str(tmp_path / "no-such-command")))
    assert rc == 127 and "no such command" in err
    _assert_nothing_left(str(tmp_path / "buffer"), [])


def test_restarts_follow_the_shipped_unit():
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read(ROOT / "systemd" / "prefetchd.service")
    assert float(unit["Service"]["RestartSec"]) == launch.RESTART_SEC
    assert unit["Service"]["Restart"] == "on-failure"
    assert int(unit["Service"]["RestartPreventExitStatus"]) in launch.NO_RESTART
    assert float(unit["Unit"]["StartLimitIntervalSec"]) == launch.START_LIMIT_INTERVAL_S
    assert int(unit["Unit"]["StartLimitBurst"]) == launch.START_LIMIT_BURST
    r = launch.Restarts()
    r.started(0.0)
    assert r.after_exit(78, 1.0)[0] is None and r.after_exit(0, 1.0)[0] is None
    when = [0.0]
    for _ in range(4):  # 5 starts in all
        when, _why = r.after_exit(-9, when if isinstance(when, float) else 1.0)
        assert when is not None
        r.started(when)
    assert r.after_exit(1, when)[0] is None  # the sixth within 300 s is not made
    assert r.after_exit(1, when + 400)[0] is not None  # later, it is


# --- prefetchd_client.serve(): the same rules from Python ---------------------------------------


def _read_epoch(n: int = 8) -> list[tuple[int, int]]:
    from prefetchd_client import PrefetchClient

    with PrefetchClient(as_numpy=True, timeout=60) as loader:  # the config from $PREFETCHD_CONFIG
        return [(loader.last_batch.epoch, loader.last_batch.batch) for _ in zip(range(n), loader, strict=False)]


def test_serve_runs_the_daemon_for_the_block_and_again_in_the_same_process(tmp_path, cfg, monkeypatch):
    from prefetchd_client import serve

    monkeypatch.delenv("PREFETCHD_CONFIG", raising=False)
    pids = []
    for _ in range(2):
        with serve(cfg) as served:
            assert not served.reused and os.environ["PREFETCHD_CONFIG"] == cfg
            assert status.daemon_alive(str(tmp_path / "buffer"))
            assert _read_epoch() == [(0, b) for b in range(8)]
            pids.append(served.pid)
        assert "PREFETCHD_CONFIG" not in os.environ
        _assert_nothing_left(str(tmp_path / "buffer"), pids)
    assert pids[0] != pids[1]


def test_ctrl_c_in_the_block_stops_the_daemon_and_the_cell_runs_again(tmp_path, cfg):
    from prefetchd_client import serve

    with pytest.raises(KeyboardInterrupt):
        with serve(cfg) as served:
            first = served.pid
            os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C (or Jupyter's interrupt) does
            wait_until(lambda: False, 10, "KeyboardInterrupt")
    _assert_nothing_left(str(tmp_path / "buffer"), [first])
    with serve(cfg) as served:
        assert _read_epoch(2) == [(0, 0), (0, 1)]
    _assert_nothing_left(str(tmp_path / "buffer"), [first, served.pid])


def test_a_trainer_killed_with_sigkill_takes_its_served_daemon_with_it(tmp_path, cfg):
    """A threaded trainer (the client's threads, torch's) killed outright runs no clean-up: the
    daemon it started goes all the same, sent SIGTERM by the kernel (asked for by the daemon
    itself: no ``preexec_fn`` runs in the threaded parent)."""
    out = tmp_path / "pid"
    script = _script(tmp_path, "trainer.py", textwrap.dedent(f"""
        import os, threading, time
        from prefetchd_client import serve
        for _ in range(4):  # a trainer has threads when it starts the daemon
            threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
        with serve({cfg!r}) as served:
            open({str(out)!r}, "w").write(str(served.pid))
            time.sleep(600)
    """))
    p = subprocess.Popen([sys.executable, script], start_new_session=True)
    try:
        wait_until(lambda: out.exists() and out.read_text(), 60, "the daemon started by serve()")
        pid = int(out.read_text())
        assert psutil.Process(pid).environ().get("PREFETCHD_DIE_WITH_PARENT") == str(p.pid)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        wait_until(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, 30,
                   "the daemon of a trainer killed with SIGKILL to exit")
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_serve_refuses_a_bad_start_in_one_line(tmp_path, image_root):
    from prefetchd_client import DaemonStartError, serve

    for root, sections, code, words in [(image_root, {"buffer": {"capacity": 0}}, 78, "buffer.capacity"),
                                        (str(tmp_path / "nothing-here"), {}, 78, "nothing-here")]:
        bad = small_config(tmp_path, root, **sections)
        with pytest.raises(DaemonStartError) as e:
            with serve(bad):
                raise AssertionError("the block ran")
        assert e.value.exit_code == code and words in str(e.value) and "\n" not in str(e.value)
        assert not (tmp_path / "buffer").exists()


def test_serve_refuses_a_buffer_another_stream_is_served_from(tmp_path, image_root, cfg):
    from prefetchd_client import DaemonStartError, serve

    d = DaemonProc(cfg, str(tmp_path / "other.log"))
    try:
        wait_until(lambda: status.read_json(str(tmp_path / "buffer"), status.META_NAME), 60, "the other daemon")
        other = tmp_path / "other"
        other.mkdir()
        clash = small_config(other, image_root, augment={"output_size": 32}, buffer={"dir": str(tmp_path / "buffer")})
        with pytest.raises(DaemonStartError, match=r"augment.output_size 64, not 32") as e:
            with serve(clash):
                raise AssertionError("the block ran")
        assert e.value.exit_code == 1
        with serve(cfg) as served:  # the same stream: used, and left running
            assert served.reused and served.pid == d.pid
        assert d.proc.poll() is None
    finally:
        assert d.stop() == 0


def test_the_client_without_a_config_path_says_how_to_give_one(monkeypatch, cfg):
    from prefetchd_client import PrefetchClient, PrefetchError

    monkeypatch.delenv("PREFETCHD_CONFIG", raising=False)
    with pytest.raises(PrefetchError, match=r"no config given and \$PREFETCHD_CONFIG is not set"):
        PrefetchClient()
    monkeypatch.setenv("PREFETCHD_CONFIG", cfg)
    client = PrefetchClient(as_numpy=True, timeout=1)  # no daemon needed to build one
    assert client.cfg.source == cfg
    client.close()


def test_launch_and_serve_import_neither_torch_nor_the_daemon():
    """The supervisor stays small: importing it costs no torch (seconds, hundreds of MB) and,
    for serve(), nothing of the daemon."""
    code = ("import sys, prefetchd.tools.launch, prefetchd_client; from prefetchd_client import serve; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('prefetchd.daemon', "
            "'prefetchd.executors', 'PIL', 'cv2'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_clean_up_removes_only_what_this_start_made(tmp_path, image_root, cfg):
    """Two jobs' rings under one parent that neither found: the first to finish removes its own
    ring, not the parent the other still uses; a ring a daemon holds is never removed."""
    from types import SimpleNamespace

    from prefetchd_client.child import Created

    def fake(buffer_dir: str):
        return SimpleNamespace(buffer=SimpleNamespace(dir=buffer_dir), progress_dir=buffer_dir + "/progress")

    parent = tmp_path / "shm" / "job"
    a, b = Created.before_start(fake(str(parent / "a"))), None
    (parent / "a" / "progress").mkdir(parents=True)
    b = Created.before_start(fake(str(parent / "b")))
    (parent / "b" / "progress").mkdir(parents=True)
    (parent / "b" / "r0000-e000000-b00000000.batch").write_bytes(b"x")
    a.remove()
    assert not (parent / "a").exists() and (parent / "b" / "r0000-e000000-b00000000.batch").exists()
    b.remove()
    assert not any(parent.iterdir())  # b found the parents made: an empty directory is all that is left
    Created.before_start(fake(str(tmp_path / "shm2" / "a"))).remove()  # nothing was made: nothing goes wrong
    alone = Created.before_start(fake(str(tmp_path / "shm2" / "a")))
    (tmp_path / "shm2" / "a" / "progress").mkdir(parents=True)
    alone.remove()
    assert not (tmp_path / "shm2").exists()  # alone, a start removes the parents it made

    held = Created.before_start(fake(str(tmp_path / "buffer")))  # before the daemon below made it
    d = DaemonProc(cfg, str(tmp_path / "held.log"))
    try:
        wait_until(lambda: status.daemon_alive(str(tmp_path / "buffer")), 60, "the daemon to hold its buffer")
        held.remove()
        assert (tmp_path / "buffer" / status.LOCK_NAME).exists()
    finally:
        assert d.stop() == 0


def test_a_ctrl_c_as_the_daemon_process_is_made_leaves_no_daemon(tmp_path, cfg, monkeypatch):
    """A notebook's interrupt that lands inside ``Popen`` (after the fork, before the pid is
    kept) used to lose the child: the daemon ran on, and the cell run again used it."""
    import prefetchd_client.child as child
    from prefetchd_client import serve

    made = []
    real = subprocess.Popen

    def popen_then_ctrl_c(*args, **kwargs):
        p = real(*args, **kwargs)
        made.append(p.pid)
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C lands here; the sleep is where Python raises it
        for _ in range(20):
            __import__("time").sleep(0.01)
        return p

    monkeypatch.setattr(child.subprocess, "Popen", popen_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        with serve(cfg):
            raise AssertionError("the block ran")
    assert made
    _assert_nothing_left(str(tmp_path / "buffer"), made)


def test_what_the_command_left_running_is_ended_with_it(tmp_path, cfg):
    """CMD that starts a background job (its grandchild, a shell's ``&``) and exits: the job is
    orphaned to launch (a subreaper) and ended, not left running after launch, as under Slurm."""
    pidfile = tmp_path / "bg"
    script = f"sleep 300 & echo $! > {pidfile}; (sleep 1 &); sleep 2; exit 5"
    rc, _, err = _finish(_launch(tmp_path, cfg, "sh", "-c", script))
    assert rc == 5, err
    left = int(pidfile.read_text())
    assert "the command left 1 process(es) running" in err, err
    _assert_nothing_left(str(tmp_path / "buffer"), [left])


def test_launch_from_a_deleted_directory(tmp_path, cfg):
    """The daemon runs in / (as under systemd), not in the caller's directory: started from a
    directory deleted since, it used to fail after 60 s (its forkserver could not start there).
    A relative config path there is one line and 78, not a traceback."""
    gone = tmp_path / "gone"
    for config, want in ((cfg, 0), ("rel.yaml", 78)):
        gone.mkdir()
        shutil.copy(cfg, gone / "rel.yaml")
        p = subprocess.Popen([sys.executable, "-m", "prefetchd", "launch", "--config", config, "--ready-timeout", "50",
                              "--", "true"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=gone,
                             start_new_session=True)
        shutil.rmtree(gone)
        rc, _, err = _finish(p)
        assert rc == want, err
        if want:
            assert len(err.splitlines()) == 1 and "give its absolute path" in err, err
    _assert_nothing_left(str(tmp_path / "buffer"), [])


@pytest.mark.parametrize("value", ["1", "abc"])
def test_a_daemon_started_by_hand_with_the_parent_variable_set_says_why_it_will_not_run(tmp_path, cfg, value):
    """PREFETCHD_DIE_WITH_PARENT is serve()'s, naming the trainer that starts the daemon: one set by
    hand (or naming another process than the daemon's parent) is said in one line, exit 78. On the
    tree before, a pid not the parent's exited 0 without a word, and a non-number was ignored."""
    d = DaemonProc(cfg, str(tmp_path / "daemon.log"), env={"PREFETCHD_DIE_WITH_PARENT": value})
    try:
        rc = d.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        d.kill_group()
    assert rc == 78, (rc, d.log())
    assert "PREFETCHD_DIE_WITH_PARENT" in d.log() and "unset it" in d.log(), d.log()


def _command_ended(launch_pid: int, daemon_pid: int) -> bool:
    """The launch's command has exited and been reaped: the daemon is its only child left."""
    return [c.pid for c in psutil.Process(launch_pid).children()] == [daemon_pid]


def _end_command(launch_pid: int, until: pathlib.Path, daemon_pid: int) -> None:
    """End the launch's UNTIL command, once it runs (before, while the launch waits for its daemon's
    READY=1, the daemon is its only child too), and wait until it has been reaped."""
    wait_until(lambda: os.path.exists(f"{until}.started"), 60, "the launch's command to start")
    until.touch()
    wait_until(lambda: _command_ended(launch_pid, daemon_pid), 30, "the launch's command to end")


@pytest.mark.parametrize("how", ["the guest ends", "a stop signal"])
def test_the_launch_that_started_the_daemon_waits_for_a_launch_using_it(tmp_path, cfg, how):
    """Two launches of one config: the second uses the first's daemon. The first's command ends
    first: the first launch says who still uses the daemon and waits, the daemon serving on, and
    the second's trainer reads its epoch; when the second ends (or a stop signal comes) the first
    stops the daemon and leaves nothing. It was stopped at once, and the second's trainer timed out."""
    buf = str(tmp_path / "buffer")
    a_done, go, seen = tmp_path / "a-done", tmp_path / "go", tmp_path / "seen.json"
    first = _launch(tmp_path, cfg, sys.executable, _script(tmp_path, "until.py", UNTIL), str(a_done))
    second = None
    try:
        wait_until(lambda: status.daemon_alive(buf) is True and status.read_json(buf, status.META_NAME), 60,
                   "the first launch's daemon")
        daemon = status.lock_pid(buf)
        second = _launch(tmp_path, cfg, sys.executable, _script(tmp_path, "late.py", LATE), str(go), str(seen))
        wait_until(lambda: os.path.exists(f"{go}.started"), 60, "the second launch's command")
        _end_command(first.pid, a_done, daemon)
        if how == "a stop signal":
            first.send_signal(signal.SIGTERM)
            rc, _, err = _finish(first)
            assert rc == 0, err  # its command's status
            assert f"the daemon (pid {daemon}) is still used by pid {second.pid} (" in err, err
            assert not psutil.pid_exists(daemon) or psutil.Process(daemon).status() == psutil.STATUS_ZOMBIE
            return
        go.touch()  # the second's trainer reads now, after the first's command ended
        rc2, _, err2 = _finish(second)
        assert rc2 == 0, err2
        assert f"using the daemon already serving {buf} (pid {daemon}); it is left running, and held until this " \
               f"launch ends (one that started it waits for that before stopping it)" in err2, err2
        assert json.loads(seen.read_text()) == [[0, b] for b in range(8)]
        rc, _, err = _finish(first)
        assert rc == 0, err
        assert f"the daemon (pid {daemon}) is still used by pid {second.pid} (" in err, err
        assert err.count("is still used by") == 1, err
        _assert_nothing_left(buf, [daemon])
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)


def test_serve_waits_for_a_launch_using_its_daemon_and_uses_a_launchs_daemon_itself(tmp_path, cfg, caplog):
    """serve() in both roles: as the starter its block's end waits for a launch that found its
    daemon (and says so in one log line); as a guest of a launch's daemon it holds it, and the
    launch stops the daemon only when the block ends."""
    from prefetchd_client import serve

    buf = str(tmp_path / "buffer")
    go, seen = tmp_path / "go", tmp_path / "seen.json"
    with serve(cfg) as served:
        guest = _launch(tmp_path, cfg, sys.executable, _script(tmp_path, "late.py", LATE), str(go), str(seen))
        wait_until(lambda: os.path.exists(f"{go}.started"), 60, "the launch's command")
        threading.Timer(0.5, go.touch).start()
    # the block ended only after the launch did
    assert guest.poll() == 0 and json.loads(seen.read_text()) == [[0, b] for b in range(8)]
    assert any(f"is still used by pid {guest.pid} (" in r.getMessage() for r in caplog.records), caplog.text
    _assert_nothing_left(buf, [served.pid])

    a_done = tmp_path / "a-done"
    owner = _launch(tmp_path, cfg, sys.executable, _script(tmp_path, "until.py", UNTIL), str(a_done))
    try:
        wait_until(lambda: status.daemon_alive(buf) is True and status.read_json(buf, status.META_NAME), 60,
                   "the launch's daemon")
        daemon = status.lock_pid(buf)
        with serve(cfg) as served:
            assert served.reused and served.pid == daemon
            _end_command(owner.pid, a_done, daemon)
            assert owner.poll() is None and status.daemon_alive(buf) is True
            assert _read_epoch() == [(0, b) for b in range(8)]
        rc, _, err = _finish(owner)
        assert rc == 0 and f"is still used by pid {os.getpid()} (" in err, err
        _assert_nothing_left(buf, [daemon])
    finally:
        if owner.poll() is None:
            os.killpg(owner.pid, signal.SIGKILL)


# `prefetchd launch` (argv: config, CMD...) whose first look at the buffer came too early: it found
# no daemon, as a launch started at the same moment as another does, and the other's is there now
LOOKED_TOO_EARLY = textwrap.dedent("""
    import sys
    from prefetchd_client import child
    from prefetchd.tools import groupsignals, launch
    real, looks = child.running_daemon, []
    def too_early(cfg):
        looks.append(cfg)
        return None if len(looks) == 1 else real(cfg)
    child.running_daemon = too_early
    sys.exit(launch.run_launch(sys.argv[1], sys.argv[2:], 120))
""")


def test_of_two_launches_started_at_once_the_one_whose_daemon_lost_uses_the_others(tmp_path, cfg, daemon_factory):
    """Two launches of one config at the same moment: both found no daemon and started one; only
    one can hold the buffer, and the other launch failed (exit 1, "another prefetchd already
    serves") before its command ran. It uses the daemon that won, as a guest, and leaves it running."""
    buf = str(tmp_path / "buffer")
    other = daemon_factory(cfg)  # the other launch's
    wait_until(lambda: status.daemon_alive(buf) is True and status.read_json(buf, status.META_NAME), 60, "the daemon")
    go, seen = tmp_path / "go", tmp_path / "seen.json"
    go.touch()
    p = subprocess.Popen([sys.executable, "-c", LOOKED_TOO_EARLY, cfg, sys.executable,
                          _script(tmp_path, "late.py", LATE), str(go), str(seen)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    rc, _, err = _finish(p)
    assert rc == 0, err
    assert f"using the daemon already serving {buf} (pid {other.pid}), started at the same time as this " \
           f"launch's;" in err, err
    assert json.loads(seen.read_text()) == [[0, b] for b in range(8)]
    assert other.proc.poll() is None and status.lock_pid(buf) == other.pid  # not its own: left running


def test_of_two_serve_blocks_started_at_once_the_one_whose_daemon_lost_uses_the_others(tmp_path, cfg, daemon_factory,
                                                                                      monkeypatch):
    """serve() as the launch above: the block ran against the daemon that won (it raised "another
    prefetchd already serves")."""
    from prefetchd_client import child, serve

    buf = str(tmp_path / "buffer")
    other = daemon_factory(cfg)
    wait_until(lambda: status.daemon_alive(buf) is True and status.read_json(buf, status.META_NAME), 60, "the daemon")
    real, looks = child.running_daemon, []

    def too_early(c):  # the first look found none, as a start at the same moment as another does
        looks.append(c)
        return None if len(looks) == 1 else real(c)

    monkeypatch.setattr(child, "running_daemon", too_early)
    with serve(cfg, timeout=120) as served:
        assert served.reused and served.pid == other.pid
        assert _read_epoch() == [(0, b) for b in range(8)]
    assert other.proc.poll() is None and status.lock_pid(buf) == other.pid


def test_of_two_serve_blocks_at_once_the_loser_removes_none_of_the_winners_directories(tmp_path, image_root,
                                                                                      daemon_factory, monkeypatch):
    """Both looked before either had made its directories, so both noted them as theirs to remove;
    the block that lost, using the winner's daemon, removed the progress directory the winner
    watches when it was outside the buffer (``progress.dir`` set)."""
    from prefetchd_client import child, serve

    cfg = small_config(tmp_path, image_root, progress={"dir": str(tmp_path / "progress"), "poll_interval_s": 0.05})
    buf = str(tmp_path / "buffer")
    other = daemon_factory(cfg)
    wait_until(lambda: status.daemon_alive(buf) is True and status.read_json(buf, status.META_NAME), 60, "the daemon")
    real, looks = child.running_daemon, []

    def too_early(c):
        looks.append(c)
        return None if len(looks) == 1 else real(c)

    monkeypatch.setattr(child, "running_daemon", too_early)
    monkeypatch.setattr(child, "_missing_top", os.path.abspath)  # as if neither directory were there yet
    with serve(cfg, timeout=120) as served:
        assert served.reused and served.pid == other.pid
    assert os.path.isdir(tmp_path / "progress") and status.lock_pid(buf) == other.pid
    with serve(cfg, timeout=120) as served:  # the winner's trainers read on
        assert _read_epoch(2) == [(0, 0), (0, 1)]


def test_a_daemon_that_dies_while_the_launch_that_started_it_waits_for_another_is_restarted(tmp_path, cfg):
    """The starter's command has ended and it waits for a launch using its daemon; the daemon is
    killed. It was not restarted (that was done only while the starter's own command ran), and the
    other launch's trainer waited for batches until its timeout and failed."""
    buf = str(tmp_path / "buffer")
    a_done, go, seen = tmp_path / "a-done", tmp_path / "go", tmp_path / "seen.json"
    first = _launch(tmp_path, cfg, sys.executable, _script(tmp_path, "until.py", UNTIL), str(a_done))
    second = None
    try:
        wait_until(lambda: status.daemon_alive(buf) is True and status.read_json(buf, status.META_NAME), 60,
                   "the first launch's daemon")
        daemon = status.lock_pid(buf)
        late = LATE.replace("timeout=60", "timeout=20")
        second = _launch(tmp_path, cfg, sys.executable, _script(tmp_path, "late.py", late), str(go), str(seen))
        wait_until(lambda: os.path.exists(f"{go}.started"), 60, "the second launch's command")
        _end_command(first.pid, a_done, daemon)
        os.kill(daemon, signal.SIGKILL)
        go.touch()
        rc2, _, err2 = _finish(second)
        assert rc2 == 0, err2
        assert json.loads(seen.read_text()) == [[0, b] for b in range(8)]
        rc, _, err = _finish(first)
        assert rc == 0, err
        assert f"the daemon (pid {daemon}) was killed by SIGKILL while launches using it run; restarting it in 2 s" \
               in err, err
        again = int(err.split("started the daemon again (pid ")[1].split(")")[0])
        _assert_nothing_left(buf, [daemon, again])
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)


def test_the_launch_that_started_the_daemon_waits_for_another_after_its_terminal_is_gone(tmp_path, cfg):
    """Its terminal hung up (an ssh session dropped: writes fail with EIO; here a pipe closed:
    EPIPE) and its command ended: the line naming the other launch raised, and launch died in its
    clean-up, its daemon with it, under the other's trainer, and left the buffer behind."""
    buf = str(tmp_path / "buffer")
    a_done, go, seen = tmp_path / "a-done", tmp_path / "go", tmp_path / "seen.json"
    first = _launch(tmp_path, cfg, sys.executable, _script(tmp_path, "until.py", UNTIL), str(a_done))
    first.stderr.close()  # nobody reads what it says any more
    second = None
    try:
        wait_until(lambda: status.daemon_alive(buf) is True and status.read_json(buf, status.META_NAME), 60,
                   "the first launch's daemon")
        daemon = status.lock_pid(buf)
        late = LATE.replace("timeout=60", "timeout=20")
        second = _launch(tmp_path, cfg, sys.executable, _script(tmp_path, "late.py", late), str(go), str(seen))
        wait_until(lambda: os.path.exists(f"{go}.started"), 60, "the second launch's command")
        _end_command(first.pid, a_done, daemon)
        go.touch()
        rc2, _, err2 = _finish(second)
        assert rc2 == 0, err2
        assert json.loads(seen.read_text()) == [[0, b] for b in range(8)]
        assert first.wait(60) == 0
        _assert_nothing_left(buf, [daemon])
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
