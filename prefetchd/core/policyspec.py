"""The augmentation policies' and extra ops' settings, checked: ``augment.policy``,
``augment.policy_args``, ``augment.random_erasing`` and ``augment.ops``. Standard library only
(read by the trainer's client with the rest of the config); the pixels are made by
``core.augment.policies``, ``core.augment.erasing`` and ``core.augment.ops``.

``augment.policy`` is ``none``, ``randaugment`` (torchvision's ``RandAugment``),
``trivialaugment`` (``TrivialAugmentWide``), ``autoaugment`` (``AutoAugment``, ImageNet policy)
or a timm RandAugment string such as ``rand-m9-mstd0.5-inc1``, parsed as timm's
``rand_augment_transform`` parses it: ``m`` magnitude (0..mmax), ``n`` number of ops,
``mstd`` magnitude std (above 100: uniform in [0, m], as timm), ``mmax`` magnitude upper bound (default
10), ``inc`` 1 for the increasing op set, ``p`` each op's probability (default 0.5). timm's
``t...`` transform sets, the old ``w`` (op weights), a section given twice and one without a
number (timm skips those silently) are refused with a message.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from dataclasses import dataclass
from typing import Any

from prefetchd.core.configvalues import ConfigError

POLICIES = ("none", "randaugment", "trivialaugment", "autoaugment")
POLICY_INTERPOLATIONS = ("nearest", "bilinear", "bicubic")
ERASING_MODES = ("const", "rand", "pixel")
ERASE_ON = ("daemon", "client")
_DAEMON_ONLY_ERASING_KEYS = ("value", "mean", "std")  # the uint8 colours: timm's normalised fill has none
MAX_NUM_OPS = 8  # the policy's fixed block of draws holds this many ops
MAX_ERASE_COUNT = 4
_POLICY_ARG_KEYS = ("num_ops", "magnitude", "num_magnitude_bins", "fill", "interpolation")
_TIMM_MEAN_FILL = (124, 116, 104)  # timm's img_mean hparam: round(255 * ImageNet mean)


@dataclass(frozen=True)
class PolicySpec:
    """A policy, resolved: ``kind`` is ``randaugment``, ``trivialaugment``, ``autoaugment`` or
    ``timm``; the rest are its parameters (those a kind does not use keep their defaults)."""

    kind: str = "none"
    num_ops: int = 2
    magnitude: float = 9
    num_magnitude_bins: int = 31
    fill: tuple[int, int, int] = (0, 0, 0)
    interpolation: str = "nearest"
    magnitude_std: float = 0.0  # timm
    magnitude_max: float = 10.0  # timm
    increasing: bool = False  # timm
    prob: float = 0.5  # timm: each chosen op's probability


def _fill(v: Any, key: str) -> tuple[int, int, int]:
    vals = [v] * 3 if isinstance(v, (int, float)) and not isinstance(v, bool) else v
    if (not isinstance(vals, (list, tuple)) or len(vals) != 3
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x <= 255 for x in vals)):
        raise ConfigError(key, f"must be a grey level 0..255 or [r, g, b] of them, got {v!r}")
    if any(x != int(x) for x in vals):  # a fraction of white (0.5) would be truncated to black
        raise ConfigError(key, f"must be whole uint8 levels 0..255 (the sample is uint8, not normalised), got {v!r}; "
                               f"for a fraction of white write 255 times it (0.5: 128)")
    return tuple(int(x) for x in vals)


def _number(v: Any, key: str, lo: float, hi: float, integer: bool = False) -> float:
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if not ok or isinstance(v, bool) or not (lo <= v <= hi):
        what = "an integer" if integer else "a number"
        raise ConfigError(key, f"must be {what} in [{lo:g}, {hi:g}], got {v!r}")
    return v


_TIMM_AUTOAUGMENT = ("original", "originalr", "v0", "v0r", "3a")  # timm's auto_augment_transform names


def _policy_hint(policy: str) -> str:
    """What a policy name that is not one probably meant (timm's other strings, another spelling)."""
    name = policy.split("-")[0].lower()
    if name == "augmix":
        return " (timm's AugMix strings are not supported)"
    if name in _TIMM_AUTOAUGMENT:
        return (f" (timm's AutoAugment policy {name!r} is not built; autoaugment is torchvision's ImageNet policy, "
                "the same sub-policies as timm's 'original' with torchvision's magnitudes)")
    squashed = name.replace("_", "").replace(" ", "")
    close = [p for p in POLICIES if p == squashed] or difflib.get_close_matches(name, POLICIES, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def parse_timm(s: str, key: str = "augment.policy") -> dict[str, Any]:
    """timm's ``rand-...`` string as a dict of PolicySpec fields (timm's parse: ``-``-separated
    sections, each a name followed by the value that starts at its first digit)."""
    parts = s.split("-")
    if parts[0] != "rand":
        raise ConfigError(key, f"must be one of {', '.join(POLICIES)} or a timm string such as rand-m9-mstd0.5-inc1, got {s!r}")
    out: dict[str, Any] = {"kind": "timm", "magnitude": 10.0, "num_ops": 2, "fill": _TIMM_MEAN_FILL,
                           "interpolation": "bilinear"}
    seen: set[str] = set()
    for c in parts[1:]:
        if c.startswith("t"):  # timm's transform set (tweights: weighted choice): not built
            raise ConfigError(key, f"timm's transform-set section {c!r} is not supported (prefetchd has timm's default "
                                   f"15 ops, inc1 the increasing ones); leave it out of {s!r}")
        cs = re.split(r"(\d.*)", c)
        if len(cs) < 2 or cs[0] == "":
            # timm skips such a section silently; a typo here should not pass unseen
            raise ConfigError(key, f"section {c!r} of {s!r} is not a name and a number (m9, n2, mstd0.5, mstd101 "
                                   f"for uniform magnitudes, mmax10, inc1, p0.5)")
        name, val = cs[0], cs[1]
        if name in seen:  # timm keeps the first mstd and mmax but the last m, n, p: a typo either way
            raise ConfigError(key, f"section {name} appears twice in {s!r}; give it once")
        seen.add(name)
        try:
            if name == "mstd":
                out["magnitude_std"] = float(val)
                if out["magnitude_std"] > 100:  # timm: mstd101 and up mean uniform in [0, m]
                    out["magnitude_std"] = math.inf
            elif name == "mmax":
                out["magnitude_max"] = float(int(val))  # timm: int(val)
            elif name == "inc":
                out["increasing"] = bool(int(val))
            elif name == "m":
                out["magnitude"] = float(int(val))
            elif name == "n":
                out["num_ops"] = int(val)
                _number(out["num_ops"], f"{key} (n)", 0, MAX_NUM_OPS, integer=True)
            elif name == "p":
                out["prob"] = float(val)
            elif name == "w":
                raise ConfigError(key, f"timm's op weights (w{val}) are not supported; leave the section out of {s!r}")
            else:
                raise ConfigError(key, f"unknown section {c!r} in {s!r}; timm's are m, n, mstd, mmax, inc, p")
        except ConfigError:
            raise
        except ValueError:
            raise ConfigError(key, f"section {c!r} of {s!r} has no usable number") from None
    # (timm skips 'mstdinf', a section without a digit, leaving mstd 0; it is refused above)
    if math.isnan(out.get("magnitude_std", 0.0)) or out.get("magnitude_std", 0.0) < 0:
        raise ConfigError(key, f"mstd must be >= 0 (or inf), got {s!r}")
    return out


def policy_spec(policy: Any, args: Any, where: str = "augment") -> PolicySpec:
    """``augment.policy`` and ``augment.policy_args`` checked and resolved (``where``: the keys' section,
    ``augment.views[i]`` for a view group's)."""
    if not isinstance(policy, str):
        raise ConfigError(f"{where}.policy", f"must be one of {', '.join(POLICIES)} or a timm string such as rand-m9-mstd0.5-inc1, got {policy!r}")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise ConfigError(f"{where}.policy_args", f"must be a mapping such as {{num_ops: 2, magnitude: 9}}, got {args!r}")
    for k in args:
        if k not in _POLICY_ARG_KEYS:
            raise ConfigError(f"{where}.policy_args.{k}", f"is not a policy parameter; known: {', '.join(_POLICY_ARG_KEYS)}")
    if policy == "none":
        if args:
            raise ConfigError(f"{where}.policy_args", f"is set but {where}.policy is none")
        return PolicySpec()
    timm = policy == "rand" or policy.startswith("rand-")
    base: dict[str, Any] = parse_timm(policy, f"{where}.policy") if timm else {"kind": policy}
    if base["kind"] not in POLICIES[1:] + ("timm",):
        raise ConfigError(f"{where}.policy", f"must be one of {', '.join(POLICIES)} or a timm string such as "
                                            f"rand-m9-mstd0.5-inc1, got {policy!r}{_policy_hint(policy)}")
    for k in ("num_ops", "magnitude", "num_magnitude_bins"):
        if k == "num_magnitude_bins" and base["kind"] == "trivialaugment":
            continue  # TrivialAugmentWide(num_magnitude_bins=31) has it too
        if k in args and base["kind"] != "randaugment":
            if base["kind"] == "timm":
                raise ConfigError(f"{where}.policy_args.{k}", f"is set by the timm string {policy!r} itself (m, n)")
            raise ConfigError(f"{where}.policy_args.{k}", f"is a randaugment parameter; {policy} has none")
    base.update({k: v for k, v in args.items()})
    spec = PolicySpec(**base)
    _number(spec.num_ops, f"{where}.policy_args.num_ops", 0, MAX_NUM_OPS, integer=True)
    _number(spec.num_magnitude_bins, f"{where}.policy_args.num_magnitude_bins", 2, 1000, integer=True)
    if spec.kind == "randaugment":
        _number(spec.magnitude, f"{where}.policy_args.magnitude", 0, spec.num_magnitude_bins - 1, integer=True)
    if spec.kind == "autoaugment":
        spec = PolicySpec(**{**spec.__dict__, "num_magnitude_bins": 10})
    if spec.interpolation not in POLICY_INTERPOLATIONS:
        raise ConfigError(f"{where}.policy_args.interpolation", f"must be one of {', '.join(POLICY_INTERPOLATIONS)}, got {spec.interpolation!r}")
    _number(spec.prob, f"{where}.policy (p)", 0.0, 1.0)
    _number(spec.magnitude_max, f"{where}.policy (mmax)", 0.0, 1000.0)
    return PolicySpec(**{**spec.__dict__, "fill": _fill(spec.fill, f"{where}.policy_args.fill")})


@dataclass(frozen=True)
class ErasingConfig:
    """``augment.random_erasing``: timm's ``RandomErasing`` on the uint8 sample (torchvision's is
    ``count: 1``). ``p`` 0 is off. ``erase_on: client``: the workers leave the boxes alone and the
    trainer's client erases its normalised batch, on its device, as timm's loader does (const
    fills with 0, rand and pixel with N(0, 1)); ``value``, ``mean`` and ``std`` are then refused."""

    p: float = 0.0
    scale: tuple[float, float] = (0.02, 1 / 3)
    ratio: tuple[float, float] = (0.3, 1 / 0.3)
    mode: str = "const"
    value: tuple[int, int, int] = (0, 0, 0)  # const mode's colour
    count: tuple[int, int] = (1, 1)  # [min, max] boxes, drawn uniformly (timm's min_count, max_count)
    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)  # rand/pixel: the noise is mean + std * N(0, 1)
    std: tuple[float, float, float] = (0.229, 0.224, 0.225)
    erase_on: str = "daemon"  # daemon: on the uint8 sample in the workers; client: the normalised batch

    def stream_dict(self) -> dict[str, Any]:
        """The settings in the stream's fingerprint: ``erase_on`` only when it is ``client``, so
        configs written before it existed keep their fingerprint."""
        d = dataclasses.asdict(self)
        if self.erase_on == "daemon":
            d.pop("erase_on")
        return d

    def client_spec(self, seed: int) -> dict[str, Any] | None:
        """What the daemon's ``meta.json`` tells the client (``"erasing"``) so it erases by itself:
        the box parameters, the mode and the loader's seed; None unless ``erase_on: client``."""
        if self.erase_on != "client" or not self.p:
            return None
        return {"p": self.p, "scale": list(self.scale), "ratio": list(self.ratio), "mode": self.mode,
                "count": list(self.count), "seed": seed}


def _floats(v: Any, n: int, key: str, lo: float, hi: float) -> tuple[float, ...]:
    if (not isinstance(v, (list, tuple)) or len(v) != n
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and lo <= x <= hi for x in v)):
        raise ConfigError(key, f"must be a list of {n} numbers in [{lo:g}, {hi:g}], got {v!r}")
    return tuple(float(x) for x in v)


