"""Object storage (``s3://bucket/prefix``, ``gs://bucket/prefix``) behind the store interface of
``prefetchd.sources.store``: the same calls as ``LocalStore``, over obstore.

Why obstore (the ``s3`` and ``gcs`` extras), not fsspec with s3fs or gcsfs: its client is Rust
(``object_store``, the crate DataFusion and Polars read buckets with), so a ranged GET costs no
Python per byte and releases the GIL while it waits; it retries 5xx, timeouts and resets with
exponential back-off and jitter itself; one wheel of a few MB with no dependencies, where s3fs
brings aiobotocore, botocore and an event loop per process.

* a key is the root's URL joined with the relative path (``Index.path``): ``s3://b/p/cls/x.jpg``;
* ``read(url)``: the whole object, one GET;
* ``open(url, on_open)``: a ``Handle`` of the object's size and ETag (one HEAD), the ``MAX_OPEN``
  most recently used kept; ``pread(handle, size, offset)``: one ranged GET sent with
  ``If-Match: <ETag>``, so an object overwritten since it was opened answers 412 and raises
  ``StorageChanged`` instead of another sample's bytes (as does an answer with another ETag, from
  a store that ignores ``If-Match``: fake-gcs-server);
* ``identity(handle)``: ``(size, ETag)``;
* ``list(url)``: every object under a prefix (``ListObjectsV2``, paginated by the client);
  ``list_top(url)``: its top level only (objects and sub-prefixes, delimited by ``/``).

Credentials and endpoint come the provider's standard way: the shared credentials file's
profile (``~/.aws/credentials``, ``AWS_PROFILE``: read here, ``aws_profile``) when no key is in
the environment; obstore reads ``AWS_*`` (the key pair, ``AWS_SESSION_TOKEN``, ``AWS_REGION``, ``AWS_ENDPOINT_URL``, ``AWS_ALLOW_HTTP``, a web
identity or an instance's metadata service); a gs:// bucket's come as ``sources/gcs.py`` says
(``GOOGLE_APPLICATION_CREDENTIALS``, ``GOOGLE_SERVICE_ACCOUNT*``, the metadata server,
``STORAGE_EMULATOR_HOST``). Nothing here logs, returns or writes a secret: ``describe`` names the
key id by its last four characters only, a service account by its e-mail.

ETags are kept quoted, as HTTP sends them (``"..."``): a GCS emulator (fake-gcs-server) lists
them bare and answers a HEAD or GET with them quoted, and an identity compared across the two
(a listed ETag against a GET's, a HEAD's against a later listing) must match. A Rust client does not survive ``fork``: each
process makes its own on first use.
"""

from __future__ import annotations

import configparser
import errno
import logging
import os
import random
import re
import threading
import time
from datetime import timedelta

from prefetchd.sources import bytecache, gcs
from prefetchd.sources.base import DatasetError, StorageChanged, StorageUnavailable

log = logging.getLogger("prefetchd.objectstore")

MAX_OPEN = 1024  # handles (a HEAD's size and ETag) a worker keeps: a few bytes each, no descriptor
SCHEMES = {"s3": "s3", "gs": "gcs"}  # URL scheme -> the extra that reads it
_URL = re.compile(r"^([a-z][a-z0-9+.-]*)://([^/]*)/?(.*)$")


def is_url(path: str | None) -> bool:
    """Is ``path`` a URL (``scheme://...``) rather than a local path?"""
    return bool(path) and _URL.match(path) is not None


def split(url: str, key: str = "dataset.root") -> tuple[str, str, str]:
    """``(scheme, bucket, prefix)`` of ``url`` (prefix without leading or trailing ``/``)."""
    m = _URL.match(url)
    if m is None or m.group(1) not in SCHEMES or not m.group(2):
        raise DatasetError(f"{key} {url} is not a bucket URL prefetchd reads: use s3://BUCKET/PREFIX or "
                           "gs://BUCKET/PREFIX")
    return m.group(1), m.group(2), m.group(3).strip("/")


def _obstore(scheme: str, key: str):
    try:
        import obstore
    except ImportError:
        raise DatasetError(f"{key} is a {scheme}:// URL, which needs the '{SCHEMES[scheme]}' extra: "
                           f"pip install 'prefetchd[{SCHEMES[scheme]}]'") from None
    return obstore


