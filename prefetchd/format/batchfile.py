"""The batch file: one ready batch in the ring buffer, written once and never modified.

Shared by the daemon (which writes) and the client (which reads); it imports only numpy and
xxhash, so a reader in another language needs nothing but this docstring.

File name: ``r{rank:04d}-e{epoch:06d}-b{batch:08d}.batch`` in the buffer directory; a batch of the
validation stream is ``v{rank:04d}-e{pass:06d}-b{batch:08d}.batch``, its header's ``rank`` is the
lane ``progress.VAL_LANE + rank``, ``epoch`` the pass and ``fingerprint`` the validation stream's
(so neither stream's reader takes the other's file). A batch of a resumed epoch's segment (the
epoch's samples from ``offset`` on, see ``progress``) is ``r{rank:04d}-e{epoch:06d}-o{offset:010d}-b{batch:08d}.batch``
and its header's ``fingerprint`` is ``segment_fingerprint(stream fingerprint, epoch, offset)``,
so a batch made for another segmentation is never taken for it. Writers create
``.tmp-...`` names with ``O_CREAT|O_EXCL|O_NOFOLLOW`` and publish by ``rename(2)``, so a reader
sees either nothing or the whole file.

Layout, all integers little-endian::

    offset size  field
         0    8  magic            b"PFDBATCH"
         8    2  version          1
        10    2  header_size      128
        12    4  flags            bit 0: some sample was replaced (quarantined source)
        16    8  checksum         xxh3_64 of the whole file with these 8 bytes read as zero
        24    8  fingerprint      u64: the stream fingerprint (config + dataset) it was made for
        32    4  rank
        36    4  epoch
        40    8  batch
        48    4  batches_in_epoch for this rank
        52    4  n                samples in this batch
        56    4  height
        60    4  width
        64    4  channels         3
        68    1  dtype            1 = uint8
        69    1  layout           1 = NHWC (the client exposes it as [N, C, H, W], channels-last)
        70    2  reserved         0
        72    8  indices_offset   int64[n]: dataset index of each sample actually used
        80    8  labels_offset    int64[n]: class label of each sample
        88    8  replaced_offset  int64[n]: the sampled index a quarantined one replaced, else -1
        96    8  images_offset    uint8[n, height, width, channels], 4096-byte aligned
       104    8  images_nbytes
       112    8  file_size        the whole file, for a length check before reading
       120    8  reserved         0

Version 2, several views (a transform returning k >= 2 images per sample, or ``augment.views``):
the same header with ``version`` 2 and the two bytes at offset 70 holding ``views``, k; ``height``,
``width``, ``images_offset`` and ``images_nbytes`` are view 0's. The view table follows the three
int64 arrays, at ``HEADER_SIZE + 24 * n``: k entries of 24 bytes (u32 height, u32 width, u64
offset, u64 nbytes), then each view's uint8 ``[n, height, width, channels]`` at its offset, in
order, each 4096-byte aligned after the one before; ``file_size`` is the end of the last view.
A batch of one view is always written as version 1 (byte for byte what it was before views
existed), so both versions are read and a reader of version 1 alone refuses a file of several
views by its version rather than misreading it.

A file is valid when the magic, version, header size, offsets and file size agree with each
other and with the file's length, and the checksum (which covers the view table) matches.
"""

from __future__ import annotations

import errno
import functools
import mmap
import os
import re
import struct
from dataclasses import dataclass

import numpy as np
import xxhash

from prefetchd.format.progress import lane, split_lane

MAGIC = b"PFDBATCH"
VERSION = 1
VERSION_VIEWS = 2  # several image sections (views), with a view table
VIEW = struct.Struct("<IIQQ")  # a view table entry: height, width, offset, nbytes
MAX_VIEWS = 64
HEADER = struct.Struct("<8sHHIQQIIQIIIIIBBHQQQQQQQ")
assert HEADER.size == 128
HEADER_SIZE = HEADER.size
IMAGE_ALIGN = 4096
DTYPE_UINT8 = 1
LAYOUT_NHWC = 1
FLAG_REPLACED = 1
_CHECKSUM_SLICE = slice(16, 24)
_ZERO8 = bytes(8)

