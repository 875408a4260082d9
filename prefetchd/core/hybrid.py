"""Hybrid decode, the daemon's side: the cheap CPU part of a batch the trainer's GPU decodes. Pure.

For a batch that ``on_gpu`` assigns to the GPU, each sample is read as now and then:

* ``augment.probe`` opens its header (anything but a JPEG or PNG, or a decompression bomb, raises
  ``SampleError`` and is quarantined and replaced exactly as on the CPU path);
* ``scan_jpeg`` walks the JPEG's markers and ``hw_refusal`` says whether the GPU's hardware
  decoder takes it: baseline (SOF0), 8-bit, greyscale or YCbCr with 4:4:4, 4:2:2, 4:2:0 or 4:4:0
  sampling, complete (an EOI marker after the scan). Everything else (progressive, arithmetic,
  12-bit, CMYK/YCCK, RGB-coded, odd sampling, PNG whatever its name, truncated) is made by the
  CPU path (``augment.make_sample``) and stored as finished pixels, bit-identical to
  ``augment.decode: cpu``; a file the CPU path cannot decode is quarantined as now;
* for a JPEG the GPU takes, the crop comes from the same draws and the same functions as on the
  CPU path (``augment.crop_for`` on the upright size, the same DCT reduction factor, and
  ``augment.roi_box`` in the reduced image, where the client takes it), and so do the flip, the jitter order and factors (``augment.jitter_ops``) and the lighting
  (``augment.lighting_offset``): crops, flips and labels are those of the CPU path.

The result is written as a compact batch (``prefetchd.jpegbatch``). Which batches go to the GPU is
a pure function of the config and the batch number (``on_gpu``), never of timing.

The worker's side (``prefetchd.executors.builders.CompactBuilder``) collects a batch's samples
with these functions and writes the compact batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from prefetchd.core import augment
from prefetchd.core.config import AugmentConfig

_SOF_BASELINE = 0xC0
_SOF_MARKERS = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
_HW_LUMA_SAMPLING = {(1, 1), (2, 1), (2, 2), (1, 2)}  # 4:4:4, 4:2:2, 4:2:0, 4:4:0 with 1x1 chroma


def on_gpu(cfg: AugmentConfig, epoch: int, batch: int) -> bool:
    """Whether batch ``batch`` of ``epoch`` is a compact batch for the GPU.

    ``cpu``: never; ``gpu``: always; ``hybrid``: ``gpu_share`` of the batches, spread evenly by
    batch number (batch b goes to the GPU when floor((b+1)*share) > floor(b*share)), the same
    in every epoch and for every rank."""
    del epoch  # the same pattern every epoch: a resumed run and a fresh one agree trivially
    if cfg.decode == "cpu":
        return False
    if cfg.decode == "gpu":
        return True
    s = cfg.gpu_share
    return math.floor((batch + 1) * s) > math.floor(batch * s)


@dataclass(frozen=True)
class JpegInfo:
    """What the markers before the first scan say about a JPEG."""

    sof: int  # the frame marker's second byte (0xC0 baseline, 0xC2 progressive, ...)
    precision: int
    width: int
    height: int
    components: tuple[tuple[int, int, int], ...]  # (id, horizontal, vertical) sampling
    adobe_transform: int | None  # APP14 "Adobe" colour transform, None if absent
    scan_offset: int  # where the first SOS marker starts
    complete: bool  # an EOI marker follows the scan


def scan_jpeg(data: bytes) -> JpegInfo | None:
    """Walk a JPEG's marker segments up to the first scan; None where the structure is not that
    of a JPEG with a frame and a scan (such a file goes to the CPU path, which judges it)."""
    n = len(data)
    if n < 4 or data[0] != 0xFF or data[1] != 0xD8:
        return None
    pos, frame, adobe = 2, None, None
    while pos + 4 <= n:
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # standalone markers carry no length
            pos += 2
            continue
        if marker == 0xD9:
            return None  # EOI before any scan
        length = (data[pos + 2] << 8) | data[pos + 3]
        if length < 2 or pos + 2 + length > n:
            return None
        seg = data[pos + 4: pos + 2 + length]
        if marker in _SOF_MARKERS:
            if frame is not None or len(seg) < 6:
                return None
            nc = seg[5]
            if len(seg) < 6 + 3 * nc:
                return None
            comps = tuple((seg[6 + 3 * i], seg[7 + 3 * i] >> 4, seg[7 + 3 * i] & 15) for i in range(nc))
            frame = (marker, seg[0], (seg[3] << 8) | seg[4], (seg[1] << 8) | seg[2], comps)
        elif marker == 0xEE and seg[:5] == b"Adobe" and len(seg) >= 12:
            adobe = seg[11]
        elif marker == 0xDA:
            if frame is None:
                return None
            # entropy-coded data never holds FF D9 (FF is stuffed as FF 00): a truncated file
            # has no EOI after its scan, whatever else it carries before
            complete = data.rfind(b"\xff\xd9", pos + 2 + length) >= 0
            sof, precision, w, h, comps = frame
            return JpegInfo(sof, precision, w, h, comps, adobe, pos, complete)
        pos += 2 + length
    return None


def hw_refusal(info: JpegInfo | None) -> str | None:
    """Why the GPU's hardware JPEG decoder cannot take this file, or None if it can."""
    if info is None:
        return "not a well-formed JPEG"
    if info.sof != _SOF_BASELINE:
        return "progressive" if info.sof in (0xC2, 0xC6, 0xCA, 0xCE) else f"frame type SOF{info.sof - 0xC0}"
    if info.precision != 8:
        return f"{info.precision}-bit samples"
    if not info.complete:
        return "truncated (no EOI marker after the scan)"
    if info.width < 1 or info.height < 1:
        return "no frame size in the header"
    nc = len(info.components)
    if nc == 1:
        return None
    if nc != 3:
        return f"{nc} colour components (CMYK or YCCK)"
    if info.adobe_transform == 0 or tuple(c[0] for c in info.components) == (82, 71, 66):
        return "RGB-coded (Adobe transform 0 or components named R, G, B)"
    luma, cb, cr = ((h, v) for _, h, v in info.components)
    if cb != (1, 1) or cr != (1, 1) or luma not in _HW_LUMA_SAMPLING:
        return f"chroma sampling {[c[1:] for c in info.components]}"
    return None


