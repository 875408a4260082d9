"""Datasets read in place from tar archives: ImageNet as downloaded, never extracted.

Layouts (``dataset.choose`` tells them from an ImageFolder and from mixtures it refuses):

* ``tar``: ``root`` is a tar of per-class tars (``ILSVRC2012_img_train.tar``: ``n01440764.tar``,
  ... each holding that class's JPEGs). A class is a top-level ``<name>.tar`` member.
* ``tars``: ``root`` is a folder of per-class tars (the train tar extracted one level).
* ``flat-tar``: ``root`` is a tar of images with no class tars (``ILSVRC2012_img_val.tar``), and
  ``flat-folder``: a folder of them, both labelled through the devkit (``prefetchd.sources.devkit``).

**Order.** Classes are sorted by name; a class's images are ordered as ``scan_image_folder``
walks the extracted folder (torchvision's ``ImageFolder`` order: folders by their whole path, then
file names, compared as ``str`` with non-UTF-8 bytes as surrogates; hidden folders and ``._*``
files skipped, extensions matched case-insensitively). The relative paths are those of the
extracted ImageFolder (``<class>/<member>``), so the index's paths, labels and fingerprint, and
hence every batch, are byte for byte those of the extracted folder, with one exception: hard
and symbolic links in a class tar are skipped here (warned, listed by ``check``) where extracting
makes files of them. A flat set is in name order.

**Reading and identity** (``archive``): the scan reads the tar headers only (``tarheaders``: a
``pread`` per header at most, the data skipped); a worker reads a sample with one positioned read,
checked against the archive's identity as indexed (``archive.TarIndex.read``).

**Unusual and hostile members** each have one outcome:

* read as the next member's metadata: a PAX extended header's (``x``, what Python's ``tarfile``,
  ``tar --format=posix`` and bsdtar write) ``path`` and ``size`` records, and a GNU long name
  (``L``); other PAX records (times, owners, xattrs) and GNU long link names (``K``) are ignored.
  The member is then judged by its full name like any other, and its data offset stays exact;
* skipped, with one warning per archive naming them: a path that is absolute or has a ``..``
  component; hard and symbolic links, devices, FIFOs, GNU sparse files (``S``, or PAX
  ``GNU.sparse.*`` records) and other non-regular types; a member whose extension header is
  malformed or over 1 MiB; a PAX global header (``g``) that sets no path or size (ignored);
* a duplicate name: the last copy is used, as extraction would, with a warning;
* a one-line error naming the archive and the member: a header that is not a tar header (bad
  checksum: corrupt, compressed or not a tar), an archive that ends inside a header, a member
  whose data runs past the end of its archive (a truncated download) or of its inner tar, an
  archive that ends without its end-of-archive block (cut at a member boundary), a directory
  member that claims data, a PAX global header that sets a path or size for every member after it;
* a would-be class tar that holds tars (the train tar left among its class tars), only
  ``ILSVRC2012_val_*`` or ``_test_*`` images beside class tars that do not (the validation or
  test tar; where all do, they are a validation set packed per class), or is named as one of
  ImageNet's files (``ILSVRC2012_*``), is refused, naming it: as a class, it would shift every
  label after it (``devkit.not_a_class``; any other stray tar is not told from a class); two
  tars of one class name (``n1.tar``, ``n1.TAR``) are refused;
* directories and non-image members are ignored, as the folder scan ignores them.

**Cache.** ``archive``'s (``tarmeta.json``).
"""

from __future__ import annotations

import logging
import os
import time
from array import array
from collections import Counter
from contextlib import contextmanager, nullcontext
from dataclasses import replace

from prefetchd.core.bars import bar
from prefetchd.sources import devkit as dk
from prefetchd.sources.archive import (
    Arrays,
    TarIndex,
    kept_notes,
    load_cached,
    open_archive,
    save,
    stamp_of,
    unchanged,
    warn_skipped,
)
from prefetchd.sources.base import DatasetError, cache_path
from prefetchd.sources.store import identity_of
from prefetchd.sources.tarheaders import BLOCK, image_members, members, show, unique

log = logging.getLogger("prefetchd.dataset")


def _refuse_others(root: str, key: str, others: list[tuple[str, str]], total: int) -> None:
    shown = "; ".join(f"{name} ({why})" for name, why in others[:5]) + (" ..." if len(others) > 5 else "")
    devkits = sorted(n for n in os.listdir(root) if "devkit" in n.lower()) if os.path.isdir(root) else []
    if len(others) == total:
        raise DatasetError(f"{key} {root} holds no class tars, only {shown}{' and ' + ', '.join(devkits) if devkits else ''}"
                           f": it looks like ImageNet's download folder; set dataset.root to the train tar "
                           "(ILSVRC2012_img_train.tar), and validation.root to the validation tar with validation.devkit "
                           "the devkit (ILSVRC2012_devkit_t12.tar.gz)")
    raise DatasetError(f"{key} {root}: {len(others)} of its {total} tars are not class tars: {shown}; each would be "
                       "read as a class and shift every label after it: move them out of the folder (the train tar "
                       "left beside its extracted class tars can go)")


