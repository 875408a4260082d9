"""The dataset index: every sample's path and label, held compactly and cached on disk.

Two sources:

* an ImageFolder, ``root/<class>/.../<image>``: labels are the index of the class folder's name
  among the sorted class names, files are sorted, as torchvision's ``ImageFolder`` does;
  extensions are matched case-insensitively. Directory symlinks, by one rule that never indexes
  an image twice or under another class's label: one whose target lies inside the root (a loop
  to an ancestor, a link to another class) is not followed, its images are indexed where they
  are; one pointing outside the root is followed, and a directory reached a second time (by
  another link) is skipped. What was skipped is kept with the index (``Index.skipped``, shown by
  ``prefetchd check``).
* a file list: one ``path label`` per line (``#`` comments and blank lines allowed); relative
  paths are relative to the list's directory.
* tar archives read in place (ImageNet's train tar of class tars, a folder of class tars, the
  flat validation tar or folder with the devkit): ``prefetchd.core.tarindex``.

The index is three numpy arrays: a byte blob of the paths relative to the root, an int64 offset
array and an int32 label array (about 40 bytes per sample for ImageNet, instead of ~150 for a
list of Python strings). They are saved as ``.npy`` files in the cache directory and opened with
``mmap_mode='r'``: forked or spawned workers share the page cache instead of copying a list of
objects page by page, and a restart skips the scan. A cache entry is valid while the root's and
every scanned directory's ``mtime_ns`` (or the list file's size and mtime) are unchanged.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
from dataclasses import dataclass, replace

import numpy as np
import xxhash

from prefetchd.core.bars import bar
from prefetchd.core.classlike import refuse_unless_classlike
from prefetchd.format.atomic import write_atomic

log = logging.getLogger("prefetchd.dataset")

_CACHE_VERSION = 2  # 2: directory symlinks into the root are not followed (version 1 indexed them twice)


class DatasetError(ValueError):
    """The dataset cannot be used: the message says why and what to do."""


class StorageChanged(OSError):
    """What ``Index.read`` reads from is no longer what was indexed (an archive replaced or cut):
    the storage's state, not the sample's fault (``executors.storage`` waits for it)."""


@dataclass(frozen=True)
class Index:
    root: str
    classes: tuple[str, ...]
    blob: np.ndarray  # uint8: concatenated fs-encoded relative paths
    offsets: np.ndarray  # int64 [n + 1]
    labels: np.ndarray  # int32 [n]
    fingerprint: str  # hex: content hash of paths and labels
    files_dir: str | None = None  # where the .npy files live (for workers to mmap)
    skipped: tuple[str, ...] = ()  # directories the scan did not index, each with why
    kind: str = "folder"  # what the root is: "folder" (an ImageFolder) or "list" (dataset.file_list)

    def __len__(self) -> int:
        return len(self.labels)

    def relpath(self, i: int) -> str:
        return os.fsdecode(self.blob[self.offsets[i]: self.offsets[i + 1]].tobytes())

    def path(self, i: int) -> str:
        return os.path.join(self.root, self.relpath(i))

    def read(self, i: int) -> bytes:
        """Sample ``i``'s bytes (OSError when it cannot be read; ``executors.storage`` judges it)."""
        fd = os.open(self.path(i), os.O_RDONLY | os.O_CLOEXEC)
        try:
            return read_all(fd)
        finally:
            os.close(fd)

    # what ``skipped`` holds (one, many) and by which rule, for ``prefetchd check``
    skipped_what = ("directory", "directories")
    skipped_rule = "directory symlinks into the root are not followed; a directory is indexed once"

    def describe(self) -> str:
        """What the dataset is, in a few words (``prefetchd check``)."""
        if self.kind == "list":
            return f"a file list in {self.root}"
        return f"{os.path.basename(self.root.rstrip(os.sep)) or self.root}, an ImageFolder"

    def sample_size(self, i: int) -> int:
        """Sample ``i``'s size in bytes (one stat), or 0 when it cannot be read."""
        try:
            return os.stat(self.path(i)).st_size
        except OSError:
            return 0

    @property
    def nbytes(self) -> int:
        return self.blob.nbytes + self.offsets.nbytes + self.labels.nbytes


