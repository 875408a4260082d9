"""Reading a tar archive's headers, the data skipped: a ``pread`` per header at most (``walk``).

``members`` lists the regular members of a tar (or of a tar inside one, by its byte range) with
each one's data offset and size, applying GNU long names and PAX ``path``/``size`` records to the
member they describe; what it skips, and why, goes to a list. What is read, skipped or an error,
member by member, is stated in ``prefetchd.sources.imagenet``'s docstring.
"""

from __future__ import annotations

import os
import zlib

from prefetchd.sources.base import DatasetError

BLOCK = 512
_ZERO = bytes(BLOCK)
_REGULAR = (b"0", b"\0", b"7")
_EXTENSIONS = {b"L": "GNU long-name header", b"K": "GNU long-link header", b"x": "PAX extended header",
               b"g": "PAX global header"}  # headers whose data describes the next member(s), not a file
_MAX_EXTENSION = 1 << 20  # an extension header's data beyond this is not metadata
_WINDOW_MIN, _WINDOW_MAX = 4096, 256 << 10  # bytes a read of headers takes (``walk``)
_NOT_A_PATH = (b"", b".", b"..")  # names without a slash that are not a member's relative path
_SIZES: dict[bytes, int] = {}  # a size field's bytes -> its value (``_header``)
_OTHER = {b"1": "a hard link", b"2": "a symbolic link", b"3": "a character device", b"4": "a block device",
          b"6": "a FIFO", b"S": "a GNU sparse file", b"g": "a PAX global header (its settings are not applied)"}


def pread(src, size: int, offset: int) -> bytes:
    """``size`` bytes at ``offset`` of ``src``: a descriptor, or an object with ``pread(size, offset)``
    and ``size`` (a shard in a bucket read in large ranged chunks: ``bucketshards.ShardFile``)."""
    return os.pread(src, size, offset) if isinstance(src, int) else src.pread(size, offset)


def size_of(src) -> int:
    """The size of ``src`` (as ``pread`` takes it)."""
    return os.fstat(src).st_size if isinstance(src, int) else src.size


def show(name: bytes) -> str:
    return os.fsdecode(name)


def _header(hdr: bytes, where: str, off: int, last: bytes | None, top: str = "") -> tuple[bytes, bytes, int]:
    """(name, type, size) of the header block ``hdr`` at ``off``; DatasetError if it is not one
    (``top``: the config key naming the archive, when it is the root itself)."""
    chk = hdr[148:156]
    try:
        stored = int(chk.replace(b"\0", b" "), 8)  # int() strips the spaces itself; none left: not a checksum
    except ValueError:
        stored = -1
    # The checksum is the header's byte sum with its own field read as spaces. Adler-32's low half
    # is 1 + that byte sum mod 65521, at C speed (a Python sum of 512 bytes was a third of the
    # scan; of the field's 8, a tenth), and the field's own sum is below 65521; only a header that
    # fails it is summed exactly (some tars sum signed bytes).
    if stored < 0 or stored % 65521 != ((zlib.adler32(hdr) & 0xFFFF) - (zlib.adler32(chk) & 0xFFFF) + 256) % 65521:
        unsigned = sum(hdr) - sum(hdr[148:156]) + 256
        ok = stored in (unsigned, unsigned - 256 * sum(b > 127 for b in hdr[:148] + hdr[156:]))
    else:
        ok = True
    if not ok:
        after = f"after member {show(last)}" if last is not None else "the first header"
        hint = "it is gzip-compressed: decompress it first" if hdr[:2] == b"\x1f\x8b" and last is None else (
            "the archive is corrupt, compressed or not a tar")
        if top and last is None:  # the root itself: say what it could have been
            raise DatasetError(f"{top} {where} is not a directory (an ImageFolder) nor an uncompressed tar "
                               f"archive: no valid tar header at offset 0; {hint}")
        raise DatasetError(f"{where}: no valid tar header at offset {off} ({after}); {hint}")
    end = hdr.find(b"\0", 0, 100)
    name = hdr[:end] if end >= 0 else hdr[:100]
    field = hdr[124:136]
    if field[0] & 0x80:  # GNU base-256, for members of 8 GiB and more
        if field[0] == 0xFF:
            raise DatasetError(f"{where}: member {show(name)} has a negative size")
        size = int.from_bytes(field[1:], "big")
    elif (size := _SIZES.get(field)) is None:  # labels, captions: the same few sizes, each parsed once
        try:
            size = int(field.replace(b"\0", b" ").strip() or b"0", 8)
        except ValueError:
            raise DatasetError(f"{where}: the header at offset {off} has an unreadable size {field!r}") from None
        if len(_SIZES) < 4096:
            _SIZES[field] = size
    if hdr[257:263] == b"ustar\0" and hdr[345] != 0:  # POSIX ustar: a path prefix (GNU tars keep times there)
        name = hdr[345:500].split(b"\0", 1)[0] + b"/" + name
    return name, hdr[156:157], size