def _scan_class_tars(root: str, key: str, opener, tars: list[tuple[str, int, int, int]], exts, layout_: str,
                     archives: tuple[str, ...], notes: list, identity: dict | None = None) -> tuple[TarIndex, dict]:
    """``tars``: (class, archive number, start, end) in class order; ``opener(arch, start)``: a context
    giving the archive's descriptor (or a reader, ``tarheaders.pread``) (a folder's tars are opened one at a time: ``ulimit -n``).
    Returns the index and each archive's identity (``identity_of``) as read."""
    twins = sorted({c for c, n in Counter(t[0] for t in tars).items() if n > 1})
    if twins:  # n1.tar and n1.TAR: extracted, one folder
        raise DatasetError(f"{key} {root} holds more than one tar of the class {twins[0]} (names that differ in "
                           "the case of .tar only): extracted, they would be one class folder; keep one of them")
    out = Arrays()
    out.multi = len(archives) > 1
    empty, others, strays, identity = [], [], [], dict(identity or {})  # identity: archives already open, as they were then
    classes = [t[0] for t in tars]
    tbar = bar(tars, desc=f"indexing {root}", unit="class", leave=False)
    for label, (cls, arch, start, end) in enumerate(tbar):
        where = os.path.join(root, cls + ".tar") if layout_ == "tar" else os.path.join(root, archives[arch])
        skipped: list = []
        with opener(arch, start) as fd:
            if arch not in identity:
                identity[arch] = identity_of(os.fstat(fd))
            found = unique(members(fd, start, end if end is not None else identity[arch][2], where, skipped),
                           where, skipped)
            unchanged(fd, where, identity[arch])
        images = image_members(found, exts, False, skipped)
        why = dk.not_a_class(cls, found, [n for n, _, _ in images])
        if why:
            others.append((cls + ".tar", why))
            continue
        why = dk.unlabelled([n for n, _, _ in images])
        if why:  # a stray only beside real classes: per-class validation tars are all so
            strays.append((cls + ".tar", why))
        warn_skipped(where, skipped, notes)
        prefix = os.fsencode(cls) + b"/"
        for name, pos, size in images:
            out.add(prefix + name, label, pos, size, arch)
        if not images:
            empty.append(cls)
        tbar.set_postfix_str(f"{len(out.labels):,} images", refresh=False)
    tbar.close()
    if others or len(strays) < len(tars):
        others += strays
    if others:
        _refuse_others(root, key, others, len(tars))
    if empty:
        log.warning("%d class tar(s) hold no images (their labels stay reserved): %s",
                    len(empty), ", ".join(empty[:5]) + (" ..." if len(empty) > 5 else ""))
    if not len(out.labels):
        raise DatasetError(f"{root} holds no images with extensions {', '.join(e.decode() for e in exts)}")
    return out.index(root, classes, layout_, archives), identity


# a tar of images alone is an unlabelled WebDataset shard as much as a flat set (webdataset.looks_like_shards)
_SHARD_HINT = "; or, if it is a WebDataset shard of images alone, set dataset.layout: webdataset (dataset.label: none)"


def _flat(root: str, devkit: str | None, names: list[tuple[bytes, int, int]], layout_: str, archive: str,
          notes: list, key: str) -> TarIndex:
    if not devkit:
        val = sum(dk.val_number(n) is not None for n, _, _ in names)
        if key.startswith("dataset."):  # the devkit labels the validation set only: no advice to set it here
            raise DatasetError(f"{key} {root} is a flat set of {len(names)} images with no class tars or folders"
                               f"{' (ILSVRC2012_val_ names: ImageNet' + chr(39) + 's validation set)' if val else ''}"
                               f": a train set needs class folders ({key}/<class>/<image>) or class tars; a "
                               "validation set goes in validation.root, labelled by validation.devkit"
                               f"{_SHARD_HINT if root.lower().endswith('.tar') and not val else ''}")
        raise DatasetError(f"{key} {root} is a flat set of {len(names)} images with no class tars or folders: set "
                           "validation.devkit to label it (ImageNet's validation set), or give per-class tars")
    try:
        wnids, labels = dk.read_devkit(devkit)
    except dk.DevkitError as e:
        raise DatasetError(str(e)) from None
    out = Arrays()
    unlabelled = []
    for name, pos, size in names:
        k = dk.val_number(name)
        if k is None or not 1 <= k <= len(labels):
            unlabelled.append((name, "no ILSVRC2012_val_NNNNNNNN number in the devkit's ground truth"))
            continue
        out.add(name, labels[k - 1], pos, size)
    warn_skipped(root, unlabelled, notes)
    if not len(out.labels):
        raise DatasetError(f"{root} holds no validation images that the devkit {devkit} labels")
    if len(out.labels) < len(labels):  # a download or extraction cut short, or a subset on purpose
        short = (f"{root}: {len(out.labels)} validation images of the devkit ground truth's {len(labels)}: the set is "
                 "incomplete (a cut download or a half-run extraction?); only these are validated")
        log.warning("%s", short)
        notes.append(short)
    used = sorted(set(out.labels))  # only the classes present: a train subset may lack the others
    if len(used) < len(wnids):
        table = {old: new for new, old in enumerate(used)}
        out.labels = array("i", (table[k] for k in out.labels))
        wnids = [wnids[k] for k in used]
    index = out.index(root, wnids, layout_, (archive,))
    return replace(index, block=None, size=None) if layout_ == "flat-folder" else index


