"""An ImageFolder in a bucket (``s3://bucket/prefix/<class>/.../<image>``), indexed from one listing.

The same index as ``folder.scan_image_folder`` gives for the same tree on a disk, so the same
seed gives the same batches from either: classes are the sorted first path components, a
class's images in torchvision's order (folders by their whole path, then names); hidden path
components, ``._*`` files and ``__MACOSX`` are skipped; extensions matched case-insensitively.
A bucket has no empty folders and no symlinks, so those rules of the local scan have nothing to
do here. The index's root is the URL, so ``Index.read`` reads each sample as one GET (whole
object) through ``objectstore``; the index keeps each object's size and ETag as listed, which key
it in the node-local cache (``bytecache``, ``dataset.cache``) when there is one.

Listing a large prefix takes minutes: the index is cached like a local one (the same
``meta.json`` and ``.npy`` files, written with no credential in them) and kept until a reload
(SIGHUP) lists again and finds the objects changed (``stamps_valid``): the next start scans. A
bucket has no directory mtimes to tell a change cheaply.
"""

from __future__ import annotations

import hashlib
import logging
import os
import posixpath
from dataclasses import dataclass

import numpy as np

from prefetchd.sources import bytecache, folder, objectstore, readahead
from prefetchd.sources.base import (
    CACHE_VERSION,
    DatasetError,
    Index,
    build_index,
    cache_path,
    read_cache,
    write_cache,
)

log = logging.getLogger("prefetchd.dataset")

META = "bucket-meta.json"  # not folder's meta.json: ``dataset.open_index_files`` tells the kinds apart by it


@dataclass(frozen=True)
class BucketIndex(Index):
    """An ``Index`` whose root is a bucket URL: a sample is one GET of its object."""

    sizes: np.ndarray | None = None  # int64 [n]: each object's size as listed (None: a cache from before)
    etags: np.ndarray | None = None  # bytes [n]: each object's ETag as listed

    def read(self, i: int) -> bytes:
        return readahead.fetched(self.root, i, lambda: self._get(i))

    def prefetch(self, indices, ahead=()) -> None:
        """Start reading the objects of ``indices`` (the batch being made), then those of ``ahead``
        (the batches queued after it, in order), within ``readahead``'s bounds; ``read`` then takes
        each one's bytes."""
        sizes = self.sizes
        readahead.fetch_ahead(self.root, [indices, *ahead], self._get,
                              None if sizes is None else lambda i: int(sizes[i]))

    def _get(self, i: int) -> bytes:
        """The object's bytes: from the node-local cache (``bytecache``) when it holds them for the
        ETag listed; else one GET, kept there when the object is still the one listed (an object
        overwritten since is read as it is now, and not cached under the listed ETag)."""
        store = objectstore.store_for(self.root)
        kept = bytecache.current() if self.etags is not None else None
        # quoted as a GET's is: an index cache from before the quoting (bare, as fake-gcs-server lists
        # them) is kept until a reload lists again, and its objects were never kept in the cache
        etag = objectstore.quoted(self.etags[i].decode()) if kept is not None else ""
        if kept is not None and etag:
            data = kept.get(store.cache_key(self.path(i)), etag, 0, int(self.sizes[i]))
            if data is not None:
                return data
        data, now = store.read_tagged(self.path(i))
        if kept is not None and etag and now == etag and len(data) == int(self.sizes[i]):
            kept.put(store.cache_key(self.path(i)), etag, 0, data)
        return data

    def content_stamp(self, i: int) -> str:
        """The object's size and ETag now (``Index.content_stamp``)."""
        try:
            h = objectstore.store_for(self.root).head(self.path(i))
        except OSError as e:
            return f"unreadable:{e.errno}"
        return f"{h.size}:{h.etag}"

    def sample_size(self, i: int) -> int:
        try:
            return objectstore.store_for(self.root).head(self.path(i)).size
        except OSError:
            return 0

    def describe(self) -> str:
        return f"{self.root}, {'a file list' if self.kind == 'list' else 'an ImageFolder'} in a bucket"


