"""What every module of the client shares: its errors, ``BatchInfo``, its timing constants, and
torch imported at first use (``torch_or_none``, ``torch``).

The bottom of the client's imports: it imports nothing of the client, so the modules above it
(memory, normalize, reader, loader) make no cycle.
"""

from __future__ import annotations

import errno
import os
import threading
import weakref
from dataclasses import dataclass

import numpy as np

from prefetchd.core.configvalues import ConfigError as _ConfigError

_POLL_MIN_S = 0.0005
_POLL_MAX_S = 0.005
_QUEUE_POLL_S = 0.05  # how often a blocked reader or trainer looks at the stop flag / the other side
_JOIN_TIMEOUT_S = 10.0  # a stopped reader finishes its current file (milliseconds) and exits
_STATE_FORMAT = "prefetchd-loader"
_PROGRESS_RETRY_S = 0.1  # a progress write a full disk refused is tried again this often while waiting
# progress writes failing with these (a full disk, a hiccup) are tried again, not raised
_PASSING_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.ENOMEM, errno.EINTR, errno.EAGAIN})


CONFIG_ENV = "PREFETCHD_CONFIG"  # the config's path when none is given (``prefetchd launch`` sets it)


def config_from_env(config):
    """``config`` itself, or the path in ``$PREFETCHD_CONFIG`` when it is None."""
    if config is not None:
        return config
    path = os.environ.get(CONFIG_ENV)
    if not path:
        raise ConfigError("", f"no config given and ${CONFIG_ENV} is not set: pass the config's path, or run "
                            f"the trainer under `prefetchd launch --config FILE -- ...`, which sets it")
    return path


@dataclass(frozen=True)
class BatchInfo:
    """What the last batch yielded was: its place in the stream, its samples, and whether it was
    an echo (a repeat served instead of waiting, only with ``client.echo_factor`` > 1)."""

    rank: int
    epoch: int
    batch: int
    indices: np.ndarray  # dataset indices of the samples
    # per sample: the index a quarantined sample stood in for, else -1; its own index where the
    # client could decode it neither on the GPU nor on the CPU and zeros stand in (hybrid decode)
    replaced: np.ndarray
    echo: int = 0  # 0: first service; k: the k-th repeat
    # validation batches: per sample, True where it is padding (``validation.pad``: a repeat that
    # evens the ranks' passes out, as DistributedSampler's); ``~padding`` selects each sample once
    # across the ranks. None for train batches.
    padding: np.ndarray | None = None


class PrefetchError(RuntimeError):
    """The client cannot go on; the message says what it waited for or found."""


class PrefetchTimeout(PrefetchError, TimeoutError):
    """No batch arrived within the timeout."""


class ConfigError(PrefetchError, _ConfigError):
    """The config cannot serve this trainer: missing or unreadable, invalid, or at odds with the
    job (``WORLD_SIZE``, ``RANK``, ``split="val"`` without validation). A ``PrefetchError``, so
    ``except PrefetchError`` catches every error of the client, and still a ``ValueError`` (the
    config's own ``ConfigError``, whose ``key`` names the setting), as it was."""

    def __init__(self, key: str, message: str):
        _ConfigError.__init__(self, key, message)  # PrefetchError's RuntimeError would drop the key

    @classmethod
    def of(cls, e: _ConfigError) -> ConfigError:
        """The config's own error as the client's."""
        err = cls("", str(e))
        err.key = e.key
        return err


_NO_TORCH = []  # one failed import of torch is enough: not retried at each batch


def torch_or_none():
    """torch, imported at the first call that needs it (a second or more of CPU and hundreds of
    MB: a trainer that asks for numpy arrays never pays it); None where it is not installed."""
    if _NO_TORCH:
        return None
    try:
        import torch
    except ImportError:
        _NO_TORCH.append(True)
        return None
    return torch


class _LazyTorch:
    """``torch`` for the client's modules: imported at its first use, not with the client."""

    def __getattr__(self, name: str):
        import torch

        return getattr(torch, name)


torch = _LazyTorch()


class _Stopped(Exception):
    """The reader was told to stop (seek, close, a new iteration)."""


# The client of each lane (progress directory, lane) that moved it last in this process. A loader
# left behind (Ctrl-C in a notebook: the traceback keeps it and its suspended for alive) while a
# new one of the same rank reads must not report its position: its reader thread, still reading
# ahead, and its for's clean-up, when the garbage collector gets to it, would move the daemon's
# rank back to it, away from the batches the new loader waits for.
_OWNERS: dict[tuple[str, int], weakref.ref] = {}
_OWNERS_LOCK = threading.Lock()


_LANE_LOCKS: dict[tuple[str, int], threading.Lock] = {}


def _lane_lock(key: tuple[str, int]) -> threading.Lock:
    """Held from a client's look at who owns the lane to its progress write: else a left-behind
    loader's reader could see the lane still its own, and write after the new loader took it and
    wrote (each client's own lock does not order the two), moving the rank back."""
    with _OWNERS_LOCK:
        return _LANE_LOCKS.setdefault(key, threading.Lock())


def _take_lane(key: tuple[str, int], client) -> None:
    with _OWNERS_LOCK:
        _OWNERS[key] = weakref.ref(client)


def _owns_lane(key: tuple[str, int], client) -> bool:
    with _OWNERS_LOCK:
        ref = _OWNERS.get(key)
    owner = ref() if ref is not None else None
    return owner is None or owner is client
