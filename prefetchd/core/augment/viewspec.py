"""``augment.views``: the built-in multi-crop (SimCLR's two crops, DINO's 2 x 224 + 6 x 96), as
written in the config and checked there. Pure, standard library only (the trainer's client reads
the config too; the pixels are ``core.augment.views``').

Each entry is a group of ``count`` views made alike: a random-resized crop of ``rrc_scale`` (area
fraction) and ``rrc_ratio`` (aspect) to ``output_size`` square, a horizontal flip (``flip``) and
colour jitter (``brightness``, ``contrast``, ``saturation``: factors in ``[1-x, 1+x]``), what
``augment.mode: random_resized_crop`` does to one image. The groups' views are numbered in order
(DINO's two global crops are views 0 and 1, its six local ones 2 to 7). ``hue`` and ``jitter_p``
are the section's keys of those names (a hue shift; the jitter's probability). A group's ``ops`` are
``augment.ops``' single ops (grayscale, blur, solarize, posterize, vflip, each with its
probability; ``core.policyspec.OpsConfig``), made on each of its views after the jitter: SimCLR's
grayscale and blur, BYOL's and DINO's solarize on one global view. Each view draws from its
sample's key and its number (``seeds.sample_key``); the decode's DCT reduction is shared by the
sample's views (``views``), so the views together are a pure function of ``(seed, epoch, sample)``.

A group's ``policy`` (with ``policy_args``) and ``random_erasing`` are ``augment.policy``'s,
``augment.policy_args``' and ``augment.random_erasing``'s keys (``core.policyspec``), made on each
of the group's views where the single-view path makes them: after the jitter, the policy, then
the ops, then the erasing, the flip last (``policies.apply_extras``), each from the view's own
draws. ``erase_on: client`` leaves a group's boxes to the trainer's client, which erases each
view of the group from the view's key (``erasing_meta``: what ``meta.json`` tells it).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field, fields
from typing import Any

from prefetchd.core.configvalues import (
    ConfigError,
    _bool,
    _float,
    _int,
    _pair,
    _unknown,
    jitter_strength,
)
from prefetchd.core.policyspec import (
    ErasingConfig,
    OpsConfig,
    erasing_config,
    misplaced_op,
    ops_config,
    policy_spec,
)

MAX_VIEWS = 64  # a batch file's limit (format.batchfile.MAX_VIEWS)


@dataclass(frozen=True)
class ViewGroup:
    """One entry of ``augment.views``: ``count`` views made alike."""

    output_size: int
    count: int = 1
    rrc_scale: tuple[float, float] = (0.08, 1.0)
    rrc_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: bool = True
    brightness: float = 0.0
    contrast: float = 0.0
    saturation: float = 0.0
    hue: float = 0.0
    jitter_p: float = 1.0
    ops: OpsConfig = field(default_factory=OpsConfig)
    policy: str = "none"  # augment.policy's values: randaugment, trivialaugment, autoaugment, rand-m9-...
    policy_args: dict = field(default_factory=dict)
    random_erasing: ErasingConfig = field(default_factory=ErasingConfig)


_KEYS = [f.name for f in fields(ViewGroup)]
_LATER = ("hue", "jitter_p", "ops", "policy", "policy_args", "random_erasing")  # in the fingerprint only when set


def parse_views(raw: Any) -> tuple[ViewGroup, ...]:
    """``augment.views`` as written (a list of mappings, or already ``ViewGroup``s), checked;
    ``ConfigError`` in one line naming the entry and key."""
    if raw is None or raw == () or raw == []:
        return ()
    if not isinstance(raw, (list, tuple)):
        raise ConfigError("augment.views", f"must be a list of view groups such as [{{count: 2, output_size: 224, "
                          f"rrc_scale: [0.4, 1.0]}}, {{count: 6, output_size: 96, rrc_scale: [0.05, 0.4]}}], got {raw!r}")
    groups = []
    for i, g in enumerate(raw):
        where = f"augment.views[{i}]"
        if isinstance(g, ViewGroup):
            g = {k: getattr(g, k) for k in _KEYS}
        if not isinstance(g, dict):
            raise ConfigError(where, f"must be a mapping such as {{count: 2, output_size: 224}}, got {g!r}")
        for k in g:
            if k not in _KEYS:
                raise misplaced_op(str(k), _KEYS, where) or _unknown(str(k), _KEYS, where)
        if "output_size" not in g:
            raise ConfigError(f"{where}.output_size", "is required (each view group's crop size, such as 224)")
        policy_spec(g.get("policy", "none"), g.get("policy_args"), where)  # checked here: errors name the group
        groups.append(ViewGroup(
            output_size=_int(g["output_size"], f"{where}.output_size", 8, 4096),
            count=_int(g.get("count", 1), f"{where}.count", 1, MAX_VIEWS),
            rrc_scale=_pair(g.get("rrc_scale", (0.08, 1.0)), f"{where}.rrc_scale", 1e-6, 1.0),
            rrc_ratio=_pair(g.get("rrc_ratio", (3 / 4, 4 / 3)), f"{where}.rrc_ratio", 1e-3, 1e3),
            flip=_bool(g.get("flip", True), f"{where}.flip"),
            **{k: jitter_strength(g.get(k, 0.0), f"{where}.{k}", 1.0) for k in ("brightness", "contrast", "saturation")},
            hue=jitter_strength(g.get("hue", 0.0), f"{where}.hue", 0.5),
            jitter_p=_float(g.get("jitter_p", 1.0), f"{where}.jitter_p", 0.0, 1.0),
            ops=ops_config(g.get("ops"), f"{where}.ops"),
            policy=g.get("policy", "none"),
            policy_args=dict(g.get("policy_args") or {}),
            random_erasing=erasing_config(g.get("random_erasing"), f"{where}.random_erasing"),
        ))
        g = groups[-1]
        if g.jitter_p < 1.0 and not (g.brightness or g.contrast or g.saturation or g.hue):
            raise ConfigError(f"{where}.jitter_p", jitter_p_alone(g.jitter_p, f"{where}."))
    total = sum(g.count for g in groups)
    if total < 2:
        raise ConfigError("augment.views", f"makes {total} view: list two or more (count: 2 for SimCLR's pair), or "
                          "leave augment.views out for one crop per sample (augment.mode)")
    if total > MAX_VIEWS:
        raise ConfigError("augment.views", f"makes {total} views; a batch holds at most {MAX_VIEWS}")
    return tuple(groups)


def jitter_p_alone(p: float, where: str) -> str:
    """Why a ``jitter_p`` without a jitter strength is refused: it would be accepted and do nothing."""
    return (f"({p:g}) is the colour jitter's probability, but {where}brightness, contrast, saturation and hue are "
            f"all 0: no jitter to apply; set them (DINO's: 0.4, 0.4, 0.2, 0.1) or remove jitter_p")


def expand(groups: tuple[ViewGroup, ...]) -> tuple[ViewGroup, ...]:
    """One entry per view, in view order (a group of ``count`` k is k entries)."""
    return tuple(g for g in groups for _ in range(g.count))


def shapes(groups: tuple[ViewGroup, ...]) -> tuple[tuple[int, int], ...]:
    """Each view's (height, width), in view order."""
    return tuple((g.output_size, g.output_size) for g in expand(groups))


