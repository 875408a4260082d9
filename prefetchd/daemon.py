"""The daemon's main loop: keep every rank's ring filled between the watermarks.

For each rank served, the *window* is the next ``buffer.capacity`` batches from the trainer's
position, running across epoch boundaries (up to ``loader.epochs``). The loop:

1. reads the progress files that changed (woken by inotify, or at least every poll interval)
   and evicts the published batches that are behind a rank's position or outside its window
   (a jump back, from a resume, drops the batches that were far ahead);
2. takes results from the workers and publishes each batch that is still wanted, by rename;
   a dead worker's batches are simply missing again and get made again;
3. gives idle workers the earliest missing batch of the rank with the fewest ready, for ranks
   that are filling: a rank starts filling when its ready count falls below ``refill_at`` and
   stops when ``capacity`` batches are ready or being made. Every rank has a ``capacity`` of its
   own; ``max_bytes`` and the filesystem's free space are shared, and because the emptiest rank
   is served first, a slow (full) rank never starves the others;
4. rewrites ``status.json`` about once a second.

Signal handlers only record the signal and wake the loop, which does the work: SIGTERM/SIGINT
stop it cleanly (workers stopped, temp files removed, published batches kept for the next
start), SIGHUP reloads the tunables.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import time
from collections import deque
from dataclasses import replace

import psutil

from . import batchfile, status
from .config import Config, ConfigError, format_size
from .config import load as load_config
from .dataset import load_index
from .pool import Pool, Worker
from .ring import Lock, Ring, is_tmpfs, prepare_dirs
from .sampler import Sampler
from .watcher import ProgressWatcher
from .worker import Result, Task, WorkerSetup

log = logging.getLogger("prefetchd")

_STATUS_INTERVAL_S = 1.0
_RATE_WINDOW_S = 10.0
_ERROR_BACKOFF_S = 1.0
_CRASH_LOOP_DEATHS = 8  # this many worker deaths before the first batch means a broken setup


class Daemon:
    def __init__(self, cfg: Config, notify=None, early_signals: list[int] | None = None):
        self.cfg = cfg
        self._early_signals = early_signals if early_signals is not None else []
        self.notify = notify
        self.t_start = time.time()
        self._stop = False
        self._reload = False
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.blocked: str | None = None
        self._error_until = 0.0
        self.produced_batches = 0
        self.produced_images = 0
        self._produced: deque = deque()  # (time, images)
        self._consumed: deque = deque()  # (time, images)
        self.quarantined: dict[int, dict] = {}
        self._crashes: dict[int, int] = {}  # sample index -> deaths of workers decoding it
        self._crashers: tuple[tuple[int, str], ...] = ()  # quarantined for killing workers
        self.first_batch_at: float | None = None
        self._ready_notified = False
        self._last_activity = time.monotonic()  # last result, or the start of work after idling
        self._status_error: str | None = None
        self._blocked_logged: str | None = None

    # --- set-up -----------------------------------------------------------------------------------

    def _setup(self) -> None:
        cfg = self.cfg
        prepare_dirs(cfg.buffer.dir, cfg.progress_dir, cfg.buffer.group)  # modes and groups: ring.py
        self.lock = Lock(cfg.buffer.dir)
        self.lock.acquire()
        try:  # the last daemon's description no longer holds; ours follows once the index is read
            os.unlink(os.path.join(cfg.buffer.dir, status.META_NAME))
        except FileNotFoundError:
            pass
        if not is_tmpfs(cfg.buffer.dir):
            log.warning("buffer.dir %s is not on tmpfs: batches go through the page cache to disk; "
                        "mount a tmpfs there (see systemd/run-prefetchd.mount)", cfg.buffer.dir)
        t0 = time.monotonic()
        self.index, cached = load_index(cfg.dataset.root, cfg.dataset.file_list, cfg.dataset.extensions,
                                        cfg.dataset.cache_dir)
        log.info("dataset: %d samples in %d classes (%s, %.2f s)", len(self.index), len(self.index.classes),
                 "cached index" if cached else "scanned", time.monotonic() - t0)
        L = cfg.loader
        self.sampler = Sampler(len(self.index), L.batch_size, L.seed, L.shuffle, L.drop_last, L.world_size)
        if self.sampler.batches_per_epoch == 0:
            raise ConfigError("loader.batch_size", f"({L.batch_size}) is larger than a rank's share of the dataset "
                              f"({self.sampler.samples_per_rank} samples) with drop_last: no batch to make")
        self.fingerprint_hex = stream_fingerprint(cfg, self.index.fingerprint)
        self.fingerprint = batchfile.fingerprint_u64(self.fingerprint_hex)
        self.ring = Ring(cfg.buffer.dir)
        counts = self.ring.recover(self.fingerprint)
        if any(counts.values()):
            log.info("buffer recovered: kept %(kept)d batches; removed %(temp)d temp, %(bad)d torn or corrupt, "
                     "%(foreign)d from another stream", counts)
        self._load_quarantine()
        self.ranks = L.ranks
        self.pos = {r: (0, 0) for r in self.ranks}
        self.filling = {r: True for r in self.ranks}
        self.inflight: dict[tuple[int, int, int], int] = {}
        self.wait_s = {r: 0.0 for r in self.ranks}
        self.echoed = {r: 0 for r in self.ranks}
        self.last_progress: dict[int, float] = {}
        self._session: dict[int, str] = {}
        self._backwards_warned: dict[int, str] = {}
        self._write_meta()
        self.metrics = None
        if cfg.metrics.enabled:
            from .metrics import MetricsServer

            self.metrics = MetricsServer(cfg.metrics.address, cfg.metrics.port)
            self.metrics.start()
        setup = WorkerSetup(cfg, self.index.files_dir, None if self.index.files_dir else self.index,
                            self.fingerprint, cfg.buffer.dir, frozenset(self.quarantined))
        self.pool = Pool(setup, cfg.workers.resolved_count(), cfg.workers.max_tasks_in_flight)
        self.pool.start()
        self.remote = None
        if cfg.workers.executor in ("ray", "mixed"):
            from .raypool import RayPool

            self.remote = RayPool(cfg.workers.ray, replace(setup, index=self.index), cfg.workers.max_tasks_in_flight,
                                  self._wake)
            self.remote.start()
        self.watcher = ProgressWatcher(cfg.progress_dir, self.ranks, self._wake, cfg.progress.inotify)
        self.watcher.start()
        self._apply_progress(self.watcher.poll(), initial=True)
        self._evict()
        log.info("serving ranks %s of world size %d: %d batches of %d per epoch per rank, %s; %d workers, "
                 "capacity %d (refill below %d), max %s; buffer %s",
                 list(self.ranks), L.world_size, self.sampler.batches_per_epoch, L.batch_size,
                 "endless" if L.epochs is None else f"{L.epochs} epochs", self.pool.count, cfg.buffer.capacity,
                 cfg.buffer.refill_at, format_size(cfg.buffer.max_bytes), cfg.buffer.dir)

    def _write_meta(self) -> None:
        c = self.cfg
        status.write_json(c.buffer.dir, status.META_NAME, {
            "format": "prefetchd-meta", "version": 1, "pid": os.getpid(), "fingerprint": self.fingerprint_hex,
            "stream_fingerprint": c.stream_fingerprint(), "num_samples": len(self.index),
            "num_classes": len(self.index.classes), "batch_size": c.loader.batch_size,
            "batches_per_epoch": self.sampler.batches_per_epoch, "world_size": c.loader.world_size,
            "ranks": list(self.ranks), "epochs": c.loader.epochs, "output_size": c.augment.output_size,
            "progress_dir": c.progress_dir, "started": self.t_start,
        })

    def _load_quarantine(self) -> None:
        path = os.path.join(self.cfg.buffer.dir, status.QUARANTINE_NAME)
        try:
            with open(path, encoding="utf-8") as f:
                for line in f:
                    try:
                        q = json.loads(line)
                        if q.get("dataset") == self.index.fingerprint:
                            self.quarantined[int(q["index"])] = q
                    except (ValueError, KeyError, TypeError):
                        continue
        except FileNotFoundError:
            pass

    # --- signals and waking -----------------------------------------------------------------------

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # already awake

    def _on_signal(self, signum, frame) -> None:  # record only; the loop acts
        if signum == signal.SIGHUP:
            self._reload = True
        else:
            self._stop = True
        self._wake()

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    # --- positions and windows ----------------------------------------------------------------------

    def _normalise(self, e: int, b: int) -> tuple[int, int]:
        bpe = self.sampler.batches_per_epoch
        return (e + b // bpe, b % bpe)

    def window(self, r: int) -> list[tuple[int, int]]:
        e, b = self.pos[r]
        out = []
        epochs = self.cfg.loader.epochs
        while len(out) < self.cfg.buffer.capacity and (epochs is None or e < epochs):
            out.append((e, b))
            e, b = self._normalise(e, b + 1)
        return out

    def _apply_progress(self, changed: dict, initial: bool = False) -> None:
        now = time.time()
        for r, p in changed.items():
            new = self._normalise(p.epoch, p.batch)
            old = self.pos[r]
            if new < old and not initial and p.session and p.session == self._session.get(r):
                if self._backwards_warned.get(r) != p.session:
                    log.warning("rank %d's progress went back from epoch %d batch %d to epoch %d batch %d within one "
                                "trainer session; ignoring it and keeping the last good position", r, *old, *new)
                    self._backwards_warned[r] = p.session
                continue
            self._session[r] = p.session
            if p.fingerprint and p.fingerprint != self.fingerprint_hex and not initial:
                log.warning("rank %d's trainer expects stream %s but this daemon makes %s (a config differs)",
                            r, p.fingerprint, self.fingerprint_hex)
            if new < old and not initial:
                log.info("rank %d jumped back from epoch %d batch %d to epoch %d batch %d (a resume?)", r, *old, *new)
            elif not initial and new > old:
                bpe = self.sampler.batches_per_epoch
                n = (new[0] - old[0]) * bpe + new[1] - old[1]
                self._consumed.append((now, n * self.cfg.loader.batch_size))
            self.pos[r] = new
            self.wait_s[r] = float(p.wait_s)
            self.echoed[r] = int(p.echoed)
            self.last_progress[r] = now
        if changed:
            self._evict()

    def _evict(self) -> None:
        windows = {r: set(self.window(r)) for r in self.ranks}
        for key in list(self.ring.ready):
            r, e, b = key
            if r not in windows or (e, b) not in windows[r]:
                self.ring.evict(key)

    # --- scheduling -------------------------------------------------------------------------------------

    def _window_state(self, r: int) -> tuple[list[tuple[int, int]], int, int]:
        """(r's missing batches in window order, how many are ready or in flight, how many of those
        are contiguous from the trainer's position: what the trainer can rely on)."""
        missing: list[tuple[int, int]] = []
        have = ahead = 0
        for e, b in self.window(r):
            k = (r, e, b)
            if k in self.ring.ready or k in self.inflight:
                have += 1
                if not missing:
                    ahead += 1
            else:
                missing.append((e, b))
        return missing, have, ahead

    def _schedule(self) -> None:
        self._schedule_some()
        # say why production waits, once per cause until a batch is published again
        if self.blocked and not (self._blocked_logged or "").startswith(self.blocked[:24]):
            log.warning("waiting: %s", self.blocked)
            self._blocked_logged = self.blocked

    def _schedule_some(self) -> None:
        if time.monotonic() < self._error_until:
            return
        if self.remote is not None and self.cfg.workers.executor == "ray":
            if self.remote.connected and self.pool.count:
                log.info("ray: remote workers ready; stopping the local stand-ins")
                self.pool.resize(0)
            elif not self.remote.connected and not self.pool.count:  # the cluster was lost
                self.pool.resize(self.cfg.workers.resolved_count())
        idle = self.pool.idle() + (self.remote.idle() if self.remote is not None else [])
        if not idle:
            return
        cap = self.cfg.buffer
        free = None
        self.blocked = None
        # one pass over each rank's window per call, then updated as batches are handed out
        state = {}
        for r in self.ranks:
            missing, have, ahead = self._window_state(r)
            if ahead < cap.refill_at:  # the low watermark counts only what the trainer can use next
                self.filling[r] = True
            state[r] = [missing, have]
        for w in idle:
            best = None
            for r in self.ranks:
                missing, have = state[r]
                if not missing or have >= cap.capacity:
                    self.filling[r] = False
                if self.filling[r] and (best is None or have < state[best][1]):
                    best = r
            if best is None:
                return
            r = best
            e, b = state[r][0][0]
            n = self.sampler.batch_len(b)
            est = batchfile.max_file_size(n, self.cfg.augment.output_size, self.cfg.augment.output_size)
            pending = sum(self.inflight.values())
            if self.ring.bytes_used + pending + est > cap.max_bytes:
                if self.ring.bytes_used + pending == 0:
                    self.blocked = (f"one batch needs {format_size(est)} but buffer.max_bytes is "
                                    f"{format_size(cap.max_bytes)}; raise buffer.max_bytes")
                else:
                    self.blocked = f"buffer.max_bytes ({format_size(cap.max_bytes)}) reached"
                return
            if free is None:
                free = self.ring.free_bytes()
            if free - pending - est < cap.min_free_bytes:
                self.blocked = (f"the buffer filesystem has {format_size(free)} free; a batch needs "
                                f"{format_size(est)} and buffer.min_free_bytes keeps {format_size(cap.min_free_bytes)}")
                return
            task = Task(r, e, b, self.sampler.batches_per_epoch, self.sampler.batch_indices(e, r, b), self._crashers)
            if (self.pool if isinstance(w, Worker) else self.remote).submit(w, task):
                if not self.inflight:
                    self._last_activity = time.monotonic()
                self.inflight[(r, e, b)] = est
                state[r][0].pop(0)
                state[r][1] += 1

    def _handle(self, res: Result) -> None:
        key = (res.rank, res.epoch, res.batch)
        self.inflight.pop(key, None)
        self._last_activity = time.monotonic()
        for q in res.quarantined:
            self._quarantine(q, res.epoch)
        if res.error:
            log.error("batch r%d e%d b%d failed: %s; trying again in %.0f s", *key, res.error, _ERROR_BACKOFF_S)
            self.blocked = res.error
            self._error_until = time.monotonic() + _ERROR_BACKOFF_S
            return
        r, e, b = key
        wanted = r in self.pos and (e, b) in self.window(r) and key not in self.ring.ready
        if not wanted:
            Ring._unlink(res.tmp_path)
            return
        try:
            self.ring.publish(res.tmp_path, key, res.size)
        except OSError as err:
            log.error("cannot publish batch r%d e%d b%d: %s", *key, err.strerror)
            Ring._unlink(res.tmp_path)
            return
        now = time.time()
        self._blocked_logged = None
        self.produced_batches += 1
        self.produced_images += res.samples
        self._produced.append((now, res.samples))
        if self.first_batch_at is None:
            self.first_batch_at = now
            log.info("first batch published %.2f s after start", now - self.t_start)

    def _note_crashes(self) -> None:
        """A sample that was being decoded when its worker died twice is quarantined: it gets the
        same deterministic replacement as an undecodable file, and training goes on."""
        from .worker import Quarantined

        for index, how in self.pool.suspects:
            self._crashes[index] = self._crashes.get(index, 0) + 1
            if self._crashes[index] >= 2 and index not in self.quarantined:
                reason = f"its worker {how} twice while decoding it"
                self._crashers += ((index, reason),)
                self._quarantine(Quarantined(index, self.index.path(index), reason), -1)
        self.pool.suspects.clear()

    def _quarantine(self, q, epoch: int) -> None:
        if q.index in self.quarantined:
            return
        rec = {"index": q.index, "path": q.path, "reason": q.reason, "epoch": epoch, "time": time.time(),
               "dataset": self.index.fingerprint}
        self.quarantined[q.index] = rec
        log.warning("quarantined sample %d (%s): %s; a deterministic replacement stands in for it",
                    q.index, q.path, q.reason)
        try:
            with open(os.path.join(self.cfg.buffer.dir, status.QUARANTINE_NAME), "a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")
        except OSError as e:
            log.error("cannot append to the quarantine list: %s", e.strerror)

    # --- status ----------------------------------------------------------------------------------------

    def _rate(self, dq: deque, now: float) -> float | None:
        while dq and dq[0][0] < now - _RATE_WINDOW_S:
            dq.popleft()
        if not dq:
            return 0.0
        span = min(_RATE_WINDOW_S, now - self.t_start)
        return sum(n for _, n in dq) / span if span > 0 else None

    def status_record(self) -> dict:
        now = time.time()
        ranks = {}
        for r in self.ranks:
            win = self.window(r)
            ready = 0
            for e, b in win:  # contiguous run of ready batches from the trainer's position
                if (r, e, b) not in self.ring.ready:
                    break
                ready += 1
            ranks[str(r)] = {
                "position": list(self.pos[r]),
                "ready": sum(1 for e, b in win if (r, e, b) in self.ring.ready),
                "ahead": ready,
                "in_flight": sum(1 for k in self.inflight if k[0] == r),
                "filling": self.filling[r],
                "wait_s": self.wait_s[r],
                "echoed": self.echoed[r],
                "last_progress_age_s": (now - self.last_progress[r]) if r in self.last_progress else None,
                "done": not win,
            }
        busy = sum(w.busy_s for w in self.pool.workers.values())
        up = max(now - self.t_start, 1e-9)
        rss = 0
        for pid in [os.getpid(), *self.pool.pids()]:
            try:
                rss += psutil.Process(pid).memory_info().rss
            except psutil.Error:
                pass
        return {
            "format": "prefetchd-status", "version": 1, "pid": os.getpid(), "state": "stopping" if self._stop else "running",
            "updated": now, "started": self.t_start, "uptime_s": up, "buffer_dir": self.cfg.buffer.dir,
            "fingerprint": self.fingerprint_hex, "capacity": self.cfg.buffer.capacity,
            "refill_at": self.cfg.buffer.refill_at, "workers": self.pool.count,
            "workers_alive": sum(1 for w in self.pool.workers.values() if w.process.is_alive()),
            "worker_restarts": self.pool.restarts, "worker_pids": self.pool.pids(),
            "worker_utilisation": min(1.0, busy / (up * max(1, self.pool.count))),
            "produced_batches": self.produced_batches, "produced_images": self.produced_images,
            "produced_img_s": self._rate(self._produced, now), "consumed_img_s": self._rate(self._consumed, now),
            "first_batch_s": None if self.first_batch_at is None else self.first_batch_at - self.t_start,
            "bytes_used": self.ring.bytes_used, "max_bytes": self.cfg.buffer.max_bytes,
            "fs_free": self.ring.free_bytes(), "blocked": self.blocked, "quarantined": len(self.quarantined),
            "progress_watch": self.watcher.mode, "rss_bytes": rss, "ranks": ranks,
            "executor": self.cfg.workers.executor, "ray": self.remote.status() if self.remote is not None else None,
        }

    def _write_status(self) -> dict:
        rec = self.status_record()
        if self.metrics is not None:
            self.metrics.update(rec)
        try:
            status.write_json(self.cfg.buffer.dir, status.STATUS_NAME, rec)
            self._status_error = None
        except OSError as e:
            if self._status_error != e.strerror:  # once per spell, not every second
                log.warning("cannot write status.json: %s", e.strerror)
            self._status_error = e.strerror
        return rec

    # --- reload -----------------------------------------------------------------------------------------

    def _do_reload(self) -> None:
        self._reload = False
        if self.notify:
            self.notify.reloading()
        try:
            new = load_config(self.cfg.source) if self.cfg.source else None
        except ConfigError as e:
            log.error("reload refused: %s; keeping the running configuration", e)
            new = None
        if new is not None:
            why = _reload_blockers(self.cfg, new)
            if why:
                log.error("reload refused: %s would change the batch stream or the buffer; restart the daemon "
                          "to apply it", why)
            else:
                self.cfg = replace(self.cfg, workers=new.workers, buffer=new.buffer, progress=new.progress, log=new.log)
                self.pool.max_in_flight = new.workers.max_tasks_in_flight
                self.pool.resize(new.workers.resolved_count())
                logging.getLogger().setLevel(getattr(logging, new.log.level.upper()))
                for r in self.ranks:
                    self.filling[r] = True
                self._evict()
                log.info("reloaded: %d workers, capacity %d (refill below %d), max %s", self.pool.count,
                         new.buffer.capacity, new.buffer.refill_at, format_size(new.buffer.max_bytes))
        if self.notify:
            self.notify.ready()

    # --- the loop ---------------------------------------------------------------------------------------

    def run(self) -> int:
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        for signum in self._early_signals:  # arrived before the handlers above
            self._on_signal(signum, None)
        try:
            self._setup()
        except BaseException:
            for s, h in old.items():
                signal.signal(s, h)
            raise
        next_status = 0.0
        deaths_before_first = 0
        try:
            while not self._stop:
                if self._reload:
                    self._do_reload()
                changed = self.watcher.poll()
                if changed:
                    self._apply_progress(changed)
                self._schedule()
                timeout = self.cfg.progress.poll_interval_s
                now = time.monotonic()
                if now >= next_status:
                    rec = self._write_status()
                    next_status = now + _STATUS_INTERVAL_S
                    self._notify_status(rec)
                timeout = max(0.0, min(timeout, next_status - time.monotonic()))
                results, lost, extras = self.pool.wait(timeout, [self._wake_r])
                if extras:
                    self._drain_wake()
                if self.remote is not None:
                    remote_results, remote_lost = self.remote.drain(self.cfg.buffer.dir, 9999)
                    results += remote_results
                    for t in remote_lost:
                        self.inflight.pop((t.rank, t.epoch, t.batch), None)
                for res in results:
                    self._handle(res)
                for t in lost:
                    self.inflight.pop((t.rank, t.epoch, t.batch), None)
                    if self.first_batch_at is None:
                        deaths_before_first += 1
                self._note_crashes()
                if deaths_before_first >= _CRASH_LOOP_DEATHS:
                    log.error("workers died %d times before the first batch was made; stopping (see the errors above)",
                              deaths_before_first)
                    return 1
                self.pool.shrink_idle()
            log.info("stopping: %d batches published this run", self.produced_batches)
            return 0
        finally:
            if self.notify:
                self.notify.stopping()
            self.watcher.stop()
            if self.metrics is not None:
                self.metrics.stop()
            if self.remote is not None:
                self.remote.stop()
            self.pool.stop()
            removed = self.ring.remove_temp_files()
            if removed:
                log.info("removed %d temp files of unfinished batches", removed)
            try:
                rec = self.status_record()
                rec["state"] = "stopped"
                status.write_json(self.cfg.buffer.dir, status.STATUS_NAME, rec)
            except OSError:
                pass
            self.lock.release()
            for s, h in old.items():
                signal.signal(s, h)
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _notify_status(self, rec: dict) -> None:
        if not self.notify:
            return
        ready_all = all(v["ahead"] > 0 or v["done"] for v in rec["ranks"].values())
        if ready_all and not self._ready_notified:
            self.notify.ready()
            self._ready_notified = True
        if self.notify.watchdog_s:
            # WATCHDOG=1 only while the pipeline moves: idle with nothing to do, or results coming
            stalled = bool(self.inflight) and time.monotonic() - self._last_activity > self.notify.watchdog_s / 2
            if not stalled:
                self.notify.watchdog()
        self.notify.status(f"{rec['produced_img_s'] or 0:.0f} img/s; "
                           + ", ".join(f"r{r} {v['ahead']}/{rec['capacity']} ahead" for r, v in rec["ranks"].items()))


def stream_fingerprint(cfg: Config, dataset_fingerprint: str) -> str:
    """16 hex digits identifying the batch stream: config settings that change bytes + dataset."""
    return hashlib.sha256(f"{cfg.stream_fingerprint()}|{dataset_fingerprint}".encode()).hexdigest()[:16]


def _reload_blockers(old: Config, new: Config) -> str | None:
    if new.stream_fingerprint() != old.stream_fingerprint():
        diffs = [f"loader.{k}" for k in ("batch_size", "seed", "shuffle", "drop_last", "world_size")
                 if getattr(new.loader, k) != getattr(old.loader, k)]
        diffs += ["augment.*"] if new.augment != old.augment else []
        return ", ".join(diffs) or "the stream"
    if new.dataset != old.dataset:
        return "dataset.*"
    if new.loader != old.loader:
        return "loader.ranks/epochs"
    if new.buffer.dir != old.buffer.dir or new.buffer.group != old.buffer.group:
        return "buffer.dir/group"
    if new.progress.dir != old.progress.dir:
        return "progress.dir"
    return None