_ENDPOINT_KEYS = ("endpoint", "endpoint_url", "aws_endpoint", "aws_endpoint_url")


class Handle:
    """An opened object: its key in the bucket, size and ETag (``ObjectStore.open``)."""

    __slots__ = ("key", "size", "etag")

    def __init__(self, key: str, size: int, etag: str):
        self.key, self.size, self.etag = key, size, etag


def _os_error(e: Exception, url: str) -> OSError:
    """obstore's error as the OSError a local read would raise (``executors.storage`` judges it)."""
    from obstore import exceptions as x

    if isinstance(e, x.PreconditionError):
        return _changed(url)
    status = _status(e)
    code = errno.ENOENT if isinstance(e, (x.NotFoundError, FileNotFoundError)) or status == 404 else (
        errno.EACCES if isinstance(e, (x.PermissionDeniedError, x.UnauthenticatedError)) or status in (401, 403)
        else errno.ETIMEDOUT if getattr(e, "retried_out", False) else errno.EIO)
    return OSError(code, _first_line(e) + _tls(e), url)


_CERT = re.compile(r"InvalidCertificate\(([\s\w(]*)")


def _tls(e: Exception) -> str:
    """Why a TLS handshake failed, from obstore's debug text ("" when it did not): its first line
    says only "error sending request", which was taken for an endpoint gone and retried."""
    m = _CERT.search(str(e))
    why = re.findall(r"\w+", m.group(1)) if m else []
    return f" (the endpoint's TLS certificate is not trusted: {why[-1]})" if why else ""


def _changed(url: str) -> StorageChanged:
    # (errno, message): the worker says its strerror (``executors.storage``), None without one
    return StorageChanged(errno.ESTALE, f"the archive {url}{StorageChanged.MARK} (its ETag differs: overwritten "
                          "in the bucket): batches from it wait; restart the daemon to index it again")


_STATUS = re.compile(r"status code: (\d{3})\b")


def _status(e: Exception) -> int:
    """The HTTP status an obstore error carries in its text, 0 without one: a listing's 403 or
    404 (NoSuchBucket) comes as a GenericError, not as PermissionDenied or NotFound."""
    m = _STATUS.search(str(e).split("\n", 1)[0])
    return int(m.group(1)) if m else 0


def permanent(e: Exception) -> bool:
    """A 4xx other than a timeout (408) or throttling (429): asking again gets the same answer."""
    return bool(_tls(e)) or (400 <= _status(e) < 500 and _status(e) not in (408, 429))


# an AWS access key id (AKIA... long-term, ASIA... temporary) or what a server echoes in <AccessKeyId>
_KEY_ID = re.compile(r"\b(?:AKIA|ASIA)[A-Z0-9]{12,}\b|(?<=<AccessKeyId>)[^<]+(?=</AccessKeyId>)")


def _redact(text: str) -> str:
    """``text`` with every access key id cut to its last 4 characters, as ``describe`` shows it."""
    known = os.environ.get("AWS_ACCESS_KEY_ID", "")
    if len(known) > 4:
        text = text.replace(known, "..." + known[-4:])
    return _KEY_ID.sub(lambda m: "..." + m.group(0)[-4:] if len(m.group(0)) > 4 else m.group(0), text)


def _first_line(e: Exception) -> str:
    """obstore's message without its long "Debug source" tail, and without an access key id
    (a server's error may echo it; the secret key is never in it)."""
    return _PEM.sub("[a private key]", _redact(str(e).split("\n", 1)[0]))[:300]


_PEM = re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?(-----END [A-Z ]*PRIVATE KEY-----|$)", re.S)


def _etag(tag: str | None) -> str:
    """An ETag as HTTP quotes it (``"..."``, or a weak ``W/"..."``); "" for none (see the docstring)."""
    if not tag:
        return ""
    return tag if tag.startswith(('"', 'W/"')) else f'"{tag}"'


quoted = _etag  # for the indexes that keep ETags


