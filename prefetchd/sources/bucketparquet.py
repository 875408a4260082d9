"""Parquet files in a bucket: ``s3://bucket/prefix/`` holding ``.parquet`` objects (its top level,
by name), one ``.parquet`` object, or a glob of object names (``s3://bucket/hf/train-*.parquet``:
``*``, ``?`` and ``[...]`` within one path component, matched against a listing of the glob's
folder).

**The same index** as ``parquet.scan`` gives for the same files on a disk: the same code reads
each file's footer and label column and builds the index (``parquet.collect``), so the same seed
gives the same batches from either; a folder or glob of several Hugging Face splits is refused as
a local one is.

**Ranged reads.** pyarrow reads an object through an ``ObjectFile``: each read it asks for is one
ranged GET (the footer: its last 64 KiB, one more GET when the footer is larger; a row group's
column chunks, coalesced by pyarrow's ``pre_buffer``). Indexing reads the footer and the label
column only, never the images. A worker keeps each file's footer once read, so a sample's read
is its row group's image column chunk (one ranged GET), kept for the group's other rows
(``parquet._group``); the row groups a batch needs are fetched together (``IN_FLIGHT`` at once).

**Identity.** A file's identity is its (size, ETag) as listed; every GET, of the scan and of each
read, is sent with ``If-Match: <that ETag>``, so an object overwritten since answers 412:
``StorageChanged`` in a worker (its batches wait, said once; a restart indexes it anew), a
one-line error during the scan; never another row's pixels under the indexed label. A pyarrow
error reading an object that is still the indexed one is the row group's damage (its samples are
quarantined, as a local file's). The index is cached (``bucket-parquetmeta.json`` and the
``.npy`` files, keyed on the root, the columns and the endpoint, with no credential in them); a
start with a cached index lists the files again and indexes anew when their names, a size or an
ETag differ.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import io
import os
import posixpath
from dataclasses import dataclass

from prefetchd.sources import objectstore, parquet, readahead
from prefetchd.sources.base import (
    DatasetError,
    StorageChanged,
    cache_path,
    cached_or_scanned,
    read_cache,
)

META = "bucket-parquetmeta.json"  # not parquet's: ``dataset.open_index_files`` tells the kinds apart by it
_VERSION = 1
_FOOTERS: dict = {}  # url -> (pid, identity, FileMetaData): a worker reads each file's footer once
_AHEAD: dict = {}  # (url, row group) -> (pid, the future of its image column): the batch being made


class ObjectFile(io.RawIOBase):
    """An object as a read-only, seekable file for pyarrow: each ``readinto`` is one ranged GET held
    to the handle's ETag."""

    def __init__(self, store, handle: objectstore.Handle):
        super().__init__()
        self.store, self.handle, self._pos = store, handle, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.handle.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buf) -> int:
        n = min(len(buf), self.handle.size - self._pos)
        if n <= 0:
            return 0
        data = self.store.pread(self.handle, n, self._pos)
        buf[:len(data)] = data
        self._pos += len(data)
        return len(data)


