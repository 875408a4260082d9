"""The compact batch: JPEG bytes and per-sample parameters, decoded by the trainer's GPU.

With ``augment.decode: hybrid | gpu`` the daemon writes some batches in this format instead of
``batchfile``'s pixels (which ones: ``prefetchd.core.hybrid.on_gpu``). It lives in the same ring under
the same name (``r{rank:04d}-e{epoch:06d}-b{batch:08d}.batch``), is written under a ``.tmp-`` name
and published by ``rename(2)`` like any batch, and the reader tells the two apart by the magic
(``parse_any``). Both headers are 128 bytes and keep ``file_size`` at offset 112, so a reader
reads 128 bytes, learns the size (``expected_size``), reads the whole file and dispatches.
Shared by the daemon (which writes) and the client (which reads); imports only numpy and xxhash.

Layout, all integers little-endian::

    offset size  field
         0    8  magic            b"PFDJPEGB"
         8    2  version          1
        10    2  header_size      128
        12    4  flags            bit 0: some sample was replaced (quarantined source)
                                  bit 1: PCA lighting is on (apply ``lighting`` offsets)
        16    8  checksum         xxh3_64 of the whole file with these 8 bytes read as zero
        24    8  fingerprint      u64: the stream fingerprint (config + dataset) it was made for
        32    4  rank
        36    4  epoch
        40    8  batch
        48    4  batches_in_epoch for this rank
        52    4  n                samples in this batch
        56    4  height           output height (augment.output_size)
        60    4  width            output width
        64    4  channels         3
        68    1  interpolation    1 nearest, 2 bilinear, 3 bicubic, 4 lanczos, 5 area
        69    3  reserved         0
        72    8  indices_offset   int64[n]: dataset index of each sample actually used
        80    8  labels_offset    int64[n]: class label of each sample
        88    8  replaced_offset  int64[n]: the sampled index a quarantined one replaced, else -1
        96    8  params_offset    PARAM[n], 96 bytes each (below)
       104    8  data_offset      the payloads, back to back in sample order
       112    8  file_size        the whole file, for a length check before reading
       120    8  data_nbytes

The sections follow each other without gaps: indices at 128, labels at 128 + 8n, replaced at
128 + 16n, params at 128 + 24n, data at 128 + 120n, file_size = data_offset + data_nbytes.

PARAM, one per sample (96 bytes, packed)::

    offset size  field
         0    1  kind         1 = JPEG: payload is a JPEG file for the client to decode;
                              2 = PIXELS: payload is the finished sample, uint8 [height, width, 3]
                                  (HWC, RGB), made by the daemon's CPU path (bit-identical to
                                  ``augment.decode: cpu``); nothing more is applied to it
         1    1  orientation  EXIF orientation 1..8 of the JPEG (PIXELS: 1)
         2    1  flip         1: flip horizontally after resampling
         3    1  n_ops        colour jitter ops that apply, 0..3
         4    3  ops          op codes in the order they apply: 0 brightness, 1 contrast, 2 saturation
         7    1  reduce       1, 2, 4 or 8: reduce the decoded image by this factor (r x r box
                              average, partial blocks at the right and bottom edges averaged over
                              what they hold) before cropping, as the CPU path's reduced-scale
                              DCT decode does; > 1 only with orientation 1 (PIXELS: 1)
         8    4  coded_width  the JPEG's frame size as stored, before orientation (PIXELS: width)
        12    4  coded_height
        16   16  roi          int32 x0, y0, x1, y1: the crop in upright (oriented) source pixels
                              after the reduction (an image of ceil(w/reduce) x ceil(h/reduce)),
                              ends exclusive (PIXELS: the whole output)
        32   24  factors      float64[3]: the jitter factors, in op order
        56   24  lighting     float64[3]: offsets added to R, G, B before rounding (flag bit 1)
        80    8  offset       u64: the payload's offset from the start of the file
        88    8  nbytes       u64: the payload's length

The client decodes each JPEG payload to RGB in its stored orientation, reduces it by ``reduce``,
applies ``orientation`` as ``PIL.ImageOps.exif_transpose`` does, takes ``roi``, resamples it to ``height`` x ``width`` with
``interpolation`` (as ``prefetchd.core.augment`` does: 2x area halving while the region is at least twice
the output, then the filter), applies the jitter ops in order (brightness: ``lut = clip(rint(v * f))``;
contrast: ``lut = clip(rint(v * f + m * (1 - f)))`` with ``m`` the mean of the BT.601 grey image;
saturation: ``clip(round(x * f + grey * (1 - f)))``), the lighting (``clip(rint(v + offset_c))``
per channel) and the flip.

A file is valid when the magic, version, header size, offsets and file size agree with each other
and with the file's length, the checksum matches, and every PARAM is well formed (kinds, payload
ranges inside the data section, PIXELS payloads of exactly height*width*3 bytes, ``roi`` non-empty
inside the upright frame, orientation 1..8, ops valid).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import xxhash

from prefetchd.format import batchfile
from prefetchd.format.batchfile import BatchFileError, BatchMeta

MAGIC = b"PFDJPEGB"
VERSION = 1
HEADER = struct.Struct("<8sHHIQQIIQIIIIIB3sQQQQQQQ")
assert HEADER.size == 128 == batchfile.HEADER_SIZE
HEADER_SIZE = HEADER.size
FILE_SIZE_OFFSET = 112  # the same in batchfile's header
FLAG_REPLACED = 1
FLAG_LIGHTING = 2
KIND_JPEG = 1
KIND_PIXELS = 2
OP_NONE = 255
INTERPOLATIONS = ("nearest", "bilinear", "bicubic", "lanczos", "area")  # code = position + 1

PARAM = np.dtype([
    ("kind", "u1"), ("orientation", "u1"), ("flip", "u1"), ("n_ops", "u1"), ("ops", "u1", (3,)),
    ("reduce", "u1"), ("coded_width", "<u4"), ("coded_height", "<u4"), ("roi", "<i4", (4,)),
    ("factors", "<f8", (3,)), ("lighting", "<f8", (3,)), ("offset", "<u8"), ("nbytes", "<u8"),
])
assert PARAM.itemsize == 96


def empty_params(n: int) -> np.ndarray:
    """A PARAM array of ``n`` zeroed records with no jitter ops."""
    p = np.zeros(n, dtype=PARAM)
    p["ops"] = OP_NONE
    p["orientation"] = p["reduce"] = 1
    return p


@dataclass(frozen=True)
class JpegBatch:
    """A parsed compact batch; every array is a view into the buffer it was parsed from."""

    rank: int
    epoch: int
    batch: int
    batches_in_epoch: int
    fingerprint: int
    flags: int
    height: int
    width: int
    interpolation: str
    indices: np.ndarray
    labels: np.ndarray
    replaced: np.ndarray
    params: np.ndarray  # PARAM [n]
    buffer: np.ndarray  # uint8: the whole file
    file_size: int

    def __len__(self) -> int:
        return len(self.params)

    def payload(self, k: int) -> np.ndarray:
        """Sample ``k``'s payload: JPEG bytes (uint8 [nbytes]) or finished pixels (uint8 [h, w, 3])."""
        p = self.params[k]
        view = self.buffer[int(p["offset"]): int(p["offset"]) + int(p["nbytes"])]
        return view.reshape(self.height, self.width, 3) if p["kind"] == KIND_PIXELS else view

    @property
    def lighting(self) -> bool:
        return bool(self.flags & FLAG_LIGHTING)


