"""WebDataset shards in a bucket against a real S3 server (SeaweedFS on loopback, tests/s3fixture.py),
no mock: the index is the local shards' (by tarfile-written shards, a folder prefix or a brace
pattern), built with one GET per chunk of a shard, never one per member (counted at a proxy);
an object overwritten in the bucket is never read at its indexed offsets, and a start indexes it
anew; bad roots are one line naming the key; the real daemon makes the local shards' batches
byte for byte."""

from __future__ import annotations

import errno
import io
import math
import os
import tarfile

import numpy as np
import pytest
from bucketrun import same_batches_from_the_bucket_and_no_secret
from conftest import small_config, wait_until
from s3fixture import BUCKET, SECRET_KEY
from s3proxy import FaultProxy
from test_daemon import collect, published
from test_shards import _add, _samples, write_shards

pytest.importorskip("obstore", reason="the s3 extra (obstore) is not installed")

from prefetchd.sources import bucketshards, objectstore, readahead  # noqa: E402
from prefetchd.sources.base import DatasetError, StorageChanged  # noqa: E402
from prefetchd.sources.dataset import load_index  # noqa: E402

EXTS = (".jpeg", ".jpg", ".png")  # dataset.extensions' default: shards then take .jpg .jpeg .png .webp
N = 36  # samples: 3 shards of 12


