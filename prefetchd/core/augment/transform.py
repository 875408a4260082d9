"""A user's transform, run in the workers: ``augment.transform: "package.module:factory"``.

Set-up (``load``, once per worker, and once by ``prefetchd check`` and at the daemon's start):
``augment.transform_path`` (if set) goes first on ``sys.path``, the module is imported, and
``factory(**augment.transform_args)`` makes the transform: any callable taking one image. A
module not found, a name not in it, a factory that is not callable, raises or returns something
not callable: ``ConfigError`` naming the key, in one line.

Per sample (``UserTransform.make``, a function of ``(bytes, seed, epoch, index)`` only):

1. the file is decoded whole by Pillow, RGB and upright (``augment.decode_image``), and handed
   over as a PIL image, or with ``augment.transform_input: numpy`` as a writable HWC uint8 array;
2. ``seeds.seed_sample`` seeds Python's ``random``, numpy's global generator and torch's
   (when the process has loaded torch) from the sample's key; a callable with an ``rng``
   parameter also gets a ``numpy.random.Generator`` from the same key. A call that loads torch
   itself (the first in a worker) is made once more, seeded as every later one;
3. the result, a uint8 array or tensor (HWC or CHW) or an RGB PIL image, becomes the batch's
   HWC slot (``to_hwc``); a tuple or list of k >= 2 of them is k views (``to_views``), each
   into its own image section of the batch (``format.batchfile`` version 2).

Several views: their number and each one's height and width are the stream's, learned by
``probe`` from the first sample it makes (``Probed.shapes``; the daemon hands them to the
workers); a sample whose views differ in number or shape raises ``OutputError`` naming what
changed. One view must be ``output_size`` square, as before.

A transform that raises on a sample raises ``TransformRaised`` (a ``SampleError``, one line: the
worker quarantines the sample as an undecodable file); an output the batch cannot hold raises
``OutputError`` (quarantined too; ``probe`` at start turns it into a ``ConfigError``).

The transform's module file is hashed (``UserTransform.code``): the daemon adds it to its stream's
identity, so batches and loader states made before the file changed are not taken for today's.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from PIL import Image

from prefetchd.core.augment import modes as augment
from prefetchd.core.augment.seeds import loaded_torch, seed_sample
from prefetchd.core.augment.viewspec import MAX_VIEWS
from prefetchd.core.configsections import AugmentConfig
from prefetchd.core.configvalues import ConfigError

_KEY = "augment.transform"
_PROBE_SAMPLES = 2  # outputs the probe checks...
_PROBE_TRIES = 16  # ...among at most this many first samples of the dataset
_REASON_CHARS = 300


class TransformRaised(augment.SampleError):
    """The user's transform raised on this sample, with this draw: a replacement stands in for it
    in this batch (the draw's failure, not the file's: the next epoch's draw may succeed, so it is
    not quarantined for good, which would make later epochs depend on which worker saw it)."""

    per_draw = True


class OutputError(augment.SampleError):
    """The transform's output cannot be a sample of the batch; the message says what to change."""

    per_draw = True


class SizeError(OutputError):
    """The output is not ``output_size`` x ``output_size``."""

    def __init__(self, message: str, height: int, width: int):
        super().__init__(message)
        self.height, self.width = height, width


@dataclass(frozen=True)
class ModuleFile:
    path: str | None  # the file of the module holding the factory (None: it has none)
    code: str | None  # 16 hex digits of its bytes' SHA-256


class Probed(NamedTuple):
    """What ``check`` learned at start: the transform's module file and the (height, width) of
    each view a batch holds (the transform's, or without one the config's)."""

    module: ModuleFile
    shapes: tuple[tuple[int, int], ...]


def module_file(module) -> ModuleFile:
    path = getattr(module, "__file__", None)
    if not path:
        return ModuleFile(None, None)
    try:
        with open(path, "rb") as f:
            return ModuleFile(path, hashlib.sha256(f.read()).hexdigest()[:16])
    except OSError:
        return ModuleFile(path, None)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    if len(text) > _REASON_CHARS:
        text = text[:_REASON_CHARS - 3] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _takes_rng(fn: Callable) -> bool:
    try:
        p = inspect.signature(fn).parameters.get("rng")
    except (TypeError, ValueError):  # a builtin or an extension type: no signature to read
        return False
    return p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)


