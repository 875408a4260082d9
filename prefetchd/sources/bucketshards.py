"""WebDataset shards in a bucket: ``s3://bucket/prefix/`` holding ``.tar`` objects, a brace pattern
of object names (``s3://bucket/wds/train-{000000..000099}.tar``) or one ``.tar`` object.

**The same index** as ``webdataset.scan`` gives for the same shards on a disk: the same code reads
the headers and labels (``webdataset.scan_shard``, ``tarheaders.members``) and builds the index
(``webdataset.collect``), so the same seed gives the same batches from either. The shards are a
prefix's top-level ``.tar`` objects by name (a listing with ``/`` as delimiter: one request per
1,000 objects, nothing under the folders beside them), or the objects a pattern names, all of
which must be there (``shardnames``' rules and messages: numbers missing between the first and
last, the shards of several splits).

**Indexing over the network.** A shard's headers and label members are read through a
``ShardFile``: the object fetched in ranged GETs of ``CHUNK`` bytes (8 MiB), each chunk at most
once, into a sparse temporary file in the index cache's folder (local disk, deleted as soon as the
shard is indexed); only the chunks that hold a header or a label are fetched, so a shard of
members larger than a chunk is not read whole. Never one request per member: a shard of N bytes
costs at most ``ceil(N / CHUNK)`` GETs. ``SCANS_IN_FLIGHT`` shards are indexed at once (their GETs
overlap each other's latency); the temporary files then hold at most that many shards' bytes.

**Identity.** A shard's identity is its (size, ETag) as listed. Every ranged GET, of the scan and of
each sample, is sent with ``If-Match: <that ETag>``: an object overwritten since answers 412 (or
with another ETag, ``ObjectStore.pread`` checks), which
is a one-line error during the scan and ``StorageChanged`` in a worker (its batches wait, said once
in the log; a restart indexes it anew), never another sample's bytes under the indexed label. The
index is cached like a local one (``bucket-tarmeta.json`` and the ``.npy`` files, keyed on the root,
the label and the endpoint, with no credential in them); a start with a cached index lists the
shards again and indexes anew when their names, a size or an ETag differ.

**Reading.** A sample is one ranged GET of its member's bytes; a worker starts the GETs of the
batch it makes together, and those of the batches queued after it (``readahead``).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import errno
import itertools
import os
import posixpath
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from prefetchd.sources import objectstore, readahead, shardnames, webdataset
from prefetchd.sources.archive import TarIndex
from prefetchd.sources.base import (
    DatasetError,
    StorageChanged,
    StorageUnavailable,
    cache_path,
    cached_or_scanned,
    default_cache_dir,
    read_cache,
)
from prefetchd.sources.tarheaders import BLOCK

META = "bucket-tarmeta.json"  # not archive's tarmeta.json: ``dataset.open_index_files`` tells the kinds apart by it
_VERSION = 1
CHUNK = 8 << 20  # bytes of a shard one GET of the scan fetches
SCANS_IN_FLIGHT = 8  # shards indexed at once
AHEAD_BYTES = 32 << 20  # bytes a forward reader fetches ahead while it reads its chunks in a row
MAX_AHEAD = 8  # chunks it keeps in flight at most (4 of 8 MiB, 8 of 1 MiB)
# set as the interpreter exits, before concurrent.futures joins its threads: a daemon stopped while
# it indexes (on a thread it does not wait for) waits for no shard's remaining chunks
_EXITING = threading.Event()
getattr(threading, "_register_atexit", atexit.register)(_EXITING.set)
_ARRAYS = ("blob", "offsets", "labels", "archive_ids", "block", "size")


@dataclass(frozen=True)
class BucketShardIndex(TarIndex):
    """A ``TarIndex`` of shards in a bucket: ``identity`` holds each shard's (size, ETag)."""

    def read(self, i: int) -> bytes:
        return readahead.fetched(self.root, i, lambda: self._get(i))

    def prefetch(self, indices, ahead=()) -> None:
        """Start the ranged GETs of ``indices`` (the batch being made), then of ``ahead`` (the
        batches queued after it), within ``readahead``'s bounds; ``read`` takes each one's bytes."""
        readahead.fetch_ahead(self.root, [indices, *ahead], self._get, lambda i: int(self.size[i]))

    def _get(self, i: int) -> bytes:
        a = 0 if self.archive_ids is None else int(self.archive_ids[i])
        size, etag = self.identity[a]
        n = int(self.size[i])
        handle = objectstore.Handle(self.archive(i), int(size), etag)  # If-Match: the ETag indexed, no HEAD
        data = objectstore.store_for(self.root).pread(handle, n, int(self.block[i]) * BLOCK)
        if len(data) != n:
            raise OSError(errno.EIO, f"the shard {self.archive(i)} ends {n - len(data)} bytes short of this member")
        return data

    def archive(self, i: int) -> str:
        return f"{self.root}/{self.archives[0 if self.archive_ids is None else int(self.archive_ids[i])]}"

    @property
    def refusal_root(self) -> str:  # one shard: its ACL's 403 refuses every sample, the root's refusal
        if len(self.archives) != 1:
            return self.root
        return f"{self.root}/{self.archives[0]}" if self.archives[0] else self.root  # "": the root is the object

    def path(self, i: int) -> str:
        return f"{self.root}/{self.relpath(i)}"

    def describe(self) -> str:
        return f"{self.root}, WebDataset shards in a bucket (indexed in {self.scan_s:.1f} s)"


