"""The daemon's status record: what ``status.json``, ``prefetchd status`` and the metrics show
(format in ``prefetchd.format.status``), read from the loop's counters through the Daemon's public
attributes and accessors (``stopping``, ``produced_rate``, ``consumed_rate``, ...)."""

from __future__ import annotations

import os
import time
from collections import deque
from operator import itemgetter

import psutil

from prefetchd.daemon.stalls import Seen
from prefetchd.format import procstate
from prefetchd.format.progress import lane

_RATE_WINDOW_S = 10.0
_PID_NS = procstate.pid_namespace()  # what "pid" means: a trainer in another namespace cannot look it up


def status_record(d) -> dict:
    """The daemon ``d``'s status record (``status.json``, the metrics), from counters kept up to
    date, O(ranks): no window is walked."""
    now = time.time()
    ranks = {}
    for r in d.ranks:
        rs = d.planner.rank_status(r)
        seen = _seen(d, r)
        rs.update(echoed=d.sessions.echoed[r],
                  gpu_fallbacks=d.sessions.gpu_fallbacks[r], consumed=d.sessions.consumed[r], pid=seen.pid,
                  ready_ratio=rs["ready"] / max(1, d.cfg.buffer.capacity),
                  last_progress_age_s=d.stalls.age(r, now, seen.time), last_progress=seen.time,
                  **d.stalls.trainer(r, now, seen, rs["done"]))  # trainer, stalled, waiting, wait_s
        ranks[str(r)] = rs
    up = max(now - d.t_start, 1e-9)
    rss = 0
    for r in d.ranks:  # a rank in a resumed epoch as its trainer numbers it: the batch of its segment
        ranks[str(r)].update(d.segments.user_position(r, ranks[str(r)].get("position")))
    respawn = d.pool.respawn_due()  # a worker is missing, replaced after this back-off
    for pid in [os.getpid(), *d.pool.pids()]:
        try:
            rss += _process(pid).memory_info().rss
        except psutil.Error:
            _processes.pop(pid, None)
    return {
        "format": "prefetchd-status", "version": 1, "pid": os.getpid(), "pid_ns": _PID_NS,
        "state": "stopping" if d.stopping else "running", "updated": now, "started": d.t_start,
        "uptime_s": up, "buffer_dir": d.cfg.buffer.dir, "fingerprint": d.fingerprint_hex,
        "capacity": d.cfg.buffer.capacity, "refill_at": d.cfg.buffer.refill_at,
        "workers": d.pool.count, "workers_alive": d.pool.alive(), "worker_restarts": d.pool.restarts,
        "worker_timeouts": d.pool.timeouts, "worker_pids": d.pool.pids(),
        "forkserver_restarts": d.pool.helpers.restarts["forkserver"],
        "resource_tracker_restarts": d.pool.helpers.restarts["resource tracker"],
        "helper_pids": {k.replace(" ", "_"): v for k, v in d.pool.helpers.pids().items()},
        "worker_respawn_in_s": None if respawn is None else max(0.0, respawn - d.clock()),
        "worker_utilisation": min(1.0, d.pool.busy_s() / (up * max(1, d.pool.count))),
        "produced_batches": d.produced_batches, "produced_images": d.produced_images,
        "consumed_batches": sum(d.sessions.consumed.values()),
        "failed_batches": d.failed_batches,
        "stuck_s": stuck_s(d),  # batches in the making, none made for this long (status --live)
        "produced_img_s": d.produced_rate.per_s(),
        "consumed_img_s": d.consumed_rate.per_s(),
        "first_batch_s": None if d.first_batch_at is None else d.first_batch_at - d.t_start,
        "bytes_used": d.ring.bytes_used, "max_bytes": d.cfg.buffer.max_bytes,
        "fs_free": d.ring.free_bytes(), "quarantined": len(d.quarantine),
        "blocked": d.segments.conflict or d.waiting.blocked.get("train"), "val_blocked": d.waiting.blocked.get("validation"),
        "train_bytes": d.planner.held, "val_bytes": d.val.planner.held if d.val else None,
        "progress_watch": d.watcher.mode, "rss_bytes": rss, "ranks": ranks,
        "executor": d.cfg.workers.executor, "ray": d.remote.status() if d.remote is not None else None,
        "main_cpu_s": _own_cpu_s(), "val_ranks": d.val.status(now) if d.val else None,
        "resume": d.segments.status(),
        "dataset_unreadable": d.outages.describe(),
        "storage": d.outages.storage(),  # a bucket's requests, bytes, errors, cache hits (sources/objectstore.py)
        "sizing": list(d.sizing.why.values()),  # each auto value and why (core.sizing)
    }


def stuck_s(d) -> float:
    """Seconds batches have been in the making without one made (0 while nothing is needed):
    what the watchdog and ``status --live`` judge the pipeline by. Failures are not progress."""
    if not any(p.busy() for p in (d.planner, *([d.val.planner] if d.val else []))):
        return 0.0
    return max(0.0, d.clock() - d.last_activity)


def _seen(d, r: int) -> Seen:
    """What rank ``r``'s trainer last said, in the newest record of its train or validation lane
    (a trainer in a validation pass moves, may wait for a validation batch, and closes that
    client last), with the train lane's wait counter."""
    s, lane_id = d.sessions, r
    seen = s.last_seen.get(r)
    if d.val:
        vseen = d.val.sessions.last_seen.get(lane("val", r))
        if vseen is not None and (seen is None or vseen > seen):
            s, lane_id, seen = d.val.sessions, lane("val", r), vseen
    return Seen(seen, s.pid.get(lane_id), s.pid_identity.get(lane_id, (0, 0)), lane_id in s.live,
                lane_id in s.closed, s.waiting_since.get(lane_id, 0.0), d.sessions.wait_s[r],
                d.sessions.session.get(r, "").rpartition(".")[0], wait_is_own=lane_id == r)


_processes: dict[int, psutil.Process] = {}  # by pid: a Process is made once (it reads /proc to know its process)


def _process(pid: int) -> psutil.Process:
    p = _processes.get(pid)
    if p is None:
        if len(_processes) > 256:  # workers replaced many times: forget the old ones
            _processes.clear()
        p = _processes[pid] = psutil.Process(pid)
    return p


class RateWindow:
    """Images made (or consumed) in the last ``_RATE_WINDOW_S``: the loop adds, the status reads.
    Timed on the monotonic clock (``clock``), so a step of the wall clock (NTP, ``date -s``)
    neither empties the window nor keeps a backlog of "future" entries in it for as long as the
    step (a step back of an hour: an hour of batches summed at every status record)."""

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._start = clock()
        self._dq: deque = deque()  # (time, images)

    def add(self, images: int) -> None:
        self._dq.append((self._clock(), images))

    def per_s(self) -> float | None:
        """Images per second over the window (shorter while the daemon is younger than it)."""
        now = self._clock()
        dq = self._dq
        while dq and dq[0][0] < now - _RATE_WINDOW_S:
            dq.popleft()
        if not dq:
            return 0.0
        span = min(_RATE_WINDOW_S, now - self._start)
        return sum(map(itemgetter(1), dq)) / span if span > 0 else None  # (a deque of 10 s of batches: summed in C)


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system
