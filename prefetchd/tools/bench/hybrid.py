"""The daemon's side of hybrid decode against the CPU path, per image, on this machine's CPU.

``python -m prefetchd.tools.bench.hybrid [--root DIR] [--passes 3]``: makes (or reads) an image folder,
sorts its files into those the GPU would decode and those the daemon keeps, and times
``hybrid.plan_sample`` and ``augment.make_sample`` over each, one pass after another; also the
compact batch's size against the pixel batch's. No GPU involved (BENCHMARKS.md, Hybrid decode).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

from prefetchd.core import hybrid
from prefetchd.core.augment import modes as augment
from prefetchd.core.config import AugmentConfig
from prefetchd.executors import builders
from prefetchd.format import batchfile, jpegbatch
from prefetchd.tools.samples import make_image_folder


def _ms_per_image(datas: list[bytes], fn, passes: int) -> list[float]:
    runs = []
    for _ in range(passes):
        t = time.perf_counter()
        for i, d in enumerate(datas):
            fn(d, augment.draws(0, 0, i))
        runs.append((time.perf_counter() - t) / max(1, len(datas)) * 1e3)
    return runs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m prefetchd.tools.bench.hybrid")
    ap.add_argument("--root", help="an image folder (default: 256 generated photo-like JPEGs)")
    ap.add_argument("--passes", type=int, default=3)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.root or tmp
        if not args.root:
            make_image_folder(root, classes=4, per_class=64, seed=0)
        paths = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)
        datas = []
        for p in paths:
            with open(p, "rb") as f:
                datas.append(f.read())
    cfg = AugmentConfig(decode="gpu")
    n, s = len(datas), cfg.output_size
    images = np.empty((n, s, s, 3), np.uint8)
    builder = builders.CompactBuilder(cfg)
    builder.reset(images)
    for i, d in enumerate(datas):
        builder.add(d, augment.draws(0, 0, i), images[i])
    raw = builder.pack(batchfile.BatchMeta(0, 0, 0, 1, 0), np.arange(n), np.arange(n), np.full(n, -1))
    kinds = jpegbatch.parse(raw).params["kind"]
    gpu = [d for d, k in zip(datas, kinds, strict=True) if k == jpegbatch.KIND_JPEG]
    cpu = [d for d, k in zip(datas, kinds, strict=True) if k == jpegbatch.KIND_PIXELS]
    out = np.empty((s, s, 3), np.uint8)

    def fmt(runs):
        return ", ".join(f"{x:.3f}" for x in runs)

    print(f"{n} images: {len(gpu)} for the GPU, {len(cpu)} kept by the daemon {builder.cpu_reasons}")
    print(f"CPU path, files the GPU would take:  {fmt(_ms_per_image(gpu, lambda d, r: augment.make_sample(d, cfg, r, out), args.passes))} ms/image")
    print(f"hybrid daemon side, the same files:  {fmt(_ms_per_image(gpu, lambda d, r: hybrid.plan_sample(d, cfg, r), args.passes))} ms/image")
    print(f"CPU path, files the daemon keeps:    {fmt(_ms_per_image(cpu, lambda d, r: augment.make_sample(d, cfg, r, out), args.passes))} ms/image")
    pixels = batchfile.Layout(n, s, s, 3).file_size
    print(f"compact batch {len(raw)} bytes, pixel batch {pixels} bytes ({len(raw) / pixels:.2f}x)")


if __name__ == "__main__":
    main()