SUFFIX = ".batch"
TMP_PREFIX = ".tmp-"
_NAME_RE = re.compile(r"^([rv])(\d{4,})-e(\d{6,})(?:-o(\d{10,}))?-b(\d{8,})\.batch$")


class BatchFileError(ValueError):
    """A batch file is torn, foreign or corrupt."""


def batch_name(rank: int, epoch: int, batch: int, offset: int = 0) -> str:
    """``rank`` is a lane: a train rank, or ``progress.VAL_LANE + rank`` for validation;
    ``offset``: the first sample of a resumed epoch's segment (0: the whole epoch)."""
    stream, r = split_lane(rank)
    seg = f"-o{offset:010d}" if offset else ""
    return f"{'v' if stream == 'val' else 'r'}{r:04d}-e{epoch:06d}{seg}-b{batch:08d}{SUFFIX}"


def parse_name(name: str) -> tuple[int, int, int] | tuple[int, int, int, int] | None:
    """The key a batch file name is for: ``(lane, epoch, batch)``, or ``(lane, epoch, batch,
    offset)`` for a resumed epoch's segment; ``batch_name(*key)`` gives the name back."""
    m = _NAME_RE.match(name)
    if not m or not m.group(2).isascii() or not (m.group(4) or "1").isascii() or m.group(4) and not int(m.group(4)):
        return None  # (an offset of 0 is never written out: that batch has the whole epoch's name)
    key = (lane("val" if m.group(1) == "v" else "train", int(m.group(2))), int(m.group(3)), int(m.group(5)))
    return key + (int(m.group(4)),) if m.group(4) else key


def segment_fingerprint(fingerprint: int, epoch: int, offset: int) -> int:
    """The header fingerprint of the batches of ``epoch``'s segment from sample ``offset``: the
    stream's own for a whole epoch (``offset`` 0), else the xxh3-64 (an unsigned 64-bit integer)
    of ``struct.pack("<QQQ", fingerprint, epoch, offset)``."""
    if not offset:
        return fingerprint
    return xxhash.xxh3_64_intdigest(struct.pack("<QQQ", fingerprint, epoch, offset))


def fingerprint_u64(hex_fingerprint: str) -> int:
    return int(hex_fingerprint[:16], 16)


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


@dataclass(frozen=True)
class Layout:
    n: int
    height: int
    width: int
    channels: int = 3
    more: tuple[tuple[int, int], ...] = ()  # views 1..k-1's (height, width); () for one view

    @property
    def shapes(self) -> tuple[tuple[int, int], ...]:
        """Each view's (height, width), view 0 first."""
        return ((self.height, self.width),) + tuple(self.more)

    @property
    def version(self) -> int:
        return VERSION_VIEWS if self.more else VERSION

    @property
    def table_offset(self) -> int:
        return HEADER_SIZE + 24 * self.n

    @property
    def view_offsets(self) -> tuple[int, ...]:
        """Where each view's pixels start (view 0's is ``images_offset``)."""
        at = self.table_offset + (VIEW.size * len(self.shapes) if self.more else 0)
        out = []
        for h, w in self.shapes:
            at = _align(at, IMAGE_ALIGN)
            out.append(at)
            at += self.n * h * w * self.channels
        return tuple(out)

    def view_nbytes(self, v: int) -> int:
        h, w = self.shapes[v]
        return self.n * h * w * self.channels

    @property
    def indices_offset(self) -> int:
        return HEADER_SIZE

    @property
    def labels_offset(self) -> int:
        return HEADER_SIZE + 8 * self.n

    @property
    def replaced_offset(self) -> int:
        return HEADER_SIZE + 16 * self.n

    @property
    def images_offset(self) -> int:
        return self.view_offsets[0]

    @property
    def images_nbytes(self) -> int:
        return self.n * self.height * self.width * self.channels

    @property
    def file_size(self) -> int:
        return self.view_offsets[-1] + self.view_nbytes(len(self.shapes) - 1)

    def table(self) -> bytes:
        """The view table (version 2; empty for one view)."""
        if not self.more:
            return b""
        return b"".join(VIEW.pack(h, w, o, self.view_nbytes(v))
                        for v, ((h, w), o) in enumerate(zip(self.shapes, self.view_offsets, strict=True)))


