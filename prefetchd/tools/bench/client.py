"""``prefetchd bench --client``: what the client costs the trainer's thread when the next batch is ready.

The ring is filled before the clock starts: the bench writes ``--batches`` batch files of
``--batch-size`` x ``--size`` x ``--size`` x 3 random pixels in the daemon's format into a buffer
directory on tmpfs, holds that directory's lock and writes its meta.json as the daemon does, and
then no daemon runs (its decoding would share the cores with what is measured). A loop in the
style of a training loop takes a batch, then "trains" for ``--step-ms`` (the thread sleeps, as a
trainer does in ``loss.item()`` while the GPU works), and the time spent inside ``next()`` is
recorded for every batch but the first of each pass (the loop drops its batch before the next
``next()``, so the time includes freeing it, 38.5 MB of pages). Two ways, side by side:

* ``sync``: the old client's way, everything in the trainer's thread: open, read, checksum,
  parse, progress report, conversion (the client's own ``_load``, called in this thread).
* ``thread``: the client as it is: a reader thread ``prefetch`` batches ahead; ``next()`` takes
  the next item from a queue (and, on a GPU, makes the stream wait on the copy's event).

Feeds: numpy arrays, CPU tensors and, where CUDA is available, CUDA tensors.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import threading
import time

import numpy as np
import yaml

from prefetchd.core.config import load as load_config
from prefetchd.daemon.ring import Lock, is_tmpfs
from prefetchd.format import batchfile, status


def _write_ring(work: str, batches: int, batch_size: int, size: int) -> str:
    """A buffer directory holding epoch 0's ``batches`` files for rank 0, as a full ring has them."""
    root = os.path.join(work, "data", "c0")
    os.makedirs(root)
    buf = os.path.join(work, "buffer")
    cfg = {"dataset": {"root": os.path.dirname(root)},
           "loader": {"batch_size": batch_size, "epochs": 1},
           "buffer": {"dir": buf, "capacity": batches}, "augment": {"output_size": size}}
    path = os.path.join(work, "cfg.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    os.makedirs(os.path.join(buf, "progress"))
    fingerprint = "5eed" * 4
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (batch_size, size, size, 3), dtype=np.uint8)
    idx = np.arange(batch_size, dtype=np.int64)
    for b in range(batches):
        images[0, 0, 0, 0] = b  # each file its own bytes
        fd = os.open(os.path.join(buf, batchfile.batch_name(0, 0, b)), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            batchfile.write_batch(fd, batchfile.BatchMeta(0, 0, b, batches, batchfile.fingerprint_u64(fingerprint)),
                                  idx + b * batch_size, idx % 10, np.full(batch_size, -1, np.int64), images)
        finally:
            os.close(fd)
    return path


def _serve(cfg_path: str, batches: int) -> Lock:
    """Hold the buffer's lock and publish its meta.json, as the daemon does once it runs."""
    cfg = load_config(cfg_path)
    lock = Lock(cfg.buffer.dir)
    lock.acquire()
    status.write_json(cfg.buffer.dir, status.META_NAME, {
        "format": "prefetchd-meta", "version": 1, "pid": os.getpid(), "fingerprint": "5eed" * 4,
        "stream_fingerprint": cfg.stream_fingerprint(), "batch_size": cfg.loader.batch_size,
        "batches_per_epoch": batches, "world_size": 1, "ranks": [0], "epochs": 1,
        "output_size": cfg.augment.output_size, "progress_dir": cfg.progress_dir})
    return lock


def _measure(cfg_path: str, feed: str, way: str, batches: int, passes: int, step_s: float, prefetch: int) -> list[float]:
    from prefetchd_client import PrefetchClient

    kw = {"as_numpy": True} if feed == "numpy" else {"device": "cuda"} if feed == "cuda" else {}
    sync_cuda = None
    if feed == "cuda":
        import torch

        sync_cuda = torch.cuda.synchronize
    times: list[float] = []
    with PrefetchClient(cfg_path, timeout=30, prefetch=prefetch, **kw) as c:
        for _ in range(passes):
            c.seek(0, 0)
            if way == "sync":
                c._resolve_device()
                stop = threading.Event()

                def take(b, c=c, stop=stop):
                    with c._reader_context():  # on a GPU: the side stream, as the reader uses it
                        images, labels, event, info = c._load(0, b, stop)
                    if event is not None:
                        c._transfer.wait(event, c.device, (images, labels))
                    return images, labels

                it = (take(b) for b in range(batches))
            else:
                it = iter(c)
            for b in range(batches):
                t = time.perf_counter()
                x, y = next(it)
                dt = time.perf_counter() - t
                if b:
                    times.append(dt)
                if sync_cuda is not None:
                    x.float().sum()  # the trainer uses the batch on its stream
                time.sleep(step_s)
                del x, y
            if sync_cuda is not None:
                sync_cuda()
            del it
    return times


def run_client_bench(args) -> int:
    parent = args.buffer_parent or ("/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir())
    batch_size = args.batch_size or 256
    size, batches, passes = args.size, args.batches or 24, args.passes
    step_s = args.step_ms / 1000
    feeds = ["numpy", "tensor"]
    try:
        import torch

        if torch.cuda.is_available():
            feeds.append("cuda")
    except ImportError:
        feeds = ["numpy"]
    work = tempfile.mkdtemp(prefix="prefetchd-bench-client-", dir=parent)
    lock = None
    try:
        cfg_path = _write_ring(work, batches, batch_size, size)
        nbytes = os.path.getsize(os.path.join(work, "buffer", batchfile.batch_name(0, 0, 0)))
        lock = _serve(cfg_path, batches)
        print(f"client cost per next(), next batch ready: {batches} batches of {batch_size}x{size}x{size}x3 "
              f"({nbytes / 1e6:.1f} MB) in {parent} ({'tmpfs' if is_tmpfs(parent) else 'not tmpfs'}), "
              f"{passes} passes, step {args.step_ms:g} ms (sleep), prefetch {args.prefetch}, {os.cpu_count()} cores")
        print(f"{'feed':8} {'way':7} {'median ms':>10} {'p90 ms':>8} {'n':>4}")
        rows = []
        for feed in feeds:
            for way in ("sync", "thread"):
                t = _measure(cfg_path, feed, way, batches, passes, step_s, args.prefetch)
                t.sort()
                med, p90 = statistics.median(t) * 1e3, t[int(0.9 * (len(t) - 1))] * 1e3
                rows.append({"feed": feed, "way": way, "median_ms": med, "p90_ms": p90, "n": len(t)})
                print(f"{feed:8} {way:7} {med:10.3f} {p90:8.3f} {len(t):4d}", flush=True)
            s, n = rows[-2]["median_ms"], rows[-1]["median_ms"]
            print(f"{feed:8} sync/thread median ratio {s / n:.0f}x", flush=True)
        if args.json:
            import json

            with open(args.json, "w") as f:
                json.dump({"bytes": nbytes, "step_ms": args.step_ms, "prefetch": args.prefetch, "rows": rows}, f, indent=1)
        return 0
    finally:
        if lock is not None:
            lock.release()
        shutil.rmtree(work, ignore_errors=True)
