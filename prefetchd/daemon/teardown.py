"""Stopping the daemon: what its set-up started is stopped step by step, each step that fails is
logged and the others still run, and the buffer's lock is released last, always. The parts are the
Daemon's public attributes (``watcher``, ``pool``, ``lock``, ... each None until set-up makes it)."""

from __future__ import annotations

import logging
import shlex

from prefetchd.core.config import format_size
from prefetchd.format import procstate, status

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
        if line := _quietly(lambda: left_behind(len(d.ring.ready), d.ring.bytes_used, d.cfg.buffer.dir, d.cfg.source,
                                                _made_by_a_live_start(d.cfg.buffer.dir)), "what is left"):
            log.info("%s", line)
    finally:
        d.lock.release()


def _made_by_a_live_start(buffer_dir: str) -> bool:
    """A ``launch`` or ``serve()`` that runs made the buffer directory (``status.CREATED_NAME``) and
    removes it when it ends; one killed outright leaves it to the next start, or to ``clean``."""
    return procstate.exists((status.read_json(buffer_dir, status.CREATED_NAME) or {}).get("pid"))


def left_behind(batches: int, nbytes: int, buffer_dir: str, config: str | None, created: bool) -> str | None:
    """The stop's line on the batches it leaves in ``buffer_dir`` (RAM, on a tmpfs) and how to free
    them; ``created``: a ``launch`` or ``serve()`` made the directory and removes it."""
    if not batches:
        return None
    what = f"stopped; left {batches} batch{'es' if batches != 1 else ''} ({format_size(nbytes)}) in {buffer_dir}"
    if created:
        return f"{what}; the launch (or serve()) that made the directory removes it"
    clean = f"prefetchd clean --config {shlex.quote(config)}" if config else "prefetchd clean --config FILE"
    return (f"{what} for the next start of this config to reuse; to free that memory now: {clean} "
            f"(or rm -r {shlex.quote(buffer_dir)})")


def _quietly(fn, what: str):
    try:
        return fn()
    except Exception as e:  # teardown goes on: the lock must be released whatever failed
        log.error("while stopping, %s: %s: %s", what, type(e).__name__, e)
        return None
