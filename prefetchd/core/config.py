"""Configuration: YAML parsed with ``yaml.safe_load`` into frozen, validated dataclasses.

Every value is checked once, here. An error names the key path, the bad value and what would be
accepted (``buffer.capacity must be a positive integer, got 0``); unknown keys are rejected with
the closest known key suggested. ``config.example.yaml`` documents every key with its default.

This module is part of the pure core: it imports only the standard library and PyYAML, so the
trainer's client can read the same file without pulling in the daemon.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import ipaddress
import json
import math
import os
import re
from dataclasses import dataclass, field, replace
from typing import Any

import yaml

EX_CONFIG = 78  # sysexits.h: configuration error; systemd's RestartPreventExitStatus uses it


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
        raise ConfigError(key, f"must be a number, got {v!r}")
    if lo is not None and v < lo:
        raise ConfigError(key, f"must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise ConfigError(key, f"must be <= {hi}, got {v}")
    return float(v)


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
    return os.path.abspath(os.path.expanduser(s))


# --- sections -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class DatasetConfig:
    root: str | None = None
    file_list: str | None = None
    extensions: tuple[str, ...] = (".jpeg", ".jpg", ".png")
    cache_dir: str | None = None
    one_class: bool = False  # an ImageFolder of one class folder on purpose (labels unused): not refused

    def __post_init__(self) -> None:
        _bool(self.one_class, "dataset.one_class")
        if self.root is None and self.file_list is None:
            raise ConfigError("dataset.root", "is required (an ImageFolder, ImageNet's train tar or a folder of class tars), or set dataset.file_list")
        if self.root is not None and self.file_list is not None:
            raise ConfigError("dataset.file_list", "and dataset.root are exclusive: set one")
        for k in ("root", "file_list", "cache_dir"):
            v = getattr(self, k)
            if v is not None:
                object.__setattr__(self, k, _path(v, f"dataset.{k}"))
        exts = self.extensions
        if isinstance(exts, str) or not isinstance(exts, (list, tuple)) or not exts:
            raise ConfigError("dataset.extensions", f"must be a non-empty list such as [.jpeg, .jpg, .png], got {exts!r}")
        norm = []
        for e in exts:
            e = _str(e, "dataset.extensions").lower()
            norm.append(e if e.startswith(".") else "." + e)
        object.__setattr__(self, "extensions", tuple(norm))


@dataclass(frozen=True)
class LoaderConfig:
    batch_size: int = 256
    seed: int = 0
    epochs: int | None = None
    shuffle: bool = True
    drop_last: bool = True
    world_size: int = 1
    ranks: tuple[int, ...] | str = "all"

    def __post_init__(self) -> None:
        _int(self.batch_size, "loader.batch_size", 1, 1 << 20)
        _int(self.seed, "loader.seed", 0, 2**63 - 1)
        if self.epochs is not None:
            _int(self.epochs, "loader.epochs", 1)
        _bool(self.shuffle, "loader.shuffle")
        _bool(self.drop_last, "loader.drop_last")
        _int(self.world_size, "loader.world_size", 1, 1 << 16)
        ranks = self.ranks
        if ranks == "all":
            ranks = tuple(range(self.world_size))
        elif isinstance(ranks, bool) or isinstance(ranks, int):
            ranks = (ranks,)
        if not isinstance(ranks, (list, tuple)) or not ranks:
            raise ConfigError("loader.ranks", f"must be 'all' or a non-empty list of ranks, got {self.ranks!r}")
        for r in ranks:
            _int(r, "loader.ranks", 0, self.world_size - 1)
        if len(set(ranks)) != len(ranks):
            raise ConfigError("loader.ranks", f"must not repeat a rank, got {list(ranks)}")
        object.__setattr__(self, "ranks", tuple(sorted(ranks)))


@dataclass(frozen=True)
class RayConfig:
    address: str = "auto"
    workers: int = 2
    num_cpus: float = 1.0
    resources: dict = field(default_factory=dict)
    path_map: dict = field(default_factory=dict)
    connect_timeout_s: float = 30.0
    retry_s: float = 30.0
    node_ip_address: str | None = None

    def __post_init__(self) -> None:
        _str(self.address, "workers.ray.address")
        if self.node_ip_address is not None:
            try:
                ipaddress.ip_address(self.node_ip_address)
            except ValueError:
                raise ConfigError("workers.ray.node_ip_address", f"must be an IP address, got {self.node_ip_address!r}") from None
        _int(self.workers, "workers.ray.workers", 1, 100000)
        _float(self.num_cpus, "workers.ray.num_cpus", 0.0, 1024)
        for key, mapping in (("resources", self.resources), ("path_map", self.path_map)):
            if not isinstance(mapping, dict):
                raise ConfigError(f"workers.ray.{key}", f"must be a mapping, got {mapping!r}")
        for k, v in self.resources.items():
            _float(v, f"workers.ray.resources.{k}", 0.0)
        for k, v in self.path_map.items():
            if not (isinstance(k, str) and isinstance(v, str) and os.path.isabs(k) and os.path.isabs(v)):
                raise ConfigError("workers.ray.path_map", f"maps absolute local prefixes to absolute remote ones, got {k!r}: {v!r}")
        _float(self.connect_timeout_s, "workers.ray.connect_timeout_s", 0.1, 3600)
        _float(self.retry_s, "workers.ray.retry_s", 0.0, 86400)
        object.__setattr__(self, "resources", dict(self.resources))
        object.__setattr__(self, "path_map", dict(self.path_map))

    def map_path(self, path: str) -> str:
        """The path a remote worker reads for a local path (longest matching prefix wins)."""
        for local in sorted(self.path_map, key=len, reverse=True):
            if path == local or path.startswith(local.rstrip("/") + "/"):
                return self.path_map[local] + path[len(local.rstrip("/")):]
        return path


EXECUTORS = ("local", "ray", "mixed")


@dataclass(frozen=True)
class WorkersConfig:
    count: int | str = "auto"
    reserve_cores: int = 0
    max_tasks_in_flight: int = 2
    # a worker that holds one batch longer than this (a decode hung on a dead NFS server, a
    # stopped process) is killed and replaced, and the batch made again
    task_timeout_s: float = 120.0
    executor: str = "local"
    ray: RayConfig | dict = field(default_factory=RayConfig)

    def __post_init__(self) -> None:
        _choice(self.executor, "workers.executor", EXECUTORS)
        if isinstance(self.ray, dict):
            known = [f.name for f in dataclasses.fields(RayConfig)]
            for k in self.ray:
                if k not in known:
                    raise _unknown(str(k), known, "workers.ray")
            object.__setattr__(self, "ray", RayConfig(**self.ray))
        elif not isinstance(self.ray, RayConfig):
            raise ConfigError("workers.ray", f"must be a mapping, got {self.ray!r}")
        if self.count != "auto":
            if isinstance(self.count, str):
                raise ConfigError("workers.count", f"must be a positive integer or 'auto', got {self.count!r}")
            _int(self.count, "workers.count", 1, 1024)
        _int(self.reserve_cores, "workers.reserve_cores", 0)
        _int(self.max_tasks_in_flight, "workers.max_tasks_in_flight", 1, 16)
        _float(self.task_timeout_s, "workers.task_timeout_s", 0.1)

    def resolved_count(self) -> int:
        if self.count != "auto":
            return int(self.count)
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            cores = os.cpu_count() or 1
        return max(1, cores - self.reserve_cores)


@dataclass(frozen=True)
class BufferConfig:
    dir: str = "/run/prefetchd"
    capacity: int = 64
    refill_at: int | None = None
    max_bytes: int | str = "8GiB"
    min_free_bytes: int | str = "256MiB"
    group: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dir", _path(self.dir, "buffer.dir"))
        _int(self.capacity, "buffer.capacity", 1, 1 << 20)
        refill = self.refill_at
        if refill is None:
            refill = max(1, (self.capacity * 3) // 4)
        _int(refill, "buffer.refill_at", 1)
        if refill > self.capacity:
            raise ConfigError("buffer.refill_at", f"must be <= buffer.capacity ({self.capacity}), got {refill}")
        object.__setattr__(self, "refill_at", refill)
        object.__setattr__(self, "max_bytes", parse_size(self.max_bytes, "buffer.max_bytes"))
        object.__setattr__(self, "min_free_bytes", parse_size(self.min_free_bytes, "buffer.min_free_bytes"))
        if self.group is not None:
            _str(self.group, "buffer.group")


@dataclass(frozen=True)
class ProgressConfig:
    dir: str | None = None
    poll_interval_s: float = 0.5
    inotify: bool = True

    def __post_init__(self) -> None:
        if self.dir is not None:
            object.__setattr__(self, "dir", _path(self.dir, "progress.dir"))
        _float(self.poll_interval_s, "progress.poll_interval_s", 0.01, 60)
        _bool(self.inotify, "progress.inotify")


AUGMENT_MODES = ("scale", "random_resized_crop", "eval")
INTERPOLATIONS = ("nearest", "bilinear", "bicubic", "lanczos", "area")
DECODERS = ("auto", "pillow")
DECODE_MODES = ("cpu", "hybrid", "gpu")


@dataclass(frozen=True)
class AugmentConfig:
    mode: str = "scale"
    output_size: int = 224
    scale_min: int = 256
    scale_max: int = 480
    rrc_scale: tuple[float, float] = (0.08, 1.0)
    rrc_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    eval_resize: int = 256
    flip: bool = True
    brightness: float = 0.0
    contrast: float = 0.0
    saturation: float = 0.0
    lighting: float = 0.0
    interpolation: str = "bilinear"
    decoder: str = "auto"
    decode: str = "cpu"
    gpu_share: float = 0.5

    def __post_init__(self) -> None:
        _choice(self.mode, "augment.mode", AUGMENT_MODES)
        _int(self.output_size, "augment.output_size", 8, 4096)
        _int(self.scale_min, "augment.scale_min", 1, 1 << 14)
        _int(self.scale_max, "augment.scale_max", 1, 1 << 14)
        if self.scale_min > self.scale_max:
            raise ConfigError("augment.scale_min", f"must be <= augment.scale_max ({self.scale_max}), got {self.scale_min}")
        if self.mode == "scale" and self.scale_min < self.output_size:
            raise ConfigError("augment.scale_min", f"must be >= augment.output_size ({self.output_size}) so the crop fits, got {self.scale_min}")
        object.__setattr__(self, "rrc_scale", _pair(self.rrc_scale, "augment.rrc_scale", 1e-6, 1.0))
        object.__setattr__(self, "rrc_ratio", _pair(self.rrc_ratio, "augment.rrc_ratio", 1e-3, 1e3))
        _int(self.eval_resize, "augment.eval_resize", 1, 1 << 14)
        if self.mode == "eval" and self.eval_resize < self.output_size:
            raise ConfigError("augment.eval_resize", f"must be >= augment.output_size ({self.output_size}), got {self.eval_resize}")
        _bool(self.flip, "augment.flip")
        for k in ("brightness", "contrast", "saturation"):
            object.__setattr__(self, k, _float(getattr(self, k), f"augment.{k}", 0.0, 1.0))
        object.__setattr__(self, "lighting", _float(self.lighting, "augment.lighting", 0.0, 10.0))
        _choice(self.interpolation, "augment.interpolation", INTERPOLATIONS)
        _choice(self.decoder, "augment.decoder", DECODERS)
        _choice(self.decode, "augment.decode", DECODE_MODES)
        share = _float(self.gpu_share, "augment.gpu_share", 0.0, 1.0)
        if share <= 0.0:
            raise ConfigError("augment.gpu_share", f"must be > 0 and <= 1 (use augment.decode: cpu for none), got {share}")
        object.__setattr__(self, "gpu_share", share)

    def stream_dict(self) -> dict[str, Any]:
        """The keys that change the stream's bytes; the decode keys only where they are used, so
        configs written before they existed keep their fingerprint."""
        d = dataclasses.asdict(self)
        if self.decode != "hybrid":
            d.pop("gpu_share")
        if self.decode == "cpu":
            d.pop("decode")
        return d


@dataclass(frozen=True)
class ClientConfig:
    echo_factor: int = 1
    prefetch: int = 2

    def __post_init__(self) -> None:
        _int(self.echo_factor, "client.echo_factor", 1, 16)
        _int(self.prefetch, "client.prefetch", 1, 64)


@dataclass(frozen=True)
class MetricsConfig:
    enabled: bool = False
    address: str = "127.0.0.1"
    port: int = 9464

    def __post_init__(self) -> None:
        _bool(self.enabled, "metrics.enabled")
        _str(self.address, "metrics.address")
        try:
            ipaddress.ip_address(self.address)
        except ValueError:
            raise ConfigError("metrics.address", f"must be an IP address such as 127.0.0.1, got {self.address!r}") from None
        _int(self.port, "metrics.port", 0, 65535)


@dataclass(frozen=True)
class LogConfig:
    level: str = "info"

    def __post_init__(self) -> None:
        _choice(self.level, "log.level", ("debug", "info", "warning", "error"))


@dataclass(frozen=True)
class ValidationConfig:
    """The validation stream: the same daemon, eval augmentation, no shuffle, every sample once per
    pass. ``batch_size``, ``resize``, ``capacity`` default from the other sections (by ``Config``)."""

    enabled: bool = False
    root: str | None = None
    file_list: str | None = None
    devkit: str | None = None  # ImageNet's devkit: labels a flat validation tar or folder
    batch_size: int | None = None
    resize: int | None = None
    capacity: int | None = None

    def __post_init__(self) -> None:
        _bool(self.enabled, "validation.enabled")
        for k in ("root", "file_list", "devkit"):
            v = getattr(self, k)
            if v is not None:
                object.__setattr__(self, k, _path(v, f"validation.{k}"))
        if self.enabled and self.root is None and self.file_list is None:
            raise ConfigError("validation.root", "is required with validation.enabled (an ImageFolder with the train set's "
                              "class folders, or the flat validation tar with validation.devkit), or set validation.file_list")
        if self.root is not None and self.file_list is not None:
            raise ConfigError("validation.file_list", "and validation.root are exclusive: set one")
        if self.batch_size is not None:
            _int(self.batch_size, "validation.batch_size", 1, 1 << 16)
        if self.resize is not None:
            _int(self.resize, "validation.resize", 1, 1 << 14)
        if self.capacity is not None:
            _int(self.capacity, "validation.capacity", 1, 1 << 20)


@dataclass(frozen=True)
class Config:
    dataset: DatasetConfig
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    progress: ProgressConfig = field(default_factory=ProgressConfig)
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    client: ClientConfig = field(default_factory=ClientConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    log: LogConfig = field(default_factory=LogConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    source: str | None = None

    def __post_init__(self) -> None:
        v = self.validation  # defaults that depend on the other sections
        size = self.augment.output_size
        v = replace(v, batch_size=v.batch_size or self.loader.batch_size,
                    resize=v.resize or -(-size * 256 // 224), capacity=v.capacity or self.buffer.capacity)
        if v.resize < size:
            raise ConfigError("validation.resize", f"must be >= augment.output_size ({size}), got {v.resize}")
        object.__setattr__(self, "validation", v)

    def val_augment(self) -> AugmentConfig:
        """The validation stream's augmentation: shorter side to ``validation.resize``, centre crop.
        Always decoded on the CPU (a pass is a small share of the work, and its files keep the
        pixel batch's fixed size, so ``max_bytes`` holds exactly)."""
        return replace(self.augment, mode="eval", eval_resize=self.validation.resize, flip=False, decode="cpu",
                       brightness=0.0, contrast=0.0, saturation=0.0, lighting=0.0)

    def val_stream_fingerprint(self) -> str:
        """As ``stream_fingerprint`` for the validation stream (the val dataset is added by the daemon)."""
        d = {"stream": "val", "train": self.stream_fingerprint(), "batch_size": self.validation.batch_size,
             "augment": self.val_augment().stream_dict()}
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=list).encode()).hexdigest()[:16]

    @property
    def progress_dir(self) -> str:
        # a directory of their own: watching the whole buffer would wake the daemon for every
        # batch file written, renamed and deleted (about 4% of a core, measured)
        return self.progress.dir or os.path.join(self.buffer.dir, "progress")

    def stream_fingerprint(self, **loader: Any) -> str:
        """Hash of every setting that changes the bytes of the batch stream (the dataset's own
        fingerprint is added by the daemon). Worker count, capacity and paths are not in it.
        ``loader`` overrides batch_size, drop_last or world_size (another job's, for a resume)."""
        keys = ("batch_size", "seed", "shuffle", "drop_last", "world_size")
        d = {"loader": {k: loader.get(k, getattr(self.loader, k)) for k in keys}, "augment": self.augment.stream_dict()}
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=list).encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("source")
        return d


