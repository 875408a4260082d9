"""The planner on its own: no processes, no files, a clock passed in."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from prefetchd.core.planner import Limits, Planner, retry_delay_s

MB = 1 << 20
FREE = 1 << 40


def make(ranks=(0,), bpe=10, epochs=2, capacity=4, refill_at=4, max_bytes=1 << 40, min_free=0, est=MB):
    return Planner(ranks, bpe, epochs, Limits(capacity, refill_at, max_bytes, min_free), lambda b: est)


def run(p: Planner, keys, size=MB):
    """The loop's part: every submitted batch comes back made and is published."""
    for k in keys:
        assert p.finished(k)
        p.published(k, size)


def test_fills_the_window_in_order_and_stops_at_capacity():
    p = make(capacity=4)
    plan = p.plan(10, 0.0, FREE)
    assert plan.submit == [(0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 0, 3)]
    run(p, plan.submit)
    assert p.plan(10, 0.0, FREE).submit == []
    assert p.rank_status(0)["ahead"] == 4


def test_refills_only_below_the_watermark():
    p = make(capacity=4, refill_at=2)
    run(p, p.plan(10, 0.0, FREE).submit)
    assert p.set_position(0, 0, 1) == [(0, 0, 0)]  # 3 ahead >= refill_at 2: no refill yet
    assert p.plan(10, 0.0, FREE).submit == []
    assert p.set_position(0, 0, 3) == [(0, 0, 1), (0, 0, 2)]
    assert p.plan(10, 0.0, FREE).submit == [(0, 0, 4), (0, 0, 5), (0, 0, 6)]


def test_window_runs_across_the_epoch_boundary_and_stops_at_the_last_epoch():
    p = make(bpe=3, epochs=2, capacity=4)
    assert p.plan(10, 0.0, FREE).submit == [(0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0)]
    run(p, [(0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0)])
    p.set_position(0, 0, 3)  # a trainer may say "batch 3 of epoch 0": the same as epoch 1 batch 0
    assert p.position(0) == (1, 0)
    assert p.plan(10, 0.0, FREE).submit == [(0, 1, 1), (0, 1, 2)]  # nothing after the last epoch
    run(p, [(0, 1, 1), (0, 1, 2)])
    p.set_position(0, 2, 0)
    assert p.rank_status(0)["done"] and p.plan(10, 0.0, FREE).submit == []


def test_jump_back_evicts_what_lies_beyond_the_new_window_and_refills_from_there():
    p = make(bpe=100, capacity=4)
    p.set_position(0, 0, 50)
    run(p, p.plan(10, 0.0, FREE).submit)
    assert p.set_position(0, 0, 48) == [(0, 0, 52), (0, 0, 53)]
    assert p.plan(10, 0.0, FREE).submit == [(0, 0, 48), (0, 0, 49)]


def test_jump_forward_far_evicts_the_whole_old_window():
    p = make(bpe=1000, capacity=4)
    run(p, p.plan(10, 0.0, FREE).submit)
    assert sorted(p.set_position(0, 0, 500)) == [(0, 0, b) for b in range(4)]
    assert p.bytes_ready == 0
    assert p.plan(10, 0.0, FREE).submit[0] == (0, 0, 500)


def test_batches_made_after_leaving_the_window_are_thrown_away_and_their_bytes_freed():
    p = make(capacity=2, refill_at=2)
    sub = p.plan(10, 0.0, FREE).submit
    p.set_position(0, 0, 5)
    assert p.bytes_inflight == 2 * MB  # still being written somewhere
    assert not p.finished(sub[0]) and not p.finished(sub[1])
    assert p.bytes_inflight == 0


def test_fairness_emptiest_rank_first_and_a_full_rank_does_not_starve_others():
    p = make(ranks=range(4), bpe=100, capacity=3, refill_at=3)
    first = p.plan(4, 0.0, FREE).submit
    assert sorted(k[0] for k in first) == [0, 1, 2, 3]  # one each before anyone gets a second
    run(p, first)
    run(p, p.plan(100, 0.0, FREE).submit)
    # rank 0's trainer reads; the others are full and idle
    p.set_position(0, 0, 3)
    assert {k[0] for k in p.plan(100, 0.0, FREE).submit} == {0}