def _offsets(n: int) -> tuple[int, int, int, int, int]:
    io = HEADER_SIZE
    return io, io + 8 * n, io + 16 * n, io + 24 * n, io + 24 * n + PARAM.itemsize * n


def encode(meta: BatchMeta, indices: np.ndarray, labels: np.ndarray, replaced: np.ndarray,
           params: np.ndarray, payloads: list, height: int, width: int, interpolation: str,
           lighting: bool) -> list:
    """The file as a list of buffers to write in order (payloads are not copied).

    ``params`` is a PARAM array whose ``offset`` and ``nbytes`` are filled in here; ``payloads[k]``
    is sample ``k``'s JPEG bytes or its uint8 [height, width, 3] C-contiguous pixels.
    """
    n = len(params)
    if not (len(indices) == len(labels) == len(replaced) == len(payloads) == n):
        raise ValueError("indices, labels, replaced, params and payloads must each have one entry per sample")
    io, lo, ro, po, do = _offsets(n)
    views = [memoryview(p).cast("B") for p in payloads]
    sizes = np.array([v.nbytes for v in views], dtype=np.uint64)
    params = params.copy()
    params["nbytes"] = sizes
    params["offset"] = do + np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.uint64) if n else sizes
    pixels = params["kind"] == KIND_PIXELS
    if (params["nbytes"][pixels] != height * width * 3).any():
        raise ValueError(f"a PIXELS payload is not uint8 [{height}, {width}, 3]")
    data_nbytes = int(sizes.sum())
    file_size = do + data_nbytes
    flags = (FLAG_REPLACED if bool((np.asarray(replaced) >= 0).any()) else 0) | (FLAG_LIGHTING if lighting else 0)
    arrays = b"".join(np.ascontiguousarray(a, dtype="<i8").tobytes() for a in (indices, labels, replaced))
    head = (meta, n, height, width, INTERPOLATIONS.index(interpolation) + 1, io, lo, ro, po, do, file_size,
            data_nbytes, flags)
    h_ = xxhash.xxh3_64()
    parts = [_header(*head, 0), arrays, params.tobytes(), *views]
    for part in parts:
        h_.update(part)
    parts[0] = _header(*head, h_.intdigest())
    return parts


