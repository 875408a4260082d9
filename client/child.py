"""The daemon as a child process: ``serve()`` for a ``with`` block, ``DaemonChild`` for ``prefetchd launch``.

    import prefetchd_client

    with prefetchd_client.serve("train.yaml"):            # starts `python -m prefetchd run`, waits until ready
        loader = prefetchd_client.PrefetchClient()          # the path comes from $PREFETCHD_CONFIG
        for images, labels in loader:
            ...
    # the daemon is stopped; what it made for this block is gone

The rules, shared with ``prefetchd launch``:

* **A daemon already serving the buffer** (it holds the buffer directory's lock) is used, and
  said so in one log line, when it serves what the config asks (``meta.json``'s batch size,
  world size, ranks, output size, epochs and stream fingerprint equal the config's); it is
  neither stopped nor restarted. One serving something else is an error (exit status 1): two configs cannot share
  one ``buffer.dir``. The user holds it (``users.Guest``) while it uses it, and the launch or
  block that started it waits for its users to end before stopping it (``users``). Of two starts
  at the same moment (both found none), the one whose daemon could not hold the buffer uses the
  other's (``join_instead``).
* **Ready** is the daemon's own ``READY=1`` (systemd's notify protocol, on a private socket in
  the abstract namespace: no file): every rank has a batch ready. Waiting is bounded
  (``timeout``); a daemon that exits first is an error of one line, its own error line, with its
  exit status (78: the configuration, 1: anything else).
* **Its log** goes to ``sys.stderr``: held back until it is ready (a failing start is then one
  line, not the whole log), passed on from then on.
* **Clean-up**: the daemon is stopped with SIGTERM (SIGKILL of its process group after
  ``_STOP_TIMEOUT_S``, the service's ``TimeoutStopSec``), and the buffer and progress
  directories it created are removed, batches and all; in a directory that existed before, only
  ``daemon.lock`` is removed, unless a start killed outright made it (``Created``: its
  ``created.json`` says so), whose directories this start takes over and removes. It runs in a
  session of its own (a Ctrl-C at the terminal is the trainer's, not the daemon's: it is stopped
  after the trainer), and it is sent SIGTERM by the kernel when the thread that started it ends
  (``PR_SET_PDEATHSIG``, which the daemon asks for itself, told the trainer's pid in
  ``PREFETCHD_DIE_WITH_PARENT``: no Python runs between fork and exec in a threaded trainer).

Imports nothing of the daemon: it runs ``python -m prefetchd run`` (the interpreter running
this), like any user would.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import select
import shutil
import signal
import site
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prefetchd.core import config as _config_module
from prefetchd.core.config import EX_CONFIG, Config, ConfigError
from prefetchd.core.config import load as load_config
from prefetchd.format import procstate, status

from .common import CONFIG_ENV, PrefetchError, config_from_env
from .users import Guest, OwnerHold, wait_for_guests

_log = logging.getLogger("prefetchd_client.child")

_STOP_TIMEOUT_S = 20.0  # systemd/prefetchd.service's TimeoutStopSec
_READY_TIMEOUT_S = 600.0  # the index of a large tar is scanned before the first batch: minutes, not hours
_TICK_S = 0.05  # how often a wait looks at the child and at its caller's stop flag
_HELD_LINES = 2000  # log lines held back until ready (a start that logs more keeps the last ones)
_LOG_PREFIX = re.compile(r"^(<\d>)?(\d\d:\d\d:\d\d \w+ )?")
# the meta.json keys that must equal the config's for a running daemon to serve this config
_SAME = (("batch_size", "loader.batch_size"), ("world_size", "loader.world_size"), ("ranks", "loader.ranks"),
         ("output_size", "augment.output_size"), ("epochs", "loader.epochs"))


class DaemonStartError(PrefetchError):
    """The daemon could not be started or used; ``exit_code`` is 78 (configuration) or 1."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


def load(config: str | os.PathLike | None) -> tuple[str, Config]:
    """The config's absolute path (``$PREFETCHD_CONFIG`` when None) and the config, or a
    ``DaemonStartError`` with exit code 78 naming the key."""
    try:
        path = os.path.abspath(os.fspath(config_from_env(config)))
    except PrefetchError as e:
        raise DaemonStartError(str(e), 2) from None
    except OSError as e:  # a relative path, and the current directory was deleted
        raise DaemonStartError(f"configuration error: cannot find config file {os.fspath(config_from_env(config))} "
                               f"relative to the current directory ({e.strerror}); give its absolute path",
                               EX_CONFIG) from None
    try:
        return path, load_config(path)
    except ConfigError as e:
        raise DaemonStartError(f"configuration error: {e}", EX_CONFIG) from None