def _import(name: str, path: str | None):
    if path is not None:
        if not os.path.isdir(path):
            raise ConfigError("augment.transform_path", f"must be a directory (put on the workers' sys.path), got {path}")
        if path not in sys.path:
            sys.path.insert(0, path)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and (name == e.name or name.startswith(e.name + ".")):
            where = f"in augment.transform_path {path} or " if path else ""
            raise ConfigError(_KEY, f"names module {name!r}, which is not found {where}on the daemon's sys.path: "
                              f"install it in the daemon's environment or set augment.transform_path to the directory "
                              f"that holds it") from None
        raise ConfigError(_KEY, f"module {name!r} cannot be imported: {_one_line(e)}") from None
    except Exception as e:
        raise ConfigError(_KEY, f"importing module {name!r} raised {_one_line(e)}") from None


class UserTransform:
    """The transform one worker runs: made once (``load``), called per sample (``make``)."""

    def __init__(self, cfg: AugmentConfig, fn: Callable, module: ModuleFile, worker: bool = False):
        self.cfg = cfg
        self.fn = fn
        self.module = module
        self.takes_rng = _takes_rng(fn)
        self.worker = worker  # torch on one thread (see ``load``)
        # each view's (height, width), fixed for the stream: None until ``probe`` learns them
        # (the daemon's workers are given the probe's, ``WorkerSetup.view_shapes``)
        self.shapes: tuple[tuple[int, int], ...] | None = None

    @property
    def code(self) -> str | None:
        return self.module.code

    def _input(self, data: bytes):
        im = augment.decode_image(data)
        return im if self.cfg.transform_input == "pil" else np.array(im)

    def _once(self, data: bytes, seed: int, epoch: int, index: int, torch):
        x = self._input(data)
        rng = seed_sample(seed, epoch, index, torch, self.takes_rng)
        try:
            return self.fn(x, rng=rng) if self.takes_rng else self.fn(x)
        except Exception as e:
            raise TransformRaised(f"augment.transform raised {_one_line(e)}") from None

    def _call(self, data: bytes, seed: int, epoch: int, index: int):
        torch = loaded_torch()
        y = self._once(data, seed, epoch, index, torch)
        if torch is None and (torch := loaded_torch()) is not None:
            # this call loaded torch (a worker's first): made again, torch's generator seeded as in every later call
            if self.worker:
                _quiet_torch(torch)
            y = self._once(data, seed, epoch, index, torch)
        return y

    def make(self, data: bytes, seed: int, epoch: int, index: int, out=None):
        """Sample ``index`` of ``epoch``, into ``out`` (uint8 [S, S, 3]; several views: a tuple of
        one slot per view) or a new array (several views: a tuple of them). Raises SampleError
        (its subclasses TransformRaised and OutputError included)."""
        views = to_views(self._call(data, seed, epoch, index), self.cfg.output_size, self.shapes)
        if out is None:
            made = tuple(np.ascontiguousarray(v) for v in views)
            return made[0] if len(made) == 1 else made
        slots = out if isinstance(out, (tuple, list)) else (out,)
        if len(slots) != len(views):  # (to_views checked the views against the stream's shapes)
            raise OutputError(f"augment.transform returned {len(views)} views where the batch holds {len(slots)}")
        for slot, v in zip(slots, views, strict=True):
            np.copyto(slot, v)
        return out


def load(cfg: AugmentConfig, worker: bool = False) -> UserTransform:
    """Import and make the transform ``cfg`` names (``ConfigError`` in one line if it cannot be).
    ``worker``: this process is a pool worker (torch, if loaded, then runs on one thread, as in a
    DataLoader's worker: the workers are one per core already)."""
    name, _, attr = cfg.transform.partition(":")
    module = _import(name, cfg.transform_path)
    factory = getattr(module, attr, None)
    if factory is None:
        raise ConfigError(_KEY, f"names {attr!r}, which module {name!r} ({getattr(module, '__file__', None)}) "
                          "does not define")
    if not callable(factory):
        raise ConfigError(_KEY, f"names {cfg.transform}, a {type(factory).__name__}, which is not callable: name the "
                          "function (or class) that makes the transform")
    try:
        fn = factory(**cfg.transform_args)
    except Exception as e:
        raise ConfigError(_KEY, f"{cfg.transform}(**augment.transform_args) raised {_one_line(e)}") from None
    if isinstance(fn, tuple):
        raise ConfigError(_KEY, f"{cfg.transform} returned a tuple: return one transform (a callable), which returns "
                          "a tuple of images for several views")
    if not callable(fn):
        raise ConfigError(_KEY, f"{cfg.transform} returned a {type(fn).__name__}, which is not callable: the factory "
                          "must return the transform (a callable taking one image)")
    if worker and loaded_torch() is not None:
        _quiet_torch(loaded_torch())
    return UserTransform(cfg, fn, module_file(module), worker)


def _quiet_torch(torch) -> None:
    try:
        if torch.get_num_threads() != 1:
            torch.set_num_threads(1)
    except Exception:  # noqa: BLE001 - a stub or an old torch: threads do not change the pixels
        pass


