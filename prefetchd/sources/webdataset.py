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
headers and the label members, never the images, in one pass (``tarheaders.walk``: a read holds the
next header and what follows it, so a label comes with its header, and small members' headers
come many a read; a 110 KB JPEG costs one small read for its header). Classes are
``"0" .. str(max label)``, as a file list's.

**Processes**: the first shard is scanned here; if the rest would take over ``_POOL_FROM_S``
CPU seconds by its measure, they are scanned by ``scanpool`` (a process a usable core, at most
``os.cpu_count()`` and 16), and merged in shard order: the index, the skipped list and the first error
are those of one process scanning them in order.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
from dataclasses import replace

from prefetchd.core.bars import bar
from prefetchd.core.hostread import read_host
from prefetchd.core.limits import cpu_bound
from prefetchd.sources import scanpool
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
from prefetchd.sources.tarheaders import BLOCK, _header, _pax_records, pread, show, size_of, walk

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


_LABEL_EXTS = {"cls": (b"cls", b"txt"), "json": (b"json",), "none": ()}  # the members a label is read from


def _label(fd: int, sample: dict[bytes, tuple[int, int]], bodies: dict, how: str, jkey: str | None) -> int | str:
    """The sample's label, or why it has none (a str); ``bodies``: the label members' data read
    with their headers (None: not read yet)."""
    if how == "none":
        return -1
    names = _LABEL_EXTS[how]
    ext = names[0] if names[0] in sample else next((e for e in names[1:] if e in sample), None)
    if ext is None:
        return f"no .{' or .'.join(e.decode() for e in names)} member for its label"
    pos, size = sample[ext]
    if size > _LABEL_MEMBER_MAX:
        return f"its .{ext.decode()} member is {size} bytes: not a label"
    text = bodies.get(ext)
    if text is None:
        text = pread(fd, size, pos)
    try:
        if how == "cls":
            value = int(text.strip())
        else:
            value = json.loads(text)
            for part in (jkey or "").split("."):
                value = value[part]
    except (ValueError, KeyError, TypeError, IndexError):
        what = f"its .{ext.decode()} member {text[:40]!r} is not an integer" if how == "cls" else (
            f"its .json member has no {jkey!r} (or is not JSON)")
        return what
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**31:
        return f"its label {value!r} (.{ext.decode()}) is not an integer in [0, 2**31)"
    return value