def _header(meta: BatchMeta, n, height, width, interp, io, lo, ro, po, do, file_size, data_nbytes, flags,
            checksum) -> bytes:
    return HEADER.pack(MAGIC, VERSION, HEADER_SIZE, flags, checksum, meta.fingerprint, meta.rank, meta.epoch,
                       meta.batch, meta.batches_in_epoch, n, height, width, 3, interp, bytes(3),
                       io, lo, ro, po, do, file_size, data_nbytes)


def pack(*args, **kwargs) -> bytes:
    """The whole file as bytes (``encode``'s arguments); for tests and tools."""
    return b"".join(bytes(p) for p in encode(*args, **kwargs))


def write_batch(fd: int, *args, **kwargs) -> int:
    """Write a whole compact batch to ``fd`` (positioned at 0); ``encode``'s arguments. Returns
    the file size. The space is reserved first, as ``batchfile.write_batch`` does."""
    return batchfile.write_file(fd, encode(*args, **kwargs))


def is_compact(head) -> bool:
    """Whether a file starting with ``head`` (at least 8 bytes) is a compact batch."""
    return bytes(memoryview(head)[:8]) == MAGIC


def expected_size(head) -> int:
    """The file size the header claims, for either kind of batch file (after checking the magic
    and version)."""
    if is_compact(head):
        return _read_header(memoryview(head))[21]
    return batchfile.expected_size(head)


def _read_header(mv: memoryview) -> tuple:
    return batchfile.check_header(mv, HEADER, MAGIC, VERSION, "compact ")


