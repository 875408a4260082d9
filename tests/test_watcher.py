"""The progress watcher's sources are watchdog's, without its threads: its inotify layer read by the
loop, and its directory snapshots diffed on the poll timer (the whole mechanism without inotify).

The unit tests here (all but the ``daemon`` ones) also run against the lowest and the newest
watchdog of pyproject's range (``tests/test_watchdog_range.py``)."""

from __future__ import annotations

import json
import os
import select
import threading
import time

import pytest

from prefetchd.daemon import watcher as watcher_mod
from prefetchd.daemon.watcher import ProgressWatcher
from prefetchd.format import progress


def _returns_within(fn, seconds: float = 5.0):
    """``fn()``, or a failure if it is still running after ``seconds`` (a read blocked on a FIFO)."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds} s"
    return out[0]


def _fifo(path) -> str:
    os.mkfifo(path)
    return str(path)


def test_watchdog_is_the_one_the_range_test_asked_for():
    import watchdog

    want = os.environ.get("PREFETCHD_TEST_WATCHDOG_DIR")
    if want:
        assert os.path.realpath(watchdog.__file__).startswith(os.path.realpath(want)), watchdog.__file__


def test_without_inotify_every_kind_of_change_is_seen_through_watchdogs_snapshot_diff(tmp_path):
    d = str(tmp_path)
    val0 = progress.lane("val", 0)
    w = ProgressWatcher(d, (0, 1, val0), lambda: None, use_inotify=False)
    w.start()
    assert w.mode == "polling" and w.waitables() == []
    assert w.poll() == {}
    progress.write(d, progress.Progress(0, 0, 3, session="s"))  # created
    assert {r: p.position for r, p in w.poll().items()} == {0: (0, 3)}
    assert w.poll() == {}  # nothing changed: nothing read
    progress.write(d, progress.Progress(0, 0, 4, session="s"))  # replaced (a new inode)
    progress.write(d, progress.Progress(val0, 0, 1, session="s"))  # a validation lane
    assert {r: p.position for r, p in w.poll().items()} == {0: (0, 4), val0: (0, 1)}
    p0 = os.path.join(d, progress.progress_name(0))
    ino = os.stat(p0).st_ino
    with open(p0, "r+b") as f:  # rewritten in place, the same inode
        f.write(progress.encode(progress.Progress(0, 0, 12345, session="s")))
    assert os.stat(p0).st_ino == ino
    assert {r: p.position for r, p in w.poll().items()} == {0: (0, 12345)}
    progress.write(d, progress.Progress(1, 1, 2, session="s"), )
    os.rename(os.path.join(d, progress.progress_name(1)), tmp_path / "aside")
    os.rename(tmp_path / "aside", os.path.join(d, progress.progress_name(1)))  # moved away and back
    assert {r: p.position for r, p in w.poll().items()} == {1: (1, 2)}
    os.unlink(p0)  # deleted: the last position is kept
    assert w.poll() == {} and w._stamps[0] is None and w.last[0].position == (0, 12345)
    progress.write(d, progress.Progress(0, 1, 0, session="s"))  # and created again
    assert {r: p.position for r, p in w.poll().items()} == {0: (1, 0)}
    assert w.poll(full=False) == {}  # between timers, only inotify marks (none here)


def test_the_snapshot_diff_decides_what_is_read_without_inotify(tmp_path, monkeypatch):
    """Not a stat of every lane beside it: a difference the snapshot does not show is not read."""
    d = str(tmp_path)
    w = ProgressWatcher(d, (0,), lambda: None, use_inotify=False)
    w.poll()

    class NoChange(watcher_mod.DirectorySnapshotDiff):
        def __init__(self, ref, snapshot, **kw):
            super().__init__(ref, ref, **kw)

    monkeypatch.setattr(watcher_mod, "DirectorySnapshotDiff", NoChange)
    progress.write(d, progress.Progress(0, 0, 3, session="s"))
    assert w.poll() == {}
    monkeypatch.undo()
    progress.write(d, progress.Progress(0, 0, 4, session="s"))
    assert w.poll()[0].position == (0, 4)


def test_a_snapshot_of_a_hostile_directory_looks_at_the_lanes_only_and_never_blocks(tmp_path, monkeypatch, caplog):
    d = str(tmp_path)
    for i in range(20_000):
        (tmp_path / f"junk-{i}").write_bytes(b"")
    for i in range(20):
        _fifo(tmp_path / f"fifo-{i}")
    _fifo(tmp_path / progress.progress_name(1))  # a FIFO where a lane's file should be
    os.symlink("/dev/zero", tmp_path / progress.progress_name(2))
    progress.write(d, progress.Progress(0, 0, 3, session="s"))
    w = ProgressWatcher(d, (0, 1, 2), lambda: None, use_inotify=False)
    looked: list[str] = []
    real_lstat = os.lstat

    def lstat(path, *a, **kw):
        looked.append(os.fsdecode(path))
        return real_lstat(path, *a, **kw)

    def no_listing(*a, **kw):
        raise AssertionError("the progress directory was listed")

    monkeypatch.setattr(os, "lstat", lstat)
    monkeypatch.setattr(os, "scandir", no_listing)
    monkeypatch.setattr(os, "listdir", no_listing)
    caplog.set_level("WARNING", logger="prefetchd.watcher")
    t = time.monotonic()
    got = _returns_within(w.poll)
    assert {r: p.position for r, p in got.items()} == {0: (0, 3)}
    # the directory, and per lane the snapshot's lstat, its stamp's and the refusing read's: not 20,040
    assert len(looked) <= 1 + 3 * 3
    looked.clear()
    assert _returns_within(w.poll) == {} and len(looked) == 1 + 3  # unchanged: the snapshot's lstats only
    assert time.monotonic() - t < 2
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2 and "a FIFO" in msgs[0] + msgs[1] and "symbolic link" in msgs[0] + msgs[1], msgs


def test_inotify_comes_from_watchdog_without_a_thread_and_gives_back_every_descriptor(tmp_path):
    from watchdog.observers.inotify_c import InotifyFD

    fds = set(os.listdir("/proc/self/fd"))
    threads = threading.active_count()
    w = ProgressWatcher(str(tmp_path), (0,), lambda: None, use_inotify=True)
    w.start()
    try:
        assert w.mode == "inotify+polling" and isinstance(w._inotify._ifd, InotifyFD)
        assert threading.active_count() == threads and not w._inotify._ifd.is_alive()
        fd = w.waitables()[0].fileno()
        assert not os.get_inheritable(fd) and not os.get_blocking(fd)
        assert w.poll(full=False) == {}  # not readable: returns at once, watchdog is not asked to read
        progress.write(str(tmp_path), progress.Progress(0, 0, 7, session="s"))
        assert select.select([fd], [], [], 10)[0]
        assert w.poll(full=False)[0].position == (0, 7)
    finally:
        w.stop()
    assert set(os.listdir("/proc/self/fd")) == fds  # the inotify descriptor and watchdog's wake-up pipe


def test_an_unwatchable_directory_falls_back_to_snapshots_with_one_line(tmp_path, caplog):
    caplog.set_level("WARNING", logger="prefetchd.watcher")
    w = ProgressWatcher(str(tmp_path / "missing"), (0,), lambda: None, use_inotify=True)
    w.start()
    assert w.mode == "polling" and w.waitables() == []
    assert [r.getMessage() for r in caplog.records] == [
        f"cannot watch {tmp_path / 'missing'} with inotify (No such file or directory); polling every interval instead"]
    assert w.poll() == {}


def test_a_platform_without_inotify_is_served_by_snapshots(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(watcher_mod, "Inotify", None)
    monkeypatch.setattr(watcher_mod, "_NO_INOTIFY", "UnsupportedLibcError: no inotify_init", raising=False)
    caplog.set_level("WARNING", logger="prefetchd.watcher")
    w = ProgressWatcher(str(tmp_path), (0,), lambda: None, use_inotify=True)
    w.start()
    assert w.mode == "polling" and "no inotify_init" in caplog.text
    progress.write(str(tmp_path), progress.Progress(0, 0, 1, session="s"))
    assert w.poll()[0].position == (0, 1)


def test_the_watch_ending_with_its_directory_leaves_snapshots_in_charge(tmp_path, caplog):
    d = tmp_path / "progress"
    d.mkdir()
    w = ProgressWatcher(str(d), (0,), lambda: None, use_inotify=True)
    w.start()
    caplog.set_level("WARNING", logger="prefetchd.watcher")
    d.rmdir()
    deadline = time.monotonic() + 10
    while w.mode != "polling" and time.monotonic() < deadline:
        select.select(w.waitables(), [], [], 0.1)
        w.poll(full=False)
    assert w.mode == "polling" and w.waitables() == []
    assert "the inotify watch on" in caplog.text
    d.mkdir()
    progress.write(str(d), progress.Progress(0, 0, 2, session="s"))
    assert w.poll()[0].position == (0, 2)


_SITE = """
import atexit, json, os, sys