@functools.lru_cache(maxsize=256)
def max_file_size(batch_size: int, height: int, width: int, channels: int = 3,
                  more: tuple[tuple[int, int], ...] = ()) -> int:
    """The file of a batch of ``batch_size`` samples; ``more``: views 1..k-1's (height, width)."""
    return Layout(batch_size, height, width, channels, tuple(more)).file_size  # (cached: asked once per batch)


def views_file_size(batch_size: int, shapes) -> int:
    """``max_file_size`` for views of these (height, width) shapes, view 0 first."""
    (h, w), *more = [tuple(x) for x in shapes]
    return max_file_size(batch_size, h, w, 3, tuple(more))


@dataclass(frozen=True)
class BatchMeta:
    rank: int
    epoch: int
    batch: int
    batches_in_epoch: int
    fingerprint: int


def encode_header(meta: BatchMeta, layout: Layout, flags: int, checksum: int = 0) -> bytes:
    return HEADER.pack(
        MAGIC, layout.version, HEADER_SIZE, flags, checksum, meta.fingerprint,
        meta.rank, meta.epoch, meta.batch, meta.batches_in_epoch,
        layout.n, layout.height, layout.width, layout.channels, DTYPE_UINT8, LAYOUT_NHWC,
        len(layout.shapes) if layout.more else 0,
        layout.indices_offset, layout.labels_offset, layout.replaced_offset,
        layout.images_offset, layout.images_nbytes, layout.file_size, 0,
    )


def encode(meta: BatchMeta, indices: np.ndarray, labels: np.ndarray, replaced: np.ndarray,
           images) -> list:
    """The file as a list of buffers to write in order; ``images`` (uint8 ``[n, h, w, c]``,
    C-contiguous, or a tuple or list of such arrays, one per view, of one ``n`` and ``c``) is not
    copied. One view makes a version 1 file, several a version 2 file."""
    views = tuple(images) if isinstance(images, (tuple, list)) else (images,)
    if not views or len(views) > MAX_VIEWS:
        raise ValueError(f"a batch holds 1 to {MAX_VIEWS} views, got {len(views)}")
    for v in views:
        if v.dtype != np.uint8 or not v.flags.c_contiguous or v.ndim != 4:
            raise ValueError("images must be a C-contiguous uint8 array [n, h, w, c] (one per view)")
    n, h, w, c = views[0].shape
    if any(v.shape[0] != n or v.shape[3] != c for v in views):
        raise ValueError(f"every view must have the batch's {n} samples of {c} channels, got "
                         f"{[list(v.shape) for v in views]}")
    layout = Layout(n, h, w, c, tuple(v.shape[1:3] for v in views[1:]))
    arrays = b"".join(np.ascontiguousarray(a, dtype="<i8").tobytes() for a in (indices, labels, replaced))
    if len(arrays) != 24 * n:
        raise ValueError("indices, labels and replaced must each have one entry per image")
    flags = FLAG_REPLACED if bool((replaced >= 0).any()) else 0
    parts: list = [arrays + layout.table()]
    at = HEADER_SIZE + len(parts[0])
    for v, off in zip(views, layout.view_offsets, strict=True):
        parts.append(bytes(off - at))
        parts.append(memoryview(v).cast("B"))
        at = off + v.nbytes
    h_ = xxhash.xxh3_64()
    h_.update(encode_header(meta, layout, flags, 0))
    for p in parts:
        h_.update(p)
    # (buffers: header, then the arrays and table with view 0's padding, then each view and the next padding)
    head, *rest = parts
    joined = [head + rest[0]] + rest[1:]
    return [encode_header(meta, layout, flags, h_.intdigest())] + [p for p in joined if memoryview(p).nbytes]


def write_batch(fd: int, meta: BatchMeta, indices: np.ndarray, labels: np.ndarray,
                replaced: np.ndarray, images: np.ndarray) -> int:
    """Write a whole batch file to ``fd`` (positioned at 0). Returns the file size.

    ``images`` is uint8 ``[n, h, w, c]``, C-contiguous; it is written without a copy.
    """
    return write_file(fd, encode(meta, indices, labels, replaced, images))