def scan_shard(fd: int, where: str, exts: tuple[bytes, ...], how: str, jkey: str | None, skipped: list,
               prefix: bytes = b"") -> tuple[Arrays, str | None]:
    """The samples of one shard open as ``fd``, as index rows named ``prefix + member name``, and
    the first row the index cannot hold (``Arrays.add``'s error) or None; what is skipped goes to
    ``skipped`` as (name or key, why): the members ``tarheaders`` skips, then the samples.

    One pass over the headers (``tarheaders.walk``): consecutive members of one key are grouped as
    webdataset groups them, and a label member's data is taken from the read that held its header."""
    size = size_of(fd)
    if size == 0:
        raise DatasetError(f"the shard {where} is empty (0 bytes): not a tar; an interrupted write? write it again "
                           "or take it out of dataset.root")
    images_of = frozenset(e[1:] for e in exts if e.startswith(b"."))  # b"jpg" is an image if b".jpg" is in exts
    wanted = _LABEL_EXTS[how]
    out, bad, dropped = Arrays(), None, []
    blob, ends, labels, blocks, sizes = out.blob, out.ends, out.labels, out.block, out.size  # Arrays.add's, inline

    def sample_done(key: bytes, sample: dict, bodies: dict, problems: list) -> None:
        nonlocal bad
        images = [e for e in sample if e in images_of]
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
        label = _label(fd, sample, bodies, how, jkey) if not problems else 0
        if isinstance(label, str):
            problems.append(label)
        if problems:
            dropped.append((key, "; ".join(problems)))
        elif bad is None:
            pos, n = sample[images[0]]
            if n < 1 << 32 and pos < BLOCK << 32:
                blob.extend(prefix + key + b"." + images[0])
                ends.append(len(blob))
                labels.append(label)
                blocks.append(pos // BLOCK)
                sizes.append(n)
                return
            try:
                out.add(prefix + key + b"." + images[0], label, pos, n)
            except DatasetError as e:  # raised by the caller once the shard is read, as when it added them
                bad = str(e)

    key, sample, bodies, problems = None, {}, {}, []
    for name, pos, n, win, at in walk(fd, 0, size, where, skipped):
        if b"/" not in name and name[:1] not in b"._":  # split_name's answer for a plain name, faster
            dot = name.find(b".")
            if dot < 0:
                continue
            k, ext = name[:dot], name[dot + 1:].lower()
        else:
            parts = split_name(name)
            if parts is None:
                continue
            k, ext = parts
        if k != key:
            if key is not None:
                sample_done(key, sample, bodies, problems)
            key, sample, bodies, problems = k, {}, {}, []
        if ext in sample:
            problems.append(f"two members of extension .{ext.decode('latin-1')}")
        sample[ext] = (pos, n)
        if ext in wanted:
            j = pos - at
            bodies[ext] = win[j:j + n] if j + n <= len(win) else None
    if key is not None:
        sample_done(key, sample, bodies, problems)
    skipped.extend(dropped)
    return out, bad


def scan_path(path: str, rel: str, exts: tuple[bytes, ...], how: str, jkey: str | None) -> tuple:
    """One shard's scan, as ``scan`` uses it (here or in a ``scanpool`` process): (identity,
    skipped, rows, the first row the index cannot hold or None)."""
    fd = open_archive(path, "the shard")
    try:
        ident = identity_of(os.fstat(fd))  # before the headers: the offsets are this file's
        skipped: list = []
        rows, bad = scan_shard(fd, path, exts, how, jkey, skipped, os.fsencode(rel) + b"/")
        unchanged(fd, path, ident)
    finally:
        os.close(fd)
    return ident, skipped, rows, bad


_POOL_FROM_S = 1.0  # CPU seconds the rest of the shards would take here (by the first's) that a pool pays for
_MAX_PROCS = 16  # ~40 MB each; past this, starting them costs about what another one saves


def _procs(first_s: float, rest: int) -> tuple[int, str]:
    """Processes for the rest of a scan whose first shard took ``first_s`` CPU seconds, and why: one
    (this one) for a short scan, else one a usable core (``os.cpu_count()`` at most; fewer under an
    affinity mask, a cpuset or a CPU quota: ``core.limits.cpu_bound``)."""
    if first_s * rest < _POOL_FROM_S:
        return 1, "a short scan"
    bound = cpu_bound(read_host())
    return max(1, min(bound.value, os.cpu_count() or 1, rest, _MAX_PROCS)), bound.what


def _scanned(jobs: list[tuple], procs: int | None):
    """``scan_path`` of each job, in order: the first here, the rest here or by ``scanpool``."""
    t = time.thread_time()
    yield scan_path(*jobs[0])
    rest = jobs[1:]
    n, why = _procs(time.thread_time() - t, len(rest)) if procs is None else (min(procs, len(rest)), "as asked")
    if n <= 1:
        for job in rest:
            yield scan_path(*job)
        return
    log.info("indexing %d more shards in %d processes (%s)", len(rest), n, why)
    done = 0
    try:
        with contextlib.closing(scanpool.ordered(scan_path, rest, n, lambda i: rest[i][0])) as results:
            for found in results:
                yield found
                done += 1
    except scanpool.Unavailable as e:  # the same index, in this process
        log.warning("cannot index shards in other processes (%s): indexing the other %d here", e, len(rest) - done)
        for job in rest[done:]:
            yield scan_path(*job)


def scan(root: str, extensions: tuple[str, ...], label: str = "cls",
         key: str = "dataset.root", procs: int | None = None) -> tuple[TarIndex, list]:
    """Index the shards ``root`` names (see the module docstring). Returns the index and the stamps
    (each shard's identity, and the list file's or folder's) that validate a cache of it. ``procs``:
    processes to scan in (1: this one alone); None: as many as pay (``_procs``)."""
    how, jkey = parse_label(label)
    base, shards, stamps = resolve(root, key)
    exts = tuple(e.lower().encode() for e in extensions)
    identity = []

    def results():
        with contextlib.closing(_scanned(jobs, procs)) as found:
            for a, (ident, skipped, rows, bad) in enumerate(found):
                identity.append(ident)
                stamps.append([jobs[a][0], *ident])
                yield rows, bad, skipped

    jobs = [(os.path.join(base, rel), rel, exts, how, jkey) for rel in shards]
    with contextlib.closing(results()) as scanned:
        index = collect(root, base, shards, scanned, extensions, label, key)
    return replace(index, identity=tuple(identity)), stamps


def collect(root: str, base: str, shards: list[str], scanned, extensions: tuple[str, ...], label: str,
            key: str) -> TarIndex:
    """The index of ``shards`` (names relative to ``base``) from ``scanned``: each shard's
    ``scan_shard`` result (rows, the first row the index cannot hold or None) and skipped list, in
    the shards' order (a local scan's or a bucket's, ``bucketshards``). Its ``identity`` is the
    caller's to set."""
    if len(shards) > 65535:
        raise DatasetError(f"{key} {root} names {len(shards)} shards; at most 65535 are supported")
    out = Arrays()
    out.multi = len(shards) > 1
    notes: list = []
    empty = []
    sbar = bar(total=len(shards), desc=f"indexing {root}", unit="shard", leave=False)
    for a, (rel, (rows, bad, skipped)) in enumerate(zip(shards, scanned, strict=True)):
        warn_skipped(os.path.join(base, rel), skipped, notes)
        if bad is not None:
            raise DatasetError(bad)
        out.extend(rows, a)
        if not len(rows.labels):
            empty.append(rel)
        sbar.update()
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
