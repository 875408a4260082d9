"""A file list whose images are objects in a bucket (``dataset.file_list`` / ``validation.file_list``).

Two forms, both ``path label`` lines as a local list (``folder.parse_file_list``: ``#`` comments,
blank lines, non-negative integer labels, classes ``0`` .. the largest label):

* the list is an object, ``s3://bucket/lists/train.txt``: a relative path is relative to the list's
  folder, as a local list's to its directory (``s3://bucket/lists/<path>``); a full ``s3://`` URL
  (of the same bucket) is read as it is;
* the list is a local file whose paths are ``s3://`` URLs (all of them: a list of both local paths
  and URLs is refused).

The index is a ``bucketfolder.BucketIndex`` (a sample is one GET of its object, read ahead and
through the node-local cache as an ImageFolder's): its root is the list's folder when every path
lies under it (so a list uploaded beside its images gives the local list's paths, labels and
fingerprint: the same batches), else the deepest folder holding them all. A listing of each folder
the paths lie in (its own level; or, with very many folders, one of everything under the root)
gives each object's size and ETag; paths that name no object are one line, before any batch. The
index is cached keyed on the list's bytes (a list rewritten is indexed anew), the root and the
endpoint.
"""

from __future__ import annotations

import hashlib
import logging
import os
import posixpath
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from prefetchd.sources import bucketfolder, objectstore
from prefetchd.sources.base import CACHE_VERSION, DatasetError, build_index, cache_path, write_cache
from prefetchd.sources.folder import parse_file_list

log = logging.getLogger("prefetchd.dataset")

_SCHEMES = (b"s3://", b"gs://")


def _urls(paths: list[bytes], folder: str | None, where: str, key: str) -> list[str]:
    """Each path as a full URL: a URL as it is, a relative path under ``folder`` (None: a local
    list, where every path must be a URL)."""
    out = []
    for p in paths:
        text = p.decode("utf-8", "surrogateescape")
        if p.startswith(_SCHEMES):
            out.append(text)
            continue
        if folder is None:
            raise DatasetError(f"{key} {where} names objects in a bucket ({out[0] if out else ''}) and local "
                               f"paths ({text}): one or the other; give every image as an s3:// URL, or upload "
                               "the list beside the images and set the key to its URL")
        rel = posixpath.normpath(text)
        if text.startswith("/") or rel == ".." or rel.startswith("../"):
            raise DatasetError(f"{key} {where}: the path {text} is not under the list's folder {folder}/: in a "
                               "bucket, paths are relative to the list's folder or full s3:// URLs")
        out.append(f"{folder}/{rel}")
    return out


def _root(urls: list[str], folder: str | None, where: str, key: str) -> str:
    """The index's root: ``folder`` when every URL lies under it, else their deepest common folder."""
    buckets = {objectstore.split(u, key)[:2] for u in urls}
    if len(buckets) > 1:
        shown = sorted(f"{s}://{b}" for s, b in buckets)[:2]
        raise DatasetError(f"{key} {where} names objects in {len(buckets)} buckets ({', '.join(shown)} ...): "
                           "one bucket per list")
    if folder is not None and all(u.startswith(folder + "/") for u in urls):
        return folder
    common = posixpath.commonpath([u.split("://", 1)[1] for u in urls])
    (scheme, bucket), = buckets
    common = common if common != bucket and not any(u.split("://", 1)[1] == common for u in urls) else (
        posixpath.dirname(common))
    return f"{scheme}://{common or bucket}"


_PAGE = 1000  # the objects a listing's page holds (S3's and GCS's most)
_FOLDERS_IN_FLIGHT = 8


