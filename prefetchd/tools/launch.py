"""``prefetchd launch [--config FILE] -- CMD ARGS...``: the daemon for the life of one command.

    prefetchd launch --config train.yaml -- torchrun --nproc-per-node 8 train.py

1. The config is read (``--config``, else ``$PREFETCHD_CONFIG``); an error is one line, exit 78.
2. A daemon already serving ``buffer.dir`` for this config is used (said in one line) and left
   as it is, held (``prefetchd_client.users``) until launch exits; one serving another stream
   there is one line, exit 1. So is one that another launch started at the same moment, whose
   daemon holds the buffer where this one's could not. Otherwise the daemon is
   started (``python -m prefetchd run``, ``prefetchd_client.child.DaemonChild``) and waited for
   until its ``READY=1`` (every rank has a batch ready); a daemon that exits first is one line
   (its own error) and launch exits 78 (configuration) or 1 before CMD runs.
3. CMD runs with ``PREFETCHD_CONFIG`` set to the config's absolute path (the client takes it when
   given no path), in launch's process group. CMD sees each stop once, whoever sent it: a
   SIGINT, SIGTERM or SIGHUP that reached launch's process group (a terminal's Ctrl-C,
   ``kill -PGID``, ``timeout``, Slurm's ``scancel``, which signals every process of the step)
   has reached CMD already and is not forwarded; one sent to launch alone (``kill PID``, a
   container's PID 1, systemd's ``KillMode=mixed``) is. Which is which a witness process in
   the group tells (``groupsignals``: the signal is pending there too, seen within 0.1 s); a CMD
   that left launch's process group gets every signal forwarded. A second SIGINT or SIGTERM (a
   second Ctrl-C) kills CMD (SIGKILL): one that ignores or outlasts the first is not waited for
   forever, and one saving a checkpoint is given all the time it needs until then (a Slurm step
   or a pod has its own kill deadline).
4. While CMD runs, a daemon that dies is started again as ``systemd/prefetchd.service`` would
   (``Restart=on-failure``, ``RestartSec=2``, at most ``StartLimitBurst=5`` starts in
   ``StartLimitIntervalSec=300``, never after exit 78 or a clean exit); its batches are kept
   in the ring, so the trainers wait at most a start's time.
5. When CMD exits, launch waits while another launch (or ``serve()``) holds the daemon it started
   (one line names them; a stop signal, or one before CMD exited, ends or skips the wait; a daemon
   that dies meanwhile is started again as in 4, for their trainers read from it), then the
   daemon is stopped (SIGTERM, SIGKILL after 20 s), the directories its start
   created are removed (``child.Created``), and launch exits with CMD's status (128 + n when
   signal n ended it; 127: CMD not found, 126: not executable).
6. Launch is a subreaper (``PR_SET_CHILD_SUBREAPER``): what CMD left running when it exited (a
   background job, a forked helper: orphans that the kernel hands to launch) is ended too
   (SIGTERM, SIGKILL after 20 s) and said in one line, as a Slurm step or a container would.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections import deque

import psutil
from prefetchd_client import users
from prefetchd_client.child import (
    Created,
    DaemonChild,
    DaemonStartError,
    join_instead,
    join_running,
    load,
)
from prefetchd_client.common import CONFIG_ENV

from prefetchd.tools.groupsignals import Witness

# systemd/prefetchd.service's back-off (tests/test_launch.py reads the unit and compares)
RESTART_SEC = 2.0  # RestartSec=2
START_LIMIT_INTERVAL_S = 300.0  # StartLimitIntervalSec=300
START_LIMIT_BURST = 5  # StartLimitBurst=5
NO_RESTART = (0, 78)  # Restart=on-failure: not after a clean exit; RestartPreventExitStatus=78
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_TICK_S = 0.05  # how often the loop looks at CMD, the daemon and the signals received
LEFTOVER_STOP_S = 20.0  # what CMD left running gets SIGTERM, then SIGKILL after this (TimeoutStopSec)
_PR_SET_CHILD_SUBREAPER = 36
_GRACE_S = 0.5  # a leftover already killed (the daemon's group) has this long to exit before it is said
_REAP_EVERY_S = 1.0  # how often orphans that exited while CMD runs are reaped (no zombies pile up)


_HELD = ", and held until this launch ends (one that started it waits for that before stopping it)"


def say(text: str) -> None:
    try:
        print(f"prefetchd launch: {text}", file=sys.stderr, flush=True)
    except (OSError, ValueError):  # the terminal hung up (EIO), a closed pipe: the line is lost, not the clean-up
        pass


class Restarts:
    """The service's restart rule, pure: when to start the daemon again after it exited."""

    def __init__(self) -> None:
        self.starts: deque[float] = deque()

    def started(self, now: float) -> None:
        self.starts.append(now)

    def after_exit(self, rc: int, now: float) -> tuple[float | None, str]:
        """(when to start again or None, why): ``rc`` is the exit status, negative for a signal."""
        if rc in NO_RESTART:
            return None, ("it stopped cleanly (status 0), not restarted" if rc == 0 else
                          "a configuration error (status 78) is not restarted; fix the config and launch again")
        when = now + RESTART_SEC
        while self.starts and self.starts[0] <= when - START_LIMIT_INTERVAL_S:
            self.starts.popleft()
        if len(self.starts) >= START_LIMIT_BURST:
            return None, (f"it was started {len(self.starts)} times within {START_LIMIT_INTERVAL_S:.0f} s; "
                          f"not restarted again (the service's StartLimitBurst)")
        return when, f"restarting it in {RESTART_SEC:.0f} s"


