"""The local executor: worker processes started by forkserver, one pipe each, watched by pidfds.

Every executor (this one, ``raypool.RayPool``) offers the same small interface the daemon's loop
drives without asking which kind it has: ``idle()`` (free task slots), ``submit(task)``,
``results()`` (finished and lost tasks, without blocking), ``waitables()`` (what the loop may
wait on) and ``stop()``.

Each worker has its own duplex pipe, so the pool always knows which tasks a worker holds. A
worker that dies (its pidfd or its pipe says so, without the forkserver's help) or holds one
task longer than ``workers.task_timeout_s`` (hung in a decode, stopped) is killed if need be,
its temp files are removed at once, its tasks come back as lost (to be made again) and it is
replaced, after a back-off that grows while workers keep dying. That deadline, like every one
but the teardown's, is on the clock the daemon hands in (``core.runclock.RunClock``): the time
the daemon ran, so a job stopped whole (``scontrol suspend``, Ctrl-Z) kills no worker on SIGCONT. Only a crash (SIGSEGV, SIGBUS,
SIGILL, SIGFPE, SIGABRT, or an exit) while a sample was being decoded names that sample as a
suspect; a death while writing, and a kill from outside (SIGKILL: the OOM killer, an operator,
the deadline), blame nobody, so random kills never quarantine a good sample. A worker's exit
status comes from ``waitid`` when it is this process's child (its forkserver died: see
``helpers``), else from the forkserver's report; when neither comes within
``_EXIT_STATUS_GRACE_S`` (the forkserver is stopped) it is buried unknown, blaming nobody.
Crashes of workers that never made a batch are counted apart (``crashes_before_a_batch``): the
daemon's sign of a broken set-up; kills from outside and unknown deaths are not.

The forkserver and the resource tracker are watched by ``helpers.Helpers``: one that dies or
does not answer a worker's start in time is replaced. A worker that cannot be started is tried
again with the same back-off as a death; ``PoolError`` only when none could be started for
``_UNSTARTABLE_S``.

Stop signals are the daemon's: workers ignore SIGTERM, SIGINT and SIGHUP (``helpers.GROUP_SIGNALS``;
a signal to the daemon's process group reaches them too), so the daemon ends them, by SIGKILL:
their work can be made again and their temp files are the pool's to remove. Once the daemon is
stopping (the ``stopping`` it hands in), a worker that dies is not said, counted or replaced.

Teardown: kill, wait. The forkserver and the resource tracker are process-wide (other
multiprocessing users in the same process share them), so only the CLI stops them, as its
process exits (``stop_helpers``), and only if ``Pool.stop`` saw every worker gone. Surplus
workers (a reload lowered the count) get a stop message and are reaped later by ``results``,
killed if they do not go, without the loop ever waiting on them.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.process
import os
import select
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from multiprocessing import forkserver
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as mp_wait

from prefetchd.executors import helpers
from prefetchd.executors.fdwait import FdWait
from prefetchd.executors.helpers import SpawnError, describe_exit
from prefetchd.executors.worker import Result, Task, WorkerSetup, tmp_name, worker_main
from prefetchd.sources.dataset import index_files_hold

log = logging.getLogger("prefetchd.pool")

_WORKER_JOIN_TIMEOUT_S = 3.0  # a surplus worker told to stop is killed after this
_WORKER_KILL_TIMEOUT_S = 2.0  # a worker killed has this long to be seen gone
_RESPAWN_BASE_S = 0.1  # a worker dying soon after the last one is replaced after this, doubling...
_RESPAWN_MAX_S = 10.0  # ...up to this
_CALM_S = 30.0  # no death for this long: replace the next one at once again
_EXIT_STATUS_GRACE_S = 0.5  # a dead worker's status not known after this (its forkserver is stopped): buried unknown
_UNSTARTABLE_S = 60.0  # no worker could be started for this long: an error
_CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT}


@dataclass
class Worker:
    wid: int
    process: mp.process.BaseProcess
    conn: Connection
    tasks: deque = field(default_factory=deque)  # Task, in the order sent
    current: object = None  # shared int64 [1]: the sample the worker is decoding, -1 otherwise
    ready: bool = False
    head_since: float = 0.0  # when the worker started on tasks[0]
    busy_s: float = 0.0
    pid: int = 0
    pidfd: int | None = None  # readable once the worker has exited (None: no pidfds; the pipe tells)
    dead_at: float | None = None  # when its death was noticed (its status may come a little later)
    code: int | None = None  # its exit status, once known
    made: bool = False  # it has made a batch (its set-up works)

    def exited(self) -> bool:
        if self.dead_at is not None:
            return True
        if self.pidfd is not None:
            return helpers.has_exited(self.pidfd)
        return not self.process.is_alive()


stop_helpers = helpers.stop_helpers  # the CLI's, at exit


class PoolError(RuntimeError):
    """No worker could be started for ``_UNSTARTABLE_S``; the message names what failed."""


class Pool:
    def __init__(self, setup: WorkerSetup, count: int, max_in_flight: int = 2, task_timeout_s: float = 120.0,
                 index=None, clock: Callable[[], float] = time.monotonic, stopping: Callable[[], bool] = lambda: False):
        self.setup = setup
        # what every deadline but the teardown's is measured on: the daemon's ``RunClock``, which
        # leaves out the time the process was stopped (a job suspended whole kills no worker on SIGCONT)
        self._clock = clock
        self.stopping = stopping  # the daemon is stopping: deaths are part of it, nothing is replaced
        self.index = index  # the daemon's own index: sent whole to a worker if its cache files are gone
        self._index_sent_warned = False
        self.count = count
        self.max_in_flight = max_in_flight
        self.task_timeout_s = task_timeout_s
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(["prefetchd.executors.worker"])
        self.workers: dict[int, Worker] = {}
        self.suspects: list[tuple[int, str]] = []  # (sample index, how its worker died)
        self._next_id = 0
        self.restarts = 0
        self.timeouts = 0
        # crashes (an exit status > 0, or SIGSEGV, SIGBUS, ...) of workers that never made a batch:
        # a broken set-up; kills from outside (the OOM killer, task_timeout_s) do not count
        self.crashes_before_a_batch = 0
        self._respawn_delay = 0.0
        self._respawn_at = 0.0
        self._last_death = -1e9
        self._stopping: list[tuple[Worker, float]] = []  # surplus workers told to stop: (worker, since)
        self.stopped_clean = False  # set by stop(): every worker is gone (the helpers may be stopped)
        self.helpers = helpers.Helpers(stopping)
        self._unstartable_since: float | None = None  # the first failed start since the last good one
        self._orphans: list[tuple[int, int]] = []  # (pid, pidfd) of buried workers not reaped yet
        self._fdwait = FdWait()
        self.priority = ""  # what the workers' priority became (executors.priority), as they said

    def start(self) -> None:
        self._replace(force=True)

    def _spawn(self) -> Worker:
        """Start one worker; ``SpawnError`` if it could not be (the forkserver is replaced)."""
        wid = self._next_id
        parent, child = self.ctx.Pipe(duplex=True)
        current = self.ctx.RawArray("q", 1)
        current[0] = -1
        p = self.ctx.Process(target=worker_main, args=(child, wid, self._worker_setup(), current),
                             name=f"prefetchd-worker-{wid}", daemon=True)
        try:
            self.helpers.spawn(p.start)
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        self._next_id += 1
        # the pool watches and reaps it: multiprocessing must not poll it (and eat its exit status
        # from the forkserver) nor join it at exit (forever, if the forkserver is stopped)
        multiprocessing.process._children.discard(p)
        w = Worker(wid, p, parent, current=current, pid=p.pid, pidfd=helpers.pidfd_open(p.pid))
        self.workers[wid] = w
        return w

    def _worker_setup(self) -> WorkerSetup:
        """What a new worker is born from: the daemon's index, never a fresh look at the dataset.
        Normally the worker maps the cache files the daemon read; if another process rescanned a
        changed dataset and replaced them, the index goes down the worker's pipe instead (a copy
        per worker, but a worker that starts)."""
        s = self.setup
        if s.index is not None or s.index_dir is None or s.index_fingerprint is None or self.index is None:
            return s
        if index_files_hold(s.index_dir, s.index_fingerprint):
            return s
        if not self._index_sent_warned:
            log.warning("the index cache in %s no longer holds this daemon's index (the dataset was rescanned by "
                        "another process?); new workers are sent the index through their pipe", s.index_dir)
            self._index_sent_warned = True
        return replace(s, index_dir=None, index=replace(self.index, files_dir=None))

    def resize(self, count: int) -> None:
        """Grow at once (a start that fails is retried after the back-off); shrink as workers
        fall idle."""
        self.count = count
        try:
            self._replace(force=True)
        except PoolError:
            pass  # results() says it and the daemon stops

    # --- the executor interface ---------------------------------------------------------------------

    def idle(self) -> int:
        """Free task slots."""
        return sum(self.max_in_flight - len(w.tasks) for w in self.workers.values()
                   if w.ready and len(w.tasks) < self.max_in_flight)

    def submit(self, task: Task) -> bool:
        ws = [w for w in self.workers.values() if w.ready and len(w.tasks) < self.max_in_flight]
        if not ws:
            return False
        w = min(ws, key=lambda w: len(w.tasks))
        try:
            w.conn.send(task)
        except (OSError, BrokenPipeError):
            return False
        if not w.tasks:
            w.head_since = self._clock()
        w.tasks.append(task)
        return True

    def waitables(self) -> list:
        objs: list = list(self.helpers.waitables())
        for w in self.workers.values():
            if w.dead_at is not None:  # waiting for its status from the forkserver
                objs.append(w.process.sentinel)
            else:
                objs += [w.conn, w.pidfd if w.pidfd is not None else w.process.sentinel]
        return objs

    def results(self) -> tuple[list[Result], list[Task]]:
        """Finished tasks, and tasks lost with dead or timed-out workers; does not block."""
        results: list[Result] = []
        lost: list[Task] = []
        self.helpers.check()
        now = self._clock()
        ready = self._ready()
        for w in list(self.workers.values()):
            try:
                while w.dead_at is None and w.conn.fileno() in ready:
                    msg = w.conn.recv()
                    ready = self._ready_after_recv(ready, w.conn.fileno())
                    if isinstance(msg, tuple) and msg and msg[0] == "ready":
                        w.ready = True
                        if len(msg) > 3 and msg[3] != self.priority:  # said once, and again if it changes
                            self.priority = msg[3]
                            log.info("workers run at CPU priority: %s", msg[3])
                        continue
                    w.tasks.popleft()
                    w.busy_s += now - w.head_since
                    w.head_since = now
                    results.append(msg)
                    if msg.error is None:
                        self._respawn_delay = 0.0
                        w.made = True
            except (EOFError, OSError):  # its end of the pipe closed: it is dying
                w.dead_at = now
            if w.dead_at is None and (w.pidfd in ready if w.pidfd is not None else w.exited()):
                w.dead_at = now
            if w.dead_at is not None:
                if (self._exit_status(w) or now - w.dead_at >= _EXIT_STATUS_GRACE_S
                        or self.helpers.forkserver_stopped()):
                    lost += self._bury(w)
            elif w.tasks and now - w.head_since > self.task_timeout_s:
                t = w.tasks[0]
                log.error("worker %d (pid %s) has held batch r%d e%d b%d for %.0f s (workers.task_timeout_s); "
                          "killing it", w.wid, w.pid, t.rank, t.epoch, t.batch, now - w.head_since)
                self.timeouts += 1
                helpers.send_signal(w.pid, w.pidfd, signal.SIGKILL)
                if w.pidfd is not None:
                    helpers.wait_exited(w.pidfd, 1.0)
                w.dead_at = now
                self._exit_status(w)
                lost += self._bury(w, blame=False)
        self._reap_orphans()
        self._replace()
        self._shrink_idle()
        self._reap_stopping(now)
        return results, lost

    def _ready(self) -> set[int]:
        """Of the live workers' result pipes and pidfds, those ready now: one poll for the pool,
        not one per worker (see fdwait)."""
        fds = []
        for w in self.workers.values():
            if w.dead_at is None:
                fds.append(w.conn.fileno())
                if w.pidfd is not None:
                    fds.append(w.pidfd)
        return self._fdwait.ready(tuple(fds))

    @staticmethod
    def _ready_after_recv(ready: set[int], fd: int) -> set[int]:
        """``ready`` with ``fd`` looked at again: another message may wait behind the one read."""
        if not select.select([fd], [], [], 0)[0]:
            ready = ready - {fd}
        return ready

    def wake_due(self) -> float | None:
        """When the loop must call ``results`` again without being woken: a worker is missing,
        or a dead worker's status is awaited."""
        due = [w.dead_at + _EXIT_STATUS_GRACE_S for w in self.workers.values() if w.dead_at is not None]
        respawn = self.respawn_due()
        if respawn is not None:
            due.append(respawn)
        if self._orphans:
            due.append(self._clock() + 1.0)
        return min(due) if due else None

    def stop(self) -> None:
        """Stop every worker now (SIGKILL: they ignore the stop signals, and a stopped one dies
        too). Their work can be made again, so nothing is waited for; their temp files are
        removed."""
        ws = list(self.workers.values()) + [w for w, _ in self._stopping]
        self._stopping.clear()
        for w in ws:
            if not w.exited():
                helpers.send_signal(w.pid, w.pidfd, signal.SIGKILL)
        deadline = time.monotonic() + _WORKER_KILL_TIMEOUT_S
        for w in ws:
            self._wait_exit(w, deadline - time.monotonic())
            self._remove_temp(w)
            w.conn.close()
        clean = all(w.exited() for w in ws)  # nothing holds the tracker's pipe
        for w in ws:
            self._forget(w)
        self.workers.clear()
        self._reap_orphans()
        self.helpers.close()
        self.stopped_clean = clean

    def _wait_exit(self, w: Worker, timeout: float) -> bool:
        if w.pidfd is not None:
            return w.dead_at is not None or helpers.wait_exited(w.pidfd, timeout)
        w.process.join(max(0.0, timeout))
        return not w.process.is_alive()

    # --- deaths ---------------------------------------------------------------------------------------

    def _exit_status(self, w: Worker) -> bool:
        """Learn a dead worker's exit status: from ``waitid`` if it is this process's child (its
        forkserver died), else from its forkserver's report. False: not known yet."""
        if w.pidfd is not None:
            code = helpers.child_status(w.pidfd)
            if code is not None:
                w.code = code
                return True
        elif not w.process.is_alive():  # no pidfds: multiprocessing's own report
            w.code = w.process.exitcode
            return True
        if not mp_wait([w.process.sentinel], 0):
            return False
        try:
            w.code = forkserver.read_signed(w.process.sentinel)
        except (EOFError, OSError):  # the forkserver died before it could say
            w.code = None
        return True

    def _forget(self, w: Worker) -> None:
        """The pool is done with ``w``; its pidfd is kept only until someone has reaped it."""
        if w.pidfd is None:
            return
        if helpers.child_status(w.pidfd) is not None or helpers.is_gone(w.pidfd):
            os.close(w.pidfd)
        else:  # a zombie of a stopped forkserver: reaped here once that one is killed
            self._orphans.append((w.pid, w.pidfd))
        w.pidfd = None

    def _reap_orphans(self) -> None:
        keep = []
        for pid, fd in self._orphans:
            if helpers.child_status(fd) is not None or helpers.is_gone(fd):
                os.close(fd)
            else:
                keep.append((pid, fd))
        self._orphans = keep

    def _bury(self, w: Worker, blame: bool = True) -> list[Task]:
        if w.pidfd is not None and not helpers.has_exited(w.pidfd):
            helpers.send_signal(w.pid, w.pidfd, signal.SIGKILL)  # its pipe broke, but it runs: no half-dead workers
        tasks = list(w.tasks)
        if not self.stopping():  # during a stop a death is part of it: neither said, blamed, counted nor replaced
            self._mourn(w, tasks, blame)
        self._remove_temp(w)
        try:
            w.conn.close()
        except OSError:
            pass
        self._forget(w)
        del self.workers[w.wid]
        return tasks

    def _mourn(self, w: Worker, tasks: list[Task], blame: bool) -> None:
        """Say a death, blame its sample if it crashed, count it, and time its replacement."""
        what = ", ".join(f"r{t.rank} e{t.epoch} b{t.batch}" for t in tasks) or "no batch"
        code = w.code
        how = describe_exit(code)
        crashed = code is not None and (code > 0 or -code in _CRASH_SIGNALS)
        sample = int(w.current[0]) if blame and crashed and w.current is not None and tasks else -1
        now = self._clock()
        if now - self._last_death > _CALM_S:
            self._respawn_delay = 0.0
        else:  # deaths in a row: wait longer each time before the next replacement
            self._respawn_delay = min(_RESPAWN_MAX_S, max(_RESPAWN_BASE_S, self._respawn_delay * 2))
        self._last_death = now
        self._respawn_at = max(self._respawn_at, now + self._respawn_delay)
        if blame:
            when = f" in {self._respawn_delay:.1f} s" if self._respawn_delay else ""
            log.error("worker %d (pid %s) %s while making %s%s; replacing it%s and making its batches again",
                      w.wid, w.pid, how, what, f" (at sample {sample})" if sample >= 0 else "", when)
        if sample >= 0:
            self.suspects.append((sample, how))
        if crashed and not w.made:
            self.crashes_before_a_batch += 1
        self.restarts += 1

    def _remove_temp(self, w: Worker) -> None:
        """The temp files a dead worker may have left for its tasks: gone at once, not at stop."""
        if not w.pid:
            return
        for t in w.tasks:
            try:
                os.unlink(os.path.join(self.setup.buffer_dir, tmp_name(t, w.wid, w.pid)))
            except OSError:
                pass

    def _replace(self, force: bool = False) -> None:
        """Start the missing workers once the back-off allows (``force``: now). A start that
        fails waits out the back-off, doubled, like a death; ``PoolError`` when none could be
        started for ``_UNSTARTABLE_S``."""
        if len(self.workers) >= self.count or not (force or self._clock() >= self._respawn_at) or self.stopping():
            return
        while len(self.workers) < self.count:
            try:
                self._spawn()
            except SpawnError as e:
                now = self._clock()
                if self._unstartable_since is None:
                    self._unstartable_since = now
                elif now - self._unstartable_since >= _UNSTARTABLE_S:
                    raise PoolError(f"no worker could be started for {_UNSTARTABLE_S:.0f} s; the last try: {e}") from None
                self._respawn_delay = min(_RESPAWN_MAX_S, max(_RESPAWN_BASE_S, self._respawn_delay * 2))
                self._respawn_at = now + self._respawn_delay
                self._last_death = now
                log.error("cannot start worker %d: %s; trying again in %.1f s", self._next_id, e, self._respawn_delay)
                return
            self._unstartable_since = None

    def respawn_due(self) -> float | None:
        """When a missing worker will be replaced (for the loop's wait), if one is missing."""
        return self._respawn_at if len(self.workers) < self.count else None

    def _shrink_idle(self) -> None:
        """Stop surplus workers (after a reload lowered the count) once they hold no task."""
        for w in list(self.workers.values()):
            if len(self.workers) <= self.count:
                return
            if not w.tasks and w.ready:
                self._stop_one(w)
                del self.workers[w.wid]

    def _stop_one(self, w: Worker) -> None:
        """Ask a surplus worker to stop; ``_reap_stopping`` collects it. Never blocks."""
        try:
            w.conn.send(None)
        except (OSError, BrokenPipeError):
            pass
        self._stopping.append((w, self._clock()))

    def _reap_stopping(self, now: float) -> None:
        """Surplus workers that have exited are joined; one that ignores the stop message (busy,
        stopped) is killed after _WORKER_JOIN_TIMEOUT_S."""
        keep = []
        for w, since in self._stopping:
            if w.exited():
                w.conn.close()
                if not self._exit_status(w):  # the forkserver has not said yet: ask again later
                    w.dead_at = w.dead_at or now
                    if now - w.dead_at < _EXIT_STATUS_GRACE_S:
                        keep.append((w, since))
                        continue
                self._forget(w)
                continue
            if now - since > _WORKER_JOIN_TIMEOUT_S:
                helpers.send_signal(w.pid, w.pidfd, signal.SIGKILL)
            keep.append((w, since))
        self._stopping = keep

    def temp_bytes(self) -> int:
        """What the batches in flight have written so far (already counted in the free space)."""
        n = 0
        for w in self.workers.values():
            for t in w.tasks:
                try:
                    n += os.stat(os.path.join(self.setup.buffer_dir, tmp_name(t, w.wid, w.pid))).st_size
                except OSError:
                    pass
        return n

    def pids(self) -> list[int]:
        return [w.pid for w in self.workers.values() if w.pid]

    def child_pids(self) -> list[int]:
        """Every process the pool's work runs in: the workers (surplus ones being stopped too),
        then the forkserver and the resource tracker (what a last-resort kill must take)."""
        ws = [*self.workers.values(), *(w for w, _ in self._stopping)]
        return [w.pid for w in ws if w.pid] + [p for p in self.helpers.pids().values() if p]

    def busy_s(self) -> float:
        return sum(w.busy_s for w in self.workers.values())

    def alive(self) -> int:
        return sum(1 for w in self.workers.values() if not w.exited())
