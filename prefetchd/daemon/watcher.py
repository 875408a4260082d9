"""Learning where each trainer is: the progress files, watched through watchdog, with inotify and
snapshots.

Both sources are watchdog's, used without its observer threads. inotify (``inotify.Inotify``:
watchdog's ``InotifyFD``, its descriptor among the loop's waitables, read by the loop itself) wakes
the daemon's loop as soon as a progress file is replaced. Every ``progress.poll_interval_s`` the
loop also takes a snapshot of the served lanes' files (``watchdog.utils.dirsnapshot``: one
``lstat`` per lane) and diffs it with the last one; that is the whole mechanism where inotify sees
nothing: a directory on NFS or another node's mount (inotify is accepted there, but events of
other clients never come), exhausted watches, ``progress.inotify: false``.
Events are coalesced: an event or a difference only marks a lane's file dirty, and each wake-up of
the loop reads each dirty file once, if its stamp (inode, mtime, size) changed since it was last
read. A file that cannot be parsed, for whatever reason, leaves the last good value in place and is
reported in one line, once per bad spell (until a good file is read), never raising into the loop.

Every trainer of the node can write the directory, so nothing found there may block or flood
the loop:

* the directory is never listed: the snapshot's listing is the served lanes' names
  (``DirectorySnapshot``'s ``listdir``), its ``stat`` is ``os.lstat``, so entries beside them
  (20,000 stray files, FIFOs, say) cost their inotify events and nothing else, and one warning per
  spell (``_STRAY_QUIET_S`` without such a change ends it); a wake-up looks up dirty lanes only
  (one ``lstat``, and one bounded read when it changed, per lane);
* a name that is not a regular file (a FIFO, a symlink to anything, a directory, a socket) is
  refused without anything waiting on it (``untrusted.read_regular``), with one warning per
  bad spell like bad content;
* the set of dirty names holds served lanes only, so events cannot grow it;
* a flood of events is read a bounded amount per turn of the loop (``inotify._READ_BYTES``);
  when the kernel's inotify queue overflows, marks are lost and every lane is read again at
  once (the snapshot on the poll timer would find the changes too).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from itertools import chain

from watchdog.utils.dirsnapshot import DirectorySnapshot, DirectorySnapshotDiff

from prefetchd.format import progress as progress_fmt

try:
    from prefetchd.daemon.inotify import Inotify
except Exception as e:  # no inotify here (watchdog raises UnsupportedLibcError): snapshots only
    Inotify, _NO_INOTIFY = None, f"{type(e).__name__}: {e}"

log = logging.getLogger("prefetchd.watcher")

_STRAY_QUIET_S = 30.0  # a spell of changes to names that are not progress files ends after this long without one


class ProgressWatcher:
    def __init__(self, directory: str, ranks: tuple[int, ...], wake: Callable[[], None], use_inotify: bool):
        self.dir = directory
        self.ranks = ranks
        self._wake = wake
        self._use_inotify = use_inotify
        self._inotify: Inotify | None = None
        self._stamps: dict[int, tuple | None] = {r: None for r in ranks}
        self._paths = {r: progress_fmt.progress_path(directory, r) for r in ranks}
        self._lane_of = {p: r for r, p in self._paths.items()}
        self._entries = tuple(_Entry(progress_fmt.progress_name(r)) for r in ranks)
        self._snap: DirectorySnapshot | None = None
        self._bad: dict[int, str] = {}
        self.last: dict[int, progress_fmt.Progress] = {}
        self.mode = "polling"
        self._dirty: set[int] = set()
        self._dirty_lock = threading.Lock()
        # changes to names that are no progress file of ours
        self._strays = 0
        self._stray_name = ""
        self._stray_last = 0.0
        self._stray_spell = False

    def start(self) -> None:
        if not self._use_inotify:
            return
        if Inotify is None:
            log.warning("cannot watch %s with inotify (%s); polling every interval instead", self.dir, _NO_INOTIFY)
            return
        try:
            self._inotify = Inotify(self.dir)
            self.mode = "inotify+polling"
        except OSError as e:  # no inotify (limits, filesystem, platform): polling still works
            log.warning("cannot watch %s with inotify (%s); polling every interval instead", self.dir, e.strerror)
            self._inotify = None

    def stop(self) -> None:
        if self._inotify is not None:
            self._inotify.close()
            self._inotify = None

    def waitables(self) -> list:
        """What the loop waits on besides its own: the inotify descriptor, readable on an event."""
        return [] if self._inotify is None else [self._inotify]

    def _mark(self, name: str) -> None:
        """A change to ``name`` seen by another thread: the lane is marked dirty and the loop woken."""
        if self._note(name):
            self._wake()

    def _note(self, name: str) -> bool:
        """Mark a served lane's name dirty (True), or count a change to anything else."""
        r = progress_fmt.parse_progress_name(name)
        if r is None or r not in self._stamps:
            # a client's temp file, and the users lock of launches sharing the daemon, are ours
            if not (name.startswith(".progress-") and name.endswith(".tmp")) and name and name != progress_fmt.USERS_NAME:
                self._strays += 1
                self._stray_name = name
                self._stray_last = time.monotonic()
            return False
        with self._dirty_lock:
            self._dirty.add(r)
        return True

    def _read_events(self) -> None:
        """Mark what inotify saw since the last poll (the loop woke on its descriptor)."""
        names, overflow = self._inotify.read()
        for name in names:  # a client's temp file (two of the three events of a progress write) is skipped first
            if not (name.startswith(".progress-") and name.endswith(".tmp")):
                self._note(name)
        if overflow:  # events were lost: every lane is read again now
            with self._dirty_lock:
                self._dirty.update(self.ranks)
        if self._inotify.gone:  # the directory was removed or unmounted: snapshots only from now on
            log.warning("the inotify watch on %s ended (the directory was removed or unmounted); "
                        "looking every progress.poll_interval_s instead", self.dir)
            self.stop()
            self.mode = "polling"

    def _lanes_only(self, _directory) -> tuple[_Entry, ...]:
        return self._entries

    def _snapshot_changes(self) -> set[int]:
        """The lanes whose file differs from the last snapshot's (created, deleted, replaced,
        modified, moved): watchdog's snapshot of the lanes' names alone, diffed with the last."""
        try:
            snap = DirectorySnapshot(self.dir, recursive=False, stat=os.lstat, listdir=self._lanes_only)
        except OSError:  # the directory itself is gone or unreachable: each lane says why below
            self._snap = None
            return set(self.ranks)
        prev, self._snap = self._snap, snap
        if prev is None:
            return set(self.ranks)
        diff = DirectorySnapshotDiff(prev, snap)
        paths = chain(diff.files_created, diff.files_deleted, diff.files_modified, diff.files_attrib,
                      diff.dirs_created, diff.dirs_deleted, diff.dirs_modified, diff.dirs_attrib,
                      *diff.files_moved, *diff.dirs_moved)
        return {self._lane_of[p] for p in paths if p in self._lane_of}

    def poll(self, full: bool = True) -> dict[int, progress_fmt.Progress]:
        """Progress records that changed since the last poll, by rank: those inotify said were
        touched, and when ``full`` those a new snapshot differs in."""
        if self._inotify is not None:
            self._read_events()
        with self._dirty_lock:
            dirty, self._dirty = self._dirty, set()
        if full:
            self._check_strays()
            dirty |= self._snapshot_changes()
        changed: dict[int, progress_fmt.Progress] = {}
        for r in (self.ranks if full else dirty):
            if r not in dirty:
                continue
            path = self._paths[r]
            try:
                st = os.lstat(path)  # a symlink's own stamp: it is refused, whatever it points to
                stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
            except FileNotFoundError:
                stamp = None
            except OSError as e:
                self._report(r, f"cannot stat {path}: {e.strerror}")
                continue
            if stamp == self._stamps[r]:
                continue
            self._stamps[r] = stamp
            if stamp is None:
                if r in self.last:
                    self._report(r, f"{path} was deleted; keeping the last position {self.last[r].position}")
                continue
            try:
                p = progress_fmt.read(path)
            except Exception as e:  # ProgressError; anything else is a bug, but must not stop the daemon
                why = str(e) if isinstance(e, progress_fmt.ProgressError) else f"{type(e).__name__}: {e}"
                self._report(r, f"ignoring {path}: {why}; keeping the last good position "
                                f"{self.last[r].position if r in self.last else 'none'}")
                continue
            if p.rank != r:
                self._report(r, f"ignoring {path}: it names rank {p.rank}")
                continue
            self._bad.pop(r, None)
            self.last[r] = p
            changed[r] = p
        return changed

    def _check_strays(self) -> None:
        n, self._strays = self._strays, 0
        if n and not self._stray_spell:
            log.warning("progress.dir %s: %d change(s) to entries that are not progress files of the ranks served here "
                        "(e.g. %r); they are ignored (a trainer writes only its progress-rNNNN.json and "
                        "progress-vNNNN.json there)", self.dir, n, self._stray_name)
            self._stray_spell = True
        elif self._stray_spell and not n and time.monotonic() - self._stray_last > _STRAY_QUIET_S:
            self._stray_spell = False

    def _report(self, rank: int, msg: str) -> None:
        # once per bad spell (a file rewritten badly many times a second must not flood the
        # journal); a good read clears it
        if rank not in self._bad:
            log.warning("%s", msg)
        self._bad[rank] = msg


class _Entry:
    """What ``DirectorySnapshot`` takes of an ``os.scandir`` entry: its name."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name
