"""The WebDataset shard index as the scan before the one-pass scan (tree 4283a04) built it:
a header per ``pread``, then the samples grouped, then a ``pread`` per label. The reference the
faster scan (``prefetchd.sources.webdataset``: windows of headers, labels from the same reads,
shards in processes) must equal byte for byte: kept verbatim, slow and simple, for
``tests/test_shards_scan.py``. Only the module names are changed (``_header`` and ``members``
live here, from ``tarheaders``)."""

from __future__ import annotations

import json
import logging
import os
import zlib
from dataclasses import replace

from prefetchd.core.bars import bar
from prefetchd.sources.archive import (
    Arrays,
    TarIndex,
    kept_notes,
    open_archive,
    unchanged,
    warn_skipped,
)
from prefetchd.sources.base import DatasetError, numbered_classes
from prefetchd.sources.shardnames import resolve
from prefetchd.sources.store import identity_of
from prefetchd.sources.tarheaders import (
    _EXTENSIONS,
    _MAX_EXTENSION,
    _OTHER,
    _REGULAR,
    _ZERO,
    BLOCK,
    _pax_records,
    show,
)
from prefetchd.sources.webdataset import _LABEL_MEMBER_MAX, LAYOUT, parse_label, split_name

log = logging.getLogger("prefetchd.dataset")


def _header(hdr: bytes, where: str, off: int, last: bytes | None, top: str = "") -> tuple[bytes, bytes, int]:
    """(name, type, size) of the header block ``hdr`` at ``off``; DatasetError if it is not one
    (``top``: the config key naming the archive, when it is the root itself)."""
    try:
        stored = int(hdr[148:156].replace(b"\0", b" ").strip() or b"-1", 8)
    except ValueError:
        stored = -1
    # The checksum is the header's byte sum with its own field read as spaces. Adler-32's low half
    # is 1 + that byte sum mod 65521, at C speed (a Python sum of 512 bytes was a third of the
    # scan); only a header that fails it is summed exactly (some tars sum signed bytes).
    if stored < 0 or stored % 65521 != ((zlib.adler32(hdr) & 0xFFFF) - 1 - sum(hdr[148:156]) + 256) % 65521:
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
    name = hdr[:100].split(b"\0", 1)[0]
    field = hdr[124:136]
    if field[0] & 0x80:  # GNU base-256, for members of 8 GiB and more
        if field[0] == 0xFF:
            raise DatasetError(f"{where}: member {show(name)} has a negative size")
        size = int.from_bytes(field[1:], "big")
    else:
        try:
            size = int(field.replace(b"\0", b" ").strip() or b"0", 8)
        except ValueError:
            raise DatasetError(f"{where}: the header at offset {off} has an unreadable size {field!r}") from None
    if hdr[257:263] == b"ustar\0" and hdr[345] != 0:  # POSIX ustar: a path prefix (GNU tars keep times there)
        name = hdr[345:500].split(b"\0", 1)[0] + b"/" + name
    return name, hdr[156:157], size