def running_daemon(cfg: Config) -> int | None:
    """The pid of a daemon already serving ``cfg``'s buffer, or None when none runs there.
    Raises ``DaemonStartError`` (exit code 1) when the one running serves another stream."""
    if status.daemon_alive(cfg.buffer.dir) is not True:
        return None
    pid = status.lock_pid(cfg.buffer.dir)
    meta = status.read_json(cfg.buffer.dir, status.META_NAME) or {}
    want = {"batch_size": cfg.loader.batch_size, "world_size": cfg.loader.world_size, "ranks": list(cfg.loader.ranks),
            "output_size": cfg.augment.output_size, "epochs": cfg.loader.epochs}
    for key, name in _SAME:
        if key in meta and meta[key] != want[key]:
            raise DaemonStartError(f"another prefetchd (pid {pid}) already serves {cfg.buffer.dir} with {name} "
                                   f"{meta[key]}, not {want[key]} as in {cfg.source}; stop it, or set another "
                                   f"buffer.dir")
    if "stream_fingerprint" in meta and meta["stream_fingerprint"] != cfg.stream_fingerprint():
        raise DaemonStartError(f"another prefetchd (pid {pid}) already serves {cfg.buffer.dir} with a different "
                               f"stream than {cfg.source} describes (loader or augment settings differ); stop it, "
                               f"or set another buffer.dir")
    return pid


def _missing_top(path: str) -> str | None:
    """The outermost directory of ``path`` that does not exist yet (what a start would create)."""
    top = None
    path = os.path.abspath(path)
    while not os.path.lexists(path):
        top = path
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return top


def _importable_from_root(env: dict) -> None:
    """The daemon runs in ``/`` (as under systemd: the caller's directory may be deleted,
    unreadable or an unmount the daemon must not hold); a ``prefetchd`` found only through the
    caller's directory (a checkout, not installed) is put on its ``PYTHONPATH``."""
    root = os.path.abspath(os.path.join(os.path.dirname(_config_module.__file__), "..", ".."))
    if root in set(site.getsitepackages()) | {site.getusersitepackages()}:
        return  # installed: the interpreter finds it anywhere (a site dir first on PYTHONPATH would shadow the stdlib)
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])