def _dump():
    with open(os.path.join(os.environ["PREFETCHD_TEST_MODULES"], f"{os.getpid()}.json"), "w") as f:
        json.dump(sorted(sys.modules), f)

atexit.register(_dump)
"""


@pytest.mark.parametrize("use_inotify", [False, True], ids=["snapshots-only", "inotify"])
def test_the_daemon_watches_through_watchdog_and_sees_every_change(tmp_path, image_root, daemon_factory,
                                                                    use_inotify):
    from conftest import small_config, wait_until
    from test_daemon import published

    from prefetchd.format import status

    hook, mods = tmp_path / "hook", tmp_path / "modules"
    hook.mkdir()
    mods.mkdir()
    (hook / "sitecustomize.py").write_text(_SITE)
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH")) if p),
           "PREFETCHD_TEST_MODULES": str(mods)}
    cfg = small_config(tmp_path, image_root, loader={"epochs": None},
                       progress={"inotify": use_inotify, "poll_interval_s": 0.05})
    buf = str(tmp_path / "buffer")
    pdir = os.path.join(buf, "progress")
    d = daemon_factory(cfg, env=env)

    def st():
        return status.read_json(buf, status.STATUS_NAME) or {}

    def pos():
        return st().get("ranks", {}).get("0", {}).get("position")

    wait_until(lambda: len(published(buf)) == 4, 60, "a full buffer")
    assert st()["progress_watch"] == ("inotify+polling" if use_inotify else "polling")
    path = progress.progress_path(pdir, 0)
    for b in range(1, 6):  # each replace, one after the other
        progress.write(pdir, progress.Progress(rank=0, epoch=0, batch=b))
        wait_until(lambda b=b: pos() == [0, b], 20, f"position 0/{b}")
    ino = os.stat(path).st_ino
    with open(path, "wb") as f:  # rewritten in place (``cp`` over it): the same inode and size
        f.write(progress.encode(progress.Progress(rank=0, epoch=0, batch=7)))
    assert os.stat(path).st_ino == ino
    wait_until(lambda: pos() == [0, 7], 20, "position 0/7 (in place)")
    os.unlink(path)
    progress.write(pdir, progress.Progress(rank=0, epoch=1, batch=0))  # deleted and made again
    wait_until(lambda: pos() == [1, 0], 20, "position 1/0")
    assert d.stop() == 0
    with open(mods / f"{d.pid}.json") as f:
        loaded = set(json.load(f))
    assert {"watchdog.observers.inotify_c", "watchdog.utils.dirsnapshot"} <= loaded
