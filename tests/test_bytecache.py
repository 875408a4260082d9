"""The node-local cache of a bucket's fetched bytes (``dataset.cache``, sources/bytecache.py) against
a real S3 server (SeaweedFS): a second read of a shard's samples asks the bucket nothing (counted
at a proxy); an object overwritten and indexed again is a miss, never the old bytes; the cache
stays under max_bytes, least recently used first; worker processes writing the same entries at
once leave whole entries only; a cache in buffer.dir, on tmpfs or for a local root is one line;
the real daemon's second run over a warm cache makes the same batches with no sample GET."""

from __future__ import annotations

import multiprocessing
import os

import numpy as np
import pytest
from conftest import small_config, wait_until
from s3fixture import BUCKET
from s3proxy import FaultProxy
from test_bucket_shards import _reversed_shard
from test_daemon import collect
from test_shards import _samples, write_shards

pytest.importorskip("obstore", reason="the s3 extra (obstore) is not installed")

from prefetchd.core import config as C  # noqa: E402
from prefetchd.format import status  # noqa: E402
from prefetchd.sources import bytecache, objectstore  # noqa: E402
from prefetchd.sources.base import DatasetError  # noqa: E402
from prefetchd.sources.dataset import load_index  # noqa: E402

EXTS = (".jpeg", ".jpg", ".png")


@pytest.fixture(scope="module")
def cshards(s3, tmp_path_factory):
    folder = tmp_path_factory.mktemp("cwds")
    samples = _samples(24, seed=21, classes=3)
    paths = write_shards(folder, samples, per_shard=12)
    for p in paths:
        with open(p, "rb") as f:
            s3.put(f"cached/{os.path.basename(p)}", f.read())
    return f"s3://{BUCKET}/cached", str(folder), samples


@pytest.fixture
def proxied(s3_env, s3_proxy):
    yield s3_proxy
    bytecache.configure(None)


def _entries(d) -> list[str]:
    return [os.path.join(p, n) for p, _, names in os.walk(d) for n in names]


def test_a_second_read_asks_the_bucket_nothing_and_an_overwritten_object_indexed_again_is_a_miss(
        s3, cshards, proxied, tmp_path):
    root, _, samples = cshards
    cache = {"dir": str(tmp_path / "bytes"), "max_bytes": 1 << 30}
    index, _ = load_index(root, None, EXTS, str(tmp_path / "idx"), cache=cache)
    first = [index.read(i) for i in range(len(index))]
    assert first == [s[1] for s in samples]
    assert len(_entries(tmp_path / "bytes")) == len(index)  # one a sample; not the scan's 8 MiB chunks
    before = proxied.requests
    assert [index.read(i) for i in range(len(index))] == first
    assert proxied.requests == before  # every sample from the local disk
    kept = bytecache.current()
    assert kept.stats["hits"] == len(index) and kept.hit_rate() == 0.5
    # the same members at the same offsets and sizes, other bytes in each image: only the ETag differs
    other = [(key, bytes(reversed(jpg)), lab) for key, jpg, lab in samples[12:]]
    s3.put("cached/train-000001.tar", _reversed_shard(other[::-1]))
    again, cached = load_index(root, None, EXTS, str(tmp_path / "idx"), cache=cache)
    assert not cached and [int(again.block[i]) for i in range(24)] == [int(index.block[i]) for i in range(24)]
    got = [again.read(i) for i in range(len(again))]
    assert got[12:] == [o[1] for o in other]  # the new object's bytes, not the cached old ones
    assert got[:12] == first[:12]
    s3.put("cached/train-000001.tar", _reversed_shard(samples[12:][::-1]))  # put back for the other tests


def test_the_cache_stays_under_max_bytes_dropping_the_least_recently_used(tmp_path):
    c = bytecache.ByteCache(str(tmp_path / "b"), 64 << 10)
    blobs = {k: os.urandom(4096) for k in range(40)}  # 160 KiB through a 64 KiB cache
    for k, data in blobs.items():
        c.put("s3://b/x.tar", "e1", k * 4096, data)
        assert c.get("s3://b/x.tar", "e1", 0, 4096) in (blobs[0], None)  # entry 0 used again and again
    total = sum(os.path.getsize(p) for p in _entries(tmp_path / "b"))
    assert total <= 64 << 10, total
    assert c.get("s3://b/x.tar", "e1", 0, 4096) == blobs[0]  # the most recently used kept
    assert c.get("s3://b/x.tar", "e1", 1 * 4096, 4096) is None  # an old one gone
    assert c.get("s3://b/x.tar", "e2", 39 * 4096, 4096) is None  # another ETag: a miss
    with open(c._path("s3://b/x.tar", "e1", 39 * 4096, 4096), "r+b") as f:
        f.truncate(100)  # a cut entry (a disk full mid-copy by hand): a miss, removed
    assert c.get("s3://b/x.tar", "e1", 39 * 4096, 4096) is None
    assert not os.path.exists(c._path("s3://b/x.tar", "e1", 39 * 4096, 4096))


