"""The bottom of the dataset index: what every dataset kind shares and the chooser imports.

The errors, the index record (``Index``: every sample's path and label in three numpy arrays), its
content hash, and the on-disk cache's reader and writer. Each dataset kind (``folder``: an
ImageFolder or a file list; ``imagenet`` and ``archive``: archives read in place) builds on this
module and never on ``dataset``, which chooses among them.

The index is three numpy arrays: a byte blob of the paths relative to the root, an int64 offset
array and an int32 label array (about 40 bytes per sample for ImageNet, instead of ~150 for a
list of Python strings). They are saved as ``.npy`` files in the cache directory and opened with
``mmap_mode='r'``: forked or spawned workers share the page cache instead of copying a list of
objects page by page, and a restart skips the scan.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import time
from dataclasses import dataclass, replace

import numpy as np
import xxhash

from prefetchd.format.atomic import write_atomic

CACHE_VERSION = 4  # 4: ._* AppleDouble files skipped; 3: torchvision's order (folders by whole path); 2: directory symlinks into the root not followed


class DatasetError(ValueError):
    """The dataset cannot be used: the message says why and what to do."""


MAX_CLASSES = 1 << 24  # labels numbered past this are ids, not class indices (WebFace260M has 4 M classes)


def numbered_classes(top: int, key: str, root: str, where: str) -> list[str]:
    """``"0" .. str(top)``, the classes of labels that name none; a DatasetError when ``top`` (the
    label of ``where``) is no class index: the list would be gigabytes (~170 bytes a class)."""
    if top >= MAX_CLASSES:
        raise DatasetError(f"{key} {root}: labels go up to {top} (e.g. {where}), more than {MAX_CLASSES} classes: "
                           "an id, not a class index? write labels as indices 0 .. classes-1")
    return [str(i) for i in range(top + 1)]


class StorageUnavailable(DatasetError):
    """A bucket that did not answer at start for the whole retry episode (its endpoint down, a
    network not up yet at boot, throttling): not the configuration's fault, so ``prefetchd run``
    exits 75 (EX_TEMPFAIL), which a service manager restarts, not 78; ``prefetchd check`` too."""

    said, exit_code = "storage unavailable", 75


class StorageChanged(OSError):
    """What ``Index.read`` reads from is no longer what was indexed (an archive replaced or cut):
    the storage's state, not the sample's fault (``executors.storage`` waits for it). Its message
    begins ``"the archive PATH "`` and holds ``MARK``: the daemon says it once per archive."""

    MARK = " changed since it was indexed"


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

    @property
    def refusal_root(self) -> str:
        """What a read's refusal is asked of (``executors.storage``): the root; a bucket index whose
        samples all lie in one object (one shard, one Parquet file), that object."""
        return self.root

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
    skipped_rule = ("directory symlinks into the root are not followed; a directory is indexed once; a Mac zip's "
                    "__MACOSX is no class")

    def describe(self) -> str:
        """What the dataset is, in a few words (``prefetchd check``)."""
        if self.kind == "list":
            return f"a file list in {self.root}"
        return f"{os.path.basename(self.root.rstrip(os.sep)) or self.root}, an ImageFolder"

    def content_stamp(self, i: int) -> str:
        """What sample ``i``'s bytes are now, in a few characters (its file's size, mtime, inode and
        ctime: a file restored in place from a backup, ``cp -p``, has its old size, inode and mtime):
        a quarantine entry made under another stamp is not held against the new content."""
        try:
            st = os.stat(self.path(i))
        except OSError as e:
            return f"unreadable:{e.errno}"
        return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}:{st.st_ctime_ns}"

    def block_sizes(self) -> np.ndarray | None:
        """The sizes of the runs of consecutive samples that are cheap to read together (a
        ``loader.shuffle: block``'s blocks), or None: this layout reads each sample alone."""
        return None

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


def build_index(root: str, classes: list[str], rel: list[bytes], labels: list[int]) -> Index:
    lens = np.fromiter((len(p) for p in rel), dtype=np.int64, count=len(rel))
    offsets = np.zeros(len(rel) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    blob = np.frombuffer(b"".join(rel), dtype=np.uint8) if rel else np.zeros(0, np.uint8)
    lab = np.asarray(labels, dtype=np.int32)
    return Index(root, tuple(classes), blob, offsets, lab, index_fingerprint(blob, offsets, lab))


def check_root(root: str, key: str = "dataset.root") -> None:
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


def default_cache_dir() -> str:
    if os.environ.get("CACHE_DIRECTORY"):  # systemd's CacheDirectory=
        return os.environ["CACHE_DIRECTORY"].split(":")[0]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "prefetchd")


def cache_path(cache_dir: str | None, source: str, kind: str, extensions: tuple[str, ...]) -> str:
    """The cache directory of the index of ``source`` (a root, a list, an archive layout: ``kind``)."""
    key = hashlib.sha256(f"{CACHE_VERSION}|{kind}|{source}|{','.join(extensions)}".encode()).hexdigest()[:16]
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


def cached_or_scanned(cdir: str, meta_name: str, use_cache: bool, load_cached, changed, scan, cache_of):
    """``(index, from_cache)`` of a bucket's layout: the index cached in ``cdir`` when ``changed(cached)``
    (one listing: are the objects still those indexed?) says None, else its warning's words and a new
    ``scan()``, timed (its ``scan_s``) and cached (``cache_of(index)``: its arrays and meta) unless
    ``use_cache`` is false; a cache that cannot be written is a warning (the next start scans again)."""
    log = logging.getLogger("prefetchd.dataset")
    if use_cache:
        cached = load_cached(cdir)
        if cached is not None:
            why = changed(cached)
            if why is None:
                return cached, True
            log.warning("%s", why)
    t0 = time.monotonic()
    index = scan()
    index = replace(index, scan_s=round(time.monotonic() - t0, 3))
    if use_cache:
        try:
            write_cache(cdir, meta_name, *cache_of(index))
            index = load_cached(cdir) or index
        except OSError as e:
            log.warning("cannot write the index cache in %s (%s); the next start indexes again", cdir, e.strerror)
    return index, False


def open_cached(files_dir: str, meta_name: str, load_cached):
    """The cached index in ``files_dir`` whose meta file is ``meta_name`` (what workers open, by
    ``load_cached(files_dir, validate=False)``), None if the cache is another kind's; a
    DatasetError if it is this kind's but cannot be read."""
    if not os.path.exists(os.path.join(files_dir, meta_name)):
        return None
    index = load_cached(files_dir, validate=False)
    if index is None:
        raise DatasetError(f"the index cache in {files_dir} is missing or unreadable")
    return index


def read_all(fd: int) -> bytes:
    """The whole file, in a buffer sized by ``fstat`` (not a 1 GiB one per image)."""
    size = os.fstat(fd).st_size
    chunks = [os.read(fd, size + 1)] if size else []
    while True:  # a file that grew since fstat, or one with no size (a pipe, /proc)
        more = os.read(fd, max(size, 1 << 16))
        if not more:
            return b"".join(chunks)
        chunks.append(more)
