"""A step of the wall clock (NTP at a VM's boot, ``date -s``) under the daemon (FIRST-CONTACT's
clocks): a rank's progress age and the production and consumption rates are measured on the
monotonic clock. Before, a step forward of an hour said every rank "no progress for 3600 s" (a
warning each, and the stalled-rank metric), a step back hid a stalled rank for an hour, and the
rate window kept an hour of "future" batches, summed at every status record."""

from __future__ import annotations

import os

import pytest

from prefetchd.daemon.report import RateWindow
from prefetchd.daemon.stalls import StallWatch


def test_a_step_of_the_wall_clock_stalls_no_rank_and_hides_none(caplog):
    mono = [500.0]
    w = StallWatch(after_s=30, clock=lambda: mono[0])
    me = os.getpid()
    with caplog.at_level("INFO", logger="prefetchd"):
        assert w.check(0, 1000.0, 999.5, me, False, True) is None
        mono[0] += 1.0
        assert w.check(0, 1000.0 + 3600 + 1, 999.5, me, False, True) is None  # stepped an hour forward
        assert w.age(0, 1000.0 + 3600 + 1, 999.5) == pytest.approx(1.5)
        mono[0] += 1.0
        assert w.check(0, 1002.0 - 3600, 999.5, me, False, True) is None  # and back two hours
        mono[0] += 29.0
        st = w.check(0, 1031.0 - 3600, 999.5, me, False, True)  # 31.5 s without a record: stalled all the same
        assert st is not None and st["age_s"] == pytest.approx(31.5) and st["since"] == 999.5
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith("rank 0: no progress for 32 s"), said


def test_the_rate_window_is_timed_on_the_monotonic_clock():
    t = [100.0]
    r = RateWindow(clock=lambda: t[0])
    for _ in range(20):
        t[0] += 1.0
        r.add(60)
    t[0] += 0.5
    assert r.per_s() == pytest.approx(60.0)  # 10 s of 60 images a second
    t[0] += 11.0
    assert r.per_s() == 0.0 and not r._dq
