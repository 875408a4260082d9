"""The device-side image operations of GPU decode, on torch tensors: orientation, crop and
resample (one sample at a time, ``resample``, the reference; a whole batch at once,
``resample_batch``: each step a pair of batched matrix products over the padded batch), colour
jitter and PCA lighting, each matching ``prefetchd.core.augment``'s arithmetic on the CPU. Used
by ``gpudecode.DecodeStage``; imports only numpy and torch.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from prefetchd.format import jpegbatch

_GREY = (9798, 19235, 3735)  # BT.601 in 15-bit fixed point: OpenCV RGB2GRAY on uint8, bit for bit


def _to_device(arr: np.ndarray, device) -> torch.Tensor:
    """A host array on ``device`` without blocking the host on the stream's earlier work (a
    pageable copy would wait for the decode queued before it): staged in a fresh pinned block,
    which torch's caching host allocator hands out again only once this copy is done, and copied
    with non_blocking. On the CPU: the array itself, as a tensor."""
    t = torch.from_numpy(np.ascontiguousarray(arr))
    if torch.device(device).type != "cuda":
        return t
    pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    pinned.copy_(t)
    return pinned.to(device, non_blocking=True)


# --- geometry ---------------------------------------------------------------------------------------


def coded_box(roi, orientation: int, w: int, h: int) -> tuple[int, int, int, int]:
    """The upright box ``roi`` (x0, y0, x1, y1) in the coordinates of the image as stored
    (``w`` x ``h``), for an EXIF ``orientation``: ``orient(img[coded box]) == orient(img)[roi]``."""
    x0, y0, x1, y1 = (int(v) for v in roi)
    return {
        1: (x0, y0, x1, y1),
        2: (w - x1, y0, w - x0, y1),
        3: (w - x1, h - y1, w - x0, h - y0),
        4: (x0, h - y1, x1, h - y0),
        5: (y0, x0, y1, x1),
        6: (y0, h - x1, y1, h - x0),
        7: (w - y1, h - x1, w - y0, h - x0),
        8: (w - y1, x0, w - y0, x1),
    }[int(orientation)]


def orient(img: torch.Tensor, orientation: int) -> torch.Tensor:
    """``[h, w, c]`` as stored -> upright, as ``PIL.ImageOps.exif_transpose`` turns it."""
    o = int(orientation)
    if o == 2:
        return img.flip(1)
    if o == 3:
        return img.flip(0, 1)
    if o == 4:
        return img.flip(0)
    if o == 5:
        return img.transpose(0, 1)
    if o == 6:
        return img.transpose(0, 1).flip(1)
    if o == 7:
        return img.transpose(0, 1).flip(0, 1)
    if o == 8:
        return img.transpose(0, 1).flip(0)
    return img


def _round_u8(x: torch.Tensor) -> torch.Tensor:
    return x.round().clamp_(0, 255)  # round half to even, as OpenCV's saturate_cast


def resample(x: torch.Tensor, hh: int, ww: int, interpolation: str) -> torch.Tensor:
    """float ``[1, 3, h, w]`` holding whole numbers -> ``[1, 3, hh, ww]``, rounded, as
    ``prefetchd.core.augment.modes._resample`` does it with OpenCV: one sample at a time, the reference
    that ``resample_batch`` computes for a batch at once (tests compare the two)."""
    if interpolation not in ("nearest", "area"):
        while x.shape[2] >= 2 * hh and x.shape[3] >= 2 * ww:
            h2, w2 = x.shape[2] // 2, x.shape[3] // 2
            if x.shape[2] % 2 == 0 and x.shape[3] % 2 == 0:
                x = F.avg_pool2d(x, 2)
            else:
                x = _area(x, h2, w2)
            x = _round_u8(x)
    if interpolation == "nearest":
        y = F.interpolate(x, size=(hh, ww), mode="nearest")
    elif interpolation == "area" and x.shape[2] >= hh and x.shape[3] >= ww:
        y = _area(x, hh, ww)
    elif interpolation == "area":  # enlarging: OpenCV's INTER_AREA is close to bilinear there
        y = F.interpolate(x, size=(hh, ww), mode="bilinear", align_corners=False)
    elif interpolation == "bilinear":
        y = F.interpolate(x, size=(hh, ww), mode="bilinear", align_corners=False)
    else:  # bicubic, and lanczos (which torch lacks)
        y = F.interpolate(x, size=(hh, ww), mode="bicubic", align_corners=False)
    return _round_u8(y)


def _area_weights(n_in: int, n_out: int, device) -> torch.Tensor:
    """[n_out, n_in]: output pixel i averages source [i*s, (i+1)*s), s = n_in/n_out, each source
    pixel weighted by how much of it the interval covers (OpenCV's INTER_AREA when shrinking;
    torch's "area" mode is adaptive pooling, which differs for ratios that are not whole)."""
    s = n_in / n_out
    lo = torch.arange(n_out, dtype=torch.float64, device=device)[:, None] * s
    j = torch.arange(n_in, dtype=torch.float64, device=device)[None, :]
    cover = (torch.minimum(j + 1, lo + s) - torch.maximum(j, lo)).clamp_(min=0)
    return (cover / s).float()


def _area(x: torch.Tensor, hh: int, ww: int) -> torch.Tensor:
    wy = _area_weights(x.shape[2], hh, x.device)
    wx = _area_weights(x.shape[3], ww, x.device)
    return torch.einsum("yh,bchw,xw->bcyx", wy, x, wx)


# --- the batch's geometry in a few launches ----------------------------------------------------------
#
# Every step of a sample's geometry acts on rows and columns separately: the r x r box reduction,
# each 2x area halving, the final filter, and the flips and transposes of EXIF orientation. So
# each step is ``round(A @ X @ B^T)`` with one matrix per axis, and a batch of samples of
# different sizes takes each step as two batched matrix products over the zero-padded batch
# (a sample with fewer halvings than another gets identity steps, which change no whole number).
# The matrices come from the sizes alone and are cached; the flips are folded into the first
# step's columns and the transposes into which axis is which.

_PAD_BUDGET_BYTES = 256 << 20  # float32 working set of one chunk of the padded batch
# per orientation: whether the output's rows come from the stored image's columns (a transpose),
# and whether the stored rows, and the stored columns, are read backwards
_ORIENT = {1: (False, False, False), 2: (False, False, True), 3: (False, True, True), 4: (False, True, False),
           5: (True, False, False), 6: (True, True, False), 7: (True, True, True), 8: (True, False, True)}


def _frozen(a: np.ndarray) -> np.ndarray:
    a = a.astype(np.float32)
    a.flags.writeable = False
    return a


@functools.lru_cache(maxsize=8192)
def _area_matrix(n_in: int, n_out: int) -> np.ndarray:
    """OpenCV's INTER_AREA when shrinking (as ``_area_weights``)."""
    s = n_in / n_out
    lo = np.arange(n_out, dtype=np.float64)[:, None] * s
    j = np.arange(n_in, dtype=np.float64)[None, :]
    return _frozen(np.clip(np.minimum(j + 1, lo + s) - np.maximum(j, lo), 0, None) / s)


@functools.lru_cache(maxsize=8192)
def _box_matrix(n_in: int, r: int) -> np.ndarray:
    """r-pixel box averages, a partial last box averaged over what it holds (avg_pool2d, ceil_mode)."""
    m = np.zeros((-(-n_in // r), n_in), dtype=np.float64)
    for i in range(m.shape[0]):
        lo, hi = i * r, min((i + 1) * r, n_in)
        m[i, lo:hi] = 1.0 / (hi - lo)
    return _frozen(m)


@functools.lru_cache(maxsize=8192)
def _filter_matrix(n_in: int, n_out: int, kind: str) -> np.ndarray:
    """``F.interpolate(..., align_corners=False)`` along one axis, as a matrix."""
    m = np.zeros((n_out, n_in), dtype=np.float64)
    dst = np.arange(n_out)
    scale = np.float32(n_in / n_out)
    f32 = dst.astype(np.float32)  # source positions in float32, as torch computes them
    if kind == "nearest":
        m[dst, np.minimum(np.floor(f32 * scale).astype(np.int64), n_in - 1)] = 1.0
    elif kind == "area":
        return _area_matrix(n_in, n_out)
    elif kind == "bilinear":
        src = np.maximum(scale * (f32 + np.float32(0.5)) - np.float32(0.5), np.float32(0))
        i0 = np.floor(src).astype(np.int64)
        i1 = np.minimum(i0 + 1, n_in - 1)
        t = src - i0.astype(np.float32)
        np.add.at(m, (dst, i0), np.float32(1) - t)
        np.add.at(m, (dst, i1), t)
    else:  # bicubic (torch's, A = -0.75), borders clamped
        src = scale * (f32 + np.float32(0.5)) - np.float32(0.5)
        i = np.floor(src).astype(np.int64)
        t = src - i.astype(np.float32)
        a = np.float32(-0.75)
        w = [((a * (t + 1) - 5 * a) * (t + 1) + 8 * a) * (t + 1) - 4 * a,
             ((a + 2) * t - (a + 3)) * t * t + 1,
             ((a + 2) * (1 - t) - (a + 3)) * (1 - t) * (1 - t) + 1,
             ((a * (2 - t) - 5 * a) * (2 - t) + 8 * a) * (2 - t) - 4 * a]
        for d in range(4):
            np.add.at(m, (dst, np.clip(i - 1 + d, 0, n_in - 1)), w[d])
    return _frozen(m)


def _eye(n: int) -> np.ndarray:
    return np.eye(n, dtype=np.float32)


def _plan(h: int, w: int, orientation: int, reduce: int, hh: int, ww: int, interpolation: str):
    """One sample's steps: (transposed, rows matrices, columns matrices), one pair per step, for
    a stored region of ``h`` x ``w``; the output of the last step is ``hh`` x ``ww`` upright
    (``ww`` x ``hh`` before its transpose when ``transposed``)."""
    transposed, rev_rows, rev_cols = _ORIENT[int(orientation)]
    rows, cols = [], []
    if reduce > 1:
        rows.append(_box_matrix(h, reduce))
        cols.append(_box_matrix(w, reduce))
        h, w = rows[-1].shape[0], cols[-1].shape[0]
    th, tw = (ww, hh) if transposed else (hh, ww)  # targets of the stored rows and columns
    if interpolation not in ("nearest", "area"):
        while h >= 2 * th and w >= 2 * tw:
            rows.append(_area_matrix(h, h // 2))
            cols.append(_area_matrix(w, w // 2))
            h, w = h // 2, w // 2
    if interpolation == "area" and not (h >= th and w >= tw):
        kind = "bilinear"  # enlarging: OpenCV's INTER_AREA is close to bilinear there
    else:
        kind = {"lanczos": "bicubic"}.get(interpolation, interpolation)
    rows.append(_filter_matrix(h, th, kind))
    cols.append(_filter_matrix(w, tw, kind))
    if rev_rows:
        rows[0] = rows[0][:, ::-1]
    if rev_cols:
        cols[0] = cols[0][:, ::-1]
    return transposed, rows, cols


def resample_batch(regions: Sequence[torch.Tensor | None], orientations, reductions, hh: int, ww: int,
                   interpolation: str, device) -> torch.Tensor:
    """The JPEG samples' crops, uint8 ``[m, 3, hh, ww]``: ``regions[j]`` is sample j's stored
    region (uint8 ``[h, w, 1 | 3]``, as decoded, before orientation; None: zeros stand in),
    reduced by ``reductions[j]`` (r x r boxes), turned upright by ``orientations[j]`` and
    resampled as ``resample`` does it for one sample, rounding after each step. Launches: one
    copy per sample into the padded batch, and a few per step for the batch (per chunk of about
    ``_PAD_BUDGET_BYTES``)."""
    m = len(regions)
    out = torch.zeros((m, 3, hh, ww), dtype=torch.uint8, device=device)
    plans = {}
    for j, x in enumerate(regions):
        if x is not None:
            plans[j] = _plan(int(x.shape[0]), int(x.shape[1]), int(orientations[j]), int(reductions[j]), hh, ww,
                             interpolation)
    for transposed in (False, True):
        group = sorted((j for j, pl in plans.items() if pl[0] == transposed),
                       key=lambda j: -regions[j].shape[0] * regions[j].shape[1])
        while group:  # largest first, so each chunk's padding is small
            chunk, hmax, wmax = [], 0, 0
            for j in group:
                h, w = max(hmax, regions[j].shape[0]), max(wmax, regions[j].shape[1])
                if chunk and (len(chunk) + 1) * 3 * h * w * 4 > _PAD_BUDGET_BYTES:
                    break
                chunk.append(j)
                hmax, wmax = h, w
            group = group[len(chunk):]
            y = _run_steps([regions[j] for j in chunk], [plans[j] for j in chunk], hmax, wmax, device)
            y = y.transpose(-1, -2) if transposed else y
            out[_to_device(np.asarray(chunk, dtype=np.int64), device)] = y.to(torch.uint8)
    return out


def _run_steps(regions: list, plans: list, hmax: int, wmax: int, device) -> torch.Tensor:
    g = len(regions)
    steps = max(len(pl[1]) for pl in plans)
    # every sample takes the same number of steps: identities before its last (filter) step
    rows = [pl[1][:-1] + [_eye(pl[1][-1].shape[1])] * (steps - len(pl[1])) + pl[1][-1:] for pl in plans]
    cols = [pl[2][:-1] + [_eye(pl[2][-1].shape[1])] * (steps - len(pl[2])) + pl[2][-1:] for pl in plans]
    shapes = []  # per step: (rows out, rows in, cols out, cols in), the largest over the chunk
    for s in range(steps):
        shapes.append((max(r[s].shape[0] for r in rows), max(r[s].shape[1] for r in rows),
                       max(c[s].shape[0] for c in cols), max(c[s].shape[1] for c in cols)))
    sizes = [g * (ro * ri + co * ci) for ro, ri, co, ci in shapes]
    host = np.zeros(sum(sizes), dtype=np.float32)  # all matrices, padded, in one copy to the device
    at = 0
    for s, (ro, ri, co, ci) in enumerate(shapes):
        a = host[at: at + g * ro * ri].reshape(g, ro, ri)
        bt = host[at + g * ro * ri: at + sizes[s]].reshape(g, co, ci)
        for i in range(g):
            r, c = rows[i][s], cols[i][s]
            a[i, :r.shape[0], :r.shape[1]] = r
            bt[i, :c.shape[0], :c.shape[1]] = c
        at += sizes[s]
    mats = _to_device(host, device)
    x = torch.zeros((g, hmax, wmax, 3), dtype=torch.uint8, device=device)
    for i, reg in enumerate(regions):
        x[i, :reg.shape[0], :reg.shape[1]].copy_(reg)  # a grey region fills all three channels
    x = x.permute(0, 3, 1, 2).float()
    at = 0
    for s, (ro, ri, co, ci) in enumerate(shapes):
        a = mats[at: at + g * ro * ri].view(g, 1, ro, ri)
        bt = mats[at + g * ro * ri: at + sizes[s]].view(g, 1, co, ci)
        x = torch.matmul(torch.matmul(a, x[:, :, :ri, :ci]), bt.transpose(-1, -2))
        x = x.round_().clamp_(0, 255)  # round half to even, as OpenCV's saturate_cast
        at += sizes[s]
    return x


# --- colour -------------------------------------------------------------------------------------------


def grey(x: torch.Tensor) -> torch.Tensor:
    """uint8 ``[n, 3, h, w]`` -> int32 ``[n, h, w]``, BT.601 as OpenCV rounds it on uint8."""
    r, g, b = x.to(torch.int32).unbind(1)
    return (r * _GREY[0] + g * _GREY[1] + b * _GREY[2] + (1 << 14)) >> 15


def _lut(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Per-sample lookup: ``x`` uint8 [m, ...], ``table`` float64 [m, 256] (rounded, clipped here)."""
    t = table.round().clamp(0, 255).to(torch.uint8)
    m = x.shape[0]
    return torch.gather(t, 1, x.reshape(m, -1).long()).reshape(x.shape)


def apply_jitter(x: torch.Tensor, n_ops: np.ndarray, ops: np.ndarray, factors: np.ndarray) -> torch.Tensor:
    """Colour jitter of uint8 ``[m, 3, h, w]``: each sample's ops in its own order (brightness and
    contrast as lookup tables, saturation as a blend with the pixel's grey, as the CPU path)."""
    if not len(n_ops) or int(n_ops.max()) == 0:
        return x
    dev = x.device
    ramp = torch.arange(256, dtype=torch.float64, device=dev)[None, :]
    for j in range(int(n_ops.max())):
        op = np.where(j < n_ops, ops[:, j], jpegbatch.OP_NONE)
        f = _to_device(np.ascontiguousarray(factors[:, j], dtype=np.float64), dev)[:, None]
        op_t = _to_device(op.astype(np.int64), dev)
        gr = grey(x)
        mean = gr.to(torch.float64).mean(dim=(1, 2))[:, None]
        contrast = (op_t == 1)[:, None]
        table = torch.where(contrast, ramp * f + mean * (1 - f), ramp * f)
        looked = _lut(x, table)
        f32 = f.to(torch.float32)[:, :, None, None]
        blend = _round_u8(x.float() * f32 + gr[:, None].float() * (1 - f32)).to(torch.uint8)
        sel = op_t[:, None, None, None]
        x = torch.where((sel == 0) | (sel == 1), looked, torch.where(sel == 2, blend, x))
    return x


def apply_lighting(x: torch.Tensor, offsets: np.ndarray) -> torch.Tensor:
    """PCA lighting of uint8 ``[m, 3, h, w]``: per channel ``clip(rint(v + offset))``."""
    dev = x.device
    m = x.shape[0]
    ramp = torch.arange(256, dtype=torch.float64, device=dev)
    off = _to_device(np.ascontiguousarray(offsets, dtype=np.float64), dev)  # [m, 3]
    table = (ramp[None, None, :] + off[:, :, None]).reshape(m * 3, 256)
    return _lut(x.reshape(m * 3, *x.shape[2:]), table).reshape(x.shape)
