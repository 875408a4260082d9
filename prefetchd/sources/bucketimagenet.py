"""ImageNet's tars in a bucket, read in place as on a disk (``imagenet``): a tar of class tars
(``s3://bucket/imagenet/ILSVRC2012_img_train.tar``), a prefix of class tars
(``s3://bucket/imagenet/train/`` holding ``n01440764.tar`` ...) and the flat validation tar with
the devkit's labels (``validation.devkit``: a local path or an ``s3://`` URL).

**The same index** as the local one: the same code walks the headers (``tarheaders``) and builds
the index (``imagenet.scan_tar``, ``scan_tars``: the same classes, order, labels, skipped members,
refusals and fingerprint), so the same seed gives the same batches byte for byte. A root ending in
``.tar`` is one object (the train tar, or the flat validation tar); any other is a prefix whose
top-level ``.tar`` objects are the class tars, ordered by class name as a folder's.

**Ranged reads.** The headers are read through ``bucketshards.ShardFile`` readers, never the whole
object in one GET: the train tar's top level (a header every class tar, 140 MB apart) goes forward
only, in ranged GETs of ``TOP_CHUNK`` (1 MiB, one a class tar: 1 GB of ImageNet's 147), holding its
last two chunks in memory; then each class tar's byte range (or object) in GETs of
``bucketshards.CHUNK`` (8 MiB) counted from its start, only those holding a header (with JPEGs of
110 KB, all of them: indexing reads the class tars once; with members larger than a chunk, not),
``SCANS_IN_FLIGHT`` (8) class tars fetched at once ahead of the scan (``_Ahead``: their chunks in
sparse temporary files in the index cache's ``tmp``, so up to 9 class tars' bytes, 1.3 GB for
ImageNet). A flat tar (the validation tar: its first member is no tar) is read forward in 8 MiB
GETs, two in memory. A forward walk that reads chunks in a row (the validation tar; a top level of
class tars smaller than a chunk) keeps the next ones' GETs in flight (``ShardFile``'s ``ahead``:
32 MiB, 4 chunks of 8 MiB); ImageNet's top level skips 140 MB a header and fetches nothing ahead. Every GET is sent with ``If-Match`` on the ETag listed, so an object
overwritten while it is indexed is a one-line error, never a mix of two versions. ImageNet's own
download tars among class tars (the train tar left beside them) are refused from the listing, before
a byte of them is read.

**Reading.** A sample is one ranged GET of its member, with If-Match on the indexed ETag, through
the node-local byte cache and read-ahead (``bucketshards.BucketShardIndex``, whose reads these
are): an object overwritten since it was indexed answers 412, its batches wait (one log line) and a
restart indexes it anew; never another sample's bytes.

**Cache.** ``bucket-imagenetmeta.json`` and the ``.npy`` files, keyed on the root, the devkit and
the endpoint, no credential in them; checked at each start and reload against one listing of the
root (a HEAD of a single object) and the devkit's stamp (its size and ETag, or a local file's).
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from prefetchd.sources import devkit as dk
from prefetchd.sources import imagenet, objectstore
from prefetchd.sources.archive import LAYOUT_WORDS, TarIndex, kept_notes, stamp_of
from prefetchd.sources.base import (
    DatasetError,
    StorageChanged,
    StorageUnavailable,
    cache_path,
    cached_or_scanned,
    default_cache_dir,
    read_cache,
)
from prefetchd.sources.bucketshards import (
    CHUNK,
    SCANS_IN_FLIGHT,
    BucketShardIndex,
    ShardFile,
    ahead_for,
    temp_dir,
)
from prefetchd.sources.tarheaders import BLOCK, walk

META = "bucket-imagenetmeta.json"  # ``dataset.open_index_files`` tells the kinds apart by it
_VERSION = 1
TOP_CHUNK = 1 << 20  # bytes a GET of the train tar's top level fetches: one class tar's header
_KEEP = 2  # chunks a forward reader holds: a header cut by a chunk's end is read again whole
_ARRAYS = ("blob", "offsets", "labels", "archive_ids", "block", "size")


@dataclass(frozen=True)
class BucketImageNetIndex(BucketShardIndex):
    """A ``TarIndex`` of ImageNet's tars in a bucket (layout ``tar``, ``tars`` or ``flat-tar``):
    ``identity`` holds each object's (size, ETag); ``archives`` ("",) is the root object itself."""

    def archive(self, i: int) -> str:
        a = self.archives[0 if self.archive_ids is None else int(self.archive_ids[i])]
        return f"{self.root}/{a}" if a else self.root

    def path(self, i: int) -> str:
        return TarIndex.path(self, i)

    def describe(self) -> str:
        return f"{self.root}, {LAYOUT_WORDS.get(self.layout, self.layout)} in a bucket (indexed in {self.scan_s:.1f} s)"


