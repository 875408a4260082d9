"""Configuration sections: one frozen dataclass per YAML section, each checking its own keys.

``core.config`` assembles them into ``Config``; the defaults here are those ``config.example.yaml``
documents. Part of the pure core (standard library only).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from prefetchd.core.augment.viewspec import (
    ViewGroup,
    as_dicts,
    erasing_meta,
    jitter_p_alone,
    parse_views,
)
from prefetchd.core.configvalues import (
    ConfigError,
    _bool,
    _choice,
    _float,
    _int,
    _pair,
    _path,
    _str,
    _unknown,
    jitter_strength,
    lists_objects,
    parse_size,
)
from prefetchd.core.policyspec import (
    ErasingConfig,
    OpsConfig,
    erasing_config,
    ops_config,
    policy_spec,
)

IMAGE_EXTENSIONS = (".jpeg", ".jpg", ".png")  # dataset.extensions' default
LAYOUTS = ("auto", "imagefolder", "imagenet_tars", "webdataset", "parquet")  # dataset.layout (sources/dataset.py)


@dataclass(frozen=True)
class DatasetConfig:
    root: str | None = None
    file_list: str | None = None
    extensions: tuple[str, ...] = IMAGE_EXTENSIONS  # shards: .jpg .jpeg .png .webp unless set (sources/webdataset.py)
    cache_dir: str | None = None
    one_class: bool = False  # an ImageFolder of one class folder on purpose (labels unused): not refused
    layout: str = "auto"  # LAYOUTS: auto tells them apart (prefetchd check says what it found)
    label: str = "cls"  # shards' label: cls (the .cls/.txt member), json:KEY, or none (-1)
    image_column: str = "image"  # Parquet: the image column (struct<bytes, path> or binary)
    label_column: str = "label"  # Parquet: the label column (integers)
    # a bucket root's client options beyond the environment's (sources/objectstore.py); may hold a secret: no repr
    storage_options: dict = field(default_factory=dict, repr=False)
    # a node-local cache of a bucket's fetched bytes, {dir, max_bytes} (sources/bytecache.py); {}: none
    cache: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        _bool(self.one_class, "dataset.one_class")
        self._check_cache()
        so = self.storage_options
        if so is None:
            object.__setattr__(self, "storage_options", {})
        elif not isinstance(so, dict) or not all(isinstance(k, str) and (isinstance(v, (str, int, float, bool)) or (
                k == "client_options" and isinstance(v, dict))) for k, v in so.items()):
            raise ConfigError("dataset.storage_options", "must be a mapping of obstore's option names to values "
                              "(access_key_id, endpoint, region, ...; client_options a mapping), e.g. "
                              "{endpoint: https://s3.example.com, region: us-east-1}")
        if self.layout not in LAYOUTS:
            raise ConfigError("dataset.layout", f"must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        lab = self.label
        if not isinstance(lab, str) or not (lab in ("cls", "none") or (lab.startswith("json:") and len(lab) > 5)):
            raise ConfigError("dataset.label", f"must be cls, json:KEY (the label's key in each sample's .json) or "
                              f"none (unlabelled: -1), got {lab!r}")
        for k in ("image_column", "label_column"):
            if not isinstance(getattr(self, k), str) or not getattr(self, k):
                raise ConfigError(f"dataset.{k}", f"must be a column name, got {getattr(self, k)!r}")
        if self.layout == "webdataset" and self.file_list is not None:
            raise ConfigError("dataset.layout", "webdataset reads shards named by dataset.root, not dataset.file_list")
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

    def _check_cache(self) -> None:
        c = self.cache
        if not c:
            object.__setattr__(self, "cache", {})
            return
        if not isinstance(c, dict) or set(c) != {"dir", "max_bytes"}:
            raise ConfigError("dataset.cache", f"must be {{dir: a folder on a local disk, max_bytes: a size such as "
                              f"100GiB}}, got {c!r}")
        if "://" not in (self.root or self.file_list or "") and not lists_objects(self.file_list):
            raise ConfigError("dataset.cache", "keeps a bucket's fetched bytes on a local disk, and dataset.root is "
                              "not a bucket URL: remove dataset.cache")
        size = parse_size(c["max_bytes"], "dataset.cache.max_bytes")
        if size <= 0:
            raise ConfigError("dataset.cache.max_bytes", f"must be a positive size such as 100GiB, got {c['max_bytes']!r}")
        object.__setattr__(self, "cache", {"dir": _path(c["dir"], "dataset.cache.dir"), "max_bytes": size})

    def index_options(self, validation: bool = False) -> dict:
        """``sources.dataset.load_index``'s keyword arguments from this section (the validation set's
        layout is told by itself: ``auto``)."""
        return {"one_class": self.one_class, "label": self.label, "image_column": self.image_column,
                "label_column": self.label_column, "storage_options": self.storage_options or None,
                "cache": self.cache or None, **({} if validation else {"layout": self.layout})}


@dataclass(frozen=True)
class LoaderConfig:
    batch_size: int = 256
    seed: int = 0
    epochs: int | None = None
    shuffle: bool | str = True  # true: a permutation of the samples; false: in order; "block" (core.sampler)
    drop_last: bool = True
    world_size: int = 1
    ranks: tuple[int, ...] | str = "all"
    shuffle_window: int = 8  # shuffle "block": blocks (Parquet row groups) whose samples are permuted together

    def __post_init__(self) -> None:
        _int(self.batch_size, "loader.batch_size", 1, 1 << 20)
        _int(self.seed, "loader.seed", 0, 2**63 - 1)
        if self.epochs is not None:
            _int(self.epochs, "loader.epochs", 1)
        if self.shuffle != "block":
            if not isinstance(self.shuffle, bool):
                raise ConfigError("loader.shuffle", f"must be true, false or block (a permutation of Parquet row groups, "
                                  f"then of the rows within a window of loader.shuffle_window groups), got {self.shuffle!r}")
        _int(self.shuffle_window, "loader.shuffle_window", 1, 1 << 20)
        if self.shuffle != "block" and self.shuffle_window != LoaderConfig.shuffle_window:  # it would do nothing
            raise ConfigError("loader.shuffle_window", f"({self.shuffle_window}) is the window of loader.shuffle: "
                              f"block, and loader.shuffle is {str(self.shuffle).lower()}: set shuffle: block (Parquet) "
                              "or remove shuffle_window")
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


    def shuffle_key(self) -> bool | str:
        """``shuffle`` as the stream's identity holds it: the window counts only for a block shuffle
        (configs without one keep the fingerprint they had)."""
        return f"block:{self.shuffle_window}" if self.shuffle == "block" else self.shuffle

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
        if _str(self.address, "workers.ray.address").strip().lower() == "local":  # its processes outlive a killed bridge
            raise ConfigError("workers.ray.address", "'local' would start a Ray cluster in the daemon; start one "
                              "(ray start --head) and give its host:port")
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
# the local workers' CPU priority below the trainers' (executors.priority says what each does)
PRIORITIES = ("idle", "batch", "nice", "normal")


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
    priority: str = "idle"

    def __post_init__(self) -> None:
        _choice(self.priority, "workers.priority", PRIORITIES)
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
        """The number of workers: ``count``, or for ``auto`` what ``core.limits.auto_workers`` makes
        of this node's affinity mask, cpuset and CPU quota, less ``reserve_cores``."""
        if self.count != "auto":
            return int(self.count)
        from prefetchd.core.hostread import read_host
        from prefetchd.core.limits import auto_workers

        return auto_workers(read_host(), self.reserve_cores)[0]


