"""WebDataset tar shards, read in place: the ``webdataset`` layout's index.

**Which shards** (``shardnames``): ``dataset.root`` is a folder of ``.tar`` shards (its top level,
in name order), a brace pattern as webdataset writes it (``/data/wds/train-{000000..001023}.tar``:
numeric ranges, zero-padded to the bounds' width, and ``{a,b}`` lists, expanded in order), a text
file listing shards (one a line, relative to the file's folder; ``#`` comments), or one shard.
A pattern or list naming a shard that is not there is an error naming it: a set with shards
missing trains on part of the data without a word.

**Which samples**, as webdataset defines them (``webdataset.tariterators``): a member's key is its
path up to the first dot of its base name (``a/n01440764_10026`` of ``a/n01440764_10026.jpg``), its
extension the rest, lower-cased (``jpg``, ``seg.png``); consecutive members of one key are one
sample. Members without a dot, webdataset's ``__key__``-style metadata and macOS ``._*`` files
are no part of any sample. The image is the sample's member whose extension is one of
``dataset.extensions`` (the whole extension: ``seg.png`` is not ``.png``); the default extensions
are ``.jpg .jpeg .png .webp`` here, as webdataset users name them. The label (``dataset.label``):

* ``cls`` (the default): the integer text of the ``.cls`` member (else the ``.txt`` one);
* ``json:KEY``: the integer under ``KEY`` (``a.b``: nested) in the ``.json`` member;
* ``none``: no label, -1 for every sample (unlabelled sets).

A sample without an image, with two, with a label missing or not a non-negative integer, or with
two members of one extension (webdataset itself stops there) is skipped and kept with its reason
(``Index.skipped``: ``prefetchd check`` lists them): never given a made-up label.

**Reading and identity**: ``archive``'s (one positioned read per sample, each shard held to its
identity as indexed; ``tarrecheck`` when its ctime alone moved). The index is built from the tar
headers (``tarheaders``: one 512-byte read per member) and the label members (one small read each),
never the images. Classes are ``"0" .. str(max label)``, as a file list's.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import replace

from prefetchd.core.bars import bar
from prefetchd.sources.archive import (
    Arrays,
    TarIndex,
    kept_notes,
    load_cached,
    open_archive,
    save,
    unchanged,
    warn_skipped,
)
from prefetchd.sources.base import DatasetError, cache_path, numbered_classes
from prefetchd.sources.shardnames import resolve
from prefetchd.sources.store import identity_of
from prefetchd.sources.tarheaders import BLOCK, _header, _pax_records, members, pread, show, size_of

log = logging.getLogger("prefetchd.dataset")

LAYOUT = "webdataset"
DEFAULT_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp")
_LABEL_MEMBER_MAX = 1 << 20  # a label member beyond this is not a label
_BASE_PLUS_EXT = re.compile(rb"^((?:.*/|)[^.]+)\.([^/]*)$")  # webdataset's base_plus_ext
_META = re.compile(rb"__[^/]*__($|/)")  # webdataset's skip_meta


def split_name(name: bytes) -> tuple[bytes, bytes] | None:
    """(key, lower-cased extension) of a member name as webdataset splits it; None: no part of a sample."""
    base = name.rpartition(b"/")[2]
    if base.startswith(b"._") or _META.match(name):
        return None
    m = _BASE_PLUS_EXT.match(name)
    if not m:
        return None
    return m.group(1), m.group(2).lower()


def parse_label(spec: str) -> tuple[str, str | None]:
    """``dataset.label`` as (how, json key): ``cls``, ``json:KEY`` or ``none``; DatasetError otherwise."""
    if spec in ("cls", "none"):
        return spec, None
    if spec.startswith("json:") and spec[5:]:
        return "json", spec[5:]
    raise DatasetError(f"dataset.label must be cls, json:KEY or none, got {spec!r}")


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
    text = pread(fd, size, pos)
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
    size = size_of(fd)
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
    exts = tuple(e.lower().encode() for e in extensions)
    identity = []

    def one(rel: str) -> tuple[list, list]:
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
        return found, skipped

    index = collect(root, base, shards, map(one, shards), extensions, label, key)
    return replace(index, identity=tuple(identity)), stamps


def collect(root: str, base: str, shards: list[str], scanned, extensions: tuple[str, ...], label: str,
            key: str) -> TarIndex:
    """The index of ``shards`` (names relative to ``base``) from ``scanned``: each shard's
    ``scan_shard`` result and skipped list, in the shards' order (a local scan's or a bucket's,
    ``bucketshards``). Its ``identity`` is the caller's to set."""
    if len(shards) > 65535:
        raise DatasetError(f"{key} {root} names {len(shards)} shards; at most 65535 are supported")
    out = Arrays()
    out.multi = len(shards) > 1
    notes: list = []
    empty = []
    sbar = bar(shards, desc=f"indexing {root}", unit="shard", leave=False)
    for a, (rel, (found, skipped)) in enumerate(zip(sbar, scanned, strict=True)):
        warn_skipped(os.path.join(base, rel), skipped, notes)
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
    top = max(out.labels) if parse_label(label)[0] != "none" else -1
    k = out.labels.index(top)  # the sample of the largest label, for a message
    where = os.path.join(base, show(bytes(out.blob[out.ends[k]:out.ends[k + 1]])))
    index = out.index(base, numbered_classes(top, key, root, where), LAYOUT, tuple(shards))
    return replace(index, skipped=kept_notes(notes), kind=LAYOUT)


