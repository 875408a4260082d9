"""Several views of one sample (``augment.views``, see ``viewspec``): ``(bytes, config, seed, epoch,
index) -> one uint8 [S_v, S_v, 3] per view``. Pure.

The file is decoded once (DCT-reduced only as far as every view's crop keeps its size) and each
view is made from it as ``augment.mode: random_resized_crop`` makes a sample (``modes.crop_for``,
``modes.finish``: resample, jitter, the group's policy, ops and erasing, flip), with the view's
own parameters and the draws of the view's key (``modes.draws(seed, epoch, index, view)``): a
view is the single-view path's sample of the same settings and draws. So the sample's views
depend on its bytes, the config and ``(seed, epoch, index)`` alone: deterministic. A view's crop
draws are its own, but the decode's DCT reduction is shared (the least any view's crop allows),
so a view's pixels can change with the other views' crops or with the view groups configured (a
new config is a new stream: its fingerprint says so).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from prefetchd.core.augment import modes
from prefetchd.core.augment.viewspec import expand
from prefetchd.core.augment.viewspec import shapes as group_shapes
from prefetchd.core.config import AugmentConfig


def view_configs(cfg: AugmentConfig) -> tuple[AugmentConfig, ...]:
    """One augmentation config per view (``cfg.views`` expanded), in view order: a random-resized
    crop with the view's size, scale, ratio, flip, jitter, single ops, policy and random erasing
    (made as the single-view path makes them: ``modes.finish``); decoder and interpolation ``cfg``'s.
    A group's views share one config."""
    made = {id(g): replace(cfg, mode="random_resized_crop", output_size=g.output_size, rrc_scale=g.rrc_scale,
                           rrc_ratio=g.rrc_ratio, flip=g.flip, brightness=g.brightness, contrast=g.contrast,
                           saturation=g.saturation, hue=g.hue, jitter_p=g.jitter_p, lighting=0.0, views=(), ops=g.ops,
                           policy=g.policy, policy_args=g.policy_args, random_erasing=g.random_erasing)
            for g in cfg.views}
    return tuple(made[id(g)] for g in expand(cfg.views))


def stream_shapes(cfg: AugmentConfig) -> tuple[tuple[int, int], ...]:
    """The (height, width) of each view a batch of the train stream holds, as far as the config
    says (a user's transform's are learned at start, ``transform.probe``): one ``output_size``
    square without ``augment.views``."""
    if cfg.views:
        return group_shapes(cfg.views)
    return ((cfg.output_size, cfg.output_size),)


def make_views(data: bytes, cfgs: Sequence[AugmentConfig], seed: int, epoch: int, index: int,
               outs: Sequence[np.ndarray] | None = None) -> tuple[np.ndarray, ...]:
    """Every view of sample ``index`` of ``epoch``, into ``outs`` (one uint8 [S_v, S_v, 3] slot per
    view, written in place) or new arrays. Raises ``modes.SampleError`` for a file that cannot
    be used."""
    plans = [(c, modes.draws(seed, epoch, index, v)) for v, c in enumerate(cfgs)]
    arr, crops = modes.decode_regions(data, plans)
    outs = outs if outs is not None else [None] * len(plans)
    return tuple(modes.finish(arr, crop, c, d, out)
                 for (c, d), crop, out in zip(plans, crops, outs, strict=True))
