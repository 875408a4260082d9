"""The local executor: worker processes started by forkserver, one pipe each, watched by their
sentinels.

Every executor (this one, ``raypool.RayPool``) offers the same small interface the daemon's loop
drives without asking which kind it has: ``idle()`` (free task slots), ``submit(task)``,
``results()`` (finished and lost tasks, without blocking), ``waitables()`` (what the loop may
wait on) and ``stop()``.

Each worker has its own duplex pipe, so the pool always knows which tasks a worker holds. A
worker that dies (its sentinel becomes ready) or holds one task longer than
``workers.task_timeout_s`` (hung in a decode, stopped) is killed if need be, its temp files are
removed at once, its tasks come back as lost (to be made again) and it is replaced, after a
back-off that grows while workers keep dying. Only a crash (SIGSEGV, SIGBUS, SIGILL, SIGFPE,
SIGABRT, or an exit) while a sample was being decoded names that sample as a suspect; a death
while writing, and a kill from outside (SIGKILL: the OOM killer, an operator, the deadline),
blame nobody, so random kills never quarantine a good sample.
Teardown: terminate, join, kill. The forkserver and the resource tracker are process-wide
(other multiprocessing users in the same process share them), so only the CLI stops them, as
its process exits (``stop_helpers``), and only if ``Pool.stop`` saw every worker gone. Surplus
workers (a reload lowered the count) get a stop message and are reaped later by ``results``,
escalating to terminate and kill, without the loop ever waiting on them.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import time
from collections import deque
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection

from prefetchd.core.dataset import index_files_hold
from prefetchd.executors.worker import Result, Task, WorkerSetup, tmp_name, worker_main

log = logging.getLogger("prefetchd.pool")

_WORKER_JOIN_TIMEOUT_S = 3.0
_WORKER_TERM_TIMEOUT_S = 2.0
_RESPAWN_BASE_S = 0.1  # a worker dying soon after the last one is replaced after this, doubling...
_RESPAWN_MAX_S = 10.0  # ...up to this
_CALM_S = 30.0  # no death for this long: replace the next one at once again
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


def stop_helpers() -> None:
    """Stop multiprocessing's forkserver, then its resource tracker (the forkserver holds the
    tracker's pipe). Left alone they exit only after seeing this process end, and systemd
    (KillMode=mixed) SIGKILLs whatever of the unit is alive when the main process exits: "Killing
    process N (python3) with signal SIGKILL" at every stop. ``_stop`` is how CPython's own tests
    stop them (3.11 and later). For the process's exit only: it breaks any other multiprocessing
    user still running in this process."""
    from multiprocessing import forkserver, resource_tracker

    for helper in (forkserver._forkserver, resource_tracker._resource_tracker):
        stop = getattr(helper, "_stop", None)
        if stop is not None:
            stop()


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "vanished"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = ", perhaps out of memory?" if -code == signal.SIGKILL else ""
        return f"was killed by {name}{hint}"
    return f"exited with status {code}"


class Pool:
    def __init__(self, setup: WorkerSetup, count: int, max_in_flight: int = 2, task_timeout_s: float = 120.0,
                 index=None):
        self.setup = setup
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
        self._respawn_delay = 0.0
        self._respawn_at = 0.0
        self._last_death = -1e9
        self._stopping: list[tuple[Worker, float]] = []  # surplus workers told to stop: (worker, since)
        self.stopped_clean = False  # set by stop(): every worker is gone (the helpers may be stopped)

    def start(self) -> None:
        for _ in range(self.count):
            self._spawn()

    def _spawn(self) -> Worker:
        wid = self._next_id
        self._next_id += 1
        parent, child = self.ctx.Pipe(duplex=True)
        current = self.ctx.RawArray("q", 1)
        current[0] = -1
        p = self.ctx.Process(target=worker_main, args=(child, wid, self._worker_setup(), current),
                             name=f"prefetchd-worker-{wid}", daemon=True)
        p.start()
        child.close()
        w = Worker(wid, p, parent, current=current)
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
        """Grow at once; shrink as workers fall idle."""
        self.count = count
        while len(self.workers) < count:
            self._spawn()

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
            w.head_since = time.monotonic()
        w.tasks.append(task)
        return True

    def waitables(self) -> list:
        objs: list = []
        for w in self.workers.values():
            objs += [w.conn, w.process.sentinel]
        return objs

    def results(self) -> tuple[list[Result], list[Task]]:
        """Finished tasks, and tasks lost with dead or timed-out workers; does not block."""
        results: list[Result] = []
        lost: list[Task] = []
        now = time.monotonic()
        for w in list(self.workers.values()):
            try:
                while w.conn.poll():
                    msg = w.conn.recv()
                    if isinstance(msg, tuple) and msg and msg[0] == "ready":
                        w.ready = True
                        continue
                    w.tasks.popleft()
                    w.busy_s += now - w.head_since
                    w.head_since = now
                    results.append(msg)
                    if msg.error is None:
                        self._respawn_delay = 0.0
            except (EOFError, OSError):
                pass  # the sentinel tells the rest
            if not w.process.is_alive():
                lost += self._bury(w)
            elif w.tasks and now - w.head_since > self.task_timeout_s:
                t = w.tasks[0]
                log.error("worker %d (pid %s) has held batch r%d e%d b%d for %.0f s (workers.task_timeout_s); "
                          "killing it", w.wid, w.process.pid, t.rank, t.epoch, t.batch, now - w.head_since)
                self.timeouts += 1
                w.process.kill()
                lost += self._bury(w, blame=False)
        self._replace()
        self._shrink_idle()
        self._reap_stopping(now)
        return results, lost

    def stop(self) -> None:
        """Stop every worker now. Their work can be made again, so nothing is waited for; their
        temp files are removed."""
        ws = list(self.workers.values()) + [w for w, _ in self._stopping]
        self._stopping.clear()
        for w in ws:
            if w.process.is_alive():
                w.process.terminate()
                try:  # a stopped (SIGSTOP) worker must run to die of SIGTERM
                    os.kill(w.process.pid, signal.SIGCONT)
                except OSError:
                    pass
        deadline = time.monotonic() + _WORKER_TERM_TIMEOUT_S
        for w in ws:
            w.process.join(max(0.0, deadline - time.monotonic()))
            if w.process.is_alive():
                w.process.kill()
                w.process.join(1.0)
            self._remove_temp(w)
            w.conn.close()
        self.workers.clear()
        self.stopped_clean = not any(w.process.is_alive() for w in ws)  # nothing holds the tracker's pipe

    # --- deaths ---------------------------------------------------------------------------------------

    def _bury(self, w: Worker, blame: bool = True) -> list[Task]:
        w.process.join(1.0)
        tasks = list(w.tasks)
        what = ", ".join(f"r{t.rank} e{t.epoch} b{t.batch}" for t in tasks) or "no batch"
        how = _describe_exit(w.process.exitcode)
        code = w.process.exitcode
        crashed = code is not None and (code > 0 or -code in _CRASH_SIGNALS)
        sample = int(w.current[0]) if blame and crashed and w.current is not None and tasks else -1
        now = time.monotonic()
        if now - self._last_death > _CALM_S:
            self._respawn_delay = 0.0
        else:  # deaths in a row: wait longer each time before the next replacement
            self._respawn_delay = min(_RESPAWN_MAX_S, max(_RESPAWN_BASE_S, self._respawn_delay * 2))
        self._last_death = now
        self._respawn_at = max(self._respawn_at, now + self._respawn_delay)
        if blame:
            when = f" in {self._respawn_delay:.1f} s" if self._respawn_delay else ""
            log.error("worker %d (pid %s) %s while making %s%s; replacing it%s and making its batches again",
                      w.wid, w.process.pid, how, what, f" (at sample {sample})" if sample >= 0 else "", when)
        if sample >= 0:
            self.suspects.append((sample, how))
        self._remove_temp(w)
        try:
            w.conn.close()
        except OSError:
            pass
        del self.workers[w.wid]
        self.restarts += 1
        return tasks

    def _remove_temp(self, w: Worker) -> None:
        """The temp files a dead worker may have left for its tasks: gone at once, not at stop."""
        if not w.process.pid:
            return
        for t in w.tasks:
            try:
                os.unlink(os.path.join(self.setup.buffer_dir, tmp_name(t, w.wid, w.process.pid)))
            except OSError:
                pass

    def _replace(self) -> None:
        if len(self.workers) < self.count and time.monotonic() >= self._respawn_at:
            while len(self.workers) < self.count:
                self._spawn()

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
        self._stopping.append((w, time.monotonic()))

    def _reap_stopping(self, now: float) -> None:
        """Surplus workers that have exited are joined; one that ignores the stop message is
        terminated after _WORKER_JOIN_TIMEOUT_S and killed _WORKER_TERM_TIMEOUT_S later."""
        keep = []
        for w, since in self._stopping:
            if not w.process.is_alive():
                w.process.join(0)
                w.conn.close()
                continue
            waited = now - since
            if waited > _WORKER_JOIN_TIMEOUT_S + _WORKER_TERM_TIMEOUT_S:
                w.process.kill()
            elif waited > _WORKER_JOIN_TIMEOUT_S:
                w.process.terminate()
            keep.append((w, since))
        self._stopping = keep

    def temp_bytes(self) -> int:
        """What the batches in flight have written so far (already counted in the free space)."""
        n = 0
        for w in self.workers.values():
            for t in w.tasks:
                try:
                    n += os.stat(os.path.join(self.setup.buffer_dir, tmp_name(t, w.wid, w.process.pid))).st_size
                except OSError:
                    pass
        return n

    def pids(self) -> list[int]:
        return [w.process.pid for w in self.workers.values() if w.process.pid]

    def busy_s(self) -> float:
        return sum(w.busy_s for w in self.workers.values())

    def alive(self) -> int:
        return sum(1 for w in self.workers.values() if w.process.is_alive())