def parse(buf, verify: bool = True) -> JpegBatch:
    """Parse and check a whole compact batch held in ``buf`` (bytes, bytearray, memoryview or a
    uint8 numpy array), without copying it. Raises BatchFileError on any inconsistency."""
    arr = buf.reshape(-1) if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
    mv = memoryview(arr)
    (_, _, _, flags, checksum, fp, rank, epoch, batch, bie, n, h, w, c, interp, _,
     io, lo, ro, po, do, fsize, dn) = _read_header(mv)
    if c != 3 or not 1 <= interp <= len(INTERPOLATIONS):
        raise BatchFileError(f"unsupported channels {c} or interpolation code {interp}")
    if (io, lo, ro, po, do) != _offsets(n) or fsize != do + dn:
        raise BatchFileError("header offsets disagree with its sample count")
    if len(mv) != fsize:
        raise BatchFileError(f"file is {len(mv)} bytes, its header says {fsize} (torn or truncated)")
    if verify:
        batchfile.verify_checksum(mv, checksum, "compact ")
    ints = arr[io: po].view("<i8")
    params = arr[po: do].view(PARAM)
    _check_params(params, h, w, do, fsize)
    return JpegBatch(rank=rank, epoch=epoch, batch=batch, batches_in_epoch=bie, fingerprint=fp, flags=flags,
                     height=h, width=w, interpolation=INTERPOLATIONS[interp - 1], indices=ints[:n],
                     labels=ints[n: 2 * n], replaced=ints[2 * n: 3 * n], params=params, buffer=arr,
                     file_size=fsize)


def _check_params(p: np.ndarray, h: int, w: int, data_offset: int, file_size: int) -> None:
    kind = p["kind"]
    if not np.isin(kind, (KIND_JPEG, KIND_PIXELS)).all():
        raise BatchFileError(f"unknown sample kind(s) {sorted(set(kind.tolist()) - {KIND_JPEG, KIND_PIXELS})}")
    off, nb = p["offset"].astype(np.int64), p["nbytes"].astype(np.int64)
    if (off < data_offset).any() or (nb < 0).any() or (off + nb > file_size).any():
        raise BatchFileError("a sample's payload lies outside the data section")
    if (nb[kind == KIND_PIXELS] != h * w * 3).any():
        raise BatchFileError(f"a PIXELS payload is not {h}x{w}x3 bytes")
    o, r = p["orientation"], p["reduce"].astype(np.int64)
    if ((o < 1) | (o > 8)).any() or (p["n_ops"] > 3).any():
        raise BatchFileError("a sample's orientation or jitter op count is out of range")
    if not np.isin(r, (1, 2, 4, 8)).all() or ((r > 1) & (o != 1)).any():
        raise BatchFileError("a sample's reduction is not 1, 2, 4 or 8 (or is not 1 on a rotated image)")
    used = np.arange(3)[None, :] < p["n_ops"][:, None]
    if (used & (p["ops"] > 2)).any():
        raise BatchFileError("a sample names an unknown jitter op")
    swap = np.isin(o, (5, 6, 7, 8))
    uw = -(-np.where(swap, p["coded_height"], p["coded_width"]).astype(np.int64) // r)
    uh = -(-np.where(swap, p["coded_width"], p["coded_height"]).astype(np.int64) // r)
    x0, y0, x1, y1 = (p["roi"][:, i].astype(np.int64) for i in range(4))
    bad = (x0 < 0) | (y0 < 0) | (x1 <= x0) | (y1 <= y0) | (x1 > uw) | (y1 > uh)
    if (bad & (kind == KIND_JPEG)).any():
        raise BatchFileError("a sample's crop lies outside its image")


def parse_any(buf, verify: bool = True):
    """Parse either kind of batch file: a ``batchfile.Batch`` or a ``JpegBatch``."""
    head = buf[:8] if not isinstance(buf, np.ndarray) else buf.reshape(-1)[:8]
    return parse(buf, verify) if is_compact(head) else batchfile.parse(buf, verify)


def read_file(path: str, verify: bool = True):
    """Read a batch file of either kind into fresh memory and parse it (for tools and tests)."""
    return parse_any(batchfile.read_whole(path), verify)
