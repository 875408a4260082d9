"""Samples that are members of archives (tar files), read in place and held to each archive's identity.

Shared by every archive layout (ImageNet's tars: ``imagenet``; WebDataset shards: ``webdataset``):
the index record (``TarIndex``), the read of one sample, the identity check, and the cache.

**Reading.** A sample is recorded as (archive, block of its data, size); a worker reads it with one
positioned read (``store.LocalStore.pread``) into a new ``bytes`` of that size. Nothing is written
or extracted, ever. A worker keeps its archives open (``store.MAX_OPEN`` most recently used); a
read that fails closes the archive so the next try opens it again (a stale NFS handle after a
remount).

**Identity.** An archive's offsets hold for the file that was indexed only. Its identity is
(device, inode, size, mtime, ctime), taken before its headers are read (one that changes while
they are read is refused: a copy still writing it); every read checks its descriptor against it
with one ``fstat`` after the ``pread`` (a write moves mtime before it moves bytes), all but the
device, which an NFS remount may change for the same file. Another file at its path
(a copy put in its place, a cut download) and the same file rewritten in place (``cp`` over it,
``rsync --inplace``, ``tar --delete``, at the same size and inode too) raise
``base.StorageChanged``, which the worker treats as storage to wait for
(``executors.storage``: one log line, no sample blamed), never as bad samples read at the wrong
offsets; a restart indexes the archive again (the cache's stamps hold the same identity). An
archive whose ctime alone moved (a chmod, a chown, a hard link, or a rewrite with its mtime put
back) is first checked member by member (``tarrecheck``): with every sample in place, it is read on.

**Cache.** As the folder index's: ``.npy`` files opened with ``mmap_mode='r'`` plus
``tarmeta.json``, valid while every archive's identity (and the root folder's and the devkit's)
are unchanged; the scan time is kept for ``prefetchd check``.
"""

from __future__ import annotations

import errno
import logging
import os
from array import array
from dataclasses import dataclass

import numpy as np

from prefetchd.sources import tarrecheck
from prefetchd.sources.base import (
    DatasetError,
    Index,
    StorageChanged,
    index_fingerprint,
    open_cached,
    read_cache,
    write_cache,
)
from prefetchd.sources.store import LOCAL, identity_of
from prefetchd.sources.tarheaders import BLOCK, show

log = logging.getLogger("prefetchd.dataset")

META = "tarmeta.json"
_VERSION = 4  # 4: identity (dev, inode, size, mtime, ctime); 3: PAX and GNU long names, skipped members kept
LAYOUT_WORDS = {"tar": "a tar of per-class tars", "tars": "a folder of per-class tars",
                "flat-tar": "a flat tar labelled by the devkit", "flat-folder": "a flat folder labelled by the devkit",
                "webdataset": "WebDataset shards"}


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
    _skipped_tar = (("archive member or folder", "archive members or folders"),
                    "only regular members with a relative path are read; of a duplicate name, the last copy; "
                    "a flat set's images without a devkit label; beside class tars, lost+found and folders "
                    "extracted from them")
    _skipped_wds = (("sample or member", "samples or members"),
                    "a sample needs one image and a readable label; only regular members with a relative path "
                    "are read")

    @property
    def skipped_what(self) -> tuple[str, str]:  # what ``skipped`` holds, for ``prefetchd check``
        return (self._skipped_wds if self.layout == "webdataset" else self._skipped_tar)[0]

    @property
    def skipped_rule(self) -> str:
        return (self._skipped_wds if self.layout == "webdataset" else self._skipped_tar)[1]

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
        if self.layout == "webdataset":  # rel is "<shard>/<member>"
            return os.path.join(self.root, rel)
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
            data = LOCAL.pread(fd, n, int(self.block[i]) * BLOCK)
            if identity is not None:  # after the read: a write that moved these bytes has moved mtime
                _check(fd, path, identity, recheck)
            if len(data) != n:
                raise OSError(errno.EIO, f"the archive ends {n - len(data)} bytes short of this member "
                                         "(it changed since it was indexed)")
        except OSError:
            LOCAL.forget(path)  # a dead descriptor (a stale NFS handle, a remount): the next try opens the file again
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
        return f"{where}, {LAYOUT_WORDS.get(self.layout, self.layout)} (indexed in {self.scan_s:.1f} s)"

    @property
    def nbytes(self) -> int:
        extra = [a for a in (self.archive_ids, self.block, self.size) if a is not None]
        return super().nbytes + sum(a.nbytes for a in extra)



