"""The client's decode stage for compact batches (``augment.decode: hybrid | gpu``).

``DecodeStage(device)`` turns a parsed ``prefetchd.format.jpegbatch.JpegBatch`` into the uint8
``[B, 3, H, W]`` channels-last tensor the CPU path yields: JPEG payloads are decoded on the device
in one batched call (nvImageCodec, which uses the GPU's hardware JPEG engines where it can), then
each is turned upright (EXIF orientation), cropped, resampled (2x area halving while the region is
at least twice the output, then the configured filter, as ``prefetchd.core.augment`` does), and the
batch is jittered, lit and flipped with the parameters the daemon drew. PIXELS payloads (files
the daemon decoded on its CPU) are copied in unchanged. Crops, flips, jitter parameters and labels
equal the CPU path's; the pixels differ slightly (the IDCT, the resampling arithmetic, and lanczos,
which torch lacks and is done as bicubic).

The decoder is injectable: anything called as ``decoder(jpegs)`` with a list of uint8 numpy arrays
(the JPEG files) that returns, per file, a uint8 tensor ``[h, w, 3]`` (RGB, as stored: no EXIF
orientation applied) on the stage's device, or None where it failed. Tests use a CPU decoder on
``device="cpu"``; the default needs ``pip install 'prefetchd[gpu]'`` and CUDA.

Imports only numpy, torch and the shared format module (nvImageCodec lazily, when the default
decoder is made).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from prefetchd.format import jpegbatch

_log = logging.getLogger(__name__)

GPU_EXTRA_HINT = "install the GPU extra: pip install 'prefetchd[gpu]' (nvImageCodec; see README, Hybrid decode)"
_GREY = (9798, 19235, 3735)  # BT.601 in 15-bit fixed point: OpenCV RGB2GRAY on uint8, bit for bit


class DecodeUnavailable(RuntimeError):
    """The default GPU decoder cannot run here; the message says what to install or change."""


class DecodeError(RuntimeError):
    """A JPEG of a compact batch could not be decoded on the device (the stage then decodes it
    on the CPU, and failing that puts a stand-in in its place: it never ends the iteration)."""


Decoder = Callable[[Sequence[np.ndarray]], Sequence["torch.Tensor | None"]]


class NvImageCodecDecoder:
    """Batched JPEG decoding with nvImageCodec on one CUDA device, on the current CUDA stream.

    Made at start-up: raises DecodeUnavailable (naming the extra) where nvImageCodec is missing
    or the device is not a CUDA device. nvImageCodec picks the hardware JPEG engines where the GPU
    has them and the file allows, and its CUDA decoder otherwise."""

    def __init__(self, device):
        self.device = torch.device(device)
        if self.device.type != "cuda" or not torch.cuda.is_available():
            raise DecodeUnavailable(f"augment.decode: hybrid | gpu needs a CUDA device, got {str(device)!r} "
                                    f"(torch.cuda.is_available() is {torch.cuda.is_available()}); "
                                    f"{GPU_EXTRA_HINT}, on a machine with CUDA, or set augment.decode: cpu")
        try:
            from nvidia import nvimgcodec
        except ImportError as e:
            raise DecodeUnavailable(f"nvImageCodec is not installed ({e}); {GPU_EXTRA_HINT}") from None
        self._nv = nvimgcodec
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self._decoder = nvimgcodec.Decoder(device_id=index)
        self._params = nvimgcodec.DecodeParams(apply_exif_orientation=False, color_spec=nvimgcodec.ColorSpec.RGB,
                                               allow_any_depth=False)

    def __call__(self, jpegs: Sequence[np.ndarray]) -> list:
        if not jpegs:
            return []
        stream = torch.cuda.current_stream(self.device)
        images = self._decoder.decode([np.asarray(j) for j in jpegs], params=self._params,
                                      cuda_stream=stream.cuda_stream)
        # the images live in nvImageCodec's buffers: torch.as_tensor wraps them (CUDA array
        # interface), and the crop that follows copies what it needs
        return [None if im is None else torch.as_tensor(im, device=self.device) for im in images]


class DecodeStage:
    """Decodes compact batches on ``device``; ``decoder`` defaults to nvImageCodec (CUDA only)."""

    def __init__(self, device="cuda", decoder: Decoder | None = None):
        self.device = torch.device(device)
        self.decoder = decoder if decoder is not None else NvImageCodecDecoder(self.device)

    def __call__(self, b: jpegbatch.JpegBatch, source: torch.Tensor | None = None,
                 replaced: np.ndarray | None = None, transfer=None) -> torch.Tensor:
        """The batch's images, uint8 ``[n, 3, H, W]`` with channels-last strides, on the device.

        ``source``, if given, is a uint8 tensor over the same memory ``b`` was parsed from (e.g.
        the client's pinned buffer): PIXELS payloads are copied from views of it, asynchronously
        when it is pinned, through ``transfer.copy_(dst, src)`` when a transfer is given.

        A JPEG the decoder fails on (None, or the wrong shape) is decoded on the CPU (simplejpeg)
        instead; if that fails too, zeros stand in for it and ``replaced[k]`` (when given) is set
        to its dataset index. Either way one warning names the sample: a corrupt image never ends
        training."""
        n, hh, ww = len(b), b.height, b.width
        out = torch.empty((n, hh, ww, 3), dtype=torch.uint8, device=self.device)
        kinds = b.params["kind"]
        for k in np.flatnonzero(kinds == jpegbatch.KIND_PIXELS):
            p = b.params[k]
            if source is not None:
                src = source[int(p["offset"]): int(p["offset"]) + int(p["nbytes"])].view(hh, ww, 3)
            else:
                with warnings.catch_warnings():  # a read-only buffer: torch only reads it here
                    warnings.simplefilter("ignore", UserWarning)
                    src = torch.from_numpy(b.payload(k))
            if transfer is not None:
                transfer.copy_(out[k], src)
            else:
                out[k].copy_(src, non_blocking=True)
        jk = np.flatnonzero(kinds == jpegbatch.KIND_JPEG)
        if len(jk):
            decoded = self.decoder([b.payload(k) for k in jk])
            crops = torch.empty((len(jk), 3, hh, ww), dtype=torch.uint8, device=self.device)
            for j, k in enumerate(jk):
                crops[j] = self._crop_one(decoded[j], b, int(k), replaced)
            p = b.params[jk]
            crops = apply_jitter(crops, p["n_ops"], p["ops"], p["factors"])
            if b.lighting:
                crops = apply_lighting(crops, p["lighting"])
            flip = _to_device(p["flip"].astype(bool), self.device)
            crops = torch.where(flip[:, None, None, None], crops.flip(-1), crops)
            out[_to_device(jk, self.device)] = crops.permute(0, 2, 3, 1)
        return out.permute(0, 3, 1, 2)

    def _crop_one(self, img, b: jpegbatch.JpegBatch, k: int, replaced: np.ndarray | None) -> torch.Tensor:
        p, index, hh, ww = b.params[k], int(b.indices[k]), b.height, b.width
        try:
            return _crop_resample(img, p, index, hh, ww, b.interpolation)
        except DecodeError as e:
            first = e
        try:
            img = _cpu_decode(b.payload(k), self.device)
            x = _crop_resample(img, p, index, hh, ww, b.interpolation)
            _log.warning("%s; decoded it on the CPU instead", first)
            return x
        except Exception as e:  # a corrupt image must not stop training: zeros stand in for it
            _log.warning("%s; the CPU decode failed too (%s): zeros stand in for it (replaced)", first, e)
        if replaced is not None:
            replaced[k] = index
        return torch.zeros((3, hh, ww), dtype=torch.uint8, device=self.device)


def _cpu_decode(jpeg: np.ndarray, device) -> torch.Tensor:
    """The fallback for one file: RGB as stored (no EXIF orientation), as the GPU decoder gives it."""
    import simplejpeg  # a core dependency of prefetchd; only needed here, on a failure

    return _to_device(simplejpeg.decode_jpeg(bytes(jpeg), colorspace="RGB"), device)


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
    ``prefetchd.core.augment._resample`` does it with OpenCV."""
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


def _crop_resample(img, p, index: int, hh: int, ww: int, interpolation: str) -> torch.Tensor:
    cw, ch = int(p["coded_width"]), int(p["coded_height"])
    if img is None:
        raise DecodeError(f"the GPU decoder could not decode dataset sample {index} "
                          f"({cw}x{ch} baseline JPEG); the daemon's checks let it through")
    if img.ndim == 2:
        img = img[:, :, None]
    if img.shape[0] != ch or img.shape[1] != cw or img.shape[2] not in (1, 3):
        raise DecodeError(f"dataset sample {index} decoded to {tuple(img.shape)}, its header says {ch}x{cw}x3")
    r = int(p["reduce"])
    if r > 1:  # orientation 1 (checked at parse): crop whole r x r blocks, then box-reduce them
        x0, y0, x1, y1 = (int(v) for v in p["roi"])
        region = img[y0 * r: min(y1 * r, ch), x0 * r: min(x1 * r, cw)]
        x = _as_rgb(region).permute(2, 0, 1).unsqueeze(0).float()
        x = _round_u8(F.avg_pool2d(x, r, ceil_mode=True))
    else:
        x0, y0, x1, y1 = coded_box(p["roi"], int(p["orientation"]), cw, ch)
        region = orient(img[y0:y1, x0:x1], int(p["orientation"]))
        x = _as_rgb(region).permute(2, 0, 1).unsqueeze(0).float()
    return resample(x, hh, ww, interpolation)[0].to(torch.uint8)


def _as_rgb(region: torch.Tensor) -> torch.Tensor:
    return region.expand(-1, -1, 3) if region.shape[2] == 1 else region


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
