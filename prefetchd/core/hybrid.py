"""Hybrid decode, the daemon's side: the cheap CPU part of a batch the trainer's GPU decodes. Pure.

For a batch that ``on_gpu`` assigns to the GPU, each sample is read as now and then:

* ``augment.probe`` opens its header (anything but a JPEG or PNG, or a decompression bomb, raises
  ``SampleError`` and is quarantined and replaced exactly as on the CPU path);
* ``scan_jpeg`` walks the JPEG's markers and ``hw_refusal`` says whether the GPU's hardware
  decoder takes it: baseline (SOF0), 8-bit, greyscale or YCbCr with 4:4:4, 4:2:2, 4:2:0 or 4:4:0
  sampling, complete (an EOI marker after the scan), and sound in the structure of its markers
  and entropy-coded data as far as can be told without decoding it (``scan_jpeg``: the tables it
  uses are defined, no stray marker before the scan, one scan whose data holds only stuffed bytes
  and restart markers in sequence, as many as its restart interval implies, and at least the 2
  bits a block takes). Everything else (progressive, arithmetic, 12-bit, CMYK/YCCK, RGB-coded,
  odd sampling, PNG whatever its name, truncated, corrupt) is made by the CPU path
  (``augment.make_sample``) and stored as finished pixels, bit-identical to ``augment.decode:
  cpu``; a file the CPU path cannot decode is quarantined as now. This matters because the
  GPU's hardware decoder reports success for a batch once it is queued: a file with corrupt
  entropy data comes back as a garbage image, not a failure. What these checks cannot see (bits
  flipped inside the entropy data, keeping its structure) reaches the trainer as a damaged image
  where the CPU path might have quarantined the file;
* for a JPEG the GPU takes, the crop comes from the same draws and the same functions as on the
  CPU path (``augment.crop_for`` on the upright size, the same DCT reduction factor, and
  ``augment.roi_box`` in the reduced image, where the client takes it), and so do the flip, the jitter order and factors (``augment.jitter_ops``) and the lighting
  (``augment.lighting_offset``): crops, flips and labels are those of the CPU path.

The result is written as a compact batch (``prefetchd.format.jpegbatch``). Which batches go to the GPU is
a pure function of the config and the batch number (``on_gpu``), never of timing.

The worker's side (``prefetchd.executors.builders.CompactBuilder``) collects a batch's samples
with these functions and writes the compact batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from prefetchd.core.augment import modes as augment
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
    defect: str | None = None  # what is wrong with the markers or the entropy-coded data, if anything


def scan_jpeg(data: bytes) -> JpegInfo | None:
    """Walk a JPEG's marker segments up to the first scan; None where the structure is not that
    of a JPEG with a frame and a scan (such a file goes to the CPU path, which judges it)."""
    n = len(data)
    if n < 4 or data[0] != 0xFF or data[1] != 0xD8:
        return None
    pos, frame, adobe = 2, None, None
    stray, restart, huffman, quant = 0, 0, set(), set()
    while pos + 4 <= n:
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # standalone markers carry no length
            stray += 1  # libjpeg skips a TEM or RST here; nvImageCodec's parser refuses the file
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
        elif marker == 0xDD and len(seg) >= 2:  # DRI
            restart = (seg[0] << 8) | seg[1]
        elif marker == 0xC4:
            huffman |= _table_ids(seg, huffman=True)
        elif marker == 0xDB:
            quant |= _table_ids(seg, huffman=False)
        elif marker == 0xDA:
            if frame is None:
                return None
            # entropy-coded data never holds FF D9 (FF is stuffed as FF 00): a truncated file
            # has no EOI after its scan, whatever else it carries before
            end = data.rfind(b"\xff\xd9", pos + 2 + length)
            sof, precision, w, h, comps = frame
            defect = None
            if stray:
                defect = f"{stray} stray marker{'s' if stray > 1 else ''} (TEM or RST) before the scan"
            elif end >= 0:
                defect = _scan_defect(data, seg, pos + 2 + length, end, frame, restart, huffman, quant)
            return JpegInfo(sof, precision, w, h, comps, adobe, pos, end >= 0, defect)
        pos += 2 + length
    return None


def _table_ids(seg: bytes, huffman: bool) -> set:
    """The (class, id) of each Huffman table (DHT) or the id of each quantisation table (DQT)."""
    ids, i = set(), 0
    while i < len(seg):
        pq_tc, th = seg[i] >> 4, seg[i] & 15
        if huffman:
            ids.add((pq_tc, th))
            i += 17 + sum(seg[i + 1: i + 17])
        else:
            ids.add(th)
            i += 1 + (128 if pq_tc else 64)
    return ids


def _scan_defect(data: bytes, sos: bytes, start: int, end: int, frame, restart: int, huffman: set,
                 quant: set) -> str | None:
    """What is wrong with a baseline JPEG's one scan (entropy-coded data ``data[start:end]``, up to
    its EOI), if anything, as far as can be told without decoding it. Vectorised: about a
    microsecond per kilobyte."""
    _, _, w, h, comps = frame
    if sos:
        ns = sos[0]
        for i in range(ns):
            if 2 + 2 * i >= len(sos):
                return "a short scan header"
            td_ta = sos[2 + 2 * i]
            if (0, td_ta >> 4) not in huffman or (1, td_ta & 15) not in huffman:
                return "a Huffman table the scan uses is not defined"
    if not quant:
        return "no quantisation table"
    arr = np.frombuffer(data, dtype=np.uint8, count=end - start, offset=start)
    ff = np.flatnonzero(arr[:-1] == 0xFF)
    after = arr[ff + 1]
    rst = after[(after >= 0xD0) & (after <= 0xD7)]
    other = (after != 0) & (after != 0xFF) & ((after < 0xD0) | (after > 0xD7))
    if other.any():
        return f"a marker FF{int(after[other][0]):02X} inside the entropy-coded data (corrupt, or several scans)"
    hmax = max(c[1] for c in comps)
    vmax = max(c[2] for c in comps)
    if len(comps) == 1:
        mcus, blocks = -(-w // 8) * -(-h // 8), 1
    else:
        mcus, blocks = -(-w // (8 * hmax)) * -(-h // (8 * vmax)), sum(c[1] * c[2] for c in comps)
    want_rst = (mcus - 1) // restart if restart else 0
    if len(rst) != want_rst:
        return f"{len(rst)} restart markers where its restart interval implies {want_rst} (corrupt)"
    if len(rst) and not np.array_equal(rst - 0xD0, np.arange(len(rst)) % 8):
        return "restart markers out of sequence (corrupt)"
    payload = len(arr) - int((after == 0).sum()) - 2 * len(rst)
    if payload * 8 < 2 * mcus * blocks:  # every block takes at least a DC and an end-of-block code
        return f"{payload} bytes of entropy-coded data for {mcus * blocks} blocks (truncated)"
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
    if info.defect:
        return info.defect
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
