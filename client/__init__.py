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
``common`` (errors, ``BatchInfo``, constants; imports nothing of the client).
"""

from __future__ import annotations

from typing import Any

from .common import BatchInfo, PrefetchError, PrefetchTimeout
from .loader import PrefetchClient
from .memory import CudaTransfer
from .normalize import IMAGENET_MEAN, IMAGENET_STD, _normalize_numpy, _normalize_torch

__all__ = ["BatchInfo", "CudaTransfer", "PrefetchClient", "PrefetchError", "PrefetchTimeout", "normalize",
           "IMAGENET_MEAN", "IMAGENET_STD"]


def normalize(images: Any, mean=IMAGENET_MEAN, std=IMAGENET_STD, dtype: Any = None) -> Any:
    """uint8 [B, 3, H, W] -> floating (x / 255 - mean) / std, on the images' own device.

    For torch tensors the work runs where the tensor is (do it on the GPU), with no host sync: the
    constants are made once per device, dtype and stream, on the device. ``dtype`` defaults to
    float32 (torch.float16/bfloat16 halve the memory; they are computed in float32 and rounded
    once). numpy arrays give float32 arrays (or ``dtype``). The memory layout (channels-last) is kept.
    """
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and isinstance(images, torch.Tensor):
        return _normalize_torch(images, dtype, mean, std)
    return _normalize_numpy(images, dtype, mean, std)
