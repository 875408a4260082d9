"""Augmentation policies (RandAugment, TrivialAugmentWide, AutoAugment, timm's rand strings),
the single ops of ``augment.ops`` and random erasing, on the uint8 sample after the crop. Pure.

A policy is first a plan, ``policy_plan(spec, p, h, w) -> [(op, magnitude), ...]``, a pure
function of the sample's fixed block of policy draws ``p`` (``Draws.p``: uniforms in [0, 1)
drawn from the sample's key after the crop's, whatever the policy or op chosen); then
``ops.apply_op`` carries it out. Draw slots: op ``k`` (k < 8) reads ``p[4k]`` (which op),
``p[4k + 1]`` (whether: timm's probability, AutoAugment's), ``p[4k + 2]`` (magnitude) and
``p[4k + 3]`` (sign); ``augment.ops`` reads ``p[32..37]``; the colour jitter ``p[38]`` (whether,
``augment.jitter_p``) and ``p[39]`` (hue's shift: ``modes.jitter_ops``); erasing reads ``p[40..217]`` and
``p[255]`` (``core.augment.erasing``).

The draws follow the references' own: torchvision's ``RandAugment`` (op uniform over its 14,
magnitude bin ``magnitude`` of ``num_magnitude_bins``, sign a fair coin), ``TrivialAugmentWide``
(op uniform, bin uniform, sign), ``AutoAugment`` (sub-policy uniform over ImageNet's 25, each op
when its uniform is <= its probability, sign), and timm's ``RandAugment`` (ops uniform with
replacement; each applied with probability ``p``; magnitude ``m``, or normal(m, mstd) when
mstd > 0, or uniform [0, m] when mstd is inf, clipped to [0, mmax]; timm's level functions).
Magnitude tables are torchvision's float32 ``torch.linspace`` values, computed as it does.
"""

from __future__ import annotations

import functools
import math
from statistics import NormalDist

import cv2
import numpy as np

from prefetchd.core.augment import erasing, seeds
from prefetchd.core.augment.ops import apply_op, gaussian_blur, grayscale, posterize, solarize
from prefetchd.core.policyspec import PolicySpec

N_POLICY_DRAWS = seeds.N_POLICY_DRAWS  # Draws.p: the fixed block, whatever the policy
RANDAUGMENT_OPS = ("Identity", "ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate", "Brightness", "Color",
                   "Contrast", "Sharpness", "Posterize", "Solarize", "AutoContrast", "Equalize")