@contextlib.contextmanager
def _ctrl_c_after() -> Iterator[None]:
    """Hold a SIGINT (Ctrl-C, a notebook's interrupt) that arrives in the block and deliver it
    to the handler that was there once the block is over (in the main thread; elsewhere no
    KeyboardInterrupt is raised)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[object] = []
    old = signal.signal(signal.SIGINT, lambda signum, frame: got.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        if got and callable(old):
            old(signal.SIGINT, got[0])
        elif got and old == signal.SIG_DFL:
            os.kill(os.getpid(), signal.SIGINT)


class DaemonChild:
    """One ``python -m prefetchd run --config PATH`` child: started, waited for, stopped.

    ``sink`` receives the daemon's log lines (default: ``sys.stderr`` at the time of writing);
    lines before ``READY=1`` are held back and passed on once it is ready."""

    def __init__(self, config_path: str, sink: Callable[[str], object] | None = None, env: dict | None = None):
        self.config_path = config_path
        self._sink = sink
        self._env = env
        self.proc: subprocess.Popen | None = None
        self.ready = False
        self._sock: socket.socket | None = None
        self._held: list[str] = []
        self._passing = False
        self._reported = False
        self._lock = threading.Lock()
        self._relay: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        name = f"prefetchd-serve-{os.getpid()}-{secrets.token_hex(6)}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._sock.bind("\0" + name)
        self._sock.setblocking(False)
        env = {k: v for k, v in (self._env if self._env is not None else os.environ).items()
               if k not in ("WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID")}
        env["NOTIFY_SOCKET"] = "@" + name
        env[procstate.PARENT_ENV] = str(os.getpid())  # it asks for SIGTERM when this thread ends (not a preexec_fn)
        _importable_from_root(env)
        with _ctrl_c_after():  # a Ctrl-C inside Popen would lose the child's pid: the daemon would be left
            self.proc = subprocess.Popen([sys.executable, "-m", "prefetchd", "run", "--config", self.config_path],
                                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True, cwd="/")
            self._relay = threading.Thread(target=self._read_log, args=(self.proc.stdout,), daemon=True,
                                           name="prefetchd-serve-log")
            self._relay.start()

    def _write(self, line: str) -> None:
        try:
            if self._sink is not None:
                self._sink(line)
            else:
                sys.stderr.write(line)
                sys.stderr.flush()
        except (OSError, ValueError):  # a closed stderr: the log is lost, the daemon is not
            pass

    def _read_log(self, pipe) -> None:
        with pipe:
            for raw in iter(pipe.readline, b""):
                line = raw.decode(errors="replace")
                with self._lock:
                    if not self._passing:
                        self._held.append(line)
                        del self._held[:-_HELD_LINES]
                        continue
                self._write(line)

    def _pass_log(self) -> None:
        with self._lock:
            held, self._held, self._passing = self._held, [], True
        for line in held:
            self._write(line)

    def error_line(self) -> str:
        """The daemon's own error line from what it logged before it was ready (or its last line)."""
        if self._relay is not None and self.poll() is not None:
            self._relay.join(2.0)  # it ended: the pipe's last lines are on their way
        self._reported = True  # said in one line: the rest of what it held back is not passed on
        with self._lock:
            lines = [ln.strip() for ln in self._held if ln.strip()]
        errors = [ln for ln in lines if " ERROR " in ln or " CRITICAL " in ln or "error:" in ln
                  or ln.startswith(("<2>", "<3>"))]
        line = (errors or lines or ["(it said nothing)"])[-1]
        return _LOG_PREFIX.sub("", line)

    def check_ready(self) -> bool:
        """Read what the daemon said on the notify socket; True once it said ``READY=1``."""
        if self.ready or self._sock is None:
            return self.ready
        while True:
            try:
                msg = self._sock.recv(4096)
            except (BlockingIOError, InterruptedError):
                break
            if b"READY=1" in msg.split(b"\n"):
                self.ready = True
                # nothing more to hear: the daemon's later sends fail at once (logged at debug),
                # where a socket nobody reads would fill and block them
                self._sock.close()
                self._sock = None
                self._pass_log()
                break
        return self.ready

    def wait_ready(self, timeout: float | None = _READY_TIMEOUT_S, stop: Callable[[], bool] = lambda: False) -> bool:
        """Wait until the daemon is ready (True), or ``stop()`` says so (False). Raises
        ``DaemonStartError`` when it exits first (with its exit status) or is not ready in time
        (the child is stopped then)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.check_ready():
            rc = self.proc.poll()
            if rc is not None:
                self._close_socket()
                line = self.error_line()
                code = EX_CONFIG if rc == EX_CONFIG else 1
                how = f"status {rc}" if rc >= 0 else f"signal {signal.Signals(-rc).name}"
                raise DaemonStartError(f"the daemon exited ({how}) before it was ready: {line}", code)
            if stop():
                return False
            if deadline is not None and time.monotonic() > deadline:
                line = self.error_line()  # what it said last before being stopped
                self.stop()
                raise DaemonStartError(f"the daemon was not ready within {timeout:.0f} s (its last line: {line}); "
                                       f"stopped it", 1)
            fd = self._sock.fileno() if self._sock is not None else None
            select.select([fd] if fd is not None else [], [], [], _TICK_S)
        return True

    def poll(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def stop(self, timeout: float = _STOP_TIMEOUT_S) -> int | None:
        """SIGTERM, then SIGKILL of its process group after ``timeout``; its exit status."""
        rc = None
        if self.proc is not None:
            if self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    _log.warning("the daemon (pid %d) did not stop within %.0f s of SIGTERM; killing it",
                                 self.proc.pid, timeout)
                except KeyboardInterrupt:  # a second Ctrl-C while it stops: no waiting, but nothing left either
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait()
                    self._close_socket()
                    raise
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # workers it left, or all of it after the deadline
            rc = self.proc.wait()
        self._close_socket()
        if self._relay is not None:
            self._relay.join(2.0)
            if not self._reported:
                self._pass_log()
        return rc

    def _close_socket(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


@dataclass
class Created:
    """What a start will create, so that it can be removed after: the buffer and progress
    directories that did not exist, and the parents made for them (``(path, outermost)`` pairs).

    A start that creates the buffer directory makes it itself (mode 0700, as the daemon would)
    and writes ``status.CREATED_NAME`` into it, naming what it made: if this process is killed
    before ``remove`` (SIGKILL of ``launch``, Slurm's KillWait, the OOM killer), the next start
    finds that file in a directory no daemon holds, takes what it names as its own, and removes
    it at its end; so a hard kill leaves its batches in RAM only until the next start ends.
    A directory that existed before without that file is someone's (a unit's ``RuntimeDirectory=``,
    a user's): its batches are kept for the next start, as always."""

    buffer_dir: str
    made: tuple[tuple[str, str], ...]

    @classmethod
    def before_start(cls, cfg: Config) -> Created:
        buffer_dir = os.path.abspath(cfg.buffer.dir)
        made = {os.path.abspath(p): top for p in (cfg.buffer.dir, cfg.progress_dir) if (top := _missing_top(p))}
        left = {}
        if buffer_dir not in made and status.daemon_alive(buffer_dir) is False:
            left = _left_by_a_killed_start(buffer_dir, (buffer_dir, os.path.abspath(cfg.progress_dir)))
        created = cls(buffer_dir, tuple({**left, **made}.items()))
        if buffer_dir in made or buffer_dir in left:
            created._mark(adopted=buffer_dir in left)
        return created

    def _mark(self, adopted: bool) -> None:
        """Make the buffer directory (or take over a killed start's) and say in it what this start
        made. One another start made first is left alone."""
        try:
            os.makedirs(os.path.dirname(self.buffer_dir), exist_ok=True)
            try:
                os.mkdir(self.buffer_dir, 0o700)  # the daemon's own mode for it, before it sets its group
            except FileExistsError:
                if not adopted:
                    return
            status.write_json(self.buffer_dir, status.CREATED_NAME, {
                "format": "prefetchd-created", "version": 1, "pid": os.getpid(),
                "made": [list(pair) for pair in self.made]})
        except OSError:  # the daemon makes it, or says why it cannot
            pass

    def remove(self) -> None:
        """Remove what the start created: each directory the daemon made, batches and all, unless
        a daemon holds it (another start got there first), then the parents made for it while
        they are empty (another job's directory beside it keeps them). In a buffer directory
        that was there before, only the lock file, and only when no daemon holds it."""
        if status.daemon_alive(self.buffer_dir) is True:  # another start's daemon: all it uses is its own
            return
        for path, top in self.made:
            if status.daemon_alive(path) is True or status.daemon_alive(os.path.dirname(path)) is True:
                continue
            shutil.rmtree(path, ignore_errors=True)
            parent = os.path.dirname(path)
            while len(parent) >= len(top) and parent.startswith(top):
                try:
                    os.rmdir(parent)
                except OSError:
                    break
                parent = os.path.dirname(parent)
        if os.path.isdir(self.buffer_dir) and status.daemon_alive(self.buffer_dir) is False:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.buffer_dir, status.LOCK_NAME))