# timm's RandomErasing arguments, as this section spells them
_TIMM_ERASING = {"probability": "p", "min_area": "scale: [min_area, max_area]", "max_area": "scale: [min_area, max_area]",
                 "min_aspect": "ratio: [min_aspect, max_aspect]", "max_aspect": "ratio: [min_aspect, max_aspect]",
                 "min_count": "count: [min_count, max_count]", "max_count": "count: [min_count, max_count]",
                 "device": "erase_on (client: the trainer's client erases its batch, on its device)"}


def erasing_config(v: Any, key: str = "augment.random_erasing") -> ErasingConfig:
    """``augment.random_erasing`` (or a view group's: ``key``) checked: a mapping of
    ErasingConfig's keys (or null: off)."""
    if v is None:
        return ErasingConfig()
    if isinstance(v, ErasingConfig):
        return v
    if not isinstance(v, dict):
        raise ConfigError(key, f"must be a mapping such as {{p: 0.25, mode: pixel}}, got {v!r}")
    known = [f for f in ErasingConfig.__dataclass_fields__]
    for k in v:
        if k in _TIMM_ERASING:
            raise ConfigError(f"{key}.{k}", f"is not a random_erasing key; timm's RandomErasing({k}=) is "
                              f"{key}.{_TIMM_ERASING[k]} here")
        if k not in known:
            raise ConfigError(f"{key}.{k}", f"is not a random_erasing key; known: {', '.join(known)}")
    d = dict(v)
    d["p"] = float(_number(d.get("p", 0.0), f"{key}.p", 0.0, 1.0))
    d["scale"] = _floats(d.get("scale", ErasingConfig.scale), 2, f"{key}.scale", 1e-6, 1.0)
    d["ratio"] = _floats(d.get("ratio", ErasingConfig.ratio), 2, f"{key}.ratio", 1e-3, 1e3)
    for k in ("scale", "ratio"):
        if d[k][0] > d[k][1]:
            raise ConfigError(f"{key}.{k}", f"must be [low, high] with low <= high, got {list(d[k])}")
    if d.get("mode", "const") not in ERASING_MODES:
        raise ConfigError(f"{key}.mode", f"must be one of {', '.join(ERASING_MODES)}, got {d.get('mode')!r}")
    d["value"] = _fill(d.get("value", 0), f"{key}.value")
    c = d.get("count", 1)
    c = [c, c] if isinstance(c, int) and not isinstance(c, bool) else c
    if (not isinstance(c, (list, tuple)) or len(c) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in c)
            or not 1 <= c[0] <= c[1] <= MAX_ERASE_COUNT):
        raise ConfigError(f"{key}.count", f"must be an integer or [min, max] with 1 <= min <= max <= {MAX_ERASE_COUNT}, got {c!r}")
    d["count"] = (int(c[0]), int(c[1]))
    d["mean"] = _floats(d.get("mean", ErasingConfig.mean), 3, f"{key}.mean", 0.0, 1.0)
    d["std"] = _floats(d.get("std", ErasingConfig.std), 3, f"{key}.std", 0.0, 10.0)
    if d.get("erase_on", "daemon") not in ERASE_ON:
        raise ConfigError(f"{key}.erase_on", f"must be one of {', '.join(ERASE_ON)}, got {d.get('erase_on')!r}")
    if d.get("erase_on") == "client":
        for k in _DAEMON_ONLY_ERASING_KEYS:  # (their defaults pass: a config written back by to_dict loads)
            if k in v and d[k] != getattr(ErasingConfig, k):
                raise ConfigError(f"{key}.{k}", "is for erasing uint8 pixels in the daemon; with erase_on: client the "
                                  "normalised batch is erased as timm does (const: 0, rand and pixel: N(0, 1) noise): "
                                  "remove it, or set erase_on: daemon")
    if "p" not in v and v:  # torchvision's and timm's RandomErasing default to 0.5, this to 0 (off)
        raise ConfigError(f"{key}.p", f"is required with the other random_erasing keys ({', '.join(map(str, v))}): "
                                      "the probability (torchvision's and timm's default 0.5; 0 turns erasing off)")
    mode = d.get("mode", "const")
    if mode != "const" and d["value"] != ErasingConfig.value:
        raise ConfigError(f"{key}.value", f"is const mode's colour, but mode is {mode} (noise from mean and std); "
                                          "remove value or set mode: const")
    if mode == "const" and (d["mean"], d["std"]) != (ErasingConfig.mean, ErasingConfig.std):
        raise ConfigError(f"{key}.{'mean' if d['mean'] != ErasingConfig.mean else 'std'}",
                          "sets the noise of modes rand and pixel, but mode is const (the box is value); "
                          "set mode: rand or pixel, or remove it")
    return ErasingConfig(**d)


