from __future__ import annotations

import numpy as np
import pytest

from prefetchd.core.sampler import Blocks, Sampler, ValSampler


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


@pytest.mark.parametrize("n", [1, 2, 7, 10, 31, 64, 100, 257])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("batch", [1, 3, 8, 32])
def test_val_every_sample_exactly_once_across_ranks(n, world, batch):
    s = ValSampler(n, batch, world, pad=False)
    got = []
    for r in range(world):
        nb = s.batches(r)
        lens = [len(s.batch_indices(r, b)) for b in range(nb)]
        assert all(k == batch for k in lens[:-1])  # only the last batch may be partial
        assert sum(lens) == s.share(r)
        if nb:
            assert 1 <= lens[-1] <= batch  # the partial tail is kept, never dropped or padded
        got += [int(i) for b in range(nb) for i in s.batch_indices(r, b)]
        with pytest.raises(IndexError):
            s.batch_indices(r, nb)
    assert sorted(got) == list(range(n))  # exactly once: no padding, no drop
    shares = [s.share(r) for r in range(world)]
    assert max(shares) - min(shares) <= 1
    counts = [s.batches(r) for r in range(world)]
    assert max(counts) - min(counts) <= 1 and s.max_batches == max(counts)


def test_val_uneven_ranks_and_partial_last_batch():
    s = ValSampler(10, 4, world_size=3, pad=False)  # shares 4, 3, 3
    assert [s.share(r) for r in range(3)] == [4, 3, 3]
    assert s.batch_indices(0, 0).tolist() == [0, 3, 6, 9]
    assert s.batch_indices(1, 0).tolist() == [1, 4, 7]
    s = ValSampler(9, 2, world_size=2, pad=False)  # shares 5 and 4: 3 batches and 2 batches
    assert (s.batches(0), s.batches(1)) == (3, 2)
    assert s.batch_indices(0, 2).tolist() == [8]
    with pytest.raises(ValueError):
        s.batches(2)


@pytest.mark.parametrize("n", [1, 2, 7, 10, 31, 65, 100])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("batch", [1, 3, 32])
def test_val_padded_as_distributed_sampler_pads(n, world, batch):
    """The padded validation shares are DistributedSampler's (shuffle=False), sample for sample;
    every rank has the same batch count; the padding mask selects each sample exactly once."""
    torch = pytest.importorskip("torch")
    from torch.utils.data import DistributedSampler

    s = ValSampler(n, batch, world)
    once = []
    for r in range(world):
        theirs = list(DistributedSampler(range(n), num_replicas=world, rank=r, shuffle=False))
        mine = [int(i) for b in range(s.batches(r)) for i in s.batch_indices(r, b)]
        assert mine == theirs, r
        for b in range(s.batches(r)):
            pad = s.padding(r, b)
            assert pad.dtype == bool and pad.shape == s.batch_indices(r, b).shape
            once += s.batch_indices(r, b)[~pad].tolist()
    assert sorted(once) == list(range(n))
    assert len({s.batches(r) for r in range(world)}) == 1
    assert torch is not None


def test_val_65_on_2_ranks_at_32_gives_both_ranks_2_batches():
    s = ValSampler(65, 32, 2)
    assert (s.batches(0), s.batches(1)) == (2, 2)
    assert s.batch_indices(1, 1).tolist() == [65 % 65] and s.padding(1, 1).tolist() == [True]
    assert not s.padding(0, 1).any() and not ValSampler(65, 32, 2, pad=False).padding(1, 0).any()
    assert (ValSampler(65, 32, 2, pad=False).batches(0), ValSampler(65, 32, 2, pad=False).batches(1)) == (2, 1)


def _global_order(s: Sampler, epoch: int, offset: int) -> list[list[int]]:
    """Per global step, the samples the ranks read, in the order of their positions in the
    epoch's permutation (sample k of rank r's batch is at ``r + world * k`` of the step's)."""
    return [[i for row in zip(*(s.batch_indices(epoch, r, b, offset).tolist() for r in range(s.world_size)), strict=True)
             for i in row] for b in range(s.batches_in(offset))]