class ObjectStore:
    """One bucket (see the module docstring for the interface)."""

    def __init__(self, scheme: str, bucket: str, storage_options: dict | None = None, key: str = "dataset.root"):
        self.scheme, self.bucket, self.key = scheme, bucket, key
        self.options = dict(storage_options or {})
        self._obs = _obstore(scheme, key)
        # obstore raises a GET's or HEAD's 404 as the builtin FileNotFoundError (no errno), not as one of its own
        self._errors = (self._obs.exceptions.BaseError, FileNotFoundError)
        self._store = None
        self._pid = 0
        self._handles: dict[str, Handle] = {}
        self._endpoint = ""

    def client(self):
        """This process's client (made on first use, again in a forked child)."""
        if self._store is None or self._pid != os.getpid():
            from obstore.store import GCSStore, S3Store

            client_options = {"timeout": "30s", "connect_timeout": "5s"}
            self._endpoint = self._find_endpoint()
            if self._endpoint.startswith("http://"):
                client_options["allow_http"] = True  # an S3-compatible store on a private network or loopback
            config = {k: v for k, v in self.options.items() if k != "client_options"}
            if self.scheme == "s3" and "access_key_id" not in config:
                config.update(aws_profile()[1])
            if self.scheme == "gs":
                refused = gcs.refusal(self.options)
                if refused:
                    raise DatasetError(f"{self.key} gs://{self.bucket}: its credentials cannot be used: {refused}")
                config.update(gcs.client_config(self.options))
            client_options.update(self.options.get("client_options", {}))
            cls = S3Store if self.scheme == "s3" else GCSStore
            try:
                self._store = cls(self.bucket, config=config or None, client_options=client_options,
                                  retry_config={"max_retries": 2, "retry_timeout": _RETRY_TIMEOUT,
                                                "backoff": {"init_backoff": _BACKOFF_START,
                                                            "max_backoff": _BACKOFF_MAX, "base": 2}})
            except self._obs.exceptions.BaseError as e:  # credentials that cannot be loaded: a missing key file
                raise _os_error(e, f"{self.scheme}://{self.bucket}") from None
            self._pid, self._handles = os.getpid(), {}
        return self._store

    def object_key(self, url: str) -> str:
        scheme, bucket, prefix = split(url, self.key)
        if (scheme, bucket) != (self.scheme, self.bucket):
            raise ValueError(f"{url} is not in {self.scheme}://{self.bucket}")
        return prefix

    def read(self, url: str) -> bytes:
        try:
            return self._retry(lambda: bytes(self._obs.get(self.client(), self.object_key(url)).bytes()))
        except self._errors as e:
            raise _os_error(e, url) from None

    def read_tagged(self, url: str) -> tuple[bytes, str]:
        """The whole object and the ETag of what was read, one GET."""
        def get():
            got = self._obs.get(self.client(), self.object_key(url))
            return bytes(got.bytes()), _etag(got.meta.get("e_tag"))

        try:
            data, etag = self._retry(get)
        except self._errors as e:
            raise _os_error(e, url) from None
        _count(bytes=len(data))
        return data, etag

    def head(self, url: str) -> Handle:
        try:
            meta = self._retry(lambda: self._obs.head(self.client(), self.object_key(url)))
        except self._errors as e:
            raise _os_error(e, url) from None
        return Handle(url, int(meta["size"]), _etag(meta.get("e_tag")))

    def open(self, url: str, on_open=None) -> Handle:
        """The object's ``Handle`` (one HEAD when not kept); ``on_open(handle)`` checks a fresh one."""
        self.client()
        h = self._handles.pop(url, None)
        if h is None:
            if len(self._handles) >= MAX_OPEN:
                self._handles.pop(next(iter(self._handles)))
            h = self.head(url)
            if on_open is not None:
                on_open(h)
        self._handles[url] = h
        return h

    def pread(self, h: Handle, size: int, offset: int, cache: bool = True) -> bytes:
        """``size`` bytes at ``offset`` (fewer at the object's end); from the node-local cache
        (``bytecache``) when it holds them for this ETag and ``cache``, which then keeps what is fetched."""
        size = min(offset + size, h.size) - offset
        if size <= 0:
            return b""
        kept = bytecache.current() if cache and h.etag else None
        where = self.cache_key(h.key)
        if kept is not None:
            data = kept.get(where, h.etag, offset, size)
            if data is not None:
                return data
        options = {"range": (offset, offset + size)}
        if h.etag:
            options["if_match"] = h.etag

        def get():
            got = self._obs.get(self.client(), self.object_key(h.key), options=options)
            return bytes(got.bytes()), _etag(got.meta.get("e_tag"))

        try:
            data, etag = self._retry(get)
        except self._errors as e:
            raise _os_error(e, h.key) from None
        _count(bytes=len(data))
        if h.etag and etag and etag != h.etag:
            # a store that ignores If-Match (fake-gcs-server does) still names the version it sent
            raise _changed(h.key)
        if kept is not None and len(data) == size:
            kept.put(where, h.etag, offset, data)
        return data

    def _retry(self, call):
        """``call()``, retried with exponential back-off and full jitter while the fault is
        transient (5xx, throttling, a timeout, a reset or refused connection), up to
        ``_RETRY_TIMEOUT_S``; one log line when an episode starts and one when it ends, not one a
        request. A permanent fault (404, 403, 412) is raised at once."""
        x = self._obs.exceptions
        delay, start, tries = _BACKOFF_START_S, None, 0
        while True:
            _count(requests=1)
            try:
                out = call()
                if isinstance(out, bytes):
                    _count(bytes=len(out))
            except (x.NotFoundError, FileNotFoundError, x.PermissionDeniedError, x.UnauthenticatedError,
                    x.PreconditionError, x.InvalidPathError, x.NotSupportedError):  # a GET's 404: the builtin
                _count(errors=1)
                raise
            except x.BaseError as e:
                _count(errors=1)
                if permanent(e):  # a listing's 403 (a wrong key) or 404 (no such bucket): said at once
                    raise
                now = time.monotonic()
                if start is None:
                    start = now
                    if _FAULT_SINCE.get(self.bucket) is None:
                        _FAULT_SINCE[self.bucket] = now
                        log.warning("%s://%s: %s; retrying with back-off (said once until it answers again)",
                                    self.scheme, self.bucket, _first_line(e))
                if now - start > _RETRY_TIMEOUT_S:
                    e.retried_out = True  # the bucket did not answer for the whole episode: ``unavailable``
                    raise
                tries += 1
                time.sleep(random.uniform(0, delay))  # full jitter: workers retrying together do not stampede
                delay = min(delay * 2, _BACKOFF_MAX_S)
                continue
            since = _FAULT_SINCE.pop(self.bucket, None)
            if since is not None:
                log.warning("%s://%s answers again after %.1f s", self.scheme, self.bucket, time.monotonic() - since)
            return out

    @staticmethod
    def identity(h: Handle) -> tuple[int, str]:
        return h.size, h.etag

    def forget(self, url: str) -> None:
        self._handles.pop(url, None)

    def list(self, url: str) -> list[tuple[str, int, str]]:
        """``(relative key, size, ETag)`` of every object under the prefix ``url`` names: the whole
        listing, listed again from its start through a transient fault (``_retry``: a 503 SlowDown
        or an outage at start failed a brace pattern's or an ImageFolder's listing at once)."""
        try:
            return self._retry(lambda: list(self._listing(url)))
        except self._errors as e:
            raise _os_error(e, url) from None

    def first(self, url: str) -> tuple[str, int, str] | None:
        """The first object under the prefix ``url`` names (one request, not retried: ``probe``'s, and
        the look at a root after a sample's 403 or 404, which waits instead)."""
        _count(requests=1)
        try:
            return next(self._listing(url), None)
        except self._errors as e:
            _count(errors=1)
            raise _os_error(e, url) from None

    def _listing(self, url: str):
        prefix = self.object_key(url)
        base = prefix + "/" if prefix else ""
        for page in self._obs.list(self.client(), prefix=prefix or None, chunk_size=1000):
            for m in page:
                if m["path"].startswith(base):
                    yield m["path"][len(base):], int(m["size"]), _etag(m.get("e_tag"))

    def list_top(self, url: str) -> tuple[list[tuple[str, int, str]], list[str]]:
        """The top level of the prefix ``url`` names, in one delimited listing: its objects'
        ``(name, size, ETag)`` and its sub-prefixes' names (the "folders" under it)."""
        prefix = self.object_key(url)
        base = prefix + "/" if prefix else ""
        try:
            got = self._retry(lambda: self._obs.list_with_delimiter(self.client(), prefix=prefix or None))
        except self._errors as e:
            raise _os_error(e, url) from None
        objects = [(m["path"][len(base):], int(m["size"]), _etag(m.get("e_tag"))) for m in got["objects"]
                   if m["path"].startswith(base)]
        return objects, [p[len(base):].strip("/") for p in got["common_prefixes"] if p.startswith(base)]

    def endpoint(self) -> str:
        """The endpoint requests go to when it is not the provider's own ("" for AWS S3 and GCS):
        the same bucket name on two endpoints is two buckets (the index caches key on it). Once
        this process's client is made, the one it was made for: ``cache_key`` asks at every read,
        and a gs:// endpoint may come from the key file (read and parsed: 80 us)."""
        if self._store is not None and self._pid == os.getpid():
            return self._endpoint
        return self._find_endpoint()

    def _find_endpoint(self) -> str:
        if self.scheme == "gs":
            return gcs.endpoint(self.options)
        given = {k.lower(): v for k, v in self.options.items() if isinstance(v, str)}
        for k in _ENDPOINT_KEYS:  # obstore's spellings of it, any case
            if given.get(k):
                return given[k]
        if self.scheme == "s3":
            return os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT") or ""
        return ""

    def cache_key(self, url: str) -> str:
        """``url`` as the node-local cache keys it: with the endpoint (the same bucket name on two
        endpoints is two buckets, whose objects' ETags may match)."""
        return f"{self.endpoint()}|{url}"

    def describe(self) -> str:
        """Which identity and endpoint requests go to, with no secret (``prefetchd check``)."""
        if self.scheme == "s3":
            key_id = self.options.get("access_key_id") or os.environ.get("AWS_ACCESS_KEY_ID", "")
            where_from, profile = aws_profile() if not key_id else ("", {})
            key_id = key_id or profile.get("access_key_id", "")
            who = (f"access key ...{key_id[-4:]}{where_from}" if key_id else
                   "no AWS_ACCESS_KEY_ID: the instance's or pod's identity, or anonymous")
            where = self.endpoint() or "AWS S3 (no AWS_ENDPOINT_URL)"
            region = self.options.get("region") or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
            return f"{who}, endpoint {where}" + (f", region {region}" if region else "")
        return gcs.describe(self.options)


