"""A config's ``auto`` values made numbers for this node: ``resolve(cfg, host)``, pure.

``workers.count: auto`` and ``buffer.max_bytes: auto`` (the defaults) become the numbers
``core.limits`` chooses for the ``Host`` that ``core.hostread`` read; explicit numbers are kept as
they are (an explicit number wins). ``buffer.capacity: auto`` starts where ``auto_capacity`` puts it
before anything is measured; the daemon's ``daemon.autosize`` then follows the consumption. ``Sizing.why`` holds one sentence per value saying where it
came from, which the daemon logs and puts in ``status``, and ``check`` prints with the limits and
a warning for each explicit number beyond them. The daemon resolves at start and at each reload.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from prefetchd.core.augment.viewspec import shapes as view_shapes
from prefetchd.core.config import Config
from prefetchd.core.limits import (
    Host,
    auto_capacity,
    auto_max_bytes,
    auto_workers,
    fmt_bytes,
    over_limits,
)
from prefetchd.format.batchfile import views_file_size


@dataclass(frozen=True)
class Sizing:
    cfg: Config  # workers.count and buffer.max_bytes are numbers
    why: dict[str, str] = field(default_factory=dict)  # "workers", "max_bytes" -> one sentence
    warnings: tuple[str, ...] = ()  # explicit numbers beyond the node's limits


def resolve(cfg: Config, host: Host) -> Sizing:
    W, B = cfg.workers, cfg.buffer
    why: dict[str, str] = {}
    if W.count == "auto":
        n, why["workers"] = auto_workers(host, W.reserve_cores)
        W = replace(W, count=n)
    else:
        why["workers"] = f"{W.count} worker{'s' if W.count != 1 else ''}: workers.count in the config"
    if B.max_bytes == "auto":
        n, why["max_bytes"] = auto_max_bytes(host, B.min_free_bytes)
        B = replace(B, max_bytes=n)
    else:
        why["max_bytes"] = f"max_bytes {fmt_bytes(B.max_bytes)}: buffer.max_bytes in the config"
    if B.capacity == "auto":
        s = cfg.augment.output_size  # a batch of several views holds each of them (a user transform's views are
        shapes = view_shapes(cfg.augment.views) if cfg.augment.views else ((s, s),)  # learned later: autosize)
        n, why["capacity"] = auto_capacity(B.max_bytes, views_file_size(cfg.loader.batch_size, shapes),
                                           len(cfg.loader.ranks), B.lead_s, None, B.refill_at)
        B = replace(B, capacity=n)
    warnings = over_limits(host, None if cfg.workers.count == "auto" else int(cfg.workers.count),
                           None if cfg.buffer.max_bytes == "auto" else int(cfg.buffer.max_bytes))
    return Sizing(replace(cfg, workers=W, buffer=B), why, tuple(warnings))


def read_and_resolve(cfg: Config) -> Sizing:
    """``resolve`` for this process's node (reads the cgroup files, the affinity and the buffer's filesystem)."""
    from prefetchd.core.hostread import read_host

    return resolve(cfg, read_host(cfg.buffer.dir))