def _nested(root: str, key: str, top: dict, exts: tuple[bytes, ...]) -> None:
    """A tar whose class tars or class folders sit below its top level: say how to use it."""
    tars = sorted(n for n in top if b"/" in n and n.lower().endswith(b".tar"))
    if tars:
        lead = os.fsdecode(tars[0].rpartition(b"/")[0])
        raise DatasetError(f"{key} {root} holds its class tars under {lead}/ ({', '.join(map(show, tars[:3]))} ...), "
                           f"not at its top level: extract it (tar xf) and give the folder {lead} (the folder of class "
                           f"tars) as {key}")
    nested = sorted(n for n in top if b"/" in n and n.lower().endswith(exts))
    if nested:
        raise DatasetError(f"{key} {root} is a tar of image folders ({', '.join(map(show, nested[:3]))} ...), not of "
                           f"class tars: extract it (tar xf) and give the folder holding the class folders as {key}")


@contextmanager
def _opened(path: str):
    fd = open_archive(path, "class tar")
    try:
        yield fd
    finally:
        os.close(fd)


def scan_tar(root: str, key: str, src, size: int, ident: tuple, devkit: str | None, exts: tuple[bytes, ...],
             notes: list, opener=None) -> TarIndex:
    """The index of the tar ``root`` (of class tars, or flat with ``devkit``), read through ``src``
    (a descriptor, or a ``bucketshards.ShardFile``: ``tarheaders.pread``) of ``size`` bytes whose
    identity is ``ident``. ``opener(ranges)``: given each class tar's (start, end) in ``src``, in
    label order, a function of a class's position giving a context of what that class tar is read
    through (a bucket's: a reader of its range alone, fetched ahead); by default ``src``."""
    skipped: list = []
    if size < 2 * BLOCK:  # not even a header and an end-of-archive block
        raise DatasetError(f"{key} {root} is not a directory (an ImageFolder) nor a tar archive ({size} bytes)")
    top = unique(members(src, 0, size, root, skipped, top=key), root, skipped)
    tars = sorted((os.fsdecode(n[:-4]), 0, p, p + s) for n, (p, s) in top.items()
                  if n.lower().endswith(b".tar") and b"/" not in n and not n.startswith(b"."))
    if tars and devkit:
        raise DatasetError(f"{key} {root} is a tar of class tars (a train set), but validation.devkit labels a "
                           "flat validation set: give the validation tar (ILSVRC2012_img_val.tar) as "
                           f"{key}, or remove validation.devkit to use its class tars' labels")
    flat = [] if tars else image_members(top, exts, True, skipped)
    warn_skipped(root, skipped, notes)
    if tars:
        if opener:
            open_i, where = opener([(t[2], t[3]) for t in tars]), {t[2]: i for i, t in enumerate(tars)}
            open_ = lambda a, start: open_i(where[start])  # noqa: E731
        else:
            open_ = lambda a, start: nullcontext(src)  # noqa: E731
        index, _ = _scan_class_tars(root, key, open_, tars, exts, "tar", ("",), notes, {0: ident})
    else:
        if not flat:
            _nested(root, key, top, exts)
        index = _flat(root, devkit, flat, "flat-tar", "", notes, key)
    return replace(index, identity=(ident,))