def aws_profile() -> tuple[str, dict]:
    """The key pair of the shared credentials file's profile (``AWS_PROFILE``, else ``default``;
    ``AWS_SHARED_CREDENTIALS_FILE``, else ``~/.aws/credentials``) when the environment has none:
    obstore reads the environment, a web identity and the instance's metadata, not this file.
    Returns (" from profile P of FILE" for ``describe``, obstore's options), or ("", {})."""
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        return "", {}
    path = os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.expanduser("~/.aws/credentials")
    name = os.environ.get("AWS_PROFILE") or "default"
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read(path, encoding="utf-8")
    except (configparser.Error, OSError, UnicodeDecodeError):
        return "", {}
    if not parser.has_section(name):
        return "", {}
    sec = parser[name]
    out = {ours: sec[theirs] for theirs, ours in (("aws_access_key_id", "access_key_id"),
                                                 ("aws_secret_access_key", "secret_access_key"),
                                                 ("aws_session_token", "token")) if sec.get(theirs)}
    return (f" from profile {name} of {path}", out) if "access_key_id" in out else ("", {})


_RETRY_TIMEOUT_S = 120.0  # a fault episode (throttling, an endpoint gone) retried this long before a read fails
_BACKOFF_START_S = 0.05
_BACKOFF_MAX_S = 5.0
# the client's own retries: a few quick ones inside each of ours (ours log the episode)
_RETRY_TIMEOUT = timedelta(seconds=10)
_BACKOFF_START = timedelta(milliseconds=20)
_BACKOFF_MAX = timedelta(milliseconds=200)
_FAULT_SINCE: dict[str, float] = {}  # bucket -> when its fault episode began (this process)
_STORES: dict[tuple[str, str], ObjectStore] = {}
_COUNTS = {"requests": 0, "bytes": 0, "errors": 0}  # this process's, for status and metrics (``counts``)
_COUNTS_LOCK = threading.Lock()  # a worker's GETs run in a thread pool


