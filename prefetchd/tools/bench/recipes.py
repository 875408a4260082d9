"""The policy recipes three ways, side by side in one run, the same workers on the same cores.

    python -m prefetchd.tools.bench.recipes --root FOLDER --workers 2 --recipe deit --rounds 2

* ``fast path``: the daemon's own ops (``augment.policy``, ``random_erasing``: docs/policies.md);
* ``user transform``: the daemon running torchvision's transform through ``augment.transform``
  (``torchvision_recipe`` below, a PIL image in, a uint8 tensor out);
* ``DataLoader``: ``torch.utils.data.DataLoader`` with the same torchvision transform on PIL
  images, ``num_workers`` = the daemon's workers.

Recipes: ``deit`` (RandomResizedCrop 224 bicubic, flip, RandAugment m9 n2 (the fast path runs
timm's ``rand-m9-mstd0.5-inc1``, torchvision has no magnitude std), colour jitter 0.4, random
erasing 0.25 (``--erase-mode``: ``const``, the default, fills with 0 as torchvision's
``RandomErasing(value=0)`` does on the other two rows, so all three do the same work; ``pixel``,
timm's per-pixel noise, on the fast path alone)); ``trivialaugment`` (the same with
TrivialAugmentWide in place of RandAugment). The rows are run in turns (``--rounds``),
so a machine's changing load falls on all of them; images/s from each row's first batch to its
last (the daemon's start-up and the DataLoader's first batch are left out). ``--cpu-only``: the
CPU time per sample of the fast path and of torchvision's transform in one process instead.
Needs torchvision.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time


def torchvision_recipe(recipe: str = "deit", size: int = 224):
    """torchvision's transform for ``recipe``: PIL image -> uint8 tensor [3, size, size]."""
    import torch
    from torchvision.transforms import InterpolationMode, v2

    policy = (v2.RandAugment(num_ops=2, magnitude=9, interpolation=InterpolationMode.BICUBIC) if recipe == "deit"
              else v2.TrivialAugmentWide(interpolation=InterpolationMode.BICUBIC))
    return v2.Compose([
        v2.RandomResizedCrop(size, interpolation=InterpolationMode.BICUBIC, antialias=True),
        v2.RandomHorizontalFlip(),
        policy,
        v2.ColorJitter(0.4, 0.4, 0.4),
        v2.PILToTensor(),
        v2.RandomErasing(p=0.25, value=0),
        v2.ToDtype(torch.uint8),
    ])


def fast_path_augment(recipe: str, size: int = 224, erase_mode: str = "const") -> dict:
    return {"mode": "random_resized_crop", "output_size": size, "interpolation": "bicubic", "flip": True,
            "brightness": 0.4, "contrast": 0.4, "saturation": 0.4,
            "policy": "rand-m9-mstd0.5-inc1" if recipe == "deit" else "trivialaugment",
            "policy_args": {"interpolation": "bicubic"},
            "random_erasing": {"p": 0.25, "mode": erase_mode}}


class _Folder:
    def __init__(self, paths, transform):
        self.paths, self.transform = paths, transform

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        from PIL import Image

        with open(self.paths[i], "rb") as f:
            im = Image.open(f).convert("RGB")
        return self.transform(im), i % 1000


def dataloader_img_s(paths: list[str], workers: int, batch_size: int, recipe: str, epochs: int) -> float:
    import torch

    dl = torch.utils.data.DataLoader(_Folder(paths, torchvision_recipe(recipe)), batch_size=batch_size,
                                     shuffle=True, num_workers=workers, drop_last=True, persistent_workers=True)
    n, t = 0, None
    for _ in range(epochs):
        for x, _ in dl:
            if t is None:  # workers started, first batch made: left out as the daemon's start-up is
                t = time.perf_counter()
                continue
            n += x.shape[0]
    return n / (time.perf_counter() - t)


