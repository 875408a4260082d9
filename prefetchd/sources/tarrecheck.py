"""An archive whose ctime alone moved since it was indexed: are its samples still where they were?

A chmod, a chown or a hard link moves an archive's ctime and nothing else; so does a rewrite in
place that puts its mtime back (``touch -d``, ``rsync --inplace -t``), which may move members.
The two cannot be told apart from the identity, so ``archive`` asks this module before it makes
the archive's batches wait for a restart: every sample of the archive still has, in the 512 bytes
right before its data, a valid regular-member header of its own name and size. Then each
indexed offset still reads that member, whatever else changed, and the worker reads on with the
new identity (``accept``, kept per process). One ``pread`` per sample: about 1,300 for an
ImageNet class tar, 1.28 M (seconds) for the train set as one tar.

A name the header holds only in part (over 100 bytes, or not ASCII in a PAX tar) is read whole
from the GNU long-name or PAX header right before it: names alike in their first 100 bytes are
common (``<long folder>/<long stem>_<n>.JPEG``), and one of them put in another's place at the
same size would be read under the wrong name. Anything else (a header that is not one, another
name or size, no extension header holding the whole name) is not vouched for: the archive's
batches wait as for any change.

**Another node's copy** (a Ray actor's, ``archive.sizes_only``: its device, inode and times are
its own, only the size was known) is checked the same way when a process first opens it
(``vouch_copy``): a copy re-packed in another order at the same size would otherwise be read at
the indexed offsets, other members' pixels under the indexed labels. Vouched for, it is then held
to its own full identity, as the daemon's node holds the indexed one.
"""

from __future__ import annotations

import errno
import logging
import os

import numpy as np

from prefetchd.sources.base import DatasetError, StorageChanged
from prefetchd.sources.tarheaders import (
    _REGULAR,
    BLOCK,
    _header,
    _pax_records,
    members,
    show,
    unique,
)

log = logging.getLogger("prefetchd.dataset")

_LOOK_BACK = 16  # data blocks of a long-name or PAX header looked for before a member's header (8 KiB)
_accepted: dict[tuple[str, tuple], tuple] = {}  # (path, identity indexed) -> the identity vouched for since
_refused: dict[tuple[str, tuple], tuple[tuple, str]] = {}  # (path, identity indexed) -> (identity refused, why)


def current(path: str, indexed: tuple) -> tuple:
    """The identity ``path`` is checked against: the one indexed, or the one vouched for since."""
    return _accepted.get((path, indexed), indexed)


def accept(path: str, indexed: tuple, now: tuple) -> None:
    _accepted[(path, indexed)] = now


def unverified_copy(identity: tuple) -> bool:
    """An identity with its inode and ctime unknown: another node's copy not vouched for yet."""
    return identity[1] == 0 and identity[4] == 0


def vouch_copy(fd: int, path: str, recheck: tuple, now: tuple) -> None:
    """Accept this node's copy ``path`` (open as ``fd``, its identity ``now``) if its size is the
    indexed one and every sample is in place (``recheck``: as ``archive._check`` has it); else
    raise ``StorageChanged``: its batches wait."""
    indexed, misplaced_in = recheck
    why = f"{now[2]} bytes, not {indexed[2]}" if now[2] != indexed[2] else judged(path, indexed, now,
                                                                                 lambda: misplaced_in(fd))
    if why is not None:
        raise StorageChanged(errno.ESTALE, f"the archive {path}{StorageChanged.MARK} (this node's copy is not the one "
                             f"indexed: {why}): batches from it wait; make this node's copy the same")
    log.info("the archive %s on this node: every sample's header is where the index has it: reading it", path)


def judged(path: str, indexed: tuple, now: tuple, check) -> str | None:
    """``check()`` (``misplaced``) for ``path`` as it is now (``now``), once per identity: a yes is
    ``accept``ed, a no kept, since a batch that waits is tried again every half second and the
    check of a train tar reads every header (seconds a try, in every worker)."""
    refused = _refused.get((path, indexed))
    if refused is not None and refused[0] == now:
        return refused[1]
    why = check()
    if why is None:
        accept(path, indexed, now)
    else:
        _refused[(path, indexed)] = (now, why)
    return why


def misplaced(fd: int, index, archive: int) -> str | None:
    """Why a sample of ``index``'s archive number ``archive`` (open as ``fd``) is not where it was
    indexed; None when every one is (see the module docstring)."""
    ids = index.archive_ids
    chosen = np.arange(len(index)) if ids is None else np.flatnonzero(ids == archive)
    inner = index.layout in ("tar", "tars")  # relpath is "<class>/<member>"; a flat tar's is the member
    shard = os.fsencode(index.archives[archive]) + b"/" if index.layout == "webdataset" else b""
    within = _class_tars(fd) if index.layout == "tar" else None
    if isinstance(within, str):
        return within
    for i in chosen:
        data = int(index.block[i]) * BLOCK
        hdr = os.pread(fd, BLOCK, data - BLOCK)
        want = os.fsencode(index.relpath(int(i)))
        if shard:  # a shard's sample is "<shard>/<member>"
            want = want[len(shard):]
        if inner:
            cls, _, want = want.partition(b"/")
            if within is not None:
                start, end = within.get(cls, (0, 0))
                if not start <= data - BLOCK < data + int(index.size[i]) <= end:
                    return f"{show(want)} is not inside {show(cls)}.tar, the class tar it was indexed in"
        if len(hdr) < BLOCK:
            return f"the header of {show(want)} is past the archive's end"
        try:
            name, kind, size = _header(hdr, "", data - BLOCK, None)
        except DatasetError:
            return f"no tar header right before the data of {show(want)}"
        if kind not in _REGULAR or size != int(index.size[i]):
            return f"the header before the data of {show(want)} is not that of a member of its size"
        if _normal(name) != want:
            whole = _whole_name(fd, data - BLOCK)
            if whole is None or _normal(whole) != want:
                return f"the header before the data of {show(want)} names {show(whole or name)}"
    return None


def _class_tars(fd: int) -> dict[bytes, tuple[int, int]] | str:
    """A tar of class tars' class tars: class -> (data start, end), one header read a class tar
    (members of one name in each class, all of one size, would pass for those of a class tar
    swapped with another of its size); why not, when its headers are no tar's now."""
    try:
        top = unique(members(fd, 0, os.fstat(fd).st_size, "", []), "", [])
    except DatasetError:
        return "its class tars' headers are no longer a tar's"
    return {n[:-4]: (p, p + s) for n, (p, s) in top.items() if n.lower().endswith(b".tar") and b"/" not in n}


def _normal(name: bytes) -> bytes:
    return b"/".join(p for p in name.split(b"/") if p and p != b".")


def _whole_name(fd: int, at: int) -> bytes | None:
    """The name that the GNU long-name or PAX header ending right before the member header at
    ``at`` gives that member; None when there is no such header (or it names none)."""
    start = max(0, at - (_LOOK_BACK + 1) * BLOCK)
    back = os.pread(fd, at - start, start)
    for k in range(1, len(back) // BLOCK):  # k blocks of its data, its header before them
        off = len(back) - (k + 1) * BLOCK
        hdr = back[off:off + BLOCK]
        if hdr[156:157] not in (b"L", b"x"):
            continue
        try:
            _, kind, size = _header(hdr, "", start + off, None)
        except DatasetError:
            continue
        if -(-size // BLOCK) != k:
            continue
        body = back[off + BLOCK:off + BLOCK + size]
        if kind == b"L":
            return body.split(b"\0", 1)[0]
        try:
            return _pax_records(body).get(b"path") or None
        except ValueError:
            return None
    return None
