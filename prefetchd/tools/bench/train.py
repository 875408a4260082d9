"""``prefetchd bench --train MODEL``: a real training loop fed three ways, side by side in one run.

* ``on-device``: one uint8 batch already on the device, used again every step (the model's own
  ceiling: no data loading at all);
* ``prefetchd``: the daemon (random_resized_crop + flip) read through
  ``PrefetchClient(device=...)``, twice: ``ring full``, the ring filled with every batch of the run
  before the clock starts (a ceiling: the trainer never waits for the daemon), and ``steady``,
  the daemon producing while the model trains (ring capacity ``--capacity``, default the
  config's), measured once its backlog no longer flatters the trainer (``steady.py``);
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
  same on Pillow), ``pin_memory=True`` on a GPU, steady state as the prefetchd rows (its backlog:
  up to ``prefetch_factor`` x workers finished batches, read from the iterator's queues).

Every steady row warms up at least ``--warmup`` steps, then until the feed's backlog (batches
ready ahead of the trainer) is drained to the feed's read-ahead or holds over the last
``--steps`` steps, at most ``--warmup-max-s``; the row says which, with the backlog at the start
and end of its measured window. The rings are sized from a real bound (``_ring_bytes``: compact
batches as the daemon bounds them), so a small ``--size`` never stops a ring at max_bytes, and a
ring that stops filling is an error within a minute, not a 900 s wait.

The loop is pytorch/examples ``imagenet/main.py``'s: normalise on the device, bf16 autocast,
channels_last, SGD, ``loss.item()`` every step. It prints images/s, the ratio to the on-device
rate, the share of the measured time spent waiting for data, and for prefetchd the trainer
thread's time inside ``next()`` per batch.

``MODEL`` is ``tiny`` (a small convolutional net defined here, so the bench runs on any CPU) or a
torchvision model name (``resnet50``, ``resnet18``, ...). On a GPU:
``prefetchd bench --train resnet50 --root IMAGENET_LIKE_FOLDER --workers 14``; on a CPU, e.g.
``prefetchd bench --train tiny --device cpu --size 64 --batch-size 32 --steps 20``.
``--freeze-daemon`` stops the daemon (SIGSTOP) once a ring-full row's ring holds every batch of
the run, so on a machine with few cores its refills do not compete with the training for them
(the steady rows never freeze it: producing while the model trains is what they measure).
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

from prefetchd.format import batchfile, status
from prefetchd.tools.bench import steady
from prefetchd.tools.bench.throughput import stop_daemon

_FIRST_BATCH_S = 900.0  # the daemon indexes the dataset before its first batch
_STALL_S = 60.0  # a ring that gains no batch this long while filling has stopped


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

        from prefetchd.core.augment.modes import Draws, crop_for
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

    return endless(), how, dl


def _train(torch, args, device, batches, label: str, timed_next: list | None = None, backlog=None,
           floor: int = 1, depth: int = 0) -> dict:
    """Train on ``batches`` and time ``--steps`` steps after the warm-up. Without ``backlog`` the
    warm-up is ``--warmup`` steps. With it (a callable: the batches ready ahead of the trainer, or
    None where that cannot be seen) the warm-up runs at least ``--warmup`` steps and then until
    ``steady.settled`` says the feed's backlog is drained to ``floor`` or holds, at most
    ``--warmup-max-s`` after the first batch; where the backlog cannot be seen, ``depth`` more
    steps (the feed's read-ahead). The row says how its warm-up ended."""
    from prefetchd_client import normalize

    m = _model(torch, args.train, device)
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    it = iter(batches)
    wait = 0.0

    def step(timed: list | None) -> int:
        nonlocal wait
        tw = time.perf_counter()
        x, y = next(it)
        if timed is not None:
            timed.append(time.perf_counter() - tw)
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
        return x.shape[0]

    warm, readings, how, deadline = 0, [], "fixed", None
    tol = max(2, args.steps // 20)
    while True:
        if warm >= args.warmup:
            if backlog is None:
                break
            b = backlog()
            if b is None:  # not to be seen now (or ever: then warm up past the feed's read-ahead)
                if not readings and warm >= args.warmup + depth:
                    how = "blind"
                    break
            else:
                readings.append(b)
                how = steady.settled(readings, floor, args.steps, tol)
                if how:
                    break
            if deadline is not None and time.perf_counter() > deadline:
                how = "not settled"
                break
        step(None)
        warm += 1
        if deadline is None:
            deadline = time.perf_counter() + args.warmup_max_s
    sync()
    start = backlog() if backlog is not None else None
    wait, n = 0.0, 0
    if timed_next is not None:
        timed_next.clear()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        n += step(timed_next)
    sync()
    dt = time.perf_counter() - t0
    r = {"feed": label, "img_s": n / dt, "wait_share": wait / dt, "seconds": dt, "warmup_steps": warm}
    if backlog is not None:
        r.update(settled=how, backlog=[start, backlog()], tol=tol, floor=floor)
    return r


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


def _ring_bytes(paths: list[str], batch: int, size: int, capacity: int, decode: str) -> int:
    """``buffer.max_bytes`` for ``capacity`` batches (and two more in flight) of any batch of the
    dataset ``paths``. A pixel batch is ``batchfile.max_file_size``; a compact batch (hybrid,
    gpu) is bounded as the daemon bounds it before making it (``builders.compact_bound``: per
    sample the larger of its file and a pixel sample), here for the ``batch`` largest files, which
    bounds every batch, so a small ``--size`` with large JPEGs never stops the ring at max_bytes."""
    from prefetchd.executors import builders

    per = batchfile.max_file_size(batch, size, size)
    if decode != "cpu" and paths:
        sizes = [os.stat(p).st_size for p in paths]
        largest = sorted(range(len(paths)), key=sizes.__getitem__)[-batch:]
        largest += largest[-1:] * (batch - len(largest))  # fewer files than a batch: some repeat
        per = max(per, builders.compact_bound(sizes.__getitem__, largest, size))
    return (capacity + 2) * per + (64 << 20)


def _start_daemon(args, root: str, work: str, batch: int, capacity: int, workers: int, decode: str, state: str,
                  max_bytes: int):
    cache = os.path.join(work, "cache")  # one index for every daemon of the run
    work = os.path.join(work, f"{decode}-{state}")
    os.makedirs(work, exist_ok=True)
    buf = os.path.join(work, "buffer")
    # refill_at = capacity: the daemon tops the ring up as soon as a batch is taken (no hysteresis,
    # so a feed that keeps pace shows a backlog that holds)
    cfg = {"dataset": {"root": root, "cache_dir": cache},
           "loader": {"batch_size": batch, "seed": 0, "epochs": None},
           "workers": {"count": workers},
           "buffer": {"dir": buf, "capacity": capacity, "refill_at": capacity, "max_bytes": max_bytes},
           "augment": {"mode": "random_resized_crop", "flip": True, "output_size": args.size, "decode": decode,
                       **({"gpu_share": args.gpu_share} if decode == "hybrid" else {})}}
    path = os.path.join(work, "train.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    log = open(os.path.join(work, "daemon.log"), "wb")
    proc = subprocess.Popen([sys.executable, "-m", "prefetchd", "run", "--config", path], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log, path, buf


def _wait_full(proc, buf: str, capacity: int, log_path: str) -> str | None:
    """Wait until rank 0 has ``capacity`` ready batches; an error line if the daemon exits, makes
    no batch in ``_FIRST_BATCH_S`` (it indexes first) or stops adding batches for ``_STALL_S``."""
    t0 = last_change = time.monotonic()
    last = 0
    while True:
        s = status.read_json(buf, status.STATUS_NAME) or {}
        ready = s.get("ranks", {}).get("0", {}).get("ready", 0)
        if ready >= capacity:
            return None
        now = time.monotonic()
        if ready != last:
            last, last_change = ready, now
        if proc.poll() is not None:
            return f"the daemon exited with {proc.returncode}; see {log_path}"
        if (ready == 0 and now - t0 > _FIRST_BATCH_S) or (ready and now - last_change > _STALL_S):
            return (f"the ring stopped at {ready} of {capacity} batches ({now - last_change:.0f} s without a new "
                    f"one): {s.get('bytes_used')} of buffer.max_bytes {s.get('max_bytes')} bytes used, "
                    f"{s.get('fs_free')} free on the buffer's filesystem; see {log_path}")
        time.sleep(0.2)


def _client_row(torch, args, device, c, label: str, backlog=None) -> dict:
    """Train from the client ``c``; the row adds next()'s times, memory and the decode stage's costs."""
    cuda = device.type == "cuda"
    nexts: list[float] = []

    def epochs():
        while True:
            yield from c

    r = _train(torch, args, device, epochs(), label, nexts, backlog=backlog, floor=c.prefetch)
    r["next_ms_median"] = statistics.median(nexts) * 1e3
    r["next_ms_p90"] = sorted(nexts)[int(0.9 * (len(nexts) - 1))] * 1e3
    r["decoder"] = "-" if label == "prefetchd" else ("nvImageCodec" if cuda else "stand-in: simplejpeg on the CPU")
    if c._stage is not None and c._stage.batches:
        r["decode_host_ms"] = c._stage.host_s / c._stage.batches * 1e3
        r["gpu_fallbacks"] = c._stage.fallbacks
    return r


def _note(r: dict, workers: int, device) -> str:
    note = []
    if "settled" in r:
        end = {"drained": f"drained to <= {r['floor']} ready", "held": f"backlog held (within {r['tol']})",
               "blind": "backlog unseen: past its read-ahead", "not settled": "NOT settled: --warmup-max-s"}
        b0, b1 = ("?" if b is None else b for b in r["backlog"])
        note.append(f"warm-up {r['warmup_steps']} steps, {end[r['settled']]}; backlog {b0} -> {b1}")
    if "next_ms_median" in r:
        note.append(f"next() median {r['next_ms_median']:.3f} ms, p90 {r['next_ms_p90']:.3f} ms")
        if r["decoder"] != "-":
            note.append(f"decoded by {r['decoder']}")
        if "peak_gpu_mib" in r:
            note.append(f"device memory held {r['device_used_mib']:,.0f} MiB (torch's peak "
                        f"{r['peak_gpu_mib']:,.0f} MiB)")
        if "decode_host_ms" in r:
            note.append(f"decode stage {r['decode_host_ms']:.1f} ms host/batch, {r['gpu_fallbacks']} CPU fallbacks")
    elif r["feed"] == "dataloader":
        note.append(f"{workers} workers, {r['how']}, pin_memory={device.type == 'cuda'}, {r['batches_per_epoch']} "
                    f"batches an epoch (each starts with its workers' queues empty)")
    return ", ".join(note)


def run_train_bench(args) -> int:
    try:
        import torch
    except ImportError:
        print("bench --train needs torch: pip install prefetchd[torch]", file=sys.stderr)
        return 2
    from prefetchd_client import PrefetchClient

    from prefetchd.core.config import BufferConfig
    from prefetchd.tools.bench.throughput import _buffer_parent, _cores, list_images

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    batch = args.batch_size or 256
    decodes = [d.strip() for d in (args.decodes or "cpu,hybrid,gpu").split(",") if d.strip()]
    if not decodes or set(decodes) - {"cpu", "hybrid", "gpu"}:
        print(f"--decodes takes a comma-separated list of cpu, hybrid, gpu; got {args.decodes!r}", file=sys.stderr)
        return 2
    if device.type == "cuda" and set(decodes) & {"hybrid", "gpu"}:
        # the GPU rows need nvImageCodec: checked before any daemon starts, in the way the client
        # checks it (after torch and torchvision, as a trainer imports them)
        from prefetchd_client.gpudecode import DecodeUnavailable, load_nvimgcodec

        try:
            load_nvimgcodec()
        except DecodeUnavailable as e:
            if args.decodes is not None:  # asked for by name: say why it cannot run
                print(f"--decodes {args.decodes}: {e}", file=sys.stderr)
                return 2
            print(f"the hybrid and gpu rows are left out: {e}", file=sys.stderr, flush=True)
            decodes = [d for d in decodes if d == "cpu"]
    root = args.root[0] if args.root else None
    if root is not None and not os.path.isdir(root):
        print(f"--train reads an ImageFolder (the DataLoader row needs one); {root} is not a directory",
              file=sys.stderr)
        return 2
    workers = args.workers or _cores()
    steady_capacity = args.capacity or BufferConfig.capacity
    work = tempfile.mkdtemp(prefix="prefetchd-bench-train-", dir=_buffer_parent(args))
    proc = log = None
    try:
        if root is None:
            from prefetchd.tools.samples import make_image_folder

            root = os.path.join(work, "data")
            make_image_folder(root, classes=20, per_class=max(1, args.images // 20), seed=1)
        paths = list_images(root)
        print(f"train {args.train} on {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
              f"batch {batch}x3x{args.size}x{args.size}, bf16 autocast, channels_last, loss.item() every step; "
              f"{args.steps} measured steps; {workers} workers; {_cores()} cores", flush=True)
        print(f"ring full: the daemon fills its ring with every warm-up and measured batch ({args.warmup} + "
              f"{args.steps}) before the clock starts, a ceiling, not what a trainer sees; steady: the feed "
              f"produces while the model trains (ring capacity {steady_capacity}), the clock starts after at least "
              f"{args.warmup} warm-up steps once the feed's backlog (batches ready ahead of the trainer) is drained "
              f"to its read-ahead or has held over the last {args.steps} steps (at most {args.warmup_max_s:g} s)",
              flush=True)
        rows = []
        x = torch.randint(0, 256, (batch, 3, args.size, args.size), dtype=torch.uint8, device=device)
        x = x.contiguous(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (batch,), device=device)

        def same():
            while True:
                yield x, y

        rows.append({**_train(torch, args, device, same(), "on-device"), "state": "-"})
        cuda = device.type == "cuda"
        for decode in decodes:
            label = "prefetchd" if decode == "cpu" else decode
            # without a GPU the client decodes the compact batches with a CPU stand-in
            decoder = None if cuda or decode == "cpu" else _cpu_decoder()
            for state in ("ring full", "steady"):
                # ring full: the ring holds every batch of the run before the clock starts
                capacity = args.warmup + args.steps + 2 if state == "ring full" else steady_capacity
                proc, log, cfg_path, buf = _start_daemon(args, root, work, batch, capacity, workers, decode,
                                                         state.replace(" ", "-"),
                                                         _ring_bytes(paths, batch, args.size, capacity, decode))
                if state == "ring full":
                    t0 = time.monotonic()
                    err = _wait_full(proc, buf, capacity, log.name)
                    if err:
                        print(f"{label}: {err}", file=sys.stderr)
                        return 1
                    print(f"{label}: ring full ({capacity} batches) after {time.monotonic() - t0:.1f} s", flush=True)
                    if args.freeze_daemon:
                        # every batch of the run is in the ring: stop the daemon's refills competing for the cores
                        os.killpg(proc.pid, signal.SIGSTOP)
                if cuda:
                    torch.cuda.synchronize(device)
                    torch.cuda.reset_peak_memory_stats(device)
                    free, total = torch.cuda.mem_get_info(device)
                    used_before = total - free
                with PrefetchClient(cfg_path, device=device if cuda else None, timeout=120,
                                    prefetch=args.prefetch, decoder=decoder) as c:
                    probe = None if state == "ring full" else (lambda c=c, buf=buf: steady.ring_backlog(buf, c))
                    r = _client_row(torch, args, device, c, label, probe)
                    r["state"] = state
                    if cuda:
                        r["peak_gpu_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
                        torch.cuda.synchronize(device)
                        free, total = torch.cuda.mem_get_info(device)
                        r["device_used_mib"] = (total - free - used_before) / 2**20
                    rows.append(r)
                os.killpg(proc.pid, signal.SIGCONT)
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)
                proc = None
                log.close()
                log = None
        feed, how, dl = _dataloader(torch, root, args.size, batch, workers, pin=device.type == "cuda")
        r = _train(torch, args, device, feed, "dataloader", backlog=lambda: steady.loader_backlog(dl), floor=1,
                   depth=workers * 4)
        r.update(how=how, state="steady", batches_per_epoch=len(dl))
        rows.append(r)
        base = rows[0]["img_s"]
        print(f"{'feed':11} {'state':9} {'img/s':>9} {'x on-device':>11} {'waited':>7}  notes")
        for r in rows:
            print(f"{r['feed']:11} {r['state']:9} {r['img_s']:9.1f} {r['img_s'] / base:11.2f} {r['wait_share']:7.1%}  "
                  f"{_note(r, workers, device)}")
        if args.json:
            import json

            with open(args.json, "w") as f:
                json.dump({"model": args.train, "device": str(device), "batch": batch, "size": args.size,
                           "workers": workers, "warmup": args.warmup, "steps": args.steps,
                           "warmup_max_s": args.warmup_max_s, "steady_capacity": steady_capacity, "rows": rows},
                          f, indent=1)
        return 0
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGCONT)
            stop_daemon(proc, 30)
        if log is not None:
            log.close()
        shutil.rmtree(work, ignore_errors=True)