def objects_of(root: str, store, key: str = "dataset.root") -> tuple[str, list[str], dict[str, tuple[int, str]]]:
    """(the root URL, the class tars' names in class order, or [""] for the root object itself,
    each one's (size, ETag)): one HEAD of a ``.tar`` object, else one delimited listing."""
    _, _, prefix = objectstore.split(root, key)
    try:
        if prefix.lower().endswith(".tar"):
            h = store.head(root)
            return root, [""], {"": (h.size, h.etag)}
        objects, folders = store.list_top(root)
    except FileNotFoundError:
        raise DatasetError(f"{key} {root}: no such object in the bucket (check the bucket and the key)") from None
    except OSError as e:
        raise objectstore.listing_error(key, root, store, e) from None
    listed = {n: (size, etag) for n, size, etag in objects if not n.startswith(".")}
    tars = sorted((n for n in listed if n.lower().endswith(".tar")), key=lambda n: n[:-4])  # as a folder's
    if not tars:
        if not listed and not folders:
            raise DatasetError(f"{key} {root} lists no objects: check the bucket and the prefix")
        raise DatasetError(f"{key} {root} holds no class tars (.tar objects) at its top level: give the train tar "
                           "(.../ILSVRC2012_img_train.tar), the validation tar or the prefix of the class tars")
    return root.rstrip("/"), tars, {n: listed[n] for n in tars}


def _forward(store, url: str, size: int, etag: str, chunk: int, start: int = 0, end: int = 0):
    return contextlib.closing(ShardFile(store, url, size, etag, "", chunk, origin=start, end=end, keep=_KEEP,
                                        ahead=ahead_for(chunk)))


class _Ahead:
    """The class tars' headers fetched ``SCANS_IN_FLIGHT`` class tars ahead of the scan, which walks
    them in label order (``imagenet._scan_class_tars``, one at a time): each is walked first on a
    thread, its chunks kept in a ``ShardFile``'s sparse temporary file (``tmpdir``, local disk), so
    the scan's own walk of it fetches nothing more. A walk ahead that fails is left: the scan's
    walk meets the same fault and says it; but the bucket's not answering is said at once, and
    stops the other walks ahead (each would wait through a retry episode of its own). ``items``: (url, size, ETag, start, end) in label order."""

    def __init__(self, store, items: list[tuple[str, int, str, int, int]], tmpdir: str):
        self.store, self.items, self.tmpdir = store, items, tmpdir
        self.stop = threading.Event()
        self.pool = ThreadPoolExecutor(SCANS_IN_FLIGHT, thread_name_prefix="prefetchd-index")
        self.files: dict[int, ShardFile] = {}
        self.futures: dict = {}
        self.next = 0
        self.failed: OSError | None = None  # the bucket did not answer a walk ahead: the scan says it

    @contextlib.contextmanager
    def open(self, i: int):
        while self.next < len(self.items) and self.next <= i + SCANS_IN_FLIGHT:
            url, size, etag, start, end = self.items[self.next]
            f = ShardFile(self.store, url, size, etag, self.tmpdir, CHUNK, stop=self.stop, origin=start, end=end)
            self.files[self.next], self.futures[self.next] = f, self.pool.submit(self._walk, f, start, end)
            self.next += 1
        self.futures.pop(i).result()
        f = self.files.pop(i)
        if self.failed is not None:  # at once: the scan's own walk would wait through another retry episode
            f.close()
            raise self.failed
        try:
            yield f
        finally:
            f.close()

    def close(self) -> None:
        self.stop.set()  # the walks ahead stop at their next chunk
        self.pool.shutdown(wait=True, cancel_futures=True)
        for f in self.files.values():
            f.close()

    def _walk(self, f: ShardFile, start: int, end: int) -> None:
        """Walk a class tar ahead. The bucket's not answering through a retry episode
        (``objectstore.unavailable``) stops every walk ahead, and those queued never start one."""
        try:
            for _ in walk(f, start, end, f.url, []):
                pass
        except OSError as e:
            if objectstore.unavailable(e) and self.failed is None:
                self.failed = e
                self.stop.set()
        except Exception:  # noqa: BLE001 - the scan's own walk of it says what is wrong
            pass