# --- the output ----------------------------------------------------------------------------------


def _said(shapes) -> str:
    return ", ".join(f"{h}x{w}" for h, w in shapes)


def to_views(y, size: int, shapes: tuple[tuple[int, int], ...] | None = None) -> tuple[np.ndarray, ...]:
    """The transform's output as one uint8 HWC array per view: one image (``output_size`` square,
    ``to_hwc``) or a tuple or list of k >= 2 (each its own height and width). ``shapes``: the
    stream's views, which the output must match (None: any, as at the probe's first sample);
    OutputError names what changed."""
    if not isinstance(y, (tuple, list)):
        views = (to_hwc(y, size),)
    elif len(y) == 0:
        raise OutputError(f"augment.transform returns an empty {type(y).__name__}: return one image, or a tuple "
                          "of images for several views")
    elif len(y) == 1:
        views = (to_hwc(y[0], size),)
    elif len(y) > MAX_VIEWS:  # a batch file's limit
        raise OutputError(f"augment.transform returns {len(y)} views: a batch holds at most {MAX_VIEWS}; return "
                          "fewer (a tuple of images, one per view)")
    else:
        out = []
        for k, v in enumerate(y):
            try:
                out.append(to_hwc(v, None))
            except OutputError as e:
                raise OutputError(f"view {k} of {len(y)}: {e}") from None
        views = tuple(out)
    if shapes is not None:
        got = tuple(v.shape[:2] for v in views)
        if len(got) != len(shapes):
            raise OutputError(f"augment.transform returned {len(got)} view(s) ({_said(got)}) where the stream has "
                              f"{len(shapes)} ({_said(shapes)}, from the first samples at start): the number of views "
                              "is fixed for the stream; return as many views for every sample")
        for k, (g, w) in enumerate(zip(got, shapes, strict=True)):
            if tuple(g) != tuple(w):
                raise OutputError(f"augment.transform returned view {k} of {g[0]}x{g[1]} where the stream's view {k} "
                                  f"is {w[0]}x{w[1]} (from the first samples at start): each view's size is fixed for "
                                  "the stream; end each view with a crop or resize of a fixed size")
    return views


def to_hwc(y, size: int | None) -> np.ndarray:
    """The transform's output as a uint8 [size, size, 3] array (a view where it can be; ``size``
    None: of any height and width), or OutputError saying what to change."""
    if isinstance(y, (tuple, list)):
        raise OutputError(f"augment.transform returns a {type(y).__name__} inside its output: return one image, or "
                          "a flat tuple of images for several views")
    if isinstance(y, Image.Image):
        y = np.asarray(y if y.mode == "RGB" else y.convert("RGB"))
    torch = loaded_torch()
    if torch is not None and isinstance(y, torch.Tensor):
        if y.is_floating_point():
            raise OutputError(_float_message(str(y.dtype).replace("torch.", "")))
        y = y.detach().cpu().numpy()
    if not isinstance(y, np.ndarray):
        raise OutputError(f"augment.transform returns a {type(y).__module__}.{type(y).__qualname__}: return a uint8 "
                          "array or tensor (HWC or CHW) or an RGB PIL image")
    if np.issubdtype(y.dtype, np.floating):
        raise OutputError(_float_message(str(y.dtype)))
    if y.dtype != np.uint8:
        raise OutputError(f"augment.transform returns {y.dtype} pixels: end the pipeline in uint8 (the batch holds "
                          "uint8; ToDtype(torch.uint8) or .astype(numpy.uint8))")
    if y.ndim == 3 and y.shape[0] == 3 and y.shape[2] == 3:  # 3 rows (HWC) or 3 columns (CHW): either reading fits
        raise OutputError(f"augment.transform returns shape {list(y.shape)}, which is HWC with 3 rows or CHW with 3 "
                          "columns: the layout cannot be told; return an image of another height or width")
    if y.ndim == 3 and y.shape[2] == 3:
        hwc = y
    elif y.ndim == 3 and y.shape[0] == 3:
        hwc = y.transpose(1, 2, 0)
    elif y.ndim == 2 or (y.ndim == 3 and 1 in (y.shape[0], y.shape[2])):
        raise OutputError(f"augment.transform returns one channel (shape {list(y.shape)}): the batch holds RGB; "
                          "end with an RGB image (Grayscale(num_output_channels=3), or convert('RGB'))")
    else:
        raise OutputError(f"augment.transform returns shape {list(y.shape)}: return one image, HWC [H, W, 3] or "
                          "CHW [3, H, W]")
    h, w = hwc.shape[:2]
    if not h or not w:  # a batch cannot hold it (and a view's shape is the stream's)
        raise OutputError(f"augment.transform returns an empty image ({h}x{w}): each image needs at least one row and "
                          "one column (a crop of size 0?)")
    if size is not None and (h, w) != (size, size):
        raise SizeError(f"augment.transform returned a {h}x{w} image where the batch holds {size}x{size} "
                        "(augment.output_size)", h, w)
    return hwc


