"""An ImageFolder in a bucket (``s3://bucket/prefix/<class>/.../<image>``), indexed from one listing.

The same index as ``folder.scan_image_folder`` gives for the same tree on a disk, so the same
seed gives the same batches from either: classes are the sorted first path components, a
class's images in torchvision's order (folders by their whole path, then names); hidden path
components, ``._*`` files and ``__MACOSX`` are skipped; extensions matched case-insensitively.
A bucket has no empty folders and no symlinks, so those rules of the local scan have nothing to
do here. The index's root is the URL, so ``Index.read`` reads each sample as one GET (whole
object) through ``objectstore``.

Listing a large prefix takes minutes: the index is cached like a local one (the same
``meta.json`` and ``.npy`` files, written with no credential in them) and kept until a reload
scans again (``use_cache=False``); a bucket has no directory mtimes to tell a change cheaply.
"""

from __future__ import annotations

import logging
import posixpath

from prefetchd.sources import folder, objectstore
from prefetchd.sources.base import DatasetError, Index, build_index, cache_path

log = logging.getLogger("prefetchd.dataset")


def scan(root: str, extensions: tuple[str, ...], key: str = "dataset.root",
         storage_options: dict | None = None) -> Index:
    """The index of the ImageFolder under the bucket URL ``root``."""
    store = objectstore.store_for(root, storage_options, key)
    exts = tuple(e.lower() for e in extensions)
    by_class: dict[str, list[tuple[str, str]]] = {}  # class -> (folder, name) of its images
    apple = 0
    try:
        for rel, _size, _etag in store.list(root):
            parts = rel.split("/")
            if len(parts) < 2 or any(p.startswith(".") or not p for p in parts) or parts[0] == folder.MACOSX:
                continue
            name = parts[-1]
            if name.startswith("._"):
                apple += name.lower().endswith(exts)
                continue
            by_class.setdefault(parts[0], [])
            if name.lower().endswith(exts):
                by_class[parts[0]].append((posixpath.dirname(rel), name))
    except OSError as e:
        raise DatasetError(f"{key} {root} cannot be listed: {e.strerror}") from None
    classes = sorted(by_class)
    if not classes:
        raise DatasetError(f"{key} {root} has no class folders (expected {root.rstrip('/')}/<class>/<image>)")
    rel_paths: list[bytes] = []
    labels: list[int] = []
    empty = []
    for label, cls in enumerate(classes):
        images = sorted(by_class[cls])  # torchvision's order: by folder path as str, then by name
        if not images:
            empty.append(cls)
        rel_paths.extend(f"{d}/{n}".encode("utf-8", "surrogateescape") for d, n in images)
        labels.extend([label] * len(images))
    if empty:
        log.warning("%d class folder(s) hold no images (their labels stay reserved): %s",
                    len(empty), ", ".join(empty[:5]) + (" ..." if len(empty) > 5 else ""))
    if apple:
        log.warning("%d ._* file(s) not indexed: macOS AppleDouble metadata (a copy from a Mac), not images", apple)
    if not rel_paths:
        raise DatasetError(f"{key} {root} holds no images with extensions {', '.join(exts)}")
    return build_index(root.rstrip("/"), classes, rel_paths, labels)


def load(root: str, extensions: tuple[str, ...], cache_dir: str | None, use_cache: bool = True,
         section: str = "dataset", storage_options: dict | None = None) -> tuple[Index, bool]:
    """(index, from_cache) of the ImageFolder under the bucket URL ``root``."""
    objectstore.split(root, f"{section}.root")  # a URL prefetchd cannot read is one line, before any listing
    cdir = cache_path(cache_dir, root.rstrip("/"), "bucket-folder", extensions)
    if use_cache:
        cached = folder.load_cached(cdir)  # no stamps: valid until a reload lists again
        if cached is not None:
            return cached, True
    index = scan(root, extensions, f"{section}.root", storage_options)
    if use_cache:
        try:
            index = folder.save_cache(cdir, index, [])
        except OSError as e:
            log.warning("cannot write the index cache in %s (%s); the next start lists again", cdir, e.strerror)
    return index, False
