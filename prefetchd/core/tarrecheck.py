"""An archive whose ctime alone moved since it was indexed: are its samples still where they were?

A chmod, a chown or a hard link moves an archive's ctime and nothing else; so does a rewrite in
place that puts its mtime back (``touch -d``, ``rsync --inplace -t``), which may move members.
The two cannot be told apart from the identity, so ``tarindex`` asks this module before it makes
the archive's batches wait for a restart: every sample of the archive still has, in the 512 bytes
right before its data, a valid regular-member header of its own name and size. Then each
indexed offset still reads that member, whatever else changed, and the worker reads on with the
new identity (``accept``, kept per process). One ``pread`` per sample: about 1,300 for an
ImageNet class tar, 1.28 M (seconds) for the train set as one tar.

Anything else (a header that is not one, another name or size, a member whose name the header
holds only in part because it is over 100 bytes, of which the first 90 must match) is not vouched
for: the archive's batches wait as for any change.

**Another node's copy** (a Ray actor's, ``tarindex.sizes_only``: its device, inode and times are
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

from prefetchd.core.indexbase import DatasetError, StorageChanged
from prefetchd.core.tarheaders import _REGULAR, BLOCK, _header, show

log = logging.getLogger("prefetchd.dataset")

_accepted: dict[tuple[str, tuple], tuple] = {}  # (path, identity indexed) -> the identity vouched for since


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
    indexed one and every sample is in place (``recheck``: as ``tarindex._check`` has it); else
    raise ``StorageChanged``: its batches wait."""
    indexed, misplaced_in = recheck
    why = f"{now[2]} bytes, not {indexed[2]}" if now[2] != indexed[2] else misplaced_in(fd)
    if why is not None:
        raise StorageChanged(errno.ESTALE, f"the archive {path}{StorageChanged.MARK} (this node's copy is not the one "
                             f"indexed: {why}): batches from it wait; make this node's copy the same")
    accept(path, indexed, now)
    log.info("the archive %s on this node: every sample's header is where the index has it: reading it", path)


def misplaced(fd: int, index, archive: int) -> str | None:
    """Why a sample of ``index``'s archive number ``archive`` (open as ``fd``) is not where it was
    indexed; None when every one is (see the module docstring)."""
    ids = index.archive_ids
    chosen = np.arange(len(index)) if ids is None else np.flatnonzero(ids == archive)
    inner = index.layout in ("tar", "tars")  # relpath is "<class>/<member>"; a flat tar's is the member
    for i in chosen:
        data = int(index.block[i]) * BLOCK
        hdr = os.pread(fd, BLOCK, data - BLOCK)
        want = os.fsencode(index.relpath(int(i)))
        if inner:
            want = want.partition(b"/")[2]
        if len(hdr) < BLOCK:
            return f"the header of {show(want)} is past the archive's end"
        try:
            name, kind, size = _header(hdr, "", data - BLOCK, None)
        except DatasetError:
            return f"no tar header right before the data of {show(want)}"
        name = b"/".join(p for p in name.split(b"/") if p and p != b".")
        if kind not in _REGULAR or size != int(index.size[i]):
            return f"the header before the data of {show(want)} is not that of a member of its size"
        if name != want and not (len(want) >= 100 and len(name) >= 90 and want.startswith(name[:90])):
            return f"the header before the data of {show(want)} names {show(name)}"
    return None
