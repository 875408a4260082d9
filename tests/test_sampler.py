from __future__ import annotations

import numpy as np
import pytest

from prefetchd.sampler import Sampler


@pytest.mark.parametrize("n, world, batch, drop_last", [(100, 1, 10, True), (103, 4, 8, False), (103, 4, 8, True),
                                                         (7, 3, 2, False), (1000, 8, 32, True)])
def test_ranks_are_disjoint_and_cover_the_dataset(n, world, batch, drop_last):
    s = Sampler(n, batch, seed=5, world_size=world, drop_last=drop_last)
    shares = [s.rank_indices(3, r) for r in range(world)]
    assert all(len(x) == s.samples_per_rank for x in shares)
    allidx = np.concatenate(shares)
    assert set(allidx.tolist()) == set(range(n))  # cover
    padding = s.samples_per_rank * world - n
    assert len(allidx) - len(set(allidx.tolist())) == padding  # disjoint up to the wrap-around padding
    for r in range(world):
        got = np.concatenate([s.batch_indices(3, r, b) for b in range(s.batches_per_epoch)])
        expect = shares[r][: s.batches_per_epoch * batch] if drop_last else shares[r]
        assert np.array_equal(got, expect)


def test_pure_function_of_seed_and_epoch():
    a = Sampler(500, 16, seed=1)
    b = Sampler(500, 16, seed=1)
    assert np.array_equal(a.batch_indices(2, 0, 5), b.batch_indices(2, 0, 5))
    assert not np.array_equal(a.permutation(2), a.permutation(3))
    assert not np.array_equal(a.permutation(2), Sampler(500, 16, seed=2).permutation(2))


def test_no_shuffle_is_identity_and_tail_batch_is_shorter():
    s = Sampler(10, 4, shuffle=False, drop_last=False)
    assert s.batches_per_epoch == 3 and s.batch_len(2) == 2
    assert s.batch_indices(0, 0, 2).tolist() == [8, 9]
    with pytest.raises(IndexError):
        s.batch_indices(0, 0, 3)


def test_matches_distributed_sampler_rule():
    # DistributedSampler: pad by wrapping to a multiple of world size, rank r takes [r::world]
    s = Sampler(10, 2, shuffle=False, world_size=4, drop_last=False)
    assert s.rank_indices(0, 1).tolist() == [1, 5, 9]
    assert s.rank_indices(0, 3).tolist() == [3, 7, 1]
