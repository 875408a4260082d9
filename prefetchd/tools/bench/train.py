"""``prefetchd bench --train MODEL``: a real training loop fed three ways, side by side in one run.

* ``on-device``: one uint8 batch already on the device, used again every step (the model's own
  ceiling: no data loading at all);
* ``prefetchd``: the daemon (random_resized_crop + flip) with its ring filled before the clock
  starts, read through ``PrefetchClient(device=...)``;
* ``hybrid`` and ``gpu``: the same with ``augment.decode: hybrid`` (``--gpu-share`` of the batches,
  default 0.5) and ``gpu`` (all of them): the daemon writes compact batches of JPEG bytes and the
  client decodes them on the device, with nvImageCodec (``prefetchd[gpu]``) on a GPU. On a CPU
  there is no hardware decoder: the client decodes with a stand-in CPU decoder (simplejpeg), so
  the rows show that the path runs and what it costs a CPU, not what a GPU would do. On CUDA each
  prefetchd row also gives the device memory the run holds at its end (``torch.cuda.mem_get_info``:
  used now less used before the client started, which sees nvImageCodec's own pools and stream-
  ordered allocations, invisible to torch's ``max_memory_allocated``, also given), so the hybrid
  rows' excess over the ``prefetchd`` row is what the decode stage holds; hybrid rows give the
  decode stage's host time per batch (``DecodeStage.host_s``) and its CPU fallbacks;
  ``--decodes`` picks the rows (default ``cpu,hybrid,gpu``);
* ``dataloader``: ``torch.utils.data.DataLoader`` with the same worker count and augmentation
  (torchvision's ImageFolder + v2 RandomResizedCrop/flip where torchvision imports, else the
  same on Pillow), ``pin_memory=True`` on a GPU.

The loop is pytorch/examples ``imagenet/main.py``'s: normalise on the device, bf16 autocast,
channels_last, SGD, ``loss.item()`` every step. It prints images/s, the ratio to the on-device
rate, and for prefetchd the trainer thread's time inside ``next()`` per batch.

``MODEL`` is ``tiny`` (a small convolutional net defined here, so the bench runs on any CPU) or a
torchvision model name (``resnet50``, ``resnet18``, ...). On a GPU:
``prefetchd bench --train resnet50 --root IMAGENET_LIKE_FOLDER --workers 14``; on a CPU, e.g.
``prefetchd bench --train tiny --device cpu --size 64 --batch-size 32 --steps 20``.
``--freeze-daemon`` stops the daemon (SIGSTOP) once the ring holds every measured batch, so on
a machine with few cores its refills do not compete with the training for them.
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import yaml

from prefetchd.format import status
from prefetchd.tools.bench.throughput import stop_daemon


def _tiny_model(torch, num_classes: int):
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
        nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(inplace=True),
        nn.Conv2d(32, 64, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes))


def _model(torch, name: str, device):
    if name == "tiny":
        m = _tiny_model(torch, 1000)
    else:
        try:
            import torchvision
        except ImportError as e:
            raise SystemExit(f"--train {name} needs torchvision ({e}); use --train tiny without it") from None
        if not hasattr(torchvision.models, name):
            raise SystemExit(f"torchvision has no model {name!r}")
        m = getattr(torchvision.models, name)(weights=None, num_classes=1000)
    return m.to(device).to(memory_format=torch.channels_last)


class _RRCFolder:
    """ImageFolder + RandomResizedCrop(size) + flip on Pillow, as torchvision does it (for
    machines where torchvision does not import)."""

    def __init__(self, root: str, size: int):
        from prefetchd.tools.bench.throughput import list_images

        self.paths = list_images(root)
        classes = sorted({os.path.basename(os.path.dirname(p)) for p in self.paths})
        self.labels = [classes.index(os.path.basename(os.path.dirname(p))) for p in self.paths]
        self.size = size

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        import random

        import torch
        from PIL import Image

        from prefetchd.core.augment import Draws, crop_for
        from prefetchd.core.config import AugmentConfig

        with open(self.paths[i], "rb") as f:
            im = Image.open(f).convert("RGB")
        c = crop_for(AugmentConfig(mode="random_resized_crop", output_size=self.size), *im.size,
                     Draws(np.random.random(48), np.zeros(3)))
        im = im.resize((self.size, self.size), Image.Resampling.BILINEAR, box=(c.left, c.top, c.right, c.bottom))
        if random.random() < 0.5:
            im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return torch.from_numpy(np.array(im)).permute(2, 0, 1), self.labels[i]


def _dataloader(torch, root: str, size: int, batch: int, workers: int, pin: bool):
    try:
        from torchvision import datasets
        from torchvision.transforms import v2

        t = v2.Compose([v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip(), v2.PILToTensor()])
        ds, how = datasets.ImageFolder(root, transform=t), "torchvision"
    except ImportError:
        ds, how = _RRCFolder(root, size), "Pillow (no torchvision)"
    dl = torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers, pin_memory=pin,
                                     persistent_workers=workers > 0, drop_last=True,
                                     prefetch_factor=4 if workers > 0 else None)

    def endless():
        while True:
            yield from dl

    return endless(), how


def _train(torch, args, device, batches, label: str, timed_next: list | None = None) -> dict:
    from prefetchd_client import normalize

    m = _model(torch, args.train, device)
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    it = iter(batches)
    wait = 0.0
    n = 0
    t0 = time.perf_counter()
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            sync()
            t0 = time.perf_counter()
            wait, n = 0.0, 0
            if timed_next is not None:
                timed_next.clear()
        tw = time.perf_counter()
        x, y = next(it)
        dt = time.perf_counter() - tw
        if timed_next is not None:
            timed_next.append(dt)
        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        wait += time.perf_counter() - tw
        x = normalize(x).contiguous(memory_format=torch.channels_last)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(m(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss.item()  # as main.py does (losses.update(loss.item())): the host waits for the step
        n += x.shape[0]
    sync()
    dt = time.perf_counter() - t0
    return {"feed": label, "img_s": n / dt, "wait_share": wait / dt, "seconds": dt}


def _cpu_decoder():
    """The stand-in for nvImageCodec where there is no GPU: libjpeg-turbo through simplejpeg, RGB
    as stored, as ``DecodeStage`` wants it."""
    import simplejpeg
    import torch

    def decode(jpegs):
        out = []
        for j in jpegs:
            try:
                out.append(torch.from_numpy(simplejpeg.decode_jpeg(bytes(j), colorspace="RGB")))
            except ValueError:
                out.append(None)
        return out

    return decode


def _start_daemon(args, root: str, work: str, batch: int, capacity: int, workers: int, decode: str = "cpu"):
    work = os.path.join(work, decode)
    os.makedirs(work, exist_ok=True)
    buf = os.path.join(work, "buffer")
    pixels = batch * args.size * args.size * 3 + (1 << 20)
    # a compact batch holds whole JPEG files: room for twice a pixel batch
    per_batch = pixels if decode == "cpu" else 2 * pixels
    cfg = {"dataset": {"root": root, "cache_dir": os.path.join(work, "cache")},
           "loader": {"batch_size": batch, "seed": 0, "epochs": None},
           "workers": {"count": workers},
           "buffer": {"dir": buf, "capacity": capacity, "refill_at": capacity,
                      "max_bytes": max(64 << 20, (capacity + 2) * per_batch)},
           "augment": {"mode": "random_resized_crop", "flip": True, "output_size": args.size, "decode": decode,
                       **({"gpu_share": args.gpu_share} if decode == "hybrid" else {})}}
    path = os.path.join(work, "train.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    log = open(os.path.join(work, "daemon.log"), "wb")
    proc = subprocess.Popen([sys.executable, "-m", "prefetchd", "run", "--config", path], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log, path, buf


def run_train_bench(args) -> int:
    try:
        import torch
    except ImportError:
        print("bench --train needs torch: pip install prefetchd[torch]", file=sys.stderr)
        return 2
    from prefetchd_client import PrefetchClient

    from prefetchd.tools.bench.throughput import _buffer_parent, _cores

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    batch = args.batch_size or 256
    decodes = [d.strip() for d in args.decodes.split(",") if d.strip()]
    if not decodes or set(decodes) - {"cpu", "hybrid", "gpu"}:
        print(f"--decodes takes a comma-separated list of cpu, hybrid, gpu; got {args.decodes!r}", file=sys.stderr)
        return 2
    workers = args.workers or _cores()
    work = tempfile.mkdtemp(prefix="prefetchd-bench-train-", dir=_buffer_parent(args))
    proc = log = None
    try:
        root = args.root[0] if args.root else None
        if root is None:
            from prefetchd.tools.samples import make_image_folder

            root = os.path.join(work, "data")
            make_image_folder(root, classes=20, per_class=max(1, args.images // 20), seed=1)
        print(f"train {args.train} on {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
              f"batch {batch}x3x{args.size}x{args.size}, bf16 autocast, channels_last, loss.item() every step; "
              f"{args.warmup} warm-up + {args.steps} measured steps; {workers} workers; {_cores()} cores", flush=True)
        rows = []
        x = torch.randint(0, 256, (batch, 3, args.size, args.size), dtype=torch.uint8, device=device)
        x = x.contiguous(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (batch,), device=device)

        def same():
            while True:
                yield x, y

        rows.append(_train(torch, args, device, same(), "on-device"))
        cuda = device.type == "cuda"
        for decode in decodes:
            # prefetchd: the ring holds every measured batch before the clock starts
            capacity = args.warmup + args.steps + 2
            proc, log, cfg_path, buf = _start_daemon(args, root, work, batch, capacity, workers, decode)
            t0 = time.monotonic()
            full = False
            while time.monotonic() - t0 < 900:
                s = status.read_json(buf, status.STATUS_NAME) or {}
                if s.get("ranks", {}).get("0", {}).get("ready", 0) >= capacity:
                    full = True
                    break
                if proc.poll() is not None:
                    print(f"the daemon exited with {proc.returncode}; see {work}/{decode}/daemon.log", file=sys.stderr)
                    return 1
                time.sleep(0.2)
            print(f"{decode}: ring {'full' if full else 'NOT full'} ({capacity} batches) after "
                  f"{time.monotonic() - t0:.1f} s", flush=True)
            if args.freeze_daemon and full:
                # every measured batch is in the ring: stop the daemon's refills competing for the cores
                os.killpg(proc.pid, signal.SIGSTOP)
            nexts: list[float] = []
            label = "prefetchd" if decode == "cpu" else decode
            # without a GPU the client decodes the compact batches with a CPU stand-in
            decoder = None if cuda or decode == "cpu" else _cpu_decoder()
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                free, total = torch.cuda.mem_get_info(device)
                used_before = total - free
            with PrefetchClient(cfg_path, device=device if cuda else None, timeout=120,
                                prefetch=args.prefetch, decoder=decoder) as c:

                def epochs():
                    while True:
                        yield from c

                r = _train(torch, args, device, epochs(), label, nexts)
                r["next_ms_median"] = statistics.median(nexts) * 1e3
                r["next_ms_p90"] = sorted(nexts)[int(0.9 * (len(nexts) - 1))] * 1e3
                r["decoder"] = "-" if decode == "cpu" else ("nvImageCodec" if cuda else "stand-in: simplejpeg on the CPU")
                if cuda:
                    r["peak_gpu_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
                    torch.cuda.synchronize(device)
                    free, total = torch.cuda.mem_get_info(device)
                    r["device_used_mib"] = (total - free - used_before) / 2**20
                if c._stage is not None and c._stage.batches:
                    r["decode_host_ms"] = c._stage.host_s / c._stage.batches * 1e3
                    r["gpu_fallbacks"] = c._stage.fallbacks
                rows.append(r)
            os.killpg(proc.pid, signal.SIGCONT)
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
            proc = None
            log.close()
            log = None
        dl, how = _dataloader(torch, root, args.size, batch, workers, pin=device.type == "cuda")
        r = _train(torch, args, device, dl, "dataloader")
        r["how"] = how
        rows.append(r)
        base = rows[0]["img_s"]
        print(f"{'feed':11} {'img/s':>9} {'x on-device':>11} {'waited':>7}  notes")
        for r in rows:
            note = ""
            if "next_ms_median" in r:
                note = f"next() median {r['next_ms_median']:.3f} ms, p90 {r['next_ms_p90']:.3f} ms"
                if r["decoder"] != "-":
                    note += f", decoded by {r['decoder']}"
                if "peak_gpu_mib" in r:
                    note += (f", device memory held {r['device_used_mib']:,.0f} MiB (torch's peak "
                             f"{r['peak_gpu_mib']:,.0f} MiB)")
                if "decode_host_ms" in r:
                    note += f", decode stage {r['decode_host_ms']:.1f} ms host/batch, {r['gpu_fallbacks']} CPU fallbacks"
            elif r["feed"] == "dataloader":
                note = f"{workers} workers, {r['how']}, pin_memory={device.type == 'cuda'}"
            print(f"{r['feed']:11} {r['img_s']:9.1f} {r['img_s'] / base:11.2f} {r['wait_share']:7.1%}  {note}")
        if args.json:
            import json

            with open(args.json, "w") as f:
                json.dump({"model": args.train, "device": str(device), "batch": batch, "size": args.size,
                           "workers": workers, "rows": rows}, f, indent=1)
        return 0
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGCONT)
            stop_daemon(proc, 30)
        if log is not None:
            log.close()
        shutil.rmtree(work, ignore_errors=True)