def _writer(d: str, seed: int) -> None:
    c = bytecache.ByteCache(d, 1 << 30)
    for k in range(200):
        data = bytes([k % 251]) * (1000 + k)
        c.put("s3://b/y.tar", "e", k, data)
        got = c.get("s3://b/y.tar", "e", (k * 7 + seed) % 200, 1000 + (k * 7 + seed) % 200)
        assert got is None or got == bytes([((k * 7 + seed) % 200) % 251]) * (1000 + (k * 7 + seed) % 200)


def test_processes_writing_the_same_entries_at_once_leave_whole_entries_only(tmp_path):
    d = str(tmp_path / "b")
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(d, s)) for s in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    names = _entries(d)
    assert len(names) == 200 and not [n for n in names if ".tmp-" in n]
    c = bytecache.ByteCache(d, 1 << 30)
    assert all(c.get("s3://b/y.tar", "e", k, 1000 + k) == bytes([k % 251]) * (1000 + k) for k in range(200))


def _load(tmp_path, text: str) -> C.Config:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return C.load(str(p))


def test_a_cache_in_the_ring_on_tmpfs_or_for_a_local_root_is_one_line(tmp_path):
    buf = tmp_path / "ring"
    with pytest.raises(C.ConfigError) as e:
        _load(tmp_path, f"dataset: {{root: 's3://b/p', cache: {{dir: {buf}/bytes, max_bytes: 1GiB}}}}\n"
                        f"buffer: {{dir: {buf}}}\n")
    assert "dataset.cache.dir" in str(e.value) and "buffer.dir" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(C.ConfigError, match="dataset.root is not a bucket URL: remove dataset.cache"):
        _load(tmp_path, f"dataset: {{root: {tmp_path}, cache: {{dir: {tmp_path}/b, max_bytes: 1GiB}}}}\n")
    with pytest.raises(C.ConfigError, match=r"dataset.cache must be \{dir"):
        _load(tmp_path, "dataset: {root: 's3://b/p', cache: {dir: /x}}\n")
    cfg = _load(tmp_path, f"dataset: {{root: 's3://b/p', cache: {{dir: {tmp_path}/b, max_bytes: 2GiB}}}}\n")
    assert cfg.dataset.cache == {"dir": str(tmp_path / "b"), "max_bytes": 2 << 30}
    from prefetchd.daemon.ring import is_tmpfs

    if not os.path.isdir("/dev/shm") or not is_tmpfs("/dev/shm"):
        pytest.skip("no tmpfs at /dev/shm to try")
    refused = f"/dev/shm/pfd-test-bytes-{os.getpid()}/cache"
    with pytest.raises(DatasetError, match=f"dataset.cache.dir {refused} is on tmpfs"):
        bytecache.configure({"dir": refused, "max_bytes": 1 << 30})
    assert not os.path.exists(os.path.dirname(refused))  # refused, and nothing made in RAM