def test_many_ranks_under_max_bytes_share_it_evenly():
    ranks = range(64)
    p = make(ranks=ranks, bpe=10_000, epochs=None, capacity=1000, refill_at=1000, max_bytes=640 * MB)
    while True:
        plan = p.plan(8, 0.0, FREE)
        if not plan.submit:
            break
        run(p, plan.submit)
    assert plan.blocked.startswith("buffer.max_bytes")
    assert p.bytes_ready + p.bytes_inflight <= 640 * MB
    counts = [p.rank_status(r)["ready"] for r in ranks]
    assert min(counts) == max(counts) == 10
    # rank 5 reads 5 batches: it, the emptiest, gets the room they free
    p.set_position(5, 0, 5)
    got = []
    while (plan := p.plan(8, 0.0, FREE)).submit:
        got += plan.submit
        run(p, plan.submit)
    assert {k[0] for k in got} == {5} and len(got) == 5


def test_free_space_counts_in_flight_bytes_once():
    p = make(capacity=10, refill_at=10, min_free=10 * MB)
    assert len(p.plan(2, 0.0, free_bytes=13 * MB).submit) == 2  # 13 - 1 - 1 >= 10, the third would not fit
    # both batches are fully written: the free space already shows it; nothing to reserve twice
    assert p.plan(1, 0.0, free_bytes=11 * MB, temp_bytes=2 * MB).submit == [(0, 0, 2)]
    assert "min_free_bytes" in p.plan(1, 0.0, free_bytes=11 * MB, temp_bytes=2 * MB).blocked


def test_a_failed_batch_backs_off_alone_while_other_batches_and_ranks_go_on():
    p = make(ranks=(0, 1), capacity=3, refill_at=3)
    sub = p.plan(2, 0.0, FREE).submit
    assert sub == [(0, 0, 0), (1, 0, 0)]
    assert p.finished((0, 0, 0))
    assert p.failed((0, 0, 0), now=100.0) == retry_delay_s(1)
    run(p, [(1, 0, 0)])
    nxt = p.plan(10, 100.0, FREE).submit
    assert (0, 0, 0) not in nxt and (0, 0, 1) in nxt and (1, 0, 1) in nxt
    assert p.next_retry(100.0) == 100.0 + retry_delay_s(1)
    assert p.plan(10, 100.0 + retry_delay_s(1), FREE).submit == [(0, 0, 0)]
    p.finished((0, 0, 0))
    p.failed((0, 0, 0), now=200.0)  # second failure in a row: twice as long
    assert p.plan(10, 200.0 + retry_delay_s(1), FREE).submit == []
    assert p.plan(10, 200.0 + retry_delay_s(2), FREE).submit == [(0, 0, 0)]
    run(p, [(0, 0, 0)])
    assert p.failures == {}
    assert retry_delay_s(100) == pytest.approx(60.0)


def test_a_due_retry_is_no_reason_to_wake_the_loop():
    """A failed batch whose back-off has passed but that waits for a slot or room: the loop
    must not wait 0 s on it (it would spin); only future retry times count."""
    p = make(capacity=4, refill_at=4)
    k = p.plan(1, 0.0, FREE).submit[0]
    p.finished(k)
    p.failed(k, now=10.0)
    t = 10.0 + retry_delay_s(1)
    assert p.next_retry(10.0) == t
    assert p.next_retry(t) is None and p.next_retry(t + 5) is None