@dataclass(frozen=True)
class BucketParquetIndex(parquet.ParquetIndex):
    """A ``ParquetIndex`` of objects in a bucket: ``identity`` holds each file's (size, ETag)."""

    def file(self, i: int) -> str:
        return f"{self.root}/{self.files[int(self.file_ids[i])]}"

    @property
    def refusal_root(self) -> str:  # one file: its ACL's 403 refuses every sample, the root's refusal
        return f"{self.root}/{self.files[0]}" if len(self.files) == 1 else self.root

    def path(self, i: int) -> str:
        return f"{self.root}/{self.relpath(i)}"

    def _column(self, i: int):
        a, g = int(self.file_ids[i]), int(self.group[i])
        url = self.file(i)
        ahead = _AHEAD.pop((url, g), None)
        read = _read_group
        if ahead is not None and ahead[0] == os.getpid():
            read = lambda *_: ahead[1].result()  # noqa: E731 - what the batch's prefetch fetched (or raised)
        return parquet._group(url, a, g, self.identity[a], self.image_column, read)

    def prefetch(self, indices, ahead=()) -> None:
        """Start reading the row groups of ``indices`` (a batch) that are not kept, together
        (``ahead``, the batches queued after it, is not read ahead: a row group is shared by many
        batches and kept whole, ``parquet.keep_groups``)."""
        _AHEAD.clear()
        for i in indices:
            a, g = int(self.file_ids[i]), int(self.group[i])
            url = self.file(i)
            if (url, g) not in _AHEAD and (url, g) not in parquet._groups:
                _AHEAD[(url, g)] = (os.getpid(), readahead.pool().submit(
                    _read_group, url, g, self.identity[a], self.image_column))

    def describe(self) -> str:
        return super().describe().replace(f"{os.path.basename(self.root.rstrip('/')) or self.root}, ",
                                          f"{self.root}, in a bucket: ", 1)


def _read_group(url: str, g: int, identity: tuple, column: str):
    """Row group ``g``'s ``column`` of the object ``url`` (``identity``: its (size, ETag) indexed)."""
    pq = parquet.pyarrow_parquet()
    size, etag = identity
    f = ObjectFile(objectstore.store_for(url), objectstore.Handle(url, int(size), etag))
    kept = _FOOTERS.get(url)
    footer = kept[2] if kept is not None and kept[:2] == (os.getpid(), tuple(identity)) else None
    try:
        pf = pq.ParquetFile(f, metadata=footer, pre_buffer=True)
        if footer is None:
            _FOOTERS[url] = (os.getpid(), tuple(identity), pf.metadata)
        return pf.read_row_group(g, columns=[column]).column(0)
    except StorageChanged:
        raise
    except Exception as e:
        if isinstance(e, OSError) and e.errno is not None or isinstance(e, MemoryError):
            raise  # the store's fault after its retries, or out of memory: not the row group's damage
        said = (str(e).splitlines() or [type(e).__name__])[0]
        # every GET was held to the indexed ETag: these are the indexed object's bytes, damaged
        raise OSError(errno.EBADMSG, f"row group {g} of {url} cannot be read ({said}); the object is the one "
                      "indexed, so the row group is damaged") from None


def files_of(root: str, store, key: str = "dataset.root") -> tuple[str, list[str], dict[str, tuple[int, str]]]:
    """(the base URL the names are relative to, the ``.parquet`` object names in order, each one's
    (size, ETag) as listed) of the bucket ``root``; a one-line DatasetError naming ``key`` otherwise."""
    scheme, bucket, prefix = objectstore.split(root, key)
    top = f"{scheme}://{bucket}"
    try:
        if any(c in prefix for c in "*?["):
            base_key = posixpath.dirname(prefix[:min(prefix.index(c) for c in "*?[" if c in prefix)])
            base = f"{top}/{base_key}" if base_key else top
            pattern = prefix[len(base_key) + 1:] if base_key else prefix
            depth = pattern.count("/")
            listed = {rel: (size, etag) for rel, size, etag in store.list(base)
                      if rel.count("/") == depth and fnmatch.fnmatchcase(rel, pattern)}
            if not listed:
                raise DatasetError(f"{key} {root} matches no objects: check the bucket, the prefix and the pattern")
        elif prefix.endswith(".parquet"):
            h = store.head(root)
            base, _, name = root.rpartition("/")
            listed = {name: (h.size, h.etag)}
        else:
            objects, folders = store.list_top(root)
            base = root.rstrip("/")
            listed = {n: (size, etag) for n, size, etag in objects if n.endswith(".parquet") and not n.startswith(".")}
            if not listed:
                if not objects and not folders:
                    raise DatasetError(f"{key} {root} lists no objects: check the bucket and the prefix")
                seen = [f + "/" for f in folders[:3]] + sorted(n for n, _, _ in objects)[:3]
                raise DatasetError(f"{key} {root} holds no .parquet files at its top level (it holds "
                                   f"{', '.join(seen[:3])} ...): set it to the prefix of the files, or dataset.layout "
                                   "to what it is")
    except FileNotFoundError:
        raise DatasetError(f"{key} {root}: no such object in the bucket (check the bucket and the key)") from None
    except OSError as e:
        raise objectstore.listing_error(key, root, store, e) from None
    names = sorted(listed)
    parquet._one_split(root, key, base, names)
    return base, names, listed


