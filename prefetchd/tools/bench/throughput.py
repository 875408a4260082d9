"""``prefetchd bench``: the daemon's throughput beside the decode-only limit, in one run.

Everything is measured side by side on the same corpus and cores, and reported as ratios:

* **decode-only limit**: Pillow (libjpeg-turbo) merely decoding every image, at reduced DCT
  scale where a 256 shorter side allows, one process per worker, nothing else done. No
  pipeline that decodes every image can beat it by more than its decoder's edge.
* **daemon**: the real daemon (``python -m prefetchd run``) in a subprocess with the client
  consuming as fast as it can; images/s from the first batch the client got to the last, and
  the client's total wait.
* **DataLoader peer** (``--peer``, needs torch): ``torch.utils.data.DataLoader`` with the same
  augmentation written as a user writes it with Pillow (what torchvision's transforms do on PIL
  images: resize the whole image, crop, flip, jitter).
* **client read**: reading a published batch into a preallocated buffer with ``readinto``,
  against ``memcpy`` of the same bytes.

``--ranks N`` runs N consumer processes (world size N, one rank each) against one daemon, each
reading ``--batches`` batches as fast as it can, all started with the daemon (a cold ring is part
of the run; each rank is timed from the first batch it asks for). It prints images/s of all ranks
together, the per-rank spread (slowest/fastest), the CPU of the daemon's main process (% of one
core, and per published batch: what the loop costs, apart from the workers). ``--ranks 1,8,64``
runs several counts in turn; ``--capacity`` sets ``buffer.capacity`` (default 1,000).

``--sweep-workers`` repeats the daemon run for 1..cores(+1) workers and prints mean and spread,
plotting error bars to ``--plot`` when matplotlib is installed. ``--index-scale N`` measures the
memory a cached index of N entries adds to the whole daemon and the time to its first batch.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from multiprocessing import get_context

import numpy as np

from prefetchd.core.bars import bar
from prefetchd.format import batchfile
from prefetchd.tools.bench.limit import decode_limit, say_skipped
from prefetchd.tools.demo import write_config

# 32 readers importing numpy and the client on 2 cores shared with other work took over 120 s at
# load average 40; the wait is before the daemon starts, so it is outside every measurement
_READERS_READY_S = 600


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def list_images(root: str) -> list[str]:
    out: list[str] = []
    if not os.path.isdir(root):  # an archive: its images are not files
        return out
    for cls in sorted(os.listdir(root)):
        d = os.path.join(root, cls)
        if os.path.isdir(d):
            out += [os.path.join(d, f) for f in sorted(os.listdir(d))]
    return out


# --- the daemon ----------------------------------------------------------------------------------------


def stop_daemon(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM the daemon a benchmark started; its process group is killed if it is not gone in time."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


BLOCK_SUFFIX = "@block"  # --root PATH@block: PATH read with loader.shuffle: block


def daemon_run(root: str, workers: int, batch_size: int, epochs: int, augment: dict, work: str,
               parent: str, capacity: int = 16, workers_extra: dict | None = None, daemon_src: str | None = None) -> dict:
    from prefetchd_client import PrefetchClient

    run = tempfile.mkdtemp(prefix="run-", dir=work)
    buffer = tempfile.mkdtemp(prefix="prefetchd-bench-", dir=parent)
    os.rmdir(buffer)
    cfg = os.path.join(run, "bench.yaml")
    loader = {}
    if root.endswith(BLOCK_SUFFIX):  # a Parquet root read with loader.shuffle: block, beside its full shuffle
        root, loader = root[:-len(BLOCK_SUFFIX)], {"shuffle": "block"}
    write_config(cfg, root, buffer, os.path.join(work, "cache"), batch_size, epochs, workers, capacity,
                 extra={"augment": augment, "buffer": {"max_bytes": "4GiB"}, "workers": workers_extra or {},
                        "loader": loader})
    log = open(os.path.join(run, "daemon.log"), "wb")
    t_start = time.monotonic()
    env = dict(os.environ)
    if daemon_src:  # an A/B run: the daemon from another source tree (cwd=run: not ours first)
        env["PYTHONPATH"] = daemon_src + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen([sys.executable, "-m", "prefetchd", "run", "--config", cfg], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True, env=env, cwd=run)
    try:
        _daemon_started(proc, buffer, os.path.join(run, "daemon.log"))
        import psutil

        rss_by_epoch = []
        times = []
        n = 0
        with PrefetchClient(cfg, timeout=120, as_numpy=True) as c:
            for e in range(epochs):
                for _, y in bar(c.iter_epoch(e), total=len(c), desc=f"daemon epoch {e}", unit="batch", leave=False):
                    times.append(time.monotonic())
                    n += len(y)
                # the daemon's children: the forkserver and the workers
                rss_by_epoch.append([k.memory_info().rss for k in psutil.Process(proc.pid).children(recursive=True)])
            wait = c.wait_s
        first_wait = times[0] - t_start
        img_s = (n - batch_size) / (times[-1] - times[0])
        return {"img_s": img_s, "images": n, "wait_s": wait, "first_batch_s": first_wait,
                "max_child_rss_by_epoch": [max(r) if r else 0 for r in rss_by_epoch]}
    finally:
        stop_daemon(proc, 30)
        log.close()
        shutil.rmtree(buffer, ignore_errors=True)


def _daemon_started(proc: subprocess.Popen, buffer: str, log_path: str) -> None:
    """Wait until the daemon has written its meta.json; if it exits first, say why (its log's last line)."""
    from prefetchd.format import status

    while not os.path.exists(os.path.join(buffer, status.META_NAME)):
        if proc.poll() is not None:
            with open(log_path, errors="replace") as f:
                last = ([x for x in f.read().splitlines() if x.strip()] or ["(no output)"])[-1]
            raise RuntimeError(f"the daemon exited with status {proc.returncode} before its first batch: {last}")
        time.sleep(0.05)


# --- many ranks against one daemon ---------------------------------------------------------------------------


def _rank_reader(cfg: str, rank: int, batches: int, start, out) -> None:
    from prefetchd_client import PrefetchClient

    out.put(("ready", rank))
    start.wait()  # started with the daemon: a cold ring is part of the run
    t0 = time.monotonic()  # from the first batch this rank asks for
    with PrefetchClient(cfg, rank=rank, timeout=300, as_numpy=True) as c:
        n = 0
        e = 0
        while n < batches:
            for _ in c.iter_epoch(e):
                n += 1
                if n >= batches:
                    break
            e += 1
        out.put((rank, n * c.meta()["batch_size"], t0, time.monotonic()))


def ranks_run(root: str, ranks: int, workers: int, batch_size: int, capacity: int, batches: int, augment: dict,
              work: str, parent: str, daemon_src: str | None = None) -> dict:
    import psutil

    from prefetchd.format import status

    run = tempfile.mkdtemp(prefix=f"ranks{ranks}-", dir=work)
    buffer = tempfile.mkdtemp(prefix="prefetchd-bench-", dir=parent)
    os.rmdir(buffer)
    cfg = os.path.join(run, "bench.yaml")
    per = batchfile.max_file_size(batch_size, augment.get("output_size", 224), augment.get("output_size", 224))
    write_config(cfg, root, buffer, os.path.join(work, "cache"), batch_size, None, workers, capacity,
                 extra={"augment": augment, "loader": {"world_size": ranks},
                        "buffer": {"max_bytes": per * capacity * ranks + (64 << 20)}})
    env = dict(os.environ)
    if daemon_src:  # an A/B run: the daemon from another source tree, the same client and config
        env["PYTHONPATH"] = daemon_src + os.pathsep + env.get("PYTHONPATH", "")  # (cwd=run: not ours first)
    log = open(os.path.join(run, "daemon.log"), "wb")
    log.write(f"daemon from {daemon_src or 'the installed prefetchd'}\n".encode())
    log.flush()
    ctx = get_context("forkserver")
    start, out = ctx.Event(), ctx.Queue()
    readers = [ctx.Process(target=_rank_reader, args=(cfg, r, batches, start, out), daemon=True) for r in range(ranks)]
    for p in readers:
        p.start()
    for _ in readers:  # every reader has imported what it needs before the clock starts (and the daemon)
        out.get(timeout=_READERS_READY_S)
    proc = subprocess.Popen([sys.executable, "-m", "prefetchd", "run", "--config", cfg], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True, env=env, cwd=run)
    try:
        main = psutil.Process(proc.pid)
        start.set()
        cpu0 = _cpu(main)
        t0 = time.monotonic()
        done: list = []
        first = None  # (main CPU, published) at the first status showing a published batch
        deadline = t0 + 900
        while len(done) < len(readers) and time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the daemon exited with status {proc.returncode}; see {run}/daemon.log")
            try:
                done.append(out.get(timeout=0.2))
            except queue.Empty:
                pass
            if first is None:
                cpu = _cpu(main)
                rec0 = status.read_json(buffer, status.STATUS_NAME) or {}
                if rec0.get("produced_batches", 0) > 0:
                    first = (cpu, rec0["produced_batches"])
        t1, t1_wall = time.monotonic(), time.time()
        cpu1 = _cpu(main)
        rec: dict = {}
        while time.monotonic() < t1 + 5:  # a status written after the end: its count covers the run
            rec = status.read_json(buffer, status.STATUS_NAME) or {}
            if rec.get("updated", 0) >= t1_wall:
                break
            time.sleep(0.02)
        cpu2 = _cpu(main)
        produced = rec.get("produced_batches", 0)
        first = first or (cpu0, 0)
        rates = [n / (b - a) for _, n, a, b in done]
        images = sum(n for _, n, _, _ in done)
        span = max(b for *_, b in done) - min(a for _, _, a, _ in done)
        return {"ranks": ranks, "capacity": capacity, "img_s": images / span, "images": images,
                "rank_img_s_min": min(rates), "rank_img_s_max": max(rates),
                "main_cpu_pct": 100 * (cpu1 - cpu0) / (t1 - t0),
                "main_cpu_ms_per_batch": 1000 * (cpu2 - first[0]) / max(1, produced - first[1]),
                "published": produced}
    finally:
        stop_daemon(proc, 60)
        for p in readers:
            p.join(5)
            if p.is_alive():
                p.kill()
        log.close()
        shutil.rmtree(buffer, ignore_errors=True)


def _cpu(p) -> float:
    t = p.cpu_times()  # this process and its threads, not its children (the workers)
    return t.user + t.system


# --- the DataLoader peer -------------------------------------------------------------------------------


class _PeerDataset:
    """ImageFolder + RandomResize(256, 481) + RandomCrop(224) + flip (+ ColorJitter), on PIL."""

    def __init__(self, paths, jitter: bool, mode: str):
        self.paths, self.jitter, self.mode = paths, jitter, mode

    def __len__(self):
        return len(self.paths)

    def _decodable(self, i: int, Image):
        """Sample ``i``, or the next file Pillow can decode (a user's dataset skips a corrupt file
        so, and the daemon replaces it): one bad JPEG must not end the peer's run."""
        for k in range(len(self.paths)):
            try:
                with open(self.paths[(i + k) % len(self.paths)], "rb") as f:
                    return Image.open(f).convert("RGB")
            except Exception:  # noqa: BLE001 - whatever Pillow raises for a bad file (OSError, a bomb, ...)
                continue
        raise ValueError(f"none of the {len(self.paths)} files could be decoded")

    def __getitem__(self, i):
        import random

        import torch
        from PIL import Image, ImageEnhance

        im = self._decodable(i, Image)
        w, h = im.size
        if self.mode == "random_resized_crop":
            from prefetchd.core.augment.modes import Draws, crop_for
            from prefetchd.core.config import AugmentConfig
            c = crop_for(AugmentConfig(mode="random_resized_crop"), w, h,
                         Draws(np.random.random(48), np.zeros(3)))
            im = im.resize((224, 224), Image.Resampling.BILINEAR, box=(c.left, c.top, c.right, c.bottom))
        else:
            s = random.randint(256, 480)
            rw, rh = (s, int(s * h / w)) if w <= h else (int(s * w / h), s)
            im = im.resize((rw, rh), Image.Resampling.BILINEAR)
            x, y = random.randint(0, rw - 224), random.randint(0, rh - 224)
            im = im.crop((x, y, x + 224, y + 224))
        if random.random() < 0.5:
            im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        if self.jitter:
            ops = [ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color]
            random.shuffle(ops)
            for op in ops:
                im = op(im).enhance(random.uniform(0.6, 1.4))
        return torch.from_numpy(np.array(im)).permute(2, 0, 1), i % 1000  # as PILToTensor: a copy


def peer_dataloader(paths: list[str], workers: int, batch_size: int, jitter: bool, mode: str) -> float:
    import torch

    ds = _PeerDataset(paths, jitter, mode)
    dl = torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=True, num_workers=workers,
                                     persistent_workers=True, drop_last=True)
    it = iter(dl)
    next(it)  # warm-up: workers started, first batch made
    t = time.perf_counter()
    n = sum(x.shape[0] for x, _ in it)
    return n / (time.perf_counter() - t)


