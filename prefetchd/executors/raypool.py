"""Making batches on a Ray cluster (``workers.executor: ray | mixed``).

Each remote worker is a Ray actor holding a ``BatchMaker`` (the same code as a local worker,
so a batch's bytes do not depend on where it was made). The dataset index travels once through
Ray's object store, with its root mapped by ``workers.ray.path_map`` to where the cluster's
nodes see the data. An actor makes the pixels of a batch and returns them through the object
store; this daemon alone writes the temp file and publishes it, so publishing stays atomic and
local.

Actors restart when their process or node dies (``max_restarts=-1``); the batches they held
come back to the daemon as lost and are made again, like a dead local worker's. A batch that
met unreadable storage is not lost: the actor answers "unavailable" and the daemon waits for
the storage as it does for a local worker (``executors.storage``). Connecting runs
on a thread: the daemon starts at once and keeps making batches locally while the cluster is
being reached, or when it cannot be, and says so in its status (``ray``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from prefetchd.core.config import RayConfig
from prefetchd.core.tarindex import TarIndex, sizes_only
from prefetchd.executors.builders import Packed
from prefetchd.executors.storage import StorageUnavailable
from prefetchd.executors.worker import Quarantined, Result, Task, WorkerSetup, write_temp
from prefetchd.format.batchfile import BatchMeta, segment_fingerprint
from prefetchd.format.progress import VAL_LANE

log = logging.getLogger("prefetchd.ray")

_WAIT_S = 0.1
_MAX_FAILURES = 3
_UNAVAILABLE = "unavailable"  # an actor's answer for a batch that met unreadable storage, with why


@dataclass
class RemoteWorker:
    wid: int
    actor: object
    node: str = "?"
    tasks: deque = field(default_factory=deque)  # (task, t0, ref)
    ready: bool = True
    busy_s: float = 0.0
    failures: int = 0  # consecutive lost batches: an actor that keeps failing is dropped


def _actor_class(ray):
    @ray.remote(max_restarts=-1, max_task_retries=0)
    class BatchActor:
        def __init__(self, setup: WorkerSetup, worker_id: int):
            from prefetchd.executors.worker import BatchMaker

            root = setup.index.root
            probe = setup.index.archive(0) if isinstance(setup.index, TarIndex) else setup.index.path(0)
            if not os.access(probe, os.R_OK):
                raise RuntimeError(f"this node ({os.uname().nodename}) cannot read the dataset: {probe} "
                                   f"(root {root}); mount it there or set workers.ray.path_map")
            self.maker = BatchMaker(setup, worker_id)
            self.val_maker = BatchMaker(setup.val, worker_id) if setup.val is not None else None

        def where(self) -> str:
            return ray.get_runtime_context().get_node_id()[:12] + ":" + str(os.getpid())

        def fill(self, epoch, indices, crashers, where, val=False):
            """The whole batch file as bytes (``where``: its rank, batch number, batches in the
            epoch and, for a resumed epoch's segment, its offset). ``val``: a validation lane's
            batch, made by the actor's second maker."""
            maker = self.val_maker if val else self.maker
            for i, reason in crashers:
                maker.bad.setdefault(i, reason)
            t0 = time.perf_counter()
            rank, batch, batches, *offset = where
            fingerprint = segment_fingerprint(maker.fingerprint, epoch, offset[0] if offset else 0)
            builder = maker.builder_for(epoch, batch)
            try:
                _, used, labels, replaced, quarantined = maker.fill(epoch, indices, builder)
            except StorageUnavailable as e:  # the storage's, not the actor's: the daemon waits, as for a local worker
                return _UNAVAILABLE, str(e)
            data = builder.pack(BatchMeta(rank, epoch, batch, batches, fingerprint), used, labels, replaced)
            return data, used, labels, replaced, quarantined, time.perf_counter() - t0

    return BatchActor


class RayPool:
    """Remote workers behind the executor interface of ``pool.Pool`` (``idle``, ``submit``,
    ``results``, ``waitables``, ``stop``); results arrive on a thread that wakes the loop."""

    def __init__(self, cfg: RayConfig, setup: WorkerSetup, max_in_flight: int, wake: Callable[[], None],
                 worker_id: int = 9999):
        self.cfg = cfg
        self.setup = setup
        self.max_in_flight = max_in_flight
        self.wake = wake
        self.state = "connecting"
        self.workers: dict[int, RemoteWorker] = {}
        self.restarts = 0
        self._lock = threading.Lock()
        self._done: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._connecting = threading.Lock()
        self._collecting = False
        self._threads: list[threading.Thread] = []
        self._ray = None
        self.worker_id = worker_id  # names the temp files this daemon writes for remote batches

    # --- connecting -----------------------------------------------------------------------------

    def start(self) -> None:
        t = threading.Thread(target=self._connect, name="prefetchd-ray-connect", daemon=True)
        t.start()
        self._threads.append(t)
        timer = threading.Timer(self.cfg.connect_timeout_s, self._give_up)
        timer.daemon = True
        timer.start()
        self._threads.append(timer)

    def _give_up(self) -> None:
        if self.state == "connecting":  # ray.init cannot be cancelled; if it ever returns, we go on
            self._fail(f"no answer from the Ray cluster at {self.cfg.address} within "
                       f"{self.cfg.connect_timeout_s:.0f} s (workers.ray.connect_timeout_s)", retry=False)

    def _probe(self) -> str | None:
        """A quick TCP check of a host:port address, so a dead head fails in a second."""
        addr = self.cfg.address
        if addr == "auto" or "://" in addr or ":" not in addr:
            return None
        host, _, port = addr.rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=min(5.0, self.cfg.connect_timeout_s)):
                return None
        except (OSError, ValueError) as e:
            return f"cannot reach the Ray cluster at {addr} ({getattr(e, 'strerror', None) or e})"

    def _connect(self) -> None:
        if self._stop.is_set() or not self._connecting.acquire(blocking=False):
            return  # stopping, or a connection attempt is already under way
        try:
            self._connect_once()
        finally:
            self._connecting.release()

    def _connect_once(self) -> None:
        try:
            import ray
        except ImportError:
            self._fail("ray is not installed (pip install 'prefetchd[ray]')", retry=False)
            return
        why = self._probe()
        if why:
            self._fail(why)
            return
        try:
            extra = {"_node_ip_address": self.cfg.node_ip_address} if self.cfg.node_ip_address else {}
            ray.init(address=self.cfg.address, namespace="prefetchd", log_to_driver=False,
                     ignore_reinit_error=True, include_dashboard=False, logging_level=logging.WARNING, **extra)
        except Exception as e:  # unreachable, refused, version mismatch: the daemon goes on locally
            try:
                ray.shutdown()  # whatever half of ray.init happened, so the next try starts clean
            except Exception:  # pragma: no cover - best effort
                pass
            self._fail(f"cannot reach the Ray cluster at {self.cfg.address} ({type(e).__name__}: {e})")
            return
        self._ray = ray
        try:
            remote_setup = self._remote_setup(self.setup)
            actor_cls = _actor_class(ray)
            opts = {"num_cpus": self.cfg.num_cpus, "resources": dict(self.cfg.resources), "scheduling_strategy": "SPREAD"}
            # held for the pool's life: a restarting actor gets its constructor arguments from it
            self._setup_ref = ray.put(remote_setup)
            actors = [actor_cls.options(**opts).remote(self._setup_ref, 1000 + i) for i in range(self.cfg.workers)]
            where = ray.get([a.where.remote() for a in actors], timeout=max(60.0, self.cfg.connect_timeout_s))
        except Exception as e:
            self._fail(f"Ray workers could not start ({type(e).__name__}: {_reason(e)})")
            return
        with self._lock:
            for i, (a, w) in enumerate(zip(actors, where, strict=True)):
                self.workers[i] = RemoteWorker(i, a, node=w)
            self.state = f"connected to {self.cfg.address}: {len(actors)} workers on {len({w.split(':')[0] for w in where})} node(s)"
        log.info("ray: %s", self.state)
        if not self._collecting:
            self._collecting = True
            t = threading.Thread(target=self._collect, name="prefetchd-ray-collect", daemon=True)
            t.start()
            self._threads.append(t)
        self.wake()

    def _fail(self, why: str, retry: bool = True) -> None:
        again = retry and self.cfg.retry_s > 0 and not self._stop.is_set()
        self.state = (f"unavailable: {why}; making batches with local workers"
                      + (f"; trying again every {self.cfg.retry_s:.0f} s" if again else ""))
        log.warning("ray: %s", self.state)
        if again:
            timer = threading.Timer(self.cfg.retry_s, self._connect)
            timer.daemon = True
            timer.start()
        self.wake()

    @property
    def connected(self) -> bool:
        return self.state.startswith("connected")

    # --- work ------------------------------------------------------------------------------------

    def idle(self) -> int:
        """Free task slots."""
        with self._lock:
            return sum(max(0, self.max_in_flight - len(w.tasks)) for w in self.workers.values())

    def submit(self, task: Task) -> bool:
        with self._lock:
            ws = [w for w in self.workers.values() if len(w.tasks) < self.max_in_flight]
            if not ws:
                return False
            w = min(ws, key=lambda w: len(w.tasks))
            where = (task.rank, task.batch, task.batches_in_epoch, task.offset)
            ref = w.actor.fill.remote(task.epoch, task.indices, task.crashers, where, task.rank >= VAL_LANE)
            w.tasks.append((task, time.monotonic(), ref))
        return True

    def waitables(self) -> list:
        return []  # the collecting thread wakes the loop

    def results(self) -> tuple[list[Result], list[Task]]:
        return self.drain(self.setup.buffer_dir, self.worker_id)

    def _collect(self) -> None:
        ray = self._ray
        while not self._stop.is_set():
            with self._lock:
                refs = {ref: (w, task, t0) for w in self.workers.values() for task, t0, ref in w.tasks}
            if not refs:
                self._stop.wait(_WAIT_S)
                continue
            ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=_WAIT_S, fetch_local=True)
            for ref in ready:
                w, task, t0 = refs[ref]
                try:
                    value = ray.get(ref)
                    self._done.put(("ok", task, value))
                    w.failures = 0
                except Exception as e:  # the actor or its node died: made again elsewhere
                    self._done.put(("lost", task, e))
                    w.failures += 1
                with self._lock:
                    w.tasks = deque(x for x in w.tasks if x[2] is not ref)
                    w.busy_s += time.monotonic() - t0
                    if w.failures >= _MAX_FAILURES and self.workers.get(w.wid) is w:
                        del self.workers[w.wid]
                        log.error("ray: worker %d (%s) lost %d batches in a row; dropping it (%d remote workers left)",
                                  w.wid, w.node, w.failures, len(self.workers))
                        if not self.workers:
                            threading.Thread(target=self._fail, args=("every Ray worker failed",), daemon=True).start()
            if ready:
                self.wake()

    def drain(self, buffer_dir: str, worker_id: int) -> tuple[list[Result], list[Task]]:
        """Finished remote batches, written here as temp files; and the lost ones."""
        results: list[Result] = []
        lost: list[Task] = []
        while True:
            try:
                kind, task, value = self._done.get_nowait()
            except queue.Empty:
                return results, lost
            if kind == "lost":
                self.restarts += 1
                log.error("ray: batch r%d e%d b%d was lost (%s: %s); making it again", task.rank, task.epoch,
                          task.batch, type(value).__name__, _first_line(value))
                lost.append(task)
                continue
            if value[0] == _UNAVAILABLE:  # what worker_main answers for a StorageUnavailable
                results.append(Result(task.rank, task.epoch, task.batch, None, error=value[1], unavailable=True))
                continue
            data, used, labels, replaced, quarantined, seconds = value
            setup = self.setup.val if task.rank >= VAL_LANE else self.setup
            results.append(write_temp(buffer_dir, task, setup.fingerprint, worker_id, Packed(data), used, labels,
                                      replaced, list(quarantined), seconds))

    def _remote_setup(self, setup: WorkerSetup) -> WorkerSetup:
        """The setup as a remote node sees it: the index held in memory, its root mapped by path_map
        (the validation stream's too)."""
        index = setup.index
        mapped = dataclasses.replace(index, root=self.cfg.map_path(index.root), files_dir=None,
                                     blob=index.blob.copy(), offsets=index.offsets.copy(), labels=index.labels.copy())
        if isinstance(mapped, TarIndex):  # the archives are under root: path_map maps them with it
            mapped = dataclasses.replace(mapped, **{k: None if getattr(mapped, k) is None else getattr(mapped, k).copy()
                                                    for k in ("archive_ids", "block", "size")})
            # another node's copy has its own inodes: only the sizes are checked there
            mapped = dataclasses.replace(mapped, identity=sizes_only(mapped.identity))
        val = self._remote_setup(setup.val) if setup.val is not None else None
        return dataclasses.replace(setup, index=mapped, index_dir=None, val=val)

    def status(self) -> dict:
        with self._lock:
            return {"state": self.state, "workers": len(self.workers), "lost_batches": self.restarts,
                    "where": [w.node for w in self.workers.values()],
                    "in_flight": sum(len(w.tasks) for w in self.workers.values()),
                    "busy_s": sum(w.busy_s for w in self.workers.values())}

    def stop(self) -> None:
        self._stop.set()
        if self._ray is not None:
            with self._lock:
                actors = [w.actor for w in self.workers.values()]
                self.workers.clear()
            for a in actors:
                try:
                    self._ray.kill(a)
                except Exception:  # already gone
                    pass
            try:
                self._ray.shutdown()
            except Exception:  # pragma: no cover - teardown must not fail the stop
                pass


def _reason(e: BaseException) -> str:
    """The line of a Ray error that says what went wrong (its cause), else its first line."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    for line in reversed(lines):
        if "RuntimeError:" in line or "cannot read" in line:
            return line
    return lines[0] if lines else type(e).__name__


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else ""


__all__ = ["RayPool", "Quarantined"]
