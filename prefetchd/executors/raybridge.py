"""The Ray driver, in a process of its own: the bridge between the daemon and a Ray cluster.

Ray ends a driver whose raylet is gone ("The connection to the plasma store is failed.
Terminate the process."), and a head restart takes every node's raylet down with it. So the
daemon is never Ray's driver: ``raypool.RayPool`` starts this module as a child process
(``python -m prefetchd.executors.raybridge FD``) and talks to it over one socket pair, as it
talks to a local worker. Whatever Ray does to this process, the daemon goes on with local
workers and starts a new bridge later.

One bridge is one try: it reaches the cluster, checks that a worker can be placed at all (the
nodes' resources against ``num_cpus`` and ``resources``), starts ``workers.ray.workers``
actors and serves batches until told to stop or until the cluster is lost; then it exits. The
daemon decides when to try again.

The protocol (``Msg``, pickled tuples; the first element is the tag):

- daemon to bridge: ``(START, ray_config, setup, worker_id)`` once, then ``(TASK, seq, task)``
  and finally ``(STOP,)``.
- bridge to daemon: ``(INIT,)`` once the driver is connected; ``(UP, [(wid, where)], waiting,
  state)`` whenever the set of ready actors changes; ``(DONE, seq, Result)`` (the batch is a
  temp file in the buffer written by this process, named with its pid, published by the
  daemon); ``(LOST, seq, why)`` (made again by the daemon; ``why`` ``NO_WORKER_READY``: no actor
  was ready, and an UP follows, saying which are when that changes); ``(LOG, level, line)``;
  ``(DOWN, why, retry)`` before it gives up and exits.

Actors that can be placed start at once; those the cluster has no free room for wait, placed
by Ray when room frees (another daemon stops) and counted in the state meanwhile. Actors are
owned by this driver: when it exits, even killed, Ray removes them; on ``STOP`` it kills them
first (pending ones too), so nothing of the daemon's stays in the cluster's actor table.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from enum import IntEnum
from multiprocessing.connection import Connection

from prefetchd.core.config import RayConfig
from prefetchd.executors.builders import Packed
from prefetchd.executors.storage import StorageUnavailable
from prefetchd.executors.worker import Result, Task, WorkerSetup, write_temp
from prefetchd.format import procstate
from prefetchd.format.batchfile import BatchMeta, segment_fingerprint
from prefetchd.format.progress import VAL_LANE
from prefetchd.sources.archive import TarIndex, sizes_only

_WAIT_S = 0.1
_MAX_FAILURES = 3  # consecutive lost batches: an actor that keeps failing is dropped
_HEALTH_EVERY_S = 1.0  # the head's GCS port is probed this often...
_GCS_LOST_S = 2.0  # ...and a head that has not answered for this long is lost: the bridge exits
_WHERE_EVERY_S = 5.0  # ready actors say where they run this often: one restarted elsewhere is seen
_UNAVAILABLE = "unavailable"  # an actor's answer for a batch that met unreadable storage, with why
# LOST's reason for a task that came while no actor was ready (all restarting: a node or the head
# went): the daemon then sends nothing more until an UP names ready actors
NO_WORKER_READY = "no Ray worker is ready"


class Msg(IntEnum):
    START = 1
    TASK = 2
    STOP = 3
    INIT = 10
    UP = 11
    DONE = 12
    LOST = 13
    DOWN = 14
    LOG = 15


# --- pure helpers ---------------------------------------------------------------------------------


def worker_needs(cfg: RayConfig) -> dict[str, float]:
    """What one actor asks of a node: its CPUs and custom resources (zero amounts ask nothing)."""
    need = {"CPU": float(cfg.num_cpus)} if cfg.num_cpus > 0 else {}
    need.update({k: float(v) for k, v in cfg.resources.items() if v > 0})
    return need


def fits(need: dict[str, float], total: dict[str, float]) -> int:
    """How many actors asking ``need`` a node with ``total`` resources can host at once."""
    if not need:
        return 1 << 30
    return min(math.floor(total.get(k, 0.0) / v + 1e-9) for k, v in need.items())


def placement_problem(need: dict[str, float], nodes: list[dict[str, float]], address: str) -> str | None:
    """Why no node of the cluster (``nodes``: the alive nodes' total resources) can ever host a
    worker, in one line naming the key to change; None if one can."""
    if any(fits(need, n) > 0 for n in nodes):
        return None
    if not nodes:
        return f"the Ray cluster at {address} has no alive node"
    missing = []
    for k, v in need.items():
        best = max(n.get(k, 0.0) for n in nodes)
        key = "workers.ray.num_cpus" if k == "CPU" else f"workers.ray.resources.{k}"
        if best <= 0:
            missing.append(f"no node has resource {k!r} ({key}: {v:g})")
        elif best < v:
            missing.append(f"the largest node has {best:g} {k} ({key}: {v:g})")
    why = "; ".join(missing) or "no single node has all of them at once"
    return (f"no node of the Ray cluster at {address} can host a worker asking {_fmt(need)}: {why}; "
            f"change the config or add such a node")


def _fmt(need: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in need.items()) + "}"


def probe(address: str, timeout_s: float) -> str | None:
    """A quick TCP check of a host:port address, so a dead head fails in a second: why it does
    not answer, or None."""
    if address == "auto" or "://" in address or ":" not in address:
        return None
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=min(5.0, timeout_s)):
            return None
    except (OSError, ValueError) as e:
        return str(getattr(e, "strerror", None) or e)


def reason(e: BaseException) -> str:
    """The line of a Ray error that says what went wrong (its cause), else its first line."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    for line in reversed(lines):
        if "RuntimeError:" in line or "cannot read" in line:
            return line
    return lines[0] if lines else type(e).__name__


def remote_setup(setup: WorkerSetup, cfg: RayConfig) -> WorkerSetup:
    """The setup as a remote node sees it: the index held in memory, its root mapped by path_map
    (the validation stream's too)."""
    index = setup.index
    mapped = dataclasses.replace(index, root=cfg.map_path(index.root), files_dir=None,
                                 blob=index.blob.copy(), offsets=index.offsets.copy(), labels=index.labels.copy())
    if isinstance(mapped, TarIndex):  # the archives are under root: path_map maps them with it
        mapped = dataclasses.replace(mapped, **{k: None if getattr(mapped, k) is None else getattr(mapped, k).copy()
                                                for k in ("archive_ids", "block", "size")})
        # another node's copy has its own device, inodes and times: its size is known, and each sample is
        # checked in place when a process first opens it (tarrecheck.vouch_copy)
        mapped = dataclasses.replace(mapped, identity=sizes_only(mapped.identity))
    val = remote_setup(setup.val, cfg) if setup.val is not None else None
    return dataclasses.replace(setup, index=mapped, index_dir=None, val=val)


# --- the actor --------------------------------------------------------------------------------------


def _actor_class(ray):
    @ray.remote(max_restarts=-1, max_task_retries=0)
    class BatchActor:
        def __init__(self, setup: WorkerSetup, worker_id: int):
            from prefetchd.executors.worker import BatchMaker

            root = setup.index.root
            probe_path = setup.index.archive(0) if isinstance(setup.index, TarIndex) else setup.index.path(0)
            if not os.access(probe_path, os.R_OK):
                raise RuntimeError(f"this node ({os.uname().nodename}) cannot read the dataset: {probe_path} "
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
            for i, why in crashers:
                maker.bad.setdefault(i, why)
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


@dataclasses.dataclass
class _Actor:
    wid: int
    handle: object
    where_ref: object = None  # the pending ``where`` call: the actor is (re)starting
    check_ref: object = None  # a ``where`` call of a ready actor: where it runs now (a node died?)
    node: str = ""
    tasks: int = 0
    failures: int = 0


# --- the bridge -------------------------------------------------------------------------------------


class Bridge:
    def __init__(self, conn: Connection, cfg: RayConfig, setup: WorkerSetup, worker_id: int):
        self.conn = conn
        self.cfg = cfg
        self.setup = setup
        self.worker_id = worker_id
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self._send_lock = threading.Lock()
        self.actors: dict[int, _Actor] = {}
        self.refs: dict = {}  # fill ref -> (actor, seq, task)
        self.ray = None
        self._last_up = None

    def send(self, *msg) -> None:
        with self._send_lock:
            try:
                self.conn.send(msg)
            except OSError:  # the daemon is gone: nothing left to serve
                self.stop.set()

    def down(self, why: str, retry: bool = True) -> int:
        self.send(Msg.DOWN, why, retry)
        return 0

    def run(self) -> int:
        threading.Thread(target=self._read, name="prefetchd-bridge-read", daemon=True).start()
        cfg = self.cfg
        why = probe(cfg.address, cfg.connect_timeout_s)
        if why:
            return self.down(f"cannot reach the Ray cluster at {cfg.address} ({why})")
        try:
            import ray
        except ImportError:
            return self.down("ray is not installed (pip install 'prefetchd[ray]')", retry=False)
        try:
            extra = {"_node_ip_address": cfg.node_ip_address} if cfg.node_ip_address else {}
            ray.init(address=cfg.address, namespace="prefetchd", log_to_driver=False, include_dashboard=False,
                     logging_level=logging.WARNING, **extra)
        except Exception as e:  # unreachable, refused, version mismatch: the daemon goes on locally
            return self.down(f"cannot reach the Ray cluster at {cfg.address} ({type(e).__name__}: {e})")
        self.ray = ray
        self.send(Msg.INIT)
        try:
            need = worker_needs(cfg)
            nodes = [{k: float(v) for k, v in n.get("Resources", {}).items()} for n in ray.nodes() if n.get("Alive")]
            why = placement_problem(need, nodes, cfg.address)
            if why:
                return self.down(why)
            if self.stop.is_set():
                return 0
            actor_cls = _actor_class(ray)
            opts = {"num_cpus": cfg.num_cpus, "resources": dict(cfg.resources), "scheduling_strategy": "SPREAD"}
            # held for the bridge's life: a restarting actor gets its constructor arguments from it
            setup_ref = ray.put(remote_setup(self.setup, cfg))
            for i in range(cfg.workers):
                handle = actor_cls.options(**opts).remote(setup_ref, 1000 + i)
                self.actors[i] = _Actor(i, handle, handle.where.remote())
            self._up()
            return self._collect()
        except Exception as e:  # the cluster went away under us: the daemon starts a new bridge
            return self.down(f"the Ray cluster at {cfg.address} failed ({type(e).__name__}: {reason(e)})")
        finally:
            self._release()

    def _read(self) -> None:
        while not self.stop.is_set():
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):  # the daemon is gone
                self.stop.set()
                return
            if msg[0] == Msg.STOP:
                self.stop.set()
            elif msg[0] == Msg.TASK:
                self._submit(msg[1], msg[2])

    def _submit(self, seq: int, task: Task) -> None:
        with self.lock:
            ready = [a for a in self.actors.values() if a.where_ref is None]
            if ready:
                a = min(ready, key=lambda a: a.tasks)
                where = (task.rank, task.batch, task.batches_in_epoch, task.offset)
                ref = a.handle.fill.remote(task.epoch, task.indices, task.crashers, where, task.rank >= VAL_LANE)
                a.tasks += 1
                self.refs[ref] = (a, seq, task)
                return
            self._last_up = None  # the daemon forgets its workers at this answer: the next UP is said, whatever it is
            # sent under the lock: an UP that another thread says (an actor ready just now) comes after
            # it, never before it (the daemon would drop the workers that UP named, and no UP would follow)
            self.send(Msg.LOST, seq, NO_WORKER_READY)
        self._up()  # none ready now: the daemon stops sending until an UP says one is

    def _up(self) -> None:
        """Tell the daemon which actors are ready, when that changes."""
        with self.lock:
            ready = [(a.wid, a.node) for a in self.actors.values() if a.where_ref is None]
            restarting = sum(1 for a in self.actors.values() if a.where_ref is not None and a.node)
            waiting = len(self.actors) - len(ready) - restarting
        nodes = len({w.split(":")[0] for _, w in ready})
        state = f"connected to {self.cfg.address}: {len(ready)} workers on {nodes} node(s)"
        if restarting:
            state += f"; {restarting} restarting (a process or node died)"
        if waiting:
            state += (f"; {waiting} more starting (or waiting for a node with free {_fmt(worker_needs(self.cfg))}:"
                      " another job may hold it)")
        if (ready, state) != self._last_up:
            self._last_up = (ready, state)
            self.send(Msg.UP, ready, waiting + restarting, state)

    def _collect(self) -> int:
        ray = self.ray
        next_check, next_where, answered = 0.0, time.monotonic() + _WHERE_EVERY_S, time.monotonic()
        while not self.stop.is_set():
            now = time.monotonic()
            if now >= next_where:
                next_where = now + _WHERE_EVERY_S
                with self.lock:
                    for a in self.actors.values():
                        if a.where_ref is None and a.check_ref is None:
                            a.check_ref = a.handle.where.remote()
            if now >= next_check:  # Ray's driver would wait a minute for a head that restarted anew
                next_check = now + _HEALTH_EVERY_S
                why = probe(self.cfg.address, _HEALTH_EVERY_S)
                if why is None:
                    answered = now
                elif now - answered >= _GCS_LOST_S:
                    return self.down(f"lost the Ray cluster at {self.cfg.address}: its head does not answer ({why})")
            with self.lock:
                fills = dict(self.refs)
                starts = {a.where_ref: a for a in self.actors.values() if a.where_ref is not None}
                checks = {a.check_ref: a for a in self.actors.values() if a.check_ref is not None}
            refs = list(fills) + list(starts) + list(checks)
            if not refs:
                self.stop.wait(_WAIT_S)
                continue
            ready, rest = ray.wait(refs, num_returns=1, timeout=_WAIT_S, fetch_local=True)
            if ready and rest:
                more, _ = ray.wait(rest, num_returns=len(rest), timeout=0, fetch_local=True)
                ready += more
            for ref in ready:
                if ref in starts:
                    why = self._started(starts[ref], ref)
                elif ref in checks:
                    why = self._checked(checks[ref], ref)
                else:
                    why = self._finished(*fills[ref], ref)
                if why:
                    return self.down(why)
            if ready:
                self._up()
        return 0

    def _checked(self, a: _Actor, ref) -> None:
        try:
            node = self.ray.get(ref)
        except Exception:  # it died: it restarts (where, the next ``where`` says)
            node = None
        with self.lock:
            a.check_ref = None
            if node is None and a.where_ref is None and self.actors.get(a.wid) is a:
                a.where_ref = a.handle.where.remote()
            elif node is not None:
                a.node = node

    def _started(self, a: _Actor, ref) -> str | None:
        try:
            a.node = self.ray.get(ref)
        except Exception as e:
            if a.node and a.failures + 1 < _MAX_FAILURES:  # it was up: it restarts; ask again
                a.failures += 1
                with self.lock:
                    a.where_ref = a.handle.where.remote()
                return None
            # its constructor failed (an unreadable dataset), or it keeps dying: it is dropped
            with self.lock:
                del self.actors[a.wid]
                left = len(self.actors)
            self._kill(a)
            why = f"Ray workers could not start ({type(e).__name__}: {reason(e)})"
            if not left:
                return why
            self.send(Msg.LOG, logging.ERROR, f"{why}; going on with {left} of {self.cfg.workers}")
            return None
        with self.lock:
            a.where_ref = None
        return None

    def _finished(self, a: _Actor, seq: int, task: Task, ref) -> str | None:
        with self.lock:
            self.refs.pop(ref, None)
            a.tasks -= 1
        try:
            value = self.ray.get(ref)
        except Exception as e:  # the actor or its node died: made again elsewhere
            self.send(Msg.LOST, seq, f"{type(e).__name__}: {_first_line(e)}")
            a.failures += 1
            with self.lock:
                if a.failures >= _MAX_FAILURES and self.actors.get(a.wid) is a:
                    del self.actors[a.wid]
                    self._kill(a)
                    if not self.actors:
                        return "every Ray worker failed"
                elif self.actors.get(a.wid) is a and a.where_ref is None:
                    a.where_ref = a.handle.where.remote()  # where it restarts (a node died: another one)
            return None
        a.failures = 0
        if value[0] == _UNAVAILABLE:  # what worker_main answers for a StorageUnavailable
            res = Result(task.rank, task.epoch, task.batch, None, error=value[1], unavailable=True)
        else:
            data, used, labels, replaced, quarantined, seconds = value
            setup = self.setup.val if task.rank >= VAL_LANE else self.setup
            res = write_temp(setup.buffer_dir, task, setup.fingerprint, self.worker_id, Packed(data), used, labels,
                             replaced, list(quarantined), seconds)
        self.send(Msg.DONE, seq, res)
        return None

    def _kill(self, a: _Actor) -> None:
        try:
            self.ray.kill(a.handle, no_restart=True)
        except Exception:  # already gone
            pass

    def _release(self) -> None:
        """Kill every actor of this driver (placed or still pending), then leave the cluster."""
        if self.ray is None:
            return
        for a in list(self.actors.values()):
            self._kill(a)
        self.actors.clear()
        try:
            self.ray.shutdown()
        except Exception:  # pragma: no cover - best effort: the process exits next
            pass


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else ""


def main(argv: list[str]) -> int:
    fd, parent = int(argv[0]), int(argv[1])
    if not procstate.die_with_parent(parent, signal.SIGKILL):  # the daemon gone, however: the actors go with us
        os._exit(0)  # it has gone already
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the daemon's: it stops us
    conn = Connection(fd)
    try:
        msg = conn.recv()
    except (EOFError, OSError):
        return 0
    if msg[0] != Msg.START:
        return 2
    return Bridge(conn, *msg[1:]).run()


if __name__ == "__main__":
    # under its own name, so that the messages' tags pickle as the daemon knows them
    from prefetchd.executors import raybridge

    code = raybridge.main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(code)  # no interpreter teardown: Ray's threads can hang it