# --- the client's read ---------------------------------------------------------------------------------


def _buffer_parent(args=None) -> str:
    if args is not None and getattr(args, "buffer_parent", None):
        return args.buffer_parent
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def client_read_vs_memcpy(parent: str, batch_size: int = 256, size: int = 224, repeats: int = 20) -> dict:
    d = tempfile.mkdtemp(prefix="prefetchd-bench-read-", dir=parent)
    try:
        images = np.random.default_rng(0).integers(0, 256, (batch_size, size, size, 3), dtype=np.uint8)
        path = os.path.join(d, "b.batch")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        z = np.zeros(batch_size, np.int64)
        nbytes = batchfile.write_batch(fd, batchfile.BatchMeta(0, 0, 0, 1, 0), z, z, z - 1, images)
        os.close(fd)
        buf = np.empty(nbytes, np.uint8)
        src = np.empty(nbytes, np.uint8)
        src[:] = 1
        read_t, verify_t, copy_t = [], [], []
        for _ in range(repeats):
            t = time.perf_counter()
            fd = os.open(path, os.O_RDONLY)
            batchfile.copy_into(fd, buf)  # what the client does
            os.close(fd)
            read_t.append(time.perf_counter() - t)
            t = time.perf_counter()
            batchfile.parse(buf, verify=True)
            verify_t.append(time.perf_counter() - t)
            t = time.perf_counter()
            np.copyto(buf, src)
            copy_t.append(time.perf_counter() - t)
        gb = nbytes / 1e9
        r, v, c = (statistics.median(x) for x in (read_t, verify_t, copy_t))
        return {"bytes": nbytes, "read_gb_s": gb / r, "read_verify_gb_s": gb / (r + v), "memcpy_gb_s": gb / c}
    finally:
        shutil.rmtree(d, ignore_errors=True)


