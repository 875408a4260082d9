"""CPU per GET of obstore's client in one process, against SeaweedFS on loopback (no proxy): a pool of
N threads each making blocking GETs (what ``sources.readahead`` runs, N = ``IN_FLIGHT``), asyncio with
``get_async`` and N in flight, and one GET at a time; rounds alternate the ways.

    .venv/bin/python tests/bench_s3gets.py --root /tmp/shards_corpus --objects 1200 --rounds 3

CPU is this process's (``getrusage``: obstore's runtime threads included), per GET. Not a test:
figures go to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(__file__))
from s3fixture import BUCKET, S3Server  # noqa: E402


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(argv=None) -> int:
    import obstore
    from obstore.store import S3Store

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", required=True, help="a folder of images to upload")
    ap.add_argument("--objects", type=int, default=1200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--in-flight", type=int, nargs="+", default=[32, 8], help="the pools' sizes, and asyncio's (the first)")
    args = ap.parse_args(argv)
    data = tempfile.mkdtemp(prefix="prefetchd-s3gets-")
    srv = S3Server(data)
    srv.start()
    try:
        srv.upload_tree(args.root, "gets")
        env = srv.env()
        store = S3Store(BUCKET, config={"access_key_id": env["AWS_ACCESS_KEY_ID"], "region": "us-east-1",
                                        "secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
                                        "endpoint": env["AWS_ENDPOINT_URL"]}, client_options={"allow_http": True})
        listed = [(m["path"], int(m["size"])) for page in obstore.list(store, prefix="gets", chunk_size=1000)
                  for m in page][:args.objects]
        keys = [k for k, _ in listed]

        def get(k):
            return len(bytes(obstore.get(store, k).bytes()))

        def pool(n):
            def run():
                with ThreadPoolExecutor(n) as ex:
                    return sum(ex.map(get, keys))
            return run

        def aio():
            async def main():
                sem = asyncio.Semaphore(args.in_flight[0])

                async def one(k):
                    async with sem:
                        return len(bytes(await (await obstore.get_async(store, k)).bytes_async()))
                return sum(await asyncio.gather(*(one(k) for k in keys)))
            return asyncio.run(main())

        ways = [(f"pool of {n}", pool(n)) for n in args.in_flight]
        ways += [(f"asyncio, {args.in_flight[0]} in flight", aio), ("one at a time", lambda: sum(map(get, keys)))]
        print(f"{len(keys)} objects, {sum(n for _, n in listed) / max(1, len(listed)) / 1000:.1f} KB each on average")
        for r in range(args.rounds):
            for name, run in ways:
                c, t = _cpu(), time.perf_counter()
                run()
                print(f"round {r + 1}, {name}: {(_cpu() - c) / len(keys) * 1e3:.3f} ms of CPU a GET, "
                      f"{len(keys) / (time.perf_counter() - t):,.0f} GETs/s", flush=True)
    finally:
        srv.stop()
        shutil.rmtree(data, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
