"""Configuration: YAML parsed with ``yaml.safe_load`` into frozen, validated dataclasses.

Every value is checked once, by its section's dataclass (``core.configsections``, with the
validators of ``core.configvalues``); this module assembles the sections. An error names the key path, the bad value and what would be
accepted (``buffer.capacity must be a positive integer, got 0``); unknown keys are rejected with
the closest known key suggested. ``config.example.yaml`` documents every key with its default.

This module is part of the pure core: it imports only the standard library and PyYAML, so the
trainer's client can read the same file without pulling in the daemon.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field, replace
from typing import Any

import yaml

from prefetchd.core.bufferdir import default_buffer_dir
from prefetchd.core.configsections import (  # noqa: F401 - re-exported: the public names stay here
    AUGMENT_MODES,
    DECODE_MODES,
    DECODERS,
    EXECUTORS,
    INTERPOLATIONS,
    AugmentConfig,
    BufferConfig,
    ClientConfig,
    DatasetConfig,
    LoaderConfig,
    LogConfig,
    MetricsConfig,
    ProgressConfig,
    RayConfig,
    ValidationConfig,
    WorkersConfig,
)
from prefetchd.core.configvalues import ConfigError, _unknown, format_size, parse_size  # noqa: F401
from prefetchd.core.policyspec import misplaced_op

EX_CONFIG = 78  # sysexits.h: configuration error; systemd's RestartPreventExitStatus uses it
EX_TEMPFAIL = 75  # sysexits.h: try again later (the bucket did not answer at start); Restart=on-failure restarts


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
                    resize=v.resize or -(-size * 256 // 224), capacity=v.capacity or self._train_capacity())
        if v.resize < size:
            raise ConfigError("validation.resize", f"must be >= augment.output_size ({size}), got {v.resize}")
        object.__setattr__(self, "validation", v)
        c = self.dataset.cache
        if c and self.buffer.dir:
            d, b = os.path.realpath(c["dir"]), os.path.realpath(self.buffer.dir)
            if d == b or d.startswith(b + os.sep) or b.startswith(d + os.sep):
                raise ConfigError("dataset.cache.dir", f"{c['dir']} is in buffer.dir {self.buffer.dir} (the batch ring, "
                                  "in RAM) or holds it: set it to a folder on a local disk outside it")

    def _train_capacity(self) -> int:
        c = self.buffer.capacity
        return c if isinstance(c, int) else 64  # capacity: auto starts at today's default (core.limits)

    def val_augment(self) -> AugmentConfig:
        """The validation stream's augmentation: shorter side to ``validation.resize``, centre crop.
        Always decoded on the CPU (a pass is a small share of the work, and its files keep the
        pixel batch's fixed size, so ``max_bytes`` holds exactly)."""
        return replace(self.augment, mode="eval", eval_resize=self.validation.resize, flip=False, decode="cpu",
                       brightness=0.0, contrast=0.0, saturation=0.0, hue=0.0, jitter_p=1.0, lighting=0.0,
                       transform=None, transform_args={}, transform_path=None, views=(),
                       policy="none", policy_args={}, random_erasing=None, ops=None)

    def val_stream_fingerprint(self) -> str:
        """As ``stream_fingerprint`` for the validation stream (the val dataset is added by the daemon)."""
        d = {"stream": "val", "train": self.stream_fingerprint(), "batch_size": self.validation.batch_size,
             "pad": self.validation.pad,
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
        mine = {**{k: getattr(self.loader, k) for k in keys}, "shuffle": self.loader.shuffle_key()}
        d = {"loader": {k: loader.get(k, mine[k]) for k in keys}, "augment": self.augment.stream_dict()}
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
                raise (name == "augment" and misplaced_op(str(k), known, name)) or _unknown(str(k), known, name)
        try:
            sections[name] = cls(**body)
        except TypeError as e:  # pragma: no cover - all keys checked above
            raise ConfigError(name, str(e)) from None
    if "dataset" not in sections:
        raise ConfigError("dataset.root", "is required (an ImageFolder root/<class>/<image>)")
    buffer = sections.get("buffer", BufferConfig())
    if buffer.dir is None:  # per user and config under $XDG_RUNTIME_DIR, root's /run/prefetchd, or one line
        real = os.path.realpath(source) if source else None
        sections["buffer"] = replace(buffer, dir=default_buffer_dir(os.environ, os.geteuid(), real))
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
    for sec, key in (("dataset", "root"), ("dataset", "file_list"), ("dataset", "cache_dir"), ("augment", "transform_path"),
                     ("validation", "root"), ("validation", "file_list"), ("validation", "devkit"),
                     ("buffer", "dir"), ("progress", "dir")):
        body = out.get(sec)
        if isinstance(body, dict) and isinstance(body.get(key), str):
            p = os.path.expanduser(body[key])
            if not os.path.isabs(p) and "://" not in p:  # a bucket URL is no path
                body[key] = os.path.join(base, p)
    return out


def reload_blockers(old: Config, new: Config) -> str | None:
    """What keeps ``new`` from being applied to a running daemon by SIGHUP (restart keys that
    changed), or None."""
    if new.stream_fingerprint() != old.stream_fingerprint():
        diffs = [f"loader.{k}" for k in ("batch_size", "seed", "shuffle", "shuffle_window", "drop_last", "world_size")
                 if getattr(new.loader, k) != getattr(old.loader, k)]
        diffs += ["augment.*"] if new.augment != old.augment else []
        return ", ".join(diffs) or "the stream"
    if new.dataset != old.dataset:
        return "dataset.*"
    if new.loader != old.loader:
        return "loader.ranks/epochs"
    if replace(new.validation, capacity=None) != replace(old.validation, capacity=None):
        return "validation.enabled/root/file_list/devkit/batch_size/resize"
    W, V = new.workers, old.workers  # set when the workers and the Ray bridge start, not after
    if (W.priority, W.executor, W.ray) != (V.priority, V.executor, V.ray):
        return "workers.priority/executor/ray"
    if new.buffer.dir != old.buffer.dir or new.buffer.group != old.buffer.group:
        return "buffer.dir/group"
    if new.progress.dir != old.progress.dir:
        return "progress.dir"
    return None