@dataclass(frozen=True)
class OpsConfig:
    """``augment.ops``: single ops outside a policy, each with its probability (0: off)."""

    vflip: float = 0.0
    grayscale: float = 0.0
    blur: float = 0.0
    blur_sigma: tuple[float, float] = (0.1, 2.0)
    blur_kernel: int = 23
    solarize: float = 0.0
    solarize_threshold: float = 128.0
    posterize: float = 0.0
    posterize_bits: int = 4


def misplaced_op(key: str, known: list[str], where: str) -> ConfigError | None:
    """An unknown key of ``where`` (``augment`` or a view group, whose keys are ``known``) that is
    an op, or closest to one: said as ``where.ops``' key; None otherwise."""
    ops = list(OpsConfig.__dataclass_fields__)
    if key in ops:  # grayscale beside brightness: an op, one level down
        return ConfigError(f"{where}.{key}", f"is an op: write it under {where}.ops ({where}.ops: {{{key}: ...}})")
    hint = difflib.get_close_matches(key, known + ops, n=1, cutoff=0.5)
    if hint and hint[0] in ops and hint[0] not in known:  # grayscal: the op, not rrc_scale
        return ConfigError(f"{where}.{key}", f"is not a known key (did you mean the op {where}.ops.{hint[0]}?)")
    return None