def scan(root: str, image_column: str, label_column: str, key: str, store) -> BucketParquetIndex:
    base, names, idents = files_of(root, store, key)

    @contextlib.contextmanager
    def opened(url: str):
        ident = idents[url[len(base) + 1:]]
        yield ObjectFile(store, objectstore.Handle(url, *ident)), ident

    index = parquet.collect(root, base, names, opened, image_column, label_column, key)
    return BucketParquetIndex(**{f.name: getattr(index, f.name) for f in parquet.ParquetIndex.__dataclass_fields__
                                 .values()})


def stamps_valid(stamps: list) -> bool:
    """A reload's check (``bucketshards.stamps_valid``: the root listed again)."""
    from prefetchd.sources import bucketshards

    return bucketshards.stamps_valid(stamps, files_of)


def load_cached(cdir: str, validate: bool = False) -> BucketParquetIndex | None:
    def build(meta: dict, arrays: dict) -> BucketParquetIndex:
        return BucketParquetIndex(meta["root"], tuple(meta["classes"]), arrays["blob"], arrays["offsets"],
                                  arrays["labels"], meta["fingerprint"], files_dir=cdir,
                                  skipped=tuple(meta.get("skipped", ())), kind="parquet", files=tuple(meta["files_"]),
                                  file_ids=arrays["file_ids"], group=arrays["group"], row=arrays["row"],
                                  identity=tuple((int(s), e) for s, e in meta["identity"]),
                                  image_column=meta["image_column"], scan_s=meta["scan_s"])

    return read_cache(cdir, META, _VERSION, build)


def open_files(cdir: str) -> BucketParquetIndex | None:
    """The cached bucket Parquet index in ``cdir`` (what workers open), or None if another kind's."""
    return load_cached(cdir) if os.path.exists(os.path.join(cdir, META)) else None


def load(root: str, image_column: str, label_column: str, cache_dir: str | None, use_cache: bool = True,
         key: str = "dataset.root", storage_options: dict | None = None) -> tuple[BucketParquetIndex, bool]:
    """(index, from_cache) of the Parquet files the bucket URL ``root`` names."""
    store = objectstore.store_for(root, storage_options, key)
    endpoint = store.endpoint()
    cdir = cache_path(cache_dir, f"{root}|{image_column}|{label_column}" + (f" at {endpoint}" if endpoint else ""),
                      "bucket-parquet", ())

    def changed(cached: BucketParquetIndex) -> str | None:
        listing = files_of(root, store, key)  # one listing: still the files indexed?
        return objectstore.changed_words(root, "Parquet files", "other files", objectstore.moved_since(
            cached.root, cached.files, cached.identity, listing))

    def cache_of(index: BucketParquetIndex) -> tuple[dict, dict]:
        return {k: getattr(index, k) for k in parquet._ARRAYS}, {
            "version": _VERSION, "root": index.root, "classes": list(index.classes),
            "fingerprint": index.fingerprint, "count": len(index), "skipped": list(index.skipped),
            "files_": list(index.files), "identity": [list(x) for x in index.identity],
            "image_column": index.image_column, "scan_s": index.scan_s,
            "stamps": objectstore.listing_stamps(root, index.root, index.files, index.identity)}

    return cached_or_scanned(cdir, META, use_cache, load_cached, changed,
                             lambda: scan(root, image_column, label_column, key, store), cache_of)