def _count(**by: int) -> None:
    with _COUNTS_LOCK:
        for k, v in by.items():
            _COUNTS[k] += v


def counts() -> tuple:
    """This process's totals since it started, ``(pid, requests, bytes, errors, cache hits, cache
    misses, bytes from the cache)``: what a worker sends with each result (the daemon sums the
    latest of each process: ``daemon.outages``); () when it has asked no bucket anything."""
    c = bytecache.current()
    hits = (c.stats["hits"], c.stats["misses"], c.stats["hit_bytes"]) if c is not None else (0, 0, 0)
    if not _COUNTS["requests"] and not any(hits):
        return ()
    return (os.getpid(), _COUNTS["requests"], _COUNTS["bytes"], _COUNTS["errors"], *hits)
_PROBE_BYTES = 1 << 20  # what ``probe`` reads of the first object


def moved_since(cached_root: str, cached_names, cached_identity: tuple, listing: tuple) -> list[str] | None:
    """None when ``listing`` (base, names, {name: (size, ETag)}) shows the objects a cached bucket
    index holds, in its order; else the names it holds whose size or ETag moved (none: other objects)."""
    base, names, idents = listing
    now = tuple(idents[n] for n in names)
    if (base, tuple(names), now) == (cached_root, tuple(cached_names), cached_identity):
        return None
    return [n for n, was, is_ in zip(cached_names, cached_identity, now, strict=False) if was != is_]