TIMM_OPS = ("AutoContrast", "Equalize", "Invert", "Rotate", "Posterize", "Solarize", "SolarizeAdd", "Color",
            "Contrast", "Brightness", "Sharpness", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel")
TIMM_INCREASING_OPS = ("AutoContrast", "Equalize", "Invert", "Rotate", "PosterizeIncreasing", "SolarizeIncreasing",
                       "SolarizeAdd", "ColorIncreasing", "ContrastIncreasing", "BrightnessIncreasing",
                       "SharpnessIncreasing", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel")
# torchvision's AutoAugmentPolicy.IMAGENET: (op, probability, magnitude bin of 10)
IMAGENET_POLICY = (
    (("Posterize", 0.4, 8), ("Rotate", 0.6, 9)), (("Solarize", 0.6, 5), ("AutoContrast", 0.6, None)),
    (("Equalize", 0.8, None), ("Equalize", 0.6, None)), (("Posterize", 0.6, 7), ("Posterize", 0.6, 6)),
    (("Equalize", 0.4, None), ("Solarize", 0.2, 4)), (("Equalize", 0.4, None), ("Rotate", 0.8, 8)),
    (("Solarize", 0.6, 3), ("Equalize", 0.6, None)), (("Posterize", 0.8, 5), ("Equalize", 1.0, None)),
    (("Rotate", 0.2, 3), ("Solarize", 0.6, 8)), (("Equalize", 0.6, None), ("Posterize", 0.4, 6)),
    (("Rotate", 0.8, 8), ("Color", 0.4, 0)), (("Rotate", 0.4, 9), ("Equalize", 0.6, None)),
    (("Equalize", 0.0, None), ("Equalize", 0.8, None)), (("Invert", 0.6, None), ("Equalize", 1.0, None)),
    (("Color", 0.6, 4), ("Contrast", 1.0, 8)), (("Rotate", 0.8, 8), ("Color", 1.0, 2)),
    (("Color", 0.8, 8), ("Solarize", 0.8, 7)), (("Sharpness", 0.4, 7), ("Invert", 0.6, None)),
    (("ShearX", 0.6, 5), ("Equalize", 1.0, None)), (("Color", 0.4, 0), ("Equalize", 0.6, None)),
    (("Equalize", 0.4, None), ("Solarize", 0.2, 4)), (("Solarize", 0.6, 5), ("AutoContrast", 0.6, None)),
    (("Invert", 0.6, None), ("Equalize", 1.0, None)), (("Color", 0.6, 4), ("Contrast", 1.0, 8)),
    (("Equalize", 0.8, None), ("Equalize", 0.6, None)),
)
_NORMAL = NormalDist()
_TIMM_LEVEL_DENOM = 10.0
_TIMM_TRANSLATE_PCT = 0.45


def linspace_f32(start: float, end: float, steps: int) -> np.ndarray:
    """``torch.linspace(start, end, steps)`` in float32 to the bit, as torch's CPU kernel makes
    it: ``start + step * i`` for the first half, ``end - step * (steps - i - 1)`` after, each a
    fused multiply-add (one rounding; the compiler contracts them), ``step`` rounded to float32."""
    s, e = np.float32(start), np.float32(end)
    step = float((e - s) / np.float32(steps - 1))
    i = np.arange(steps, dtype=np.float64)
    # float32 x small integer is exact in float64, so one rounding to float32 is the fma's
    fused = np.where(i < steps // 2, float(s) + step * i, float(e) - step * (steps - i - 1))
    return fused.astype(np.float32)


def magnitude_table(kind: str, bins: int, h: int, w: int) -> dict[str, tuple[np.ndarray | None, bool]]:
    """torchvision's ``_augmentation_space`` of RandAugment/AutoAugment (``kind`` randaugment or
    autoaugment) or TrivialAugmentWide: op -> (magnitudes or None, signed)."""
    wide = kind == "trivialaugment"
    shear, rot, enh = (0.99, 135.0, 0.99) if wide else (0.3, 30.0, 0.9)
    tx, ty = (32.0, 32.0) if wide else (150.0 / 331.0 * w, 150.0 / 331.0 * h)
    post = 8 - np.rint(np.arange(bins, dtype=np.float32) / np.float32((bins - 1) / (6 if wide else 4))).astype(np.int32)
    t: dict[str, tuple[np.ndarray | None, bool]] = {
        "Identity": (None, False),
        "ShearX": (linspace_f32(0.0, shear, bins), True), "ShearY": (linspace_f32(0.0, shear, bins), True),
        "TranslateX": (linspace_f32(0.0, tx, bins), True), "TranslateY": (linspace_f32(0.0, ty, bins), True),
        "Rotate": (linspace_f32(0.0, rot, bins), True),
        "Brightness": (linspace_f32(0.0, enh, bins), True), "Color": (linspace_f32(0.0, enh, bins), True),
        "Contrast": (linspace_f32(0.0, enh, bins), True), "Sharpness": (linspace_f32(0.0, enh, bins), True),
        "Posterize": (post, False), "Solarize": (linspace_f32(255.0, 0.0, bins), False),
        "AutoContrast": (None, False), "Equalize": (None, False),
    }
    if kind == "autoaugment":
        t["Invert"] = (None, False)
        del t["Identity"]
    return t


@functools.lru_cache(maxsize=64)
def _table(kind: str, bins: int, h: int, w: int) -> dict[str, tuple[np.ndarray | None, bool]]:
    """``magnitude_table``, made once per (kind, bins, size) in a worker (read-only arrays): it was
    made afresh per sample, some 4% of a TrivialAugmentWide sample's CPU time."""
    t = magnitude_table(kind, bins, h, w)
    for mags, _ in t.values():
        if mags is not None:
            mags.setflags(write=False)
    return t


def _pick(u: float, n: int) -> int:
    return min(int(u * n), n - 1)


def _tv_op(name: str, mags: np.ndarray | None, signed: bool, index: int | None, neg: bool) -> tuple[str, float]:
    m = float(mags[index]) if mags is not None and index is not None else 0.0
    if signed and neg:
        m = -m
    if name in ("TranslateX", "TranslateY", "Posterize"):
        m = float(int(m))  # torchvision's int(magnitude)
    return name, m


def _timm_op(name: str, level: float, neg: bool, h: int, w: int) -> tuple[str, float]:
    """timm's level function for op ``name`` as a torchvision op and signed magnitude."""
    x = level / _TIMM_LEVEL_DENOM
    sign = -1.0 if neg else 1.0
    if name in ("AutoContrast", "Equalize", "Invert"):
        return name, 0.0
    if name == "Rotate":
        return "Rotate", sign * x * 30.0
    if name == "Posterize":
        return "Posterize", float(int(x * 4))
    if name == "PosterizeIncreasing":
        return "Posterize", float(4 - int(x * 4))
    if name == "Solarize":
        return "Solarize", float(int(x * 256))
    if name == "SolarizeIncreasing":
        return "Solarize", float(256 - int(x * 256))
    if name == "SolarizeAdd":
        return "SolarizeAdd", float(int(x * 110))
    if name.endswith("Increasing"):  # ColorIncreasing, ...: factor max(0.1, 1 +- 0.9 x)
        return name[: -len("Increasing")], max(0.1, 1.0 + sign * x * 0.9) - 1.0
    if name in ("Color", "Contrast", "Brightness", "Sharpness"):
        return name, x * 1.8 + 0.1 - 1.0
    if name in ("ShearX", "ShearY"):  # timm's (1, f, 0, 0, 1, 0) is torchvision's ShearX(f)
        return name, sign * x * 0.3
    # TranslateXRel: timm's (1, 0, px, 0, 1, 0) moves the image by -px
    px = sign * x * _TIMM_TRANSLATE_PCT * (w if name == "TranslateXRel" else h)
    return ("TranslateX" if name == "TranslateXRel" else "TranslateY"), -px


def policy_plan(spec: PolicySpec, p: np.ndarray, h: int, w: int) -> list[tuple[str, float]]:
    """The ops one sample gets, in order, with torchvision's signed magnitudes (skipped ops left out)."""
    if spec.kind == "randaugment" or spec.kind == "trivialaugment":
        table = _table(spec.kind, spec.num_magnitude_bins, h, w)
        plan = []
        for k in range(spec.num_ops if spec.kind == "randaugment" else 1):
            name = RANDAUGMENT_OPS[_pick(p[4 * k], len(RANDAUGMENT_OPS))]
            mags, signed = table[name]
            index = int(spec.magnitude) if spec.kind == "randaugment" else (
                _pick(p[4 * k + 2], len(mags)) if mags is not None else None)
            plan.append(_tv_op(name, mags, signed, index, p[4 * k + 3] < 0.5))
        return plan
    if spec.kind == "autoaugment":
        table = _table("autoaugment", 10, h, w)
        plan = []
        for k, (name, prob, index) in enumerate(IMAGENET_POLICY[_pick(p[0], len(IMAGENET_POLICY))]):
            if p[4 * k + 1] <= prob:
                mags, signed = table[name]
                plan.append(_tv_op(name, mags, signed, index, p[4 * k + 3] < 0.5))
        return plan
    if spec.kind == "timm":
        names = TIMM_INCREASING_OPS if spec.increasing else TIMM_OPS
        plan = []
        for k in range(spec.num_ops):
            name = names[_pick(p[4 * k], len(names))]
            if spec.prob < 1.0 and p[4 * k + 1] > spec.prob:
                continue
            level = spec.magnitude
            if spec.magnitude_std == math.inf:
                level = p[4 * k + 2] * level
            elif spec.magnitude_std > 0:
                level = level + spec.magnitude_std * _NORMAL.inv_cdf(min(max(p[4 * k + 2], 1e-12), 1 - 1e-12))
            level = max(0.0, min(level, spec.magnitude_max or _TIMM_LEVEL_DENOM))
            plan.append(_timm_op(name, level, p[4 * k + 3] > 0.5, h, w))
        return plan
    return []


def apply_policy(img: np.ndarray, spec: PolicySpec, p: np.ndarray) -> np.ndarray:
    for name, m in policy_plan(spec, p, img.shape[0], img.shape[1]):
        img = apply_op(img, name, m, spec.interpolation, spec.fill)
    return img


def apply_extras(img: np.ndarray, cfg, p: np.ndarray) -> np.ndarray:
    """What ``augment.policy``, ``augment.ops`` and ``augment.random_erasing`` ask of one sample
    (``cfg``: an AugmentConfig; ``p``: its ``Draws.p``), in that order: the policy, grayscale,
    blur, solarize, posterize (BYOL's and DINO's order: blur before solarize), vertical flip,
    erasing (not with ``erase_on: client``: the trainer's client erases the normalised batch).
    Nothing is done when none is set."""
    spec = cfg.policy_spec
    if spec.kind != "none":
        img = apply_policy(img, spec, p)
    o = cfg.ops
    if o.grayscale and p[33] < o.grayscale:
        img = grayscale(img)
    if o.blur and p[34] < o.blur:
        lo, hi = o.blur_sigma
        img = gaussian_blur(img, o.blur_kernel, lo + p[35] * (hi - lo))
    if o.solarize and p[36] < o.solarize:
        img = solarize(img, o.solarize_threshold)
    if o.posterize and p[37] < o.posterize:
        img = posterize(img, o.posterize_bits)
    if o.vflip and p[32] < o.vflip:
        img = cv2.flip(img, 0)  # a copy: later steps (cv2, in-place erasing) want a plain array
    if cfg.random_erasing.p and cfg.random_erasing.erase_on == "daemon":  # else the client's (client/erasing.py)
        img = erasing.erase(img, cfg.random_erasing, p)
    return img


def active(cfg) -> bool:
    """Whether ``apply_extras`` has anything to do for this AugmentConfig."""
    o = cfg.ops
    return (cfg.policy_spec.kind != "none" or (cfg.random_erasing.p > 0 and cfg.random_erasing.erase_on == "daemon")
            or any((o.vflip, o.grayscale, o.blur, o.solarize, o.posterize)))
