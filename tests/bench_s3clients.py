"""obstore against fsspec's s3fs on a real S3 server (SeaweedFS on loopback), the measurement
behind the s3 extra's choice: CPU seconds per MB read and wall time, one request at a time and
with requests in flight, optionally through the latency proxy (``--latency-ms``).

    PYTHONPATH=/path/with/s3fs .venv/bin/python tests/bench_s3clients.py --objects 300 --kb 110

Prints one line per client and mode. Not a test (no assertion): figures go to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(__file__))
from s3fixture import ACCESS_KEY, BUCKET, SECRET_KEY, S3Server  # noqa: E402
from s3proxy import FaultProxy  # noqa: E402


def _measure(name: str, fn, total_bytes: int) -> None:
    c0, w0 = time.process_time(), time.perf_counter()
    got = fn()
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    assert got == total_bytes, (name, got, total_bytes)
    mb = total_bytes / 1e6
    print(f"{name:34s} {mb / wall:8.1f} MB/s  {cpu / mb * 1000:6.1f} ms CPU per MB  ({wall:.2f} s wall)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--objects", type=int, default=300)
    ap.add_argument("--kb", type=int, default=110)
    ap.add_argument("--in-flight", type=int, default=16)
    ap.add_argument("--latency-ms", type=float, default=0.0)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = S3Server(tmp)
        server.start()
        proxy = FaultProxy(server.port, latency_s=a.latency_ms / 1000) if a.latency_ms else None
        endpoint = proxy.endpoint if proxy else server.endpoint
        try:
            data = os.urandom(a.kb * 1024)
            keys = [f"bench/{i:06d}.jpg" for i in range(a.objects)]
            for k in keys:
                server.put(k, data)
            total = len(data) * len(keys)
            import obstore
            from obstore.store import S3Store

            store = S3Store(BUCKET, endpoint=endpoint, access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY,
                            region="us-east-1", client_options={"allow_http": True})
            one = lambda k: len(obstore.get(store, k).bytes())  # noqa: E731
            _measure("obstore, 1 in flight", lambda: sum(map(one, keys)), total)
            with ThreadPoolExecutor(a.in_flight) as pool:
                _measure(f"obstore, {a.in_flight} in flight (threads)", lambda: sum(pool.map(one, keys)), total)
            import s3fs

            fs = s3fs.S3FileSystem(key=ACCESS_KEY, secret=SECRET_KEY, endpoint_url=endpoint,
                                   client_kwargs={"region_name": "us-east-1"})
            paths = [f"{BUCKET}/{k}" for k in keys]
            _measure("s3fs, 1 in flight", lambda: sum(len(fs.cat_file(p)) for p in paths), total)
            _measure(f"s3fs, {len(paths)} in flight (cat, its loop)",
                     lambda: sum(len(v) for v in fs.cat(paths).values()), total)
        finally:
            if proxy:
                proxy.stop()
            server.stop()


if __name__ == "__main__":
    main()
