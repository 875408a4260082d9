"""Making batches on a Ray cluster (``workers.executor: ray | mixed``).

Each remote worker is a Ray actor holding a ``BatchMaker`` (the same code as a local worker,
so a batch's bytes do not depend on where it was made). The dataset index travels once through
Ray's object store, with its root mapped by ``workers.ray.path_map`` to where the cluster's
nodes see the data.

The daemon is not Ray's driver: Ray ends a driver whose raylet is gone (a head restart takes
every node's raylet with it), and it must not end the data service. The driver runs in a child
process, the bridge (``raybridge``), which this class starts and talks to over a socket pair,
as the pool talks to a local worker. The bridge writes each remote batch as a temp file (named
with its pid); this daemon publishes it, so publishing stays atomic and local.

Faults: actors restart when their process or node dies (``max_restarts=-1``); the batches
they held come back as lost and are made again, like a dead local worker's. A batch that met
unreadable storage is not lost: the actor answers "unavailable" and the daemon waits for the
storage as for a local worker (``executors.storage``). A bridge that exits or dies (the
cluster is gone, Ray ended its driver, ``connect_timeout_s`` passed without an answer) is said
in one line and in the status (``ray``); its batches are made again, its temp files removed,
the daemon goes on with local workers and starts a new bridge after ``retry_s`` (the first
time after a working cluster was lost: after at most ``_FIRST_RETRY_S``). A reason said
once is not said again at every try (the status keeps it).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection

from prefetchd.core.config import RayConfig
from prefetchd.executors import helpers
from prefetchd.executors.raybridge import NO_WORKER_READY, Msg
from prefetchd.executors.worker import Quarantined, Result, Task, WorkerSetup, tmp_name

log = logging.getLogger("prefetchd.ray")

_FIRST_RETRY_S = 1.0  # a cluster that was working and was lost is tried again this soon, then every retry_s
_STOP_TIMEOUT_S = 10.0  # a bridge told to stop (it kills its actors) is killed after this
_START_SLACK_S = 15.0  # starting Python and importing ray, before connect_timeout_s counts
_TAIL_LINES = 20
_PARTIAL_GRACE_S = 10.0  # some actors up, others not yet: local stand-ins keep serving this long


class RayPool:
    """Remote workers behind the executor interface of ``pool.Pool`` (``idle``, ``submit``,
    ``results``, ``waitables``, ``stop``), through a bridge process."""

    def __init__(self, cfg: RayConfig, setup: WorkerSetup, max_in_flight: int, wake: Callable[[], None],
                 worker_id: int = 9999, task_timeout_s: float = 120.0,
                 clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self._clock = clock  # the daemon's RunClock: a job stopped whole and continued is no hung bridge
        self.task_timeout_s = task_timeout_s  # workers.task_timeout_s: a bridge holding a batch longer has hung
        self.setup = setup
        self.max_in_flight = max_in_flight
        self.wake = wake
        self.worker_id = worker_id  # names the temp files the bridge writes for remote batches
        self.state = "connecting"
        self.workers: dict[int, str] = {}  # ready actors: wid -> where (node:pid)
        self.restarts = 0  # batches lost and made again
        self.bridge_starts = 0
        self.bridge_deaths = 0  # bridges that exited without being told to (the cluster was lost)
        self._busy_s = 0.0
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._pidfd: int | None = None
        self._inited = False  # the bridge's driver is connected
        self._down: tuple[str, bool] | None = None  # what the bridge said before exiting
        self._deadline = 0.0  # no INIT by then: the bridge is killed
        self._in_flight: dict[int, tuple[Task, float]] = {}  # seq -> (task, sent at)
        self._seq = 0
        self._relaunch_at: float | None = None
        self._said: str | None = None  # the last failure said in the log
        self._lost = False  # the cluster was lost and is not back: tries that cannot reach it are not said again
        self._stopped = False
        self._tail: deque = deque(maxlen=_TAIL_LINES)  # the bridge's stderr (Ray's own messages)
        self._timers: list[threading.Timer] = []
        self._waiting = 0  # actors not up (starting, restarting, or waiting for room)
        self._up_since = 0.0  # when the first actor of this bridge was up
        self._lost_said: set[str] = set()  # kinds of loss logged since workers were last ready
        self._lost_quiet = 0  # batches lost since then and not logged (each counted in the status)

    # --- the bridge -----------------------------------------------------------------------------

    def start(self) -> None:
        self._launch()

    def _launch(self) -> None:
        # from the loop's thread only: the bridge dies with the thread that started it (PR_SET_PDEATHSIG)
        self._relaunch_at = None
        self._inited = False
        self._down = None
        self.workers = {}
        ours, theirs = socket.socketpair()
        # born with the group's stop signals blocked, as the forkserver is (helpers.GROUP_SIGNALS): a
        # SIGTERM to the daemon's whole group (scancel, timeout) is the daemon's to act on, not the
        # bridge's to die of (said as a lost cluster and a new bridge, during the stop); it is
        # stopped with SIGKILL, and dies with the daemon (PR_SET_PDEATHSIG, SIGKILL)
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, helpers.GROUP_SIGNALS)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "prefetchd.executors.raybridge", str(theirs.fileno()), str(os.getpid())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE)
        except OSError as e:
            ours.close()
            self._fail(f"cannot start the Ray bridge process ({e.strerror or e})", lost_cluster=False)
            return
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            theirs.close()
        self.bridge_starts += 1
        self._conn = Connection(ours.detach())
        self._pidfd = helpers.pidfd_open(self._proc.pid)
        self._deadline = self._clock() + _START_SLACK_S + self.cfg.connect_timeout_s
        self._tail = deque(maxlen=_TAIL_LINES)
        conn, proc, tail = self._conn, self._proc, self._tail
        start = (Msg.START, self.cfg, self.setup, self.worker_id)
        threading.Thread(target=_send_start, args=(conn, start), name="prefetchd-ray-start", daemon=True).start()
        threading.Thread(target=_read_stderr, args=(proc, tail), name="prefetchd-ray-stderr", daemon=True).start()
        self._timer(self._deadline)

    def _timer(self, at: float) -> None:
        """Wake the loop at ``at`` (a deadline or a retry is due); cancelled by ``stop``."""
        self._timers = [t for t in self._timers if t.is_alive()]
        t = threading.Timer(max(0.0, at - self._clock()) + 0.05, self._wake_unless_stopped)
        t.daemon = True
        t.start()
        self._timers.append(t)

    def _wake_unless_stopped(self) -> None:
        if not self._stopped:  # after stop the loop's wake pipe may be closed
            self.wake()

    def _fail(self, why: str, lost_cluster: bool, retry: bool = True) -> None:
        """The bridge is gone (or never came): local workers go on; a new bridge after a while."""
        again = retry and self.cfg.retry_s > 0 and not self._stopped
        self.workers = {}
        self.state = (f"unavailable: {why}; making batches with local workers"
                      + (f"; trying again every {self.cfg.retry_s:g} s" if again else ""))
        quiet = self._lost and why.startswith(("cannot reach", "no answer"))
        if why != self._said and not quiet:  # said once; the status keeps saying it
            log.warning("ray: %s", self.state)
            self._said = why
        else:
            log.debug("ray: %s", self.state)
        self._lost = self._lost or lost_cluster
        if again:
            delay = min(_FIRST_RETRY_S, self.cfg.retry_s) if lost_cluster else self.cfg.retry_s
            self._relaunch_at = self._clock() + delay
            self._timer(self._relaunch_at)
        self.wake()

    def _bridge_gone(self) -> list[Task]:
        """Reap the bridge; its batches are lost (made again), its temp files removed."""
        proc, pid = self._proc, self._proc.pid
        try:
            code = proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            helpers.send_signal(pid, self._pidfd, signal.SIGKILL)
            code = proc.wait()
        self._close()
        lost = [task for task, _ in self._in_flight.values()]
        for task in lost:
            try:
                os.unlink(os.path.join(self.setup.buffer_dir, tmp_name(task, self.worker_id, pid)))
            except OSError:
                pass
        self._in_flight.clear()
        self.restarts += len(lost)
        if self._stopped:
            return lost
        redo = f"; {len(lost)} batches it held are made again" if lost else ""
        if self._down is not None:
            why, retry = self._down
            self._fail(why + redo, lost_cluster=why.startswith("lost the Ray cluster") or bool(self.workers),
                       retry=retry)
            return lost
        was_up = bool(self.workers) or self._inited
        self.bridge_deaths += 1
        last = next((line for line in reversed(self._tail) if line.strip()), "")
        how = helpers.describe_exit(code)
        why = (f"the Ray bridge (pid {pid}, Ray's driver) {how}" + (f" (its last words: {last.strip()[:200]})"
                                                                    if last else "") + redo)
        self._said = None  # always said: the cluster was lost (or never answered)
        self._fail(why, lost_cluster=was_up)
        return lost

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
        if self._pidfd is not None:
            os.close(self._pidfd)
        self._conn = self._pidfd = self._proc = None

    @property
    def connected(self) -> bool:
        """Remote workers serve (``executor: ray`` stops its local stand-ins): every actor is up,
        or some have been for ``_PARTIAL_GRACE_S`` (the others may wait long for room)."""
        if not self.workers:
            return False
        return not self._waiting or self._clock() - self._up_since >= _PARTIAL_GRACE_S

    # --- the executor interface -----------------------------------------------------------------------

    def idle(self) -> int:
        """Free task slots."""
        return max(0, len(self.workers) * self.max_in_flight - len(self._in_flight))

    def submit(self, task: Task) -> bool:
        if not self.idle() or self._conn is None:
            return False
        self._seq += 1
        try:
            self._conn.send((Msg.TASK, self._seq, task))
        except OSError:  # the bridge is dying: results() says so
            return False
        self._in_flight[self._seq] = (task, self._clock())
        return True

    def waitables(self) -> list:
        return [] if self._conn is None else [self._conn] + ([self._pidfd] if self._pidfd is not None else [])

    def results(self) -> tuple[list[Result], list[Task]]:
        """Finished remote batches (temp files the bridge wrote) and lost ones; does not block."""
        results: list[Result] = []
        lost: list[Task] = []
        now = self._clock()
        if self._conn is not None:
            gone = False
            try:
                while self._conn.poll(0):
                    self._handle(self._conn.recv(), results, lost, now)
            except (EOFError, OSError):
                gone = True
            except Exception as e:  # noqa: BLE001 -- a message that cannot be read: a broken bridge
                log.error("ray: unreadable message from the Ray bridge (%s: %s); killing it", type(e).__name__, e)
                helpers.send_signal(self._proc.pid, self._pidfd, signal.SIGKILL)
                gone = True
            if gone or (self._pidfd is not None and helpers.has_exited(self._pidfd)):
                lost += self._bridge_gone()
            elif (held := self._held_too_long(now)) is not None:
                helpers.send_signal(self._proc.pid, self._pidfd, signal.SIGKILL)
                self._down = (held, True)
                lost += self._bridge_gone()
            elif not self._inited and now > self._deadline:
                log.debug("ray: the bridge did not connect in time; killing it")
                helpers.send_signal(self._proc.pid, self._pidfd, signal.SIGKILL)
                self._down = (f"no answer from the Ray cluster at {self.cfg.address} within "
                              f"{self.cfg.connect_timeout_s:g} s (workers.ray.connect_timeout_s)", True)
                lost += self._bridge_gone()
        elif self._relaunch_at is not None and now >= self._relaunch_at and not self._stopped:
            self._launch()
        return results, lost

    def _held_too_long(self, now: float) -> str | None:
        """Why the bridge is taken for hung: it has held a batch past ``workers.task_timeout_s``
        (stopped, or its driver stuck in Ray) and the batches it holds would never come."""
        if not self._in_flight:
            return None
        task, sent = min(self._in_flight.values(), key=lambda v: v[1])
        if now - sent <= self.task_timeout_s:
            return None
        return (f"the Ray bridge (pid {self._proc.pid}) held batch r{task.rank} e{task.epoch} b{task.batch} for "
                f"{now - sent:.0f} s without an answer (workers.task_timeout_s {self.task_timeout_s:g}); killed it")

    def _handle(self, msg: tuple, results: list, lost: list, now: float) -> None:
        kind = msg[0]
        if kind == Msg.DONE:
            task, t0 = self._in_flight.pop(msg[1], (None, now))
            if task is not None:
                self._busy_s += now - t0
                results.append(msg[2])
        elif kind == Msg.LOST:
            task, _ = self._in_flight.pop(msg[1], (None, now))
            if task is not None:
                self.restarts += 1
                self._say_lost(task, str(msg[2]))
                lost.append(task)
            if msg[2] == NO_WORKER_READY:  # none ready: nothing is sent until an UP says one is (no resubmit loop)
                self.workers = {}
        elif kind == Msg.UP:
            _, ready, self._waiting, state = msg
            if ready and not self.workers:
                self._up_since = now
                self._timer(now + _PARTIAL_GRACE_S)  # the loop looks at ``connected`` again then
            self.workers = dict(ready)
            self.state = state
            if ready:
                self._said, self._lost = None, False
                if self._lost_quiet:
                    log.info("ray: %d more batches were lost and made again while no Ray worker was ready "
                             "(the status counts them all)", self._lost_quiet)
                self._lost_said, self._lost_quiet = set(), 0
                log.info("ray: %s", state)
        elif kind == Msg.INIT:
            self._inited = True
        elif kind == Msg.DOWN:
            self._down = (msg[1], msg[2])
        elif kind == Msg.LOG:
            log.log(msg[1], "ray: %s", msg[2])

    def _say_lost(self, task: Task, why: str) -> None:
        """One line per kind of loss until workers are ready again (an outage loses every batch in
        flight, and more while the actors restart); the rest at debug level, counted in the status."""
        kind = why.split(":")[0]
        if kind in self._lost_said:
            self._lost_quiet += 1
            log.debug("ray: batch r%d e%d b%d was lost (%s); making it again", task.rank, task.epoch, task.batch, why)
            return
        self._lost_said.add(kind)
        log.error("ray: batch r%d e%d b%d was lost (%s); making it again (more lost this way until a Ray worker "
                  "is ready are counted in the status, not logged)", task.rank, task.epoch, task.batch, why)

    def status(self) -> dict:
        return {"state": self.state, "workers": len(self.workers), "lost_batches": self.restarts,
                "where": list(self.workers.values()), "in_flight": len(self._in_flight), "busy_s": self._busy_s,
                "bridge": {"pid": self._proc.pid if self._proc is not None else None, "starts": self.bridge_starts,
                           "deaths": self.bridge_deaths}}

    def stop(self) -> None:
        """Tell the bridge to stop (it kills its actors, placed or pending, and leaves the
        cluster); kill it if it does not within ``_STOP_TIMEOUT_S`` (Ray then removes the actors
        of the dead driver)."""
        self._stopped = True
        for t in self._timers:
            t.cancel()
        if self._proc is None:
            return
        proc = self._proc
        if self._inited:  # it may have actors: it kills them (before that, the start may still be being sent)
            try:
                self._conn.send((Msg.STOP,))
                proc.wait(timeout=_STOP_TIMEOUT_S)
            except (OSError, subprocess.TimeoutExpired):
                pass
        helpers.send_signal(proc.pid, self._pidfd, signal.SIGKILL)  # gone by now, or nothing of it to keep
        self._bridge_gone()


def _send_start(conn: Connection, msg: tuple) -> None:
    """The set-up (the whole index) to a new bridge, off the loop's thread."""
    try:
        conn.send(msg)
    except OSError:  # it died first: results() says so
        pass


def _read_stderr(proc: subprocess.Popen, tail: deque) -> None:
    """Ray's own messages on the bridge's stderr: kept for the line that says why it died, and
    logged at debug level (its stack dumps never fill the daemon's log)."""
    for raw in iter(proc.stderr.readline, b""):
        line = raw.decode(errors="replace").rstrip()
        tail.append(line)
        log.debug("ray bridge: %s", line)
    proc.stderr.close()


__all__ = ["RayPool", "Quarantined"]
