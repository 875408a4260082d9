"""multiprocessing's helper processes, the forkserver and the resource tracker, watched like workers.

Every local worker is forked by multiprocessing's forkserver; the resource tracker is started
with it. Neither may be a single point of failure, so this module:

- watches both through a pidfd (``pidfd_open``): one that dies (the OOM killer, a stray
  signal, a crash) is noticed at once, reaped, named in one log line, counted in
  ``restarts`` (``status`` and the metrics show the counts) and started anew;
- bounds every worker start (``Helpers.spawn``): a forkserver that does not fork the worker
  within ``_SPAWN_TIMEOUT_S`` (stopped, deadlocked; ``_FIRST_SPAWN_TIMEOUT_S`` for a new one,
  which first imports numpy and Pillow; time the whole job was stopped not counted, see
  ``core.runclock``) or refuses the connection is killed and replaced,
  and the start fails with ``SpawnError``, which the pool retries after its back-off;
- makes the daemon a child subreaper (``become_subreaper``, for ``prefetchd run`` only), so
  the workers of a forkserver that died become the daemon's children: they go on working,
  and their exit status is still known (``waitid`` on their pidfd) and nothing is left a zombie;
- stops both at the process's exit within a bounded time (``stop_helpers``), even when one of
  them is stopped (SIGSTOP) or hung;
- keeps the forkserver's socket path short enough (``short_temp_dir``): multiprocessing puts it
  at ``$TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX``, and under Python 3.13 and older a ``TMPDIR``
  past 75 bytes fails every worker's start ("AF_UNIX path too long"); then a short folder
  (``/tmp``, ``/var/tmp``) is used instead, said in one line, as Python 3.14 does itself;
- starts both with ``GROUP_SIGNALS`` blocked (``ensure_helpers``): a signal sent to the daemon's
  whole process group (a terminal's Ctrl-C, ``kill -TERM -PGID``, ``timeout``, Slurm's
  ``scancel``, which signals every process of the step) is the daemon's to act on, and it ends
  its helpers and workers itself. Killed by it, they were said as faults and replaced during
  the stop. The workers the forkserver forks inherit the mask; ``worker_main`` ignores the
  signals. Once the daemon is stopping (``stopping``), a helper that dies is neither said nor
  replaced: ``stop_helpers`` ends them.

The resource tracker unlinks named semaphores and shared memory segments that a dead process
registered. The pool registers none: its pipes are socket pairs and its shared slots
(``RawArray``) live in a file that multiprocessing unlinks as soon as it is created. So a new
tracker starts empty, and that is correct: nothing of the old one's needs taking over. It is
still restarted, since multiprocessing hands every new worker its pipe.
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import signal
import tempfile
import threading
import warnings
from collections.abc import Callable
from multiprocessing import forkserver, resource_tracker

from prefetchd.core.runclock import TICK_S, WaitClock

log = logging.getLogger("prefetchd.pool")

_SPAWN_TIMEOUT_S = 2.0  # a forkserver that has forked a worker before must fork the next within this...
_FIRST_SPAWN_TIMEOUT_S = 30.0  # ...a new one first imports the worker's modules
_HELPER_STOP_TIMEOUT_S = 2.0  # at exit: a helper not gone after this is killed
_PR_SET_CHILD_SUBREAPER = 36
# What a sender aims at the daemon's whole process group: the daemon acts on them (stop, reload),
# its helpers and workers are born with them blocked and leave them to it
GROUP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

# Linux's sun_path holds 108 bytes with its NUL; multiprocessing adds this much to the temp folder
_SUN_PATH_MAX = 107
_SOCKET_SUFFIX = len("/pymp-12345678/listener-12345678")
_SHORT_TEMP_DIRS = ("/tmp", "/var/tmp", "/usr/tmp")

FORKSERVER = "forkserver"
TRACKER = "resource tracker"


class SpawnError(RuntimeError):
    """A worker could not be started; the message says what failed and what was done."""


def become_subreaper() -> bool:
    """Orphaned descendants (the workers of a forkserver that died) become this process's
    children rather than init's. For the daemon's process only: it must reap them."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def pidfd_open(pid: int) -> int | None:
    """A pidfd for ``pid`` (readable once the process has exited), or None if it is gone or
    the kernel has no pidfds."""
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None