def write_file(fd: int, parts: list) -> int:
    """Write an encoded file (either kind: ``encode``'s or ``jpegbatch.encode``'s buffers) to
    ``fd`` (positioned at 0), reserving its space first. Returns the file size."""
    size = sum(memoryview(p).nbytes for p in parts)
    reserve(fd, size)
    total = write_parts(fd, parts)
    if total != size:  # pragma: no cover - guarded by write_parts' loop
        raise OSError(f"wrote {total} bytes, expected {size}")
    return total


@dataclass(frozen=True)
class Batch:
    """A parsed batch; arrays are views into the buffer it was parsed from."""

    rank: int
    epoch: int
    batch: int
    batches_in_epoch: int
    fingerprint: int
    flags: int
    indices: np.ndarray
    labels: np.ndarray
    replaced: np.ndarray
    images: np.ndarray  # uint8 [n, h, w, c]: view 0's
    file_size: int
    views: tuple[np.ndarray, ...] = ()  # every view's uint8 [n, h_v, w_v, c], view 0 (``images``) first

    @property
    def shapes(self) -> tuple[tuple[int, int], ...]:
        """Each view's (height, width)."""
        return tuple(v.shape[1:3] for v in self.views)


def read_header(buf) -> tuple:
    return check_header(buf, HEADER, MAGIC, (VERSION, VERSION_VIEWS), "")


def check_header(buf, header: struct.Struct, magic: bytes, version, kind: str) -> tuple:
    """The header's fields, after checking its length, magic, version (one, or a tuple of those
    known) and header size (shared by both kinds of batch file; ``kind`` names the kind in the
    errors: "" or "compact ")."""
    if len(buf) < header.size:
        raise BatchFileError(f"file of {len(buf)} bytes is shorter than the {header.size}-byte header")
    fields = header.unpack_from(buf, 0)
    if fields[0] != magic:
        raise BatchFileError(f"bad magic {fields[0]!r}; not a prefetchd {kind}batch file")
    known = version if isinstance(version, tuple) else (version,)
    if fields[1] not in known:
        said = " and ".join(str(v) for v in known)
        raise BatchFileError(f"{kind}batch format version {fields[1]} is not supported (this reader knows {said})")
    if fields[2] != header.size:
        raise BatchFileError(f"header size {fields[2]} is not {header.size}")
    return fields


def verify_checksum(mv: memoryview, checksum: int, kind: str) -> None:
    """Check the xxh3-64 of the whole file with the checksum field (bytes 16..24) read as zero."""
    h_ = xxhash.xxh3_64()
    h_.update(mv[:16])
    h_.update(_ZERO8)
    h_.update(mv[24:])
    if h_.intdigest() != checksum:
        raise BatchFileError(f"checksum mismatch (corrupt {kind}batch file)")


def write_parts(fd: int, parts) -> int:
    """Write the buffers in order (``os.write`` may write less than asked on large buffers);
    returns the bytes written."""
    total = 0
    for part in parts:
        view = memoryview(part).cast("B")
        while view.nbytes:
            k = os.write(fd, view)
            total += k
            view = view[k:]
    return total


def expected_size(buf) -> int:
    """The file size the header claims (after checking the magic and version)."""
    return read_header(buf)[22]


