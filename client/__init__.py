"""prefetchd_client: what the training loop imports to read prefetchd's batches.

    from prefetchd_client import PrefetchClient, normalize

    with PrefetchClient("/etc/prefetchd/train.yaml", device="cuda") as client:
        client.load_state_dict(checkpoint["loader"])          # resume exactly, if resuming
        for epoch in range(client.epoch, epochs):
            for images, labels in client.iter_epoch(epoch):   # uint8 [B,3,H,W], int64 [B]
                x = normalize(images)                         # float on the device
                ...
                checkpoint["loader"] = client.state_dict()
"""

from __future__ import annotations

from typing import Any

from .client import BatchInfo, PrefetchClient, PrefetchError, PrefetchTimeout

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

__all__ = ["BatchInfo", "PrefetchClient", "PrefetchError", "PrefetchTimeout", "normalize", "IMAGENET_MEAN", "IMAGENET_STD"]


def normalize(images: Any, mean=IMAGENET_MEAN, std=IMAGENET_STD, dtype: Any = None) -> Any:
    """uint8 [B, 3, H, W] -> floating (x / 255 - mean) / std, on the images' own device.

    For torch tensors the work runs where the tensor is (do it on the GPU); ``dtype`` defaults to
    float32 (torch.float16/bfloat16 halve the memory). numpy arrays give float32 arrays.
    """
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and isinstance(images, torch.Tensor):
        dtype = dtype or torch.float32
        m = torch.tensor(mean, device=images.device, dtype=dtype).view(1, -1, 1, 1) * 255
        s = torch.tensor(std, device=images.device, dtype=dtype).view(1, -1, 1, 1) * 255
        return (images.to(dtype) - m) / s
    import numpy as np

    m = np.asarray(mean, dtype=np.float32).reshape(1, -1, 1, 1) * 255
    s = np.asarray(std, dtype=np.float32).reshape(1, -1, 1, 1) * 255
    return (np.asarray(images, dtype=dtype or np.float32) - m) / s