def index_fingerprint(blob: np.ndarray, offsets: np.ndarray, labels: np.ndarray) -> str:
    """The content hash of an index's paths and labels (``Index.fingerprint``)."""
    h = xxhash.xxh3_128()
    for a in (blob, offsets, labels):
        h.update(memoryview(np.ascontiguousarray(a)).cast("B"))
    return h.hexdigest()[:16]


def _build(root: str, classes: list[str], rel: list[bytes], labels: list[int]) -> Index:
    lens = np.fromiter((len(p) for p in rel), dtype=np.int64, count=len(rel))
    offsets = np.zeros(len(rel) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    blob = np.frombuffer(b"".join(rel), dtype=np.uint8) if rel else np.zeros(0, np.uint8)
    lab = np.asarray(labels, dtype=np.int32)
    return Index(root, tuple(classes), blob, offsets, lab, index_fingerprint(blob, offsets, lab))


def _check_root(root: str, key: str = "dataset.root") -> None:
    """``root`` (the config key ``key`` names it) is a readable directory, or a DatasetError says why."""
    try:
        st = os.stat(root)
    except FileNotFoundError:
        raise DatasetError(f"{key} {root} does not exist") from None
    except PermissionError:
        raise DatasetError(f"{key} {root} is not readable (permission denied)") from None
    if not stat.S_ISDIR(st.st_mode):
        raise DatasetError(f"{key} {root} is not a directory")
    if not os.access(root, os.R_OK | os.X_OK):
        raise DatasetError(f"{key} {root} is not readable (permission denied)")


def scan_image_folder(root: str, extensions: tuple[str, ...], key: str = "dataset.root") -> tuple[
        Index, list[tuple[str, int]]]:
    """Scan ``root/<class>/...`` (``key``: the config key naming it, for messages). Returns the
    index and the (dir, mtime_ns) list that validates a cache of it."""
    _check_root(root, key)
    exts = tuple(e.lower() for e in extensions)
    stamps: list[tuple[str, int]] = [(root, os.stat(root).st_mtime_ns)]
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir(follow_symlinks=True) and not e.name.startswith("."))
    if not classes:
        raise DatasetError(f"{key} {root} has no class folders (expected root/<class>/<image>)")
    rel: list[bytes] = []
    labels: list[int] = []
    empty: list[str] = []
    real_root = os.path.realpath(root)
    seen: set[tuple[int, int]] = set()  # every directory indexed, whichever class reached it
    skipped: list[str] = []
    # a bar on a terminal only (prefetchd check, run in the foreground): a cold scan of a large tree is slow
    classes_bar = bar(classes, desc=f"scanning {root}", unit="class", leave=False)
    for label, cls in enumerate(classes_bar):
        top = os.path.join(root, cls)
        found = 0
        why = _not_followed(top, real_root)
        for dirpath, dirnames, filenames in [] if why else os.walk(top, followlinks=True, onerror=_walk_error):
            st = os.stat(dirpath)
            key = (st.st_dev, st.st_ino)
            if key in seen:  # reached before (by another link): its images have their label already
                skipped.append(f"{os.path.relpath(dirpath, root)} (a directory already indexed by another path)")
                dirnames[:] = []
                continue
            seen.add(key)
            stamps.append((dirpath, st.st_mtime_ns))
            dirnames.sort()
            keep = []
            for d in dirnames:
                why_not = None if d.startswith(".") else _not_followed(os.path.join(dirpath, d), real_root)
                if why_not:
                    skipped.append(f"{os.path.relpath(os.path.join(dirpath, d), root)} {why_not}")
                elif not d.startswith("."):
                    keep.append(d)
            dirnames[:] = keep
            for name in sorted(filenames):
                if name.lower().endswith(exts):
                    rel.append(os.fsencode(os.path.relpath(os.path.join(dirpath, name), root)))
                    labels.append(label)
                    found += 1
        if why:
            skipped.append(f"{cls} {why}")
        if not found:
            empty.append(cls)
        classes_bar.set_postfix_str(f"{len(rel):,} images", refresh=False)
    classes_bar.close()
    if empty:
        log.warning("%d class folder(s) hold no images (their labels stay reserved): %s",
                    len(empty), ", ".join(empty[:5]) + (" ..." if len(empty) > 5 else ""))
    if skipped:
        log.warning("%d director%s not indexed (directory symlinks into dataset.root are not followed, a "
                    "directory is indexed once): %s", len(skipped), "y" if len(skipped) == 1 else "ies",
                    "; ".join(skipped[:5]) + (" ..." if len(skipped) > 5 else ""))
    if not rel:
        raise DatasetError(f"{key} {root} holds no images with extensions {', '.join(exts)}")
    return replace(_build(root, classes, rel, labels), skipped=tuple(skipped)), stamps