def temp_dir(tmpdir: str) -> str:
    """``tmpdir`` (``dataset.cache_dir``'s ``tmp``), made if missing: where ``ShardFile`` keeps the
    chunks of the tars being indexed; a one-line DatasetError when it cannot be made."""
    try:
        os.makedirs(tmpdir, mode=0o700, exist_ok=True)
    except OSError as e:
        raise _unwritable(tmpdir, e) from None
    return tmpdir


def ahead_for(chunk: int) -> int:
    """The chunks a forward reader of ``chunk``-byte chunks fetches ahead (``ShardFile``'s ``ahead``)."""
    return min(MAX_AHEAD, max(1, AHEAD_BYTES // chunk))  # MAX_AHEAD 0: none (sequential)


def _unwritable(tmpdir: str, e: OSError) -> DatasetError:
    return DatasetError(f"dataset.cache_dir: the temporary files of an index of tars in a bucket cannot be made in "
                        f"{tmpdir} ({e.strerror or e}); set dataset.cache_dir to a folder this user can write, with "
                        f"room for {SCANS_IN_FLIGHT + 1} tars' chunks")


class ShardFile:
    """A shard in a bucket as ``tarheaders.pread`` reads it (see the module docstring): ``pread``
    fetches the ``CHUNK``-byte chunks a read touches that are not fetched yet (ranged GETs with
    If-Match, so the bytes are all of the listed object) into a sparse temporary file.

    ``origin`` and ``end``: the byte range of the object read (a class tar inside ImageNet's train
    tar), chunks counted from ``origin`` and none fetched past ``end``. ``keep``: hold only the
    ``keep`` chunks last fetched, in memory, no temporary file (a reader that only goes forward,
    as ``tarheaders.walk`` does, over an object of 100 GB).

    ``ahead`` (with ``keep``): GETs are sent on ``ahead`` threads. A read spanning several chunks
    (``tarheaders.walk``'s window grows to 256 KiB over small members) sends theirs at once. While
    the reads go through the chunks in a row (a read starts in the chunk the last one ended in, or
    the next), the GETs of the next chunks are sent before they are read: one chunk ahead after one
    chunk read in a row, two after two, up to ``ahead``; a read that skips (the walk jumps over a
    large member) fetches nothing ahead until it reads in a row again. So a walk that reads every chunk waits on one request's latency every
    ``ahead`` chunks, not every chunk; one whose headers are chunks apart fetches what it did
    sequentially; and the chunks fetched are those a sequential reader fetches plus, where a run in
    a row ends in a skip, at most as many as the run's length and ``ahead``, never past ``end``.
    Memory: the ``keep`` chunks held, the chunks of the read under way, the ``ahead`` fetched or in
    flight, and up to ``ahead`` no longer wanted whose GET is ending. Each GET is the sequential
    one (If-Match on the ETag, the answer's ETag checked, faults retried by ``store.pread``), its
    error raised when its chunk is read (never, if the walk skips it); a stop or ``close`` sends
    none more, cancels those not started and ``close`` waits for those started."""

    def __init__(self, store, url: str, size: int, etag: str, tmpdir: str, chunk: int = 0,
                 stop: threading.Event | None = None, origin: int = 0, end: int = 0, keep: int = 0,
                 ahead: int = 0):
        self.store, self.url, self.size, self.chunk = store, url, size, chunk or CHUNK
        self.stop = stop  # set: the scan was left (an error elsewhere, a stop): no more chunks fetched
        self.handle = objectstore.Handle(url, size, etag)
        self.origin, self.end, self.keep = origin, min(end or size, size), keep
        self.tmpdir = tmpdir
        self._file = None
        if not keep:
            try:
                self._file = tempfile.TemporaryFile(dir=tmpdir, prefix=".shard-")
            except OSError as e:
                raise _unwritable(tmpdir, e) from None
        self._have: set[int] = set()
        self._held: collections.OrderedDict[int, bytes] = collections.OrderedDict()  # keep: chunk -> bytes
        self.gets = 0
        self.ahead = ahead if keep else 0
        self._flight: dict[int, Future] = {}  # chunk -> its GET sent ahead
        self._pool: ThreadPoolExecutor | None = None
        self._last = -2  # the chunk the last read ended in (-2: none yet)
        self._run = 0  # chunks entered by reads in a row since the last skip: how far ahead to fetch
        self._row = False  # the read under way started in a row with the last one

    def pread(self, size: int, offset: int) -> bytes:
        end = min(offset + size, self.end)
        if end <= offset:
            return b""
        c, o = self.chunk, self.origin
        first, last = (offset - o) // c, (end - 1 - o) // c
        if self.ahead:
            self._moved(first)
            self._send(range(first + 1, last + 1))  # a read of several chunks (a 256 KiB window): at once
        parts = []
        for k in range(first, last + 1):
            at = o + k * c
            if k not in self._have and k not in self._held:
                self._check_stop()
                want = min(c, self.end - at)
                sent = self._flight.pop(k, None)
                if sent is None:
                    self.gets += 1
                data = sent.result() if sent is not None else self._get(k)
                if len(data) != want:
                    raise OSError(errno.EIO, f"{len(data)} bytes at offset {at}, not {want}", self.url)
                if self._file is None:
                    self._held[k] = data
                    while len(self._held) > self.keep:
                        self._held.popitem(last=False)
                else:
                    self._keep(data, at)
                    self._have.add(k)
            if self._file is None:
                self._held.move_to_end(k)
                parts.append(self._held[k][max(offset - at, 0):end - at])
        if self.ahead:
            self._send_ahead(last)
        return b"".join(parts) if self._file is None else os.pread(self._file.fileno(), end - offset, offset)

    def _check_stop(self) -> None:
        if _EXITING.is_set() or (self.stop is not None and self.stop.is_set()):
            raise DatasetError(f"indexing {self.url} stopped")

    def _get(self, k: int) -> bytes:
        """Chunk ``k``'s ranged GET (If-Match, the answer's ETag checked, faults retried: ``store.pread``)."""
        at = self.origin + k * self.chunk
        return self.store.pread(self.handle, min(self.chunk, self.end - at), at, cache=False)  # no sample reads it again

    def _ahead_get(self, k: int) -> bytes:
        self._check_stop()  # a GET sent ahead and not started before a stop: none sent
        return self._get(k)

    def _moved(self, first: int) -> None:
        """A read starts in chunk ``first``: in a row with the last read (in its last chunk or the
        next), or a skip, which ends the run."""
        self._row = first in (self._last, self._last + 1)
        for k in [k for k in self._flight if k < first]:  # skipped over: not wanted
            self._flight.pop(k).cancel()

    def _send_ahead(self, last: int) -> None:
        """The read in a row ended in chunk ``last``: the run grows by the chunks it entered; have
        the ``min(run, ahead)`` chunks after ``last`` fetched or in flight (not past ``end``)."""
        self._run = self._run + last - self._last if self._row else 0  # a skip's own chunks start no run
        self._last = last
        self._send(range(last + 1, last + 1 + min(self._run, self.ahead)))

    def _send(self, chunks: range) -> None:
        """Send the GETs of ``chunks`` not held nor in flight (none past ``end``, none after a stop)."""
        n_chunks = -(-(self.end - self.origin) // self.chunk)
        for k in chunks:
            if k >= n_chunks or k in self._flight or k in self._held or _EXITING.is_set() or (
                    self.stop is not None and self.stop.is_set()):
                continue
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.ahead, thread_name_prefix="prefetchd-ahead")
            self._flight[k] = self._pool.submit(self._ahead_get, k)
            self.gets += 1

    def _keep(self, data: bytes, at: int) -> None:
        """Write a fetched chunk to the temporary file, whole: a disk that is full wrote part of it (a
        short write), and the rest read back short (said as a truncated download) or as zeros."""
        try:
            n = os.pwrite(self._file.fileno(), data, at)
            why = "" if n == len(data) else f"{n:,} of {len(data):,} bytes written: is it full?"
        except OSError as e:
            why = e.strerror or str(e)
        if why:
            raise DatasetError(f"indexing {self.url}: its headers' chunks cannot be kept in {self.tmpdir} ({why}); "
                               "free space there or set dataset.cache_dir to a disk with room (indexing keeps "
                               f"up to {SCANS_IN_FLIGHT + 1} tars' chunks there at once)")

    def close(self) -> None:
        for sent in self._flight.values():
            sent.cancel()
        self._flight.clear()
        if self._pool is not None:  # the GETs started end (one request each); no thread is left
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self._file is not None:
            self._file.close()
        self._held.clear()


def shards_of(root: str, store, key: str = "dataset.root") -> tuple[str, list[str], dict[str, tuple[int, str]]]:
    """(the base URL the shard names are relative to, the shard names in order, each one's
    (size, ETag) as listed) of the bucket ``root``; a one-line DatasetError naming ``key`` when
    it names no shards."""
    scheme, bucket, prefix = objectstore.split(root, key)
    top = f"{scheme}://{bucket}"
    try:
        if shardnames.is_pattern(prefix):
            base_key = posixpath.dirname(prefix[:prefix.index("{")])  # a brace may stand for folders too
            base = f"{top}/{base_key}" if base_key else top
            names = [posixpath.relpath(p, base_key) if base_key else p for p in shardnames.expand(prefix)]
            listed = {rel: (size, etag) for rel, size, etag in store.list(base)}
            absent = [n for n in names if n not in listed]
            if absent:
                raise shardnames._missing(key, root, names, absent, "the pattern names")
            return base, names, {n: listed[n] for n in names}
        if prefix.lower().endswith(".tar"):
            h = store.head(root)
            base, _, name = root.rpartition("/")
            return base, [name], {name: (h.size, h.etag)}
        objects, folders = store.list_top(root)
    except FileNotFoundError:
        raise DatasetError(f"{key} {root}: no such object in the bucket (check the bucket and the key)") from None
    except OSError as e:
        raise objectstore.listing_error(key, root, store, e) from None
    listed = {n: (size, etag) for n, size, etag in objects if not n.startswith(".")}
    tars = sorted(n for n in listed if n.lower().endswith(".tar"))
    if not tars:
        packed = sorted(n for n in listed if n.lower().endswith(shardnames.COMPRESSED))
        if packed:
            raise DatasetError(f"{key} {root} holds compressed shards ({packed[0]} ...), not .tar ones: shards are read "
                               "in place, uncompressed; decompress them (gunzip, zstd -d, ...) and upload them again")
        if not listed and not folders:
            raise DatasetError(f"{key} {root} lists no objects: check the bucket and the prefix")
        seen = [f + "/" for f in folders[:3]] + sorted(listed)[:3]
        raise DatasetError(f"{key} {root} holds no .tar shards at its top level (it holds {', '.join(seen[:3])} ...): "
                           "set it to the prefix of the shards, or dataset.layout to what it is")
    shardnames._one_split(key, root, tars)
    shardnames._no_gaps(key, root, tars)
    return root.rstrip("/"), tars, {n: listed[n] for n in tars}


def scan(root: str, extensions: tuple[str, ...], label: str, key: str, store, tmpdir: str) -> BucketShardIndex:
    """Index the shards the bucket ``root`` names (see the module docstring)."""
    how, jkey = webdataset.parse_label(label)
    base, shards, idents = shards_of(root, store, key)
    exts = tuple(e.lower().encode() for e in extensions)
    temp_dir(tmpdir)

    stop = threading.Event()

    def one(rel: str) -> tuple:
        url = f"{base}/{rel}"
        f = ShardFile(store, url, *idents[rel], tmpdir, stop=stop)
        skipped: list = []
        try:
            rows, bad = webdataset.scan_shard(f, url, exts, how, jkey, skipped, os.fsencode(rel) + b"/")
            return rows, bad, skipped
        except StorageChanged:
            raise DatasetError(f"the shard {url} changed while it was being indexed (its ETag differs): is an upload "
                               "still writing it? start again once it is complete") from None
        except OSError as e:
            if objectstore.unavailable(e):
                raise StorageUnavailable(f"the shard {url} cannot be read: the bucket did not answer "
                                         f"({e.strerror or e}); the daemon exits 75 to be started again") from None
            raise DatasetError(f"the shard {url} cannot be read: {objectstore.words(e)}") from None
        finally:
            f.close()

    if len(shards) > 65535:  # before a shard is fetched (collect says so too, after its arguments are made)
        raise DatasetError(f"{key} {root} names {len(shards)} shards; at most 65535 are supported")
    pool = ThreadPoolExecutor(SCANS_IN_FLIGHT, thread_name_prefix="prefetchd-index")
    try:
        with contextlib.closing(_in_order(pool, one, shards, 2 * SCANS_IN_FLIGHT)) as scanned:
            index = webdataset.collect(root, base, shards, scanned, extensions, label, key)
    finally:  # an error, or a stop: the shards not started are not, those started stop at their next chunk
        stop.set()
        pool.shutdown(wait=False, cancel_futures=True)
    return BucketShardIndex(**{**_fields(index), "identity": tuple(idents[n] for n in shards)})


def _in_order(pool, fn, items: list, ahead: int):
    """``fn(item)`` of each item, in order, at most ``ahead`` submitted to ``pool`` at once (a scan that
    stops early, on an error, leaves the rest unstarted)."""
    futures = collections.deque(pool.submit(fn, x) for x in items[:ahead])
    rest = iter(items[ahead:])
    try:
        while futures:
            result = futures.popleft().result()
            for x in itertools.islice(rest, 1):
                futures.append(pool.submit(fn, x))
            yield result
    finally:
        for f in futures:
            f.cancel()


def _fields(index: TarIndex) -> dict:
    return {f: getattr(index, f) for f in ("root", "classes", "blob", "offsets", "labels", "fingerprint", "skipped",
                                           "kind", "layout", "archives", "archive_ids", "block", "size", "scan_s")}


def stamps_valid(stamps: list, listed=None) -> bool:
    """Still the shards indexed (a reload asks)? The root listed again, as a start does (``load``):
    a shard uploaded since is seen, as a local folder's mtime shows one (one HEAD each, which an
    older cache's stamps without the root get, saw only those indexed). ``listed``: ``shards_of``
    or ``bucketparquet.files_of``."""
    if stamps and stamps[0][0] == "list":
        root = stamps[0][1]
        try:
            base, names, idents = (listed or shards_of)(root, objectstore.store_for(root))
        except (OSError, DatasetError):
            return False
        return [[f"{base}/{n}", *idents[n]] for n in names] == [list(s) for s in stamps[1:]]
    try:
        with ThreadPoolExecutor(16) as pool:
            now = list(pool.map(lambda s: objectstore.store_for(s[0]).head(s[0]), stamps))
    except (OSError, DatasetError):
        return False
    return all([h.size, h.etag] == list(s[1:]) for s, h in zip(stamps, now, strict=True))


def load_cached(cdir: str, validate: bool = False) -> BucketShardIndex | None:
    """The cached index in ``cdir`` (``load`` checks it against a listing; a worker opens it as is)."""
    def build(meta: dict, arrays: dict) -> BucketShardIndex:
        return BucketShardIndex(meta["root"], tuple(meta["classes"]), arrays["blob"], arrays["offsets"],
                                arrays["labels"], meta["fingerprint"], files_dir=cdir, layout=meta["layout"],
                                archives=tuple(meta["archives"]), archive_ids=arrays.get("archive_ids"),
                                block=arrays.get("block"), size=arrays.get("size"), scan_s=meta["scan_s"],
                                identity=tuple((int(s), e) for s, e in meta["identity"]),
                                skipped=tuple(meta.get("skipped", ())), kind=meta.get("kind", "webdataset"))

    return read_cache(cdir, META, _VERSION, build)


def open_files(cdir: str) -> BucketShardIndex | None:
    """The cached bucket shards index in ``cdir`` (what workers open), or None if it is another kind's."""
    return load_cached(cdir) if os.path.exists(os.path.join(cdir, META)) else None


def load(root: str, extensions: tuple[str, ...], label: str, cache_dir: str | None, use_cache: bool = True,
         key: str = "dataset.root", storage_options: dict | None = None) -> tuple[BucketShardIndex, bool]:
    """(index, from_cache) of the shards the bucket URL ``root`` names."""
    store = objectstore.store_for(root, storage_options, key)
    endpoint = store.endpoint()
    cdir = cache_path(cache_dir, f"{root}|label={label}" + (f" at {endpoint}" if endpoint else ""),
                      "bucket-webdataset", extensions)

    def changed(cached: BucketShardIndex) -> str | None:
        listing = shards_of(root, store, key)  # one listing: still the shards indexed?
        return objectstore.changed_words(root, "shards", "other shards", objectstore.moved_since(
            cached.root, cached.archives, cached.identity, listing))

    def cache_of(index: BucketShardIndex) -> tuple[dict, dict]:
        return {k: getattr(index, k) for k in _ARRAYS}, {
            "version": _VERSION, "layout": index.layout, "root": index.root, "classes": list(index.classes),
            "archives": list(index.archives), "fingerprint": index.fingerprint, "count": len(index),
            "scan_s": index.scan_s, "identity": [list(x) for x in index.identity], "skipped": list(index.skipped),
            "kind": index.kind, "stamps": objectstore.listing_stamps(root, index.root, index.archives, index.identity)}

    tmp = os.path.join(cache_dir or default_cache_dir(), "tmp")
    return cached_or_scanned(cdir, META, use_cache, load_cached, changed,
                             lambda: scan(root, extensions, label, key, store, tmp), cache_of)
