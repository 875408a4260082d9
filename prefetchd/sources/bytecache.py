"""A node-local cache of the bytes fetched from a bucket: ``dataset.cache: {dir, max_bytes}``.

Later epochs read a sample's bytes from local disk instead of the bucket. What is cached: every
ranged read of an object whose ETag is known (``objectstore.ObjectStore.pread``: a shard's
member, a Parquet row group's column chunk or footer), keyed by (endpoint and URL, ETag, offset, size), and an
ImageFolder's objects, keyed by (URL, the ETag listed, 0, the size listed) and kept only when the
GET's ETag is the listed one (``bucketfolder.BucketIndex``); not the chunks read while a shard
is indexed (a sample never reads them again).

**Entries**: one file per range, named by the SHA-256 of its key, in 256 sub-folders of ``dir``.
Written to a temporary name in the same folder and renamed, so a reader sees no entry or a whole
one, and several worker processes writing the same entry at once each rename a whole copy; the
size is checked at read (another size is a miss, and the file removed). A hit sets the file's
mtime to now: the least recently used are those of the oldest mtime.

**The same object overwritten**: the key holds the ETag the index was built with (the ranged
reads ask for it: ``If-Match``); once the object is indexed or listed again (its new ETag), its
old entries are never read again and age out. Until then an entry holds the indexed object's
bytes, which are what the index's offsets and labels name: a shard's or Parquet file's member as
indexed (never another sample's), an ImageFolder object's bytes as listed (its path's label).

**Bounded**: when a process has added more than ``max_bytes / 32`` since it last looked (and at
its first write), it lists the cache and removes the least recently used files until the total
is at most 90% of ``max_bytes``; two processes removing the same file is harmless. A temporary
file over an hour old (its writer killed mid-write) is removed then too.

``dir`` must be on a local disk: not the RAM ring's ``buffer.dir`` (``Config`` refuses it) nor any
tmpfs (``configure`` refuses it: a cache in RAM competes with the ring for the memory it needs).
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import threading
import time

from prefetchd.core.bufferdir import is_tmpfs
from prefetchd.sources.base import DatasetError

log = logging.getLogger("prefetchd.dataset")

_LOW_WATER = 0.9  # an eviction brings the total down to this share of max_bytes
_LOOK_EVERY = 32  # a process lists the cache after adding max_bytes / this many bytes
_STALE_TMP_S = 3600  # a temporary file this old is a dead writer's: removed when the cache is listed


class ByteCache:
    """The cache in ``dir`` (see the module docstring)."""

    def __init__(self, dir: str, max_bytes: int):
        self.dir, self.max_bytes = dir, int(max_bytes)
        self.stats = {"hits": 0, "misses": 0, "hit_bytes": 0, "fetched_bytes": 0, "errors": 0}
        self._added = max_bytes  # look at the first write
        self._warned = self._said_small = False  # each said once a process
        self._lock = threading.Lock()  # the counters and eviction: a worker reads with several threads

    def _path(self, url: str, etag: str, offset: int, size: int) -> str:
        h = hashlib.sha256(f"{url}\0{etag}\0{offset}\0{size}".encode("utf-8", "surrogateescape")).hexdigest()
        return os.path.join(self.dir, h[:2], h[2:])

    def get(self, url: str, etag: str, offset: int, size: int) -> bytes | None:
        path = self._path(url, etag, offset, size)
        try:
            with open(path, "rb") as f:
                data = f.read(size + 1)
            if len(data) != size:
                raise OSError(f"{len(data)} bytes, not {size}")
            os.utime(path)  # most recently used
        except FileNotFoundError:
            self._count(misses=1)
            return None
        except OSError as e:
            self._count(misses=1, errors=1)
            log.debug("cache entry %s unreadable (%s): fetched again", path, e)
            try:
                os.unlink(path)
            except OSError:
                pass
            return None
        self._count(hits=1, hit_bytes=size)
        return data

    def put(self, url: str, etag: str, offset: int, data: bytes) -> None:
        if len(data) > self.max_bytes * _LOW_WATER:  # written, then evicted at once with the whole cache listed
            if not self._said_small:
                self._said_small = True
                log.warning("dataset.cache.max_bytes (%d bytes) is smaller than what one read fetches (%d bytes): "
                            "nothing that large is cached; raise it (a size such as 100GiB)", self.max_bytes, len(data))
            return
        path = self._path(url, etag, offset, len(data))
        tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
        try:
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
            os.rename(tmp, path)
        except OSError as e:  # a full disk: the read goes on, uncached
            self._count(errors=1)
            if not self._warned:  # a full disk: said once a process, the reads go on from the bucket
                self._warned = True
                log.warning("dataset.cache.dir %s: cannot write an entry (%s): reads go on from the bucket, "
                            "uncached; free space there or lower dataset.cache.max_bytes", self.dir, e.strerror or e)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return
        self._count(fetched_bytes=len(data))
        with self._lock:
            self._added += len(data)
            look = self._added * _LOOK_EVERY >= self.max_bytes
            if look:
                self._added = 0
        if look:
            self.evict()

    def evict(self) -> int:
        """Remove the least recently used entries while the cache holds more than ``max_bytes``
        (down to 90% of it); returns the bytes removed."""
        entries = []
        try:
            subs = [e.path for e in os.scandir(self.dir) if e.is_dir() and len(e.name) == 2]
        except OSError:
            return 0
        stale = time.time_ns() - _STALE_TMP_S * 10**9
        for sub in subs:
            try:
                found = list(os.scandir(sub))
            except OSError:
                continue
            for e in found:
                try:  # each entry on its own: another process renames or evicts them meanwhile
                    st = e.stat()
                    if ".tmp-" not in e.name:
                        entries.append((st.st_mtime_ns, st.st_size, e.path))
                    elif st.st_mtime_ns < stale:  # a writer killed mid-write (SIGKILL, out of memory) left it
                        os.unlink(e.path)
                except OSError:
                    continue
        total = sum(s for _, s, _ in entries)
        if total <= self.max_bytes:
            return 0
        removed = 0
        for _, size, path in sorted(entries):
            if total - removed <= self.max_bytes * _LOW_WATER:
                break
            try:
                os.unlink(path)
            except OSError:
                continue  # another process took it first
            removed += size
        return removed

    def _count(self, **by: int) -> None:
        with self._lock:
            for k, v in by.items():
                self.stats[k] += v

    def hit_rate(self) -> float:
        n = self.stats["hits"] + self.stats["misses"]
        return self.stats["hits"] / n if n else 0.0


_CURRENT: ByteCache | None = None


def current() -> ByteCache | None:
    """This process's cache (``configure``), or None."""
    return _CURRENT


