"""Batch builders: what a worker fills, one sample at a time, and writes as one batch file.

Two kinds behind one interface, so the worker never asks which it holds:

* ``reset(images)``: start a batch; ``images`` (uint8 ``[n, S, S, 3]``) is the worker's reused
  array, slot ``k`` for sample ``k``;
* ``add(data, draws, out)``: make one sample from its file's bytes into slot ``out`` (or record
  it for the GPU); raises ``augment.SampleError`` for a file that cannot be used (the worker
  quarantines it and asks for a replacement);
* ``fit(budget)``: keep the file within ``budget`` bytes (0: no bound);
* ``encode(meta, used, labels, replaced)``: the file as buffers to write in order;
  ``write(fd, ...)`` writes them, ``pack(...)`` joins them (what a Ray actor sends back).

``PixelBuilder`` makes every sample on the CPU (``augment.make_sample``) and writes a pixel batch
(``prefetchd.format.batchfile``). ``CompactBuilder`` makes the batches ``hybrid.on_gpu`` gives the
trainer's GPU: a JPEG the GPU takes is stored as its bytes with its crop, flip and jitter
parameters, anything else as finished pixels, in a compact batch (``prefetchd.format.jpegbatch``).
"""

from __future__ import annotations

import numpy as np

from prefetchd.core import hybrid
from prefetchd.core.augment import modes as augment
from prefetchd.core.config import AugmentConfig
from prefetchd.format import batchfile, jpegbatch
from prefetchd.format.batchfile import BatchMeta


class Builder:
    """The interface (see the module docstring); writing and packing are shared."""

    def reset(self, images: np.ndarray) -> None:
        raise NotImplementedError

    def add(self, data: bytes, d: augment.Draws, out: np.ndarray) -> None:
        raise NotImplementedError

    def fit(self, budget: int) -> None:
        raise NotImplementedError

    def encode(self, meta: BatchMeta, used: np.ndarray, labels: np.ndarray, replaced: np.ndarray) -> list:
        raise NotImplementedError

    def write(self, fd: int, meta: BatchMeta, used: np.ndarray, labels: np.ndarray, replaced: np.ndarray) -> int:
        """Write the batch to ``fd`` (positioned at 0), reserving its space first. Returns its size."""
        return batchfile.write_file(fd, self.encode(meta, used, labels, replaced))

    def pack(self, meta: BatchMeta, used: np.ndarray, labels: np.ndarray, replaced: np.ndarray) -> bytes:
        """The whole file as bytes."""
        return b"".join(bytes(p) for p in self.encode(meta, used, labels, replaced))


class PixelBuilder(Builder):
    """Every sample decoded and augmented on the CPU into its slot: a pixel batch."""

    def __init__(self, cfg: AugmentConfig):
        self.cfg = cfg
        self._images: np.ndarray | None = None

    def reset(self, images) -> None:
        """``images``: the batch's array, or (several views) a tuple of one per view."""
        self._images = images

    def add(self, data: bytes, d: augment.Draws, out: np.ndarray) -> None:
        augment.make_sample(data, self.cfg, d, out)

    def fit(self, budget: int) -> None:
        """A pixel batch's size is fixed by its shape: nothing to fit."""

    def encode(self, meta: BatchMeta, used: np.ndarray, labels: np.ndarray, replaced: np.ndarray) -> list:
        if self._images is None:
            raise RuntimeError("reset() first")
        if isinstance(self._images, tuple):  # several views: one image section each
            return batchfile.encode(meta, used, labels, replaced, tuple(np.ascontiguousarray(v) for v in self._images))
        return batchfile.encode(meta, used, labels, replaced, np.ascontiguousarray(self._images))


class Packed(Builder):
    """A batch file already encoded elsewhere (a Ray actor's ``pack``), written as it is."""

    def __init__(self, data: bytes):
        self.data = data

    def encode(self, meta: BatchMeta, used: np.ndarray, labels: np.ndarray, replaced: np.ndarray) -> list:
        return [self.data]


def compact_bound(sample_size, indices, output_size: int) -> int:
    """An upper bound on the compact batch of the samples ``indices`` (``sample_size(i)``: a
    sample's size in bytes, 0 if unreadable: ``Index.sample_size``): header and tables plus, per
    sample, the larger of its bytes and a pixel sample. A quarantined sample's stand-in may be
    larger: ``CompactBuilder.fit`` keeps the batch within this bound by making its largest JPEGs
    pixels. One stat per sample of a folder, none for an archive's members."""
    pixel = output_size * output_size * 3
    bound = jpegbatch.HEADER_SIZE + (24 + jpegbatch.PARAM.itemsize) * len(indices)
    for i in indices:
        bound += max(pixel, sample_size(int(i)))  # unreadable (0): it will be replaced, and fit() keeps the bound
    return bound