@dataclass(frozen=True)
class BufferConfig:
    dir: str | None = None  # None: core.bufferdir.default_buffer_dir, resolved by core.config.from_dict
    capacity: int | str = 64  # or "auto": lead_s of consumption (core.limits.auto_capacity)
    refill_at: int | None = None
    max_bytes: int | str = "auto"  # core.limits.auto_max_bytes: least of the disk and memory limits
    min_free_bytes: int | str = "256MiB"
    group: str | None = None
    lead_s: float = 60.0  # capacity: auto keeps this many seconds of each rank's consumption ready

    def __post_init__(self) -> None:
        if self.dir is not None:
            object.__setattr__(self, "dir", _path(self.dir, "buffer.dir"))
        _float(self.lead_s, "buffer.lead_s", 1.0, 86400)
        refill = self.refill_at
        if self.capacity == "auto":  # made a number by core.sizing, refill_at with it unless set
            if refill is not None:
                _int(refill, "buffer.refill_at", 1)
        else:
            if isinstance(self.capacity, str):
                raise ConfigError("buffer.capacity", f"must be a positive integer or 'auto', got {self.capacity!r}")
            _int(self.capacity, "buffer.capacity", 1, 1 << 20)
            if refill is None:
                refill = max(1, (self.capacity * 3) // 4)
            _int(refill, "buffer.refill_at", 1)
            if refill > self.capacity:
                raise ConfigError("buffer.refill_at", f"must be <= buffer.capacity ({self.capacity}), got {refill}")
        object.__setattr__(self, "refill_at", refill)
        if self.max_bytes != "auto":
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
TRANSFORM_INPUTS = ("pil", "numpy")
_TRANSFORM_KEYS = ("transform", "transform_args", "transform_path", "transform_input")
_POLICY_KEYS = ("policy", "policy_args", "random_erasing", "ops")
_DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


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
    hue: float = 0.0  # torchvision's ColorJitter hue: a shift uniform in [-hue, hue] of the hue circle
    jitter_p: float = 1.0  # the colour jitter's probability (SimCLR's and DINO's RandomApply(ColorJitter, 0.8))
    lighting: float = 0.0
    interpolation: str = "bilinear"
    decoder: str = "auto"
    decode: str = "cpu"
    gpu_share: float = 0.5
    # a user's transform, run in the workers instead of the built-in modes (core.augment.transform)
    transform: str | None = None  # "package.module:factory"
    transform_args: dict = field(default_factory=dict)  # keyword arguments to the factory
    transform_path: str | None = None  # a directory put on the workers' sys.path
    transform_input: str = "pil"  # what the callable gets: a PIL image, or numpy (HWC uint8)
    # several views of each sample, built in (core.augment.viewspec): one crop group per entry
    views: tuple[ViewGroup, ...] = ()
    # policies, single ops and random erasing after the crop (core.policyspec, core.augment.policies)
    policy: str = "none"  # none | randaugment | trivialaugment | autoaugment | "rand-m9-mstd0.5-inc1"
    policy_args: dict = field(default_factory=dict)
    random_erasing: Any = None  # a mapping, checked into a policyspec.ErasingConfig
    ops: Any = None  # a mapping, checked into a policyspec.OpsConfig

    def __post_init__(self) -> None:
        _choice(self.mode, "augment.mode", AUGMENT_MODES)
        _int(self.output_size, "augment.output_size", 8, 4096)
        _int(self.scale_min, "augment.scale_min", 1, 1 << 14)
        _int(self.scale_max, "augment.scale_max", 1, 1 << 14)
        if self.scale_min > self.scale_max:
            raise ConfigError("augment.scale_min", f"must be <= augment.scale_max ({self.scale_max}), got {self.scale_min}")
        builtin = self.transform is None  # a user's transform makes the crop: the modes' keys do nothing
        if builtin and self.mode == "scale" and self.scale_min < self.output_size:
            raise ConfigError("augment.scale_min", f"must be >= augment.output_size ({self.output_size}) so the crop fits, got {self.scale_min}")
        object.__setattr__(self, "rrc_scale", _pair(self.rrc_scale, "augment.rrc_scale", 1e-6, 1.0))
        object.__setattr__(self, "rrc_ratio", _pair(self.rrc_ratio, "augment.rrc_ratio", 1e-3, 1e3))
        _int(self.eval_resize, "augment.eval_resize", 1, 1 << 14)
        if builtin and self.mode == "eval" and self.eval_resize < self.output_size:
            raise ConfigError("augment.eval_resize", f"must be >= augment.output_size ({self.output_size}), got {self.eval_resize}")
        _bool(self.flip, "augment.flip")
        for k in ("brightness", "contrast", "saturation"):
            object.__setattr__(self, k, jitter_strength(getattr(self, k), f"augment.{k}", 1.0))
        object.__setattr__(self, "hue", jitter_strength(self.hue, "augment.hue", 0.5))
        object.__setattr__(self, "jitter_p", _float(self.jitter_p, "augment.jitter_p", 0.0, 1.0))
        object.__setattr__(self, "lighting", _float(self.lighting, "augment.lighting", 0.0, 10.0))
        _choice(self.interpolation, "augment.interpolation", INTERPOLATIONS)
        _choice(self.decoder, "augment.decoder", DECODERS)
        _choice(self.decode, "augment.decode", DECODE_MODES)
        share = _float(self.gpu_share, "augment.gpu_share", 0.0, 1.0)
        if share <= 0.0:
            raise ConfigError("augment.gpu_share", f"must be > 0 and <= 1 (use augment.decode: cpu for none), got {share}")
        object.__setattr__(self, "gpu_share", share)
        if (self.hue or self.jitter_p < 1.0) and self.decode != "cpu":
            raise ConfigError("augment.decode", f"must be cpu with augment.hue or augment.jitter_p (the GPU's jitter has "
                              f"brightness, contrast and saturation, always applied), got {self.decode}")
        self._check_transform()
        self._check_policy()
        object.__setattr__(self, "views", parse_views(self.views))
        if self.views and self.transform is not None:
            raise ConfigError("augment.views", "and augment.transform are exclusive: a transform makes its own views "
                              "(return a tuple of images); remove one of them")
        if self.views and self.decode != "cpu":
            raise ConfigError("augment.decode", f"must be cpu with augment.views (several views are made on the CPU, "
                              f"in the workers), got {self.decode}")
        if self.views and (self.hue or self.jitter_p < 1.0):
            raise ConfigError("augment.hue" if self.hue else "augment.jitter_p", "is set in each view group with "
                              "augment.views (augment.views[i].hue, augment.views[i].jitter_p); remove it here")
        if not builtin:  # the transform makes the whole sample: the built-in jitter would be accepted and do nothing
            for k, default in (("brightness", 0.0), ("contrast", 0.0), ("saturation", 0.0), ("hue", 0.0),
                               ("jitter_p", 1.0), ("lighting", 0.0)):
                if getattr(self, k) != default:
                    raise ConfigError(f"augment.{k}", f"is not applied with augment.transform (the transform makes the "
                                      f"whole sample), got {getattr(self, k):g}; put the jitter in the transform "
                                      f"(torchvision's ColorJitter) and remove augment.{k}")
        if self.jitter_p < 1.0 and not (self.brightness or self.contrast or self.saturation or self.hue):
            raise ConfigError("augment.jitter_p", jitter_p_alone(self.jitter_p, "augment."))
        if self.views and self.lighting:
            raise ConfigError("augment.lighting", f"is not applied to augment.views (each view is a random-resized "
                              f"crop with its own flip and jitter), got {self.lighting}; set it to 0")
        if self.views:  # each view group has its own: the section's would be accepted and do nothing
            for k, default in (("flip", True), ("brightness", 0.0), ("contrast", 0.0), ("saturation", 0.0),
                               ("rrc_scale", (0.08, 1.0)), ("rrc_ratio", (3 / 4, 4 / 3))):
                if getattr(self, k) != default:
                    raise ConfigError(f"augment.{k}", f"is not applied to augment.views (each view group has its own "
                                      f"{k}), got {getattr(self, k)!r}; set {k} in each group of augment.views instead")
        if self.views and self._extras_on:  # each view group has its own: the section's would do nothing
            k = next(k for k in _POLICY_KEYS if getattr(self, k) not in ("none", {}, ErasingConfig(), OpsConfig()))
            raise ConfigError(f"augment.{k}", f"is not applied to augment.views (each view group has its own {k}); "
                              f"move it into the groups that want it (augment.views[i].{k}) and remove it here")

    def _check_policy(self) -> None:
        object.__setattr__(self, "policy_spec", policy_spec(self.policy, self.policy_args))
        object.__setattr__(self, "policy_args", dict(self.policy_args or {}))
        object.__setattr__(self, "random_erasing", erasing_config(self.random_erasing))
        object.__setattr__(self, "ops", ops_config(self.ops))
        on = not (self.policy == "none" and self.random_erasing == ErasingConfig() and self.ops == OpsConfig())
        object.__setattr__(self, "_extras_on", on)  # read per sample: computed once
        if on:
            if self.transform is not None:
                raise ConfigError("augment.policy", "and augment.random_erasing/ops are the built-in path's; with "
                                  "augment.transform put them in your transform")
            e = self.random_erasing  # erase_on: client erases in the trainer's client, after any decode
            in_workers = self.policy != "none" or self.ops != OpsConfig() or (e.erase_on == "daemon" and e != ErasingConfig())
            if self.decode != "cpu" and in_workers:
                raise ConfigError("augment.decode", f"must be cpu with augment.policy, random_erasing or ops (they run "
                                  f"on the workers' uint8 arrays; random_erasing with erase_on: client does not), got {self.decode}")

    def client_erasing(self, seed: int) -> dict[str, Any] | None:
        """What ``meta.json``'s ``"erasing"`` tells the trainer's client (``erase_on: client``): the
        section's spec (``ErasingConfig.client_spec``), or with views each view's (``viewspec.erasing_meta``)."""
        return erasing_meta(self.views, seed) if self.views else self.random_erasing.client_spec(seed)

    def extras_set(self) -> bool:
        """Whether a policy, random erasing or a single op is set (core.augment.policies)."""
        return self._extras_on

    def stream_extras(self) -> dict[str, Any] | None:
        if not self._extras_on:
            return None
        d = {"policy": self.policy, "policy_args": json.loads(json.dumps(self.policy_args, sort_keys=True)),
             "random_erasing": self.random_erasing.stream_dict(), "ops": dataclasses.asdict(self.ops)}
        o = self.ops  # two or more of these: their order is the one since grayscale, blur, solarize, posterize
        if sum(x > 0 for x in (o.grayscale, o.blur, o.solarize, o.posterize)) >= 2:
            d["ops_order"] = 2
        return d

    def _check_transform(self) -> None:
        """The transform's keys as written; importing it is the workers' (and ``check``'s) job:
        this module is read by the trainer's client too."""
        t = self.transform
        if t is not None:
            mod, sep, name = t.partition(":") if isinstance(t, str) else ("", "", "")
            if not sep or not _DOTTED.match(mod) or not name.isidentifier():
                raise ConfigError("augment.transform", f"must be \"package.module:factory\" (a module to import and "
                                  f"the name of a callable in it that makes the transform), got {t!r}")
            if self.decode != "cpu":
                raise ConfigError("augment.decode", f"must be cpu with augment.transform (a user's transform runs on the "
                                  f"CPU, in the workers), got {self.decode}")
        args = self.transform_args
        if args is None:
            args = {}
        if not isinstance(args, dict) or not all(isinstance(k, str) and k.isidentifier() for k in args):
            raise ConfigError("augment.transform_args", f"must be a mapping of the factory's keyword arguments "
                              f"(such as {{size: 224, magnitude: 9}}), got {args!r}")
        try:
            json.dumps(args, allow_nan=False)
        except (TypeError, ValueError):
            raise ConfigError("augment.transform_args", f"must hold plain values (numbers, strings, booleans, lists, "
                              f"mappings), got {args!r}") from None
        object.__setattr__(self, "transform_args", args)
        if self.transform_path is not None:
            object.__setattr__(self, "transform_path", _path(self.transform_path, "augment.transform_path"))
        _choice(self.transform_input, "augment.transform_input", TRANSFORM_INPUTS)
        if t is None and (args or self.transform_path is not None):
            key = "augment.transform_args" if args else "augment.transform_path"
            raise ConfigError(key, "is set but augment.transform is not: name the factory (\"package.module:factory\")")

    def stream_dict(self) -> dict[str, Any]:
        """The keys that change the stream's bytes; the decode keys only where they are used, so
        configs written before they existed keep their fingerprint."""
        d = dataclasses.asdict(self)
        d.pop("views")  # configs without views keep the fingerprint they had
        if self.views:
            d["views"] = as_dicts(self.views)
        for k in _POLICY_KEYS:  # configs without a policy keep the fingerprint they had
            d.pop(k)
        if self.transform is None:  # configs without a transform keep the fingerprint they had
            for k in _TRANSFORM_KEYS:
                d.pop(k)
            extras = self.stream_extras()
            if extras is not None:
                d.update(extras)
        else:  # the built-in modes' keys do nothing then; the module's file is added by the daemon
            d = {k: d[k] for k in ("output_size", "transform", "transform_args", "transform_input")}
            d["transform_args"] = json.loads(json.dumps(d["transform_args"], sort_keys=True))
            return d
        for k, default in (("hue", 0.0), ("jitter_p", 1.0)):  # configs without them keep their fingerprint
            if d[k] == default:
                d.pop(k)
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
    # every rank's pass the same number of batches, padded from the start of the set as
    # DistributedSampler pads (BatchInfo.padding marks the repeats); false: each sample exactly once
    pad: bool = True

    def __post_init__(self) -> None:
        _bool(self.enabled, "validation.enabled")
        _bool(self.pad, "validation.pad")
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
