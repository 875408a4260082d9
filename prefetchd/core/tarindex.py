"""Datasets read in place from tar archives: ImageNet as downloaded, never extracted.

Layouts (``layout(root, devkit)`` tells them from an ImageFolder, which ``dataset`` scans):

* ``tar``: ``root`` is a tar of per-class tars (``ILSVRC2012_img_train.tar``: ``n01440764.tar``,
  ... each holding that class's JPEGs). A class is a top-level ``<name>.tar`` member.
* ``tars``: ``root`` is a folder of per-class tars (the train tar extracted one level).
* ``flat-tar``: ``root`` is a tar of images with no class tars (``ILSVRC2012_img_val.tar``), and
  ``flat-folder``: a folder of them, both labelled through the devkit (``prefetchd.core.devkit``).

**Order.** Classes are sorted by name; a class's images are ordered as ``scan_image_folder``
walks the extracted folder (a folder's files sorted, then its sub-folders in sorted order, hidden
folders skipped, extensions matched case-insensitively). The relative paths are those of the
extracted ImageFolder (``<class>/<member>``), so the index's paths, labels and fingerprint, and
hence every batch, are byte for byte those of the extracted folder. A flat set is in name order.

**Reading.** The scan reads the tar headers only: one 512-byte ``pread`` per member, the data is
skipped. A sample is recorded as (archive, block of its data, size); a worker reads it with one
``os.pread`` into a new ``bytes`` of that size. Nothing is written or extracted, ever. A worker
keeps its archives open (the most recently used ``_MAX_OPEN``); a read that fails closes the
archive so the next try opens it again (a stale NFS handle after a remount).

**Identity.** An archive's offsets hold for the file that was indexed only. Its identity is
(device, inode, size, mtime, ctime), taken when it is indexed; every read checks the descriptor
it reads through against it with one ``fstat`` after the ``pread`` (a write moves mtime before
it moves bytes, so a match after the read vouches for the bytes read). Another file at its path
(a copy put in its place, a cut download) and the same file rewritten in place (``cp`` over it,
``rsync --inplace``, ``tar --delete``, at the same size and inode too) raise
``indexbase.StorageChanged``, which the worker treats as storage to wait for
(``executors.storage``: one log line, no sample blamed), never as bad samples read at the wrong
offsets; a restart indexes the archive again (the cache's stamps hold the same identity).

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
  whose data runs past the end of its archive (a truncated download) or of its inner tar, a PAX
  global header that sets a path or size for every member after it;
* directories and non-image members are ignored, as the folder scan ignores them.

**Cache.** As the folder index's (``dataset``): ``.npy`` files opened with ``mmap_mode='r'`` plus
``tarmeta.json``, valid while every archive's identity (and the root folder's and the devkit's)
are unchanged; the scan time is kept for ``prefetchd check``.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from array import array
from dataclasses import dataclass, replace

import numpy as np

from prefetchd.core import devkit as dk
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
from prefetchd.core.tarheaders import BLOCK, members, show, unique

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
    skipped_what = ("archive member", "archive members")
    skipped_rule = ("only regular members with a relative path are read; of a duplicate name, the last copy; "
                    "a flat set's images without a devkit label")

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
        fd = _open(path, identity)
        try:
            data = os.pread(fd, n, int(self.block[i]) * BLOCK)
            if identity is not None:  # after the read: a write that moved these bytes has moved mtime
                _check(fd, path, identity)
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


def _check(fd: int, path: str, identity: tuple) -> None:
    """Raise ``StorageChanged`` unless the file open as ``fd`` is the one indexed (``identity``)."""
    now = identity_of(os.fstat(fd))
    changed = [f"{name} {was} -> {is_}" for name, was, is_ in zip(_FIELDS, identity, now, strict=True)
               if was != is_ and (was or name == "size")]
    if changed:
        _forget(path)  # the next try opens the path again (the file put back, or another in its place)
        raise StorageChanged(errno.ESTALE, f"the archive {path} changed since it was indexed ({', '.join(changed)}; "
                             "copied over, rewritten in place or cut): its indexed offsets would read other bytes, so "
                             "batches from it wait; restart the daemon to index it again")


def _open(path: str, identity: tuple | None = None) -> int:
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
            _check(fd, path, identity)  # closes it if it is not the one indexed
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


def _walk_key(name: bytes) -> tuple[tuple[bytes, ...], bytes]:
    if b"/" not in name:
        return (), name
    *dirs, base = name.split(b"/")
    return tuple(dirs), base  # a folder's files before its sub-folders, as os.walk yields them


def _images(members: dict, exts: tuple[bytes, ...], flat: bool) -> list[tuple[bytes, int, int]]:
    keep = []
    for name, (pos, size) in members.items():
        if not name.lower().endswith(exts):
            continue
        if b"/" in name and (flat or any(d.startswith(b".") for d in name.split(b"/")[:-1])):
            continue
        keep.append((name, pos, size))
    keep.sort(key=lambda m: _walk_key(m[0]))
    return keep


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


def layout(root: str, devkit: str | None) -> str | None:
    """``tar`` (a tar file: of class tars, or flat), ``tars`` or ``flat-folder``; None for an
    ImageFolder (or a root that is not there: the folder scan says why)."""
    try:
        st = os.stat(root)
    except OSError:
        return None
    if stat.S_ISREG(st.st_mode):
        return "tar"
    if not stat.S_ISDIR(st.st_mode):
        return None
    try:
        entries = [e for e in os.scandir(root) if not e.name.startswith(".")]
    except OSError:
        return None
    if any(e.is_dir() for e in entries):
        return None
    if any(e.name.lower().endswith(".tar") and e.is_file() for e in entries):
        return "tars"
    return "flat-folder" if devkit else None


def _identity(path: str) -> list:
    """A cache stamp: the path and its identity (``identity_of``)."""
    return [path, *identity_of(os.stat(path))]


def _open_archive(path: str, what: str) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise DatasetError(f"{what} {path} cannot be opened: {e.strerror}") from None


def _scan_class_tars(root: str, fd_of, tars: list[tuple[str, int, int, int]], exts, layout_: str,
                     archives: tuple[str, ...], notes: list) -> TarIndex:
    """``tars``: (class, archive number, start, end) in class order."""
    out = _Arrays()
    out.multi = len(archives) > 1
    empty = []
    classes = [t[0] for t in tars]
    tbar = bar(tars, desc=f"indexing {root}", unit="class", leave=False)
    for label, (cls, arch, start, end) in enumerate(tbar):
        where = os.path.join(root, cls + ".tar") if layout_ == "tar" else os.path.join(root, archives[arch])
        skipped: list = []
        images = _images(unique(members(fd_of(arch), start, end, where, skipped), where, skipped), exts, False)
        _warn_skipped(where, skipped, notes)
        prefix = os.fsencode(cls) + b"/"
        for name, pos, size in images:
            out.add(prefix + name, label, pos, size, arch)
        if not images:
            empty.append(cls)
        tbar.set_postfix_str(f"{len(out.labels):,} images", refresh=False)
    tbar.close()
    if empty:
        log.warning("%d class tar(s) hold no images (their labels stay reserved): %s",
                    len(empty), ", ".join(empty[:5]) + (" ..." if len(empty) > 5 else ""))
    if not len(out.labels):
        raise DatasetError(f"{root} holds no images with extensions {', '.join(e.decode() for e in exts)}")
    return out.index(root, classes, layout_, archives)


def _flat(root: str, devkit: str | None, names: list[tuple[bytes, int, int]], layout_: str, archive: str,
          notes: list) -> TarIndex:
    if not devkit:
        raise DatasetError(f"{root} is a flat set of {len(names)} images with no class tars or folders: set "
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
    used = sorted(set(out.labels))  # only the classes present: a train subset may lack the others
    if len(used) < len(wnids):
        table = {old: new for new, old in enumerate(used)}
        out.labels = array("i", (table[k] for k in out.labels))
        wnids = [wnids[k] for k in used]
    index = out.index(root, wnids, layout_, (archive,))
    return replace(index, block=None, size=None) if layout_ == "flat-folder" else index


def scan(root: str, devkit: str | None, extensions: tuple[str, ...], key: str = "dataset.root") -> tuple[TarIndex, list]:
    """Index ``root`` (see the module docstring; ``key``: the config key naming it). Returns the index and the identities (path,
    size, mtime, inode) that validate a cache of it."""
    exts = tuple(e.lower().encode() for e in extensions)
    kind = layout(root, devkit)
    stamps = [_identity(root)]
    notes: list = []  # what was skipped, kept with the index
    if kind == "tar":
        fd = _open_archive(root, key)
        try:
            skipped: list = []
            if os.fstat(fd).st_size < 2 * BLOCK:  # not even a header and an end-of-archive block
                raise DatasetError(f"{key} {root} is not a directory (an ImageFolder) nor a tar archive "
                                   f"({os.fstat(fd).st_size} bytes)")
            top = unique(members(fd, 0, os.fstat(fd).st_size, root, skipped, top=key), root, skipped)
            _warn_skipped(root, skipped, notes)
            tars = sorted((os.fsdecode(n[:-4]), 0, p, p + s) for n, (p, s) in top.items()
                          if n.lower().endswith(b".tar") and b"/" not in n and not n.startswith(b"."))
            if tars:
                index = _scan_class_tars(root, lambda a: fd, tars, exts, "tar", ("",), notes)
            else:
                index = _flat(root, devkit, _images(top, exts, True), "flat-tar", "", notes)
            index = replace(index, identity=(identity_of(os.fstat(fd)),))
        finally:
            os.close(fd)
    elif kind == "tars":
        names = sorted(e.name for e in os.scandir(root)
                       if e.name.lower().endswith(".tar") and not e.name.startswith(".") and e.is_file())
        if len(names) > 65535:
            raise DatasetError(f"{key} {root} holds {len(names)} tar files; at most 65535 are supported")
        fds: list[int] = []
        try:
            tars = []
            for a, name in enumerate(names):
                fds.append(_open_archive(os.path.join(root, name), "class tar"))
                tars.append((name[:-4], a, 0, os.fstat(fds[-1]).st_size))
                stamps.append(_identity(os.path.join(root, name)))
            index = _scan_class_tars(root, fds.__getitem__, tars, exts, "tars", tuple(names), notes)
            index = replace(index, identity=tuple(identity_of(os.fstat(fd)) for fd in fds))
        finally:
            for fd in fds:
                os.close(fd)
    elif kind == "flat-folder":
        names = sorted(os.fsencode(e.name) for e in os.scandir(root) if e.is_file() and not e.name.startswith("."))
        index = _flat(root, devkit, [(n, 0, 0) for n in names if n.lower().endswith(exts)], kind, "", notes)
    else:
        raise DatasetError(f"{root} is not an archive layout")  # pragma: no cover - dispatch checks first
    if devkit:
        stamps += [_identity(p) for p in _devkit_files(devkit)]
    return replace(index, skipped=_kept(notes)), stamps


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
         use_cache: bool = True, key: str = "dataset.root") -> tuple[TarIndex, bool]:
    """As ``dataset.load_index`` for the archive layouts: (index, from_cache)."""
    source = f"{root}|devkit={devkit or ''}"
    cdir = cache_path(cache_dir, source, "archive", extensions)
    if use_cache:
        cached = _load(cdir)
        if cached is not None:
            return cached, True
    t0 = time.monotonic()
    index, stamps = scan(root, devkit, extensions, key)
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