def test_the_daemons_second_run_over_a_warm_cache_makes_the_same_batches_with_no_sample_get(
        s3, cshards, tmp_path, daemon_factory):
    root, local, _ = cshards
    proxy = FaultProxy(s3.port)
    try:
        (tmp_path / "l").mkdir()
        local_cfg = small_config(tmp_path / "l", local)
        d = daemon_factory(local_cfg)
        ref = collect(local_cfg)
        assert d.stop() == 0
        (tmp_path / "b").mkdir()
        cfg = small_config(tmp_path / "b", root, dataset={"cache": {"dir": str(tmp_path / "bytes"),
                                                                     "max_bytes": "1GiB"}})
        env = {**s3.env(), "AWS_ENDPOINT_URL": proxy.endpoint}
        runs, said = [], []
        buf = str(tmp_path / "b" / "buffer")
        for _ in range(2):
            before = proxy.requests
            d = daemon_factory(cfg, env=env)
            got = collect(cfg)
            def counted():  # every sample's read counted (status.json is written each second, mid-run too)
                st = (status.read_json(buf, status.STATUS_NAME) or {}).get("storage") or {}
                return st.get("cache_hits", 0) + st.get("cache_misses", 0) >= 48

            wait_until(counted, 20, "the storage counts of the run's 48 sample reads in status.json")
            said.append(status.read_json(buf, status.STATUS_NAME)["storage"])
            assert d.stop() == 0
            runs.append(proxy.requests - before)
            for k in ref:
                assert np.array_equal(got[k][0], ref[k][0]) and np.array_equal(got[k][1], ref[k][1]), k
        assert runs[0] >= 24 and runs[1] <= 6, runs  # the second: listings and auto's probe, no sample
        # status: the workers' requests and bytes, the cache's hits (2 epochs of 24 samples, 4 batches of 6 an epoch)
        assert said[0]["requests"] >= 24 and said[0]["bytes"] > 0 and said[0]["cache_misses"] >= 24, said
        assert said[0]["cache_hits"] >= 16 and 0 < said[0]["cache_hit_rate"] < 1, said
        assert said[1]["requests"] == 0 and said[1]["cache_hits"] >= 48 and said[1]["cache_hit_rate"] == 1.0, said
    finally:
        proxy.stop()


def test_metrics_carry_the_storage_counts_of_a_bucket_root_only():
    from prefetchd.daemon.metrics import families

    st = {"requests": 7, "bytes": 900, "errors": 1, "cache_hits": 3, "cache_misses": 4, "cache_hit_bytes": 50,
          "cache_hit_rate": 3 / 7}
    got = {f.name: f.samples[0].value for f in families({"storage": st}) if f.name.startswith("prefetchd_storage")}
    assert got == {"prefetchd_storage_requests": 7, "prefetchd_storage_bytes": 900, "prefetchd_storage_errors": 1,
                   "prefetchd_storage_cache_hits": 3, "prefetchd_storage_cache_misses": 4,
                   "prefetchd_storage_cache_hit_bytes": 50}
    assert not [f for f in families({}) if f.name.startswith("prefetchd_storage")]


def test_an_imagefolder_in_a_bucket_is_cached_by_its_listed_etag(s3, proxied, image_root, tmp_path):
    s3.upload_tree(image_root, "cfolder")
    root = f"s3://{BUCKET}/cfolder"
    cache = {"dir": str(tmp_path / "bytes"), "max_bytes": 1 << 30}
    index, _ = load_index(root, None, EXTS, str(tmp_path / "idx"), cache=cache)
    first = [index.read(i) for i in range(len(index))]
    with open(os.path.join(image_root, index.relpath(0)), "rb") as f:
        assert first[0] == f.read()
    assert len(_entries(tmp_path / "bytes")) == len(index)
    before = proxied.requests
    assert [index.read(i) for i in range(len(index))] == first and proxied.requests == before
    again, cached = load_index(root, None, EXTS, str(tmp_path / "idx"), cache=cache)  # the cached index: ETags kept
    before = proxied.requests  # (auto's one listing of the top level)
    assert cached and again.read(1) == first[1] and proxied.requests == before
    s3.put(f"cfolder/{index.relpath(1)}", b"new bytes")  # overwritten after the listing
    relisted, _ = load_index(root, None, EXTS, str(tmp_path / "idx"), use_cache=False, cache=cache)
    assert relisted.read(1) == b"new bytes"  # listed anew (a reload): its new ETag is a miss
    newer = bytes(reversed(first[2]))  # the same size: only the ETag tells
    s3.put(f"cfolder/{index.relpath(2)}", newer)  # overwritten after the listing, not cached yet: read as it is
    bytecache.configure(None)
    bytecache.configure({"dir": str(tmp_path / "bytes2"), "max_bytes": 1 << 30})
    assert relisted.read(2) == newer and relisted.read(2) == newer
    assert not _entries(tmp_path / "bytes2")  # not kept under the ETag listed before the overwrite


def test_a_killed_writers_temporary_file_is_removed_when_the_cache_is_listed(tmp_path):
    c = bytecache.ByteCache(str(tmp_path / "b"), 1 << 20)
    c.put("s3://b/z.tar", "e", 0, b"x" * 100)
    left = c._path("s3://b/z.tar", "e", 100, 50) + ".tmp-99999-1"  # what a SIGKILL mid-write leaves
    fresh = c._path("s3://b/z.tar", "e", 200, 50) + ".tmp-99998-1"  # another process writing now
    for p in (left, fresh):
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(b"y" * 50)
    os.utime(left, (1, 1))
    c.evict()
    assert not os.path.exists(left) and os.path.exists(fresh)
    assert c.get("s3://b/z.tar", "e", 0, 100) == b"x" * 100


