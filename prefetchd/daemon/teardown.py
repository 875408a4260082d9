"""Stopping the daemon: what its set-up started is stopped step by step, each step that fails is
logged and the others still run, and the buffer's lock is released last, always. The parts are the
Daemon's public attributes (``watcher``, ``pool``, ``lock``, ... each None until set-up makes it)."""

from __future__ import annotations

import logging

from prefetchd.format import status

log = logging.getLogger("prefetchd")


def close_early(d) -> None:
    """The daemon ``d``'s set-up failed: stop what it started; the lock goes last, whatever happens."""
    try:
        for part, obj in (("watcher", d.watcher), ("metrics", d.metrics), ("remote", d.remote), ("pool", d.pool)):
            if obj is not None:  # None: set-up failed before making it
                _quietly(obj.stop, part)
    finally:
        if d.lock is not None:
            d.lock.release()

def teardown(d) -> None:
    """Workers stopped, temp files removed, published batches kept for the next start. A step
    that fails is logged and the others still run; the lock is released last, always."""
    try:
        if d.notify:
            _quietly(d.notify.stopping, "notify")
        _quietly(d.watcher.stop, "progress watcher")
        if d.metrics is not None:
            _quietly(d.metrics.stop, "metrics server")
        if d.remote is not None:
            _quietly(d.remote.stop, "ray")
        _quietly(d.pool.stop, "workers")
        removed = _quietly(d.ring.remove_temp_files, "temp files")
        if removed:
            log.info("removed %d temp files of unfinished batches", removed)

        def final_status():
            rec = d.status_record()
            rec["state"] = "stopped"
            status.write_json(d.cfg.buffer.dir, status.STATUS_NAME, rec)

        _quietly(final_status, "the final status")
    finally:
        d.lock.release()


def _quietly(fn, what: str):
    try:
        return fn()
    except Exception as e:  # teardown goes on: the lock must be released whatever failed
        log.error("while stopping, %s: %s: %s", what, type(e).__name__, e)
        return None
