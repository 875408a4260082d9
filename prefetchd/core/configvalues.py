"""Configuration values: the error every check raises, sizes, and one small validator per kind.

Each validator takes the value and its key path and raises ``ConfigError`` with a one-line message
naming the key, the bad value and what would be accepted. Part of the pure core (standard library
only), shared by ``core.configsections`` and ``core.config``.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import stat
from typing import Any


class ConfigError(ValueError):
    """A configuration value is invalid. ``str(err)`` is a one-line message naming the key."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key} {message}" if key else message)


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?i?b?)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1024, "ki": 1024,
    "m": 1000**2, "mb": 1000**2, "mib": 1024**2, "mi": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "gi": 1024**3,
    "t": 1000**4, "tb": 1000**4, "tib": 1024**4, "ti": 1024**4,
}


def parse_size(value: Any, key: str) -> int:
    """``8GiB``, ``512MB``, ``1.5G`` or a plain integer number of bytes."""
    if isinstance(value, bool):
        raise ConfigError(key, f"must be a size such as 8GiB or 512MB, got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ConfigError(key, f"must be a positive size, got {value}")
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        unit = (m.group(2) or "").lower() if m else None
        if m and unit in _SIZE_UNITS:
            n = int(float(m.group(1)) * _SIZE_UNITS[unit])
            if n > 0:
                return n
    raise ConfigError(key, f"must be a size such as 8GiB, 512MB or a number of bytes, got {value!r}")


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # unreachable


# --- small validators: each raises ConfigError naming the key ---------------------------------


def _int(v: Any, key: str, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(key, f"must be an integer, got {v!r}")
    if lo is not None and v < lo:
        what = "a positive integer" if lo == 1 else f"an integer >= {lo}"
        raise ConfigError(key, f"must be {what}, got {v}")
    if hi is not None and v > hi:
        raise ConfigError(key, f"must be an integer <= {hi}, got {v}")
    return v


def _float(v: Any, key: str, lo: float | None = None, hi: float | None = None) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ConfigError(key, f"must be a number, got {v!r}{_text_number(v)}")
    if lo is not None and v < lo:
        raise ConfigError(key, f"must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise ConfigError(key, f"must be <= {hi}, got {v}")
    return float(v)


def jitter_strength(v: Any, key: str, hi: float) -> float:
    """A colour jitter strength (``brightness``, ``contrast``, ``saturation``: factors in
    ``[1-x, 1+x]``; ``hue``: a shift in ``[-x, x]``) as one number; torchvision's ``(min, max)``
    form is said as the number it stands for, or as a range not made here."""
    if isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                           for x in v):
        hue = key.endswith("hue")
        centre, form = (0.0, "[-x, x]") if hue else (1.0, "[1-x, 1+x]")
        x = (v[1] - v[0]) / 2
        if not math.isclose((v[0] + v[1]) / 2, centre, abs_tol=1e-9):
            raise ConfigError(key, f"must be one number x, for {form} (centred on {centre:g}); {list(v)} is off "
                              "centre, which torchvision's (min, max) form allows and this does not")
        if x < 0:
            raise ConfigError(key, f"must be one number x, for {form}: {list(v)} is a (min, max) range written "
                              f"backwards; as one number: {-x:g}")
        if x > hi:
            raise ConfigError(key, f"must be one number x, for {form}, at most {hi:g}: {list(v)} is torchvision's "
                              f"(min, max) form of {key.rpartition('.')[2]}: {x:g}, past what it allows")
        raise ConfigError(key, f"must be one number x, for {form}: {list(v)} is torchvision's (min, max) form "
                          f"of {key.rpartition('.')[2]}: {x:g}; write that")
    return _float(v, key, 0.0, hi)


def _text_number(v: Any) -> str:
    """Why a number arrived as text: quoted, or YAML 1.1's exponent without a dot (1e-1 is text)."""
    try:
        x = float(v) if isinstance(v, str) else None
    except ValueError:
        return ""
    if x is None or not math.isfinite(x):
        return ""
    if "e" in v.lower() and "." not in v:
        return f" (YAML reads an exponent without a dot as text: write {x!r})"
    return f" (YAML read it as text: write {x!r} unquoted)"


def _bool(v: Any, key: str) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(key, f"must be true or false, got {v!r}")
    return v


def _str(v: Any, key: str, allow_empty: bool = False) -> str:
    if not isinstance(v, str) or (not allow_empty and not v.strip()):
        raise ConfigError(key, f"must be a non-empty string, got {v!r}")
    return v


def _choice(v: Any, key: str, choices: tuple[str, ...]) -> str:
    if v not in choices:
        hint = difflib.get_close_matches(str(v), choices, n=1)
        extra = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise ConfigError(key, f"must be one of {', '.join(choices)}, got {v!r}{extra}")
    return v


def _pair(v: Any, key: str, lo: float, hi: float) -> tuple[float, float]:
    if not isinstance(v, (list, tuple)) or len(v) != 2:
        raise ConfigError(key, f"must be a list of two numbers [low, high], got {v!r}")
    a, b = (_float(x, key, lo, hi) for x in v)
    if a > b:
        raise ConfigError(key, f"must be [low, high] with low <= high, got {list(v)}")
    return (a, b)


def _path(v: Any, key: str) -> str:
    s = _str(v, key)
    if "://" in s:  # a bucket URL (s3://, gs://): sources/objectstore.py says which it reads
        return s
    return os.path.abspath(os.path.expanduser(s))


# timm's train.py arguments (and torchvision's names) as users carry them into the augment section:
# the closest spelling would mislead (remode -> mode, scale -> scale_min, hflip -> flip as a bool)
PORTED_AUGMENT_KEYS = {
    "aa": "augment.policy (a timm string such as rand-m9-mstd0.5-inc1, or randaugment)",
    "auto_augment": "augment.policy (a timm string such as rand-m9-mstd0.5-inc1, or randaugment)",
    "reprob": "augment.random_erasing.p", "remode": "augment.random_erasing.mode",
    "recount": "augment.random_erasing.count",
    "scale": "augment.rrc_scale (the crop's area fraction, [0.08, 1.0])",
    "ratio": "augment.rrc_ratio (the crop's aspect, [0.75, 1.333])",
    "color_jitter": "augment.brightness, augment.contrast and augment.saturation (each x: factors in [1-x, 1+x]; "
                    "a 4th value is augment.hue)",
    # create_transform's arguments (timm 1.x), beside train.py's flags
    "color_jitter_prob": "augment.jitter_p", "grayscale_prob": "augment.ops.grayscale",
    "gaussian_blur_prob": "augment.ops.blur", "re_prob": "augment.random_erasing.p",
    "re_mode": "augment.random_erasing.mode", "re_count": "augment.random_erasing.count",
    "hflip": "augment.flip (true: a horizontal flip with probability 0.5)", "vflip": "augment.ops.vflip",
    "train_interpolation": "augment.interpolation",
}


def _unknown(key: str, known: list[str], where: str) -> ConfigError:
    full = f"{where}.{key}" if where else key
    if where == "augment" and key in PORTED_AUGMENT_KEYS:
        return ConfigError(full, f"is not a known key; timm's {key} is {PORTED_AUGMENT_KEYS[key]} here")
    hint = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
    msg = f"is not a known key (did you mean {(where + '.' if where else '') + hint[0]!r}?)" if hint else (
        f"is not a known key; known keys here: {', '.join(known)}")
    return ConfigError(full, msg)


def lists_objects(file_list: str | None) -> bool:
    """Does the local file list ``file_list`` name objects in a bucket (its first path an ``s3://`` or
    ``gs://`` URL: ``sources/bucketlist.py``)?"""
    try:
        if not stat.S_ISREG(os.stat(file_list or "").st_mode):
            return False  # a FIFO (a list made on the fly): a peek would take the lines its one reader gets
        with open(file_list or "", "rb") as f:
            head = f.read(4096)
    except OSError:
        return False  # the scan says why
    for line in head.splitlines():
        line = line.strip()
        if line and not line.startswith(b"#"):
            return line.startswith((b"s3://", b"gs://"))
    return False