def _float_message(dtype: str) -> str:
    return (f"augment.transform returns {dtype} pixels (a Normalize or ToDtype(float) left in?): end the pipeline in "
            "uint8; normalise in the trainer with normalize=True")


# --- the probe at start --------------------------------------------------------------------------


def probe(t: UserTransform, samples: Iterable[tuple[int, bytes]], seed: int) -> str:
    """Run the transform on the first samples (``(index, bytes)``, epoch 0) as a worker would;
    a fault every sample would have (wrong type, float pixels, another size) or a transform
    that raises on every one of them is a ``ConfigError`` in one line naming what to change.
    Files that do not decode are skipped (the workers quarantine them). The first sample made
    sets ``t.shapes`` (the stream's views), which the others must match. Returns what was seen."""
    made, raised, tried = 0, [], 0
    t.shapes = None
    for index, data in samples:
        if made >= _PROBE_SAMPLES or tried >= _PROBE_TRIES:
            break
        tried += 1
        try:
            first = t.make(data, seed, 0, index)
            first = first if isinstance(first, tuple) else (first,)
            again = t.make(data, seed, 0, index)
            again = again if isinstance(again, tuple) else (again,)
            if made == 0 and not all(np.array_equal(a, b) for a, b in zip(first, again, strict=False)):
                raise ConfigError(_KEY, f"{t.cfg.transform} made sample {index} twice from one seed and got other pixels: "
                                  "it draws from a generator of its own, which prefetchd cannot seed (the stream would "
                                  "depend on the worker); draw from random, numpy.random or torch's generator, or take "
                                  "rng= (a numpy Generator of the sample's key)")
        except SizeError as e:
            raise ConfigError("augment.output_size", _size_advice(e, t.cfg.output_size)) from None
        except OutputError as e:
            raise ConfigError(_KEY, f"{t.cfg.transform}: {e} (sample {index})") from None
        except TransformRaised as e:
            raised.append(f"sample {index}: {e}")
            continue
        except augment.SampleError:  # the file, not the transform: a worker quarantines it
            continue
        if t.shapes is None:
            t.shapes = tuple(v.shape[:2] for v in first)
        made += 1
    if made == 0 and raised:
        raise ConfigError(_KEY, f"{t.cfg.transform} failed on each of the first {len(raised)} samples ({raised[0]}); "
                          "fix the transform, then start again")
    where = f"{t.module.path} sha256 {t.code}" if t.module.path else "no module file"
    shapes = t.shapes or ((t.cfg.output_size, t.cfg.output_size),)
    seen = (f"{_said(shapes)} uint8" if len(shapes) == 1 else f"{len(shapes)} views ({_said(shapes)}) uint8")
    return (f"{t.cfg.transform} ({where}) made {made} of the first {tried} samples, "
            f"{seen}" + ("; rng= given" if t.takes_rng else ""))


def check(cfg: AugmentConfig, index, seed: int, say: Callable[[str], object]) -> Probed:
    """What ``prefetchd check`` and the daemon's start do: make the transform ``cfg`` names,
    ``probe`` it on the first readable samples of ``index`` and ``say`` what it saw. Returns its
    module file and views (no transform: none, and the config's views); ``ConfigError`` if it cannot be made or no sample
    gets through."""
    from prefetchd.core.augment.views import stream_shapes

    if cfg.transform is None:
        return Probed(ModuleFile(None, None), stream_shapes(cfg))
    t = load(cfg)
    say(probe(t, first_samples(index), seed))
    return Probed(t.module, t.shapes or stream_shapes(cfg))


def first_samples(index):
    """``(index, bytes)`` of the dataset's readable samples, in order (what ``probe`` takes)."""
    for i in range(len(index)):
        try:
            yield i, index.read(i)
        except OSError:  # unreadable now: the workers will say so
            continue


def _size_advice(e: SizeError, size: int) -> str:
    if e.height == e.width:
        return (f"is {size} but augment.transform returns {e.height}x{e.width} images: set augment.output_size: "
                f"{e.height}, or end the transform with a {size}x{size} crop")
    return (f"is {size} but augment.transform returns {e.height}x{e.width} images: the batch holds one square size; "
            f"end the transform with a {size}x{size} crop (CenterCrop, RandomResizedCrop({size}))")
