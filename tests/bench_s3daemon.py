"""The daemon's throughput from a local ImageFolder and from the same folder in a bucket (SeaweedFS
on loopback, through the test proxy adding ``--latency-ms`` to every request), one after the
other in one run, and whether the batches are equal.

    .venv/bin/python tests/bench_s3daemon.py --classes 8 --per-class 60 --latency-ms 20

Images per second over both epochs, from the client's first request to its last batch (the
daemon's start and the listing not counted), and the CPU seconds each process spent over the same
span (psutil): the daemon with its workers (CPU per image: the target compares this), SeaweedFS,
and this process's threads (the client's, the main thread; the test proxy's, every other one).
Not a test: figures go to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import psutil
import yaml

sys.path.insert(0, os.path.dirname(__file__))
from prefetchd_client import PrefetchClient  # noqa: E402
from s3fixture import BUCKET, S3Server  # noqa: E402
from s3proxy import FaultProxy  # noqa: E402

from prefetchd.tools.samples import make_image_folder  # noqa: E402

SMALL = {"output_size": 112, "scale_min": 128, "scale_max": 160}  # the generated images' recipe


def _config(d: str, root: str, batch: int, tasks: int = 2, augment: dict | None = None, **dataset) -> str:
    cfg = {"dataset": {"root": root, "cache_dir": os.path.join(d, "cache"), **dataset},
           "loader": {"batch_size": batch, "seed": 7, "epochs": 2},
           "workers": {"count": 2, "max_tasks_in_flight": tasks},
           "buffer": {"dir": os.path.join(d, "buffer"), "capacity": 8, "refill_at": 6, "max_bytes": "256MiB",
                      "min_free_bytes": "1MiB"},
           "augment": SMALL if augment is None else augment}
    path = os.path.join(d, "cfg.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def _cpu(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` and their descendants (the daemon's workers, its forkserver)."""
    total, seen = 0.0, set()
    for pid in pids:
        try:
            procs = [psutil.Process(pid)]
            procs += procs[0].children(recursive=True)
        except psutil.NoSuchProcess:
            continue
        for p in procs:
            if p.pid in seen:
                continue
            seen.add(p.pid)
            try:
                t = p.cpu_times()
                total += t.user + t.system + t.children_user + t.children_system
            except psutil.NoSuchProcess:
                pass
    return total


def _threads() -> tuple[float, float]:
    """(main thread's, every other thread's) CPU seconds of this process: the client's, the proxy's
    (its handler threads end with their connections: the process's total less the main thread's)."""
    me = psutil.Process()
    main = threading.main_thread().native_id
    mine = sum(t.user_time + t.system_time for t in me.threads() if t.id == main)
    total = me.cpu_times()
    return mine, total.user + total.system - mine


def _snapshot(daemon: int, weed: int) -> tuple[float, float, float, float]:
    return (_cpu([daemon]), _cpu([weed]) if weed else 0.0, *_threads())


def _run(cfg: str, env: dict, weed: int = 0) -> tuple[float, int, list, tuple]:
    log = open(cfg + ".log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "prefetchd", "run", "--config", cfg], stdout=log,
                            stderr=subprocess.STDOUT, env={**os.environ, **env}, start_new_session=True)
    try:
        batches, n = [], 0
        with PrefetchClient(cfg, timeout=120, as_numpy=True) as c:
            it = c.iter_epoch(0)
            x, y = next(it)  # the first batch: start-up and listing are behind us
            cpu0 = _snapshot(proc.pid, weed)
            t0 = time.perf_counter()
            for e in (0, 1):
                for x, y in (it if e == 0 else c.iter_epoch(1)):
                    batches.append((x.copy(), y.copy()))
                    n += len(y)
                if e == 0:
                    first = (time.perf_counter() - t0, n)
            took = time.perf_counter() - t0
            cpu = tuple(b - a for a, b in zip(cpu0, _snapshot(proc.pid, weed), strict=True))
        return took, n, batches, cpu + first
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def _say(name: str, n: int, t: float, cpu: tuple, local_rate: float, local_cpu: float, requests: int,
         same: bool) -> None:
    daemon, weed, client, proxy, t1, n1 = cpu
    print(f"{name}: {n / t:7.1f} img/s ({n} images, {t:.2f} s), {n / t / local_rate:.2f}x "
          f"(epoch 1 alone {n1 / t1:.1f} img/s); "
          f"CPU ms/image: daemon+workers {1000 * daemon / n:.2f} ({daemon / n / local_cpu:.2f}x), SeaweedFS "
          f"{1000 * weed / n:.2f}, proxy {1000 * proxy / n:.2f}, client {1000 * client / n:.2f}; "
          f"{requests} requests; batches equal: {same}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--classes", type=int, default=8)
    ap.add_argument("--per-class", type=int, default=60)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--tasks", type=int, default=2, help="workers.max_tasks_in_flight: how far a worker reads ahead")
    ap.add_argument("--cache", action="store_true", help="with dataset.cache: a second bucket run over the warm cache")
    ap.add_argument("--root", help="an ImageFolder of your own (../shared/bench/make_corpus.py's, say), read with the "
                                   "daemon's default recipe (shorter side 256..480, crop 224), not generated images")
    a = ap.parse_args()
    augment = {} if a.root else None
    with tempfile.TemporaryDirectory() as tmp:
        root = a.root or os.path.join(tmp, "images")
        if not a.root:
            make_image_folder(root, classes=a.classes, per_class=a.per_class, seed=3, long_side=256)
        server = S3Server(os.path.join(tmp, "s3"))
        os.makedirs(server.workdir)
        server.start()
        proxy = FaultProxy(server.port, latency_s=a.latency_ms / 1000)
        try:
            server.upload_tree(root, "bench")
            os.makedirs(os.path.join(tmp, "local"))
            os.makedirs(os.path.join(tmp, "bucket"))
            print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
            t_local, n_local, ref, cpu = _run(_config(os.path.join(tmp, "local"), root, a.batch, a.tasks, augment), {})
            local_rate, local_cpu = n_local / t_local, cpu[0] / n_local
            _say("local disk", n_local, t_local, cpu, local_rate, local_cpu, 0, True)
            env = {**server.env(), "AWS_ENDPOINT_URL": proxy.endpoint}
            weed = server.proc.pid
            runs = [("bucket, no cache", os.path.join(tmp, "bucket"), {})]
            if a.cache:  # dataset.cache: the first run fills it, a second daemon reads it (the bucket run above had none)
                cache = {"cache": {"dir": os.path.join(tmp, "bytes"), "max_bytes": "4GiB"}}
                runs += [("cache cold", os.path.join(tmp, "cached"), cache), ("cache warm", os.path.join(tmp, "cached"), cache)]
            for name, d, extra in runs:
                os.makedirs(d, exist_ok=True)
                before = proxy.requests
                t, n, got, cpu = _run(_config(d, f"s3://{BUCKET}/bench", a.batch, a.tasks, augment, **extra), env,
                                    weed)
                same = len(ref) == len(got) and all(np.array_equal(p[0], q[0]) and np.array_equal(p[1], q[1])
                                                    for p, q in zip(ref, got, strict=True))
                _say(f"{name} ({a.latency_ms:g} ms a request)", n, t, cpu, local_rate, local_cpu,
                     proxy.requests - before, same)
            print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        finally:
            proxy.stop()
            server.stop()


if __name__ == "__main__":
    main()