@pytest.mark.parametrize("n, world, batch, drop_last", [(103, 4, 8, False), (103, 4, 8, True), (7, 3, 2, False),
                                                         (48, 3, 4, True), (1000, 8, 32, True)])
@pytest.mark.parametrize("offset", [0, 1, 5, 20])
def test_a_resumed_segment_shares_the_remainder_as_a_whole_epoch_is_shared(n, world, batch, drop_last, offset):
    offset = min(offset, n - 1)
    s = Sampler(n, batch, seed=5, world_size=world, drop_last=drop_last)
    rest = s.permutation(3)[offset:].tolist()
    shares = [s.rank_indices(3, r, offset) for r in range(world)]
    assert all(len(x) == s.share(offset) == -(-len(rest) // world) for x in shares)
    allidx = np.concatenate(shares).tolist()
    assert set(allidx) == set(rest)  # covers what was not consumed, and nothing that was
    padding = s.share(offset) * world - len(rest)
    assert len(allidx) - len(set(allidx)) == padding  # disjoint up to the padding
    padded = np.resize(np.array(rest), s.share(offset) * world).tolist()  # the remainder wrapped round
    assert sorted(allidx) == sorted(padded)
    for r in range(world):
        got = np.concatenate([s.batch_indices(3, r, b, offset) for b in range(s.batches_in(offset))] or [[]])
        expect = shares[r][: s.batches_in(offset) * batch] if drop_last else shares[r]
        assert np.array_equal(got, expect)
        assert [s.batch_len(b, offset) for b in range(s.batches_in(offset))] == [
            len(s.batch_indices(3, r, b, offset)) for b in range(s.batches_in(offset))]
    with pytest.raises(IndexError, match="resumed from sample" if offset else "epoch's"):
        s.batch_indices(3, 0, s.batches_in(offset), offset)


def test_offset_zero_is_the_ordinary_epoch():
    s = Sampler(103, 8, seed=5, world_size=4, drop_last=False)
    assert s.batches_in(0) == s.batches_per_epoch and s.share(0) == s.samples_per_rank
    for r in range(4):
        for b in range(s.batches_per_epoch):
            assert np.array_equal(s.batch_indices(3, r, b, 0), s.batch_indices(3, r, b))
    with pytest.raises(ValueError, match="offset 103 is outside"):
        s.batches_in(103)


def test_resume_at_2_then_3_then_1_reads_every_sample_once_but_the_drop_last_tail():
    # 1000 samples; world 2 x batch 10 for 7 steps, then world 3 x batch 8 for 9 steps, then one
    # rank x batch 16 to the end of the epoch (the batch size changes too: samples are the unit)
    n, epoch = 1000, 4
    a = Sampler(n, 10, seed=9, world_size=2)
    b = Sampler(n, 8, seed=9, world_size=3)
    c = Sampler(n, 16, seed=9, world_size=1)
    seen = [i for step in _global_order(a, epoch, 0)[:7] for i in step]
    e, off = b.resume(epoch, 0, 7, a.world_size, a.batch_size)
    assert (e, off) == (epoch, 140)
    seen += [i for step in _global_order(b, epoch, off)[:9] for i in step]
    e, off2 = c.resume(epoch, off, 9, b.world_size, b.batch_size)
    assert (e, off2) == (epoch, 140 + 9 * 24)
    seen += [i for step in _global_order(c, epoch, off2) for i in step]
    assert len(seen) == len(set(seen))  # no sample twice in the epoch
    missing = set(range(n)) - set(seen)
    assert len(missing) < c.world_size * c.batch_size  # only the drop_last tail of the last segment
    assert missing == set(a.permutation(epoch)[n - len(missing):].tolist())
    # the order is the epoch's permutation: a resumed job reads on where the first one stopped
    assert seen == a.permutation(epoch)[: len(seen)].tolist()


def test_resume_past_the_last_sample_is_the_next_epoch():
    s = Sampler(48, 6, world_size=2)
    assert s.resume(3, 0, 4, 2, 6) == (4, 0)  # 48 consumed
    assert s.resume(3, 40, 1, 4, 2) == (4, 0)
    assert s.resume(3, 40, 1, 3, 2) == (3, 46)


# --- loader.shuffle: block ------------------------------------------------------------------------


def _blocks(seed: int, n_blocks: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 9, n_blocks)


@pytest.mark.parametrize("n_blocks, window", [(1, 1), (7, 1), (7, 3), (40, 8), (40, 64)])
def test_a_block_shuffle_is_a_permutation_of_whole_blocks_a_window_at_a_time(n_blocks, window):
    sizes = _blocks(n_blocks, n_blocks)
    n = int(sizes.sum())
    block_of = np.repeat(np.arange(n_blocks), sizes)
    s = Sampler(n, 4, seed=3, shuffle="block", blocks=Blocks(sizes, window))
    for epoch in range(3):
        perm = s.permutation(epoch)
        assert sorted(perm.tolist()) == list(range(n))
        assert np.array_equal(perm, Sampler(n, 4, seed=3, shuffle="block", blocks=Blocks(sizes, window)).permutation(epoch))
        seen_blocks: set = set()
        members: set = set()
        count = 0
        for i in perm:  # each window: the samples of `window` whole blocks (fewer at the end), none seen before
            b = int(block_of[i])
            assert b not in seen_blocks, (epoch, b)
            members.add(b)
            count += 1
            assert len(members) <= window
            if count == int(sizes[sorted(members)].sum()) and (len(members) == window
                                                              or len(seen_blocks) + len(members) == n_blocks):
                seen_blocks |= members
                members, count = set(), 0
        assert not members
        assert seen_blocks == set(range(n_blocks))
    assert not np.array_equal(s.permutation(0), s.permutation(1)) or n_blocks == 1 and sizes[0] == 1


def test_a_block_shuffle_mixes_within_windows_and_moves_blocks_between_epochs():
    sizes = np.full(50, 20)
    s = Sampler(1000, 10, seed=1, shuffle="block", blocks=Blocks(sizes, 5))
    firsts = [int(s.permutation(e)[0]) // 20 for e in range(60)]
    assert len(set(firsts)) > 25  # the first block varies with the epoch
    perm = s.permutation(0)
    window = perm[:100]  # 5 blocks of 20: their 100 samples in a random order, not block by block
    runs = int(np.sum(window[1:] // 20 != window[:-1] // 20))
    assert runs > 50, runs


def test_block_shuffle_needs_blocks_and_is_in_the_stream_fingerprint():
    from prefetchd.core.config import Config, ConfigError, DatasetConfig, LoaderConfig
    from prefetchd.core.sampler import for_loader

    with pytest.raises(ConfigError, match=r"^loader.shuffle block needs a layout read in blocks .* imagefolder"):
        for_loader(LoaderConfig(shuffle="block"), 10, None, "imagefolder")
    assert for_loader(LoaderConfig(batch_size=2, shuffle="block", shuffle_window=2), 10, [4, 6]).blocks == Blocks([4, 6], 2)
    assert for_loader(LoaderConfig(batch_size=2), 10, [4, 6]).blocks is None
    with pytest.raises(ConfigError, match=r"^loader.shuffle must be true, false or block"):
        LoaderConfig(shuffle="blocks")
    values = [Config(dataset=DatasetConfig(root="/d"), loader=LoaderConfig(**kw)).stream_fingerprint()
              for kw in ({}, {"shuffle_window": 8}, {"shuffle": "block"}, {"shuffle": "block", "shuffle_window": 4})]
    assert values[0] == values[1] and len(set(values)) == 3  # the window counts only for a block shuffle


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_shuffle_window_without_a_block_shuffle_is_refused(shuffle):
    """``loader.shuffle_window: 4`` beside ``shuffle: true`` (or false) was accepted and did
    nothing: the full shuffle has no window, and no row groups are kept for one."""
    from prefetchd.core.config import ConfigError, LoaderConfig

    with pytest.raises(ConfigError) as e:
        LoaderConfig(shuffle=shuffle, shuffle_window=4)
    assert str(e.value) == (f"loader.shuffle_window (4) is the window of loader.shuffle: block, and loader.shuffle is "
                            f"{str(shuffle).lower()}: set shuffle: block (Parquet) or remove shuffle_window")


def test_a_block_shuffle_of_single_row_groups_is_made_in_well_under_a_second():
    """Row groups of one row (a writer's row_group_size=1), ImageNet's 1.28 M of them, window 1:
    the permutation took 2.9 s here (a Python call per one-sample window), in the daemon's loop
    at every epoch; the windows that draw nothing are skipped, and the permutation is the one the
    plain loop over every window makes (numpy's shuffle of one element draws nothing)."""
    import time

    from prefetchd.core.sampler import _block_permutation

    rng = np.random.default_rng(8)
    for _ in range(30):  # the same permutation as shuffling every window, one-sample ones too
        b = Blocks(rng.integers(1, 4, int(rng.integers(1, 40))), int(rng.integers(1, 5)))
        want = np.random.Generator(np.random.PCG64(np.random.SeedSequence([0x5045524D, 0x424C4F43, 3, 1])))
        order = want.permutation(len(b.sizes))
        starts = np.concatenate(([0], np.cumsum(b.sizes)[:-1]))
        perm = np.concatenate([np.arange(starts[k], starts[k] + b.sizes[k]) for k in order])
        lens = b.sizes[order]
        bounds = np.concatenate(([0], np.cumsum(lens)[b.window - 1::b.window]))
        bounds = bounds if bounds[-1] == b.total else np.append(bounds, b.total)
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            want.shuffle(perm[lo:hi])
        assert np.array_equal(_block_permutation(b, 3, 1), perm)
    t0 = time.process_time()  # this process's CPU (0.3 s; 2.9 s when every one-row window drew), not the machine's load
    perm = _block_permutation(Blocks(np.ones(1_281_167, np.int64), 1), 0, 0)
    assert time.process_time() - t0 < 1.5 and len(perm) == 1_281_167


def test_a_block_shuffled_epoch_resumed_at_random_world_and_batch_sizes_reads_every_row():
    """A seeded walk: a block shuffle (group sizes 1 to 6, windows from 1 to past the group
    count), k steps at W x B, the rest at W' x B': the permutation is the same whatever the
    world and batch size, every row is read, and a row is read twice only as the padding of the
    resumed remainder (fewer than W' repeats)."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        sizes = rng.integers(1, 7, int(rng.integers(1, 30)))
        n, window = int(sizes.sum()), int(rng.choice([1, 2, 3, len(sizes), len(sizes) + 5, 1 << 20]))
        seed, epoch = int(rng.integers(0, 2**63 - 1)), int(rng.integers(0, 2**40))
        world, batch = int(rng.integers(1, 5)), int(rng.integers(1, 5))
        s = Sampler(n, batch, seed, "block", False, world, Blocks(sizes, window))
        perm = s.permutation(epoch)
        assert sorted(perm.tolist()) == list(range(n))
        assert np.array_equal(perm, Sampler(n, batch + 1, seed, "block", True, 1, Blocks(list(sizes), window))
                              .permutation(epoch))
        k = int(rng.integers(0, s.batches_in(0) + 1))
        read = [i for r in range(world) for b in range(k) for i in s.batch_indices(epoch, r, b).tolist()]
        e, offset = s.resume(epoch, 0, k, world, batch)
        if e != epoch:
            continue
        world2, batch2 = int(rng.integers(1, 5)), int(rng.integers(1, 5))
        s2 = Sampler(n, batch2, seed, "block", False, world2, Blocks(sizes, window))
        rest = [i for r in range(world2) for b in range(s2.batches_in(offset))
                for i in s2.batch_indices(epoch, r, b, offset).tolist()]
        assert set(read) | set(rest) == set(range(n)) and not set(read) & set(rest)
        assert len(rest) - len(set(rest)) < world2
