"""The daemon's main loop: keep every rank's ring filled between the watermarks.

The policy lives in ``planner.Planner`` (pure: windows, watermarks, fairness, byte limits,
per-batch back-off); this module is the shell that carries its plans out. Each turn of the loop:

1. reads the progress files that changed (``watcher``: inotify marks them, one read each per
   wake-up; every file on the poll timer), turns them into moves (``sessions``) and deletes the
   published batches each move takes out of a window (the planner says which);
2. asks the planner for as many batches as the executors have free slots and submits them
   (``pool.Pool``, and ``raypool.RayPool`` with ``workers.executor: ray | mixed``, behind one
   interface: ``idle``, ``submit``, ``results``, ``waitables``, ``stop``);
3. waits for results, deaths, signals or the next timer; publishes each made batch still wanted,
   by rename; a failed batch is retried after its back-off, a lost one (its worker died or was
   killed at its deadline) at once; samples that fail are quarantined (``quarantine``);
4. rewrites ``status.json`` from counters once a second.

The validation stream (``validation.enabled``) runs in the same loop: a second planner whose
lanes (``progress.VAL_LANE + rank``) are pass-bounded and active only while their trainer
iterates a pass (``reading`` in its progress file). Both share the workers and
``buffer.max_bytes``: train is planned first, validation gets the slots it leaves, and a pass
being read always keeps room for its lanes' next batches (``validation.ValStream.make_room``).

Signal handlers only record the signal and wake the loop, which does the work: SIGTERM/SIGINT
stop it cleanly (also during the dataset scan; workers stopped, temp files removed, published
batches kept for the next start, the lock released whatever fails), SIGHUP reloads the tunables.
A stop signal also arms the ``stopguard.StopGuard`` the CLI hands in: should the main thread
not get back to the loop (a call stuck in the kernel), the process still ends, with status 0,
``stopguard.STOP_DEADLINE_S`` after the signal; once the loop has returned, the teardown has
until ``stopguard.STOP_TOTAL_S``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import threading
import time
from dataclasses import replace

from prefetchd.core import hybrid
from prefetchd.core.augment.transform import check as check_transform
from prefetchd.core.config import Config, ConfigError, format_size, reload_blockers
from prefetchd.core.config import load as load_config
from prefetchd.core.planner import Limits, Planner
from prefetchd.core.runclock import TICK_S, RunClock
from prefetchd.core.sampler import for_index
from prefetchd.core.sizing import read_and_resolve
from prefetchd.core.streamkeys import stream_settings
from prefetchd.daemon.autosize import Pacer
from prefetchd.daemon.metrics import reload_metrics
from prefetchd.daemon.outages import Outages
from prefetchd.daemon.quarantine import QuarantineLog
from prefetchd.daemon.report import RateWindow, status_record, stuck_s
from prefetchd.daemon.rescan import Rescan
from prefetchd.daemon.ring import Lock, Ring, is_tmpfs, prepare_dirs
from prefetchd.daemon.segments import Segments, WholeEpochs, sample_fingerprint
from prefetchd.daemon.sessions import Sessions
from prefetchd.daemon.stalls import StallWatch
from prefetchd.daemon.teardown import close_early, teardown
from prefetchd.daemon.validation import ValStream
from prefetchd.daemon.waiting import Waiting
from prefetchd.daemon.watcher import ProgressWatcher
from prefetchd.executors import builders
from prefetchd.executors.fdwait import FdWait, fd_of
from prefetchd.executors.pool import Pool, PoolError
from prefetchd.executors.storage import STORAGE_RETRY_S
from prefetchd.executors.worker import Result, WorkerSetup
from prefetchd.format import batchfile, status
from prefetchd.format.progress import VAL_LANE
from prefetchd.sources.dataset import load_index, unchanged_since_scan, val_labels

log = logging.getLogger("prefetchd")

_STATUS_INTERVAL_S = 1.0
_CRASH_LOOP_DEATHS = 8  # this many worker crashes before the first batch mean a broken setup (kills do not count)
# Fault injection for the test suite: once this file exists the loop blocks (as a call stuck in
# the kernel would), so that only the stop guard can end the process. Unset in normal use.
_STUCK_ON = os.environ.get("PREFETCHD_FAULT_STUCK_LOOP")


class Daemon:
    segments = WholeEpochs()  # resumed epochs' keys (segments.py); set up with the sampler in _setup

    def __init__(self, cfg: Config, notify=None, early_signals: list[int] | None = None, stop_guard=None):
        self.sizing = read_and_resolve(cfg)  # workers.count, max_bytes, capacity: auto made numbers, and why
        self.pacer = Pacer(cfg.buffer.capacity == "auto", cfg.buffer.refill_at is None)
        self.cfg = cfg = self.sizing.cfg
        self.stop_guard = stop_guard  # stopguard.StopGuard, armed by a stop signal
        self._early_signals = early_signals if early_signals is not None else []
        self.notify = notify
        self.clock = RunClock()  # every deadline's: a job stopped whole (scontrol suspend) fires none on resuming
        self.t_start = time.time()
        self._stop = False
        self._reload = False
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._fdwait = (FdWait(), FdWait())  # the loop's wait, without and with the watcher's: the same fds turn after turn
        self.waiting = Waiting()  # why each stream waits: the status, one log line per spell
        self.produced_batches = 0
        self.produced_images = 0
        self.failed_batches = 0
        self._bounds: dict = {}  # compact batches: key -> size bound (made from file sizes, reused while blocked)
        self.produced_rate = RateWindow()  # images made in the last seconds (the status's img/s)
        self.consumed_rate = RateWindow()
        self.first_batch_at: float | None = None
        self._ready_notified = False
        self.last_activity = self.clock()  # last batch made, or the start of work after idling
        self._status_error: str | None = None
        self.watcher = self.pool = self.lock = None  # made by _setup: teardown stops the parts that exist
        self.remote = None
        self.metrics = None
        self.val = None  # the validation stream's state, when validation.enabled
        self.outages = Outages()  # dataset roots that batches find unreadable now
        self._rescan: Rescan | None = None  # a SIGHUP's dataset rescan, while it runs

    # --- set-up -----------------------------------------------------------------------------------

    def _setup(self) -> bool:
        """Everything before the loop. False: a stop signal came first (during the index scan)."""
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
        if not self._load_index():
            return False
        L = cfg.loader
        self.sampler = for_index(L, self.index)  # (a ConfigError when a rank's share holds no batch)
        self.dataset_fp = self.sampler.dataset_fingerprint(self.index.fingerprint)  # the stream's dataset part
        # augment.transform made and run on the first samples before any worker starts: if broken, a ConfigError (exit 78)
        self.transform_file, self.view_shapes = check_transform(cfg.augment, self.index, L.seed, lambda s: log.info("augment.transform: %s", s))
        self.fingerprint_hex = status.stream_id(cfg.stream_fingerprint(), self.dataset_fp,  # the stream's name
                                                self.transform_file.code)
        self.fingerprint = batchfile.fingerprint_u64(self.fingerprint_hex)
        self.ranks = L.ranks
        self.quarantine = QuarantineLog(cfg.buffer.dir, self.index.fingerprint, self.index.path,
                                        self.index.content_stamp)
        self.quarantine.load()
        self.sessions = Sessions(self.ranks, self.sampler.batches_per_epoch, self.fingerprint_hex)
        self.stalls = StallWatch(clock=self.clock)  # ranks whose trainer stopped moving (status, metrics, one log line)
        self.planner = Planner(self.ranks, self.sampler.batches_per_epoch, L.epochs, _limits(cfg.buffer),
                               self._estimate)
        self.segments = Segments(self.sampler, self.ranks, self.fingerprint_hex, self.sessions, self.planner)
        if cfg.validation.enabled:
            self.val = ValStream(cfg, self.val_index, self.ranks, self.fingerprint_hex)
        lanes = tuple(self.ranks) + (self.val.lanes if self.val else ())
        self.watcher = ProgressWatcher(cfg.progress_dir, lanes, self._wake, cfg.progress.inotify)
        self._apply_progress(self.watcher.poll(), initial=True)
        self.ring = Ring(cfg.buffer.dir, self.segments)
        counts = self.ring.recover(self.fingerprint, self.val.fingerprint if self.val else None, self.view_shapes)
        for key, nbytes in list(self.ring.ready.items()):
            if not self._planner(key[0]).adopt(key, nbytes):
                self.ring.evict(key)
        if any(counts.values()):
            log.info("buffer recovered: kept %(kept)d batches; removed %(temp)d temp, %(bad)d torn or corrupt, "
                     "%(foreign)d from another stream", counts)
        self._write_meta()
        if cfg.metrics.enabled:
            from prefetchd.daemon.metrics import MetricsServer

            self.metrics = MetricsServer(cfg.metrics.address, cfg.metrics.port)
            self.metrics.start()
        setup = WorkerSetup(cfg, self.index.files_dir, None if self.index.files_dir else self.index,
                            self.fingerprint, cfg.buffer.dir, frozenset(self.quarantine.records),
                            index_fingerprint=self.index.fingerprint, transform_code=self.transform_file.code, view_shapes=self.view_shapes)
        if self.val:
            setup = replace(setup, val=self.val.worker_setup(cfg, setup))
        W = cfg.workers
        self.pool = Pool(setup, W.resolved_count(), W.max_tasks_in_flight, W.task_timeout_s, self.index, self.clock, stopping=lambda: self._stop)
        self.pool.start()
        if W.executor in ("ray", "mixed"):
            from prefetchd.executors.raypool import RayPool

            self.remote = RayPool(W.ray, replace(setup, index=self.index), W.max_tasks_in_flight, self._wake, 9999, W.task_timeout_s, self.clock)
            self.remote.start()
        self.watcher.start()
        log.info("serving ranks %s of world size %d: %d batches of %d per epoch per rank, %s; %d workers, "
                 "capacity %d (refill below %d), max %s; buffer %s",
                 list(self.ranks), L.world_size, self.sampler.batches_per_epoch, self.sampler.batch_len(0),
                 "endless" if L.epochs is None else f"{L.epochs} epochs", self.pool.count, cfg.buffer.capacity,
                 cfg.buffer.refill_at, format_size(cfg.buffer.max_bytes), cfg.buffer.dir)
        log.info("sizing: %s", "; ".join(self.sizing.why.values()))
        for warning in self.sizing.warnings:
            log.warning("%s", warning)
        if self.val:
            v = self.val
            log.info("validation: %d samples, batches of %d, %s batches per pass by rank, capacity %d",
                     v.sampler.num_samples, v.sampler.batch_size, [v.sampler.batches(r) for r in self.ranks],
                     cfg.validation.capacity)
        return True

    def _load_index(self) -> bool:
        """Read the dataset index on a thread, so a stop signal is acted on during a long scan."""
        cfg, box, V = self.cfg.dataset, {}, self.cfg.validation
        t0, wake = time.monotonic(), os.dup(self._wake_w)  # the thread's own: ours closes if we stop meanwhile

        def scan():  # the box is filled once, when every index is read: the main thread waits for that
            try:
                found = {"index": load_index(cfg.root, cfg.file_list, cfg.extensions, cfg.cache_dir, **cfg.index_options())}
                if V.enabled:
                    found["val"] = load_index(V.root, V.file_list, cfg.extensions, cfg.cache_dir, devkit=V.devkit,
                                              section="validation", **cfg.index_options(validation=True))
            except BaseException as e:  # handed to the main thread
                found = {"error": e}
            box.update(found)
            with contextlib.suppress(OSError):  # awake already, or no one reads: the daemon stopped during the scan
                os.write(wake, b"x")
            os.close(wake)

        threading.Thread(target=scan, name="prefetchd-index", daemon=True).start()
        while not box and not self._stop:
            select.select([self._wake_r], [], [], 1.0)
            self._drain_wake()
        if self._stop and not box:
            log.info("stopping during the dataset scan")
            return False
        if "error" in box:
            raise box["error"]
        self.index, cached = box["index"]
        if "val" in box:
            self.val_index = val_labels(box["val"][0], self.index)
        log.info("dataset: %d samples in %d classes (%s, %.2f s)", len(self.index), len(self.index.classes),
                 "cached index" if cached else "scanned", time.monotonic() - t0)
        return True

    def _write_meta(self) -> None:
        c = self.cfg
        status.write_json(c.buffer.dir, status.META_NAME, {
            "format": "prefetchd-meta", "version": 1, "pid": os.getpid(), "fingerprint": self.fingerprint_hex,
            "stream_fingerprint": c.stream_fingerprint(), "stream": stream_settings(c), "config": c.source,
            "num_samples": len(self.index), "views": [list(v) for v in self.view_shapes],  # each view's [h, w]
            "num_classes": len(self.index.classes), "batch_size": c.loader.batch_size,
            "batches_per_epoch": self.sampler.batches_per_epoch, "world_size": c.loader.world_size,
            "ranks": list(self.ranks), "epochs": c.loader.epochs, "output_size": c.augment.output_size,
            "progress_dir": c.progress_dir, "started": self.t_start,  # and what a resume at another world size checks:
            "sample_fingerprint": sample_fingerprint(c, self.dataset_fp, self.transform_file.code),
            "transform_code": self.transform_file.code, "transform_file": self.transform_file.path,  # in both fingerprints
            "dataset_fingerprint": self.dataset_fp,  # a state of another world size names its stream
            # the client decodes compact batches itself (hybrid | gpu), erases normalised ones (erase_on: client)
            "decode": c.augment.decode, "gpu_share": c.augment.gpu_share if c.augment.decode == "hybrid" else None,
            "erasing": c.augment.client_erasing(c.loader.seed), "validation": self.val.meta() if self.val else None, "identity": status.daemon_identity(),
        })

    # --- signals and waking -----------------------------------------------------------------------

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # (already awake)
            os.write(self._wake_w, b"x")

    def _on_signal(self, signum, frame) -> None:  # record only; the loop acts
        if signum == signal.SIGHUP:
            self._reload = True
        else:
            self._stop = True
            if self.stop_guard is not None:
                self.stop_guard.arm()
        self._wake()

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    # --- the loop ---------------------------------------------------------------------------------

    def run(self) -> int:
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        for signum in self._early_signals:  # arrived before the handlers above
            self._on_signal(signum, None)
        try:
            try:
                if not self._setup():
                    self._close_early()
                    return 0
            except BaseException:
                self._close_early()
                raise
            try:
                return self._loop()
            finally:
                self._teardown()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)

    def _loop(self) -> int:
        poll_s = self.cfg.progress.poll_interval_s
        next_status = next_poll = 0.0
        while not self._stop:
            if _STUCK_ON and os.path.exists(_STUCK_ON):
                time.sleep(3600)  # resumed after a signal handler runs, like a call stuck in the kernel
            if self._reload:
                self._do_reload()
                poll_s = self.cfg.progress.poll_interval_s
            self._finish_rescan()
            now = self.clock()
            full = now >= next_poll  # every file now and then; else only those inotify named
            if full:
                next_poll = now + poll_s
            self._apply_progress(self.watcher.poll(full))
            self._balance_executors()
            self._schedule()
            if now >= next_status:
                self._restore_lock()
                self._notify_status(self._write_status())
                next_status = now + _STATUS_INTERVAL_S
            due = [next_poll, next_status, self.pool.wake_due(), *(p.next_retry(now) for p in self._planners())]
            timeout = min(TICK_S, max(0.0, min(t for t in due if t is not None) - self.clock()))
            # progress wakes the loop only while a slot is free; else the next result reads it too (docs/internals.md: The loop)
            watch = self.watcher.waitables() if any(ex.idle() for ex in self._executors()) else []
            waitables = [self._wake_r, *watch, *self.pool.waitables(), *(self.remote.waitables() if self.remote is not None else ())]
            if self._wake_r in self._fdwait[bool(watch)].ready(tuple(map(fd_of, waitables)), timeout):
                self._drain_wake()
            for ex in self._executors():
                try:
                    results, lost = ex.results()
                except PoolError as e:  # no retry mended it: said, and the daemon stops
                    log.error("%s", e)
                    return 1
                for res in results:
                    self._handle(res)
                for t in lost:
                    self.segments.lost(self._planner(t.rank), t)
            for index, how in self.pool.suspects:
                self.quarantine.worker_died(index, how)
            self.pool.suspects.clear()
            if self.first_batch_at is None and self.pool.crashes_before_a_batch >= _CRASH_LOOP_DEATHS:
                log.error("workers died %d times before the first batch was made (crashed, not killed); stopping "
                          "(see the errors above)", self.pool.crashes_before_a_batch)
                return 1
        log.info("stopping: %d batches published this run", self.produced_batches)
        return 0

    def _planner(self, lane_id: int) -> Planner:
        return self.val.planner if lane_id >= VAL_LANE and self.val else self.planner

    def _planners(self) -> list[Planner]:
        return [self.planner] if self.val is None else [self.planner, self.val.planner]

    def _executors(self) -> list:
        return [self.pool] if self.remote is None else [self.pool, self.remote]

    def _balance_executors(self) -> None:
        """With ``executor: ray``, local workers stand in only while the cluster is unavailable."""
        if self.remote is None or self.cfg.workers.executor != "ray":
            return
        if self.remote.connected and self.pool.count:
            log.info("ray: remote workers ready; stopping the local stand-ins")
            self.pool.resize(0)
        elif not self.remote.connected and not self.pool.count:  # the cluster was lost
            self.pool.resize(self.cfg.workers.resolved_count())

    # --- progress ---------------------------------------------------------------------------------

    def _apply_progress(self, changed: dict, initial: bool = False) -> None:
        now = time.time()
        for r, p in changed.items():
            if r >= VAL_LANE and self.val:
                for key in self.val.apply(r, p, now, initial):
                    self.ring.evict(key)
        if consumed := self.segments.apply({r: p for r, p in changed.items() if r < VAL_LANE}, now, initial,
                                           lambda key: self.ring.evict(key)):
            self.consumed_rate.add(consumed * self.sampler.batch_len(0))  # not batch_size: drop_last: false

    # --- making batches ---------------------------------------------------------------------------

    def _schedule(self) -> None:
        if self.val:  # a pass being read keeps room for its next batches (validation.py: make_room)
            workers = self.pool.count + (len(self.remote.workers) if self.remote is not None else 0)
            for key in self.val.make_room(self.planner, workers):
                self.ring.evict(key)
        slots = sum(ex.idle() for ex in self._executors())
        if not slots:
            return
        was_idle = not any(p.busy() for p in self._planners())
        submit = self._plan(self.planner, slots)
        if self.val and len(submit) < slots:  # validation gets the slots train leaves
            self.val.take_rest(self.planner)
            submit += self._plan(self.val.planner, slots - len(submit))
        elif self.val:  # train took every slot: validation waits on workers, not on bytes
            self.waiting.note(self.val.planner.name, None, None, self.clock(), all_slots=True)
        for r, e, b in submit:
            if r >= VAL_LANE:
                task = self.val.task(r, e, b)
            else:
                task = self.segments.task((r, e, b), self.quarantine.crashers,
                                          self._bounds.pop(self.segments.real((r, e, b)), 0))
            if not any(ex.submit(task) for ex in self._executors()):
                self._planner(r).lost((r, e, b))
        if was_idle and submit:
            self.last_activity = self.clock()

    def _plan(self, planner: Planner, slots: int) -> list:
        """One planner's plan (its share of ``buffer.max_bytes`` is set in its limits' ``others``)."""
        plan = planner.plan(slots, self.clock(), self.ring.free_bytes(), self.pool.temp_bytes())
        for key in plan.evictions:  # room for a batch a trainer waits on (see Planner._front_holes)
            self.ring.evict(key)
        self.waiting.note(planner.name, plan.cause, plan.blocked, self.clock(), len(plan.submit) >= slots)
        return plan.submit

    def _estimate(self, key: tuple[int, int, int]) -> int:
        """An upper bound on a batch file's size before it is made. A compact batch (hybrid
        decode) holds whole JPEG files and can outgrow a batch of pixels: its bound is its
        header and tables plus, per sample, the larger of the file's size and a pixel sample
        (one stat per sample). The worker is given the bound and turns JPEGs into pixels if a
        replaced sample would overrun it, so it holds. Once published, the real size counts."""
        key = r, e, b, o = self.segments.real(key)  # o: the segment of a resumed epoch, else 0
        size = self.cfg.augment.output_size
        if not hybrid.on_gpu(self.cfg.augment, e, b):
            return batchfile.views_file_size(self.sampler.batch_len(b, o), self.view_shapes)
        bound = self._bounds.get(key)
        if bound is None:
            bound = builders.compact_bound(self.index.sample_size, self.sampler.batch_indices(e, r, b, o), size)
            if len(self._bounds) > 4096:  # bounds of batches not handed out (the trainer moved on)
                self._bounds.clear()
            self._bounds[key] = bound
        return bound

    def _root_of(self, lane: int) -> str:
        return self.val_index.root if lane >= VAL_LANE else self.index.root

    def _handle(self, res: Result) -> None:
        key, current = self.segments.planner_key(res.rank, res.epoch, res.batch, res.offset)
        planner = self._planner(res.rank)
        for q in res.quarantined:
            if res.rank >= VAL_LANE:  # val indices are not train indices: said, not in the train quarantine
                log.warning("validation sample %d (%s) cannot be used: %s; replaced in this pass", q.index, q.path,
                            q.reason)
            elif q.per_draw:  # augment.transform failed with this epoch's draw: not quarantined for good
                log.warning("sample %d (%s), epoch %d: %s; a deterministic replacement stands in for it", q.index, q.path, res.epoch, q.reason)
            else:
                self.quarantine.add(q, res.epoch)
        if not current:  # made for a segmentation no longer read (the trainers resumed elsewhere)
            return self.segments.discard(planner, key, res.tmp_path)
        if res.error:
            if res.unavailable:  # the storage's fault, not the batch's: no back-off, said once per outage
                if planner.finished(key):
                    planner.deferred(key, self.clock() + STORAGE_RETRY_S)
                self.outages.failed(self._root_of(res.rank), res.error, self.clock(), res.storage)
            elif planner.finished(key):
                delay = planner.failed(key, self.clock())
                log.error("batch r%d e%d b%d failed: %s; trying it again in %.0f s", *key, res.error, delay)
            self.failed_batches += 1
            return
        self.outages.succeeded(self._root_of(res.rank), self.clock(), res.storage)
        if not planner.finished(key):
            Ring._unlink(res.tmp_path)  # no longer wanted (the trainer moved on) or already made
            return
        try:
            self.ring.publish(res.tmp_path, key, res.size)
        except OSError as err:
            Ring._unlink(res.tmp_path)
            delay = planner.failed(key, self.clock())
            log.error("cannot publish batch r%d e%d b%d: %s; trying it again in %.0f s", *key, err.strerror, delay)
            return
        planner.published(key, res.size)
        now = time.time()
        self.last_activity = self.clock()
        self.produced_batches += 1
        self.produced_images += res.samples
        self.produced_rate.add(res.samples)
        if self.first_batch_at is None:
            self.first_batch_at = now
            log.info("first batch published %.2f s after start", now - self.t_start)

    # --- status -----------------------------------------------------------------------------------

    @property
    def stopping(self) -> bool:  # a stop was asked for: the loop ends at its next turn
        return self._stop

    def status_record(self) -> dict:
        """The status record (``status.json``, metrics), from counters: see ``report.status_record``."""
        return status_record(self)

    def _restore_lock(self) -> None:
        """daemon.lock removed by hand: made again (the directory's own lock kept the buffer ours)."""
        try:
            if self.lock.restore():
                log.warning("%s was removed or replaced; made it again (this daemon still holds the buffer)",
                            self.lock.path)
        except OSError as e:
            log.warning("cannot make %s again: %s", self.lock.path, e.strerror)

    def _write_status(self) -> dict:
        rec = self.status_record()
        for key in self.pacer.observe(rec, self):  # capacity: auto follows the pace; data-bound ranks
            self.ring.evict(key)
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

    def _notify_status(self, rec: dict) -> None:
        if not self.notify:
            return
        ready_all = all(v["ahead"] > 0 or v["done"] for v in rec["ranks"].values())
        if ready_all and not self._ready_notified:
            self.notify.ready()
            self._ready_notified = True
        if self.notify.watchdog_s:
            # WATCHDOG=1 only while the pipeline moves: nothing to do, or batches made (stuck_s)
            if stuck_s(self) <= self.notify.watchdog_s / 2:
                self.notify.watchdog()
        self.notify.status(f"{rec['produced_img_s'] or 0:.0f} img/s; "
                           + ", ".join(f"r{r} {v['ahead']}/{rec['capacity']} ahead" for r, v in rec["ranks"].items()))

    # --- reload -----------------------------------------------------------------------------------

    def _do_reload(self) -> None:
        self._reload = False
        self._start_rescan()
        if self.notify:
            self.notify.reloading()
        try:
            new = load_config(self.cfg.source) if self.cfg.source else None
        except ConfigError as e:
            log.error("reload refused: %s; keeping the running configuration", e)
            new = None
        loaded, sized = new, read_and_resolve(new) if new is not None else None
        new = sized.cfg if sized is not None else None
        why = reload_blockers(self.cfg, new) if new is not None else None
        if why:
            log.error("reload refused: %s would change the batch stream or the buffer; restart the daemon "
                      "to apply it", why)
        elif new is not None:
            self.sizing, self.pacer = sized, Pacer(loaded.buffer.capacity == "auto", loaded.buffer.refill_at is None)
            self._apply_metrics(new.metrics)
            self.cfg = replace(self.cfg, workers=new.workers, buffer=new.buffer, progress=new.progress, log=new.log,
                               validation=replace(self.cfg.validation, capacity=new.validation.capacity))
            self.pool.max_in_flight = new.workers.max_tasks_in_flight
            for ex in self._executors():  # the Ray bridge too: one holding a batch longer has hung
                ex.task_timeout_s = new.workers.task_timeout_s
            self.pool.resize(new.workers.resolved_count())
            logging.getLogger().setLevel(getattr(logging, new.log.level.upper()))
            for key in self.planner.set_limits(_limits(new.buffer)):
                self.ring.evict(key)
            if self.val:
                for key in self.val.planner.set_limits(replace(_limits(new.buffer), capacity=self.cfg.validation.capacity,
                                                               refill_at=self.cfg.validation.capacity)):
                    self.ring.evict(key)
            log.info("reloaded: %d workers, capacity %d (refill below %d), max %s", self.pool.count,
                     new.buffer.capacity, new.buffer.refill_at, format_size(new.buffer.max_bytes))
        if self.notify:
            self.notify.ready()

    def _apply_metrics(self, new) -> None:
        """metrics.* by SIGHUP: the endpoint is started, stopped or moved now (``metrics.reload``)."""
        if new != self.cfg.metrics:
            self.metrics, applied = reload_metrics(self.metrics, self.cfg.metrics, new, self.status_record)
            self.cfg = replace(self.cfg, metrics=applied)

    # --- the dataset, looked at again (SIGHUP) -------------------------------------------------------

    def _start_rescan(self) -> None:
        if self._rescan is None:  # one at a time
            D, index = self.cfg.dataset, self.index
            self._rescan = Rescan(index, lambda: unchanged_since_scan(index.files_dir, index.fingerprint),
                                  lambda: load_index(D.root, D.file_list, D.extensions, D.cache_dir,
                                                     use_cache=False, **D.index_options())[0], self._wake)

    def _finish_rescan(self) -> None:
        if self._rescan is not None and self._rescan.done():
            self._rescan, rescan = None, self._rescan
            rescan.report()

    # --- teardown ---------------------------------------------------------------------------------

    def _close_early(self) -> None:
        if self.stop_guard is not None:  # what follows is bounded step by step: the guard gives it longer
            self.stop_guard.tearing_down()
        close_early(self)

    def _teardown(self) -> None:
        if self.stop_guard is not None:
            self.stop_guard.tearing_down()
        teardown(self)


def _limits(b) -> Limits:
    return Limits(b.capacity, b.refill_at, b.max_bytes, b.min_free_bytes)
