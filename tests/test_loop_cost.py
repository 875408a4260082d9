"""What the daemon's main loop does per turn stays cheap (issue 18, node scale): inotify is read by
the loop itself, without a thread."""

from __future__ import annotations

import os
import select
import threading

from prefetchd.daemon.watcher import ProgressWatcher
from prefetchd.format import progress


def _readable(w: ProgressWatcher, timeout: float = 10.0) -> bool:
    return bool(select.select(w.waitables(), [], [], timeout)[0])


def test_a_replaced_progress_file_wakes_the_loop_through_the_inotify_descriptor_without_a_thread(tmp_path):
    woken = []
    threads = threading.active_count()
    w = ProgressWatcher(str(tmp_path), (0, 1), lambda: woken.append(1), use_inotify=True)
    w.start()
    try:
        assert w.mode == "inotify+polling" and len(w.waitables()) == 1
        assert threading.active_count() == threads  # nothing runs beside the loop
        assert not _readable(w, 0)
        progress.write(str(tmp_path), progress.Progress(1, 0, 3, session="s"))
        assert _readable(w)
        got = w.poll(full=False)  # only what inotify named: rank 1, read once
        assert list(got) == [1] and got[1].position == (0, 3)
        assert not _readable(w, 0) and w.poll(full=False) == {}
        (tmp_path / "junk").write_bytes(b"x")  # a stray name: counted, marks nothing
        assert _readable(w)
        assert w.poll(full=False) == {} and w._strays == 1
        os.unlink(tmp_path / progress.progress_name(1))  # a deletion is an event too
        assert _readable(w) and w.poll(full=False) == {} and w._stamps[1] is None
        assert woken == []  # the loop woke on the descriptor: no wake-up pipe written
    finally:
        w.stop()
    assert w.waitables() == []


def test_an_inotify_queue_overflow_reads_every_lane_again_and_a_flood_is_read_over_several_turns(tmp_path):
    with open("/proc/sys/fs/inotify/max_queued_events") as f:
        limit = int(f.read())
    w = ProgressWatcher(str(tmp_path), (0, 1), lambda: None, use_inotify=True)
    w.poll()
    w.start()
    try:
        for i in range(limit + 100):  # more events than the kernel queues: the rest are lost
            (tmp_path / f"junk-{i}").write_bytes(b"")
        progress.write(str(tmp_path), progress.Progress(1, 0, 5, session="s"))  # its event is lost
        turns, got = 0, {}
        while not got and turns < 50:
            got = w.poll(full=False)
            turns += 1
        assert list(got) == [1] and got[1].position == (0, 5)
        assert turns > 1  # a bounded read per turn: the flood took several
    finally:
        w.stop()
