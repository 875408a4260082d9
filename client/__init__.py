"""prefetchd_client: what the training loop imports to read prefetchd's batches.

    from prefetchd_client import PrefetchClient

    loader = PrefetchClient("/etc/prefetchd/train.yaml", device="cuda", normalize=True)
    loader.load_state_dict(checkpoint["loader"])          # resume exactly, if resuming
    for epoch in range(loader.epoch, epochs):
        loader.set_epoch(epoch)
        for images, labels in loader:                     # one epoch: float [B,3,H,W], int64 [B]
            ...
            checkpoint["loader"] = loader.state_dict()

Modules by role: ``loader`` (``PrefetchClient``, the public loader), ``reader`` (the reader thread
and batch files), ``memory`` (pinned buffers and device copies), ``normalize``, ``gpudecode``
(compact batches decoded on the GPU), ``clock`` (waiting time, less the process's own stops),
``child`` (``serve()``: the daemon as a child process for a ``with`` block), ``shapes`` (the
DataLoader-shaped ``dataset``, ``sampler``, ``batch_sampler``), ``lifetime`` (``close()`` and what
the daemon is told of a finished or waiting trainer), ``jobenv`` (rank and world size from
torchrun's or Slurm's environment), ``common`` (errors, ``BatchInfo``, constants; imports nothing
of the client).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from .child import DaemonStartError, serve
from .common import BatchInfo, ConfigError, PrefetchError, PrefetchTimeout
from .normalize import IMAGENET_MEAN, IMAGENET_STD, _normalize_numpy, _normalize_torch

# Imported at first use (`prefetchd launch` and `serve()`, this package's ``child``, need neither);
# torch itself is imported only where a batch needs it (common.torch_or_none).
_LAZY = {"PrefetchClient": ".loader", "CudaTransfer": ".memory"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

__all__ = ["BatchInfo", "ConfigError", "CudaTransfer", "DaemonStartError", "PrefetchClient", "PrefetchError", "PrefetchTimeout",
           "normalize", "serve",
           "IMAGENET_MEAN", "IMAGENET_STD"]


def normalize(images: Any, mean=IMAGENET_MEAN, std=IMAGENET_STD, dtype: Any = None) -> Any:
    """uint8 [B, 3, H, W] -> floating (x / 255 - mean) / std, on the images' own device.

    For torch tensors the work runs where the tensor is (do it on the GPU), with no host sync: the
    constants are made once per device, dtype and stream, on the device. ``dtype`` defaults to
    float32 (torch.float16/bfloat16 halve the memory; they are computed in float32 and rounded
    once). numpy arrays give float32 arrays (or ``dtype``). The memory layout (channels-last) is kept.
    ``mean`` and ``std`` are in units of x / 255 (0..1): 0..255 ones (mmcv's 123.675) are refused.
    """
    if mean is not IMAGENET_MEAN or std is not IMAGENET_STD:  # checked as PrefetchClient checks them
        from .shapes import normalize_constants

        mean, std = normalize_constants(True, mean, std)
    # a tensor means torch is loaded: a numpy trainer's call imports none (seconds, hundreds of MB)
    tensor = getattr(sys.modules.get("torch"), "Tensor", None)
    if tensor is not None and isinstance(images, tensor):
        return _normalize_torch(images, dtype, mean, std)
    return _normalize_numpy(images, dtype, mean, std)
