"""Datasets read in place from tar archives: ImageNet as downloaded, never extracted.

Layouts (``dataset.choose`` tells them from an ImageFolder and from mixtures it refuses):

* ``tar``: ``root`` is a tar of per-class tars (``ILSVRC2012_img_train.tar``: ``n01440764.tar``,
  ... each holding that class's JPEGs). A class is a top-level ``<name>.tar`` member.
* ``tars``: ``root`` is a folder of per-class tars (the train tar extracted one level).
* ``flat-tar``: ``root`` is a tar of images with no class tars (``ILSVRC2012_img_val.tar``), and
  ``flat-folder``: a folder of them, both labelled through the devkit (``prefetchd.core.devkit``).

**Order.** Classes are sorted by name; a class's images are ordered as ``scan_image_folder``
walks the extracted folder (torchvision's ``ImageFolder`` order: folders by their whole path, then
file names, compared as ``str`` with non-UTF-8 bytes as surrogates; hidden folders and ``._*``
files skipped, extensions matched case-insensitively). The relative paths are those of the
extracted ImageFolder (``<class>/<member>``), so the index's paths, labels and fingerprint, and
hence every batch, are byte for byte those of the extracted folder, with one exception: hard
and symbolic links in a class tar are skipped here (warned, listed by ``check``) where extracting
makes files of them. A flat set is in name order.

**Reading.** The scan reads the tar headers only: one 512-byte ``pread`` per member, the data is
skipped. A sample is recorded as (archive, block of its data, size); a worker reads it with one
``os.pread`` into a new ``bytes`` of that size. Nothing is written or extracted, ever. A worker
keeps its archives open (the most recently used ``_MAX_OPEN``); a read that fails closes the
archive so the next try opens it again (a stale NFS handle after a remount).

**Identity.** An archive's offsets hold for the file that was indexed only. Its identity is
(device, inode, size, mtime, ctime), taken before its headers are read (one that changes while
they are read is refused: a copy still writing it); every read checks its descriptor against it
with one ``fstat`` after the ``pread`` (a write moves mtime before it moves bytes), all but the
device, which an NFS remount may change for the same file. Another file at its path
(a copy put in its place, a cut download) and the same file rewritten in place (``cp`` over it,
``rsync --inplace``, ``tar --delete``, at the same size and inode too) raise
``indexbase.StorageChanged``, which the worker treats as storage to wait for
(``executors.storage``: one log line, no sample blamed), never as bad samples read at the wrong
offsets; a restart indexes the archive again (the cache's stamps hold the same identity). An
archive whose ctime alone moved (a chmod, a chown, a hard link, or a rewrite with its mtime put
back) is first checked member by member (``tarrecheck``): with every sample in place, it is read on.

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

**Cache.** As the folder index's (``dataset``): ``.npy`` files opened with ``mmap_mode='r'`` plus
``tarmeta.json``, valid while every archive's identity (and the root folder's and the devkit's)
are unchanged; the scan time is kept for ``prefetchd check``.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from array import array
from collections import Counter
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace

import numpy as np

from prefetchd.core import devkit as dk
from prefetchd.core import tarrecheck
from prefetchd.core.bars import bar
from prefetchd.core.indexbase import (
    DatasetError,
    Index,
    StorageChanged,
    cache_path,
    index_fingerprint,
    read_cache,
    write_cache,
)
from prefetchd.core.tarheaders import BLOCK, image_members, members, show, unique

log = logging.getLogger("prefetchd.dataset")

META = "tarmeta.json"
_VERSION = 4  # 4: identity (dev, inode, size, mtime, ctime); 3: PAX and GNU long names, skipped members kept
_MAX_OPEN = 64  # archives a worker keeps open (a folder of 1,000 class tars must not exhaust RLIMIT_NOFILE)
_LAYOUT_WORDS = {"tar": "a tar of per-class tars", "tars": "a folder of per-class tars",
                 "flat-tar": "a flat tar labelled by the devkit", "flat-folder": "a flat folder labelled by the devkit"}


@dataclass(frozen=True)
class TarIndex(Index):
    """An ``Index`` whose samples are members of archives (or, ``flat-folder``, plain files)."""

    layout: str = "tar"
    archives: tuple[str, ...] = ()  # relative to root; "" is root itself
    archive_ids: np.ndarray | None = None  # uint16 [n]: which archive; None: archives[0]
    # uint32 [n]: where the sample's data starts in its archive, in 512-byte blocks (tar data is
    # block-aligned; archives up to 2 TiB), and its size: 8 bytes a sample instead of 16
    block: np.ndarray | None = None
    size: np.ndarray | None = None
    scan_s: float = 0.0  # how long the scan that built it took
    # each archive's (dev, inode, size, mtime_ns, ctime_ns) when it was indexed, checked at every
    # read (its offsets hold for that file only); a 0 other than the size: that field is not checked
    # (another node's copy, ``sizes_only``); (): no check
    identity: tuple[tuple[int, int, int, int, int], ...] = ()
    skipped_what = ("archive member or folder", "archive members or folders")
    skipped_rule = ("only regular members with a relative path are read; of a duplicate name, the last copy; "
                    "a flat set's images without a devkit label; beside class tars, lost+found and folders "
                    "extracted from them")

    def archive(self, i: int) -> str:
        a = self.archives[0 if self.archive_ids is None else int(self.archive_ids[i])]
        return os.path.join(self.root, a) if a else self.root

    def path(self, i: int) -> str:
        """Where sample ``i`` is, for messages: ``<archive>/<class>.tar/<member>`` or ``<archive>/<member>``."""
        if self.block is None:
            return super().path(i)
        rel = self.relpath(i)
        if self.layout == "tar":
            cls, _, member = rel.partition("/")
            return os.path.join(self.root, cls + ".tar", member)
        return os.path.join(self.archive(i), rel.partition("/")[2] if self.layout == "tars" else rel)

    def read(self, i: int) -> bytes:
        """Sample ``i``'s bytes: one positioned read at its offset (OSError when it cannot be read;
        ``StorageChanged`` when its archive is not the one indexed)."""
        if self.block is None:
            return super().read(i)
        n = int(self.size[i])
        a = 0 if self.archive_ids is None else int(self.archive_ids[i])
        path = self.archive(i)
        identity = self.identity[a] if self.identity else None
        recheck = (identity, lambda fd: tarrecheck.misplaced(fd, self, a)) if identity is not None else None
        fd = _open(path, identity, recheck)
        try:
            data = os.pread(fd, n, int(self.block[i]) * BLOCK)
            if identity is not None:  # after the read: a write that moved these bytes has moved mtime
                _check(fd, path, identity, recheck)
            if len(data) != n:
                raise OSError(errno.EIO, f"the archive ends {n - len(data)} bytes short of this member "
                                         "(it changed since it was indexed)")
        except OSError:
            _forget(path)  # a dead descriptor (a stale NFS handle, a remount): the next try opens the file again
            raise
        return data

    def content_stamp(self, i: int) -> str:
        """Sample ``i``'s archive identity as indexed and its place in it (no stat: an archive changed
        since is indexed again at the next start, and its stamp then differs)."""
        if self.block is None or not self.identity:
            return super().content_stamp(i)
        a = 0 if self.archive_ids is None else int(self.archive_ids[i])
        return ":".join(map(str, (*self.identity[a], int(self.block[i]), int(self.size[i]))))

    def sample_size(self, i: int) -> int:
        """Sample ``i``'s size in bytes, from the index (no stat: the member is not a file)."""
        return super().sample_size(i) if self.size is None else int(self.size[i])

    def describe(self) -> str:
        where = os.path.basename(self.root.rstrip("/"))
        return f"{where}, {_LAYOUT_WORDS.get(self.layout, self.layout)} (indexed in {self.scan_s:.1f} s)"

    @property
    def nbytes(self) -> int:
        extra = [a for a in (self.archive_ids, self.block, self.size) if a is not None]
        return super().nbytes + sum(a.nbytes for a in extra)


