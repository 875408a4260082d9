"""Random erasing (``augment.random_erasing``) on the uint8 sample: timm's ``RandomErasing``. Pure.

With probability ``p``: ``count`` boxes (an integer uniform in [min, max]); each takes up to
ten tries of an area fraction uniform in ``scale`` (divided by the count) and a log-uniform
aspect in ``ratio``, ``h = round(sqrt(area * aspect))``, ``w = round(sqrt(area / aspect))``,
kept when ``h < H`` and ``w < W``, placed uniformly (torchvision's ``RandomErasing`` is
``count: 1``). The box is filled with:

* ``const``: ``value`` (uint8 colour). timm and torchvision erase after normalisation with 0,
  which is the normalisation mean: ``value: [124, 116, 104]`` is that for ImageNet's mean;
* ``rand``: one colour per box, ``mean + std * N(0, 1)`` per channel (timm's normalised noise
  mapped back to pixels: ``round(255 * (mean + std * z))``, clipped to 0..255);
* ``pixel``: that per pixel (timm's ``mode='pixel'``, torchvision's ``value='random'``).

Draws (the sample's ``Draws.p``): ``p[40]`` whether, ``p[41]`` how many, box ``j`` try ``a``
``p[42 + 40j + 4a ...]`` (area, aspect, top, left), ``rand`` colours from ``p[206 + 3j ...]``,
and ``pixel`` noise from a generator seeded by ``p[255]``: a pure function of the sample's key.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np

_NORMAL = NormalDist()


def _randint(u: float, lo: int, hi_inclusive: int) -> int:
    return lo + min(int(u * (hi_inclusive - lo + 1)), hi_inclusive - lo)


def boxes(cfg, p: np.ndarray, h: int, w: int) -> list[tuple[int, int, int, int, int]]:
    """The boxes ``(top, left, height, width, j)`` erased from an ``h`` x ``w`` sample (none
    when ``p[40]`` says no)."""
    if not p[40] < cfg.p:
        return []
    count = _randint(p[41], cfg.count[0], cfg.count[1])
    log_lo, log_hi = math.log(cfg.ratio[0]), math.log(cfg.ratio[1])
    out = []
    for j in range(count):
        for a in range(10):
            ua, ur, ut, ul = p[42 + 40 * j + 4 * a: 46 + 40 * j + 4 * a]
            target = (cfg.scale[0] + ua * (cfg.scale[1] - cfg.scale[0])) * h * w / count
            aspect = math.exp(log_lo + ur * (log_hi - log_lo))
            eh = int(round(math.sqrt(target * aspect)))
            ew = int(round(math.sqrt(target / aspect)))
            if ew < w and eh < h:
                out.append((_randint(ut, 0, h - eh), _randint(ul, 0, w - ew), eh, ew, j))
                break
    return out


def noise(cfg, p: np.ndarray, bs: list[tuple[int, int, int, int, int]]) -> list[np.ndarray | None]:
    """Each box's standard normal noise, timm's fill in normalised space: ``rand``: float64 [3]
    (one value a channel), ``pixel``: float32 [height, width, 3], ``const``: None. A pure
    function of the draws, shared by the daemon's erasing (mapped to pixels) and the client's
    (``erase_on: client``: written as they are into the normalised batch)."""
    if cfg.mode == "const":
        return [None] * len(bs)
    if cfg.mode == "rand":
        return [np.array([_NORMAL.inv_cdf(min(max(u, 1e-12), 1 - 1e-12)) for u in p[206 + 3 * j: 209 + 3 * j]])
                for _, _, _, _, j in bs]
    rng = np.random.default_rng(int(p[255] * 2**53))
    return [rng.standard_normal((eh, ew, 3), dtype=np.float32) for _, _, eh, ew, _ in bs]


def _to_pixels(z: np.ndarray, cfg) -> np.ndarray:
    v = 255.0 * (np.asarray(cfg.mean) + np.asarray(cfg.std) * z)
    return np.clip(np.rint(v), 0, 255).astype(np.uint8)


def erase(img: np.ndarray, cfg, p: np.ndarray) -> np.ndarray:
    """``img`` with its boxes filled (written in place when ``img`` is writable)."""
    bs = boxes(cfg, p, img.shape[0], img.shape[1])
    if not bs:
        return img
    if not img.flags.writeable:
        img = img.copy()
    for (top, left, eh, ew, _), z in zip(bs, noise(cfg, p, bs), strict=True):
        img[top:top + eh, left:left + ew] = np.asarray(cfg.value, np.uint8) if z is None else _to_pixels(z, cfg)
    return img