# --- the index at ImageNet scale -------------------------------------------------------------------------


def index_scale(root: str, n: int, work: str, workers: int) -> dict:
    """A file list of ``n`` entries (the corpus repeated): the daemon's memory with it, against a
    small list of the same files, and the time from ``run`` to the first batch on a cached index."""
    import psutil
    from prefetchd_client import PrefetchClient

    files = list_images(root)
    out = {}
    for label, count in (("small", len(files)), ("large", n)):
        lst = os.path.join(work, f"list-{label}.txt")
        with open(lst, "w") as f:
            for i in range(count):
                f.write(f"{files[i % len(files)]} {i % 1000}\n")
        run = tempfile.mkdtemp(prefix=f"index-{label}-", dir=work)
        buffer = os.path.join("/dev/shm" if os.access("/dev/shm", os.W_OK) else run, os.path.basename(run) + "-buf")
        cfg = os.path.join(run, "c.yaml")
        write_config(cfg, root, buffer, os.path.join(work, "cache"), 64, None, workers, 4,
                     extra={"dataset": {"root": None, "file_list": lst}})
        for attempt in ("scan", "cached"):
            t0 = time.monotonic()
            proc = subprocess.Popen([sys.executable, "-m", "prefetchd", "run", "--config", cfg],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            try:
                with PrefetchClient(cfg, timeout=600, as_numpy=True) as c:
                    it = c.iter_epoch(0)
                    next(it)
                    first = time.monotonic() - t0
                    for _ in range(3):
                        next(it)
                procs = [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)
                pss = 0
                for p in procs:
                    try:
                        pss += p.memory_full_info().pss
                    except psutil.Error:
                        pass
                out[f"{label}_{attempt}_first_batch_s"] = first
                out[f"{label}_{attempt}_pss"] = pss
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)
        shutil.rmtree(buffer, ignore_errors=True)
    out["index_pss_delta"] = out["large_cached_pss"] - out["small_cached_pss"]
    out["n"] = n
    return out


