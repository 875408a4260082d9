"""A bucket root (``s3://``, ``gs://``): which layout it holds, told in one place, and its index loaded.

The layouts read from a bucket: an ImageFolder of objects (``bucketfolder``), WebDataset shards
(``bucketshards``) and Parquet files (``bucketparquet``). ``dataset.layout`` names one, or ``auto``
(the default) tells them apart by the root's name and one delimited listing of its top level
(one request, whatever lies below): a brace pattern or a ``.tar`` object is shards, a
``.parquet`` object is Parquet; a prefix whose top level holds ``.tar`` objects is shards (when
its first tar's first members are WebDataset samples: ``webdataset.looks_like_shards``, one small
ranged GET), one holding ``.parquet`` objects and no folders is Parquet, else an ImageFolder. A
glob (``*?[``) is read for Parquet only (shards are named by a brace pattern, as webdataset's).
ImageNet's tars, ``file_list`` and ``validation.devkit`` are read from a local disk only.
"""

from __future__ import annotations

import os

from prefetchd.core.configsections import IMAGE_EXTENSIONS
from prefetchd.sources import objectstore, shardnames
from prefetchd.sources.base import DatasetError, Index, default_cache_dir

_PROBE_CHUNK = 256 << 10  # bytes of the first tar fetched to tell shards from class tars
_LEFTOVERS = ("lost+found", "__MACOSX")


def detect(root: str, key: str, storage_options: dict | None, cache_dir: str | None = None) -> str:
    """``dataset.layout: auto`` for a bucket root: ``webdataset``, ``parquet`` or ``imagefolder``."""
    from prefetchd.sources import bucketshards, webdataset

    _, _, prefix = objectstore.split(root, key)
    if shardnames.is_pattern(prefix) or prefix.lower().endswith(".tar"):
        return "webdataset"
    if prefix.endswith(".parquet"):
        return "parquet"  # one, or a glob of them
    store = objectstore.store_for(root, storage_options, key)
    try:
        objects, folders = store.list_top(root)
    except OSError as e:  # a wrong key (403), no such bucket (404), an endpoint down past the retries
        raise objectstore.listing_error(key, root, store, e) from None
    if not objects and not folders:
        raise DatasetError(f"{key} {root} lists no objects: check the bucket and the prefix")
    listed = {n: (size, etag) for n, size, etag in objects if not n.startswith(".")}
    tars = sorted(n for n in listed if n.lower().endswith(".tar"))
    parquets = sorted(n for n in listed if n.endswith(".parquet"))
    if tars and parquets:  # a local folder of both was read as Parquet, the bucket's as shards
        raise shardnames.both_kinds(key, root, tars, parquets)
    stems = {t[:-4] for t in tars}
    dirs = sorted(f for f in folders if not f.startswith(".") and f not in _LEFTOVERS and f not in stems)
    if tars:
        tmp = os.path.join(cache_dir or default_cache_dir(), "tmp")
        os.makedirs(tmp, mode=0o700, exist_ok=True)
        f = bucketshards.ShardFile(store, f"{root.rstrip('/')}/{tars[0]}", *listed[tars[0]], tmp, _PROBE_CHUNK)
        try:
            shards = webdataset.looks_like_shards(f, f.size, tuple(e.encode() for e in webdataset.DEFAULT_EXTENSIONS))
        except (OSError, DatasetError):
            shards = True  # the scan says what is wrong with it
        finally:
            f.close()
        if shards is False and dirs:
            raise DatasetError(f"{key} {root} holds folders ({', '.join(dirs[:3])}{' ...' if len(dirs) > 3 else ''}) "
                               f"and tars that are not WebDataset shards ({tars[0]}): one kind of dataset per root; "
                               "move the tars out, or set dataset.layout: imagefolder to read the folders alone")
        if shards is False:
            raise DatasetError(f"{key} {root} holds tars that are not WebDataset shards ({tars[0]}: ImageNet's class "
                               "tars?): from a bucket, ImageNet's tars are not read yet; copy them to a local disk, or "
                               "set dataset.layout: webdataset if they are shards")
        if dirs:
            raise DatasetError(f"{key} {root} holds WebDataset shards ({tars[0]} ...) and folders ({', '.join(dirs[:3])}"
                               f"{' ...' if len(dirs) > 3 else ''}): one kind of dataset per root; set {key} to the "
                               "shards' prefix or a brace pattern of them")
        return "webdataset"
    if not dirs and any(n.lower().endswith(shardnames.COMPRESSED) for n in listed):
        return "webdataset"  # which says they are compressed
    if not dirs and any(n.endswith(".parquet") for n in listed):
        return "parquet"
    return "imagefolder"


def load(root: str | None, file_list: str | None, extensions: tuple[str, ...], cache_dir: str | None,
         use_cache: bool, devkit: str | None, section: str, layout: str, label: str, image_column: str,
         label_column: str, storage_options: dict | None) -> tuple[Index, bool]:
    """``dataset.load_index`` for a bucket root."""
    from prefetchd.sources import bucketfolder, bucketshards, webdataset

    key = f"{section}.root"
    if file_list is not None or devkit or layout == "imagenet_tars" or root is None:
        raise DatasetError(f"{key if root else f'{section}.file_list'} {root or file_list}: from a bucket, prefetchd "
                           "reads an ImageFolder, WebDataset shards or Parquet files (dataset.layout auto, "
                           "imagefolder, webdataset or parquet), with no file_list or devkit; copy ImageNet's tars "
                           "to a local disk")
    objectstore.split(root, key)  # a URL prefetchd cannot read is one line, before any listing
    objectstore.store_for(root, storage_options, key)
    found = detect(root, key, storage_options, cache_dir) if layout == "auto" else layout
    if found == "webdataset":
        exts = webdataset.DEFAULT_EXTENSIONS if tuple(extensions) == IMAGE_EXTENSIONS else extensions
        return bucketshards.load(root, exts, label, cache_dir, use_cache, key, storage_options)
    if found == "parquet":
        from prefetchd.sources import bucketparquet

        return bucketparquet.load(root, image_column, label_column, cache_dir, use_cache, key, storage_options)
    return bucketfolder.load(root, extensions, cache_dir, use_cache, section, storage_options)