def scan(root: str, devkit: str | None, extensions: tuple[str, ...], key: str, store,
         tmpdir: str) -> BucketImageNetIndex:
    """Index ImageNet's tars under the bucket URL ``root`` (see the module docstring)."""
    base, names, idents = objects_of(root, store, key)
    exts = tuple(e.lower().encode() for e in extensions)
    notes: list = []
    temp_dir(tmpdir)
    ahead = None
    try:
        if names == [""]:
            size, etag = idents[""]
            with _forward(store, root, size, etag, TOP_CHUNK) as first:
                head = first.pread(BLOCK, 0)
            # ImageNet's train tar starts with a class tar; else a flat tar of images, headers throughout
            nested = head[:100].split(b"\0", 1)[0].lower().endswith(b".tar")
            with _forward(store, root, size, etag, TOP_CHUNK if nested else CHUNK) as top:
                def class_tars(ranges: list[tuple[int, int]]):  # the top level walked: each class tar's range
                    nonlocal ahead
                    ahead = _Ahead(store, [(root, size, etag, p, e) for p, e in ranges], tmpdir)
                    return ahead.open

                index = imagenet.scan_tar(root, key, top, size, (size, etag), devkit, exts, notes, class_tars)
        else:
            download = [n for n in names if dk.DOWNLOAD.match(n)]
            if download:  # ImageNet's own tars (the train tar beside its class tars): refused before 8 GB is read
                imagenet._refuse_others(base, key, [(n, "named as one of ImageNet's download files, not as a class")
                                                    for n in download], len(names))
            ahead = _Ahead(store, [(f"{base}/{n}", *idents[n], 0, idents[n][0]) for n in names], tmpdir)
            index = imagenet.scan_tars(base, key, names, ahead.open, devkit, exts, notes,
                                       identity={a: idents[n] for a, n in enumerate(names)},
                                       sizes=[idents[n][0] for n in names])
    except StorageChanged:
        raise DatasetError(f"{key} {root} changed while it was being indexed (an ETag differs): is an upload still "
                           "writing it? start again once it is complete") from None
    except OSError as e:
        if objectstore.unavailable(e):
            raise StorageUnavailable(f"{key} {root} cannot be read: the bucket did not answer "
                                     f"({e.strerror or e}); the daemon exits 75 to be started again") from None
        what = f" ({e.filename})" if e.filename and e.filename != root else ""
        raise DatasetError(f"{key} {root} cannot be read{what}: {objectstore.words(e)}") from None
    finally:
        if ahead is not None:
            ahead.close()
    fields = {f: getattr(index, f) for f in ("classes", "blob", "offsets", "labels", "fingerprint", "layout",
                                             "archives", "archive_ids", "block", "size")}
    return BucketImageNetIndex(base, **fields, identity=tuple(idents[n] for n in names), skipped=kept_notes(notes),
                               kind="folder")


def _devkit_stamp(devkit: str | None) -> list:
    """What a cache holds of the devkit: its size and ETag in a bucket, or a local file's identity."""
    if not devkit:
        return []
    try:
        if "://" in devkit:
            return [dk.url_stamp(devkit)]
        return [stamp_of(p) for p in imagenet._devkit_files(devkit)]
    except dk.DevkitError as e:
        raise DatasetError(str(e)) from None
    except OSError as e:
        raise DatasetError(f"validation.devkit {devkit} cannot be read: {e.strerror}") from None


