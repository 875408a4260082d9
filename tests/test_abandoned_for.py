"""Ctrl-C in a notebook, then the cell run again (FIRST-CONTACT's habits): the interrupted ``for``
is not closed (the traceback keeps its frame, so its generator and its loader, alive), and a new
loader of the same rank is made in the same process. The old loader's reader thread, still
reading ahead, and the old generator's clean-up, run when the garbage collector gets to it, must
not report the old loader's position: the daemon would move the rank back there, away from the
batches the new loader waits for, and the trainer would time out."""

from __future__ import annotations

import os
import queue
import signal
import threading

import pytest
from conftest import small_config
from prefetchd_client import PrefetchClient
from prefetchd_client.common import _Stopped

from prefetchd.format import progress


def test_an_interrupted_loader_in_the_same_process_does_not_move_the_rank_back(tmp_path, image_root,
                                                                               daemon_factory):
    cfg = small_config(tmp_path, image_root, loader={"epochs": 3})
    d = daemon_factory(cfg)
    old = PrefetchClient(cfg, timeout=5, as_numpy=True)
    it = iter(old)
    for _ in range(2):
        next(it)  # KeyboardInterrupt in the loop's body: `it` is left suspended, its reader reading ahead
    with PrefetchClient(cfg, timeout=5, as_numpy=True) as new:  # the cell run again: a new loader
        new.seek(1, 0)
        got = []
        for i, _ in enumerate(new):
            got.append((new.last_batch.epoch, new.last_batch.batch))
            if i == 1:  # the new reader waits for a batch the daemon is about to make...
                os.killpg(d.pid, signal.SIGSTOP)
                try:
                    threading.Event().wait(1.0)
                    it.close()  # ...when the garbage collector finalizes the old generator
                    threading.Event().wait(0.3)
                finally:
                    os.killpg(d.pid, signal.SIGCONT)
        assert got == [(1, b) for b in range(8)], got
    old.close()
    assert "jumped back" not in d.log(), d.log()
    assert d.stop() == 0


def test_a_loader_another_took_the_rank_from_reports_nothing_until_it_moves_again(tmp_path, image_root,
                                                                                 daemon_factory):
    cfg = small_config(tmp_path, image_root, loader={"epochs": 3})
    d = daemon_factory(cfg)
    with PrefetchClient(cfg, timeout=30, as_numpy=True) as old, PrefetchClient(cfg, timeout=30, as_numpy=True) as new:
        old.seek(0, 2)
        new.seek(1, 0)  # the new loader moves last: the rank is its
        path = progress.progress_path(new.progress_dir, 0)
        mine = progress.read(path)
        stop = threading.Event()
        with pytest.raises(_Stopped):
            old._write_progress(0, 5, reader=stop)  # the old reader's report of a batch read ahead
        assert stop.is_set()  # and that reader stops
        old._write_progress(0, 2, take=False)  # the old for's clean-up, when the collector gets to it
        assert progress.read(path) == mine
        old.seek(0, 3)  # the old loader used again: it moves, the rank is its
        assert progress.read(path).position == (0, 3)
    assert d.stop() == 0


def test_a_left_behind_readers_report_in_flight_never_lands_after_the_new_loaders_move(
        tmp_path, image_root, daemon_factory, monkeypatch):
    """The old reader looked and saw the lane still its own, then wrote: between the two, the new
    loader took the lane and wrote its seek. Each client's own lock does not order them; the old
    write landed last and the daemon moved the rank back (CI: 'rank 0 jumped back from epoch 1
    batch 0 to epoch 0 batch 4'). The look and the write are one step for the lane now."""
    cfg = small_config(tmp_path, image_root, loader={"epochs": 3})
    d = daemon_factory(cfg)
    real, paused, moved, landed = progress.write, threading.Event(), threading.Event(), threading.Event()

    def slow(directory, p):  # the old reader's report of a batch read ahead, held between its look and its write
        if p.epoch == 0 and p.batch >= 2 and threading.current_thread() is not threading.main_thread() \
                and not paused.is_set():
            paused.set()
            moved.wait(3.0)  # until the new loader's seek is written; with the lane's lock, the seek waits instead
            try:
                return real(directory, p)
            finally:
                landed.set()
        return real(directory, p)

    # before the first batch, however far the reader has read ahead by the time it is handed over
    monkeypatch.setattr(progress, "write", slow)
    old = PrefetchClient(cfg, timeout=30, as_numpy=True)
    it = iter(old)
    next(it)
    assert paused.wait(30), "the old reader reported no batch read ahead"
    with PrefetchClient(cfg, timeout=30, as_numpy=True) as new:
        new.seek(1, 0)  # while the old report is held
        moved.set()
        assert landed.wait(10)  # the old report's write has ended either way
        on_disk = progress.read(progress.progress_path(new.progress_dir, 0))
        assert on_disk.epoch == 1 and on_disk.pid == os.getpid(), on_disk
    it.close()
    old.close()
    assert "jumped back" not in d.log(), d.log()
    assert d.stop() == 0


def test_a_batch_put_after_its_iteration_was_ended_is_never_handed_over(tmp_path, image_root, daemon_factory):
    """close() sets the reader's stop, drops what it read ahead and waits a while for its thread. A
    reader that looked at stop just before, slowed by a loaded machine past that wait, put its batch
    after the drop, and next() on the ended iteration handed that stale batch over instead of saying
    it was ended (CI, five test workers on two cores: 'DID NOT RAISE PrefetchError'). Here the late
    put is made by hand, after the newer iteration ended the old one."""
    from conftest import wait_until
    from prefetchd_client import PrefetchError

    cfg = small_config(tmp_path, image_root, loader={"epochs": 3})
    d = daemon_factory(cfg)
    with PrefetchClient(cfg, timeout=30, as_numpy=True) as c:
        it = iter(c)
        next(it)
        reader = c._reader
        wait_until(lambda: reader._q.qsize() > 0, 30, "a batch read ahead")
        late = reader._q.queue[0]
        newer = iter(c)  # a newer iteration of the same client ends the held one
        next(newer)
        assert reader.stop.is_set()
        try:  # the slow reader's put, landing after the drop
            reader._q.put_nowait(late)
        except queue.Full:  # the reader thread made one itself, just as in the race
            pass
        with pytest.raises(PrefetchError, match="ended by"):
            next(it)
        del newer
    assert d.stop() == 0
