"""The daemon's segmentations on their own (no processes): keys of a resumed epoch, and ranks that
disagree on where it resumes."""

from __future__ import annotations

from prefetchd.core.planner import Limits, Planner
from prefetchd.core.sampler import Sampler
from prefetchd.daemon.segments import Segments, disagreements
from prefetchd.daemon.sessions import Sessions
from prefetchd.format.progress import Progress

FP = "00112233aabbccdd"


def make(world=3):
    sampler = Sampler(48, 4, seed=7, world_size=world)  # 16 per rank: 4 batches per whole epoch
    sessions = Sessions(range(world), sampler.batches_per_epoch, FP)
    planner = Planner(range(world), sampler.batches_per_epoch, 3, Limits(4, 4, 1 << 40, 0), lambda k: 1)
    return Segments(sampler, range(world), FP, sessions, planner), planner


def rec(r, epoch, batch, offset=0, fp=FP):
    return Progress(rank=r, epoch=epoch, batch=batch, offset=offset, fingerprint=fp, session=f"s{r}")


def test_a_resumed_epoch_is_the_last_batches_of_its_planner_range():
    seg, planner = make()
    evicted = []
    seg.apply({r: rec(r, 0, 0, offset=20) for r in range(3)}, 0.0, True, evicted.append)
    # 28 samples left: 10 per rank with padding, 2 batches of 4; planner batches 2 and 3 of epoch 0
    assert planner.position(0) == (0, 2)
    assert seg.real((0, 0, 2)) == (0, 0, 0, 20) and seg.file_key((0, 0, 3)) == (0, 0, 1, 20)
    assert seg.real((0, 1, 0)) == (0, 1, 0, 0) and seg.file_key((0, 1, 0)) == (0, 1, 0)  # then whole epochs
    assert seg.planner_key(0, 0, 1, 20) == ((0, 0, 3), True)
    assert seg.planner_key(0, 0, 1, 0) == ((0, 0, 1), False)  # a whole epoch 0's batch: stale here
    t = seg.task((1, 0, 3), (), 0)
    assert (t.batch, t.offset, t.batches_in_epoch) == (1, 20, 2)
    assert t.indices.tolist() == Sampler(48, 4, seed=7, world_size=3).batch_indices(0, 1, 1, 20).tolist()
    assert not evicted and seg.conflict is None


def test_disagreeing_ranks_are_held_until_they_agree_and_nothing_is_evicted():
    seg, planner = make()
    evicted = []
    seg.apply({r: rec(r, 0, 0, offset=20) for r in range(3)}, 0.0, True, evicted.append)
    made = planner.plan(100, 0.0, 1 << 40).submit
    for k in made:
        planner.finished(k)
        planner.published(k, 1)
    seg.apply({1: rec(1, 0, 0, offset=12)}, 1.0, False, evicted.append)
    assert seg.held == {0, 1, 2} and "rank 0 reads it from sample 20, rank 1 from sample 12" in seg.conflict
    assert planner.plan(100, 1.0, 1 << 40).submit == [] and not evicted
    assert seg.real((1, 0, 2)) == (1, 0, 0, 20)  # rank 1's record is not applied
    seg.apply({1: rec(1, 0, 0, offset=20)}, 2.0, False, evicted.append)  # agrees again
    assert seg.held == set() and seg.conflict is None and not evicted
    # a record of another job's stream (another fingerprint) never disagrees
    assert disagreements({0: rec(0, 0, 0, 20), 1: rec(1, 0, 0, 12, fp="ffff")}, FP) == {}
    # a rank resumed elsewhere (all ranks agree on it): its window is emptied under the old names
    names = []
    seg.apply({r: rec(r, 0, 0, offset=24) for r in range(3)}, 3.0, False, lambda k: names.append(seg.file_key(k)))
    assert sorted(n for n in names if len(n) == 4) == [(r, 0, b, 20) for r in range(3) for b in (0, 1)]
    assert all(n[1] == 1 for n in names if len(n) == 3)  # epoch 1's, in the emptied windows too
    assert seg.real((0, 0, 2)) == (0, 0, 0, 24) and planner.bytes_ready == 0