def test_the_same_object_at_another_endpoint_is_another_cache_entry(s3, cshards, s3_env, tmp_path):
    """Two endpoints answering for one bucket name are two buckets (the index caches say so too):
    an entry fetched through one is never served for the other, whose ETag strings may match."""
    root, _, samples = cshards
    url = f"{root}/train-000000.tar"
    cache = bytecache.configure({"dir": str(tmp_path / "bytes"), "max_bytes": 1 << 30})
    try:
        reads = []
        for endpoint in (s3.endpoint, s3.endpoint.replace("127.0.0.1", "localhost")):
            store = objectstore.ObjectStore("s3", BUCKET, {"endpoint": endpoint})
            reads.append(store.pread(store.head(url), 512, 0))
        assert reads[0] == reads[1] and cache.stats["misses"] == 2 and cache.stats["hits"] == 0
        store.pread(store.head(url), 512, 0)
        assert cache.stats["hits"] == 1  # (and that endpoint's own entry is served)
    finally:
        bytecache.configure(None)


_AS_ANOTHER_USER = """
import logging, os, resource, signal, sys
import psutil  # noqa: F401 - imported as root: the other user cannot read this interpreter's library
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
from prefetchd.sources import bytecache
from prefetchd.sources.base import DatasetError
if sys.argv[2] == "nobody":  # imports done: the daemon's own user is another than the folder's owner
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
if sys.argv[2] == "fsize":  # a write past this size fails as on a full disk (EFBIG), the signal ignored
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))
try:
    c = bytecache.configure({"dir": sys.argv[1], "max_bytes": 1 << 30})
except DatasetError as e:
    sys.exit(f"refused: {e}")
for k in range(3):
    c.put("s3://b/x.tar", "e", k * 5000, bytes(5000))
print("gets", [c.get("s3://b/x.tar", "e", k * 5000, 5000) for k in range(3)], c.stats["errors"])
"""


def test_a_cache_dir_the_daemons_user_cannot_write_is_one_line_and_a_full_one_is_said_once(tmp_path):
    """A folder made by root for a daemon that runs as another user: every entry failed, said at
    debug level only, and the cache stayed empty (hit rate 0) with no word at start."""
    import subprocess
    import sys
    import tempfile

    top = tempfile.mkdtemp(prefix="pfd-cache-")  # not under pytest's private tmp: the other user must reach it
    try:
        os.chmod(top, 0o755)
        cache = os.path.join(top, "bytes")
        os.mkdir(cache, 0o755)
        root = os.geteuid() == 0
        if not root:
            os.chmod(cache, 0o555)
        r = subprocess.run([sys.executable, "-c", _AS_ANOTHER_USER, cache, "nobody" if root else "-"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stdout + r.stderr
        assert r.stderr.startswith(f"refused: dataset.cache.dir {cache} is not writable by this user"), r.stderr
        os.chmod(cache, 0o755)
        r = subprocess.run([sys.executable, "-c", _AS_ANOTHER_USER, cache, "fsize"], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0 and "gets [None, None, None] 3" in r.stdout, r.stdout + r.stderr
        said = [ln for ln in r.stderr.splitlines() if "cannot write an entry" in ln]
        assert len(said) == 1 and "reads go on from the bucket" in said[0], r.stderr
    finally:
        import shutil

        shutil.rmtree(top, ignore_errors=True)


def test_max_bytes_smaller_than_one_read_is_said_once_and_nothing_is_written(tmp_path, caplog):
    """``max_bytes: 100`` (bytes, where MB was meant): each read was written, then the whole cache
    listed and the entry removed at once; hit rate 0 and nothing said."""
    c = bytecache.ByteCache(str(tmp_path / "b"), 100)
    with caplog.at_level("WARNING", logger="prefetchd.dataset"):
        for k in range(3):
            c.put("s3://b/x.tar", "e", k * 4096, os.urandom(4096))
    said = [r.getMessage() for r in caplog.records if "max_bytes" in r.getMessage()]
    assert len(said) == 1 and "smaller than what one read fetches (4096 bytes)" in said[0], said
    assert c.stats["fetched_bytes"] == 0 and not _entries(tmp_path / "b")
    c.put("s3://b/x.tar", "e", 0, b"x" * 50)  # what fits is kept
    assert c.get("s3://b/x.tar", "e", 0, 50) == b"x" * 50
