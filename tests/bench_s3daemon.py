"""The daemon's throughput from a local ImageFolder and from the same folder in a bucket (SeaweedFS
on loopback, through the test proxy adding ``--latency-ms`` to every request), one after the
other in one run, and whether the batches are equal.

    .venv/bin/python tests/bench_s3daemon.py --classes 8 --per-class 60 --latency-ms 20

Images per second over both epochs, from the client's first request to its last batch (the
daemon's start and the listing not counted). Not a test: figures go to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import yaml

sys.path.insert(0, os.path.dirname(__file__))
from prefetchd_client import PrefetchClient  # noqa: E402
from s3fixture import BUCKET, S3Server  # noqa: E402
from s3proxy import FaultProxy  # noqa: E402

from prefetchd.tools.samples import make_image_folder  # noqa: E402


def _config(d: str, root: str, batch: int, **dataset) -> str:
    cfg = {"dataset": {"root": root, "cache_dir": os.path.join(d, "cache"), **dataset},
           "loader": {"batch_size": batch, "seed": 7, "epochs": 2}, "workers": {"count": 2},
           "buffer": {"dir": os.path.join(d, "buffer"), "capacity": 8, "refill_at": 6, "max_bytes": "256MiB",
                      "min_free_bytes": "1MiB"},
           "augment": {"output_size": 112, "scale_min": 128, "scale_max": 160}}
    path = os.path.join(d, "cfg.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def _run(cfg: str, env: dict) -> tuple[float, int, list]:
    log = open(cfg + ".log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "prefetchd", "run", "--config", cfg], stdout=log,
                            stderr=subprocess.STDOUT, env={**os.environ, **env}, start_new_session=True)
    try:
        batches, n = [], 0
        with PrefetchClient(cfg, timeout=120, as_numpy=True) as c:
            it = c.iter_epoch(0)
            x, y = next(it)  # the first batch: start-up and listing are behind us
            t0 = time.perf_counter()
            for e in (0, 1):
                for x, y in (it if e == 0 else c.iter_epoch(1)):
                    batches.append((x.copy(), y.copy()))
                    n += len(y)
            took = time.perf_counter() - t0
        return took, n, batches
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--classes", type=int, default=8)
    ap.add_argument("--per-class", type=int, default=60)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--cache", action="store_true", help="with dataset.cache: a second bucket run over the warm cache")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "images")
        make_image_folder(root, classes=a.classes, per_class=a.per_class, seed=3, long_side=256)
        server = S3Server(os.path.join(tmp, "s3"))
        os.makedirs(server.workdir)
        server.start()
        proxy = FaultProxy(server.port, latency_s=a.latency_ms / 1000)
        try:
            server.upload_tree(root, "bench")
            os.makedirs(os.path.join(tmp, "local"))
            os.makedirs(os.path.join(tmp, "bucket"))
            t_local, n_local, ref = _run(_config(os.path.join(tmp, "local"), root, a.batch), {})
            env = {**server.env(), "AWS_ENDPOINT_URL": proxy.endpoint}
            t_s3, n_s3, got = _run(_config(os.path.join(tmp, "bucket"), f"s3://{BUCKET}/bench", a.batch), env)
            same = len(ref) == len(got) and all(np.array_equal(p[0], q[0]) and np.array_equal(p[1], q[1])
                                                for p, q in zip(ref, got, strict=True))
            print(f"local disk: {n_local / t_local:7.1f} img/s ({n_local} images, {t_local:.2f} s)")
            print(f"bucket, {a.latency_ms:g} ms a request: {n_s3 / t_s3:7.1f} img/s ({n_s3} images, {t_s3:.2f} s), "
                  f"{n_s3 / t_s3 / (n_local / t_local):.2f}x; {proxy.requests} requests; batches equal: {same}")
            if a.cache:  # dataset.cache: the first run fills it, a second daemon reads it (the bucket run above had none)
                d = os.path.join(tmp, "cached")
                os.makedirs(d)
                cfg = _config(d, f"s3://{BUCKET}/bench", a.batch,
                              cache={"dir": os.path.join(tmp, "bytes"), "max_bytes": "4GiB"})
                for run in ("cold", "warm"):
                    before = proxy.requests
                    t, n, got = _run(cfg, env)
                    same = all(np.array_equal(p[0], q[0]) and np.array_equal(p[1], q[1])
                               for p, q in zip(ref, got, strict=True))
                    print(f"bucket with dataset.cache, {run}: {n / t:7.1f} img/s ({t:.2f} s), "
                          f"{n / t / (n_local / t_local):.2f}x; {proxy.requests - before} requests; batches equal: {same}")
        finally:
            proxy.stop()
            server.stop()


if __name__ == "__main__":
    main()