def changed_words(root: str, what: str, others: str, moved: list[str] | None) -> str | None:
    """A cached bucket index's warning, None when ``moved`` (``moved_since``) is: the ``what`` under
    ``root`` changed since they were indexed (those overwritten, or ``others``)."""
    if moved is None:
        return None
    return (f"the {what} under {root} changed since they were indexed ("
            f"{f'{len(moved)} overwritten, e.g. {moved[0]}' if moved else others}): indexing them again")


def listing_stamps(root: str, base: str, names, identity) -> list:
    """A bucket index cache's stamps: the root listed, and each object's (size, ETag) as indexed."""
    return [["list", root]] + [[f"{base}/{n}", *ident] for n, ident in zip(names, identity, strict=True)]


def store_for(url: str, storage_options: dict | None = None, key: str = "dataset.root") -> ObjectStore:
    """The ``ObjectStore`` of ``url``'s bucket (one per bucket in a process)."""
    scheme, bucket, _ = split(url, key)
    s = _STORES.get((scheme, bucket))
    if s is None or (storage_options is not None and storage_options != s.options):
        s = _STORES[(scheme, bucket)] = ObjectStore(scheme, bucket, storage_options, key)
    return s


def probe(url: str, storage_options: dict | None = None, key: str = "dataset.root") -> list[str]:
    """``prefetchd check``'s lines for a bucket root: which identity and endpoint, whether it can
    list, whether it can read (one line each); a ``DatasetError`` of one line when it cannot."""
    store = store_for(url, storage_options, key)
    lines = [f"storage: {url} as {store.describe()}"]
    first = None
    where = url  # the prefix listed: a brace pattern's or one object's folder (``bucketshards``)
    if "{" in url or url.lower().endswith((".tar", ".parquet")):
        where = url[:url.index("{")].rpartition("/")[0] if "{" in url else url.rpartition("/")[0]
    url = where
    try:
        got = store.first(url)
        first = got[:2] if got else None
    except OSError as e:
        if _no_answer(e):  # one request, not retried: the endpoint down is not the configuration's fault
            raise StorageUnavailable(f"{key} {url} cannot be listed: the endpoint did not answer "
                                     f"({words(e, store.scheme, store.options)}); is "
                                     f"{store.endpoint() or 'the endpoint'} up?") from None
        raise listing_error(key, url, store, e) from None
    if first is None:
        raise DatasetError(f"{key} {url} lists no objects (a missing bucket or an empty prefix) as {store.describe()}")
    lines.append(f"list: ok ({url.rstrip('/')}/{first[0]} is the first object)")
    try:  # its first bytes only: the first object may be a shard of gigabytes
        data = store.pread(store.head(url.rstrip("/") + "/" + first[0]), _PROBE_BYTES, 0, cache=False)
    except OSError as e:
        raise DatasetError(f"{key} {url} can be listed but not read: {words(e, store.scheme, store.options)}") from None
    lines.append(f"read: ok ({len(data):,} bytes of {first[0]})")
    return lines