# --- the Ray executor against the local one --------------------------------------------------------


def ray_vs_local(root: str, workers: int, batch: int, args, aug: dict, work: str) -> list[dict]:
    """The same daemon run with local workers, with as many Ray actors on a one-node cluster of
    the same cores (started here, on loopback), and mixed (both), alternating, ``--repeats``
    times; with ``--daemon-src``, also Ray with the daemon from that tree (an A/B of the driver)."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keep Ray on 127.0.0.1
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": workers, "node_ip_address": "127.0.0.1",
                                                            "object_store_memory": 512 * 2**20})
    rows = []
    try:
        ray_cfg = {"address": cluster.address, "workers": workers, "node_ip_address": "127.0.0.1",
                   "connect_timeout_s": 120}
        kinds = {"local": {}, "ray": {"executor": "ray", "ray": ray_cfg},
                 "mixed": {"executor": "mixed", "count": workers, "ray": ray_cfg}}
        for rep in range(args.repeats):
            row = {}
            for kind, extra in kinds.items():
                row[kind] = daemon_run(root, workers, batch, args.epochs, aug, work, _buffer_parent(args),
                                       workers_extra=extra)["img_s"]
            if args.daemon_src:
                row["ray_other_src"] = daemon_run(root, workers, batch, args.epochs, aug, work, _buffer_parent(args),
                                                  workers_extra=kinds["ray"], daemon_src=args.daemon_src)["img_s"]
            rows.append(row)
            print(f"[{rep + 1}/{args.repeats}] " + " | ".join(
                f"{k} {v:,.0f} img/s ({v / row['local']:.2f} x local)" for k, v in row.items()), flush=True)
    finally:
        cluster.shutdown()
    return rows


# --- the command ---------------------------------------------------------------------------------------------


def _augment(args) -> dict:
    a: dict = {}
    if args.mode:
        a["mode"] = args.mode
    if args.jitter:
        a.update(brightness=0.4, contrast=0.4, saturation=0.4)
    if getattr(args, "output_size", None):
        s = args.output_size
        a.update(output_size=s, scale_min=s, scale_max=s + s // 2, eval_resize=s)
    return a


def run_bench(args) -> int:
    from prefetchd.core.config import load as load_config

    work = tempfile.mkdtemp(prefix="prefetchd-bench-")
    try:
        if args.config:
            cfg = load_config(args.config)
            if cfg.dataset.root is None:
                print("bench needs an ImageFolder (dataset.root)", file=sys.stderr)
                return 2
            root = cfg.dataset.root
            batch = args.batch_size or cfg.loader.batch_size
            workers = args.workers or cfg.workers.resolved_count()
        elif args.root:
            args.root = [os.path.abspath(r) for r in args.root]  # the daemon's config lives elsewhere
            root = args.root[0]
            batch = args.batch_size or 64
            workers = args.workers or _cores()
        else:
            from prefetchd.tools.samples import make_image_folder

            root = os.path.join(work, "data")
            t = time.monotonic()
            n = make_image_folder(root, classes=20, per_class=max(1, args.images // 20), seed=1,
                                  long_side=args.image_side)
            print(f"made {n} sample JPEGs in {time.monotonic() - t:.1f} s")
            batch = args.batch_size or 64
            workers = args.workers or _cores()
        paths = list_images(root)
        aug = _augment(args)
        from prefetchd.daemon.ring import is_tmpfs

        parent = _buffer_parent(args)
        print(f"corpus {root}: {len(paths)} images; batch {batch}; augment {aug or 'scale (default)'}; "
              f"{_cores()} cores; buffers in {parent} ({'tmpfs' if is_tmpfs(parent) else 'not tmpfs'})")
        results: dict = {"corpus": root, "images": len(paths), "batch_size": batch, "augment": aug, "cores": _cores()}
        if args.index_scale:
            r = index_scale(root, args.index_scale, work, workers)
            results["index_scale"] = r
            print(f"index of {r['n']:,} entries: adds {r['index_pss_delta'] / 2**20:,.1f} MiB (PSS, daemon + workers); "
                  f"first batch {r['large_cached_first_batch_s']:.2f} s after run on the cached index "
                  f"({r['large_scan_first_batch_s']:.2f} s when scanning the list)")
        elif args.ranks:
            rows = []
            for n in [int(x) for x in str(args.ranks).split(",")]:
                r = ranks_run(root, n, workers, batch, args.capacity or 1000, args.batches or 200, aug, work, _buffer_parent(args),
                              args.daemon_src)
                rows.append(r)
                print(f"ranks {n:3d} (capacity {r['capacity']}): {r['img_s']:8,.0f} img/s all ranks; per rank "
                      f"{r['rank_img_s_min']:,.0f}..{r['rank_img_s_max']:,.0f} img/s "
                      f"(slowest/fastest {r['rank_img_s_min'] / r['rank_img_s_max']:.2f}); daemon main process "
                      f"{r['main_cpu_pct']:.1f}% of a core, {r['main_cpu_ms_per_batch']:.3f} ms CPU per published "
                      f"batch ({r['published']} published)", flush=True)
            results["ranks"] = rows
        elif len(args.root or []) > 1:
            from prefetchd.tools.bench.roots import compare_roots

            results["roots"] = compare_roots(
                args.root, lambda r: daemon_run(r, workers, batch, args.epochs, aug, work, parent), workers, args.repeats)
        elif args.executor == "ray":
            results["ray"] = ray_vs_local(root, workers, batch, args, aug, work)
        elif args.sweep_workers:
            rows = []
            for w in range(1, _cores() + 2):
                vals = [daemon_run(root, w, batch, args.epochs, aug, work, _buffer_parent(args))["img_s"] for _ in range(args.repeats)]
                lims = [decode_limit(paths, w) for _ in range(args.repeats)]
                lim = [x for x, _ in lims]
                say_skipped(lims[0][1])
                rows.append({"workers": w, "daemon": vals, "limit": lim})
                sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
                print(f"workers {w}: daemon {statistics.mean(vals):7.0f} ± {sd:5.0f} img/s, decode-only limit "
                      f"{statistics.mean(lim):7.0f} img/s, ratio {statistics.mean(vals) / statistics.mean(lim):.2f}")
            results["sweep"] = rows
            if args.plot:
                _plot(rows, args.plot)
        else:
            for rep in range(args.repeats):
                lim, skipped = decode_limit(paths, workers)
                if rep == 0:
                    say_skipped(skipped)
                d = daemon_run(root, workers, batch, args.epochs, aug, work, _buffer_parent(args))
                row = {"limit_img_s": lim, "limit_skipped": len(skipped), **d}
                line = (f"[{rep + 1}/{args.repeats}] decode-only limit ({workers} procs) {lim:,.0f} img/s | daemon "
                        f"({workers} workers) {d['img_s']:,.0f} img/s = {d['img_s'] / lim:.2f} x the decode-only limit "
                        f"of {lim:,.0f} img/s (Pillow decoding alone, no augmentation) | trainer waited "
                        f"{d['wait_s']:.2f} s, first batch {d['first_batch_s']:.2f} s")
                if args.peer:
                    peer = peer_dataloader(paths, workers, batch, args.jitter, args.mode or "scale")
                    row["peer_img_s"] = peer
                    line += f" | DataLoader peer {peer:,.0f} img/s, daemon/peer {d['img_s'] / peer:.2f}"
                print(line, flush=True)
                results.setdefault("runs", []).append(row)
            r = client_read_vs_memcpy(_buffer_parent(args))
            results["client_read"] = r
            print(f"client read of a {r['bytes'] / 2**20:.1f} MiB batch: {r['read_gb_s']:.2f} GB/s "
                  f"({r['read_gb_s'] / r['memcpy_gb_s']:.2f} x memcpy {r['memcpy_gb_s']:.2f} GB/s); with checksum "
                  f"{r['read_verify_gb_s']:.2f} GB/s ({r['read_verify_gb_s'] / r['memcpy_gb_s']:.2f} x)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    w = [r["workers"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("daemon", "prefetchd"), ("limit", "decode-only limit")):
        m = [statistics.mean(r[key]) for r in rows]
        s = [statistics.stdev(r[key]) if len(r[key]) > 1 else 0 for r in rows]
        ax.errorbar(w, m, yerr=s, capsize=4, marker="o", label=label)
    ax.set_xlabel("worker processes")
    ax.set_ylabel("images/s")
    ax.set_xticks(w)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")