_JITTER_KEYS = ("brightness", "contrast", "saturation", "hue", "jitter_p")


def ops_config(v: Any, key: str = "augment.ops") -> OpsConfig:
    """``augment.ops`` (or a view group's ``ops``: ``key``) checked: a mapping of OpsConfig's
    keys (or null: none)."""
    if v is None:
        return OpsConfig()
    if isinstance(v, OpsConfig):
        return v
    if not isinstance(v, dict):
        raise ConfigError(key, f"must be a mapping such as {{vflip: 0.5, grayscale: 0.2}}, got {v!r}")
    known = list(OpsConfig.__dataclass_fields__)
    for k in v:
        if k in _JITTER_KEYS:  # the colour jitter's keys sit beside ops, not in it
            parent = key.rpartition(".")[0]
            raise ConfigError(f"{key}.{k}", f"is the colour jitter's, not an op: write it beside ops, as {parent}.{k}")
        if k not in known:
            raise ConfigError(f"{key}.{k}", f"is not an op key; known: {', '.join(known)}")
    d = dict(v)
    for k in ("vflip", "grayscale", "blur", "solarize", "posterize"):
        d[k] = float(_number(d.get(k, 0.0), f"{key}.{k}", 0.0, 1.0))
    d["blur_sigma"] = _floats(d.get("blur_sigma", OpsConfig.blur_sigma), 2, f"{key}.blur_sigma", 1e-3, 100.0)
    if d["blur_sigma"][0] > d["blur_sigma"][1]:
        raise ConfigError(f"{key}.blur_sigma", f"must be [low, high] with low <= high, got {list(d['blur_sigma'])}")
    k = _number(d.get("blur_kernel", 23), f"{key}.blur_kernel", 1, 255, integer=True)
    if k % 2 == 0:
        raise ConfigError(f"{key}.blur_kernel", f"must be odd (torchvision's GaussianBlur), got {k}")
    d["solarize_threshold"] = float(_number(d.get("solarize_threshold", 128.0), f"{key}.solarize_threshold", 0.0, 256.0))
    d["posterize_bits"] = _number(d.get("posterize_bits", 4), f"{key}.posterize_bits", 0, 8, integer=True)
    for op, params in (("blur", ("blur_sigma", "blur_kernel")), ("solarize", ("solarize_threshold",)),
                       ("posterize", ("posterize_bits",))):
        for k in params:  # an op's setting beside its probability 0 would do nothing
            if not d[op] and d.get(k, getattr(OpsConfig, k)) != getattr(OpsConfig, k):
                raise ConfigError(f"{key}.{k}", f"is set but {key}.{op} is 0 (off): set {op} to its probability "
                                                "(1.0: always)")
    return OpsConfig(**d)