def parse(buf, verify: bool = True) -> Batch:
    """Parse and check a whole batch file held in ``buf`` (bytes, bytearray, memoryview or a
    uint8 numpy array). Raises BatchFileError on any inconsistency."""
    mv = memoryview(buf).cast("B") if not isinstance(buf, np.ndarray) else memoryview(buf.reshape(-1))
    (_, version, _, flags, checksum, fp, rank, epoch, batch, bie, n, h, w, c, dtype, layout_code, k,
     io, lo, ro, imo, imn, fsize, _) = read_header(mv)
    if dtype != DTYPE_UINT8 or layout_code != LAYOUT_NHWC:
        raise BatchFileError(f"unsupported dtype {dtype} or layout {layout_code}")
    lay = Layout(n, h, w, c, _view_table(mv, version, k, n, (h, w)))
    if (io, lo, ro, imo, imn, fsize) != (lay.indices_offset, lay.labels_offset, lay.replaced_offset,
                                         lay.images_offset, lay.images_nbytes, lay.file_size):
        raise BatchFileError("header offsets disagree with its shape")
    if len(mv) != fsize:
        raise BatchFileError(f"file is {len(mv)} bytes, its header says {fsize} (torn or truncated)")
    if lay.more and lay.table() != bytes(mv[lay.table_offset: lay.table_offset + VIEW.size * k]):
        raise BatchFileError("view table offsets disagree with its shapes")
    if verify:
        verify_checksum(mv, checksum, "")
    arr = np.frombuffer(mv, dtype=np.uint8)
    ints = arr[io: io + 24 * n].view("<i8")
    views = tuple(arr[o: o + lay.view_nbytes(v)].reshape(n, vh, vw, c)
                  for v, ((vh, vw), o) in enumerate(zip(lay.shapes, lay.view_offsets, strict=True)))
    return Batch(
        rank=rank, epoch=epoch, batch=batch, batches_in_epoch=bie, fingerprint=fp, flags=flags,
        indices=ints[:n], labels=ints[n: 2 * n], replaced=ints[2 * n: 3 * n],
        images=views[0], file_size=fsize, views=views,
    )


def _view_table(mv: memoryview, version: int, k: int, n: int, first: tuple[int, int]) -> tuple:
    """Views 1..k-1's (height, width) from a version 2 file's table (checked against the header's
    view 0); () for version 1."""
    if version == VERSION:
        if k:
            raise BatchFileError(f"a version 1 batch says {k} views")
        return ()
    if not 2 <= k <= MAX_VIEWS:
        raise BatchFileError(f"a version 2 batch says {k} views (2 to {MAX_VIEWS})")
    at = HEADER_SIZE + 24 * n
    if len(mv) < at + VIEW.size * k:
        raise BatchFileError(f"file of {len(mv)} bytes ends inside its view table (torn or truncated)")
    shapes = [VIEW.unpack_from(mv, at + VIEW.size * v)[:2] for v in range(k)]
    if tuple(shapes[0]) != tuple(first):
        raise BatchFileError(f"view table's view 0 is {shapes[0]}, the header's {first}")
    return tuple(tuple(s) for s in shapes[1:])


def read_file(path: str, verify: bool = True) -> Batch:
    """Read a batch file into fresh memory and parse it (for tools and tests)."""
    return parse(read_whole(path), verify=verify)


def read_whole(path: str) -> np.ndarray:
    """A whole file in fresh memory (uint8), not following a symlink."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        buf = np.empty(size, dtype=np.uint8)
        if size:
            copy_into(fd, buf)
    finally:
        os.close(fd)
    return buf


def reserve(fd: int, size: int) -> None:
    """Allocate the whole file before writing it: a full filesystem fails here, before any byte
    is written, and a tmpfs mounted with ``huge=within_size`` backs the file with huge pages
    (about 5x faster to write and 2.5x faster to read than 4 KiB pages, measured here)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            return  # a filesystem without fallocate: plain writes still work
        raise


def copy_into(fd: int, out: np.ndarray) -> None:
    """Fill the uint8 array ``out`` with the first ``out.size`` bytes of ``fd``.

    The file is mapped (``MAP_POPULATE``) and copied with one memcpy: on tmpfs this runs at
    memory bandwidth where ``read(2)`` pays a per-page cost (see BENCHMARKS.md). The caller
    has checked the file's size; published batch files are never truncated or modified.
    """
    size = out.size
    try:
        m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ)
    except (OSError, ValueError):
        readinto_fd(fd, memoryview(out))
        return
    try:
        src = np.frombuffer(m, dtype=np.uint8, count=size)
        np.copyto(out, src)
        del src
    finally:
        m.close()


def readinto_fd(fd: int, view: memoryview) -> int:
    """Fill ``view`` from ``fd`` with ``readv``; raises BatchFileError if the file is shorter."""
    got = 0
    total = view.nbytes
    while got < total:
        k = os.readv(fd, [view[got:]])
        if k == 0:
            raise BatchFileError(f"file ended after {got} of {total} bytes")
        got += k
    return got
