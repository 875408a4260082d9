"""The sampler: which samples make batch ``b`` of epoch ``e`` for rank ``r``. A pure function.

Per epoch, the dataset's ``n`` indices are permuted by a generator seeded from ``(seed, epoch)``
(identity when ``shuffle`` is off). As ``torch.utils.data.DistributedSampler`` does, the
permutation is padded by wrapping around to a multiple of ``world_size`` and rank ``r`` takes
every ``world_size``-th index starting at ``r``: the ranks' shares are disjoint (up to the
padding) and together cover the dataset. Each rank's share is then cut into batches of
``batch_size``; with ``drop_last`` the incomplete tail batch is dropped, otherwise it is shorter.

Nothing here depends on the worker count, timing or restarts, so the bytes of every batch are
reproducible from ``(seed, epoch, rank, batch)`` alone.

Block shuffle (``shuffle="block"``, with ``blocks``: the index's blocks, contiguous runs of
samples that are cheap to read together, such as a Parquet row group). The blocks are permuted,
then taken ``window`` at a time, and the samples of each window are permuted among themselves:
still a permutation of the epoch, a pure function of ``(seed, epoch)`` and the blocks, in which
consecutive positions come from the ``window`` blocks of one window (of two at a window's edge:
the end of one and the start of the next, each drawn from all its blocks), so a batch reads a few
row groups rather than one per sample. A window of at least the block count is one window: every
sample permuted together, as ``shuffle=True`` does (with its own draws). Every sample keeps the same chance of every
place within its window; what is lost is mixing across windows in one epoch (each epoch draws
new windows).

Resumed epochs (another world size or batch size). The permutation does not depend on the world
size, and global step ``s`` of an epoch at ``world_size`` W and ``batch_size`` B consumes its
positions ``[s*W*B, (s+1)*W*B)``. A job resumed after ``s`` steps at another W' or B' shares out
the rest, positions ``[offset, n)`` with ``offset = s*W*B`` (``resume``), exactly as a whole epoch
is shared: the remainder is padded by wrapping to a multiple of W' (repeating its own first
samples), rank ``r`` takes every W'-th position from ``r``, and the share is cut into batches of
B' (``drop_last`` drops the short tail). Every method takes that ``offset`` (0: the whole epoch);
a segment is named by ``(epoch, offset)``, and ``(seed, epoch, offset, rank, batch)`` determines
its batches. A state saved inside a resumed segment resumes in turn: the segment's step ``s``
consumed positions ``offset + [s*W*B, (s+1)*W*B)``.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from prefetchd.core.configvalues import ConfigError

# Domain-separation tags so permutation and augmentation streams never share a seed.
_PERM_TAG = 0x5045524D  # "PERM"
_BLOCK_TAG = 0x424C4F43  # "BLOC": a block shuffle's draws are their own


def for_loader(L, num_samples: int, block_sizes=None, layout: str = "this dataset") -> Sampler:
    """The train stream's sampler for ``LoaderConfig`` L over an index of ``num_samples`` whose
    blocks (``Index.block_sizes``) are ``block_sizes``; ``ConfigError`` in one line for a block
    shuffle of a layout that reads each sample alone."""
    blocks = None
    if L.shuffle == "block":
        if block_sizes is None:
            raise ConfigError("loader.shuffle", f"block needs a layout read in blocks (Parquet's row groups); "
                              f"{layout} reads each sample alone, so a full shuffle costs nothing more: use true")
        blocks = Blocks(block_sizes, L.shuffle_window)
    s = Sampler(num_samples, L.batch_size, L.seed, L.shuffle, L.drop_last, L.world_size, blocks)
    if s.batches_per_epoch == 0:
        raise ConfigError("loader.batch_size", f"({L.batch_size}) is larger than a rank's share of the dataset "
                          f"({s.samples_per_rank} samples) with drop_last: no batch to make")
    return s


def for_index(L, index) -> Sampler:
    """``for_loader`` for an ``Index`` (``sources``): its length, blocks and layout."""
    return for_loader(L, len(index), index.block_sizes(), getattr(index, "layout", "an ImageFolder"))


class Blocks:
    """The blocks of a block shuffle: ``sizes[k]`` samples each, block ``k`` the contiguous run of
    indices after block ``k - 1``'s; ``window`` blocks are permuted together. Compared and hashed
    by content (a digest), so it can key the permutation cache."""

    __slots__ = ("sizes", "window", "total", "_digest")

    def __init__(self, sizes, window: int):
        self.sizes = np.asarray(sizes, dtype=np.int64)
        if self.sizes.ndim != 1 or not len(self.sizes) or (self.sizes < 1).any():
            raise ValueError("blocks must be a non-empty list of positive sizes")
        self.window = int(window)
        if self.window < 1:
            raise ValueError("the window must be at least 1 block")
        self.total = int(self.sizes.sum())
        self._digest = hashlib.sha256(self.sizes.tobytes() + self.window.to_bytes(8, "little")).hexdigest()[:16]

    def __eq__(self, other) -> bool:
        return isinstance(other, Blocks) and other._digest == self._digest

    def __hash__(self) -> int:
        return hash(self._digest)

    def __repr__(self) -> str:
        return f"Blocks({len(self.sizes)} blocks, {self.total} samples, window {self.window})"


@dataclass(frozen=True)
class Sampler:
    num_samples: int
    batch_size: int
    seed: int = 0
    shuffle: bool = True
    drop_last: bool = True
    world_size: int = 1
    blocks: Blocks | None = None  # shuffle "block": the index's blocks and the window

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ValueError("the dataset has no samples")
        if self.world_size < 1 or self.batch_size < 1:
            raise ValueError("world_size and batch_size must be positive")
        if self.blocks is not None and self.blocks.total != self.num_samples:
            raise ValueError(f"the blocks hold {self.blocks.total} samples, the index {self.num_samples}")

    @property
    def samples_per_rank(self) -> int:
        return self.share(0)

    @property
    def batches_per_epoch(self) -> int:
        return self.batches_in(0)

    def share(self, offset: int = 0) -> int:
        """Samples per rank (padding included) of the segment starting at ``offset``."""
        return -(-(self.num_samples - self._offset(offset)) // self.world_size)

    def batches_in(self, offset: int = 0) -> int:
        """Batches per rank of the segment starting at ``offset`` (0: the whole epoch's)."""
        n = self.share(offset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def batch_len(self, batch: int, offset: int = 0) -> int:
        self._check(batch, offset)
        return min(self.batch_size, self.share(offset) - batch * self.batch_size)

    def resume(self, epoch: int, offset: int, batch: int, world_size: int, batch_size: int) -> tuple[int, int]:
        """Where a job that read ``batch`` batches per rank of segment ``(epoch, offset)`` at
        ``world_size`` x ``batch_size`` goes on, as a segment ``(epoch, offset)`` of this sampler:
        the first position not consumed globally, or ``(epoch + 1, 0)`` when none is left."""
        done = self._offset(offset) + batch * world_size * batch_size
        return (epoch, done) if done < self.num_samples else (epoch + 1, 0)

    def dataset_fingerprint(self, index_fingerprint: str) -> str:
        """The dataset's part of the stream's identity: the index's, and with a block shuffle its
        blocks too (the same rows in other row groups make another order: another stream)."""
        if self.blocks is None:
            return index_fingerprint
        return hashlib.sha256(f"{index_fingerprint}|blocks|{self.blocks._digest}".encode()).hexdigest()[:16]

    def permutation(self, epoch: int) -> np.ndarray:
        if self.shuffle == "block":
            if self.blocks is None:  # (counting batches needs none: the client's samplers have none)
                raise ValueError("a block shuffle's permutation needs the index's blocks")
            return _permutation(self.num_samples, self.seed, epoch, self.blocks)
        return _permutation(self.num_samples, self.seed, epoch, bool(self.shuffle))

    def rank_indices(self, epoch: int, rank: int, offset: int = 0) -> np.ndarray:
        """This rank's share of the epoch (of its segment from ``offset``), in order (a view for
        rank 0 of world size 1)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world_size {self.world_size}")
        perm = self.permutation(epoch)[self._offset(offset):]
        total = self.share(offset) * self.world_size
        if total > len(perm):  # wrapped round as often as needed, as batch_indices reads it
            perm = np.resize(perm, total)
        return perm[rank::self.world_size]

    def batch_indices(self, epoch: int, rank: int, batch: int, offset: int = 0) -> np.ndarray:
        """Dataset indices of batch ``batch`` of ``epoch`` (of its segment from ``offset``) for
        ``rank`` (int64, a fresh array)."""
        self._check(batch, offset)
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world_size {self.world_size}")
        perm = self.permutation(epoch)
        lo = batch * self.batch_size
        # positions in the padded remainder, read in place: the padding wraps to its start, so
        # no copy of the whole permutation is made per batch
        where = rank + self.world_size * np.arange(lo, lo + self.batch_len(batch, offset), dtype=np.int64)
        return perm[offset + where % (self.num_samples - offset)]

    def _offset(self, offset: int) -> int:
        if not 0 <= offset < self.num_samples:
            raise ValueError(f"offset {offset} is outside the epoch's {self.num_samples} samples")
        return offset

    def _check(self, batch: int, offset: int = 0) -> None:
        n = self.batches_in(offset)
        if not 0 <= batch < n:
            where = f" (resumed from sample {offset})" if offset else ""
            raise IndexError(f"batch {batch} is outside the epoch's {n} batches{where}")


_PERM_CACHE_BYTES = 64 << 20  # recent epochs' permutations: many when epochs are short (windows span them)
_perm_cache: OrderedDict = OrderedDict()


def _permutation(n: int, seed: int, epoch: int, shuffle: bool | Blocks) -> np.ndarray:
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


def _make_permutation(n: int, seed: int, epoch: int, shuffle: bool | Blocks) -> np.ndarray:
    if isinstance(shuffle, Blocks):
        perm = _block_permutation(shuffle, seed, epoch)
    elif not shuffle:
        perm = np.arange(n, dtype=np.int64)
    else:
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([_PERM_TAG, seed, epoch])))
        perm = rng.permutation(n).astype(np.int64, copy=False)
    perm.setflags(write=False)
    return perm


def _block_permutation(blocks: Blocks, seed: int, epoch: int) -> np.ndarray:
    """The blocks permuted, then the samples of each window of ``blocks.window`` of them permuted
    among themselves (see the module docstring)."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([_PERM_TAG, _BLOCK_TAG, seed, epoch])))
    sizes = blocks.sizes
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    order = rng.permutation(len(sizes))
    # each position's sample, block by block in the blocks' new order
    lens = sizes[order]
    within = np.arange(blocks.total, dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
    perm = np.repeat(starts[order], lens) + within
    bounds = np.concatenate(([0], np.cumsum(lens)[blocks.window - 1::blocks.window]))
    if bounds[-1] != blocks.total:
        bounds = np.append(bounds, blocks.total)
    # a window of one sample draws nothing (numpy's shuffle of one element): skipped, the same
    # permutation without a Python call per window (1.28 M single-row groups at window 1: 2.9 s)
    for lo, hi in zip(bounds[:-1][np.diff(bounds) > 1], bounds[1:][np.diff(bounds) > 1], strict=True):
        rng.shuffle(perm[lo:hi])
    return perm


@dataclass(frozen=True)
class ValSampler:
    """The validation stream's sampler: no shuffle, the last partial batch kept.

    Rank ``r`` of ``world_size`` takes the positions ``r, r + world_size, ...`` of the set in
    order. With ``pad`` (the default) every rank takes ``ceil(num_samples / world_size)``
    positions, as ``torch.utils.data.DistributedSampler`` (``shuffle=False``) does: position
    ``p >= num_samples`` is padding, sample ``p % num_samples`` again (from the start of the set),
    so every rank's pass has the same number of batches and a loop that reduces a metric per
    batch across ranks never waits on a rank that ran out; ``padding(rank, batch)`` says which
    samples of a batch are padding, so exact metrics stay possible. Without ``pad`` every sample
    is in exactly one rank's share; shares then differ by at most one sample and batch counts
    (``ceil(share / batch_size)``) by at most one. A pass does not depend on its number: every pass
    yields the same batches (the daemon still names them by pass, ``(pass, rank, batch)``)."""

    num_samples: int
    batch_size: int
    world_size: int = 1
    pad: bool = True

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ValueError("the validation set has no samples")
        if self.world_size < 1 or self.batch_size < 1:
            raise ValueError("world_size and batch_size must be positive")

    def share(self, rank: int) -> int:
        """Samples (padding included) of ``rank`` per pass."""
        self._rank(rank)
        if self.pad:
            return -(-self.num_samples // self.world_size)
        return len(range(rank, self.num_samples, self.world_size))

    def batches(self, rank: int) -> int:
        """Batches of ``rank`` per pass (0 when the set is smaller than the world, without ``pad``)."""
        return -(-self.share(rank) // self.batch_size)

    @property
    def max_batches(self) -> int:
        return self.batches(0)  # rank 0's share is the largest

    def _positions(self, rank: int, batch: int) -> np.ndarray:
        n = self.batches(rank)
        if not 0 <= batch < n:
            raise IndexError(f"batch {batch} is outside rank {rank}'s {n} validation batches")
        lo = batch * self.batch_size
        hi = min(lo + self.batch_size, self.share(rank))
        return rank + self.world_size * np.arange(lo, hi, dtype=np.int64)

    def batch_indices(self, rank: int, batch: int) -> np.ndarray:
        """Dataset indices of batch ``batch`` of ``rank`` (int64, a fresh array; the last batch
        of a rank may be shorter)."""
        return self._positions(rank, batch) % self.num_samples

    def padding(self, rank: int, batch: int) -> np.ndarray:
        """Per sample of the batch: True where it is padding (a sample another rank, or this one,
        also reads in the pass). All False without ``pad``."""
        return self._positions(rank, batch) >= self.num_samples

    def _rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world_size {self.world_size}")