def _not_followed(path: str, real_root: str) -> str | None:
    """Why the directory symlink ``path`` is not followed (its target lies inside the root, where
    its images are indexed under their own class), or None (not a symlink, or pointing outside)."""
    if not os.path.islink(path):
        return None
    target = os.path.realpath(path)
    if target == real_root or target.startswith(real_root.rstrip(os.sep) + os.sep):
        return f"-> {os.readlink(path)} (a directory symlink into dataset.root: its images are indexed where they are)"
    return None


def _walk_error(err: OSError) -> None:
    log.warning("cannot read %s: %s", err.filename, err.strerror)


def scan_file_list(list_path: str, key: str = "dataset.file_list") -> tuple[Index, list[tuple[str, int]]]:
    try:
        st = os.stat(list_path)
        with open(list_path, "rb") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise DatasetError(f"{key} {list_path}: {e.strerror}") from None
    root = os.path.dirname(list_path)
    rel: list[bytes] = []
    labels: list[int] = []
    for lineno, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith(b"#"):
            continue
        parts = line.rsplit(None, 1)
        if len(parts) != 2 or not parts[1].lstrip(b"-").isdigit() or int(parts[1]) < 0:
            raise DatasetError(f"{key} {list_path}:{lineno}: expected 'path label' with a non-negative integer label, got {raw[:80]!r}")
        rel.append(parts[0])
        labels.append(int(parts[1]))
    if not rel:
        raise DatasetError(f"{key} {list_path} lists no images")
    if max(labels) >= 2**31:
        raise DatasetError(f"{key} {list_path}: labels must be below 2**31")
    classes = [str(i) for i in range(max(labels) + 1)]
    index = replace(_build(root, classes, rel, labels), kind="list")
    return index, [(list_path, st.st_mtime_ns), (list_path + "#size", st.st_size)]


def default_cache_dir() -> str:
    if os.environ.get("CACHE_DIRECTORY"):  # systemd's CacheDirectory=
        return os.environ["CACHE_DIRECTORY"].split(":")[0]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "prefetchd")


def cache_path(cache_dir: str | None, source: str, kind: str, extensions: tuple[str, ...]) -> str:
    """The cache directory of the index of ``source`` (a root, a list, an archive layout: ``kind``)."""
    key = hashlib.sha256(f"{_CACHE_VERSION}|{kind}|{source}|{','.join(extensions)}".encode()).hexdigest()[:16]
    return os.path.join(cache_dir or default_cache_dir(), "index-" + key)


def write_cache(cdir: str, meta_name: str, arrays: dict, meta: dict) -> None:
    """Write an index's cache in ``cdir``: each array (None: left out) as ``<name>-<fingerprint>.npy``,
    then ``meta_name`` (``meta`` plus the ``files`` written), each replaced atomically, so a reader
    sees the old cache or the new one; ``.npy`` files of earlier indexes are removed."""
    os.makedirs(cdir, mode=0o700, exist_ok=True)
    files = {}
    for k, a in arrays.items():
        if a is not None:
            files[k] = f"{k}-{meta['fingerprint']}.npy"
            write_atomic(cdir, files[k], lambda f, a=a: np.save(f, a, allow_pickle=False))
    write_atomic(cdir, meta_name, lambda f: f.write(json.dumps({**meta, "files": files}).encode()))
    for name in os.listdir(cdir):
        if name not in files.values() and name.endswith(".npy"):
            try:
                os.unlink(os.path.join(cdir, name))
            except OSError:
                pass