@dataclass(frozen=True)
class GpuSample:
    """The parameters of one sample the GPU decodes (a PARAM record's fields)."""

    orientation: int
    reduce: int  # the CPU path's DCT reduction: the client box-reduces by it before cropping
    coded_width: int
    coded_height: int
    roi: tuple[int, int, int, int]
    flip: bool
    ops: tuple[tuple[int, float], ...]
    lighting: tuple[float, float, float]


def plan_sample(data: bytes, cfg: AugmentConfig, d: augment.Draws) -> GpuSample | str:
    """A GPU sample's parameters, or the reason it must be made on the CPU. Raises SampleError
    where the CPU path would (not a JPEG or PNG, a decompression bomb)."""
    im, orientation, w, h = augment.probe(data)
    if im.format != "JPEG":
        return f"{im.format} image"
    info = scan_jpeg(data)
    refusal = hw_refusal(info)
    if refusal is not None:
        return refusal
    if (info.width, info.height) != im.size:  # pragma: no cover - both read the same SOF
        return "frame size disagrees with Pillow's"
    crop = augment.crop_for(cfg, w, h, d)
    # the CPU path decodes an upright JPEG at a reduced DCT scale when the crop allows it (a low
    # pass before resampling); the client mimics it with a box reduction by the same factor
    r = cpu_reduction(im, cfg, crop, orientation)
    rw, rh = -(-w // r), -(-h // r)
    box = augment.roi_box(augment._scaled(crop, rw / w, rh / h), rw, rh)
    light = augment.lighting_offset(cfg.lighting, d) if cfg.lighting else np.zeros(3)
    return GpuSample(orientation, r, info.width, info.height, box, crop.flip,
                     tuple(augment.jitter_ops(cfg, d)), tuple(float(x) for x in light))


def cpu_reduction(im, cfg: AugmentConfig, crop: augment.Crop, orientation: int) -> int:
    """The DCT reduction factor ``augment.make_sample`` decodes this JPEG at (1, 2, 4 or 8)."""
    if orientation != 1:
        return 1  # rotated images are decoded whole
    r = augment._draft_factor(crop, cfg.output_size)
    if r == 1:
        return 1
    if augment.simplejpeg is not None and cfg.decoder == "auto" and im.mode in ("RGB", "L"):
        return r  # libjpeg-turbo scales by exactly 1/r to reach ceil(w/r) x ceil(h/r)
    # Pillow's draft: the largest power of two <= the whole-number ratio to the size asked for
    w, h = im.size
    scale = min(w // -(-w // r), h // -(-h // r))
    return next(a for a in (8, 4, 2, 1) if scale >= a)
