"""The sampler: which samples make batch ``b`` of epoch ``e`` for rank ``r``. A pure function.

Per epoch, the dataset's ``n`` indices are permuted by a generator seeded from ``(seed, epoch)``
(identity when ``shuffle`` is off). As ``torch.utils.data.DistributedSampler`` does, the
permutation is padded by wrapping around to a multiple of ``world_size`` and rank ``r`` takes
every ``world_size``-th index starting at ``r``: the ranks' shares are disjoint (up to the
padding) and together cover the dataset. Each rank's share is then cut into batches of
``batch_size``; with ``drop_last`` the incomplete tail batch is dropped, otherwise it is shorter.

Nothing here depends on the worker count, timing or restarts, so the bytes of every batch are
reproducible from ``(seed, epoch, rank, batch)`` alone.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

# Domain-separation tags so permutation and augmentation streams never share a seed.
_PERM_TAG = 0x5045524D  # "PERM"


@dataclass(frozen=True)
class Sampler:
    num_samples: int
    batch_size: int
    seed: int = 0
    shuffle: bool = True
    drop_last: bool = True
    world_size: int = 1

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ValueError("the dataset has no samples")
        if self.world_size < 1 or self.batch_size < 1:
            raise ValueError("world_size and batch_size must be positive")

    @property
    def samples_per_rank(self) -> int:
        return -(-self.num_samples // self.world_size)

    @property
    def batches_per_epoch(self) -> int:
        n = self.samples_per_rank
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def batch_len(self, batch: int) -> int:
        self._check(batch)
        return min(self.batch_size, self.samples_per_rank - batch * self.batch_size)

    def permutation(self, epoch: int) -> np.ndarray:
        return _permutation(self.num_samples, self.seed, epoch, self.shuffle)

    def rank_indices(self, epoch: int, rank: int) -> np.ndarray:
        """This rank's share of the epoch, in order (a view for rank 0 of world size 1)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world_size {self.world_size}")
        perm = self.permutation(epoch)
        total = self.samples_per_rank * self.world_size
        if total > self.num_samples:
            perm = np.concatenate([perm, perm[: total - self.num_samples]])
        return perm[rank::self.world_size]

    def batch_indices(self, epoch: int, rank: int, batch: int) -> np.ndarray:
        """Dataset indices of batch ``batch`` of ``epoch`` for ``rank`` (int64, a fresh array)."""
        self._check(batch)
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world_size {self.world_size}")
        perm = self.permutation(epoch)
        lo = batch * self.batch_size
        # positions in the padded permutation, read in place: the padding wraps to its start, so
        # no copy of the whole permutation is made per batch
        where = rank + self.world_size * np.arange(lo, lo + self.batch_len(batch), dtype=np.int64)
        return perm[where % self.num_samples]

    def _check(self, batch: int) -> None:
        if not 0 <= batch < self.batches_per_epoch:
            raise IndexError(f"batch {batch} is outside the epoch's {self.batches_per_epoch} batches")


_PERM_CACHE_BYTES = 64 << 20  # recent epochs' permutations: many when epochs are short (windows span them)
_perm_cache: OrderedDict = OrderedDict()


def _permutation(n: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    key = (n, seed, epoch, shuffle)
    perm = _perm_cache.get(key)
    if perm is not None:
        _perm_cache.move_to_end(key)
        return perm
    perm = _make_permutation(n, seed, epoch, shuffle)
    _perm_cache[key] = perm
    while len(_perm_cache) > max(4, _PERM_CACHE_BYTES // max(1, perm.nbytes)):
        _perm_cache.popitem(last=False)
    return perm


def _make_permutation(n: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    if not shuffle:
        perm = np.arange(n, dtype=np.int64)
    else:
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([_PERM_TAG, seed, epoch])))
        perm = rng.permutation(n).astype(np.int64, copy=False)
    perm.setflags(write=False)
    return perm


@dataclass(frozen=True)
class ValSampler:
    """The validation stream's sampler: no shuffle, no padding, the last partial batch kept.

    Rank ``r`` of ``world_size`` takes the dataset indices ``r, r + world_size, ...`` in order, so
    every sample is in exactly one rank's share per pass; shares differ by at most one sample and
    a rank's batch count (``ceil(share / batch_size)``) by at most one from another's. A pass does
    not depend on its number: every pass yields the same batches (the daemon still names them by
    pass, ``(pass, rank, batch)``)."""

    num_samples: int
    batch_size: int
    world_size: int = 1

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ValueError("the validation set has no samples")
        if self.world_size < 1 or self.batch_size < 1:
            raise ValueError("world_size and batch_size must be positive")

    def share(self, rank: int) -> int:
        """Samples of ``rank`` per pass."""
        self._rank(rank)
        return len(range(rank, self.num_samples, self.world_size))

    def batches(self, rank: int) -> int:
        """Batches of ``rank`` per pass (0 when the set is smaller than the world)."""
        return -(-self.share(rank) // self.batch_size)

    @property
    def max_batches(self) -> int:
        return self.batches(0)  # rank 0's share is the largest

    def batch_indices(self, rank: int, batch: int) -> np.ndarray:
        """Dataset indices of batch ``batch`` of ``rank`` (int64, a fresh array; the last batch
        of a rank may be shorter)."""
        n = self.batches(rank)
        if not 0 <= batch < n:
            raise IndexError(f"batch {batch} is outside rank {rank}'s {n} validation batches")
        lo = batch * self.batch_size
        hi = min(lo + self.batch_size, self.share(rank))
        return rank + self.world_size * np.arange(lo, hi, dtype=np.int64)

    def _rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world_size {self.world_size}")