def load(root: str, extensions: tuple[str, ...], label: str, cache_dir: str | None, use_cache: bool = True,
         key: str = "dataset.root") -> tuple[TarIndex, bool]:
    """As ``dataset.load_index`` for shards: (index, from_cache)."""
    # |2: a cache from before the folder's split and gap checks (resolve) is not trusted to hold one whole split
    cdir = cache_path(cache_dir, f"{root}|label={label}|2", LAYOUT, extensions)
    if use_cache:
        cached = load_cached(cdir)
        if cached is not None:
            return cached, True
    t0 = time.monotonic()
    index, stamps = scan(root, extensions, label, key)
    index = replace(index, scan_s=round(time.monotonic() - t0, 3))
    if use_cache:
        try:
            index = save(cdir, index, stamps)
        except OSError as e:
            log.warning("cannot write the index cache in %s (%s); the next start scans again", cdir, e.strerror)
    return index, False


def looks_like_shards(fd: int, size: int, exts: tuple[bytes, ...], probe: int = 64) -> bool | None:
    """Do the first ``probe`` members of the tar open as ``fd`` look like WebDataset samples? What
    ``dataset.layout: auto`` asks of a tar that is no tar of class tars. Yes when a ``.cls`` member
    is there (webdataset's label, in no class tar), or when at least half the keys with an image
    have another member too (a label, a caption: the last sample of a shard may have its label in
    the next shard); None when the tar holds no member to judge by (empty: ask the next shard)."""
    seen: dict[bytes, set[bytes]] = {}
    off, long_name = 0, None
    for _ in range(probe):
        if off + BLOCK > size:
            break
        hdr = pread(fd, BLOCK, off)
        if len(hdr) < BLOCK or hdr == bytes(BLOCK):
            break
        try:
            name, kind, n = _header(hdr, "", off, None)
        except DatasetError:
            return False
        data, off = off + BLOCK, off + BLOCK + -(-n // BLOCK) * BLOCK
        if kind in (b"L", b"x") and n <= _LABEL_MEMBER_MAX:  # a name over 100 bytes: the next member's
            body = pread(fd, n, data)
            try:
                long_name = body.split(b"\0", 1)[0] if kind == b"L" else _pax_records(body).get(b"path", long_name)
            except ValueError:
                pass
            continue
        name, long_name = long_name or name, None
        parts = split_name(name)
        if parts is not None:
            if parts[1] == b"cls" or parts[1].endswith(b".cls"):  # a dotted key's label too (``a.b.cls``)
                return True
            seen.setdefault(parts[0], set()).add(parts[1])
    if not seen:
        return None
    with_image = [e for e in seen.values() if any(b"." + x in exts for x in e)]
    return 2 * sum(len(e) > 1 for e in with_image) >= len(with_image) > 0