def read_cache(cdir: str, meta_name: str, version: int, build, stamps_valid=None):
    """``build(meta, arrays)`` from the cache in ``cdir`` (the arrays memory-mapped), or None: none
    there, another ``version``, unreadable, or ``stamps_valid(meta["stamps"])`` says the dataset
    changed since."""
    try:
        with open(os.path.join(cdir, meta_name), encoding="utf-8") as f:
            meta = json.load(f)
        if meta.get("version") != version or (stamps_valid is not None and not stamps_valid(meta["stamps"])):
            return None
        arrays = {k: np.load(os.path.join(cdir, name), mmap_mode="r", allow_pickle=False)
                  for k, name in meta["files"].items()}
        return build(meta, arrays)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _stamps_valid(stamps: list) -> bool:
    try:
        for path, value in stamps:
            if path.endswith("#size"):
                if os.stat(path[:-5]).st_size != value:
                    return False
            elif os.stat(path).st_mtime_ns != value:
                return False
    except OSError:
        return False
    return True


def _load_cache(cdir: str, validate: bool = True) -> Index | None:
    """The cached index in ``cdir``; None if there is none or (``validate``) the dataset changed
    since it was scanned."""
    def build(meta: dict, arrays: dict) -> Index:
        return Index(meta["root"], tuple(meta["classes"]), arrays["blob"], arrays["offsets"], arrays["labels"],
                     meta["fingerprint"], files_dir=cdir, skipped=tuple(meta.get("skipped", ())),
                     kind=meta.get("kind", "folder"))

    return read_cache(cdir, "meta.json", _CACHE_VERSION, build, _stamps_valid if validate else None)


def _save_cache(cdir: str, index: Index, stamps: list) -> Index:
    write_cache(cdir, "meta.json", {k: getattr(index, k) for k in ("blob", "offsets", "labels")},
                {"version": _CACHE_VERSION, "root": index.root, "classes": list(index.classes),
                 "fingerprint": index.fingerprint, "stamps": stamps, "count": len(index),
                 "skipped": list(index.skipped), "kind": index.kind})
    cached = _load_cache(cdir)
    return cached if cached is not None else index


@refuse_unless_classlike  # a root one level too high (only train/ and val/) is refused: core/classlike.py
def load_index(root: str | None, file_list: str | None, extensions: tuple[str, ...],
               cache_dir: str | None, use_cache: bool = True, devkit: str | None = None,
               section: str = "dataset") -> tuple[Index, bool]:
    """Return (index, from_cache). Scans and (re)writes the cache when it is missing or stale.
    ``devkit``: the ImageNet devkit that labels a flat validation set (``validation.devkit``).
    ``section``: the config section that names ``root`` or ``file_list`` (``validation`` for the
    validation set), so a message names the key the user wrote."""
    if root is not None and file_list is None:
        from prefetchd.core import tarindex

        if tarindex.layout(root, devkit):
            return tarindex.load(root, devkit, extensions, cache_dir, use_cache, key=f"{section}.root")
    if devkit:
        if root is not None and file_list is None:
            _check_root(root, f"{section}.root")  # missing or unreadable: that, not the devkit, is the mistake
        raise DatasetError(f"validation.devkit labels a flat validation set (ImageNet's validation tar or its "
                           f"flat folder); {root or file_list} is not one (its labels are its own): remove "
                           "validation.devkit")
    kind, source = ("list", file_list) if file_list else ("folder", root)
    assert source is not None
    cdir = cache_path(cache_dir, source, kind, extensions)
    if use_cache:
        cached = _load_cache(cdir)
        if cached is not None:
            return cached, True
    if kind == "list":
        index, stamps = scan_file_list(source, f"{section}.file_list")
    else:
        index, stamps = scan_image_folder(source, extensions, f"{section}.root")
    if use_cache:
        try:
            index = _save_cache(cdir, index, stamps)
        except OSError as e:
            log.warning("cannot write the index cache in %s (%s); the next start scans again", cdir, e.strerror)
    return index, False