def _list_stamps_valid(stamps: list) -> bool:
    """A file list's index (``bucketlist``) is valid while its list is the one indexed: an object's
    (size, ETag) by one HEAD, a local file's (size, mtime)."""
    for stamp in stamps:
        try:
            if stamp[0] == "list-object":
                h = objectstore.store_for(stamp[1]).head(stamp[1])
                now = [h.size, h.etag]
            elif stamp[0] == "list-file":
                st = os.stat(stamp[1])
                now = [st.st_size, st.st_mtime_ns]
            else:
                return False
        except (OSError, DatasetError):
            return False
        if now != list(stamp[2:]):
            return False
    return True


def stamps_valid(stamps) -> bool:
    """Still the objects indexed (a reload asks)? A file list's: its list unchanged
    (``_list_stamps_valid``). An ImageFolder's: the root listed again (a bucket has no directory
    mtimes to compare): it returned True without asking, so a reload said "unchanged" of a bucket
    with images added. A change found marks the cache (``_RELIST``) for the next start to scan, as
    the reload's line tells the user to restart for: it was used as it was, the new images unseen."""
    if isinstance(stamps, list):
        return _list_stamps_valid(stamps)
    if not isinstance(stamps, dict):  # a cache from before: cannot tell, scan
        return False
    try:
        now = scan(stamps["root"], tuple(stamps["extensions"]))
    except (OSError, DatasetError):
        return False
    if _digest(now) == stamps["digest"]:
        return True
    try:
        with open(os.path.join(stamps["dir"], _RELIST), "w", encoding="utf-8"):
            pass
    except OSError:
        pass
    return False


_RELIST = "relist"  # in an index cache's folder: the bucket changed since (a reload saw it), the next start scans


def _digest(index: BucketIndex) -> str:
    h = hashlib.sha256(index.fingerprint.encode())
    for a in (index.sizes, index.etags):
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def open_files(cdir: str) -> BucketIndex | None:
    """The cached bucket index in ``cdir``, or None (none there, or another kind's cache)."""
    def build(meta: dict, arrays: dict) -> BucketIndex:
        return BucketIndex(meta["root"], tuple(meta["classes"]), arrays["blob"], arrays["offsets"], arrays["labels"],
                           meta["fingerprint"], files_dir=cdir, sizes=arrays.get("sizes"), etags=arrays.get("etags"),
                           kind=meta.get("kind", "folder"))  # "list": a file list's (``bucketlist``)

    return read_cache(cdir, META, CACHE_VERSION, build)