def as_dicts(groups: tuple[ViewGroup, ...]) -> list[dict]:
    """The groups as plain values (for the stream's fingerprint; a group without ops keeps the
    value it had before groups had them)."""
    out = []
    for g in groups:
        d = {k: (list(v) if isinstance(v, tuple) else v) for k, v in ((k, getattr(g, k)) for k in _KEYS
                                                                     if k not in _LATER)}
        for k, default in (("hue", 0.0), ("jitter_p", 1.0)):
            if getattr(g, k) != default:
                d[k] = getattr(g, k)
        if g.ops != OpsConfig():
            d["ops"] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(g.ops).items()}
        if g.policy != "none":
            d["policy"] = g.policy
            d["policy_args"] = json.loads(json.dumps(g.policy_args, sort_keys=True))
        if g.random_erasing != ErasingConfig():
            d["random_erasing"] = json.loads(json.dumps(g.random_erasing.stream_dict()))
        out.append(d)
    return out


def erasing_meta(groups: tuple[ViewGroup, ...], seed: int) -> dict | None:
    """What ``meta.json``'s ``"erasing"`` tells the trainer's client when a group erases with
    ``erase_on: client``: ``{"seed": seed, "views": [each view's spec or None, in view order]}``
    (a spec as ``ErasingConfig.client_spec`` has it; the client draws view ``v`` of sample ``i``
    from the key ``(seed, epoch, i, v)``); None when no group does."""
    specs = [g.random_erasing.client_spec(seed) for g in expand(groups)]
    if not any(specs):
        return None
    return {"seed": seed, "views": specs}