def members(fd: int, start: int, end: int, where: str, skipped: list, top: str = "") -> list[tuple[bytes, int, int]]:
    """(normalised name, data offset, size) of every regular member of the tar that occupies
    ``[start, end)`` of ``fd``; the members that are skipped go to ``skipped`` as (name, why).
    A tar ends with a zero block (POSIX writes two, Python's ``tarfile`` reads one): one that
    stops at a member's end without it was cut short there (a download cut at a record boundary),
    and is an error like one cut inside a member."""
    return [m[:3] for m in walk(fd, start, end, where, skipped, top)]


def walk(fd: int, start: int, end: int, where: str, skipped: list, top: str = ""):
    """``members`` one at a time, each as (name, data offset, size, window, window offset): the
    bytes read at ``window offset`` that hold its header and maybe its data (a small member's data,
    a label, is then ``window[data - window offset:][:size]`` with no read of its own).

    The headers are read through that window: a read holds the next header and what follows it,
    ``_WINDOW_MIN`` bytes after a member that skipped past the last read (a JPEG's 110 KB: one read
    per header, as small as the header's), doubling to ``_WINDOW_MAX`` while the members are small
    (many headers a read). Where a read ends does not change what is read: a header cut by it is
    read again whole."""
    off, last = start, None
    ext: dict = {}  # what extension headers said of the next member: "name", "size", "why" (skip it)
    win, at, chunk = b"", start, _WINDOW_MIN // 2
    while end - off >= BLOCK:
        i = off - at
        if i + BLOCK > len(win):
            chunk = min(2 * chunk, _WINDOW_MAX) if off - at - len(win) < chunk else _WINDOW_MIN
            win, at, i = pread(fd, min(chunk, end - off), off), off, 0
            if len(win) < BLOCK:
                break
        hdr = win[i:i + BLOCK]
        if hdr == _ZERO:
            return
        name, kind, size = _header(hdr, where, off - start, last, top)  # offsets in messages: within `where`
        data = off + BLOCK
        if kind == b"0" and not ext and b"/" not in name and name not in _NOT_A_PATH:  # a plain file: below, short
            if size > end - data:
                raise _truncated(where, name, size, data - start, end - data)
            off, last = data + -(-size // BLOCK) * BLOCK, name
            yield name, data, size, win, at
            continue
        if kind == b"S" and hdr[482]:  # old GNU sparse: extension blocks follow the header
            while True:
                ext_block = pread(fd, BLOCK, data)
                data += BLOCK
                if len(ext_block) < BLOCK or data > end or not ext_block[504]:
                    break
        if kind == b"\0" and name.endswith(b"/"):  # an old-style directory (tarfile and GNU tar read it so)
            kind = b"5"
        if kind not in _EXTENSIONS and ext:  # the member the extension headers before it describe
            name, size = ext.get("name", name), ext.get("size", size)
        if kind == b"5" and size:  # tarfile reads a header right after it; we cannot tell which is meant
            raise DatasetError(f"{where}: the directory member {show(name)} at offset {off - start} claims {size} "
                               "bytes of data; the archive is corrupt")
        if size > end - data:
            raise _truncated(where, name, size, data - start, end - data)
        header_at, off, last = off, data + -(-size // BLOCK) * BLOCK, name
        if kind in _EXTENSIONS:
            j = data - at
            body = win[j:j + size] if j + size <= len(win) else pread(fd, size, data) if size <= _MAX_EXTENSION else b""
            _extension(body, kind, name, size, ext, skipped, where, header_at - start)
            continue
        if ext:
            why = ext.get("why")
            ext.clear()
            if why is not None:
                skipped.append((name, why))
                continue
        if kind in _REGULAR and b"/" not in name and name not in _NOT_A_PATH:  # the common case, as below
            yield name, data, size, win, at
        elif kind == b"5":
            pass
        elif kind not in _REGULAR:
            skipped.append((name, _OTHER.get(kind, f"of unsupported type {kind.decode('latin-1')!r}")))
        elif name.startswith(b"/"):
            skipped.append((name, "an absolute path"))
        else:
            parts = [p for p in name.split(b"/") if p and p != b"."]
            if b".." in parts:
                skipped.append((name, "a '..' component"))
            elif parts:
                yield b"/".join(parts), data, size, win, at
    if off < end:
        raise DatasetError(f"{where} is truncated: it ends inside the header after member "
                           f"{show(last) if last is not None else '(none)'} (download it again)")
    raise DatasetError(f"{where} is truncated: it ends after member {show(last) if last is not None else '(none)'} "
                       "without the end-of-archive blocks, so members after it may be missing (an incomplete "
                       "download: download it again)")


def _truncated(where: str, name: bytes, size: int, at: int, left: int) -> DatasetError:
    return DatasetError(f"{where}: member {show(name)} needs {size} bytes at offset {at} but its archive ends "
                        f"{max(left, 0)} bytes later; the archive is truncated (download it again)")


def _extension(body: bytes, kind: bytes, name: bytes, size: int, ext: dict, skipped: list, where: str, at: int) -> None:
    """Read the extension header of type ``kind`` (its data ``body``, of ``size`` bytes) into
    ``ext``, what it says of the next member; a PAX global header goes to ``skipped``, or is an
    error if it sets a path or size for every member after it (naming it: at offset ``at`` of
    ``where``). Every member of webdataset's ``TarWriter`` has one (its ``mtime``): it is fast."""
    if size > _MAX_EXTENSION:
        ext["why"] = f"described by a {_EXTENSIONS[kind]} of {size} bytes (too large to be metadata)"
        return
    if kind == b"x" and body[-1:] == b"\n":  # TarWriter's: one mtime record, which changes nothing here
        sp = body.find(b" ", 0, 12)  # as _pax_records reads it: "<length> mtime=<value>\n", the length all of it
        if sp > 0 and body[sp + 1:sp + 7] == b"mtime=" and body[:sp].isdigit() and int(body[:sp]) == len(body):
            return
    if kind == b"L":
        ext["name"] = body.split(b"\0", 1)[0]
        return
    if kind == b"K":  # a link's target: links are skipped anyway
        return
    try:
        records = _pax_records(body)
        new_size = int(records[b"size"]) if records.get(b"size") else None
        if new_size is not None and new_size < 0:
            raise ValueError(new_size)
    except ValueError:
        if kind == b"g":
            raise DatasetError(f"{where}: the {_EXTENSIONS[kind]} at offset {at} is malformed; the archive is "
                               "corrupt") from None
        ext["why"] = f"described by a malformed {_EXTENSIONS[kind]}"
        return
    sparse = b"GNU.sparse." in body and any(k.startswith(b"GNU.sparse.") for k in records)
    if kind == b"g":
        sets = [k.decode("latin-1") for k in records if k in (b"path", b"size") or k.startswith(b"GNU.sparse.")]
        if sets:
            raise DatasetError(f"{where}: the {_EXTENSIONS[kind]} at offset {at} sets {', '.join(sets)} for every "
                               "member after it: such archives are not supported (create it again without a global "
                               "header)")
        skipped.append((name, "a PAX global header (its settings are not applied)"))
        return
    if sparse:
        ext["why"] = "a PAX sparse file"
    if records.get(b"path"):
        ext["name"] = records[b"path"]
    if new_size is not None:
        ext["size"] = new_size


def _pax_records(body: bytes) -> dict[bytes, bytes]:
    """The records of a PAX header's data, each ``"<length> <key>=<value>\\n"``; ValueError if
    malformed. An empty value unsets the key (POSIX), which here means: not given."""
    records: dict[bytes, bytes] = {}
    pos = 0
    while pos < len(body) and body[pos] != 0:
        space = body.index(b" ", pos)
        length = int(body[pos:space])
        record = body[space + 1:pos + length]
        if length <= space - pos or pos + length > len(body) or not record.endswith(b"\n") or b"=" not in record:
            raise ValueError(f"bad record at {pos}")
        key, _, value = record[:-1].partition(b"=")
        records[key] = value
        pos += length
    return records


def unique(members: list, where: str, skipped: list) -> dict[bytes, tuple[int, int]]:
    found: dict[bytes, tuple[int, int]] = {}
    for name, pos, size in members:
        if name in found:
            skipped.append((name, "a duplicate name: the last copy is used, as extraction would"))
        found[name] = (pos, size)
    return found


def walk_key(name: bytes) -> tuple[str, str]:
    """The folder scan's (and torchvision's) order: by folder path, then name, compared as ``str``
    (``os.fsdecode``: non-UTF-8 bytes as surrogates, as ``os.walk`` gives them), not as bytes."""
    folder, _, base = name.rpartition(b"/")
    return os.fsdecode(folder), os.fsdecode(base)


def image_members(members: dict, exts: tuple[bytes, ...], flat: bool, skipped: list) -> list[tuple[bytes, int, int]]:
    """The members (``unique``'s) that are samples, in ``walk_key`` order: images by extension, not
    macOS ``._*`` files (noted in ``skipped``), and of a flat set only the top level's."""
    keep = []
    for name, (pos, size) in members.items():
        if not name.lower().endswith(exts):
            continue
        if name.rpartition(b"/")[2].startswith(b"._"):  # a Mac's tar writes one beside each file with xattrs
            skipped.append((name, "a macOS AppleDouble file (._*: metadata, not an image)"))
            continue
        if b"/" in name and (flat or any(d.startswith(b".") for d in name.split(b"/")[:-1])):
            continue
        keep.append((name, pos, size))
    keep.sort(key=lambda m: walk_key(m[0]))
    return keep