def val_labels(val, train):
    """The validation index with the TRAIN set's class-to-index mapping: an ImageFolder's class
    folders are looked up by name in the train classes (one missing there is an error); a file
    list's labels are kept and must be below the train set's class count."""
    if val.classes == train.classes:
        return val
    if all(c.isdigit() for c in val.classes) and not all(c.isdigit() for c in train.classes):
        if len(val.classes) > len(train.classes):
            raise DatasetError(f"validation labels go up to {len(val.classes) - 1} but the train set has "
                               f"{len(train.classes)} classes")
        return replace(val, classes=train.classes, files_dir=None)
    where = {c: i for i, c in enumerate(train.classes)}
    missing = [c for c in val.classes if c not in where]
    if missing:
        raise DatasetError(f"validation class folder(s) {missing[:5]} are not in the train set's classes "
                           f"(dataset.root); validation.root must use the train set's class names")
    table = np.array([where[c] for c in val.classes], dtype=np.int32)
    return replace(val, classes=train.classes, labels=table[np.asarray(val.labels)], files_dir=None)


def open_index_files(files_dir: str, fingerprint: str | None = None) -> Index:
    """Open a cached index read-only by memory map (what workers do).

    The dataset is not looked at: a worker serves the index its daemon read, even if the
    dataset changed since (noticing that is the daemon's job, see ``Daemon._rescan``). With
    ``fingerprint``, the files must hold that index (another process may have rescanned a
    changed dataset and replaced them): ``index_files_hold`` tells beforehand."""
    from prefetchd.core import tarindex

    index = tarindex.open_files(files_dir) or _load_cache(files_dir, validate=False)
    if index is None:
        raise DatasetError(f"the index cache in {files_dir} is missing or unreadable")
    if fingerprint is not None and index.fingerprint != fingerprint:
        raise DatasetError(f"the index cache in {files_dir} holds index {index.fingerprint}, not {fingerprint}")
    return index


def index_files_hold(files_dir: str, fingerprint: str) -> bool:
    """Do the cache files in ``files_dir`` still hold the index ``fingerprint`` (cheap: meta.json
    and the files' presence; the arrays are not read)?"""
    from prefetchd.core import tarindex

    try:
        name = tarindex.META if os.path.exists(os.path.join(files_dir, tarindex.META)) else "meta.json"
        with open(os.path.join(files_dir, name), encoding="utf-8") as f:
            meta = json.load(f)
        return (meta.get("fingerprint") == fingerprint
                and all(os.path.isfile(os.path.join(files_dir, f)) for f in meta["files"].values()))
    except (OSError, ValueError, KeyError, TypeError):
        return False


def unchanged_since_scan(files_dir: str | None, fingerprint: str) -> bool:
    """Is the dataset as it was when the index ``fingerprint``, cached in ``files_dir``, was
    scanned? Cheap: the cache's own stamps, as a start-up with the cache checks them (one stat
    per archive for tar files; every scanned folder's mtime for a folder, so a file added, gone
    or renamed shows; the list file's for a file list). False when it cannot tell (no cache, or
    the cache holds another index now): scan to know."""
    if files_dir is None:
        return False
    from prefetchd.core import tarindex

    try:
        tar = os.path.exists(os.path.join(files_dir, tarindex.META))
        with open(os.path.join(files_dir, tarindex.META if tar else "meta.json"), encoding="utf-8") as f:
            meta = json.load(f)
        if meta.get("fingerprint") != fingerprint:
            return False
        return tarindex.stamps_valid(meta["stamps"]) if tar else _stamps_valid(meta["stamps"])
    except (OSError, ValueError, KeyError, TypeError):
        return False


def read_all(fd: int) -> bytes:
    """The whole file, in a buffer sized by ``fstat`` (not a 1 GiB one per image)."""
    size = os.fstat(fd).st_size
    chunks = [os.read(fd, size + 1)] if size else []
    while True:  # a file that grew since fstat, or one with no size (a pipe, /proc)
        more = os.read(fd, max(size, 1 << 16))
        if not more:
            return b"".join(chunks)
        chunks.append(more)
