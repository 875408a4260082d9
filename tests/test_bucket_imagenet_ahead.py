"""The forward walks of ImageNet's tars in a bucket (the train tar's top level, the flat validation
tar) fetch their next chunks ahead (``bucketshards.ShardFile``'s ``ahead``), against a real S3
server (SeaweedFS) through the test proxy adding latency to each request: the same index as the
sequential walk and the local one, the GETs overlapping, the chunks fetched those the sequential
walk fetches and at most a bounded few more, and a stop during the walk ending it promptly with no
thread or request left."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
from conftest import wait_until
from imagenet_archives import make_imagenet, tar_bytes
from s3fixture import BUCKET
from s3proxy import FaultProxy

pytest.importorskip("obstore", reason="the s3 extra (obstore) is not installed")

from prefetchd.sources import bucketimagenet, bucketshards, objectstore  # noqa: E402
from prefetchd.sources.base import DatasetError, StorageChanged  # noqa: E402
from prefetchd.sources.dataset import load_index  # noqa: E402
from prefetchd.sources.tarheaders import members  # noqa: E402

EXTS = (".jpeg", ".jpg", ".png")
P = "inet-ahead"
LATENCY_S = 0.02
TOP = 32 << 10  # the train tar's top-level chunk here: its class tars are about 21 KB, so each chunk holds a header


@pytest.fixture(scope="module")
def many(s3, tmp_path_factory):
    """24 class tars of 3 JPEGs (about 10 KB each) and a flat validation tar of 40 JPEGs (about 3 KB
    each), uploaded: with 32 KiB and 4 KiB chunks, every chunk of their forward walks holds a header."""
    inet = make_imagenet(str(tmp_path_factory.mktemp("ahead")), classes=24, per_class=3, val=40, seed=11)
    for path in (inet.train_tar, inet.val_tar, inet.devkit_tgz):
        with open(path, "rb") as f:
            s3.put(f"{P}/{os.path.basename(path)}", f.read())
    return inet


@pytest.fixture
def slow(s3, monkeypatch):
    p = FaultProxy(s3.port, latency_s=LATENCY_S)
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_ENDPOINT_URL", p.endpoint)
    objectstore._STORES.clear()
    yield p
    p.stop()
    objectstore._STORES.clear()


def _gets(proxy, before: int, name: str) -> list[str]:
    """The Range headers of the GETs of ``name`` answered since ``before`` (the proxy logs a request
    after its answer is sent, and counts it in flight until then: wait for the last one's entry)."""
    wait_until(lambda: proxy.in_flight == 0, 10, "the proxy's last request logged")
    return [r for m, path, r, _ in proxy.log[before:] if m == "GET" and path.endswith(name)]


def _index_twice(proxy, tmp_path, monkeypatch, url: str, name: str, **kw):
    """(index, seconds, ranges GET, max in flight) of ``url`` indexed sequentially, then ahead."""
    out = []
    for ahead in (0, bucketshards.MAX_AHEAD):
        monkeypatch.setattr(bucketshards, "MAX_AHEAD", ahead)
        before, proxy.max_in_flight = len(proxy.log), 0
        t0 = time.monotonic()
        index, cached = load_index(url, None, EXTS, str(tmp_path / f"cache{ahead}"), **kw)
        took = time.monotonic() - t0
        assert not cached
        out.append((index, took, _gets(proxy, before, name), proxy.max_in_flight))
    return out


def _same(index, local) -> None:
    assert index.classes == local.classes and index.fingerprint == local.fingerprint
    assert [index.relpath(i) for i in range(len(index))] == [local.relpath(i) for i in range(len(local))]
    assert list(index.labels) == list(local.labels) and list(index.block) == list(local.block)


def test_the_flat_validation_tar_is_walked_with_its_next_chunks_in_flight(many, slow, tmp_path, monkeypatch):
    monkeypatch.setattr(bucketimagenet, "CHUNK", 4 << 10)  # a chunk per JPEG or so: every chunk holds a header
    local, _ = load_index(many.val_tar, None, EXTS, str(tmp_path / "local"), devkit=many.devkit_tgz,
                          section="validation")
    (seq, seq_s, seq_gets, seq_flight), (got, got_s, gets, flight) = _index_twice(
        slow, tmp_path, monkeypatch, f"s3://{BUCKET}/{P}/ILSVRC2012_img_val.tar", "ILSVRC2012_img_val.tar",
        devkit=many.devkit_tgz, section="validation", layout="imagenet_tars")
    _same(seq, local)
    _same(got, local)
    # one request at a time (the proxy may count the next one before the last one's end: 2), then several
    assert seq_flight <= 2 and flight >= 4, (seq_flight, flight)
    assert set(seq_gets) <= set(gets), (seq_gets, gets)  # every chunk the sequential walk fetched
    assert len(gets) == len(set(gets)) and len(gets) <= len(seq_gets) + bucketshards.MAX_AHEAD, (seq_gets, gets)
    print(f"\nvalidation tar, {len(seq_gets)} GETs of 4 KiB at {LATENCY_S * 1000:.0f} ms: sequential {seq_s:.2f} s, "
          f"ahead {got_s:.2f} s ({len(gets)} GETs, {flight} in flight at most)")


def test_the_train_tars_top_level_is_walked_with_its_next_chunks_in_flight(many, slow, tmp_path, monkeypatch):
    """The top level alone (``members`` through the forward reader the scan uses), then the whole
    index (whose class tars were already fetched several at once)."""
    url = f"s3://{BUCKET}/{P}/ILSVRC2012_img_train.tar"
    size, etag = objectstore.store_for(url).head(url).size, objectstore.store_for(url).head(url).etag
    with open(many.train_tar, "rb") as f:
        want = members(f.fileno(), 0, size, url, [])
    runs = []
    for ahead in (0, 8):
        before, slow.max_in_flight = len(slow.log), 0
        t0 = time.monotonic()
        f = bucketshards.ShardFile(objectstore.store_for(url), url, size, etag, "", TOP, keep=2, ahead=ahead)
        try:
            assert members(f, 0, size, url, []) == want  # the class tars' (name, offset, size) as on a disk
        finally:
            f.close()
        runs.append((time.monotonic() - t0, _gets(slow, before, "ILSVRC2012_img_train.tar"), slow.max_in_flight))
    (seq_s, seq_gets, seq_flight), (got_s, gets, flight) = runs
    assert len(seq_gets) == -(-size // TOP) and seq_flight <= 2  # every chunk, one at a time
    assert sorted(gets) == sorted(seq_gets) and flight >= 4, (gets, flight)  # the same chunks, overlapping
    print(f"\ntrain tar's top level, {len(seq_gets)} GETs of {TOP >> 10} KiB at {LATENCY_S * 1000:.0f} ms: sequential "
          f"{seq_s:.2f} s, ahead {got_s:.2f} s ({flight} in flight at most)")
    monkeypatch.setattr(bucketimagenet, "TOP_CHUNK", TOP)
    monkeypatch.setattr(bucketimagenet, "CHUNK", 16 << 10)
    local, _ = load_index(many.train_tar, None, EXTS, str(tmp_path / "local"))
    (seq, seq_s, seq_gets, _), (got, got_s, gets, _) = _index_twice(slow, tmp_path, monkeypatch, url,
                                                                    "ILSVRC2012_img_train.tar",
                                                                    layout="imagenet_tars")
    _same(seq, local)
    _same(got, local)
    assert [got.read(i) for i in range(0, len(got), 7)] == [local.read(i) for i in range(0, len(local), 7)]
    assert set(seq_gets) <= set(gets) and len(gets) <= len(seq_gets) + bucketshards.MAX_AHEAD, (seq_gets, gets)
    print(f"train tar indexed, {len(seq_gets)} GETs: sequential {seq_s:.2f} s, ahead {got_s:.2f} s ({len(gets)} GETs)")


def test_a_walk_over_large_members_fetches_nothing_ahead(s3, slow, tmp_path):
    """Members larger than two chunks (class tars of 140 MB against 1 MiB chunks): no two reads in a
    row, so the GETs are the sequential walk's alone, never the members' data."""
    big = make_imagenet(str(tmp_path / "big"), classes=3, per_class=4, val=2, seed=5, side=400)
    with open(big.train_tar, "rb") as f:
        data = f.read()
    s3.put(f"{P}-big/ILSVRC2012_img_train.tar", data)
    url = f"s3://{BUCKET}/{P}-big/ILSVRC2012_img_train.tar"
    store = objectstore.store_for(url)
    h = store.head(url)
    runs = []
    for ahead in (0, 8):
        before = len(slow.log)
        f = bucketshards.ShardFile(store, url, h.size, h.etag, "", 4 << 10, keep=2, ahead=ahead)
        try:
            found = members(f, 0, h.size, url, [])
        finally:
            f.close()
        assert len(found) == 3 and min(s for _, _, s in found) > 3 * (4 << 10)
        runs.append(sorted(_gets(slow, before, "ILSVRC2012_img_train.tar")))
    assert runs[1] == runs[0] and len(runs[0]) <= 2 * (len(found) + 1), runs  # a header (maybe straddling two) each


def test_a_stop_during_the_walk_ends_it_promptly_and_leaves_no_thread_or_request(many, s3, slow, monkeypatch):
    slow.latency_s = 0.3
    url = f"s3://{BUCKET}/{P}/ILSVRC2012_img_val.tar"
    store = objectstore.store_for(url)
    h = store.head(url)
    stop, said = threading.Event(), []
    f = bucketshards.ShardFile(store, url, h.size, h.etag, "", 4 << 10, stop=stop, keep=2, ahead=8)

    def walk():
        try:
            members(f, 0, h.size, url, [])
        except DatasetError as e:
            said.append(str(e))

    t = threading.Thread(target=walk)
    t.start()
    wait_until(lambda: slow.in_flight >= 3, 20, "GETs sent ahead in flight")
    t0 = time.monotonic()
    stop.set()
    t.join(5)
    f.close()
    took = time.monotonic() - t0
    assert not t.is_alive() and said == [f"indexing {url} stopped"], said
    # the GETs in flight end, none is sent after the stop (a margin for a loaded machine: the rest of the
    # walk would be ~200 GETs of 0.3 s)
    assert took < 2 * slow.latency_s + 3.0, took
    assert not [x for x in threading.enumerate() if x.name.startswith("prefetchd-ahead")]
    n = slow.requests
    wait_until(lambda: slow.in_flight == 0, 5, "no request left at the proxy")
    assert slow.requests == n and f.gets < -(-h.size // (4 << 10))  # not the whole tar


def test_sigterm_while_the_validation_tar_is_walked_exits_promptly(many, s3, slow, tmp_path):
    """The daemon's scan runs on a thread it does not wait for; a SIGTERM ends the process, whose
    exit must not wait for the rest of the walk's GETs (each takes 0.5 s here)."""
    slow.latency_s = 0.5
    code = ("import signal, sys, threading\n"
            "from prefetchd.sources import bucketimagenet\n"
            "bucketimagenet.CHUNK = 4096\n"
            "from prefetchd.sources.dataset import load_index\n"
            "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
            f"threading.Thread(target=load_index, args=({f's3://{BUCKET}/{P}/ILSVRC2012_img_val.tar'!r}, None, "
            f"{EXTS!r}, {str(tmp_path / 'c')!r}), kwargs=dict(devkit={many.devkit_tgz!r}, section='validation', "
            "layout='imagenet_tars'), daemon=True).start()\n"
            "print('go', flush=True); threading.Event().wait(60)\n")
    env = {**os.environ, **s3.env(), "AWS_ENDPOINT_URL": slow.endpoint}
    p = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        assert p.stdout.readline() == "go\n"
        wait_until(lambda: slow.in_flight >= 3, 30, "the walk's GETs in flight, several ahead")
        t0 = time.monotonic()
        p.terminate()
        p.wait(10)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0 and took < 5.0, (took, p.stderr.read()[-2000:])  # a loaded machine's margin


def test_a_walk_reading_one_header_at_a_time_fetches_ahead_too(s3, slow, tmp_path):
    """ImageNet's validation tar against 8 MiB chunks: JPEGs of 110 KB, each header read alone (a
    4 KiB window), 70 a chunk. Here 60 members of 20 KB against 64 KiB chunks, one header a read."""
    data = tar_bytes([(f"ILSVRC2012_val_{k:08d}.JPEG", os.urandom(20_000)) for k in range(60)])
    (tmp_path / "v.tar").write_bytes(data)
    s3.put(f"{P}-one/v.tar", data)
    url = f"s3://{BUCKET}/{P}-one/v.tar"
    store = objectstore.store_for(url)
    h = store.head(url)
    with open(tmp_path / "v.tar", "rb") as f:
        want = members(f.fileno(), 0, h.size, url, [])
    runs = []
    for ahead in (0, 8):
        before, slow.max_in_flight = len(slow.log), 0
        f = bucketshards.ShardFile(store, url, h.size, h.etag, "", 64 << 10, keep=2, ahead=ahead)
        try:
            assert members(f, 0, h.size, url, []) == want
        finally:
            f.close()
        runs.append((_gets(slow, before, "v.tar"), slow.max_in_flight))
    (seq, seq_flight), (got, flight) = runs
    assert len(seq) == -(-h.size // (64 << 10)) and seq_flight <= 2 and flight >= 4, (seq, runs)
    assert sorted(got) == sorted(seq), (seq, got)


def test_503s_and_resets_among_the_gets_sent_ahead_are_retried_and_a_stale_etag_is_refused(many, s3, slow,
                                                                                          tmp_path):
    url = f"s3://{BUCKET}/{P}/ILSVRC2012_img_val.tar"
    store = objectstore.store_for(url)
    h = store.head(url)
    with open(many.val_tar, "rb") as f:
        want = members(f.fileno(), 0, h.size, url, [])
    slow.faults(n503=4, resets=3, after_requests=slow.requests + 6)  # among the GETs in flight ahead
    f = bucketshards.ShardFile(store, url, h.size, h.etag, "", 4 << 10, keep=2, ahead=8)
    try:
        assert members(f, 0, h.size, url, []) == want
    finally:
        f.close()
    assert slow.faulted == 7 and slow.max_in_flight >= 4
    f = bucketshards.ShardFile(store, url, h.size, '"not-the-etag"', "", 4 << 10, keep=2, ahead=8)
    try:
        with pytest.raises(StorageChanged):
            members(f, 0, h.size, url, [])
    finally:
        f.close()