def scan(root: str, extensions: tuple[str, ...], key: str = "dataset.root",
         storage_options: dict | None = None) -> Index:
    """The index of the ImageFolder under the bucket URL ``root``."""
    store = objectstore.store_for(root, storage_options, key)
    exts = tuple(e.lower() for e in extensions)
    by_class: dict[str, list[tuple[str, str, int, str]]] = {}  # class -> (folder, name, size, ETag) of its images
    apple = 0
    datasets: dict[str, list[str]] = {}  # a "folder" -> the shards or Parquet files at its top
    try:
        for rel, size, etag in store.list(root):
            parts = rel.split("/")
            if len(parts) < 2 or any(p.startswith(".") or not p for p in parts) or parts[0] == folder.MACOSX:
                continue
            name = parts[-1]
            if name.startswith("._"):
                apple += name.lower().endswith(exts)
                continue
            by_class.setdefault(parts[0], [])
            if len(parts) == 2 and name.lower().endswith((".tar", ".parquet")):
                datasets.setdefault(parts[0], []).append(name)
            if name.lower().endswith(exts):
                by_class[parts[0]].append((posixpath.dirname(rel), name, size, etag))
    except OSError as e:
        raise objectstore.listing_error(key, root, store, e) from None
    classes = sorted(by_class)
    if not classes:
        raise DatasetError(f"{key} {root} has no class folders (expected {root.rstrip('/')}/<class>/<image>)")
    rel_paths: list[bytes] = []
    labels: list[int] = []
    sizes: list[int] = []
    etags: list[bytes] = []
    empty = []
    for label, cls in enumerate(classes):
        images = sorted(by_class[cls])  # torchvision's order: by folder path as str, then by name (unique)
        if not images:
            empty.append(cls)
        rel_paths.extend(f"{d}/{n}".encode("utf-8", "surrogateescape") for d, n, _, _ in images)
        labels.extend([label] * len(images))
        sizes.extend(s for _, _, s, _ in images)
        etags.extend(e.encode() for _, _, _, e in images)
    held = [c for c in empty if c in datasets]
    if held:  # a split's prefix (train/, data/ of a Hugging Face repo) one level up: no class
        c = held[0]
        raise DatasetError(f"{key} {root}: the folder {c}/ is not a class: no images, only {len(datasets[c])} "
                           f"{'.tar' if datasets[c][0].lower().endswith('.tar') else '.parquet'} object(s) "
                           f"({datasets[c][0]} ...); set {key} to {root.rstrip('/')}/{c}/ to read them")
    if empty:
        log.warning("%d class folder(s) hold no images (their labels stay reserved): %s",
                    len(empty), ", ".join(empty[:5]) + (" ..." if len(empty) > 5 else ""))
    if apple:
        log.warning("%d ._* file(s) not indexed: macOS AppleDouble metadata (a copy from a Mac), not images", apple)
    if not rel_paths:
        raise DatasetError(f"{key} {root} holds no images with extensions {', '.join(exts)}")
    plain = build_index(root.rstrip("/"), classes, rel_paths, labels)
    return BucketIndex(plain.root, plain.classes, plain.blob, plain.offsets, plain.labels, plain.fingerprint,
                       sizes=np.asarray(sizes, np.int64), etags=np.asarray(etags, dtype=f"S{max(1, *map(len, etags))}"))


def load(root: str, extensions: tuple[str, ...], cache_dir: str | None, use_cache: bool = True,
         section: str = "dataset", storage_options: dict | None = None) -> tuple[Index, bool]:
    """(index, from_cache) of the ImageFolder under the bucket URL ``root``."""
    objectstore.split(root, f"{section}.root")  # a URL prefetchd cannot read is one line, before any listing
    # the daemon reads with the store too (the transform's probe, quarantine stamps): the config's
    # keys and endpoint, set up before the cache is looked up, which keys on the endpoint
    store = objectstore.store_for(root, storage_options, f"{section}.root")
    endpoint = store.endpoint()
    cdir = cache_path(cache_dir, root.rstrip("/") + (f" at {endpoint}" if endpoint else ""), "bucket-folder",
                      extensions)
    relist = os.path.join(cdir, _RELIST)
    if use_cache and not os.path.exists(relist):
        cached = open_files(cdir)  # valid until a reload lists again (``stamps_valid``)
        if cached is not None:
            return cached, True
    index = scan(root, extensions, f"{section}.root", storage_options)
    if use_cache:
        try:
            stamps = {"root": root, "extensions": list(extensions), "dir": cdir, "digest": _digest(index)}
            write_cache(cdir, META, {k: getattr(index, k) for k in ("blob", "offsets", "labels", "sizes", "etags")},
                        {"version": CACHE_VERSION, "root": index.root, "classes": list(index.classes),
                         "fingerprint": index.fingerprint, "stamps": stamps, "count": len(index)})
            if os.path.exists(relist):
                os.unlink(relist)
            index = open_files(cdir) or index
        except OSError as e:
            log.warning("cannot write the index cache in %s (%s); the next start lists again", cdir, e.strerror)
    return index, False