def test_a_failed_front_batch_is_not_starved_by_max_bytes():
    """The rank's later batches fill max_bytes while its first batch backs off; the trainer
    waits for that batch, so it goes out anyway, room made from the rank's farthest batch."""
    p = Planner((0,), 10, 2, Limits(4, 4, 3000, 0), lambda b: 1000)
    b0, *rest = p.plan(4, 0.0, FREE).submit
    assert b0 == (0, 0, 0) and p.finished(b0)
    p.failed(b0, now=0.0)
    run(p, rest, size=1000)
    assert p.plan(4, 0.5, FREE).submit == [(0, 0, 3)]  # b0 backs off; the cursor moves on
    run(p, [(0, 0, 3)], size=1000)  # b1-b3 ready: max_bytes is full
    plan = p.plan(4, 2.0, FREE)
    assert plan.submit == [b0] and plan.evictions == [(0, 0, 3)]
    assert p.bytes_ready + p.bytes_inflight <= 3000
    run(p, [b0], size=1000)
    p.set_position(0, 0, 1)
    assert p.plan(4, 3.0, FREE).submit == [(0, 0, 3)]  # the evicted batch is made again
    for t in (100.0, 1000.0):
        assert p.plan(4, t, FREE).submit == []


def test_a_failed_front_batch_is_exempt_from_max_bytes_when_nothing_of_its_rank_can_go():
    p = Planner((0, 1), 10, 2, Limits(2, 2, 3000, 0), lambda b: 1000)
    assert p.plan(4, 0.0, FREE).submit == [(0, 0, 0), (1, 0, 0), (0, 0, 1)]
    p.finished((0, 0, 0))
    p.failed((0, 0, 0), now=0.0)
    run(p, [(1, 0, 0)], size=1000)
    assert p.plan(4, 0.5, FREE).submit == [(1, 0, 1)]  # max_bytes now full: rank 0's b1 in flight, rank 1's two
    # rank 0's trainer waits for b0 (and in lockstep training rank 1's too): nothing would ever free room
    plan = p.plan(4, 2.0, FREE)
    assert plan.submit == [(0, 0, 0)] and plan.evictions == []
    assert p.bytes_ready + p.bytes_inflight == 4000  # over by that one batch, once


def test_fairness_counts_the_run_from_the_position_not_batches_behind_a_gap():
    p = make(ranks=(0, 1), bpe=100, capacity=4, refill_at=4)
    sub = p.plan(8, 0.0, FREE).submit
    for k in sub:
        p.finished(k)
        if k == (0, 0, 0):
            p.failed(k, now=0.0)
        elif k[0] == 0 or k[2] < 2:
            p.published(k, MB)
        else:
            p.lost(k)  # rank 1: two ready, two to make again
    plan = p.plan(1, 2.0, FREE)
    assert plan.submit == [(0, 0, 0)]  # rank 0 has nothing readable: it goes before rank 1


def test_a_lost_batch_is_made_again_at_once_before_later_ones():
    p = make(capacity=4, refill_at=4)
    sub = p.plan(2, 0.0, FREE).submit
    p.lost(sub[0])
    assert p.bytes_inflight == MB
    assert p.plan(1, 0.0, FREE).submit == [(0, 0, 0)]


def test_adopt_keeps_recovered_batches_inside_a_window_only():
    p = make(bpe=100, capacity=4)
    p.set_position(0, 0, 10)
    assert p.adopt((0, 0, 11), MB) and not p.adopt((0, 0, 9), MB) and not p.adopt((0, 0, 14), MB)
    assert not p.adopt((7, 0, 11), MB) and not p.adopt((0, 0, 11), MB)
    assert p.plan(10, 0.0, FREE).submit == [(0, 0, 10), (0, 0, 12), (0, 0, 13)]


def test_lowering_capacity_evicts_beyond_the_new_window():
    p = make(capacity=4, refill_at=4)
    run(p, p.plan(10, 0.0, FREE).submit)
    assert p.set_limits(Limits(2, 2, 1 << 40, 0)) == [(0, 0, 2), (0, 0, 3)]
    assert p.rank_status(0)["ready"] == 2