def configure(cache: dict | None, key: str = "dataset.cache") -> ByteCache | None:
    """Use ``cache`` (``dataset.cache``: ``{dir, max_bytes}``, validated by the config) in this
    process; ``{}``/None: none. A ``dir`` on tmpfs is a one-line DatasetError."""
    global _CURRENT
    if not cache:
        _CURRENT = None
        return None
    d = cache["dir"]
    if _CURRENT is not None and (_CURRENT.dir, _CURRENT.max_bytes) == (d, int(cache["max_bytes"])):
        return _CURRENT
    # refused before it is made: else a refused dir stayed behind in RAM (is_tmpfs reads the mount
    # table by the path, so it answers for a dir not made yet)
    if is_tmpfs(d):
        raise DatasetError(f"{key}.dir {d} is on tmpfs (RAM), where it would take the memory the batch ring needs: "
                           "set it to a folder on a local disk")
    try:
        os.makedirs(d, mode=0o700, exist_ok=True)
    except OSError as e:
        raise DatasetError(f"{key}.dir {d} cannot be made: {e.strerror}; set it to a folder on a local disk") from None
    try:  # a folder root made for a service user that runs as another: every entry would fail, unsaid
        fd, probe = tempfile.mkstemp(dir=d, prefix=".probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise DatasetError(f"{key}.dir {d} is not writable by this user ({e.strerror}): give it to the user the "
                           "daemon runs as (chown), or set it to a folder that user can write") from None
    _CURRENT = ByteCache(d, int(cache["max_bytes"]))
    return _CURRENT