def sizes_only(identity: tuple) -> tuple:
    """``identity`` with only the sizes checked (another node's copy has its own device, inode and times)."""
    return tuple((0, 0, ident[2], 0, 0) for ident in identity)


FIELDS = ("device", "inode", "size", "mtime_ns", "ctime_ns")


def _check(fd: int, path: str, identity: tuple, recheck=None) -> None:
    """Raise ``StorageChanged`` unless the file open as ``fd`` is the one indexed (``identity``).
    ``recheck``: (the identity indexed, a function of ``fd`` saying why a sample moved or None);
    with it, a change of ctime alone whose samples are all in place is accepted (``tarrecheck``)."""
    now = LOCAL.identity(fd)
    if recheck is not None:
        identity = tarrecheck.current(path, recheck[0])
        if tarrecheck.unverified_copy(identity):  # another node's copy (sizes_only): vouched for once
            return tarrecheck.vouch_copy(fd, path, recheck, now)
    # not the device: NFS and other anonymous-device mounts get a new one at a remount, where the
    # file (inode, size, times) is the same; the index cache's stamps still compare it
    changed = [f"{name} {was} -> {is_}" for name, was, is_ in zip(FIELDS, identity, now, strict=True)
               if was != is_ and (was or name == "size") and name != "device"]
    why = None
    if changed and recheck is not None and len(changed) == 1 and changed[0].startswith("ctime"):
        why = tarrecheck.judged(path, recheck[0], now, lambda: recheck[1](fd))
        if why is None:  # a chmod, chown or link: every member where it was
            log.info("the archive %s changed its ctime alone (mode, owner or links); every sample's header is "
                     "where it was indexed: reading on", path)
            return
    if changed:
        LOCAL.forget(path)  # the next try opens the path again (the file put back, or another in its place)
        how = ("its ctime alone, and its members moved: a rewrite with its mtime put back" if why else
               "its ctime alone: a chmod, chown or hard link, or a rewrite with its mtime put back, which cannot be "
               "told apart" if changed[0].startswith("ctime") else "copied over, rewritten in place or cut")
        how += f" ({why})" if why else ""
        raise StorageChanged(errno.ESTALE, f"the archive {path}{StorageChanged.MARK} ({', '.join(changed)}; {how}): "
                             "its indexed offsets may read other bytes, so batches from it wait; restart the daemon "
                             "to index it again")



def _open(path: str, identity: tuple | None = None, recheck=None) -> int:
    """A descriptor of the archive ``path`` kept by the store (``store.LocalStore.open``).
    ``identity``: what it was indexed with (``identity_of``); a file that is not that one raises
    ``StorageChanged`` (its offsets would read the wrong bytes)."""
    return LOCAL.open(path, None if identity is None else lambda fd: _check(fd, path, identity, recheck))


_MAX_NOTES = 1000  # skipped members kept with the index (for check); more are counted


def warn_skipped(where: str, skipped: list, notes: list) -> None:
    """Warn once for ``where`` and keep what was skipped in ``notes`` (``Index.skipped``)."""
    if skipped:
        shown = "; ".join(f"{show(n)} ({why})" for n, why in skipped[:20])
        log.warning("%s: skipped %d member(s): %s%s", where, len(skipped), shown,
                    f"; and {len(skipped) - 20} more" if len(skipped) > 20 else "")
        for n, why in skipped:
            notes.append(f"{where}: {show(n)} ({why})")


def kept_notes(notes: list) -> tuple[str, ...]:
    if len(notes) <= _MAX_NOTES:
        return tuple(notes)
    return (*notes[:_MAX_NOTES], f"... and {len(notes) - _MAX_NOTES} more (see the warnings of the scan)")


# --- scanning ------------------------------------------------------------------------------------------