@pytest.fixture(scope="session")
def local_shards(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wds")
    samples = _samples(N, seed=11, classes=4)
    return str(folder), write_shards(folder, samples, per_shard=12), samples


@pytest.fixture(scope="session")
def bucket_shards(s3, local_shards) -> str:
    """The local shards uploaded under ``s3://BUCKET/wds``."""
    assert s3.upload_tree(local_shards[0], "wds") == 3
    return f"s3://{BUCKET}/wds"


@pytest.fixture
def proxy(s3):
    p = FaultProxy(s3.port)
    yield p
    p.stop()


def _via(proxy, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    objectstore._STORES.clear()


def _same(index, local) -> None:
    assert index.classes == local.classes and index.fingerprint == local.fingerprint
    assert [index.relpath(i) for i in range(len(index))] == [local.relpath(i) for i in range(len(local))]
    assert [local.read(i) for i in range(len(local))] == [index.read(i) for i in range(len(index))]


def test_the_bucket_shards_index_is_the_local_one_read_in_chunks_not_member_by_member(
        s3_env, bucket_shards, local_shards, proxy, monkeypatch, tmp_path):
    local, _ = load_index(local_shards[0], None, EXTS, str(tmp_path / "local-cache"))
    _via(proxy, monkeypatch)
    index, cached = load_index(bucket_shards, None, EXTS, str(tmp_path / "cache"))
    assert not cached and index.layout == "webdataset" and index.root == bucket_shards
    scan_requests = proxy.requests
    # the top level listed (auto: 1, the shards: 1), the first shard's head probed (1), each shard one GET:
    # 72 members a shard would be 216 GETs read one by one
    assert scan_requests <= 2 + 1 + 3, scan_requests
    before = proxy.requests
    _same(index, local)
    assert proxy.requests - before == len(index)  # a sample: one ranged GET, no HEAD
    again, cached = load_index(bucket_shards, None, EXTS, str(tmp_path / "cache"))
    assert cached and again.fingerprint == index.fingerprint
    pattern, cached = load_index(bucket_shards + "/train-{000000..000002}.tar", None, EXTS, str(tmp_path / "cache"))
    assert not cached and pattern.root == bucket_shards
    _same(pattern, local)
    for dirpath, _, files in os.walk(tmp_path / "cache"):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                assert SECRET_KEY.encode() not in f.read()
    assert not os.listdir(tmp_path / "cache" / "tmp")  # the shards' temporary files are gone


def test_a_shard_larger_than_a_chunk_costs_a_get_a_chunk_at_most(s3_env, bucket_shards, local_shards, proxy,
                                                                   monkeypatch, tmp_path):
    local, _ = load_index(local_shards[0], None, EXTS, str(tmp_path / "local-cache"))
    monkeypatch.setattr(bucketshards, "CHUNK", 16 << 10)
    _via(proxy, monkeypatch)
    index, _ = load_index(bucket_shards, None, EXTS, str(tmp_path / "cache"), layout="webdataset")
    chunks = sum(math.ceil(os.path.getsize(p) / (16 << 10)) for p in local_shards[1])
    assert 3 < chunks < 3 * 72 // 4
    assert proxy.requests <= 1 + chunks, (proxy.requests, chunks)
    assert index.fingerprint == local.fingerprint


def _reversed_shard(samples) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as t:
        for key, jpg, lab in samples[::-1]:
            _add(t, key + ".jpg", jpg)
            _add(t, key + ".cls", str(lab).encode())
    return buf.getvalue()


def test_an_overwritten_shard_is_never_read_at_its_old_offsets_and_a_start_indexes_it_anew(
        bucket, local_shards, tmp_path, caplog):
    """gs://: fake-gcs-server ignores If-Match; the answer's ETag, checked too, tells."""
    server, scheme = bucket
    _, paths, samples = local_shards
    for p in paths:
        with open(p, "rb") as f:
            server.put(f"over/{os.path.basename(p)}", f.read())
    root = f"{scheme}://{BUCKET}/over"
    index, _ = load_index(root, None, EXTS, str(tmp_path / "cache"))
    last = len(index) - 1
    assert index.read(last) == samples[-1][1]
    with open(paths[2], "rb") as f:
        size = len(f.read())
    new = _reversed_shard(samples[24:])
    assert len(new) == size  # the same size: only the ETag tells
    server.put("over/train-000002.tar", new)
    objectstore._STORES.clear()
    with pytest.raises(StorageChanged, match="changed since it was indexed"):
        index.read(last)
    assert index.read(0) == samples[0][1]  # the other shards read on
    with caplog.at_level("WARNING", logger="prefetchd.dataset"):
        again, cached = load_index(root, None, EXTS, str(tmp_path / "cache"))
    assert not cached and "changed since they were indexed (1 overwritten, e.g. train-000002.tar)" in caplog.text
    assert again.read(last) == samples[24][1] and again.relpath(last) == "train-000002.tar/" + samples[24][0] + ".jpg"
    assert int(again.labels[last]) == samples[24][2]


def _error(root, tmp_path, **kw) -> str:
    with pytest.raises(DatasetError) as e:
        load_index(root, None, EXTS, str(tmp_path / "cache"), **kw)
    said = str(e.value)
    assert "\n" not in said and "dataset.root" in said, said
    return said


def test_bad_bucket_roots_are_one_line_each_naming_the_key(s3, s3_env, bucket_shards, local_shards, image_root,
                                                           tmp_path):
    assert "lists no objects" in _error(f"s3://{BUCKET}/no-such-prefix", tmp_path)
    assert "lists no objects" in _error(f"s3://{BUCKET}/no-such-prefix", tmp_path, layout="webdataset")
    said = _error(bucket_shards + "/train-{000000..000004}.tar", tmp_path)
    assert "2 of the 5 shards the pattern names are missing" in said and "train-000003.tar" in said, said
    assert "no such object" in _error(bucket_shards + "/train-000009.tar", tmp_path)
    s3.upload_tree(image_root, "imgs")
    said = _error(f"s3://{BUCKET}/imgs", tmp_path, layout="webdataset")
    assert "holds no .tar shards at its top level" in said and "n00000000/" in said, said
    s3.put("gz/train-000000.tar.gz", b"\x1f\x8b" + bytes(100))
    assert "compressed shards" in _error(f"s3://{BUCKET}/gz", tmp_path)
    with open(local_shards[1][0], "rb") as f:
        s3.put("mixed/train-000000.tar", f.read())
    s3.put("mixed/cats/a.jpg", b"x")
    assert "WebDataset shards (train-000000.tar ...) and folders (cats)" in _error(f"s3://{BUCKET}/mixed", tmp_path)
    buf = io.BytesIO()  # ImageNet's train tar holds class tars: no shards
    with tarfile.open(fileobj=buf, mode="w") as t:
        for k in range(3):
            _add(t, f"n0144{k}.tar", bytes(1024))
    s3.put("classtars/ILSVRC2012_img_train.tar", buf.getvalue())
    # ImageNet's tars now (tests/test_bucket_imagenet.py): its download folder, one line
    assert "looks like ImageNet's download folder" in _error(f"s3://{BUCKET}/classtars", tmp_path)
    s3.upload_tree(image_root, "imgs2")
    s3.put("imgs2/backup.tar", buf.getvalue())  # an ImageFolder with a stray tar at its top
    said = _error(f"s3://{BUCKET}/imgs2", tmp_path)
    assert "holds class tars (backup.tar ...) and folders (n00000000, n00000001, n00000002 ...)" in said, said
    assert len(load_index(f"s3://{BUCKET}/imgs2", None, EXTS, str(tmp_path / "cache"), layout="imagefolder")[0]) == 48
    s3.put("empty/train-000000.tar", bytes(1024))
    assert "hold no samples" in _error(f"s3://{BUCKET}/empty", tmp_path, layout="webdataset")


def test_the_daemon_on_bucket_shards_makes_the_local_shards_batches_and_writes_no_secret(
        s3, bucket_shards, local_shards, tmp_path, daemon_factory):
    same_batches_from_the_bucket_and_no_secret(tmp_path, local_shards[0], bucket_shards, s3.env(), daemon_factory,
                                               "bucket-tarmeta.json", SECRET_KEY.encode())


def test_a_shard_overwritten_while_the_daemon_runs_waits_and_a_restart_reads_it_anew(
        bucket, local_shards, tmp_path, daemon_factory):
    server, scheme = bucket
    _, paths, samples = local_shards
    for p in paths:
        with open(p, "rb") as f:
            server.put(f"live/{os.path.basename(p)}", f.read())
    root = f"{scheme}://{BUCKET}/live"
    (tmp_path / "l").mkdir()
    local_cfg = small_config(tmp_path / "l", local_shards[0], loader={"epochs": 1, "shuffle": False})
    d = daemon_factory(local_cfg)
    ref = collect(local_cfg, epochs=(0,))
    assert d.stop() == 0
    (tmp_path / "b").mkdir()
    cfg = small_config(tmp_path / "b", root, loader={"epochs": 1, "shuffle": False})  # batches 4-5: shard 2
    d = daemon_factory(cfg, env=server.env())
    from prefetchd_client import PrefetchClient

    wait_until(lambda: len(published(str(tmp_path / "b" / "buffer"))) >= 4, 60, "4 batches in the buffer")
    server.put("live/train-000002.tar", _reversed_shard(samples[24:]))
    with PrefetchClient(cfg, timeout=60, as_numpy=True) as loader:
        for b, (x, _) in enumerate(loader.iter_epoch(0)):
            assert np.array_equal(np.ascontiguousarray(x.transpose(0, 2, 3, 1)), ref[(0, 0, b)][0])
            if b == 3:
                break
        wait_until(lambda: "changed since it was indexed" in d.log(), 60, "the daemon to say the shard changed")
        wait_until(lambda: not published(str(tmp_path / "b" / "buffer")), 30, "an empty buffer (batch 4 not made)")
    assert d.stop() == 0
    d = daemon_factory(cfg, env=server.env())
    got = collect(cfg, epochs=(0,))
    assert d.stop() == 0
    assert "indexing them again" in d.log()
    assert np.array_equal(got[(0, 0, 0)][0], ref[(0, 0, 0)][0])
    assert not np.array_equal(got[(0, 0, 4)][0], ref[(0, 0, 4)][0])  # shard 2's samples in their new order


def test_check_on_a_shards_pattern_lists_its_folder_and_reads_the_first_shards_head_only(
        s3, bucket_shards, local_shards, tmp_path):
    import subprocess
    import sys

    s3.put("big/train-000000.tar", bytes(3 << 20))  # a shard larger than what check reads of it
    for root, first in ((bucket_shards + "/train-{000000..000002}.tar", "train-000000.tar"),
                        (bucket_shards + "/train-000001.tar", "train-000000.tar"),
                        (f"s3://{BUCKET}/big", "train-000000.tar")):
        cfg = small_config(tmp_path, root)
        r = subprocess.run([sys.executable, "-m", "prefetchd", "check", "--config", cfg], capture_output=True,
                           text=True, timeout=120, env={**os.environ, **s3.env()})
        lines = r.stdout.splitlines()
        assert lines[1].startswith("list: ok (") and first in lines[1], r.stdout + r.stderr
        assert lines[2].startswith("read: ok (") and int(lines[2].split()[2].strip("(").replace(",", "")) <= 1 << 20, lines[2]
        if "big" not in root:
            assert r.returncode == 0 and "WebDataset shards in a bucket" in r.stdout, r.stdout + r.stderr
        else:  # a tar of zeros holds no samples: one line naming the key
            assert r.returncode != 0 and "dataset.root" in r.stdout + r.stderr, r.stdout + r.stderr


def test_a_reload_sees_a_shard_overwritten_since_the_index(s3, s3_env, local_shards, tmp_path):
    from prefetchd.sources.dataset import unchanged_since_scan

    _, paths, samples = local_shards
    for p in paths:
        with open(p, "rb") as f:
            s3.put(f"reload/{os.path.basename(p)}", f.read())
    index, _ = load_index(f"s3://{BUCKET}/reload", None, EXTS, str(tmp_path / "cache"))
    assert unchanged_since_scan(index.files_dir, index.fingerprint)  # one HEAD a shard, all as indexed
    s3.put("reload/train-000000.tar", _reversed_shard(samples[:12]))
    assert not unchanged_since_scan(index.files_dir, index.fingerprint)


def test_a_reload_sees_a_shard_or_parquet_file_uploaded_since_the_index_as_a_local_folder_does(
        s3, s3_env, local_shards, tmp_path):
    """A reload (SIGHUP) checked the indexed objects alone (one HEAD each): a shard uploaded since
    (`aws s3 sync` of the next ones) was never indexed until a restart, where a local folder's
    mtime shows it."""
    import shutil

    import pyarrow.parquet as pq
    from test_parquet import _rows, hf_table

    from prefetchd.sources.dataset import unchanged_since_scan

    _, paths, _ = local_shards
    local = tmp_path / "local"
    local.mkdir()
    pq.write_table(hf_table(_rows(6, seed=2)), tmp_path / "one.parquet", row_group_size=3)
    for p in paths[:2]:
        s3.put(f"grow/{os.path.basename(p)}", open(p, "rb").read())
        shutil.copy(p, local)
    s3.put("growpq/train-00000-of-00002.parquet", (tmp_path / "one.parquet").read_bytes())
    roots = (f"s3://{BUCKET}/grow", str(local), f"s3://{BUCKET}/growpq/")
    indexes = [load_index(r, None, EXTS, str(tmp_path / "cache"))[0] for r in roots]
    assert [len(i) for i in indexes] == [24, 24, 6]
    assert all(unchanged_since_scan(i.files_dir, i.fingerprint) for i in indexes)
    s3.put(f"grow/{os.path.basename(paths[2])}", open(paths[2], "rb").read())
    shutil.copy(paths[2], local)
    s3.put("growpq/train-00001-of-00002.parquet", (tmp_path / "one.parquet").read_bytes())
    assert not any(unchanged_since_scan(i.files_dir, i.fingerprint) for i in indexes)
    assert [len(load_index(r, None, EXTS, str(tmp_path / "cache"))[0]) for r in roots] == [36, 36, 12]


def test_the_daemon_on_bucket_shards_through_503s_resets_and_an_outage_makes_the_same_batches(
        s3, bucket_shards, local_shards, tmp_path, daemon_factory):
    (tmp_path / "l").mkdir()
    local_cfg = small_config(tmp_path / "l", local_shards[0])
    d = daemon_factory(local_cfg)
    ref = collect(local_cfg)
    assert d.stop() == 0
    (tmp_path / "b").mkdir()
    cfg = small_config(tmp_path / "b", bucket_shards)
    proxy = FaultProxy(s3.port)
    try:
        proxy.faults(n503=10, resets=6, after_requests=8)  # after the listings and the scan's first GETs
        proxy.outage(2.0, after_requests=40)  # then the endpoint gone for 2 s, during the first epoch
        d = daemon_factory(cfg, env={**s3.env(), "AWS_ENDPOINT_URL": proxy.endpoint})
        got = collect(cfg)
        assert d.stop() == 0
    finally:
        proxy.stop()
    assert proxy.faulted > 16
    for k in ref:
        assert np.array_equal(got[k][0], ref[k][0]) and np.array_equal(got[k][1], ref[k][1]), k
    log = d.log()
    assert "retrying with back-off" in log and log.count("answers again after") == log.count("retrying with back-off")
    assert "quarantin" not in log.lower() and "changed since it was indexed" not in log, log


def test_a_bad_first_shard_is_said_without_reading_the_others(s3, s3_env, local_shards, monkeypatch, tmp_path):
    with open(local_shards[1][0], "rb") as f:
        good = f.read()
    s3.put("many/train-000000.tar", b"")  # empty: an interrupted upload
    for k in range(1, 64):
        s3.put(f"many/train-{k:06d}.tar", good)
    proxy = FaultProxy(s3.port, latency_s=0.05)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        objectstore._STORES.clear()
        with pytest.raises(DatasetError, match="train-000000.tar is empty"):
            load_index(f"s3://{BUCKET}/many", None, EXTS, str(tmp_path / "cache"), layout="webdataset")
        assert proxy.requests <= 1 + 2 * bucketshards.SCANS_IN_FLIGHT, proxy.requests  # not 1 + 63
    finally:
        proxy.stop()


@pytest.fixture(scope="session")
def forty_shards(s3, tmp_path_factory) -> str:
    """40 one-sample shards under ``s3://BUCKET/forty``."""
    folder = tmp_path_factory.mktemp("forty")
    write_shards(folder, _samples(40, seed=21), per_shard=1)
    assert s3.upload_tree(str(folder), "forty") == 40
    return f"s3://{BUCKET}/forty"


def test_a_scan_left_early_starts_no_more_than_its_window():
    """The index's consumer stops (an error of its own, past the shards' scans): the shards queued
    after the window are never started (all were queued at once, and the pool's exit ran them all)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    started, gate = [], threading.Event()

    def one(x):
        started.append(x)
        gate.wait(10)
        return x

    pool = ThreadPoolExecutor(2)
    results = bucketshards._in_order(pool, one, list(range(100)), 4)
    gate.set()
    assert next(results) == 0
    results.close()  # the consumer gone
    pool.shutdown(wait=True)
    assert len(started) <= 5, started  # the window, and the one submitted as the first was taken


def test_a_process_leaving_a_bucket_scan_midway_fetches_no_more_shards(s3, forty_shards, proxy, tmp_path):
    """The daemon indexes on a thread it does not wait for: a stop during the scan ends the process,
    whose exit must not first fetch every shard still queued (concurrent.futures joins its threads)."""
    import subprocess
    import sys

    proxy.latency_s = 0.3
    code = ("import sys, threading; from prefetchd.sources import bucketshards, objectstore\n"
            f"root = {forty_shards!r}\n"
            "threading.Thread(target=bucketshards.scan, args=(root, ('.jpg',), 'cls', 'dataset.root', "
            f"objectstore.store_for(root), {str(tmp_path / 'tmp')!r}), daemon=True).start()\n"
            "sys.stdin.read()\n")  # the stop: when the test closes its input
    env = {**os.environ, **s3.env(), "AWS_ENDPOINT_URL": proxy.endpoint}
    p = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: proxy.requests >= 8, 60, "the scan fetching shards")  # the listing, then shards
        p.stdin.close()
        at_stop = proxy.requests
        assert p.wait(60) == 0, p.stderr.read()[-2000:]
    finally:
        p.kill()
    # those in flight at the stop end; no shard queued behind them is fetched (all 40 were)
    assert proxy.requests <= at_stop + bucketshards.SCANS_IN_FLIGHT < 40, (at_stop, proxy.requests)


def test_a_shard_overwritten_after_its_members_were_read_ahead_gives_their_indexed_bytes_or_refuses(
        s3, s3_env, local_shards, tmp_path):
    """Members fetched ahead before the overwrite are the indexed members' bytes; one fetched after
    it is refused (If-Match), never the new shard's bytes at the old offsets."""
    _, paths, samples = local_shards
    for p in paths:
        with open(p, "rb") as f:
            s3.put(f"readahead/{os.path.basename(p)}", f.read())
    root = f"s3://{BUCKET}/readahead"
    index, _ = load_index(root, None, EXTS, str(tmp_path / "cache"))
    index.prefetch([0, 1], [[24, 25]])  # 24 and 25 are in train-000002.tar: fetched ahead
    assert [index.read(0), index.read(1)] == [samples[0][1], samples[1][1]]
    wait_until(lambda: readahead.pending(root, done=True) == 2, what="the next batch's members fetched")
    with open(paths[2], "rb") as f:
        size = len(f.read())
    new = _reversed_shard(samples[24:])
    assert len(new) == size  # the same size: only the ETag tells
    s3.put("readahead/train-000002.tar", new)
    index.prefetch([24, 25, 26], [])
    assert [index.read(24), index.read(25)] == [samples[24][1], samples[25][1]]
    with pytest.raises(StorageChanged, match="changed since it was indexed"):
        index.read(26)


def test_a_brace_pattern_or_an_imagefolder_listed_through_503s_and_an_outage_at_start_is_indexed(
        s3, s3_env, bucket_shards, local_shards, image_root, proxy, monkeypatch, tmp_path):
    """Their listings (every object under the prefix) were not retried past the client's two quick
    tries: a start during a SlowDown episode or a 2 s outage was a configuration error (exit 78,
    which systemd's RestartPreventExitStatus keeps down), where a prefix of shards waited."""
    assert s3.upload_tree(image_root, "listed") == 48
    pattern = f"{bucket_shards}/train-{{000000..000002}}.tar"
    _via(proxy, monkeypatch)
    for k, fault in enumerate(({"n503": 8}, {"outage": 2.0})):
        for root, local, layout in ((pattern, local_shards[0], "auto"), (f"s3://{BUCKET}/listed", image_root,
                                                                         "imagefolder")):
            objectstore._STORES.clear()
            proxy.outage(fault["outage"]) if "outage" in fault else proxy.faults(**fault)
            index, _ = load_index(root, None, EXTS, str(tmp_path / f"{k}{layout}"), layout=layout)
            _same(index, load_index(local, None, EXTS, str(tmp_path / "local"), layout=layout)[0])


def test_one_shard_refused_by_its_acl_mid_run_waits_blaming_no_sample_and_resumes_once_mended(
        s3, bucket_shards, local_shards, tmp_path, daemon_factory):
    # a sample's 403 was asked of the index's root, the shard's folder, which still lists: every sample
    # of the one shard the dataset is was blamed in turn (quarantined, replaced by others refused alike)
    one = os.path.basename(local_shards[1][1])
    (tmp_path / "l").mkdir()
    local_cfg = small_config(tmp_path / "l", local_shards[1][1], loader={"epochs": 4})
    d = daemon_factory(local_cfg)
    ref = collect(local_cfg, epochs=range(4))
    assert d.stop() == 0
    (tmp_path / "b").mkdir()
    cfg = small_config(tmp_path / "b", f"{bucket_shards}/{one}", loader={"epochs": 4})
    proxy = FaultProxy(s3.port)
    try:
        d = daemon_factory(cfg, env={**s3.env(), "AWS_ENDPOINT_URL": proxy.endpoint})
        wait_until(lambda: len(published(str(tmp_path / "b" / "buffer"))) >= 4, 60, "a full buffer")
        proxy.deny(f"/{one}")
        from prefetchd_client import PrefetchClient

        got = {}
        with PrefetchClient(cfg, timeout=60, as_numpy=True) as loader:
            for e in range(4):
                for b, (x, y) in enumerate(loader.iter_epoch(e)):
                    got[(0, e, b)] = (np.ascontiguousarray(x.transpose(0, 2, 3, 1)), y.copy())
                if e == 1:  # the batches made before the ACL changed are read; the next wait for it
                    wait_until(lambda: "cannot be read now" in d.log(), 60, "the daemon to say the root is refused")
                    proxy.deny()
        assert d.stop() == 0
    finally:
        proxy.stop()
    log = d.log()
    said = [ln for ln in log.splitlines() if "cannot be read now" in ln]
    assert len(said) == 1 and f"{bucket_shards}/{one} cannot be read now (access denied (403)" in said[0], said
    assert "quarantin" not in log.lower().replace("no sample is quarantined", ""), log
    assert "readable again" in log
    assert got.keys() == ref.keys()
    for k in ref:
        assert np.array_equal(got[k][0], ref[k][0]) and np.array_equal(got[k][1], ref[k][1]), k


def test_one_shard_deleted_mid_run_is_the_roots_absence_not_each_samples(s3, s3_env, local_shards, tmp_path):
    # a sample's 404 was the sample's own (a file gone from a folder that is still there), though the one
    # object the dataset is was gone: every sample blamed in turn, where a local root gone waits for it
    import obstore

    from prefetchd.executors.storage import SampleUnreadable, StorageUnavailable, read_sample

    for k, p in enumerate(local_shards[1]):
        with open(p, "rb") as f:
            s3.put(f"gone/train-{k:06d}.tar", f.read())
    one = f"s3://{BUCKET}/gone/train-000001.tar"
    index, _ = load_index(one, None, EXTS, str(tmp_path / "one"))
    prefix, _ = load_index(f"s3://{BUCKET}/gone", None, EXTS, str(tmp_path / "prefix"))
    obstore.delete(s3.store(), "gone/train-000001.tar")
    with pytest.raises(StorageUnavailable) as e:
        read_sample(lambda: index.read(1), index.refusal_root, sleep=lambda s: None)
    assert f"the dataset root {one} cannot be read now (not found (404))" in str(e.value), e.value
    # of several shards, the samples of the one deleted are theirs to blame, as files gone from a folder
    with pytest.raises(SampleUnreadable):
        read_sample(lambda: prefix.read(12), prefix.refusal_root, sleep=lambda s: None)
    assert read_sample(lambda: prefix.read(0), prefix.refusal_root)


def test_a_deleted_shard_of_a_bucket_named_bucket_is_said_not_found_not_no_such_bucket(s3, s3_env, local_shards,
                                                                                      tmp_path):
    # the words looked for "bucket" and "403" anywhere in obstore's line, whose request URL names the
    # bucket and whose time may read "in 1.403ms": the one shard of s3://train-bucket deleted mid-run
    # waited saying "cannot be read now (no such bucket (404))"; a 404 in 1.403 ms was "access denied (403)"
    from prefetchd.executors.storage import StorageUnavailable, read_sample

    s3.make_bucket("train-bucket")
    with open(local_shards[1][0], "rb") as f:
        s3.put("one/train-000000.tar", f.read(), "train-bucket")
    one = "s3://train-bucket/one/train-000000.tar"
    index, _ = load_index(one, None, EXTS, str(tmp_path / "one"))
    import obstore

    obstore.delete(s3.store("train-bucket"), "one/train-000000.tar")
    with pytest.raises(StorageUnavailable) as e:
        read_sample(lambda: index.read(0), index.refusal_root, sleep=lambda s: None)
    assert str(e.value).endswith(f"the dataset root {one} cannot be read now (not found (404))"), e.value
    took = OSError(errno.ENOENT, "Object at location one/x.tar not found: Error performing GET http://127.0.0.1:40312/"
                   "b/one/x.tar in 1.403ms - Server returned non-2xx status code: 404 Not Found: ", one)
    assert objectstore.words(took) == "not found (404)" and objectstore.words(took, "gs") == "not found (404)"
    listed = OSError(errno.ENOENT, "Generic S3 error: Error performing list request: Error performing GET http://127.0.0.1:"
                     "60529/pfd-nothere?list-type=2&prefix=p%2F in 1.486446ms - Server returned non-2xx status code: "
                     "404 Not Found: ", "s3://pfd-nothere/p")  # a prefix lists empty: a listing's 404 is the bucket's
    assert objectstore.words(listed) == "no such bucket (404)"
