"""Prometheus metrics on a loopback port (``metrics.enabled``), with prometheus-client.

The figures are those of ``status.json``: a custom collector turns the daemon's latest status
record into metric families at scrape time, so the exporter holds no state of its own and
never disagrees with ``prefetchd status``. Names follow Prometheus conventions: a
``prefetchd_`` prefix, base units (bytes, seconds), ``_total`` for counters, ``rank`` as a label.
The daemon's own process is described by prometheus-client's standard ``process_*`` metrics
(CPU seconds, resident memory, open descriptors, start time).

Per rank, beside the counts: ``prefetchd_rank_ready_ratio`` (ready batches over
``buffer.capacity``, no join needed), ``prefetchd_rank_last_progress_age_seconds`` and
``_timestamp_seconds`` (the trainer's last progress record), ``prefetchd_rank_stalled`` (1 after
``stalls.STALL_AFTER_S`` without one) and ``prefetchd_rank_stalled_process{state=running|stopped|gone|unknown}``
(1 for the state of a stalled rank's trainer process; all 0 while the rank moves),
``prefetchd_rank_trainer{state=reading|waiting|finished|stalled}`` (1 for what the rank's trainer
is doing, ``stalls``; all 0 with no trainer) and ``prefetchd_rank_waiting_seconds`` (how long its
``next()`` has waited for the batch it asks for, 0 while it does not). A waiting or finished
trainer is not stalled; ``prefetchd_trainer_wait_seconds_total`` counts a wait while it lasts.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import replace

from prefetchd.daemon.stalls import STALL_AFTER_S, TRAINER_STATES
from prefetchd.format import procstate

log = logging.getLogger("prefetchd.metrics")


def families(rec: dict):
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    def gauge(name, doc, value, unit=""):
        g = GaugeMetricFamily(name, doc, unit=unit)
        g.add_metric([], float(value or 0))
        return g

    def counter(name, doc, value):
        c = CounterMetricFamily(name, doc)
        c.add_metric([], float(value or 0))
        return c

    yield counter("prefetchd_produced_images", "Images published in batches since the daemon started",
                  rec.get("produced_images"))
    yield counter("prefetchd_produced_batches", "Batches published since the daemon started", rec.get("produced_batches"))
    yield counter("prefetchd_consumed_batches", "Batches the trainers read (their positions moved past), all ranks, "
                  "since the daemon started", rec.get("consumed_batches"))
    yield gauge("prefetchd_production_rate_images_per_second", "Images published per second, last 10 s",
                rec.get("produced_img_s"))
    yield gauge("prefetchd_consumption_rate_images_per_second", "Images consumed by trainers per second, last 10 s",
                rec.get("consumed_img_s"))
    yield gauge("prefetchd_buffer_used_bytes", "Bytes of published batches in the buffer", rec.get("bytes_used"))
    yield gauge("prefetchd_buffer_max_bytes", "buffer.max_bytes", rec.get("max_bytes"))
    yield gauge("prefetchd_buffer_filesystem_free_bytes", "Free bytes on the buffer's filesystem", rec.get("fs_free"))
    yield gauge("prefetchd_buffer_capacity_batches", "buffer.capacity: batches kept ready per rank", rec.get("capacity"))
    yield gauge("prefetchd_workers", "Configured worker processes", rec.get("workers"))
    yield gauge("prefetchd_workers_alive", "Worker processes alive", rec.get("workers_alive"))
    yield counter("prefetchd_worker_restarts", "Workers replaced after dying", rec.get("worker_restarts"))
    yield counter("prefetchd_forkserver_restarts", "Forkservers (which start the workers) replaced after dying "
                  "or not answering a worker's start", rec.get("forkserver_restarts"))
    yield counter("prefetchd_resource_tracker_restarts", "multiprocessing resource trackers replaced after dying",
                  rec.get("resource_tracker_restarts"))
    yield counter("prefetchd_worker_timeouts", "Workers killed for holding a batch past workers.task_timeout_s",
                  rec.get("worker_timeouts"))
    yield gauge("prefetchd_worker_respawn_wait_seconds", "Time until a missing worker is replaced (respawn "
                "back-off), 0 when none is missing", rec.get("worker_respawn_in_s"))
    yield counter("prefetchd_failed_batches", "Batches that failed and were tried again after a back-off",
                  rec.get("failed_batches"))
    yield counter("prefetchd_main_cpu_seconds", "CPU time of the daemon's main process (not its workers)",
                  rec.get("main_cpu_s"))
    yield gauge("prefetchd_worker_utilisation_ratio", "Fraction of worker time spent making batches",
                rec.get("worker_utilisation"))
    yield gauge("prefetchd_quarantined_samples", "Samples quarantined (unreadable images)", rec.get("quarantined"))
    yield counter("prefetchd_samples_quarantined", "Samples quarantined (unreadable images), those of earlier runs "
                  "read at start included: increase() is the new ones", rec.get("quarantined"))
    st = rec.get("storage")
    if st:  # a bucket root (sources/objectstore.py): the workers' requests, bytes, errors and cache hits
        for k, doc in (("requests", "Requests sent to the bucket by the workers (each try of a retried one)"),
                       ("bytes", "Bytes the workers fetched from the bucket"),
                       ("errors", "Requests to the bucket that failed (retried or not)"),
                       ("cache_hits", "Reads served from the node-local cache (dataset.cache)"),
                       ("cache_misses", "Reads the node-local cache did not hold (dataset.cache)"),
                       ("cache_hit_bytes", "Bytes served from the node-local cache (dataset.cache)")):
            yield counter(f"prefetchd_storage_{k}", doc, st.get(k))
    yield gauge("prefetchd_resident_memory_bytes", "Resident memory of the daemon and its workers", rec.get("rss_bytes"))
    yield gauge("prefetchd_blocked", "1 while the train stream's production waits on max_bytes or free space",
                1 if rec.get("blocked") else 0)
    yield gauge("prefetchd_train_bytes", "Bytes of buffer.max_bytes the train stream holds (published batches and "
                "the estimates of those being made)", rec.get("train_bytes"))
    yield gauge("prefetchd_dataset_unreadable", "1 while batches meet an unreadable dataset root (tried again until "
                "it is back)", 1 if rec.get("dataset_unreadable") else 0)
    if rec.get("val_bytes") is not None:  # validation.enabled
        yield gauge("prefetchd_val_blocked", "1 while the validation stream's production waits on max_bytes or "
                    "free space", 1 if rec.get("val_blocked") else 0)
        yield gauge("prefetchd_val_bytes", "Bytes of buffer.max_bytes the validation stream holds (published "
                    "batches and the estimates of those being made)", rec.get("val_bytes"))
    ready = GaugeMetricFamily("prefetchd_rank_ready_batches", "Batches ready in the rank's window", labels=["rank"])
    ahead = GaugeMetricFamily("prefetchd_rank_ahead_batches", "Batches ready in a row from the trainer's position",
                              labels=["rank"])
    epoch = GaugeMetricFamily("prefetchd_rank_epoch", "The trainer's current epoch", labels=["rank"])
    batch = GaugeMetricFamily("prefetchd_rank_batch", "The trainer's next batch in its epoch", labels=["rank"])
    wait = CounterMetricFamily("prefetchd_trainer_wait_seconds", "Time the rank's trainer waited for batches",
                               labels=["rank"])
    retrying = GaugeMetricFamily("prefetchd_rank_retrying_batches", "Failed batches of the rank waiting out "
                                 "their back-off", labels=["rank"])
    echoed = CounterMetricFamily("prefetchd_trainer_echoed_batches", "Batches the rank's client served again "
                                 "(data echoing)", labels=["rank"])
    fallbacks = CounterMetricFamily("prefetchd_trainer_gpu_decode_fallbacks", "Samples of compact batches the "
                                    "rank's GPU decoder failed on, decoded on the trainer's CPU instead (hybrid "
                                    "decode)", labels=["rank"])
    consumed = CounterMetricFamily("prefetchd_rank_consumed_batches", "Batches the rank's trainer read (its "
                                   "position moved past) since the daemon started", labels=["rank"])
    ratio = GaugeMetricFamily("prefetchd_rank_ready_ratio", "Batches ready in the rank's window over "
                              "buffer.capacity", labels=["rank"])
    age = GaugeMetricFamily("prefetchd_rank_last_progress_age_seconds", "Seconds since the rank's trainer last "
                            "wrote its progress (it does per batch read)", labels=["rank"])
    seen = GaugeMetricFamily("prefetchd_rank_last_progress_timestamp_seconds", "When the rank's trainer last wrote "
                             "its progress (Unix time)", labels=["rank"])
    stalled = GaugeMetricFamily("prefetchd_rank_stalled", f"1 while the rank's trainer makes no progress (no record "
                                f"for {STALL_AFTER_S:g} s, batches left to read)", labels=["rank"])
    process = GaugeMetricFamily("prefetchd_rank_stalled_process", "1 for the state (running, stopped, gone, unknown) of a "
                                "stalled rank's trainer process; 0 for all while the rank moves",
                                labels=["rank", "state"])
    trainer = GaugeMetricFamily("prefetchd_rank_trainer", "1 for what the rank's trainer is doing (reading, "
                                "waiting for data, finished, stalled); 0 for all with no trainer",
                                labels=["rank", "state"])
    waiting = GaugeMetricFamily("prefetchd_rank_waiting_seconds", "Seconds the rank's trainer has waited in next() "
                                "for the batch it asks for; 0 while it does not wait", labels=["rank"])
    for r, rs in sorted(rec.get("ranks", {}).items()):
        for state in TRAINER_STATES:
            trainer.add_metric([r, state], 1 if rs.get("trainer") == state else 0)
        waiting.add_metric([r], (rs.get("waiting") or {}).get("for_s", 0.0))
        consumed.add_metric([r], rs.get("consumed", 0))
        ratio.add_metric([r], rs.get("ready_ratio", 0.0))
        if rs.get("last_progress") is not None:  # a trainer has written to this rank
            age.add_metric([r], rs.get("last_progress_age_s") or 0.0)
            seen.add_metric([r], rs["last_progress"])
        st = rs.get("stalled") or {}
        stalled.add_metric([r], 1 if st else 0)
        for state in procstate.STATES:
            process.add_metric([r, state], 1 if st.get("process") == state else 0)
        echoed.add_metric([r], rs.get("echoed", 0))
        fallbacks.add_metric([r], rs.get("gpu_fallbacks", 0))
        retrying.add_metric([r], rs.get("retrying", 0))
        ready.add_metric([r], rs.get("ready", 0))
        ahead.add_metric([r], rs.get("ahead", 0))
        epoch.add_metric([r], rs.get("position", [0, 0])[0])
        batch.add_metric([r], rs.get("position", [0, 0])[1])
        wait.add_metric([r], rs.get("wait_s", 0.0))
    yield from (ready, ahead, epoch, batch, wait, echoed, retrying, fallbacks, consumed, ratio, age, seen, stalled,
                process, trainer, waiting)
    vals = rec.get("val_ranks") or {}
    if vals:  # the validation stream's lanes, apart from train's
        vready = GaugeMetricFamily("prefetchd_val_rank_ready_batches", "Validation batches ready for the rank",
                                   labels=["rank"])
        vpass = GaugeMetricFamily("prefetchd_val_rank_pass", "The rank's current (or next) validation pass",
                                  labels=["rank"])
        vbatch = GaugeMetricFamily("prefetchd_val_rank_batch", "The rank's next batch in its validation pass",
                                   labels=["rank"])
        vactive = GaugeMetricFamily("prefetchd_val_rank_reading", "1 while the rank's trainer reads a validation pass",
                                    labels=["rank"])
        for r, rs in sorted(vals.items()):
            vready.add_metric([r], rs.get("ready", 0))
            vpass.add_metric([r], rs.get("position", [0, 0])[0])
            vbatch.add_metric([r], rs.get("position", [0, 0])[1])
            vactive.add_metric([r], 1 if rs.get("active") else 0)
        yield from (vready, vpass, vbatch, vactive)


class _Collector:
    def __init__(self, snapshot: Callable[[], dict]):
        self.snapshot = snapshot

    def collect(self):
        yield from families(self.snapshot())


class MetricsServer:
    """Serves /metrics from ``snapshot()`` (the latest status record) on ``address:port``."""

    def __init__(self, address: str, port: int):
        self.address, self.port = address, port
        self._lock = threading.Lock()
        self._rec: dict = {}
        self._server = None

    def update(self, rec: dict) -> None:
        with self._lock:
            self._rec = rec

    def _snapshot(self) -> dict:
        with self._lock:
            return self._rec

    def start(self) -> None:
        from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self._snapshot))
        ProcessCollector(registry=registry)  # process_*: the daemon's own CPU, memory, descriptors
        try:
            self._server, _ = start_http_server(self.port, addr=self.address, registry=registry)
        except OSError as e:  # the key to change, not only the socket's complaint
            raise OSError(e.errno, f"metrics.port {self.port} on metrics.address {self.address}: {e.strerror}; "
                          "choose a free port (or 0 for any) or set metrics.enabled: false") from None
        self.port = self._server.server_port
        log.info("metrics on http://%s:%d/metrics", self.address, self.port)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def reload_metrics(server: MetricsServer | None, old, new, snapshot: Callable[[], dict]):
    """``metrics.*`` changed by SIGHUP: stop, start or move the endpoint now. Returns (the server
    or None, the settings in force): a port that cannot be bound is said and leaves metrics off,
    and the rest of the reload applies."""
    if server is not None:
        server.stop()
        server = None
    if new.enabled:
        server = MetricsServer(new.address, new.port)
        try:
            server.start()
        except OSError as e:
            log.error("reload: cannot serve metrics: %s; metrics are off until a reload that works", e.strerror)
            return None, replace(new, enabled=False)
        server.update(snapshot())
    elif old.enabled:
        log.info("metrics: stopped (metrics.enabled: false)")
    return server, new