def _left_by_a_killed_start(buffer_dir: str, ours: tuple[str, ...]) -> dict[str, str]:
    """What the ``status.CREATED_NAME`` in ``buffer_dir`` says a start made (of ``ours``, the
    config's own directories, each with an outermost parent at or above it), or nothing."""
    rec = status.read_json(buffer_dir, status.CREATED_NAME)
    made = rec.get("made") if isinstance(rec, dict) and rec.get("format") == "prefetchd-created" else None
    if not isinstance(made, list) or _maker_alive(rec.get("pid")):
        return {}  # a start that still runs (its daemon between two tries, say) removes its own
    return {path: top for pair in made if isinstance(pair, list) and len(pair) == 2
            and all(isinstance(x, str) for x in pair) and (path := pair[0]) in ours
            and (top := pair[1]) and (path == top or path.startswith(top.rstrip("/") + "/"))}


def _maker_alive(pid) -> bool:
    """Whether the start that wrote a ``status.CREATED_NAME`` (``pid``) runs, in another process."""
    return pid != os.getpid() and procstate.exists(pid)


@contextlib.contextmanager
def _config_env(path: str) -> Iterator[None]:
    old = os.environ.get(CONFIG_ENV)
    os.environ[CONFIG_ENV] = path
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(CONFIG_ENV, None)
        else:
            os.environ[CONFIG_ENV] = old


