"""A bucket root (``s3://``, ``gs://``): which layout it holds, told in one place, and its index loaded.

The layouts read from a bucket: an ImageFolder of objects (``bucketfolder``), WebDataset shards
(``bucketshards``), Parquet files (``bucketparquet``), ImageNet's tars (``bucketimagenet``) and a
file list of objects (``bucketlist``). ``dataset.layout`` names one, or ``auto``
(the default) tells them apart by the root's name and one delimited listing of its top level
(one request, whatever lies below): a brace pattern is shards, a ``.parquet`` object is Parquet;
a ``.tar`` object, and a prefix whose top level holds ``.tar`` objects, is shards when its (first)
tar's first members are WebDataset samples (``webdataset.looks_like_shards``, one small ranged
GET), else ImageNet's tars (the train tar, class tars; with ``validation.devkit``, the validation
tar, not probed); a prefix holding ``.parquet`` objects and no folders is Parquet, else an
ImageFolder. A glob (``*?[``) is read for Parquet only (shards are named by a brace pattern, as
webdataset's).
"""

from __future__ import annotations

import itertools
import os

from prefetchd.core.configsections import IMAGE_EXTENSIONS
from prefetchd.sources import devkit as dk
from prefetchd.sources import objectstore, shardnames
from prefetchd.sources.base import DatasetError, Index, default_cache_dir

_PROBE_CHUNK = 256 << 10  # bytes of the first tar fetched to tell shards from class tars
_LEFTOVERS = ("lost+found", "__MACOSX")


def detect(root: str, key: str, storage_options: dict | None, cache_dir: str | None = None,
           devkit: str | None = None) -> str:
    """``dataset.layout: auto`` for a bucket root: ``webdataset``, ``parquet``, ``imagenet_tars`` or
    ``imagefolder``."""
    _, _, prefix = objectstore.split(root, key)
    if shardnames.is_pattern(prefix):
        return "webdataset"
    if prefix.lower().endswith(".tar"):  # one object: shards, the train tar, or the validation tar (devkit)
        if devkit:
            return "imagenet_tars"
        store = objectstore.store_for(root, storage_options, key)
        try:
            h = store.head(root)
        except OSError:
            return "webdataset"  # which says the object is missing, or the bucket unreadable
        return "webdataset" if _shards(store, root, h.size, h.etag, cache_dir) is not False else "imagenet_tars"
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
    if tars and dirs and any(dk.DOWNLOAD.match(t) for t in tars):
        # ImageNet's download folder, its tars perhaps extracted beside them: bucketimagenet refuses it from
        # the listing, naming what to set (as class tars and folders, it said to read the folders alone)
        return "imagenet_tars"
    if tars:
        shards = _shards(store, f"{root.rstrip('/')}/{tars[0]}", *listed[tars[0]], cache_dir)
        if shards is False and dirs:
            raise DatasetError(f"{key} {root} holds class tars ({tars[0]} ...) and folders ({', '.join(dirs[:3])}"
                               f"{' ...' if len(dirs) > 3 else ''}) that are not one of them extracted: one kind of "
                               "dataset per root; move the folders out, or set dataset.layout: imagefolder to read "
                               "the folders alone")
        if shards is False:
            _refuse_numbered(store, root, tars, listed, key)
            return "imagenet_tars"
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


def _refuse_numbered(store, root: str, tars: list[str], listed: dict, key: str) -> None:
    """A prefix of numbered tars of images alone is refused as a local folder of them is
    (``dataset._refuse_numbered_image_tars``): read as class tars, each shard's number would be its
    samples' label. The first tar's first 16 member names: one ranged GET of 64 KiB at most."""
    from prefetchd.sources import bucketshards, tarheaders

    if not shardnames.numbered(tars):
        return
    f = bucketshards.ShardFile(store, f"{root.rstrip('/')}/{tars[0]}", *listed[tars[0]], "", 64 << 10, keep=2)
    try:
        names = [os.fsdecode(n) for n, *_ in itertools.islice(tarheaders.walk(f, 0, f.size, tars[0], []), 16)]
    except (OSError, DatasetError):
        return  # the scan says what is wrong with it
    finally:
        f.close()
    if names:
        shardnames.refuse_numbered_images(root, tars, tars[0], names, key)