def members(fd: int, start: int, end: int, where: str, skipped: list, top: str = "") -> list[tuple[bytes, int, int]]:
    """(normalised name, data offset, size) of every regular member of the tar that occupies
    ``[start, end)`` of ``fd``; the members that are skipped go to ``skipped`` as (name, why).
    A tar ends with a zero block (POSIX writes two, Python's ``tarfile`` reads one): one that
    stops at a member's end without it was cut short there (a download cut at a record boundary),
    and is an error like one cut inside a member."""
    out = []
    off, last = start, None
    ext: dict = {}  # what extension headers said of the next member: "name", "size", "why" (skip it)
    while end - off >= BLOCK:
        hdr = os.pread(fd, BLOCK, off)
        if len(hdr) < BLOCK:
            break
        if hdr == _ZERO:
            return out
        name, kind, size = _header(hdr, where, off - start, last, top)  # offsets in messages: within `where`
        data = off + BLOCK
        if kind == b"S" and hdr[482]:  # old GNU sparse: extension blocks follow the header
            while True:
                ext_block = os.pread(fd, BLOCK, data)
                data += BLOCK
                if len(ext_block) < BLOCK or data > end or not ext_block[504]:
                    break
        if kind == b"\0" and name.endswith(b"/"):  # an old-style directory (tarfile and GNU tar read it so)
            kind = b"5"
        if kind not in _EXTENSIONS:  # the member the extension headers before it describe
            name, size = ext.get("name", name), ext.get("size", size)
        if kind == b"5" and size:  # tarfile reads a header right after it; we cannot tell which is meant
            raise DatasetError(f"{where}: the directory member {show(name)} at offset {off - start} claims {size} "
                               "bytes of data; the archive is corrupt")
        if size > end - data:
            raise DatasetError(f"{where}: member {show(name)} needs {size} bytes at offset {data - start} but its archive "
                               f"ends {max(end - data, 0)} bytes later; the archive is truncated (download it again)")
        header_at, off, last = off, data + -(-size // BLOCK) * BLOCK, name
        if kind in _EXTENSIONS:
            _extension(fd, kind, name, data, size, ext, skipped, f"{where}: the {_EXTENSIONS[kind]} at offset "
                       f"{header_at - start}")
            continue
        why = ext.get("why")
        ext.clear()
        if why is not None:
            skipped.append((name, why))
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
                out.append((b"/".join(parts), data, size))
    if off < end:
        raise DatasetError(f"{where} is truncated: it ends inside the header after member "
                           f"{show(last) if last is not None else '(none)'} (download it again)")
    raise DatasetError(f"{where} is truncated: it ends after member {show(last) if last is not None else '(none)'} "
                       "without the end-of-archive blocks, so members after it may be missing (an incomplete "
                       "download: download it again)")


def _extension(fd: int, kind: bytes, name: bytes, data: int, size: int, ext: dict, skipped: list, what: str) -> None:
    """Read the extension header of type ``kind`` (its data: ``size`` bytes at ``data``) into
    ``ext``, what it says of the next member; a PAX global header goes to ``skipped``, or is an
    error if it sets a path or size for every member after it (``what`` names it)."""
    if size > _MAX_EXTENSION:
        ext["why"] = f"described by a {_EXTENSIONS[kind]} of {size} bytes (too large to be metadata)"
        return
    body = os.pread(fd, size, data)
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
            raise DatasetError(f"{what} is malformed; the archive is corrupt") from None
        ext["why"] = f"described by a malformed {_EXTENSIONS[kind]}"
        return
    sparse = any(k.startswith(b"GNU.sparse.") for k in records)
    if kind == b"g":
        sets = [k.decode("latin-1") for k in records if k in (b"path", b"size") or k.startswith(b"GNU.sparse.")]
        if sets:
            raise DatasetError(f"{what} sets {', '.join(sets)} for every member after it: such archives are not "
                               "supported (create it again without a global header)")
        skipped.append((name, "a PAX global header (its settings are not applied)"))
        return
    if sparse:
        ext["why"] = "a PAX sparse file"
    if records.get(b"path"):
        ext["name"] = records[b"path"]
    if new_size is not None:
        ext["size"] = new_size


def _label(fd: int, sample: dict[bytes, tuple[int, int]], how: str, jkey: str | None) -> int | str:
    """The sample's label, or why it has none (a str)."""
    if how == "none":
        return -1
    names = ("cls", "txt") if how == "cls" else ("json",)
    ext = next((e for e in names if e.encode() in sample), None)
    if ext is None:
        return f"no .{' or .'.join(names)} member for its label"
    pos, size = sample[ext.encode()]
    if size > _LABEL_MEMBER_MAX:
        return f"its .{ext} member is {size} bytes: not a label"
    text = os.pread(fd, size, pos)
    try:
        if how == "cls":
            value = int(text.strip())
        else:
            value = json.loads(text)
            for part in (jkey or "").split("."):
                value = value[part]
    except (ValueError, KeyError, TypeError, IndexError):
        what = f"its .{ext} member {text[:40]!r} is not an integer" if how == "cls" else (
            f"its .json member has no {jkey!r} (or is not JSON)")
        return what
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**31:
        return f"its label {value!r} (.{ext}) is not an integer in [0, 2**31)"
    return value


def _samples(found: list[tuple[bytes, int, int]]) -> list[tuple[bytes, dict[bytes, tuple[int, int]], list]]:
    """Consecutive members of one key grouped, as webdataset groups them: (key, {ext: (pos, size)},
    problems)."""
    out: list = []
    for name, pos, size in found:
        parts = split_name(name)
        if parts is None:
            continue
        key, ext = parts
        if not out or out[-1][0] != key:
            out.append((key, {}, []))
        sample = out[-1]
        if ext in sample[1]:
            sample[2].append(f"two members of extension .{ext.decode('latin-1')}")
        sample[1][ext] = (pos, size)
    return out


def scan_shard(fd: int, where: str, exts: tuple[bytes, ...], how: str, jkey: str | None, skipped: list):
    """The samples of one shard open as ``fd``: (member name, label, pos, size) each; what is
    skipped goes to ``skipped`` as (key, why)."""
    size = os.fstat(fd).st_size
    if size == 0:
        raise DatasetError(f"the shard {where} is empty (0 bytes): not a tar; an interrupted write? write it again "
                           "or take it out of dataset.root")
    out = []
    for key, sample, problems in _samples(members(fd, 0, size, where, skipped)):
        images = [e for e in sample if b"." + e in exts]
        if not images:
            problems.append(f"no image member (extensions {', '.join(e.decode() for e in exts)}); it has "
                            f"{', '.join('.' + e.decode('latin-1') for e in sample)}")
            dotted = next((e for e in sample if b"." + e.rpartition(b".")[2] in exts and b"." in e), None)
            if dotted is not None:  # TarWriter writes a key with a dot as is; webdataset splits it there
                problems.append(f"a key with a dot: webdataset's key ends at the first dot of a member's name "
                                f"({(key + b'.' + dotted).decode('latin-1')} is key {key.decode('latin-1')}, "
                                f"extension {dotted.decode('latin-1')}); write the shards again with keys "
                                "without dots")
        elif len(images) > 1:
            problems.append(f"{len(images)} image members ({', '.join('.' + e.decode() for e in images)}): which "
                            "is the image is not said")
        label = _label(fd, sample, how, jkey) if not problems else 0
        if isinstance(label, str):
            problems.append(label)
        if problems:
            skipped.append((key, "; ".join(problems)))
            continue
        pos, n = sample[images[0]]
        out.append((key + b"." + images[0], label, pos, n))
    return out


def scan(root: str, extensions: tuple[str, ...], label: str = "cls",
         key: str = "dataset.root") -> tuple[TarIndex, list]:
    """Index the shards ``root`` names (see the module docstring). Returns the index and the stamps
    (each shard's identity, and the list file's or folder's) that validate a cache of it."""
    how, jkey = parse_label(label)
    base, shards, stamps = resolve(root, key)
    if len(shards) > 65535:
        raise DatasetError(f"{key} {root} names {len(shards)} shards; at most 65535 are supported")
    exts = tuple(e.lower().encode() for e in extensions)
    out = Arrays()
    out.multi = len(shards) > 1
    notes: list = []
    identity = []
    empty = []
    sbar = bar(shards, desc=f"indexing {root}", unit="shard", leave=False)
    for a, rel in enumerate(sbar):
        path = os.path.join(base, rel)
        fd = open_archive(path, "the shard")
        try:
            ident = identity_of(os.fstat(fd))  # before the headers: the offsets are this file's
            skipped: list = []
            found = scan_shard(fd, path, exts, how, jkey, skipped)
            unchanged(fd, path, ident)
        finally:
            os.close(fd)
        identity.append(ident)
        stamps.append([path, *ident])
        warn_skipped(path, skipped, notes)
        prefix = os.fsencode(rel) + b"/"
        for name, lab, pos, size in found:
            out.add(prefix + name, lab, pos, size, a)
        if not found:
            empty.append(rel)
        sbar.set_postfix_str(f"{len(out.labels):,} samples", refresh=False)
    sbar.close()
    if empty:
        note = (f"{len(empty)} shard(s) hold no samples: {', '.join(empty[:5])}{' ...' if len(empty) > 5 else ''}")
        log.warning("%s", note)
        notes.append(note)
    if not len(out.labels):
        raise DatasetError(f"{key} {root}: its {len(shards)} shard(s) hold no samples with an image "
                           f"({', '.join(extensions)}) and a label ({label})" + (
                               f"; e.g. {notes[0]}" if notes else ""))
    top = max(out.labels) if how != "none" else -1
    k = out.labels.index(top)  # the sample of the largest label, for a message
    where = os.path.join(base, show(bytes(out.blob[out.ends[k]:out.ends[k + 1]])))
    index = out.index(base, numbered_classes(top, key, root, where), LAYOUT, tuple(shards))
    return replace(index, identity=tuple(identity), skipped=kept_notes(notes), kind=LAYOUT), stamps


