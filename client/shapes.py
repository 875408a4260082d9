"""DataLoader-shaped stand-ins the loader hands out, so training scripts written for a
``torch.utils.data.DataLoader`` with a ``DistributedSampler`` run unchanged: ``loader.dataset``
(sized), ``loader.sampler`` (sized, with ``set_epoch``), ``loader.batch_sampler`` (sized, its
``batch_size`` and ``drop_last``). None of them can be indexed or iterated: the daemon owns the
order (a pure function of seed, epoch and rank), the loader yields it."""

from __future__ import annotations

from typing import Any


class Sized:
    """Only a length (``loader.dataset``; nothing to index or iterate)."""

    def __init__(self, n: int):
        self._n = n

    def __len__(self) -> int:
        return self._n


class DistSampler(Sized):
    """``loader.sampler``: sized as ``DistributedSampler`` without ``drop_last`` reports
    (``ceil(len(dataset) / world_size)``), with its ``set_epoch`` (the loader's: the next ``for``
    runs that epoch), ``epoch``, ``num_replicas``, ``rank`` and ``shuffle``. So code that checks
    ``hasattr(loader.sampler, "set_epoch")`` and calls it moves the loader as it would the sampler."""

    def __init__(self, loader: Any, n: int, shuffle: bool):
        super().__init__(n)
        self._loader = loader
        self.num_replicas = loader.world_size
        self.rank = loader.rank
        self.shuffle = shuffle

    def set_epoch(self, epoch: int) -> None:
        self._loader.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        return self._loader.epoch


class BatchSampler(Sized):
    """``loader.batch_sampler``: ``len()`` is this rank's batches per epoch (``len(loader)``);
    ``batch_size``, ``drop_last`` and ``sampler`` as a DataLoader's batch sampler has them."""

    def __init__(self, loader: Any):
        super().__init__(len(loader))
        self.batch_size = loader.batch_size
        self.drop_last = loader.drop_last
        self.sampler = loader.sampler


class DataLoaderShape:
    """The loader's DataLoader-shaped attributes (a mixin of ``PrefetchClient``: ``self`` is the
    loader, with its ``cfg``, ``split``, ``rank`` and ``meta()``)."""

    @property
    def batch_size(self) -> int:
        return self.cfg.validation.batch_size if self.split == "val" else self.cfg.loader.batch_size

    @property
    def drop_last(self) -> bool:
        return False if self.split == "val" else self.cfg.loader.drop_last

    @property
    def world_size(self) -> int:
        return self.cfg.loader.world_size

    @property
    def dataset(self) -> Sized:
        """Sized like a DataLoader's dataset: ``len()`` is the samples of the stream's dataset."""
        m = self.meta()
        return Sized(int(m["validation"]["num_samples"] if self.split == "val" else m["num_samples"]))

    @property
    def sampler(self) -> DistSampler:
        """Sized like a ``DistributedSampler``: ``len()`` is ``ceil(len(dataset) / world_size)``, what
        it reports without ``drop_last``. Scripts that look for the samples such a sampler leaves
        out (``len(sampler) * world_size < len(dataset)``, as pytorch/examples' ``validate`` does)
        find none: the validation stream leaves none out (padded as that sampler pads, or, with
        ``validation.pad: false``, rank shares one sample shorter). Its ``set_epoch`` is the
        loader's (``client.shapes``)."""
        shuffle = self.split == "train" and bool(self.cfg.loader.shuffle)  # a bool, as torch's (block: True)
        return DistSampler(self, -(-len(self.dataset) // self.world_size), shuffle)

    @property
    def batch_sampler(self) -> BatchSampler:
        """Sized as a DataLoader's batch sampler: ``len()`` is ``len(loader)``."""
        return BatchSampler(self)


def normalize_constants(normalize: bool, mean: Any, std: Any) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``PrefetchClient``'s ``mean=`` and ``std=`` (ImageNet's where None), checked: one value per
    channel (3), ``std`` positive, and only with ``normalize=True``."""
    from .normalize import IMAGENET_MEAN, IMAGENET_STD

    if (mean is not None or std is not None) and not normalize:
        raise ValueError("mean= and std= are those of normalize=True; pass normalize=True with them")
    out = []
    for name, v, default in (("mean", mean, IMAGENET_MEAN), ("std", std, IMAGENET_STD)):
        try:
            t = tuple(float(x) for x in (default if v is None else v))
        except (TypeError, ValueError):
            raise ValueError(f"{name}= must be 3 numbers (one per channel, RGB), got {v!r}") from None
        if len(t) != 3 or (name == "std" and min(t) <= 0):
            raise ValueError(f"{name}= must be 3 {'positive ' if name == 'std' else ''}numbers (one per channel, "
                             f"RGB), got {v!r}")
        if not all(0.0 <= x <= 1.0 for x in t):  # (x / 255 - mean) / std: mmcv's and detectron2's are 0..255
            raise ValueError(f"{name}= is in units of x / 255 (0 to 1, ImageNet's {default}), got {v!r}; a 0..255 "
                             f"{name} (mmcv's, detectron2's 123.675...) is 255 times too large: divide it by 255")
        out.append(t)
    return out[0], out[1]


def check_batch_size(asked: int | None, have: int, key: str, source: str | None) -> None:
    """``PrefetchClient(batch_size=N)``: the daemon makes the config's batches; another size is an
    error in one line naming both (a trainer scales its learning rate from the size it asked for)."""
    if asked is not None and int(asked) != have:
        where = f" in {source}" if source else ""
        raise ValueError(f"batch_size={asked} was asked for, but the daemon makes batches of {have} ({key}{where}); "
                         f"pass batch_size={have} or set {key}: {asked} and restart the daemon")