def has_exited(pidfd: int) -> bool:
    return bool(select.select([pidfd], [], [], 0)[0])


def wait_exited(pidfd: int, timeout: float) -> bool:
    return bool(select.select([pidfd], [], [], max(0.0, timeout))[0])


def child_status(pidfd: int, keep: bool = False) -> int | None:
    """The exit code (negative: killed by that signal) of an exited child of this process,
    reaped unless ``keep``; None if it runs or is not this process's child."""
    flags = os.WEXITED | os.WNOHANG | (os.WNOWAIT if keep else 0)
    try:
        r = os.waitid(os.P_PIDFD, pidfd, flags)
    except (ChildProcessError, OSError, AttributeError):
        return None
    if r is None:
        return None
    return r.si_status if r.si_code == os.CLD_EXITED else -r.si_status


def is_gone(pidfd: int) -> bool:
    """The process is reaped (by whichever parent): nothing is left of it, not even a zombie."""
    try:
        signal.pidfd_send_signal(pidfd, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def send_signal(pid: int, pidfd: int | None, sig: int) -> None:
    """Signal a process through its pidfd when there is one (never a recycled pid)."""
    try:
        if pidfd is not None:
            signal.pidfd_send_signal(pidfd, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, OSError):
        pass


def describe_exit(code: int | None) -> str:
    if code is None:
        return "died (how is unknown: the forkserver that started it could not say)"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = ", perhaps out of memory?" if -code == signal.SIGKILL else ""
        return f"was killed by {name}{hint}"
    return f"exited with status {code}"


def _pid(name: str) -> int | None:
    if name == FORKSERVER:
        return forkserver._forkserver._forkserver_pid
    return resource_tracker._resource_tracker._pid


class Helpers:
    """The forkserver and resource tracker of this process, as the pool sees them. ``stopping``
    says whether the daemon is stopping: then a helper's death is part of the stop."""

    def __init__(self, stopping: Callable[[], bool] = lambda: False):
        self.stopping = stopping
        self.restarts = {FORKSERVER: 0, TRACKER: 0}
        self._watched: dict[str, tuple[int, int]] = {}  # name -> (pid, pidfd)
        self._answered: int | None = None  # the forkserver pid that has forked a worker

    def pids(self) -> dict[str, int | None]:
        return {name: _pid(name) for name in (FORKSERVER, TRACKER)}

    def forkserver_stopped(self) -> bool:
        """The forkserver is stopped (SIGSTOP): it will not report a worker's exit status."""
        pid = _pid(FORKSERVER)
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                return f.read().rpartition(b")")[2].split()[0] in (b"T", b"t")
        except (OSError, IndexError):
            return False

    def waitables(self) -> list[int]:
        return [fd for _, fd in self._watched.values()]

    def _watch(self) -> None:
        """Open a pidfd on each helper that runs now (after a start, they may be new)."""
        for name in (FORKSERVER, TRACKER):
            pid = _pid(name)
            old = self._watched.get(name)
            if old is not None and old[0] == pid:
                continue
            if old is not None:
                os.close(old[1])
                del self._watched[name]
            fd = pidfd_open(pid) if pid else None
            if fd is not None:
                self._watched[name] = (pid, fd)

    def check(self) -> None:
        """A helper that died is reaped, said, counted and started anew (the tracker first: a
        new forkserver needs it); not once the daemon is stopping (``stop_helpers`` reaps it)."""
        if self.stopping():
            return
        restarted = False
        for name in (TRACKER, FORKSERVER):
            pid, fd = self._watched.get(name, (None, None))
            if fd is None or not has_exited(fd):
                continue
            restarted = True
            code = child_status(fd, keep=True)
            how = "died" if code is None else describe_exit(code)
            del self._watched[name]
            os.close(fd)
            self.restarts[name] += 1
            if _pid(name) not in (None, pid):
                # multiprocessing started a new one itself (its ensure_running at a worker's start reaps
                # a dead one and starts another without a word): counted and said here, and kept
                done = f"started a new one (pid {_pid(name)})"
            else:
                if name == FORKSERVER:
                    _discard_forkserver()
                try:
                    _ensure_running(name)
                    done = f"started a new one (pid {_pid(name)})"
                except Exception as e:  # noqa: BLE001 -- the next worker start tries again
                    done = f"cannot start a new one yet ({type(e).__name__}: {e}); trying again at the next worker start"
            if name == FORKSERVER:
                done += "; the workers it started go on"
            log.error("the %s (pid %s) %s; %s", name, pid, how, done)
        # once both were looked at: watched again in the loop, after the tracker's restart, a forkserver that
        # multiprocessing had already replaced was watched under its new pid before its death was seen, and
        # that death went uncounted and unsaid (forkserver_restarts 0 after every child was killed)
        if restarted:
            self._watch()

    def spawn(self, start: Callable[[], None]) -> None:
        """Run ``start`` (a worker's ``Process.start``) with a deadline on the forkserver's
        answer. On failure the forkserver is replaced and ``SpawnError`` says what happened."""
        self.check()
        fs = forkserver._forkserver
        try:  # started here, not by start(): with the mask that leaves group signals to the daemon
            ensure_helpers()
        except SpawnError:  # no temporary folder the socket fits in: said as the start's failure
            raise
        except Exception:  # noqa: BLE001 -- start() tries again, and fails in the way said below
            pass
        timeout = _SPAWN_TIMEOUT_S if self._answered is not None and self._answered == fs._forkserver_pid \
            else _FIRST_SPAWN_TIMEOUT_S
        lock = threading.Lock()
        done = []
        expired: list[int] = []

        def expire():
            with lock:
                if done:
                    return
                pid = fs._forkserver_pid
                if pid is not None:  # its death makes the blocked start fail at once
                    expired.append(pid)
                    send_signal(pid, None, signal.SIGKILL)

        cancelled = threading.Event()

        def watch():  # the deadline on a clock of this thread's own, which leaves out a stop of the job
            clock = WaitClock()
            while not cancelled.wait(TICK_S):
                if clock.tick() >= timeout:
                    return expire()

        threading.Thread(target=watch, name="prefetchd-spawn-deadline", daemon=True).start()
        try:
            with warnings.catch_warnings():  # a relaunched tracker is said by check(), not by a warning
                warnings.simplefilter("ignore")
                start()
            err = None
        except (OSError, EOFError) as e:  # the forkserver refused, hung up or was killed above
            err = e
        finally:
            with lock:
                done.append(True)
            cancelled.set()
        if err is None:
            self._answered = fs._forkserver_pid
            self.check()  # a helper that died just before and that multiprocessing relaunched itself
            self._watch()
            return
        pid = expired[0] if expired else fs._forkserver_pid
        if pid is None:
            raise SpawnError(f"cannot start the forkserver: {type(err).__name__}: {err}")
        why = (f"did not answer a worker's start within {timeout:.0f} s" if expired
               else f"failed a worker's start ({type(err).__name__}: {err})")
        old = self._watched.pop(FORKSERVER, None)
        if old is not None:
            os.close(old[1])
        _discard_forkserver()
        self.restarts[FORKSERVER] += 1
        try:
            _ensure_running(FORKSERVER)
            self._watch()
            done_ = f"killed it and started a new one (pid {fs._forkserver_pid})"
        except Exception as e:  # noqa: BLE001 -- said; the next start tries again
            done_ = f"killed it; cannot start a new one yet ({type(e).__name__}: {e})"
        raise SpawnError(f"the forkserver (pid {pid}) {why}; {done_}")

    def close(self) -> None:
        for _, fd in self._watched.values():
            os.close(fd)
        self._watched.clear()


def short_temp_dir() -> str | None:
    """Make ``tempfile``'s folder, in which multiprocessing makes the forkserver's socket, one
    where the socket's path fits ``sun_path``. Returns the line that says a change, else None;
    raises ``SpawnError`` where no folder fits. Before multiprocessing's first use of it only
    (it keeps the folder it made): ``ensure_helpers`` calls it first."""
    base = tempfile.gettempdir()
    if len(os.fsencode(base)) + _SOCKET_SUFFIX <= _SUN_PATH_MAX:
        return None
    limit = _SUN_PATH_MAX - _SOCKET_SUFFIX
    for short in _SHORT_TEMP_DIRS:
        if os.path.isdir(short) and os.access(short, os.W_OK | os.X_OK):
            tempfile.tempdir = short
            return (f"the temporary folder {base} (TMPDIR) is {len(os.fsencode(base))} bytes long, past the "
                    f"{limit} a forkserver socket's path leaves it: the workers' sockets go in {short} instead")
    raise SpawnError(f"the temporary folder {base} (TMPDIR) is {len(os.fsencode(base))} bytes long, past the "
                     f"{limit} a forkserver socket's path leaves it, and none of {', '.join(_SHORT_TEMP_DIRS)} "
                     "is writable: set TMPDIR to a shorter folder")


_TEMP_DIR_CHECKED = []


def ensure_helpers(forkserver_too: bool = True) -> None:
    """Start the resource tracker and (``forkserver_too``) the forkserver if they do not run,
    each born with ``GROUP_SIGNALS`` blocked: the mask is inherited through fork and exec, and
    neither unblocks them (the tracker ignores SIGINT and SIGTERM besides), so from their first
    instruction a signal to the daemon's group stays pending in them, harmless. Blocked in this
    thread only for the start itself (a fork and exec): the daemon's own signals then arrive."""
    if not _TEMP_DIR_CHECKED:
        said = short_temp_dir()
        _TEMP_DIR_CHECKED.append(True)
        if said:
            log.warning("%s", said)
    old = signal.pthread_sigmask(signal.SIG_BLOCK, GROUP_SIGNALS)
    try:
        with warnings.catch_warnings():  # "resource_tracker: process died unexpectedly": said by the caller
            warnings.simplefilter("ignore")
            resource_tracker.ensure_running()
            if forkserver_too:
                # the tracker unblocks SIGINT and SIGTERM after its own start (bpo-33613): again
                signal.pthread_sigmask(signal.SIG_BLOCK, GROUP_SIGNALS)
                forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _ensure_running(name: str) -> None:
    ensure_helpers(forkserver_too=name == FORKSERVER)


def _discard_forkserver() -> None:
    """Kill the forkserver if it still runs, reap it, and forget it, so that the next start
    launches a new one (``ensure_running`` would still try a dead one that is not reaped yet:
    "Connection refused"). Its children stay: they become this process's (subreaper)."""
    fs = forkserver._forkserver
    with fs._lock:
        pid = fs._forkserver_pid
        if pid is None:
            return
        try:
            os.kill(pid, signal.SIGKILL)  # still our unreaped child: the pid cannot be recycled yet
        except ProcessLookupError:
            pass
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
        if fs._forkserver_alive_fd is not None:
            os.close(fs._forkserver_alive_fd)
        address = fs._forkserver_address
        if isinstance(address, str) and not address.startswith("\0"):
            try:
                os.unlink(address)
            except OSError:
                pass
        fs._forkserver_pid = fs._forkserver_alive_fd = fs._forkserver_address = None


def stop_helpers() -> None:
    """Stop multiprocessing's forkserver, then its resource tracker (the forkserver holds the
    tracker's pipe), each within ``_HELPER_STOP_TIMEOUT_S`` (one that is stopped is continued,
    one that does not go is killed), then reap what the forkserver's exit left to this process.
    Left alone they exit only after seeing this process end, and systemd (KillMode=mixed)
    SIGKILLs whatever of the unit is alive when the main process exits: "Killing process N
    (python3) with signal SIGKILL" at every stop. ``_stop`` is how CPython's own tests stop them
    (3.11 and later). For the process's exit only: it breaks any other multiprocessing user
    still running in this process."""
    for helper, pid in ((forkserver._forkserver, forkserver._forkserver._forkserver_pid),
                        (resource_tracker._resource_tracker, resource_tracker._resource_tracker._pid)):
        stop = getattr(helper, "_stop", None)
        if stop is None or pid is None:
            continue
        send_signal(pid, None, signal.SIGCONT)  # a stopped one must run to exit
        timer = threading.Timer(_HELPER_STOP_TIMEOUT_S, send_signal, (pid, None, signal.SIGKILL))
        timer.daemon = True
        timer.start()
        try:
            stop()
        except (ChildProcessError, OSError):  # already reaped, or its socket already gone
            pass
        finally:
            timer.cancel()
    while True:  # workers of a forkserver that died, reparented here, and nobody else's
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
