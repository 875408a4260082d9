"""Read-ahead of a bucket's objects for the batches a worker makes next (``sources/readahead.py``),
against the real S3 server (SeaweedFS) through the test proxy: counted in requests, not timed."""

from __future__ import annotations

import time

import numpy as np
import pytest
from conftest import small_config, wait_until
from s3fixture import BUCKET
from s3proxy import FaultProxy
from test_daemon import collect

pytest.importorskip("obstore")

from prefetchd.sources import objectstore, readahead  # noqa: E402
from prefetchd.sources.dataset import load_index  # noqa: E402
from prefetchd.sources.folder import scan_image_folder  # noqa: E402

EXTS = (".jpg", ".jpeg", ".png")
B0, B1, B2 = [3, 40, 17, 8], [25, 33, 1, 46], [5, 12, 30, 44]


@pytest.fixture(scope="module")
def ahead_root(s3, image_root) -> str:
    s3.upload_tree(image_root, "ahead")
    return f"s3://{BUCKET}/ahead"


@pytest.fixture
def proxy(s3):
    p = FaultProxy(s3.port)
    yield p
    p.stop()


@pytest.fixture
def through_proxy(s3, proxy, monkeypatch):
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    objectstore._STORES.clear()
    yield proxy
    objectstore._STORES.clear()


def _local(image_root, i: int) -> bytes:
    local, _ = scan_image_folder(image_root, EXTS)
    with open(local.path(i), "rb") as f:
        return f.read()


def test_the_next_batchs_objects_are_fetched_while_this_one_is_made(ahead_root, image_root, through_proxy, tmp_path):
    index, _ = load_index(ahead_root, None, EXTS, str(tmp_path / "cache"))
    proxy = through_proxy
    before = proxy.requests
    index.prefetch(B0, [B1])
    assert [index.read(i) for i in B0] == [_local(image_root, i) for i in B0]
    # the next batch's GETs were sent without its being asked for
    wait_until(lambda: proxy.requests - before == len(B0) + len(B1), what="the next batch's GETs")
    index.prefetch(B1, [B2])
    assert [index.read(i) for i in B1] == [_local(image_root, i) for i in B1]  # the same bytes, no new GET for them
    wait_until(lambda: proxy.requests - before == len(B0) + len(B1) + len(B2), what="the batch after's GETs")
    index.prefetch(B0, [])  # B2 is no longer wanted: dropped, and B0 fetched again
    assert readahead.pending(ahead_root) == len(B0)
    assert [index.read(i) for i in B0] == [_local(image_root, i) for i in B0]


def test_read_ahead_stops_at_its_byte_bound(ahead_root, through_proxy, tmp_path, monkeypatch):
    index, _ = load_index(ahead_root, None, EXTS, str(tmp_path / "cache"))
    proxy = through_proxy
    # room for the next batch's first two objects: the third and everything after waits
    monkeypatch.setattr(readahead, "MAX_AHEAD_BYTES", int(index.sizes[B1[0]]) + int(index.sizes[B1[1]]))
    before = proxy.requests
    index.prefetch(B0, [B1, B2])
    for i in B0:
        index.read(i)
    wait_until(lambda: proxy.requests - before >= len(B0) + 2, what="the GETs within the bound")
    assert readahead.pending(ahead_root) == 2
    assert proxy.requests - before == len(B0) + 2  # never the ones past the bound
    index.prefetch(B1, [])
    for i in B1:
        index.read(i)
    assert proxy.requests - before == len(B0) + len(B1)


def test_plan_is_the_batch_then_the_queued_ones_in_order_within_the_bound():
    sizes = {i: 10 for i in range(100)}
    assert readahead.plan([[1, 2], [3, 4], [5]], sizes.get, 100) == [1, 2, 3, 4, 5]
    assert readahead.plan([[1, 2], [3, 4], [5]], sizes.get, 25) == [1, 2, 3, 4]  # the current batch not counted
    assert readahead.plan([[1, 2], [2, 3]], sizes.get, 0) == [1, 2]  # 2 is already wanted, 3 does not fit
    assert readahead.plan([[7, 7, 8]], sizes.get, 0) == [7, 8]


def test_a_daemons_worker_reads_ahead_the_batches_queued_to_it(s3, ahead_root, image_root, tmp_path, daemon_factory):
    """One worker, three tasks queued to it, batches of 6: a worker that fetched only the batch it
    makes never holds more than 6 requests at the proxy at once; read ahead, it holds more. The
    batches are the local disk's."""
    proxy = FaultProxy(s3.port, latency_s=0.05)  # each request held this long: those sent together overlap
    try:
        sections = {"workers": {"count": 1, "max_tasks_in_flight": 3}, "loader": {"epochs": 1}}
        (tmp_path / "local").mkdir()
        (tmp_path / "bucket").mkdir()
        local_cfg = small_config(tmp_path / "local", image_root, **sections)
        d = daemon_factory(local_cfg)
        ref = collect(local_cfg, epochs=(0,))
        assert d.stop() == 0
        cfg = small_config(tmp_path / "bucket", ahead_root, **sections)
        d = daemon_factory(cfg, env={**s3.env(), "AWS_ENDPOINT_URL": proxy.endpoint})
        got = collect(cfg, epochs=(0,))
        assert d.stop() == 0
        assert sorted(got) == sorted(ref)
        for k in ref:
            assert np.array_equal(got[k][0], ref[k][0]) and np.array_equal(got[k][1], ref[k][1]), k
        assert proxy.max_in_flight > 6, proxy.max_in_flight
    finally:
        proxy.stop()


def test_the_proxy_adds_no_latency_of_its_own(s3, ahead_root, through_proxy):
    """``latency_s`` is all the proxy adds: with Nagle on, a response's body waited for the
    client's delayed ACK of its headers (40 ms on Linux), so every request took 40 ms more than
    asked and the benchmarks' "20 ms a request" was ~64 ms."""
    store = objectstore.store_for(ahead_root)
    first = next(iter(store.list(ahead_root)))[0]
    took = []
    for _ in range(15):
        t = time.perf_counter()
        store.read(f"{ahead_root}/{first}")
        took.append(time.perf_counter() - t)
    # the fastest, not the median: a loaded machine slows some requests, the delayed ACK delays every one
    assert min(took) < 0.03, took  # 0.04 s at least with the delayed ACK, ~0.001 s without
