"""The worker pool: processes started by forkserver, one pipe each, watched by their sentinels.

Each worker has its own duplex pipe, so the daemon always knows which tasks a worker holds: when
a worker dies (its sentinel becomes ready), those tasks go back to the daemon to be made again
and the worker is replaced. Teardown escalates: a stop message, join, terminate, kill.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

from .worker import Result, Task, WorkerSetup, worker_main

log = logging.getLogger("prefetchd.pool")

_WORKER_JOIN_TIMEOUT_S = 3.0
_WORKER_TERM_TIMEOUT_S = 2.0


@dataclass
class Worker:
    wid: int
    process: mp.process.BaseProcess
    conn: Connection
    tasks: deque = field(default_factory=deque)
    current: object = None  # shared int64 [1]: the sample the worker is decoding, -1 between batches
    ready: bool = False
    started: float = field(default_factory=time.monotonic)
    busy_s: float = 0.0


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
    def __init__(self, setup: WorkerSetup, count: int, max_in_flight: int = 2):
        self.setup = setup
        self.count = count
        self.max_in_flight = max_in_flight
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(["prefetchd.worker"])
        self.workers: dict[int, Worker] = {}
        self.suspects: list[tuple[int, str]] = []  # (sample index, how its worker died)
        self._next_id = 0
        self.restarts = 0

    def start(self) -> None:
        for _ in range(self.count):
            self._spawn()

    def _spawn(self) -> Worker:
        wid = self._next_id
        self._next_id += 1
        parent, child = self.ctx.Pipe(duplex=True)
        current = self.ctx.RawArray("q", 1)
        current[0] = -1
        p = self.ctx.Process(target=worker_main, args=(child, wid, self.setup, current),
                             name=f"prefetchd-worker-{wid}", daemon=True)
        p.start()
        child.close()
        w = Worker(wid, p, parent, current=current)
        self.workers[wid] = w
        return w

    def resize(self, count: int) -> None:
        """Grow at once; shrink as workers fall idle (``shrink_idle``)."""
        self.count = count
        while len(self.workers) < count:
            self._spawn()

    def idle(self) -> list[Worker]:
        """Ready workers with room for another task, least loaded first."""
        ws = [w for w in self.workers.values() if w.ready and len(w.tasks) < self.max_in_flight]
        return sorted(ws, key=lambda w: len(w.tasks))

    def submit(self, w: Worker, task: Task) -> bool:
        try:
            w.conn.send(task)
        except (OSError, BrokenPipeError):
            return False
        w.tasks.append((task, time.monotonic()))
        return True

    def wait(self, timeout: float, extra: list) -> tuple[list[Result], list[Task], list]:
        """Wait for results, deaths or one of ``extra`` (file descriptors). Returns
        (results, tasks lost with dead workers, ready extras). The dataset index each dead
        worker was decoding is in ``self.suspects`` (a list the caller empties)."""
        objs: list = list(extra)
        by_obj: dict = {}
        for w in self.workers.values():
            by_obj[w.conn] = w
            by_obj[w.process.sentinel] = w
            objs += [w.conn, w.process.sentinel]
        ready = wait(objs, timeout)
        results: list[Result] = []
        lost: list[Task] = []
        extras = [o for o in ready if o in extra]
        dead: set[int] = set()
        for o in ready:
            w = by_obj.get(o)
            if w is None or w.wid in dead:
                continue
            if o is w.conn:
                try:
                    while w.conn.poll():
                        msg = w.conn.recv()
                        if isinstance(msg, tuple) and msg and msg[0] == "ready":
                            w.ready = True
                            continue
                        task, t0 = w.tasks.popleft()
                        w.busy_s += time.monotonic() - t0
                        results.append(msg)
                except (EOFError, OSError):
                    pass  # the sentinel tells the rest
            if not w.process.is_alive():
                dead.add(w.wid)
        # a worker may have died without its sentinel being in this wait's ready list yet
        for w in list(self.workers.values()):
            if w.wid in dead or not w.process.is_alive():
                lost += self._bury(w)
        return results, lost, extras

    def _bury(self, w: Worker) -> list[Task]:
        w.process.join(0.1)
        tasks = [t for t, _ in w.tasks]
        what = ", ".join(f"r{t.rank} e{t.epoch} b{t.batch}" for t in tasks) or "no batch"
        how = _describe_exit(w.process.exitcode)
        sample = int(w.current[0]) if w.current is not None and tasks else -1
        log.error("worker %d (pid %s) %s while making %s%s; replacing it and making its batches again",
                  w.wid, w.process.pid, how, what, f" (at sample {sample})" if sample >= 0 else "")
        if sample >= 0:
            self.suspects.append((sample, how))
        try:
            w.conn.close()
        except OSError:
            pass
        del self.workers[w.wid]
        self.restarts += 1
        if len(self.workers) < self.count:
            self._spawn()
        return tasks

    def shrink_idle(self) -> None:
        """Stop surplus workers (after a reload lowered the count) once they hold no task."""
        for w in list(self.workers.values()):
            if len(self.workers) <= self.count:
                return
            if not w.tasks and w.ready:
                self._stop_one(w)
                del self.workers[w.wid]

    def _stop_one(self, w: Worker) -> None:
        try:
            w.conn.send(None)
        except (OSError, BrokenPipeError):
            pass
        w.process.join(_WORKER_JOIN_TIMEOUT_S)
        if w.process.is_alive():
            w.process.terminate()
            w.process.join(_WORKER_TERM_TIMEOUT_S)
        if w.process.is_alive():
            w.process.kill()
            w.process.join(1.0)
        w.conn.close()

    def stop(self) -> None:
        """Stop every worker now. Their work can be made again, so nothing is waited for: a
        worker mid-batch leaves a temp file the daemon removes."""
        ws = list(self.workers.values())
        for w in ws:
            if w.process.is_alive():
                w.process.terminate()
        deadline = time.monotonic() + _WORKER_TERM_TIMEOUT_S
        for w in ws:
            w.process.join(max(0.0, deadline - time.monotonic()))
            if w.process.is_alive():
                w.process.kill()
                w.process.join(1.0)
            w.conn.close()
        self.workers.clear()

    def pids(self) -> list[int]:
        return [w.process.pid for w in self.workers.values() if w.process.pid]