_fds: dict[str, int] = {}  # in least recently used order
_fds_pid = 0


def identity_of(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """An archive's identity (``TarIndex.identity``): what changes when a byte of it may have moved."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def sizes_only(identity: tuple) -> tuple:
    """``identity`` with only the sizes checked (another node's copy has its own device, inode and times)."""
    return tuple((0, 0, ident[2], 0, 0) for ident in identity)


_FIELDS = ("device", "inode", "size", "mtime_ns", "ctime_ns")


def _check(fd: int, path: str, identity: tuple, recheck=None) -> None:
    """Raise ``StorageChanged`` unless the file open as ``fd`` is the one indexed (``identity``).
    ``recheck``: (the identity indexed, a function of ``fd`` saying why a sample moved or None);
    with it, a change of ctime alone whose samples are all in place is accepted (``tarrecheck``)."""
    now = identity_of(os.fstat(fd))
    if recheck is not None:
        identity = tarrecheck.current(path, recheck[0])
        if tarrecheck.unverified_copy(identity):  # another node's copy (sizes_only): vouched for once
            return tarrecheck.vouch_copy(fd, path, recheck, now)
    # not the device: NFS and other anonymous-device mounts get a new one at a remount, where the
    # file (inode, size, times) is the same; the index cache's stamps still compare it
    changed = [f"{name} {was} -> {is_}" for name, was, is_ in zip(_FIELDS, identity, now, strict=True)
               if was != is_ and (was or name == "size") and name != "device"]
    why = None
    if changed and recheck is not None and len(changed) == 1 and changed[0].startswith("ctime"):
        why = tarrecheck.judged(path, recheck[0], now, lambda: recheck[1](fd))
        if why is None:  # a chmod, chown or link: every member where it was
            log.info("the archive %s changed its ctime alone (mode, owner or links); every sample's header is "
                     "where it was indexed: reading on", path)
            return
    if changed:
        _forget(path)  # the next try opens the path again (the file put back, or another in its place)
        how = ("its ctime alone, and its members moved: a rewrite with its mtime put back" if why else
               "its ctime alone: a chmod, chown or hard link, or a rewrite with its mtime put back, which cannot be "
               "told apart" if changed[0].startswith("ctime") else "copied over, rewritten in place or cut")
        how += f" ({why})" if why else ""
        raise StorageChanged(errno.ESTALE, f"the archive {path}{StorageChanged.MARK} ({', '.join(changed)}; {how}): "
                             "its indexed offsets may read other bytes, so batches from it wait; restart the daemon "
                             "to index it again")


def _open(path: str, identity: tuple | None = None, recheck=None) -> int:
    """A read-only descriptor of ``path``, kept open for the next read (the ``_MAX_OPEN`` most
    recently used). ``identity``: what it was indexed with (``identity_of``); a file that is not
    that one raises ``StorageChanged`` (its offsets would read the wrong bytes)."""
    global _fds_pid
    if _fds_pid != os.getpid():  # a forked child: the parent's descriptors are its own business
        _fds.clear()
        _fds_pid = os.getpid()
    fd = _fds.pop(path, None)
    if fd is None:
        if len(_fds) >= _MAX_OPEN:
            os.close(_fds.pop(next(iter(_fds))))
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        _fds[path] = fd
        if identity is not None:
            _check(fd, path, identity, recheck)  # closes it if it is not the one indexed
    _fds[path] = fd
    return fd


def _forget(path: str) -> None:
    """Close the kept descriptor of ``path``, if any."""
    fd = _fds.pop(path, None) if _fds_pid == os.getpid() else None
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


_MAX_NOTES = 1000  # skipped members kept with the index (for check); more are counted


def _warn_skipped(where: str, skipped: list, notes: list) -> None:
    """Warn once for ``where`` and keep what was skipped in ``notes`` (``Index.skipped``)."""
    if skipped:
        shown = "; ".join(f"{show(n)} ({why})" for n, why in skipped[:20])
        log.warning("%s: skipped %d member(s): %s%s", where, len(skipped), shown,
                    f"; and {len(skipped) - 20} more" if len(skipped) > 20 else "")
        for n, why in skipped:
            notes.append(f"{where}: {show(n)} ({why})")


def _kept(notes: list) -> tuple[str, ...]:
    if len(notes) <= _MAX_NOTES:
        return tuple(notes)
    return (*notes[:_MAX_NOTES], f"... and {len(notes) - _MAX_NOTES} more (see the warnings of the scan)")


# --- scanning ------------------------------------------------------------------------------------------


class _Arrays:
    """The index under construction, in compact buffers (a 1.28 M sample index stays far under 100 MB)."""

    def __init__(self):
        self.blob, self.ends, self.labels = bytearray(), array("q", [0]), array("i")
        self.block, self.size, self.arch = array("I"), array("I"), array("H")
        self.multi = False

    def add(self, rel: bytes, label: int, pos: int, size: int, arch: int = 0) -> None:
        if size >= 1 << 32 or pos >= BLOCK << 32:
            raise DatasetError(f"member {show(rel)} is {size} bytes at offset {pos}: samples of 4 GiB or more, "
                               "or in archives over 2 TiB, are not supported")
        self.blob += rel
        self.ends.append(len(self.blob))
        self.labels.append(label)
        self.block.append(pos // BLOCK)
        self.size.append(size)
        if self.multi:  # one archive (the train tar): no per-sample archive number
            self.arch.append(arch)

    def index(self, root: str, classes: list[str], layout: str, archives: tuple[str, ...]) -> TarIndex:
        blob = np.frombuffer(self.blob, dtype=np.uint8) if self.blob else np.zeros(0, np.uint8)
        offsets, labels = np.frombuffer(self.ends, dtype=np.int64), np.frombuffer(self.labels, dtype=np.int32)
        return TarIndex(root, tuple(classes), blob, offsets, labels, index_fingerprint(blob, offsets, labels),
                        layout=layout, archives=archives,
                        archive_ids=np.frombuffer(self.arch, dtype=np.uint16) if len(archives) > 1 else None,
                        block=np.frombuffer(self.block, dtype=np.uint32), size=np.frombuffer(self.size, dtype=np.uint32))


def _identity(path: str) -> list:
    """A cache stamp: the path and its identity (``identity_of``)."""
    return [path, *identity_of(os.stat(path))]


def _unchanged(fd: int, where: str, identity: tuple) -> None:
    """The archive ``fd`` is as it was (``identity``) when its scan began: else (a copy still writing
    it) its offsets, of another file, would pass every read's check and read other members."""
    now = identity_of(os.fstat(fd))
    if now != identity:
        changed = ", ".join(f"{n} {a} -> {b}" for n, a, b in zip(_FIELDS, identity, now, strict=True) if a != b)
        raise DatasetError(f"{where} changed while it was being indexed ({changed}): is a copy or download still "
                           "writing it? start again once it is complete")


def _open_archive(path: str, what: str) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise DatasetError(f"{what} {path} cannot be opened: {e.strerror}") from None


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
    """``tars``: (class, archive number, start, end) in class order; ``opener(arch)``: a context
    giving the archive's descriptor (a folder's tars are opened one at a time: ``ulimit -n``).
    Returns the index and each archive's identity (``identity_of``) as read."""
    twins = sorted({c for c, n in Counter(t[0] for t in tars).items() if n > 1})
    if twins:  # n1.tar and n1.TAR: extracted, one folder
        raise DatasetError(f"{key} {root} holds more than one tar of the class {twins[0]} (names that differ in "
                           "the case of .tar only): extracted, they would be one class folder; keep one of them")
    out = _Arrays()
    out.multi = len(archives) > 1
    empty, others, strays, identity = [], [], [], dict(identity or {})  # identity: archives already open, as they were then
    classes = [t[0] for t in tars]
    tbar = bar(tars, desc=f"indexing {root}", unit="class", leave=False)
    for label, (cls, arch, start, end) in enumerate(tbar):
        where = os.path.join(root, cls + ".tar") if layout_ == "tar" else os.path.join(root, archives[arch])
        skipped: list = []
        with opener(arch) as fd:
            if arch not in identity:
                identity[arch] = identity_of(os.fstat(fd))
            found = unique(members(fd, start, end if end is not None else identity[arch][2], where, skipped),
                           where, skipped)
            _unchanged(fd, where, identity[arch])
        images = image_members(found, exts, False, skipped)
        why = dk.not_a_class(cls, found, [n for n, _, _ in images])
        if why:
            others.append((cls + ".tar", why))
            continue
        why = dk.unlabelled([n for n, _, _ in images])
        if why:  # a stray only beside real classes: per-class validation tars are all so
            strays.append((cls + ".tar", why))
        _warn_skipped(where, skipped, notes)
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


def _flat(root: str, devkit: str | None, names: list[tuple[bytes, int, int]], layout_: str, archive: str,
          notes: list, key: str) -> TarIndex:
    if not devkit:
        val = sum(dk.val_number(n) is not None for n, _, _ in names)
        if key.startswith("dataset."):  # the devkit labels the validation set only: no advice to set it here
            raise DatasetError(f"{key} {root} is a flat set of {len(names)} images with no class tars or folders"
                               f"{' (ILSVRC2012_val_ names: ImageNet' + chr(39) + 's validation set)' if val else ''}"
                               f": a train set needs class folders ({key}/<class>/<image>) or class tars; a "
                               "validation set goes in validation.root, labelled by validation.devkit")
        raise DatasetError(f"{key} {root} is a flat set of {len(names)} images with no class tars or folders: set "
                           "validation.devkit to label it (ImageNet's validation set), or give per-class tars")
    try:
        wnids, labels = dk.read_devkit(devkit)
    except dk.DevkitError as e:
        raise DatasetError(str(e)) from None
    out = _Arrays()
    unlabelled = []
    for name, pos, size in names:
        k = dk.val_number(name)
        if k is None or not 1 <= k <= len(labels):
            unlabelled.append((name, "no ILSVRC2012_val_NNNNNNNN number in the devkit's ground truth"))
            continue
        out.add(name, labels[k - 1], pos, size)
    _warn_skipped(root, unlabelled, notes)
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
    fd = _open_archive(path, "class tar")
    try:
        yield fd
    finally:
        os.close(fd)


def scan(root: str, devkit: str | None, extensions: tuple[str, ...], key: str = "dataset.root",
         kind: str | None = None, notes: tuple[str, ...] = ()) -> tuple[TarIndex, list]:
    """Index ``root`` (see the module docstring; ``key``: the config key naming it; ``kind``: what
    ``dataset.choose`` found, by default "tar" for a file, "tars" for a folder; ``notes``: what it
    left out of root, kept with the index). Returns the index and the identities (path, then
    ``identity_of``) that validate a cache of it."""
    exts = tuple(e.lower().encode() for e in extensions)
    kind = kind or ("tar" if os.path.isfile(root) else "tars")
    stamps = [_identity(root)]
    notes_: list = list(notes)  # what was skipped, kept with the index
    if kind == "tar":
        fd = _open_archive(root, key)
        try:
            ident = identity_of(os.fstat(fd))  # before the headers are read: the offsets are this file's
            skipped: list = []
            if os.fstat(fd).st_size < 2 * BLOCK:  # not even a header and an end-of-archive block
                raise DatasetError(f"{key} {root} is not a directory (an ImageFolder) nor a tar archive "
                                   f"({os.fstat(fd).st_size} bytes)")
            top = unique(members(fd, 0, os.fstat(fd).st_size, root, skipped, top=key), root, skipped)
            tars = sorted((os.fsdecode(n[:-4]), 0, p, p + s) for n, (p, s) in top.items()
                          if n.lower().endswith(b".tar") and b"/" not in n and not n.startswith(b"."))
            if tars and devkit:
                raise DatasetError(f"{key} {root} is a tar of class tars (a train set), but validation.devkit labels a "
                                   "flat validation set: give the validation tar (ILSVRC2012_img_val.tar) as "
                                   f"{key}, or remove validation.devkit to use its class tars' labels")
            flat = [] if tars else image_members(top, exts, True, skipped)
            _warn_skipped(root, skipped, notes_)
            if tars:
                index, _ = _scan_class_tars(root, key, lambda a: nullcontext(fd), tars, exts, "tar", ("",), notes_,
                                            {0: ident})
            else:
                if not flat:
                    _nested(root, key, top, exts)
                index = _flat(root, devkit, flat, "flat-tar", "", notes_, key)
            _unchanged(fd, root, ident)
            index = replace(index, identity=(ident,))
        finally:
            os.close(fd)
    elif kind == "tars":
        if devkit:
            raise DatasetError(f"{key} {root} is a folder of class tars (a train set), but validation.devkit labels a "
                               f"flat validation set: give the validation tar as {key}, or remove validation.devkit")
        names = sorted((e.name for e in os.scandir(root)
                        if e.name.lower().endswith(".tar") and not e.name.startswith(".") and e.is_file()),
                       key=lambda n: n[:-4])  # by class name: "a b.tar" after "a.tar", as folder "a b" after "a"
        if len(names) > 65535:
            raise DatasetError(f"{key} {root} holds {len(names)} tar files; at most 65535 are supported")
        tars = [(name[:-4], a, 0, None) for a, name in enumerate(names)]  # end: the size when opened
        index, ids = _scan_class_tars(root, key, lambda a: _opened(os.path.join(root, names[a])), tars, exts, "tars",
                                      tuple(names), notes_)
        stamps += [[os.path.join(root, name), *ids[a]] for a, name in enumerate(names)]
        index = replace(index, identity=tuple(ids[a] for a in range(len(names))))
    elif kind == "flat-folder":
        names = sorted(e.name for e in os.scandir(root) if e.is_file() and not e.name.startswith("."))
        encoded = [os.fsencode(n) for n in names]  # ordered as str, as the flat tar's members
        index = _flat(root, devkit, [(n, 0, 0) for n in encoded if n.lower().endswith(exts)], kind, "", notes_, key)
    else:
        raise DatasetError(f"{root} is not an archive layout")  # pragma: no cover - dispatch checks first
    if devkit:
        stamps += [_identity(p) for p in _devkit_files(devkit)]
    return replace(index, skipped=_kept(notes_)), stamps


def _devkit_files(devkit: str) -> list[str]:
    if not os.path.isdir(devkit):
        return [devkit]
    return [os.path.join(d, f) for d, _, files in os.walk(devkit) for f in sorted(files)
            if os.path.join(d, f).endswith((dk.META, dk.GROUND_TRUTH))]


# --- the cache -------------------------------------------------------------------------------------


_ARRAYS = ("blob", "offsets", "labels", "archive_ids", "block", "size")


def stamps_valid(stamps: list) -> bool:
    try:
        return all(_identity(s[0]) == s for s in stamps)
    except OSError:
        return False


def _load(cdir: str, validate: bool = True) -> TarIndex | None:
    """The cached index in ``cdir``; with ``validate``, only while the archives are unchanged (a
    worker opens its daemon's index without looking at the dataset: ``dataset.open_index_files``)."""
    def build(meta: dict, arrays: dict) -> TarIndex:
        return TarIndex(meta["root"], tuple(meta["classes"]), arrays["blob"], arrays["offsets"], arrays["labels"],
                        meta["fingerprint"], files_dir=cdir, layout=meta["layout"], archives=tuple(meta["archives"]),
                        archive_ids=arrays.get("archive_ids"), block=arrays.get("block"), size=arrays.get("size"),
                        scan_s=meta["scan_s"], identity=tuple(tuple(x) for x in meta.get("identity", ())),
                        skipped=tuple(meta.get("skipped", ())))

    return read_cache(cdir, META, _VERSION, build, stamps_valid if validate else None)


def _save(cdir: str, index: TarIndex, stamps: list) -> TarIndex:
    write_cache(cdir, META, {k: getattr(index, k) for k in _ARRAYS},
                {"version": _VERSION, "layout": index.layout, "root": index.root, "classes": list(index.classes),
                 "archives": list(index.archives), "fingerprint": index.fingerprint, "stamps": stamps,
                 "count": len(index), "scan_s": index.scan_s, "identity": [list(x) for x in index.identity],
                 "skipped": list(index.skipped)})
    return _load(cdir) or index


def load(root: str, devkit: str | None, extensions: tuple[str, ...], cache_dir: str | None,
         use_cache: bool = True, key: str = "dataset.root", kind: str | None = None,
         notes: tuple[str, ...] = ()) -> tuple[TarIndex, bool]:
    """As ``dataset.load_index`` for the archive layouts: (index, from_cache); ``kind`` and
    ``notes``: as ``scan``."""
    source = f"{root}|devkit={devkit or ''}"
    cdir = cache_path(cache_dir, source, "archive", extensions)
    if use_cache:
        cached = _load(cdir)
        if cached is not None:
            return cached, True
    t0 = time.monotonic()
    index, stamps = scan(root, devkit, extensions, key, kind, notes)
    index = replace(index, scan_s=round(time.monotonic() - t0, 3))
    if use_cache:
        try:
            index = _save(cdir, index, stamps)
        except OSError as e:
            log.warning("cannot write the index cache in %s (%s); the next start scans again", cdir, e.strerror)
    return index, False


def open_files(files_dir: str) -> TarIndex | None:
    """The cached archive index in ``files_dir`` (what workers open), or None if it is not one."""
    if not os.path.exists(os.path.join(files_dir, META)):
        return None
    index = _load(files_dir, validate=False)
    if index is None:
        raise DatasetError(f"the index cache in {files_dir} is missing or unreadable")
    return index