_SECTIONS: dict[str, type] = {
    "dataset": DatasetConfig,
    "loader": LoaderConfig,
    "workers": WorkersConfig,
    "buffer": BufferConfig,
    "progress": ProgressConfig,
    "augment": AugmentConfig,
    "client": ClientConfig,
    "metrics": MetricsConfig,
    "log": LogConfig,
    "validation": ValidationConfig,
}


def _unknown(key: str, known: list[str], where: str) -> ConfigError:
    hint = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
    full = f"{where}.{key}" if where else key
    msg = f"is not a known key (did you mean {(where + '.' if where else '') + hint[0]!r}?)" if hint else (
        f"is not a known key; known keys here: {', '.join(known)}")
    return ConfigError(full, msg)


def from_dict(data: Any, source: str | None = None) -> Config:
    """Build a validated Config from a plain dict (as YAML gives it)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("", f"the config must be a YAML mapping of sections, got {type(data).__name__}")
    sections: dict[str, Any] = {}
    for name, body in data.items():
        if not isinstance(name, str) or name not in _SECTIONS:
            raise _unknown(str(name), list(_SECTIONS), "")
        if body is None:
            body = {}
        if not isinstance(body, dict):
            raise ConfigError(name, f"must be a mapping of keys, got {body!r}")
        cls = _SECTIONS[name]
        known = [f.name for f in dataclasses.fields(cls)]
        for k in body:
            if k not in known:
                raise _unknown(str(k), known, name)
        try:
            sections[name] = cls(**body)
        except TypeError as e:  # pragma: no cover - all keys checked above
            raise ConfigError(name, str(e)) from None
    if "dataset" not in sections:
        raise ConfigError("dataset.root", "is required (an ImageFolder root/<class>/<image>)")
    return Config(**sections, source=source)


def load(path: str) -> Config:
    """Read and validate a YAML config file. Raises ConfigError with a one-line message."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError("", f"cannot read config file {path}: {e.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:  # the line, its text, what is wrong in words: core/yamlerror.py
        from prefetchd.core.yamlerror import explain

        raise ConfigError("", explain(e, text, path)) from None
    base = os.path.dirname(os.path.abspath(path))
    if isinstance(data, dict):
        data = _resolve_relative(data, base)
    return from_dict(data, source=os.path.abspath(path))


def _resolve_relative(data: dict, base: str) -> dict:
    """Relative paths in the file are relative to the file, not to the daemon's cwd."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    for sec, key in (("dataset", "root"), ("dataset", "file_list"), ("dataset", "cache_dir"),
                     ("validation", "root"), ("validation", "file_list"), ("validation", "devkit"),
                     ("buffer", "dir"), ("progress", "dir")):
        body = out.get(sec)
        if isinstance(body, dict) and isinstance(body.get(key), str):
            p = os.path.expanduser(body[key])
            if not os.path.isabs(p):
                body[key] = os.path.join(base, p)
    return out


def reload_blockers(old: Config, new: Config) -> str | None:
    """What keeps ``new`` from being applied to a running daemon by SIGHUP (restart keys that
    changed), or None."""
    if new.stream_fingerprint() != old.stream_fingerprint():
        diffs = [f"loader.{k}" for k in ("batch_size", "seed", "shuffle", "drop_last", "world_size")
                 if getattr(new.loader, k) != getattr(old.loader, k)]
        diffs += ["augment.*"] if new.augment != old.augment else []
        return ", ".join(diffs) or "the stream"
    if new.dataset != old.dataset:
        return "dataset.*"
    if new.loader != old.loader:
        return "loader.ranks/epochs"
    if replace(new.validation, capacity=None) != replace(old.validation, capacity=None):
        return "validation.enabled/root/file_list/devkit/batch_size/resize"
    if new.buffer.dir != old.buffer.dir or new.buffer.group != old.buffer.group:
        return "buffer.dir/group"
    if new.progress.dir != old.progress.dir:
        return "progress.dir"
    return None