class Arrays:
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

    def extend(self, rows: Arrays, arch: int = 0) -> None:
        """``add`` each of ``rows``' samples (another archive's, built apart: in a scan process), in order."""
        base = len(self.blob)
        self.blob += rows.blob
        self.ends.frombytes((np.frombuffer(rows.ends, dtype=np.int64)[1:] + base).tobytes())
        self.labels.extend(rows.labels)
        self.block.extend(rows.block)
        self.size.extend(rows.size)
        if self.multi:
            self.arch.extend(array("H", [arch]) * len(rows.labels))

    def index(self, root: str, classes: list[str], layout: str, archives: tuple[str, ...]) -> TarIndex:
        blob = np.frombuffer(self.blob, dtype=np.uint8) if self.blob else np.zeros(0, np.uint8)
        offsets, labels = np.frombuffer(self.ends, dtype=np.int64), np.frombuffer(self.labels, dtype=np.int32)
        return TarIndex(root, tuple(classes), blob, offsets, labels, index_fingerprint(blob, offsets, labels),
                        layout=layout, archives=archives,
                        archive_ids=np.frombuffer(self.arch, dtype=np.uint16) if len(archives) > 1 else None,
                        block=np.frombuffer(self.block, dtype=np.uint32), size=np.frombuffer(self.size, dtype=np.uint32))


def stamp_of(path: str) -> list:
    """A cache stamp: the path and its identity (``identity_of``)."""
    return [path, *identity_of(os.stat(path))]


def unchanged(fd: int, where: str, identity: tuple) -> None:
    """The archive ``fd`` is as it was (``identity``) when its scan began: else (a copy still writing
    it) its offsets, of another file, would pass every read's check and read other members."""
    if not isinstance(fd, int):  # a bucket's object, every range of it read with If-Match: its indexed version
        return
    now = identity_of(os.fstat(fd))
    if now != identity:
        changed = ", ".join(f"{n} {a} -> {b}" for n, a, b in zip(FIELDS, identity, now, strict=True) if a != b)
        raise DatasetError(f"{where} changed while it was being indexed ({changed}): is a copy or download still "
                           "writing it? start again once it is complete")


def open_archive(path: str, what: str) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise DatasetError(f"{what} {path} cannot be opened: {e.strerror}") from None



# --- the cache -------------------------------------------------------------------------------------


_ARRAYS = ("blob", "offsets", "labels", "archive_ids", "block", "size")


def stamps_valid(stamps: list) -> bool:
    from prefetchd.sources import devkit

    try:  # a devkit in a bucket (validation.devkit: s3://...) beside a local set: its size and ETag
        return all((devkit.url_stamp(s[0]) if "://" in s[0] else stamp_of(s[0])) == s for s in stamps)
    except (OSError, ValueError):  # DatasetError, DevkitError
        return False


def load_cached(cdir: str, validate: bool = True) -> TarIndex | None:
    """The cached index in ``cdir``; with ``validate``, only while the archives are unchanged (a
    worker opens its daemon's index without looking at the dataset: ``dataset.open_index_files``)."""
    def build(meta: dict, arrays: dict) -> TarIndex:
        return TarIndex(meta["root"], tuple(meta["classes"]), arrays["blob"], arrays["offsets"], arrays["labels"],
                        meta["fingerprint"], files_dir=cdir, layout=meta["layout"], archives=tuple(meta["archives"]),
                        archive_ids=arrays.get("archive_ids"), block=arrays.get("block"), size=arrays.get("size"),
                        scan_s=meta["scan_s"], identity=tuple(tuple(x) for x in meta.get("identity", ())),
                        skipped=tuple(meta.get("skipped", ())), kind=meta.get("kind", "folder"))

    return read_cache(cdir, META, _VERSION, build, stamps_valid if validate else None)


def save(cdir: str, index: TarIndex, stamps: list) -> TarIndex:
    write_cache(cdir, META, {k: getattr(index, k) for k in _ARRAYS},
                {"version": _VERSION, "layout": index.layout, "root": index.root, "classes": list(index.classes),
                 "archives": list(index.archives), "fingerprint": index.fingerprint, "stamps": stamps,
                 "count": len(index), "scan_s": index.scan_s, "identity": [list(x) for x in index.identity],
                 "skipped": list(index.skipped), "kind": index.kind})
    return load_cached(cdir) or index



def open_files(files_dir: str) -> TarIndex | None:
    """The cached archive index in ``files_dir`` (what workers open), or None if it is not one."""
    return open_cached(files_dir, META, load_cached)