class CompactBuilder(Builder):
    """Collects one batch's samples (GPU parameters and JPEG bytes, or finished CPU pixels) and
    writes the compact batch. One per worker; reused from batch to batch."""

    def __init__(self, cfg: AugmentConfig):
        self.cfg = cfg
        self._images: np.ndarray | None = None
        self._params = jpegbatch.empty_params(0)
        self._payloads: list = []
        self._draws: list = []
        self.cpu_reasons: dict[str, int] = {}  # why samples went to the CPU, for statistics

    def reset(self, images: np.ndarray) -> None:
        """Start a batch; ``images`` (uint8 [n, S, S, 3]) holds the CPU-made samples by slot."""
        n = len(images)
        self._images = images
        self._params = jpegbatch.empty_params(n)
        self._payloads = [None] * n
        self._draws = [None] * n

    def _slot(self, out: np.ndarray) -> int:
        base = self._images
        per = base[0].nbytes if len(base) else 1
        k, rest = divmod(out.ctypes.data - base.ctypes.data, per)
        if rest or not 0 <= k < len(base) or out.shape != base.shape[1:]:
            raise ValueError("out must be one slot images[k] of the array given to reset()")
        return k

    def add(self, data: bytes, d: augment.Draws, out: np.ndarray, k: int | None = None) -> int:
        """Make sample ``k`` (by default the slot ``out`` is) from ``data``: record a JPEG for the
        GPU, or make the pixels into ``out`` on the CPU. Returns the kind. Raises SampleError as
        ``augment.make_sample`` does (the caller quarantines and replaces as now)."""
        if self._images is None:
            raise RuntimeError("reset() first")
        k = self._slot(out) if k is None else k
        plan = hybrid.plan_sample(data, self.cfg, d)
        p = self._params[k]
        self._draws[k] = d
        if isinstance(plan, str):
            augment.make_sample(data, self.cfg, d, out)
            self.cpu_reasons[plan] = self.cpu_reasons.get(plan, 0) + 1
            s = self.cfg.output_size
            p["kind"], p["orientation"], p["reduce"], p["flip"], p["n_ops"] = jpegbatch.KIND_PIXELS, 1, 1, 0, 0
            p["ops"], p["factors"], p["lighting"] = jpegbatch.OP_NONE, 0.0, 0.0
            p["coded_width"], p["coded_height"], p["roi"] = s, s, (0, 0, s, s)
            self._payloads[k] = out
            return jpegbatch.KIND_PIXELS
        p["kind"], p["orientation"], p["flip"] = jpegbatch.KIND_JPEG, plan.orientation, int(plan.flip)
        p["reduce"] = plan.reduce
        p["coded_width"], p["coded_height"], p["roi"] = plan.coded_width, plan.coded_height, plan.roi
        p["n_ops"] = len(plan.ops)
        p["ops"], p["factors"] = jpegbatch.OP_NONE, 0.0
        for j, (op, f) in enumerate(plan.ops):
            p["ops"][j], p["factors"][j] = op, f
        p["lighting"] = plan.lighting
        self._payloads[k] = data
        return jpegbatch.KIND_JPEG

    def size(self) -> int:
        """The file the batch collected so far makes."""
        n = len(self._payloads)
        return jpegbatch.HEADER_SIZE + (24 + jpegbatch.PARAM.itemsize) * n + sum(
            memoryview(p).nbytes for p in self._payloads if p is not None)

    def fit(self, budget: int) -> None:
        """Make the largest JPEGs pixels on the CPU until the file fits ``budget`` (the daemon's
        bound, which reserves at least a pixel sample per slot, so this ends; 0: no bound)."""
        if budget <= 0:
            return
        size = self.size()
        while size > budget:
            jpegs = [k for k in range(len(self._payloads)) if self._params[k]["kind"] == jpegbatch.KIND_JPEG]
            if not jpegs:
                return
            k = max(jpegs, key=lambda k: len(self._payloads[k]))
            data, out = self._payloads[k], self._images[k]
            size -= len(data) - out.nbytes
            augment.make_sample(data, self.cfg, self._draws[k], out)
            p = self._params[k]
            s = self.cfg.output_size
            p["kind"], p["orientation"], p["reduce"], p["flip"], p["n_ops"] = jpegbatch.KIND_PIXELS, 1, 1, 0, 0
            p["ops"], p["factors"], p["lighting"] = jpegbatch.OP_NONE, 0.0, 0.0
            p["coded_width"], p["coded_height"], p["roi"] = s, s, (0, 0, s, s)
            self._payloads[k] = out
            self.cpu_reasons["batch over its size bound"] = self.cpu_reasons.get("batch over its size bound", 0) + 1

    def encode(self, meta: BatchMeta, used: np.ndarray, labels: np.ndarray, replaced: np.ndarray) -> list:
        """The compact batch file as buffers to write in order."""
        if any(p is None for p in self._payloads):
            raise RuntimeError("some samples of this batch were never added")
        return jpegbatch.encode(meta, used, labels, replaced, self._params, self._payloads, self.cfg.output_size,
                                self.cfg.output_size, self.cfg.interpolation, bool(self.cfg.lighting))