def listing_error(key: str, url: str, store: ObjectStore, e: OSError) -> DatasetError:
    """The one line for a prefix that cannot be listed: as whom, where, and what the answer means;
    a ``StorageUnavailable`` when the bucket did not answer through the whole retry episode."""
    if unavailable(e):
        # a token endpoint not answering (gcloud's user credentials, the metadata server) is not the bucket's
        asked = "Google's token endpoint reachable from this host" if "token request" in (e.strerror or "") else \
            f"{store.endpoint() or 'the endpoint'} up"
        return StorageUnavailable(f"{key} {url} cannot be listed: the bucket did not answer for "
                                  f"{_RETRY_TIMEOUT_S:.0f} s ({words(e, store.scheme, store.options)}); is {asked}"
                                  "? the daemon exits 75 to be started again")
    hint = ""
    if store.scheme == "gs" and store.endpoint() and e.errno == errno.ENOENT:
        # fake-gcs-server started without -public-host answers every XML API listing 404
        hint = (f", or {store.endpoint()} does not serve GCS's XML API (obstore lists with GET /BUCKET?list-type=2): "
                f"start fake-gcs-server with -public-host {store.endpoint().split('://', 1)[-1]}")
    return DatasetError(f"{key} {url} cannot be listed as {store.describe()}: {words(e, store.scheme, store.options)}{hint}")


def _no_answer(e: OSError) -> bool:
    """Did the endpoint not answer at all (refused, reset, timed out) or answer 503 (throttling)?"""
    text = e.strerror or str(e)
    return _status(e) in (429, 503) or (not _status(e) and "token request" not in text and "TLS" not in text and (
        "error sending request" in text or "timed out" in text.lower()))


def fault_words(e: OSError) -> str:
    """A fault's words (a 5xx, a reset): its status and the server's code, or no answer; not obstore's text
    (the request's URL, the server's XML cut short). ``words``' own for a refusal, a certificate, a token."""
    text, said, code = e.strerror or str(e), words(e), re.search(r"<Code>([^<]+)</Code>", e.strerror or "")
    if said != text or not (_status(e) or _no_answer(e)):  # ``words`` says more; or neither: without the URL
        return said if said != text else " ".join(gcs.answer(text).split())
    return f"it answered {_status(e)}" + (f" {code.group(1)}" if code else "") if _status(e) else \
        "the endpoint did not answer (the connection reset, refused or timed out)"


def unavailable(e: OSError) -> bool:
    """Did ``e`` end a transient fault's whole retry episode (an outage, throttling), not a refusal
    or a key file that cannot be read (``_retry`` marks it; ``_os_error`` makes it ETIMEDOUT)?"""
    return e.errno == errno.ETIMEDOUT


def words(e: OSError, scheme: str | None = None, options: dict | None = None) -> str:
    """What a bucket's error means, in words (the status code kept): a refusal says what to check, not
    obstore's text (the request's URL, the server's XML). ``scheme``: by default the one of the URL
    the error names (``_os_error``'s filename)."""
    text = e.strerror or str(e)
    if scheme is None:
        scheme = "gs" if str(e.filename or "").startswith("gs://") else "s3"
    if "ExpiredToken" in text:
        return ("the credentials have expired (403 ExpiredToken): renew them (AWS_SESSION_TOKEN, the profile's or "
                "the instance's role) and start again")
    said = gcs.words(e, text, options or {}) if scheme == "gs" else None
    if said:
        return said
    if "TLS certificate is not trusted" in text:
        return f"{text}: add its CA to this host's trust store; for an emulator's self-signed certificate, start it " \
               "with plain HTTP (fake-gcs-server -scheme http) or set dataset.storage_options: {client_options: " \
               "{allow_invalid_certificates: true}}"
    if "HTTP request to an HTTPS server" in text:
        return f"{text}: the endpoint speaks HTTPS: write its URL https://... (STORAGE_EMULATOR_HOST too), or start " \
               "the emulator with plain HTTP (fake-gcs-server -scheme http)"
    said = gcs.answer(text)  # not the URL, key or time: an object of a bucket named "...bucket..." was "no such bucket"
    if re.search(r"\b403\b", said) or e.errno == errno.EACCES:
        return "access denied (403): check the key pair (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) and its policy"
    if "NoSuchBucket" in said or "bucket does not exist" in said.lower() or (
            e.errno == errno.ENOENT and scheme == "s3" and "list request" in said):  # a prefix lists empty, not 404
        return "no such bucket (404)"
    if e.errno == errno.ENOENT:
        return "not found (404)"
    return text