@dataclass
class Served:
    """What ``serve()`` yields: the config's path, the daemon's pid, and whether it was already running."""

    config: str
    pid: int | None
    reused: bool
    child: DaemonChild | None = None


@contextlib.contextmanager
def serve(config: str | os.PathLike | None = None, timeout: float | None = _READY_TIMEOUT_S,
          sink: Callable[[str], object] | None = None) -> Iterator[Served]:
    """Run the daemon for ``config`` as a child process for the ``with`` block.

    Waits until it is ready (``timeout`` seconds at most, None: no limit); inside the block
    ``$PREFETCHD_CONFIG`` is the config's path, so ``PrefetchClient()`` needs no argument. On
    leaving the block (an exception and Ctrl-C too) the daemon is stopped and what it created is
    removed. A daemon already serving the buffer is used as it is (and left running). Raises
    ``DaemonStartError`` (its ``exit_code``: 78 for the configuration, else 1) with a one-line
    message when the daemon cannot start. The daemon is stopped by the kernel when the thread that
    entered this ends: enter it in one that lives as long as the daemon should (the main thread).
    See the module's docstring for the rules."""
    path, cfg = load(config)
    pid, guest = join_running(cfg)
    if guest is None:
        created = Created.before_start(cfg)
        child = DaemonChild(path, sink=sink)
        hold = OwnerHold(None)
        try:
            child.start()
            try:
                child.wait_ready(timeout)
            except DaemonStartError:
                pid, guest = join_instead(cfg, child)
                if guest is None:
                    raise
                created = Created(created.buffer_dir, ())  # the other start's directories: not ours to remove
            if guest is None:
                with _config_env(path):
                    try:
                        yield Served(path, child.pid, False, child)
                    except KeyboardInterrupt:  # Ctrl-C: stopped now, guests or not
                        raise
                    except BaseException:  # the trainer failed: another job's trainers still read on
                        hold = _wait_for_guests(cfg, child)
                        raise
                    hold = _wait_for_guests(cfg, child)
                return
        finally:
            try:
                child.stop()
            finally:
                try:
                    created.remove()
                finally:
                    hold.release()
    _log.warning("prefetchd: using the daemon already serving %s (pid %s)", cfg.buffer.dir, pid)
    try:
        with _config_env(path):
            yield Served(path, pid, True)
    finally:
        guest.close()


def _wait_for_guests(cfg: Config, child: DaemonChild) -> OwnerHold:
    """serve()'s wait, before it stops the daemon it started, for the guests using it (a
    second Ctrl-C ends it)."""
    if child.poll() is not None:
        return OwnerHold(None)
    return wait_for_guests(cfg.progress_dir, child.pid, _say, lambda: False)


def _say(line: str) -> None:
    _log.warning("prefetchd: %s", line)


def join_running(cfg: Config, say: Callable[[str], object] = _say,
                 stop: Callable[[], bool] = lambda: False) -> tuple[int | None, Guest | None]:
    """The daemon already serving ``cfg``'s buffer and this process's hold on it as a guest
    (``users.Guest``; ``say`` gets its one line when it cannot hold it), or (None, None) when
    none serves there (the caller starts one) or ``stop()`` ended a wait for its stop. Raises
    ``DaemonStartError`` as ``running_daemon``."""
    pid = running_daemon(cfg)
    if pid is None:
        return None, None
    guest = Guest.join(cfg.progress_dir, lambda: running_daemon(cfg) == pid, say, stop)
    return (pid, guest) if guest is not None else (None, None)


def join_instead(cfg: Config, child: DaemonChild,
                 say: Callable[[str], object] = _say) -> tuple[int | None, Guest | None]:
    """After ``child`` failed to start: the daemon serving ``cfg``'s buffer now and the hold on it,
    as ``join_running`` (``child`` is stopped first). Two starts of one config at the same moment
    both find no daemon and start one; only one can hold the buffer, and the other's command
    never ran ("another prefetchd already serves"): it uses the one that won instead."""
    child.stop()
    return join_running(cfg, say)
