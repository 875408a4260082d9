"""Normalisation, ``(x / 255 - mean) / std``: on the images' own device without a host sync
(torch), or in numpy."""

from __future__ import annotations

import numpy as np

# torch is imported where a tensor is normalised (it is loaded by then): importing this module,
# and so the package, costs no torch import (prefetchd launch imports the package's ``child``)

_CONSTANTS: dict = {}


def _constants(mean, std, device, dtype):
    """(scale, shift) with x * scale + shift == (x / 255 - mean) / std, made once per device,
    dtype and stream without a host-to-device copy (a pageable copy would sync the host)."""
    import torch

    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    key = (tuple(mean), tuple(std), device, dtype, stream)
    c = _CONSTANTS.get(key)
    if c is None:
        scale = torch.empty(len(mean), device=device, dtype=dtype)
        shift = torch.empty(len(mean), device=device, dtype=dtype)
        for i, (m, s) in enumerate(zip(mean, std, strict=True)):
            scale[i].fill_(1.0 / (255.0 * s))  # a fill kernel with a host scalar: no copy, no sync
            shift[i].fill_(-m / s)
        c = _CONSTANTS[key] = (scale.view(1, -1, 1, 1), shift.view(1, -1, 1, 1))
    return c


IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def _normalize_torch(images, dtype=None, mean=IMAGENET_MEAN, std=IMAGENET_STD):
    import torch

    dtype = dtype or torch.float32
    # low-precision outputs are computed in float32 and rounded once
    work = dtype if dtype in (torch.float32, torch.float64) else torch.float32
    scale, shift = _constants(mean, std, images.device, work)
    out = torch.addcmul(shift, images.to(work), scale)
    return out if work == dtype else out.to(dtype)


def _normalize_numpy(images, dtype=np.float32, mean=IMAGENET_MEAN, std=IMAGENET_STD):
    scale = (1.0 / (255.0 * np.asarray(std, dtype=np.float32))).reshape(1, -1, 1, 1)
    shift = (-np.asarray(mean, dtype=np.float32) / np.asarray(std, dtype=np.float32)).reshape(1, -1, 1, 1)
    return (np.asarray(images, dtype=np.float32) * scale + shift).astype(dtype or np.float32, copy=False)