def per_sample_cpu(paths: list[str], recipe: str, samples: int, rounds: int,
                   erase_mode: str = "const") -> dict[str, list[float]]:
    """CPU time per sample in this one process (``time.process_time``, so other processes'
    load counts less than in wall time): the fast path's ``make_sample`` against Pillow's open
    and torchvision's transform, in alternated blocks of ``samples``. On one torch thread, as
    both the daemon's and the DataLoader's workers run (torch's own threads would count their
    spinning: 5.4 against 4.4 ms a deit sample here)."""
    import io

    import torch
    from PIL import Image

    torch.set_num_threads(1)

    from prefetchd.core.augment import modes
    from prefetchd.core.configsections import AugmentConfig

    datas = [open(p, "rb").read() for p in paths[:samples]]
    cfg = AugmentConfig(**fast_path_augment(recipe, erase_mode=erase_mode))
    tv = torchvision_recipe(recipe)
    out: dict[str, list[float]] = {"fast path": [], "torchvision": []}
    for r in range(rounds):
        t = time.process_time()
        for i, x in enumerate(datas):
            modes.make_sample(x, cfg, modes.draws(r, 0, i))
        out["fast path"].append((time.process_time() - t) / len(datas) * 1e3)
        t = time.process_time()
        for x in datas:
            tv(Image.open(io.BytesIO(x)).convert("RGB"))
        out["torchvision"].append((time.process_time() - t) / len(datas) * 1e3)
    return out


def _compare(args, paths: list[str], work: str) -> int:
    """The three rows, alternated round by round, and the transform's own limit; ``work`` holds the runs."""
    from prefetchd.tools.bench.throughput import _buffer_parent, daemon_run

    parent = _buffer_parent()
    user = {"mode": "random_resized_crop", "output_size": 224,
            "transform": "prefetchd.tools.bench.recipes:torchvision_recipe", "transform_args": {"recipe": args.recipe}}
    rows: dict[str, list[float]] = {"fast path": [], "user transform": [], "DataLoader": []}
    for r in range(args.rounds):
        rows["fast path"].append(daemon_run(args.root, args.workers, args.batch_size, args.epochs,
                                            fast_path_augment(args.recipe, erase_mode=args.erase_mode), work,
                                            parent)["img_s"])
        rows["user transform"].append(daemon_run(args.root, args.workers, args.batch_size, args.epochs, user,
                                                 work, parent)["img_s"])
        rows["DataLoader"].append(dataloader_img_s(paths, args.workers, args.batch_size, args.recipe, args.epochs))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f} img/s" for k, v in rows.items()), flush=True)
    fast = statistics.median(rows["fast path"])
    # the transform's own limit: N workers doing nothing but open, decode and transform, N cores
    tv_ms = statistics.median(per_sample_cpu(paths, args.recipe, 100, 3, args.erase_mode)["torchvision"])
    limit = args.workers * 1e3 / tv_ms
    print(f"\n{args.recipe}: {len(paths)} images, {args.workers} workers, batch {args.batch_size}, "
          f"{args.rounds} rounds (median)")
    for k, v in rows.items():
        med = statistics.median(v)
        print(f"  {k:15s} {med:8.1f} img/s  (runs {', '.join(f'{x:.1f}' for x in v)})  fast path / this: {fast / med:.2f}x"
              + ("" if k == "fast path" else f", {med / limit:.0%} of the transform's limit"))
    print(f"  the transform's limit: {limit:.1f} img/s ({args.workers} x one process's {tv_ms:.2f} ms of CPU a "
          "sample: open, decode and torchvision's transform, one torch thread)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"recipe": args.recipe, "images": len(paths), "workers": args.workers, "rows": rows,
                       "transform_ms": tv_ms, "limit_img_s": limit}, f, indent=1)
    return 0


def main(argv=None) -> int:
    from prefetchd.tools.bench.throughput import list_images

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", required=True, help="an ImageFolder")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=1, help="epochs per daemon row")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--recipe", choices=("deit", "trivialaugment"), default="deit")
    ap.add_argument("--erase-mode", choices=("const", "pixel"), default="const",
                    help="the fast path's erasing fill: const (torchvision's value=0, as the other rows) or pixel")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--cpu-only", action="store_true", help="only the per-sample CPU time in one process")
    args = ap.parse_args(argv)
    paths = list_images(args.root)
    if args.cpu_only:
        ms = per_sample_cpu(paths, args.recipe, 100, args.rounds, args.erase_mode)
        f, t = statistics.median(ms["fast path"]), statistics.median(ms["torchvision"])
        print(f"{args.recipe}: CPU ms per sample, one process, {args.rounds} alternated rounds of 100 (median): "
              f"fast path {f:.2f} (runs {', '.join(f'{x:.1f}' for x in ms['fast path'])}), torchvision {t:.2f} "
              f"(runs {', '.join(f'{x:.1f}' for x in ms['torchvision'])}): {t / f:.2f}x")
        return 0
    work = tempfile.mkdtemp(prefix="prefetchd-recipes-")
    try:
        return _compare(args, paths, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