def _how(rc: int) -> str:
    if rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with status {rc}"


def _in_my_group(pid: int) -> bool:
    try:
        return os.getpgid(pid) == os.getpgrp()
    except OSError:
        return False


def _become_subreaper() -> None:
    """Orphaned descendants (CMD's children once CMD exits) are reparented to launch, not to init."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: what CMD leaves is init's, as without launch
        pass


def end_leftovers(timeout: float = LEFTOVER_STOP_S, keep: int | None = None) -> list[int]:
    """End launch's remaining children (orphans reparented to it: what CMD left; the daemon's
    own, killed with it, are only reaped) but ``keep`` (a daemon still serving), SIGTERM then
    SIGKILL after ``timeout``, each reaped; the pids of those that were still running."""
    ended: list[int] = []
    for _ in range(8):  # a leftover's own children are orphaned in turn when it ends
        try:
            kids = [k for k in psutil.Process().children() if k.pid != keep]
        except psutil.Error:
            break
        # exited or exiting (the daemon's workers, killed with its process group): reaped, not said
        _, kids = psutil.wait_procs(kids, _GRACE_S)
        if not kids:
            break
        ended += [k.pid for k in kids]
        for k in kids:
            with contextlib.suppress(psutil.Error):
                k.terminate()
        _, alive = psutil.wait_procs(kids, timeout)
        for k in alive:
            with contextlib.suppress(psutil.Error):
                k.kill()
        psutil.wait_procs(alive, 5.0)
    return ended


def reap_orphans(keep: tuple[int | None, ...]) -> None:
    """Reap the orphans reparented to launch that have exited (not CMD or the daemon: their
    ``Popen`` objects take their statuses)."""
    with contextlib.suppress(psutil.Error):
        for k in psutil.Process().children():
            if k.pid not in keep:
                with contextlib.suppress(ChildProcessError, psutil.Error):
                    if k.status() == psutil.STATUS_ZOMBIE:
                        os.waitpid(k.pid, os.WNOHANG)


class Launch:
    def __init__(self, config: str | None, cmd: list[str], ready_timeout: float | None):
        self.config = config
        self.cmd = cmd
        self.ready_timeout = ready_timeout
        self.pending: list[int] = []
        self.daemon: DaemonChild | None = None
        self.created: Created | None = None
        self.guest: users.Guest | None = None  # the hold on a daemon another launch started
        self.cfg = None
        self.served = False  # this launch's own daemon became ready and the command ran
        self.restarts = Restarts()
        self.restart_at: float | None = None
        self.reap_at = 0.0
        self.stopping = False  # a stop signal came: the daemon may be stopping too (scancel signals every process)
        self.witness: Witness | None = None  # tells a signal sent to launch's group from one sent to launch alone

    def _record(self, signum, frame) -> None:  # record only; the loop acts
        self.pending.append(signum)

    def run(self) -> int:
        old = {s: signal.signal(s, self._record) for s in FORWARDED}
        _become_subreaper()
        try:
            return self._run()
        finally:
            if self.witness is not None:  # before the leftovers: it is launch's child, not CMD's
                self.witness.stop()
            hold = users.OwnerHold(None)
            try:
                if self.guest is not None:
                    self.guest.close()
                waits = self.served and self.daemon is not None and not self.stopping
                # what the command left running goes first: a wait for guests may be long
                self._end_leftovers(keep=self.daemon.pid if self.daemon is not None else None)
                if waits:
                    hold = users.wait_for_guests(self.cfg.progress_dir, self.daemon.pid, say, self._guests_tick)
                try:
                    if self.daemon is not None:
                        self.daemon.stop()
                    if self.created is not None:
                        self.created.remove()
                finally:
                    hold.release()  # a launch waiting to use the daemon finds it gone, and starts its own
                self._end_leftovers()
            finally:
                for s, h in old.items():
                    signal.signal(s, h)

    def _end_leftovers(self, keep: int | None = None) -> None:
        if left := end_leftovers(keep=keep):
            say(f"the command left {len(left)} process(es) running (pids {', '.join(map(str, left))}); ended them")

    def _run(self) -> int:
        try:
            path, cfg = load(self.config)
            pid, self.guest = join_running(cfg, say, stop=lambda: bool(self.pending))
        except DaemonStartError as e:
            say(str(e))
            return e.exit_code
        self.cfg = cfg
        if pid is None and self.pending:  # a stop signal while a stop of the daemon it found was awaited
            return 128 + self.pending[0]
        if pid is not None:
            held = _HELD if self.guest is not None and self.guest.held else ""
            say(f"using the daemon already serving {cfg.buffer.dir} (pid {pid}); it is left running{held}")
        else:
            self.created = Created.before_start(cfg)
            self.daemon = DaemonChild(path)
            self.daemon.start()
            self.restarts.started(time.monotonic())
            try:
                if not self.daemon.wait_ready(self.ready_timeout, stop=lambda: bool(self.pending)):
                    return 128 + self.pending[0]  # stopped before CMD ran
            except DaemonStartError as e:
                err = e
                try:  # another launch of this config started one at the same moment, and it holds the buffer
                    pid, self.guest = join_instead(cfg, self.daemon, say)
                except DaemonStartError as other:  # one of another stream: that is the error to say
                    err = other
                if self.guest is None:
                    say(str(err))
                    return err.exit_code
                self.daemon = self.created = None  # not its own: neither stopped nor removed by this launch
                say(f"using the daemon already serving {cfg.buffer.dir} (pid {pid}), started at the same time as "
                    f"this launch's; it is left running{_HELD if self.guest.held else ''}")
        if self.pending:
            return 128 + self.pending[0]
        self.served = self.daemon is not None  # its own daemon is ready: guests may come
        witness = Witness(FORWARDED)
        if witness.start():
            self.witness = witness
        try:
            proc = subprocess.Popen(self.cmd, env={**os.environ, CONFIG_ENV: path})
        except FileNotFoundError:
            say(f"cannot run {self.cmd[0]!r}: no such command")
            return 127
        except OSError as e:
            say(f"cannot run {self.cmd[0]!r}: {e.strerror}")
            return 126
        while True:
            rc = proc.poll()
            if rc is not None:
                return rc if rc >= 0 else 128 - rc
            while self.pending:
                signum = self.pending.pop(0)
                # asked for every signal, so that the witness takes each one the group got
                reached = self.witness is not None and self.witness.reached(signum) and _in_my_group(proc.pid)
                if signum in (signal.SIGTERM, signal.SIGINT) and self.stopping:  # a command that ignores the first
                    say(f"a second stop signal ({signal.Signals(signum).name}): killing the command (pid {proc.pid})")
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
                    continue
                self.stopping |= signum in (signal.SIGTERM, signal.SIGINT)
                if not reached:  # sent to launch alone: CMD has not had it
                    with contextlib.suppress(ProcessLookupError):
                        proc.send_signal(signum)
            self._supervise()
            if time.monotonic() >= self.reap_at:
                self.reap_at = time.monotonic() + _REAP_EVERY_S
                reap_orphans(keep=(proc.pid, self.daemon.pid if self.daemon is not None else None,
                                   self.witness.pid if self.witness is not None else None))
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(_TICK_S)

    def _guests_tick(self) -> bool:
        """A turn of the wait for guests after CMD ended: True (the wait ends) when a SIGINT or
        SIGTERM came, or the daemon is gone for good; one that dies is started again as while CMD
        ran, for the guests' trainers read from it."""
        got = any(s in (signal.SIGINT, signal.SIGTERM) for s in self.pending)
        self.pending.clear()
        if not got:
            self._supervise("while launches using it run")
        return got or self.daemon is None

    def _supervise(self, when: str = "while the command runs") -> None:
        """Notice a daemon that died and start it again as the service would."""
        d = self.daemon
        if d is None or self.stopping:
            return
        now = time.monotonic()
        if self.restart_at is not None:
            if now >= self.restart_at:
                self.restart_at = None
                self.daemon = DaemonChild(d.config_path)
                self.daemon.start()
                self.restarts.started(now)
                say(f"started the daemon again (pid {self.daemon.pid})")
            return
        was_ready = d.ready
        if not was_ready and d.check_ready():
            say(f"the daemon (pid {d.pid}) is ready again")
        rc = d.poll()
        if rc is None:
            return
        last = "" if was_ready else f" before it was ready: {d.error_line()}"
        d.stop()  # reaps it and whatever of its process group is left
        self.restart_at, why = self.restarts.after_exit(rc, now)
        say(f"the daemon (pid {d.pid}) {_how(rc)} {when}{last}; {why}")
        if self.restart_at is None:
            self.daemon = None


def run_launch(config: str | None, cmd: list[str], ready_timeout: float | None) -> int:
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        say("no command given: prefetchd launch [--config FILE] -- CMD [ARGS...]")
        return 2
    return Launch(config, cmd, ready_timeout).run()