@pytest.mark.parametrize("trainers_wait", [False, True])
def test_random_walk_keeps_the_invariants(trainers_wait):
    """Random moves, results, failures and losses for many ranks: windows hold only wanted
    batches, bytes add up, nothing is in flight twice, and (liveness) a due gap at a rank's front
    is handed out within a few plans. ``trainers_wait``: a trainer reads only ready batches, as
    a real one does, so a gap at its front stops it until the gap is made."""
    rnd = random.Random(5)
    ranks = range(16)
    p = make(ranks=ranks, bpe=37, epochs=4, capacity=20, refill_at=10, max_bytes=200 * MB)
    inflight: list = []
    now = 0.0
    waiting: dict = {}  # rank -> (its due front gap, plans with a free slot since)
    for _ in range(5000):
        now += 0.1
        op = rnd.random()
        if op < 0.4:
            slots = rnd.randint(0, 6)
            plan = p.plan(slots, now, FREE)
            assert len(set(plan.submit)) == len(plan.submit)
            assert not set(plan.submit) & set(inflight)
            inflight += plan.submit
            for r, (g, n) in list(waiting.items()):
                waiting[r] = (g, n + (slots > 0))
        elif op < 0.75 and inflight:
            k = inflight.pop(rnd.randrange(len(inflight)))
            if p.finished(k):
                if rnd.random() < 0.05:
                    p.failed(k, now)
                else:
                    p.published(k, MB // 2)
        elif op < 0.8 and inflight:
            p.lost(inflight.pop(rnd.randrange(len(inflight))))
        else:
            r = rnd.choice(ranks)
            e, b = p.position(r)
            step = rnd.randint(1, 5)
            if trainers_wait:
                step = min(step, p.ready_ahead(r))
            g = e * 37 + b + (step if rnd.random() < 0.9 else -rnd.randint(1, 60))
            g = max(0, g)
            p.set_position(r, g // 37, g % 37)
        total = 0
        for r in ranks:
            s = p.ranks[r]
            lo, hi = s.pos, p.window_end(r)
            assert all(lo <= g < hi for g in s.ready) and all(lo <= g < hi for g in s.inflight)
            assert not set(s.ready) & set(s.inflight)
            assert all(p.linear(k[1], k[2]) in s.holes or p.linear(k[1], k[2]) in s.inflight
                       for k in p.failures if k[0] == r)  # no count left for a batch gone from the window
            total += sum(s.ready.values())
            front = min(s.holes) if s.holes else None
            if front is not None and s.holes[front] <= now and front - s.pos < 10:
                g0, n = waiting.get(r, (front, 0))
                waiting[r] = (front, n if g0 == front else 0)
                assert waiting[r][1] <= len(ranks), f"rank {r}'s gap at {front} is never handed out"
            else:
                waiting.pop(r, None)
        assert total == p.bytes_ready
        # an estimate is an upper bound; a gap at a front may go over max_bytes by one batch per rank
        assert p.bytes_ready + p.bytes_inflight <= 200 * MB + len(ranks) * MB


def test_pass_bounded_lanes_make_nothing_until_active_and_stop_at_the_pass_end():
    lens = {0: 3, 1: 2}  # uneven ranks: 3 and 2 batches per pass (linear positions use 3)
    p = Planner((0, 1), 3, None, Limits(8, 8, 1 << 40, 0), lambda k: MB, pass_len=lens.__getitem__)
    assert p.plan(10, 0.0, FREE).submit == []  # nobody reads: nothing is made
    p.set_active(1, True)
    plan = p.plan(10, 0.0, FREE)
    assert plan.submit == [(1, 0, 0), (1, 0, 1)]  # its pass only, not the next pass
    run(p, plan.submit)
    p.set_position(1, 0, 1)
    assert p.plan(10, 0.0, FREE).submit == []
    # the pass is done (or abandoned): what is left is evicted and nothing more is made
    assert p.set_active(1, False) == [(1, 0, 1)]
    assert p.bytes_ready == 0 and p.plan(10, 0.0, FREE).submit == []
    p.set_position(1, 1, 0)  # the next pass starts
    p.set_active(1, True)
    assert p.plan(10, 0.0, FREE).submit == [(1, 1, 0), (1, 1, 1)]
    assert p.rank_status(0)["active"] is False and p.rank_status(1)["active"] is True


def _fill(p: Planner, now: float = 0.0) -> None:
    while (plan := p.plan(100, now, FREE)).submit:
        run(p, plan.submit, size=1000)


def test_an_active_val_pass_gets_room_from_the_far_end_of_the_fullest_train_windows():
    """Train's windows fill max_bytes (the repro of issue 23); a val pass starts: train's budget
    leaves room for the lanes' next batches, taken from the far end of the fullest windows, never
    a rank's front; when the pass ends, train takes the bytes back."""
    train = Planner((0, 1), 100, None, Limits(6, 6, 10_000, 0), lambda k: 1000)
    val = Planner((9, 10), 5, None, Limits(4, 4, 10_000, 0), lambda k: 1000, pass_len=lambda r: 5)
    _fill(train)
    assert train.held == 10_000 and [train.rank_status(r)["ready"] for r in (0, 1)] == [5, 5]
    assert val.room_wanted() == 0  # no lane is read: nothing kept, train keeps everything
    val.set_active(9, True)
    val.set_active(10, True)
    assert val.room_wanted() == 2000  # each lane's next batch
    train.limits = replace(train.limits, others=val.room_wanted())
    gone = train.shrink(train.budget)
    assert sorted(gone) == [(0, 0, 4), (1, 0, 4)]  # one from each window's far end
    assert train.held == 8000 and train.plan(10, 0.0, FREE).submit == []  # and it does not remake them
    assert "train holds 7.8 KiB, validation 2.0 KiB, 0 B left" in train.plan(10, 0.0, FREE).blocked
    val.limits = replace(val.limits, others=train.held)
    sub = val.plan(10, 0.0, FREE).submit
    assert sorted(sub) == [(9, 0, 0), (10, 0, 0)]  # one each: progress, within max_bytes
    run(val, sub, size=1000)
    assert val.room_wanted() == 2000  # held: no more is kept
    # lane 9's trainer reads its batch: the room it frees goes to its next batch, not to train
    val.set_position(9, 0, 1)
    assert val.room_wanted() == 2000
    train.limits = replace(train.limits, others=val.room_wanted())
    assert train.shrink(train.budget) == [] and train.plan(10, 0.0, FREE).submit == []
    val.limits = replace(val.limits, others=train.held)
    assert val.plan(10, 0.0, FREE).submit == [(9, 0, 1)]
    # the pass ends: its lanes hold nothing, want nothing; train refills to max_bytes
    val.set_active(9, False)
    val.set_active(10, False)
    val.finished((9, 0, 1))
    assert val.room_wanted() == 0
    train.limits = replace(train.limits, others=0)
    assert sorted(train.plan(10, 0.0, FREE).submit) == [(0, 0, 4), (1, 0, 4)]


def test_val_room_keeps_the_workers_busy_within_capacity_and_the_pass():
    """room_wanted(workers): what each lane being read misses of its next ceil(workers / lanes)
    + 1 batches, within the val capacity and what is left of its pass; one each without workers."""
    val = Planner((9, 10), 5, None, Limits(4, 4, 1 << 40, 0), lambda k: 1000, pass_len=lambda r: 5)
    assert val.room_wanted(32) == 0  # no lane is read
    val.set_active(9, True)
    val.set_active(10, True)
    assert val.room_wanted() == 2000  # one each: progress
    assert val.room_wanted(2) == 4000  # ceil(2 / 2) + 1 = 2 each
    assert val.room_wanted(4) == 6000  # 3 each
    assert val.room_wanted(32) == 8000  # 17 each, but capacity 4
    sub = val.plan(3, 0.0, FREE).submit  # what it holds counts once, as held
    assert len(sub) == 3 and val.room_wanted(4) == 6000
    run(val, sub, size=1000)
    assert val.room_wanted(4) == 6000
    val.set_position(9, 0, 4)  # lane 9 is at its pass's last batch: nothing beyond it is wanted
    assert val.room_wanted(32) == val.held + 1000 * (1 + 4 - len(val.ranks[10].ready))
    val.set_active(9, False)
    val.set_active(10, False)
    assert val.room_wanted(32) == 0


def test_shrink_never_takes_a_ranks_front_batch_and_evens_the_windows():
    p = Planner((0, 1, 2), 100, None, Limits(8, 8, 1 << 40, 0), lambda k: 1000)
    p.set_position(1, 0, 10)
    p.set_position(2, 0, 20)
    for r, n in ((0, 6), (1, 2), (2, 1)):  # windows of 6, 2 and 1 ready batches
        pos = p.ranks[r].pos
        for g in range(pos, pos + n):
            p.adopt(p.key(r, g), 1000)
    gone = p.shrink(5000)
    assert sorted(gone) == [(0, 0, 2), (0, 0, 3), (0, 0, 4), (0, 0, 5)]  # the fullest window, from its far end
    assert p.held == 5000
    gone = p.shrink(0)  # asked for everything: the fronts stay
    assert sorted(gone) == [(0, 0, 1), (1, 0, 11)]
    assert [p.rank_status(r)["ahead"] for r in (0, 1, 2)] == [1, 1, 1]
    assert p.held == 3000 and p.shrink(0) == []


def test_val_blocked_messages_say_what_each_stream_holds_and_the_setting():
    val = Planner((9,), 5, None, Limits(4, 4, 3000, 0), lambda k: 1000, pass_len=lambda r: 5)
    val.set_active(9, True)
    val.limits = replace(val.limits, others=3000)  # train holds it all (what take_rest never allows)
    plan = val.plan(4, 0.0, FREE)
    assert plan.cause == "max_bytes"
    assert plan.blocked == ("buffer.max_bytes (2.9 KiB) reached: validation holds 0 B, train 2.9 KiB, 0 B left; "
                            "a validation batch needs 1000 B")
    tiny = Planner((9,), 5, None, Limits(4, 4, 500, 0), lambda k: 1000, pass_len=lambda r: 5)
    tiny.set_active(9, True)
    plan = tiny.plan(4, 0.0, FREE)
    assert plan.cause == "too_small"
    assert plan.blocked == "one validation batch needs 1000 B but buffer.max_bytes is 500 B; raise buffer.max_bytes"


def test_forget_empties_the_window_and_a_stale_result_never_counts_as_the_new_one():
    p = make(capacity=4)
    first = p.plan(2, 0.0, FREE).submit  # (0,0,0) and (0,0,1) in flight
    run(p, first[:1])  # (0,0,0) published
    assert p.forget(0) == [(0, 0, 0)]  # published: deleted; (0,0,1) in flight: an orphan
    assert p.bytes_ready == 0 and p.bytes_inflight == MB
    again = p.plan(10, 0.0, FREE).submit
    assert again == [(0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 0, 3)]  # made again for the new segmentation
    p.stale((0, 0, 1))  # the old (0,0,1) comes back: its bytes are released, the new one stays in flight
    assert p.is_inflight((0, 0, 1)) and p.bytes_inflight == 4 * MB
    run(p, again)
    assert p.bytes_inflight == 0 and p.rank_status(0)["ahead"] == 4


def test_a_stale_result_whose_key_came_back_into_the_window_is_made_again():
    p = make(capacity=4)
    p.plan(1, 0.0, FREE)  # (0,0,0) in flight
    p.forget(0)
    assert p.set_position(0, 0, 1) == [] and p.set_position(0, 0, 0) == []  # a jump back takes the orphan again
    assert p.is_inflight((0, 0, 0))
    p.stale((0, 0, 0))  # it was made for the old segmentation: a hole, due now
    assert not p.is_inflight((0, 0, 0)) and p.plan(1, 0.0, FREE).submit == [(0, 0, 0)]


def test_a_held_rank_keeps_its_batches_and_gets_no_new_ones():
    p = make(ranks=(0, 1), capacity=4)
    run(p, p.plan(3, 0.0, FREE).submit)
    p.hold(0, True)
    p.hold(1, True)
    assert p.plan(10, 0.0, FREE).submit == []
    assert p.bytes_ready == 3 * MB and p.rank_status(0)["held"]
    p.hold(1, False)
    assert {k[0] for k in p.plan(10, 0.0, FREE).submit} == {1}
    p.hold(0, False)
    assert p.plan(10, 0.0, FREE).submit  # rank 0 fills again