def _listed(store: objectstore.ObjectStore, root: str, rel: list[str]) -> dict[str, tuple[int, str]]:
    """``{path under root: (size, ETag)}`` of the objects in the folders the list's paths lie in: each
    folder's own level, listed apart (8 at once), so a list of a few images at a bucket's top does not
    list the whole bucket; but where the paths lie in more than 64 folders and in more folders than
    the list has pages of 1,000 paths (an image a folder, say), one listing of everything under
    ``root``."""
    folders = sorted({posixpath.dirname(r) for r in rel})
    if len(folders) > max(64, -(-len(rel) // _PAGE)):
        return {name: (size, etag) for name, size, etag in store.list(root)}

    failed: list[OSError] = []

    def level(folder: str) -> list[tuple[str, int, str]]:
        if failed:  # a listing gave up (a whole retry episode: the endpoint gone): no other folder's starts one
            raise failed[0]
        try:
            objects, _ = store.list_top(f"{root}/{folder}" if folder else root)
        except OSError as e:
            failed.append(e)
            raise
        return [(f"{folder}/{name}" if folder else name, size, etag) for name, size, etag in objects]

    with ThreadPoolExecutor(min(_FOLDERS_IN_FLIGHT, len(folders)), thread_name_prefix="prefetchd-list") as pool:
        return {name: (size, etag) for got in pool.map(level, folders) for name, size, etag in got}


def load(list_path: str, extensions: tuple[str, ...], cache_dir: str | None, use_cache: bool = True,
         section: str = "dataset", storage_options: dict | None = None) -> tuple[bucketfolder.BucketIndex, bool]:
    """(index, from_cache) of the file list ``list_path`` (an ``s3://`` URL, or a local list of them)."""
    key = f"{section}.file_list"
    in_bucket = objectstore.is_url(list_path)
    if in_bucket:
        store = objectstore.store_for(list_path, storage_options, key)
        try:
            data, etag = store.read_tagged(list_path)
        except FileNotFoundError:
            raise DatasetError(f"{key} {list_path}: no such object in the bucket (check the bucket and the key)") \
                from None
        except OSError as e:
            raise objectstore.listing_error(key, list_path, store, e) from None
        folder = list_path.rpartition("/")[0]
        stamps = [["list-object", list_path, len(data), etag]]  # a reload (SIGHUP) sees the list rewritten
    else:
        try:
            with open(list_path, "rb") as f:
                st = os.fstat(f.fileno())  # before the read: a change after it shows at the next reload
                data = f.read()
            stamps = [["list-file", list_path, st.st_size, st.st_mtime_ns]]
        except OSError as e:
            raise DatasetError(f"{key} {list_path}: {e.strerror}") from None
        folder = None
    paths, labels = parse_file_list(data.splitlines(), list_path, key)
    urls = _urls(paths, folder, list_path, key)
    root = _root(urls, folder, list_path, key)
    store = objectstore.store_for(root, storage_options, key)
    endpoint = store.endpoint()
    digest = hashlib.sha256(data).hexdigest()[:16]
    cdir = cache_path(cache_dir, f"{list_path}|{digest}" + (f" at {endpoint}" if endpoint else ""), "bucket-list",
                      extensions)
    if use_cache:
        cached = bucketfolder.open_files(cdir)
        if cached is not None:
            return cached, True
    rel = [u[len(root) + 1:] for u in urls]
    try:
        listed = _listed(store, root, rel)
    except OSError as e:
        raise objectstore.listing_error(key, root, store, e) from None
    missing = [r for r in rel if r not in listed]
    if missing:
        raise DatasetError(f"{key} {list_path}: {len(missing)} of the {len(rel)} images it lists are not in the "
                           f"bucket (e.g. {root}/{missing[0]}): upload them, or remove their lines")
    plain = build_index(root, [str(i) for i in range(max(labels) + 1)],
                        [r.encode("utf-8", "surrogateescape") for r in rel], labels)
    etags = [listed[r][1].encode() for r in rel]
    index = bucketfolder.BucketIndex(plain.root, plain.classes, plain.blob, plain.offsets, plain.labels,
                                     plain.fingerprint, kind="list",
                                     sizes=np.asarray([listed[r][0] for r in rel], np.int64),
                                     etags=np.asarray(etags, dtype=f"S{max(1, *map(len, etags))}"))
    if use_cache:
        try:
            write_cache(cdir, bucketfolder.META, {k: getattr(index, k) for k in ("blob", "offsets", "labels", "sizes",
                                                                                  "etags")},
                        {"version": CACHE_VERSION, "root": index.root, "classes": list(index.classes),
                         "fingerprint": index.fingerprint, "stamps": stamps, "count": len(index), "kind": "list"})
            index = bucketfolder.open_files(cdir) or index
        except OSError as e:
            log.warning("cannot write the index cache in %s (%s); the next start lists again", cdir, e.strerror)
    return index, False
