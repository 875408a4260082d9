"""Reading a sample from the dataset's storage, telling a bad sample from a storage hiccup.

A sample is quarantined (replaced for good, ``quarantine.jsonl``) only for what is its own
fault. The rule, applied to every failed read:

* the dataset root cannot be read (gone: unmounted or renamed away; not a directory; no
  permission), or an archive the sample is in is not the one indexed (``StorageChanged``:
  replaced, rewritten in place or cut since; checked after every read, so no bytes of a changed
  archive reach a batch) -> ``StorageUnavailable``: no sample is blamed, the batch is made
  again once the storage is back (the daemon retries it every ``STORAGE_RETRY_S`` and says so
  once; a changed archive is back only when a restart has indexed it again);
* the read failed with an errno a network filesystem or a flaky disk gives for a moment
  (EIO, ESTALE, a timeout, ...) -> tried again after each pause of ``TRANSIENT_PAUSES_S``;
  only a sample that still fails while the root is readable is the sample's fault;
* the file is missing while the root is readable -> tried once more (the root may have just
  come back between the read and the look at the root), then the sample's fault; a bucket's 404
  while the root is gone too (the one object the dataset is deleted, its prefix emptied) is the
  storage's, as a local root gone;
* anything else (EACCES on the file, EISDIR, ...) -> the sample's fault at once; but a bucket's 403
  while the bucket root refuses too (a key that expired or was revoked mid-run; the ACL of the one
  object the dataset is), or while the look at the root fails (a 503, a reset: not an answer that
  asking again gets the same, a listing's 400 or 501), is the storage's:
  ``StorageUnavailable``, no sample blamed; a 403 while the
  root reads is tried once more (an ACL mended between the read, perhaps a read-ahead's of seconds
  before, and the look at the root), then the sample's fault.

Read timeouts that hang in the kernel are not seen here: ``workers.task_timeout_s`` kills the
worker, and a kill blames no sample (``pool``).
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Callable

from prefetchd.sources.base import StorageChanged

# errnos a storage hiccup gives for a moment (NFS, Lustre, a flaky disk or network)
TRANSIENT_ERRNOS = frozenset({errno.EIO, errno.ESTALE, errno.ETIMEDOUT, errno.ENOTCONN, errno.EHOSTDOWN,
                              errno.EHOSTUNREACH, errno.ECONNRESET, errno.EAGAIN, errno.ENOLINK})
TRANSIENT_PAUSES_S = (0.1, 0.5)  # pauses between the tries of a read that failed transiently
STORAGE_RETRY_S = 0.5  # a batch that met an unreadable root is tried again after this (not a back-off)
_MISSING = (errno.ENOENT, errno.ENOTDIR)


class StorageUnavailable(RuntimeError):
    """The dataset root cannot be read: no sample is to blame; make the batch again later."""


class SampleUnreadable(OSError):
    """The sample's own file cannot be read while the root can (``strerror`` says why)."""


def root_unreadable(root: str) -> str | None:
    """Why the dataset root (a folder, or an archive: ``dataset.root`` naming a tar) cannot be
    read now, or None if it can."""
    try:
        st = os.stat(root)
    except OSError as e:
        return e.strerror or str(e)
    if stat.S_ISREG(st.st_mode):
        return None if os.access(root, os.R_OK) else "permission denied"
    if not stat.S_ISDIR(st.st_mode):
        return "neither a directory nor an archive"
    if not os.access(root, os.R_OK | os.X_OK):
        return "permission denied"
    return None


def _bucket_refuses(root: str) -> str | None:
    """Why the bucket root refuses to be read now (or is gone), or None if a sample's 403 or 404 is its
    own object's (an ACL, an object deleted), as a local file's EACCES or ENOENT. A root that is a prefix is asked with a listing (a key expired or
    revoked: one request); a root that is one object (a train tar, one shard: it lists nothing under
    it) with a HEAD of that object, since its refusal refuses every sample."""
    from prefetchd.sources import objectstore

    store = objectstore.store_for(root)
    try:
        if store.first(root) is None:
            if not objectstore.split(root)[2]:  # the bucket's top emptied (a HEAD of no key asks the bucket: there)
                return "it lists no objects"
            store.head(root)  # one object; an empty prefix's 404: the root gone
    except OSError as e:
        if e.errno in (errno.EACCES, errno.ENOENT):
            return objectstore.words(e)
        if objectstore.permanent(e) or "status code: 501" in (e.strerror or ""):
            # a listing refused for good (a gateway without ListObjectsV2: 501; 400): asking again gets the
            # same answer, and a wait would never end; the root is taken as readable, as a look that answers
            return None
        # the look itself met a fault (a 503, a reset, the endpoint gone): whose the 403 or 404 is cannot
        # be told now, and a sample blamed is lost for the run; the batch waits until it can be told
        return f"asking it failed: {objectstore.fault_words(e)}"
    return None


def read_sample(read: Callable[[], bytes], root: str, sleep: Callable[[float], None] = time.sleep) -> bytes:
    """A sample's bytes, ``read()`` (``Index.read``: a file, or a member of an archive, under
    ``root``), by the rule of the module's docstring. Raises ``StorageUnavailable`` or
    ``SampleUnreadable``."""
    pauses = iter(TRANSIENT_PAUSES_S)
    retried = False  # a file missing, or a bucket's 403, while the root reads: tried once more
    while True:
        try:
            return read()
        except OSError as e:
            err = e
        bucket = "://" in root  # a bucket URL (sources/objectstore.py): nothing to stat
        why = None if bucket else root_unreadable(root)
        if why is not None:
            raise StorageUnavailable(f"the dataset root {root} is unreadable ({why})") from None
        if isinstance(err, StorageChanged):
            raise StorageUnavailable(err.strerror) from None
        if bucket and err.errno in (errno.EACCES, *_MISSING):
            refused = _bucket_refuses(root)  # the key's (expired, revoked), not the sample's: nothing is readable
            if refused is not None:
                raise StorageUnavailable(f"the dataset root {root} cannot be read now ({refused})") from None
        if bucket and err.errno not in (*_MISSING, errno.EACCES):
            # the store already retried it for up to two minutes: the bucket's outage, not the sample's (said as
            # what came back, not obstore's text: the request's URL, the server's XML cut short)
            from prefetchd.sources.objectstore import fault_words

            raise StorageUnavailable(f"the dataset root {root} cannot be read now ({fault_words(err)})") from None
        if err.errno in TRANSIENT_ERRNOS:
            pause = next(pauses, None)
            if pause is not None:
                sleep(pause)
                continue
            raise SampleUnreadable(err.errno, f"{err.strerror} (also when tried again after "
                                   f"{sum(TRANSIENT_PAUSES_S):.1f} s)") from None
        if (err.errno in _MISSING or (bucket and err.errno == errno.EACCES)) and not retried:
            retried = True
            continue
        raise SampleUnreadable(err.errno, err.strerror) from None