def stamps_valid(stamps: dict) -> bool:
    """A reload's check: the root listed (or its object's HEAD) and the devkit as they were indexed."""
    try:
        root = stamps["root"]
        base, names, idents = objects_of(root, objectstore.store_for(root))
        return ([[n, *idents[n]] for n in names] == stamps["objects"]
                and _devkit_stamp(stamps.get("devkit")) == stamps["devkit_stamp"])
    except (OSError, ValueError, KeyError, TypeError):
        return False


def load_cached(cdir: str, validate: bool = False) -> BucketImageNetIndex | None:
    def build(meta: dict, arrays: dict) -> BucketImageNetIndex:
        return BucketImageNetIndex(meta["root"], tuple(meta["classes"]), arrays["blob"], arrays["offsets"],
                                   arrays["labels"], meta["fingerprint"], files_dir=cdir, layout=meta["layout"],
                                   archives=tuple(meta["archives"]), archive_ids=arrays.get("archive_ids"),
                                   block=arrays.get("block"), size=arrays.get("size"), scan_s=meta["scan_s"],
                                   identity=tuple((int(s), e) for s, e in meta["identity"]),
                                   skipped=tuple(meta.get("skipped", ())), kind="folder")

    return read_cache(cdir, META, _VERSION, build, stamps_valid if validate else None)


def open_files(cdir: str) -> BucketImageNetIndex | None:
    """The cached index in ``cdir`` (what workers open), or None if it is another kind's."""
    return load_cached(cdir) if os.path.exists(os.path.join(cdir, META)) else None


def load(root: str, devkit: str | None, extensions: tuple[str, ...], cache_dir: str | None, use_cache: bool = True,
         key: str = "dataset.root", storage_options: dict | None = None) -> tuple[BucketImageNetIndex, bool]:
    """(index, from_cache) of ImageNet's tars under the bucket URL ``root``."""
    store = objectstore.store_for(root, storage_options, key)
    endpoint = store.endpoint()
    cdir = cache_path(cache_dir, f"{root}|devkit={devkit or ''}" + (f" at {endpoint}" if endpoint else ""),
                      "bucket-imagenet", extensions)
    devkit_stamp = _devkit_stamp(devkit)  # before the devkit is read: a change after it shows at the next start

    def changed(cached: BucketImageNetIndex) -> str | None:
        listing = objects_of(root, store, key)  # one listing: still the objects indexed?
        moved = objectstore.moved_since(cached.root, cached.archives, cached.identity, listing)
        if moved is None and _cached_devkit(cdir) == devkit_stamp:
            return None
        return f"{root} changed since it was indexed (" + (
            f"{len(moved)} overwritten, e.g. {moved[0] or root}" if moved else
            "the devkit" if moved is None else "other tars") + "): indexing it again"

    def cache_of(index: BucketImageNetIndex) -> tuple[dict, dict]:
        return {k: getattr(index, k) for k in _ARRAYS}, {
            "version": _VERSION, "layout": index.layout, "root": index.root, "classes": list(index.classes),
            "archives": list(index.archives), "fingerprint": index.fingerprint, "count": len(index),
            "scan_s": index.scan_s, "identity": [list(x) for x in index.identity], "skipped": list(index.skipped),
            "stamps": {"root": root, "devkit": devkit, "devkit_stamp": devkit_stamp,
                       "objects": [[n, *x] for n, x in zip(index.archives, index.identity, strict=True)]}}

    tmp = os.path.join(cache_dir or default_cache_dir(), "tmp")
    return cached_or_scanned(cdir, META, use_cache, load_cached, changed,
                             lambda: scan(root, devkit, extensions, key, store, tmp), cache_of)


def _cached_devkit(cdir: str) -> list | None:
    import json

    try:
        with open(os.path.join(cdir, META), encoding="utf-8") as f:
            return json.load(f)["stamps"]["devkit_stamp"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