def scan_tars(root: str, key: str, names: list[str], opener, devkit: str | None, exts: tuple[bytes, ...],
              notes: list, identity: dict | None = None, sizes: list[int] | None = None) -> TarIndex:
    """The index of the class tars ``names`` (in class order) of the folder ``root``; ``opener(a)``:
    a context giving the descriptor (or reader) of ``names[a]``; ``identity`` and ``sizes``: each
    one's, when known before it is opened (a bucket's listing)."""
    if devkit:
        raise DatasetError(f"{key} {root} is a folder of class tars (a train set), but validation.devkit labels a "
                           f"flat validation set: give the validation tar as {key}, or remove validation.devkit")
    if len(names) > 65535:
        raise DatasetError(f"{key} {root} holds {len(names)} tar files; at most 65535 are supported")
    tars = [(name[:-4], a, 0, sizes[a] if sizes else None) for a, name in enumerate(names)]  # None: its size opened
    index, ids = _scan_class_tars(root, key, lambda a, start: opener(a), tars, exts, "tars", tuple(names), notes,
                                  identity)
    return replace(index, identity=tuple(ids[a] for a in range(len(names))))


def scan(root: str, devkit: str | None, extensions: tuple[str, ...], key: str = "dataset.root",
         kind: str | None = None, notes: tuple[str, ...] = ()) -> tuple[TarIndex, list]:
    """Index ``root`` (see the module docstring; ``key``: the config key naming it; ``kind``: what
    ``dataset.choose`` found, by default "tar" for a file, "tars" for a folder; ``notes``: what it
    left out of root, kept with the index). Returns the index and the identities (path, then
    ``identity_of``) that validate a cache of it."""
    exts = tuple(e.lower().encode() for e in extensions)
    kind = kind or ("tar" if os.path.isfile(root) else "tars")
    stamps = [stamp_of(root)]
    try:  # a devkit in a bucket: its stamp before it is read, so a change after it shows
        devkit_stamps = [dk.url_stamp(devkit)] if devkit and "://" in devkit else []
    except dk.DevkitError as e:
        raise DatasetError(str(e)) from None
    notes_: list = list(notes)  # what was skipped, kept with the index
    if kind == "tar":
        fd = open_archive(root, key)
        try:
            ident = identity_of(os.fstat(fd))  # before the headers are read: the offsets are this file's
            index = scan_tar(root, key, fd, os.fstat(fd).st_size, ident, devkit, exts, notes_)
            unchanged(fd, root, ident)
        finally:
            os.close(fd)
    elif kind == "tars":
        names = sorted((e.name for e in os.scandir(root)
                        if e.name.lower().endswith(".tar") and not e.name.startswith(".") and e.is_file()),
                       key=lambda n: n[:-4])  # by class name: "a b.tar" after "a.tar", as folder "a b" after "a"
        index = scan_tars(root, key, names, lambda a: _opened(os.path.join(root, names[a])), devkit, exts, notes_)
        stamps += [[os.path.join(root, name), *index.identity[a]] for a, name in enumerate(names)]
    elif kind == "flat-folder":
        names = sorted(e.name for e in os.scandir(root) if e.is_file() and not e.name.startswith("."))
        encoded = [os.fsencode(n) for n in names]  # ordered as str, as the flat tar's members
        index = _flat(root, devkit, [(n, 0, 0) for n in encoded if n.lower().endswith(exts)], kind, "", notes_, key)
    else:
        raise DatasetError(f"{root} is not an archive layout")  # pragma: no cover - dispatch checks first
    if devkit:
        stamps += devkit_stamps if "://" in devkit else [stamp_of(p) for p in _devkit_files(devkit)]
    return replace(index, skipped=kept_notes(notes_)), stamps


def _devkit_files(devkit: str) -> list[str]:
    if not os.path.isdir(devkit):
        return [devkit]
    return [os.path.join(d, f) for d, _, files in os.walk(devkit) for f in sorted(files)
            if os.path.join(d, f).endswith((dk.META, dk.GROUND_TRUTH))]



def load(root: str, devkit: str | None, extensions: tuple[str, ...], cache_dir: str | None,
         use_cache: bool = True, key: str = "dataset.root", kind: str | None = None,
         notes: tuple[str, ...] = ()) -> tuple[TarIndex, bool]:
    """As ``dataset.load_index`` for the archive layouts: (index, from_cache); ``kind`` and
    ``notes``: as ``scan``."""
    source = f"{root}|devkit={devkit or ''}"
    cdir = cache_path(cache_dir, source, "archive", extensions)
    if use_cache:
        cached = load_cached(cdir)
        if cached is not None:
            return cached, True
    t0 = time.monotonic()
    index, stamps = scan(root, devkit, extensions, key, kind, notes)
    index = replace(index, scan_s=round(time.monotonic() - t0, 3))
    if use_cache:
        try:
            index = save(cdir, index, stamps)
        except OSError as e:
            log.warning("cannot write the index cache in %s (%s); the next start scans again", cdir, e.strerror)
    return index, False
