"""``prefetchd preview``: a grid of augmented samples with their labels, as the model sees them.

Takes the earliest batch published for the rank in the buffer (without consuming it); when
none is ready, makes batch 0 of epoch 0 in-process with the same code the workers run. A batch
of several views (``augment.views``, a transform returning a tuple) is shown a sample a row,
its views side by side, each at its own size.
"""

from __future__ import annotations

import math
import os

import numpy as np
from PIL import Image, ImageDraw

from prefetchd.core.config import Config
from prefetchd.format import batchfile


def _batch(cfg: Config, rank: int) -> tuple[tuple[np.ndarray, ...], np.ndarray, np.ndarray, str]:
    """(every view of the batch, view 0 first; labels; sample indices; where it came from)."""
    names = sorted(n for n in os.listdir(cfg.buffer.dir)
                   if (k := batchfile.parse_name(n)) is not None and k[0] == rank) if os.path.isdir(cfg.buffer.dir) else []
    for name in names:
        try:
            b = batchfile.read_file(os.path.join(cfg.buffer.dir, name))
        except (OSError, batchfile.BatchFileError):
            continue  # consumed or replaced meanwhile: try the next
        return b.views or (b.images,), b.labels, b.indices, f"{name} from the buffer"
    from prefetchd.core.sampler import for_index
    from prefetchd.executors.worker import BatchMaker, WorkerSetup
    from prefetchd.sources.dataset import load_index

    index, _ = load_index(cfg.dataset.root, cfg.dataset.file_list, cfg.dataset.extensions, cfg.dataset.cache_dir,
                          **cfg.dataset.index_options())
    L = cfg.loader
    sampler = for_index(L, index)
    maker = BatchMaker(WorkerSetup(cfg, index.files_dir, None if index.files_dir else index, 0, cfg.buffer.dir))
    images, used, labels, _, _ = maker.fill(0, sampler.batch_indices(0, rank, 0))
    views = tuple(images) if isinstance(images, (tuple, list)) else (images,)
    return views, labels, used, "epoch 0 batch 0, made in-process (no batch ready in the buffer)"


def class_names(cfg: Config) -> tuple[str, ...]:
    from prefetchd.sources.dataset import load_index

    try:
        index, _ = load_index(cfg.dataset.root, cfg.dataset.file_list, cfg.dataset.extensions, cfg.dataset.cache_dir,
                              **cfg.dataset.index_options())
        return index.classes
    except Exception:  # labels alone are still worth showing
        return ()


def grid(images: np.ndarray, captions: list[str], cols: int | None = None) -> Image.Image:
    n, s = len(images), images.shape[1]
    cols = cols or max(1, math.ceil(math.sqrt(n)))
    rows = math.ceil(n / cols)
    pad, text_h = 4, 14
    out = Image.new("RGB", (cols * (s + pad) + pad, rows * (s + text_h + pad) + pad), (24, 24, 24))
    draw = ImageDraw.Draw(out)
    for i in range(n):
        x, y = pad + (i % cols) * (s + pad), pad + (i // cols) * (s + text_h + pad)
        out.paste(Image.fromarray(images[i]), (x, y))
        draw.text((x + 2, y + s + 1), captions[i][: max(4, s // 6)], fill=(230, 230, 230))
    return out


def views_grid(views: tuple[np.ndarray, ...], captions: list[str]) -> Image.Image:
    """A row per sample, its views left to right at their own sizes, the caption under view 0."""
    n = len(captions)
    pad, text_h = 4, 14
    row_h = max(v.shape[1] for v in views) + text_h + pad
    width = pad + sum(v.shape[2] + pad for v in views)
    out = Image.new("RGB", (width, pad + n * row_h), (24, 24, 24))
    draw = ImageDraw.Draw(out)
    for i in range(n):
        x, y = pad, pad + i * row_h
        for v in views:
            out.paste(Image.fromarray(np.ascontiguousarray(v[i])), (x, y))
            x += v.shape[2] + pad
        draw.text((pad + 2, y + views[0].shape[1] + 1), captions[i][: max(4, views[0].shape[2] // 6)],
                  fill=(230, 230, 230))
    return out


def run_preview(cfg: Config, out_path: str, count: int = 16, rank: int = 0) -> str:
    views, labels, indices, source = _batch(cfg, rank)
    names = class_names(cfg)
    k = min(count, len(views[0]))
    caps = [f"{int(labels[i])} {names[int(labels[i])] if int(labels[i]) < len(names) else ''}".strip() for i in range(k)]
    if len(views) > 1:
        views_grid(tuple(v[:k] for v in views), caps).save(out_path)
        return f"{source}, {len(views)} views a row ({' '.join(f'{v.shape[2]}x{v.shape[1]}' for v in views)})"
    grid(np.ascontiguousarray(views[0][:k]), caps).save(out_path)
    return source