def _shards(store, url: str, size: int, etag: str, cache_dir: str | None) -> bool | None:
    """Does the tar ``url`` look like WebDataset shards (``webdataset.looks_like_shards``; one ranged
    GET of its first 256 KiB)? None: it holds no member to judge by; an unreadable one is a shard,
    whose scan says what is wrong with it."""
    from prefetchd.sources import bucketshards, webdataset

    tmp = bucketshards.temp_dir(os.path.join(cache_dir or default_cache_dir(), "tmp"))
    f = bucketshards.ShardFile(store, url, size, etag, tmp, _PROBE_CHUNK)
    try:
        if f.pread(512, 0)[:100].split(b"\0", 1)[0].lower().endswith(b".tar"):
            return False  # a tar of tars (ImageNet's train tar): not 64 headers 140 MB apart probed
        return webdataset.looks_like_shards(f, f.size, tuple(e.encode() for e in webdataset.DEFAULT_EXTENSIONS))
    except (OSError, DatasetError):
        return True
    finally:
        f.close()


def load(root: str | None, file_list: str | None, extensions: tuple[str, ...], cache_dir: str | None,
         use_cache: bool, devkit: str | None, section: str, layout: str, label: str, image_column: str,
         label_column: str, storage_options: dict | None) -> tuple[Index, bool]:
    """``dataset.load_index`` for a bucket root, or a file list naming objects (``bucketlist``)."""
    from prefetchd.sources import bucketfolder, bucketimagenet, bucketlist, bucketshards, webdataset

    if devkit and objectstore.is_url(devkit):  # the config's keys and endpoint for it too
        objectstore.store_for(devkit, storage_options, "validation.devkit")
    if root is None:
        assert file_list is not None
        if devkit:
            raise DatasetError(f"validation.devkit labels a flat validation set (ImageNet's validation tar); "
                               f"{file_list} is a file list (its labels are its own): remove validation.devkit")
        if layout not in ("auto", "imagefolder"):
            raise DatasetError(f"dataset.layout is {layout}, but {section}.file_list names images one by one: set "
                               "dataset.layout: auto")
        return bucketlist.load(file_list, extensions, cache_dir, use_cache, section, storage_options)
    key = f"{section}.root"
    objectstore.split(root, key)  # a URL prefetchd cannot read is one line, before any listing
    if dk.is_devkit(root):  # by its name: as a prefix it lists nothing, which misled
        also = ("dataset.root to the train tar (ILSVRC2012_img_train.tar)" if section == "dataset"
                else "validation.root to the validation tar (ILSVRC2012_img_val.tar)")
        raise DatasetError(f"{key} {root} is ImageNet's devkit, which holds no images: it labels the validation set; "
                           f"set validation.devkit to it, and {also}")
    objectstore.store_for(root, storage_options, key)
    found = detect(root, key, storage_options, cache_dir, devkit) if layout == "auto" else layout
    if found == "imagenet_tars":
        return bucketimagenet.load(root, devkit, extensions, cache_dir, use_cache, key, storage_options)
    if devkit:
        raise DatasetError(f"validation.devkit labels ImageNet's flat validation tar, but {key} {root} is "
                           f"{_WORDS.get(found, found)}: set {key} to the validation tar (.../ILSVRC2012_img_val.tar), "
                           "or remove validation.devkit")
    if found == "webdataset":
        exts = webdataset.DEFAULT_EXTENSIONS if tuple(extensions) == IMAGE_EXTENSIONS else extensions
        return bucketshards.load(root, exts, label, cache_dir, use_cache, key, storage_options)
    if found == "parquet":
        from prefetchd.sources import bucketparquet

        return bucketparquet.load(root, image_column, label_column, cache_dir, use_cache, key, storage_options)
    return bucketfolder.load(root, extensions, cache_dir, use_cache, section, storage_options)


_WORDS = {"webdataset": "WebDataset shards", "parquet": "Parquet files", "imagefolder": "an ImageFolder"}
