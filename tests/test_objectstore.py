"""s3:// roots against a real S3 server (SeaweedFS on loopback, tests/s3fixture.py), no mock: the
store's reads, ranged reads held to the ETag, the bucket ImageFolder's index equal to the local
one's, the real daemon's batches byte for byte the local root's, ``prefetchd check``'s lines and
its one-line errors (a wrong key, a missing bucket), and no secret in anything the daemon writes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml
from bucketrun import same_batches_from_the_bucket_and_no_secret
from conftest import small_config
from s3fixture import ACCESS_KEY, BUCKET, SECRET_KEY
from s3proxy import FaultProxy
from test_daemon import collect

obstore = pytest.importorskip("obstore", reason="the s3 extra (obstore) is not installed")

from prefetchd.sources import objectstore  # noqa: E402
from prefetchd.sources.base import DatasetError, StorageChanged  # noqa: E402
from prefetchd.sources.dataset import load_index  # noqa: E402
from prefetchd.sources.folder import scan_image_folder  # noqa: E402

EXTS = (".jpg", ".jpeg", ".png")


@pytest.fixture(scope="session")
def bucket_root(s3, image_root) -> str:
    """``image_root`` (4 classes x 12 JPEGs) uploaded under ``s3://BUCKET/folder``."""
    assert s3.upload_tree(image_root, "folder") == 48
    return f"s3://{BUCKET}/folder"


def test_the_bucket_index_is_the_local_one(bucket_root, image_root, s3_env, tmp_path):
    local, _ = scan_image_folder(image_root, EXTS)
    index, cached = load_index(bucket_root, None, EXTS, str(tmp_path / "cache"))
    assert not cached and index.root == bucket_root
    assert index.classes == local.classes and index.fingerprint == local.fingerprint
    assert [index.relpath(i) for i in range(len(index))] == [local.relpath(i) for i in range(len(local))]
    for i in (0, 17, len(index) - 1):
        with open(local.path(i), "rb") as f:
            assert index.read(i) == f.read()
    again, cached = load_index(bucket_root, None, EXTS, str(tmp_path / "cache"))
    assert cached and again.fingerprint == index.fingerprint  # listed once, then the cache
    for dirpath, _, files in os.walk(tmp_path / "cache"):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                assert SECRET_KEY.encode() not in f.read()


def test_ranged_reads_are_held_to_the_etag_an_overwritten_object_is_never_read(s3, s3_env):
    data = bytes(range(256)) * 64
    s3.put("tars/one.tar", data)
    store = objectstore.store_for(f"s3://{BUCKET}/tars")
    url = f"s3://{BUCKET}/tars/one.tar"
    h = store.open(url)
    assert store.identity(h)[0] == len(data) and store.identity(h)[1]
    assert store.pread(h, 100, 1000) == data[1000:1100]
    assert store.open(url) is h  # kept: no second HEAD
    s3.put("tars/one.tar", b"x" * len(data))  # the same size, other bytes: only the ETag tells
    with pytest.raises(StorageChanged, match="changed since it was indexed"):
        store.pread(h, 100, 1000)
    store.forget(url)
    assert store.pread(store.open(url), 4, 0) == b"xxxx"
    with pytest.raises(FileNotFoundError):
        store.read(f"s3://{BUCKET}/tars/missing.tar")


def test_a_wrong_key_and_a_missing_bucket_are_one_line_each(s3, s3_env, bucket_root, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    objectstore._STORES.clear()
    with pytest.raises(DatasetError) as e:
        objectstore.probe(bucket_root)
    assert "access denied (403)" in str(e.value) and "\n" not in str(e.value)
    assert "not-the-secret" not in str(e.value) and ACCESS_KEY[-4:] in str(e.value)
    assert ACCESS_KEY not in str(e.value)  # cut to its last 4 characters wherever it is said
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    objectstore._STORES.clear()
    with pytest.raises(DatasetError) as e:
        objectstore.probe("s3://no-such-bucket-pfd/x")
    assert "\n" not in str(e.value) and "s3://no-such-bucket-pfd/x" in str(e.value)
    with pytest.raises(DatasetError, match="s3://BUCKET/PREFIX"):
        objectstore.split("ftp://host/x")


def test_an_error_line_never_carries_an_access_key_id(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "mykeyid-12345678")
    said = objectstore._first_line(RuntimeError(
        "Generic S3 error: <Error><Code>InvalidAccessKeyId</Code><AccessKeyId>AKIAIOSFODNN7EXAMPLE</AccessKeyId>"
        "</Error> as mykeyid-12345678, or ASIAXXXXXXXXXXXX9999 \n\nDebug source: AKIAIOSFODNN7EXAMPLE"))
    assert "AKIAIOSFODNN7" not in said and "mykeyid-1234" not in said and "ASIAXXXX" not in said, said
    assert "...MPLE" in said and "...5678" in said and "...9999" in said and "Debug source" not in said


def _check(cfg: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefetchd", "check", "--config", cfg], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **env})


def test_check_says_who_where_and_whether_it_lists_and_reads(s3, bucket_root, tmp_path):
    cfg = small_config(tmp_path, bucket_root)
    r = _check(cfg, s3.env())
    lines = r.stdout.splitlines()
    assert lines[0] == f"storage: {bucket_root} as access key ...{ACCESS_KEY[-4:]}, endpoint {s3.endpoint}, " \
                       "region us-east-1", r.stdout + r.stderr
    assert lines[1].startswith("list: ok (") and lines[2].startswith("read: ok (")
    bad = _check(cfg, s3.env(secret="wrong-secret"))
    assert bad.returncode != 0
    said = [ln for ln in (bad.stdout + bad.stderr).splitlines() if "access denied" in ln]
    assert len(said) == 1 and "wrong-secret" not in bad.stdout + bad.stderr, bad.stdout + bad.stderr


def test_the_daemon_with_a_wrong_key_or_no_such_bucket_stops_at_once_with_one_line(s3, bucket_root, tmp_path):
    """A listing's 403 and 404 come from obstore as a GenericError: they were retried as transient
    for 120 s ("retrying with back-off"), then the root was read as an ImageFolder."""
    for name, root, env, said in (("key", bucket_root, s3.env(secret="wrong-secret"), "access denied (403)"),
                                  ("bucket", "s3://no-such-bucket-pfd/shards", s3.env(), "no such bucket")):
        (tmp_path / name).mkdir()
        cfg = small_config(tmp_path / name, root)
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "prefetchd", "run", "--config", cfg], capture_output=True,
                           text=True, timeout=60, env={**os.environ, **env})
        out = r.stdout + r.stderr
        assert r.returncode == 78 and time.monotonic() - t0 < 30, out
        lines = [ln for ln in out.splitlines() if "dataset.root" in ln]
        assert len(lines) == 1 and said in lines[0] and "retrying" not in out and "wrong-secret" not in out, out


def test_an_endpoint_down_past_the_retries_at_start_exits_75_to_be_restarted_not_78(s3, bucket_root, tmp_path):
    """The bucket not answering at start (a store started after the daemon at boot) ended as a
    'configuration error' (exit 78), which the shipped unit's RestartPreventExitStatus=78 never
    restarts. The real CLI, its retry episode cut to 2 s, against a port nothing listens on."""
    from s3fixture import _free_ports

    cfg = small_config(tmp_path, bucket_root)
    run = ("import sys; from prefetchd.sources import objectstore; objectstore._RETRY_TIMEOUT_S = 2.0; "
           "from prefetchd.cli import main; sys.exit(main(['run', '--config', sys.argv[1]]))")
    env = {**os.environ, **s3.env(), "AWS_ENDPOINT_URL": f"http://127.0.0.1:{_free_ports(1)[0]}"}
    r = subprocess.run([sys.executable, "-c", run, cfg], capture_output=True, text=True, timeout=90, env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 75, out
    said = [ln for ln in out.splitlines() if "dataset.root" in ln]
    assert len(said) == 1 and "the bucket did not answer" in said[0] and "configuration error" not in out, out


def test_the_daemon_on_a_bucket_makes_the_local_roots_batches_and_writes_no_secret(s3, bucket_root, image_root,
                                                                                  tmp_path, daemon_factory):
    with open(small_config(tmp_path, bucket_root)) as f:
        assert yaml.safe_load(f)["dataset"]["root"] == bucket_root
    same_batches_from_the_bucket_and_no_secret(tmp_path, image_root, bucket_root, s3.env(), daemon_factory,
                                               "bucket-meta.json", SECRET_KEY.encode())


def test_an_s3_root_without_the_extra_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "obstore", None)  # import obstore raises ImportError, as when not installed
    objectstore._STORES.clear()
    with pytest.raises(DatasetError) as e:
        load_index("s3://some-bucket/train", None, EXTS, str(tmp_path / "cache"))
    assert str(e.value) == ("dataset.root is a s3:// URL, which needs the 's3' extra: pip install 'prefetchd[s3]'")


def test_gs_urls_go_through_the_same_client_with_no_secret_in_what_check_says(monkeypatch, tmp_path):
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    objectstore._STORES.clear()
    store = objectstore.store_for("gs://some-bucket/train")
    assert store.scheme == "gs" and type(store.client()).__name__ == "GCSStore"
    assert store.describe() == "no GOOGLE_APPLICATION_CREDENTIALS: the metadata server's service account (a VM's " \
                               "or pod's), endpoint Google Cloud Storage"
    missing = str(tmp_path / "sa.json")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", missing)
    objectstore._STORES.clear()
    with pytest.raises(DatasetError) as e:  # a key file that is not there: one line, before any request
        objectstore.probe("gs://some-bucket/train")
    assert "\n" not in str(e.value) and f"the credentials in GOOGLE_APPLICATION_CREDENTIALS {missing}" in str(e.value)
    assert "Unable to open service account file" in str(e.value)


@pytest.fixture
def proxy(s3):
    p = FaultProxy(s3.port)
    yield p
    p.stop()


def test_503s_and_resets_are_retried_with_one_line_per_episode(s3, proxy, bucket_root, monkeypatch, caplog):
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    objectstore._STORES.clear()
    store = objectstore.store_for(bucket_root)
    first = next(iter(store.list(bucket_root)))[0]
    want = store.read(f"{bucket_root}/{first}")
    proxy.faults(n503=6, resets=4)
    with caplog.at_level("WARNING", logger="prefetchd.objectstore"):
        assert store.read(f"{bucket_root}/{first}") == want
        assert store.read(f"{bucket_root}/{first}") == want
    said = [r.getMessage() for r in caplog.records]
    assert proxy.faulted == 10
    assert len(said) == 2 and "retrying with back-off" in said[0] and "answers again" in said[1], said
    assert SECRET_KEY not in " ".join(said)


def test_the_daemon_through_503s_resets_and_an_outage_makes_the_same_batches_and_quarantines_nothing(
        s3, proxy, bucket_root, image_root, tmp_path, daemon_factory):
    local_dir, bucket_dir = tmp_path / "local", tmp_path / "bucket"
    local_dir.mkdir()
    bucket_dir.mkdir()
    local_cfg = small_config(local_dir, image_root)
    d = daemon_factory(local_cfg)
    ref = collect(local_cfg)
    assert d.stop() == 0
    cfg = small_config(bucket_dir, bucket_root)
    proxy.faults(n503=15, resets=10, after_requests=20)  # after the listing, during the first epoch
    proxy.outage(2.0, after_requests=60)  # then the endpoint gone for 2 s
    d = daemon_factory(cfg, env={**s3.env(), "AWS_ENDPOINT_URL": proxy.endpoint})
    got = collect(cfg)
    assert d.stop() == 0
    assert proxy.faulted > 25  # the 25 planned, then every request of the outage
    for k in ref:
        assert np.array_equal(got[k][0], ref[k][0]) and np.array_equal(got[k][1], ref[k][1]), k
    log = d.log()
    episodes = log.count("retrying with back-off")
    assert 2 <= episodes <= 6, log  # per process that met it (2 workers, the daemon), per episode (2), not per request
    assert log.count("answers again after") == episodes and "quarantin" not in log.lower(), log


def test_storage_options_alone_reach_the_bucket_and_their_secret_no_file_the_daemon_writes(
        s3, bucket_root, image_root, tmp_path, daemon_factory, monkeypatch):
    for k in s3.env():
        monkeypatch.delenv(k, raising=False)
    local_dir, bucket_dir = tmp_path / "local", tmp_path / "bucket"
    local_dir.mkdir()
    bucket_dir.mkdir()
    local_cfg = small_config(local_dir, image_root)
    d = daemon_factory(local_cfg)
    ref = collect(local_cfg)
    assert d.stop() == 0
    options = {"access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY, "endpoint": s3.endpoint,
               "region": "us-east-1"}
    cfg = small_config(bucket_dir, bucket_root, dataset={"storage_options": options})
    r = _check(cfg, {})
    assert r.stdout.splitlines()[0] == (f"storage: {bucket_root} as access key ...{ACCESS_KEY[-4:]}, endpoint "
                                        f"{s3.endpoint}, region us-east-1"), r.stdout + r.stderr
    assert SECRET_KEY not in r.stdout + r.stderr
    d = daemon_factory(cfg)
    got = collect(cfg)
    assert d.stop() == 0
    for k in ref:
        assert np.array_equal(got[k][0], ref[k][0]) and np.array_equal(got[k][1], ref[k][1]), k
    written = [os.path.join(p, n) for p, _, names in os.walk(bucket_dir) for n in names if n != "cfg.yaml"]
    assert any(p.endswith("bucket-meta.json") for p in written)
    for path in [*written, d.log_path]:
        with open(path, "rb") as f:
            assert SECRET_KEY.encode() not in f.read(), path


def test_an_outage_of_2_s_is_waited_out_with_one_line_each_way(s3, proxy, bucket_root, monkeypatch, caplog):
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    objectstore._STORES.clear()
    store = objectstore.store_for(bucket_root)
    first = next(iter(store.list(bucket_root)))[0]
    want = store.read(f"{bucket_root}/{first}")
    proxy.outage(2.0)
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="prefetchd.objectstore"):
        assert store.read(f"{bucket_root}/{first}") == want
    assert time.monotonic() - t0 >= 1.9 and proxy.faulted >= 2
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "retrying with back-off" in said[0] and "answers again after" in said[1], said


def test_the_shared_credentials_files_profile_is_used_when_the_environment_has_no_key(s3, bucket_root, tmp_path,
                                                                                     monkeypatch):
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(k, raising=False)
    for k in ("AWS_ENDPOINT_URL", "AWS_REGION"):
        monkeypatch.setenv(k, s3.env()[k])
    (tmp_path / ".aws").mkdir()
    (tmp_path / ".aws" / "credentials").write_text(f"[default]\naws_access_key_id = wrong\n\n[train]\n"
                                                  f"aws_access_key_id = {ACCESS_KEY}\n"
                                                  f"aws_secret_access_key = {SECRET_KEY}\n")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("AWS_PROFILE", "train")
    objectstore._STORES.clear()
    lines = objectstore.probe(bucket_root)
    assert lines[0] == (f"storage: {bucket_root} as access key ...{ACCESS_KEY[-4:]} from profile train of "
                        f"{tmp_path}/.aws/credentials, endpoint {s3.endpoint}, region us-east-1")
    assert lines[2].startswith("read: ok") and SECRET_KEY not in " ".join(lines)


def test_a_batchs_objects_are_fetched_together_not_one_latency_each(s3, proxy, bucket_root, image_root, tmp_path,
                                                                    monkeypatch):
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    objectstore._STORES.clear()
    index, _ = load_index(bucket_root, None, EXTS, str(tmp_path / "cache"))
    local, _ = scan_image_folder(image_root, EXTS)
    proxy.latency_s = 0.3  # each request held this long at the proxy: requests sent together overlap there
    batch = [3, 40, 17, 8, 25, 33, 1, 46]
    proxy.max_in_flight = 0
    index.prefetch(batch)
    got = [index.read(i) for i in batch]
    for i, data in zip(batch, got, strict=True):
        with open(local.path(i), "rb") as f:
            assert data == f.read()
    # counted where the requests arrive, not timed (a loaded machine stretches any time): one at a
    # time would hold 1 at once
    assert proxy.max_in_flight >= len(batch) // 2, proxy.max_in_flight


def test_a_cached_bucket_index_reads_with_the_configs_storage_options(s3, bucket_root, image_root, tmp_path,
                                                                      monkeypatch):
    """The second start loads the index from the cache, lists nothing, and must still reach the
    bucket with the keys and endpoint of ``dataset.storage_options`` (the daemon reads samples
    itself: the transform's probe, the quarantine's stamps)."""
    for k in s3.env():
        monkeypatch.delenv(k, raising=False)
    options = {"access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY, "endpoint": s3.endpoint,
               "region": "us-east-1"}
    objectstore._STORES.clear()
    index, cached = load_index(bucket_root, None, EXTS, str(tmp_path / "cache"), storage_options=options)
    assert not cached
    objectstore._STORES.clear()  # a new process: the daemon's second start
    again, cached = load_index(bucket_root, None, EXTS, str(tmp_path / "cache"), storage_options=options)
    assert cached
    with open(os.path.join(image_root, again.relpath(5)), "rb") as f:
        assert again.read(5) == f.read()
    objectstore._STORES.clear()
    # the same bucket and prefix at another endpoint (here the same server by another name) is
    # another bucket: listed, not taken from the first one's cache
    other = {**options, "endpoint": s3.endpoint.replace("127.0.0.1", "localhost")}
    assert other["endpoint"] != options["endpoint"]
    _, cached = load_index(bucket_root, None, EXTS, str(tmp_path / "cache"), storage_options=other)
    assert not cached
    objectstore._STORES.clear()


def test_a_validation_root_in_another_bucket_is_read_with_the_storage_options_alone(
        s3, bucket_root, image_root, tmp_path, daemon_factory, monkeypatch):
    """The workers make each bucket's client with ``dataset.storage_options``, the validation
    root's bucket too (not only the train root's): without them, and with nothing in the
    environment, its objects could not be reached."""
    from prefetchd_client import PrefetchClient

    for k in s3.env():
        monkeypatch.delenv(k, raising=False)
    from prefetchd.tools.samples import make_image_folder

    held_out = str(tmp_path / "held_out")
    make_image_folder(held_out, classes=4, per_class=12, seed=5, long_side=160)
    s3.make_bucket("valbucket")
    assert s3.upload_tree(held_out, "val", bucket="valbucket") == 48
    options = {"access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY, "endpoint": s3.endpoint,
               "region": "us-east-1"}
    cfg = small_config(tmp_path, bucket_root, dataset={"storage_options": options}, workers={"count": 1},
                       validation={"enabled": True, "root": "s3://valbucket/val", "batch_size": 8})
    d = daemon_factory(cfg)
    with PrefetchClient(cfg, split="val", timeout=60, as_numpy=True) as v:
        labels = np.concatenate([y.copy() for _, y in v])
    assert d.stop() == 0
    assert sorted(labels.tolist()) == sorted([i // 12 for i in range(48)])
    assert "quarantined" not in d.log() and "unreadable" not in d.log()


def test_the_endpoint_is_read_under_each_of_obstores_spellings(monkeypatch):
    """The index cache keys on the endpoint, so every spelling obstore takes names it."""
    for k in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT"):
        monkeypatch.delenv(k, raising=False)
    for key in ("endpoint", "endpoint_url", "aws_endpoint", "AWS_ENDPOINT_URL", "Aws_Endpoint"):
        assert objectstore.ObjectStore("s3", "b", {key: "http://10.0.0.1:9000"}).endpoint() == "http://10.0.0.1:9000", key
    assert objectstore.ObjectStore("s3", "b").endpoint() == ""
    monkeypatch.setenv("AWS_ENDPOINT", "http://10.0.0.2:9000")
    assert objectstore.ObjectStore("s3", "b").endpoint() == "http://10.0.0.2:9000"


def test_a_gets_or_heads_404_counts_as_an_error(s3, s3_env):
    # obstore raises a GET's or HEAD's 404 as the builtin FileNotFoundError, which the retry loop's count of
    # errors (status, metrics) did not catch: an object deleted mid-run showed requests and no error
    store = objectstore.store_for(f"s3://{BUCKET}/x")
    for call in (store.read, store.head):
        before = objectstore.counts() or (0,) * 7  # () before the first request
        with pytest.raises(FileNotFoundError):
            call(f"s3://{BUCKET}/no-such/object.jpg")
        after = objectstore.counts()
        assert after[1] == before[1] + 1 and after[3] == before[3] + 1, (call.__name__, before, after)


def test_the_look_at_the_root_after_a_samples_403_or_404_counts_its_request(s3, s3_env):
    # ``first`` (one listing, not retried: the look at the root, and ``probe``'s) was not counted
    store = objectstore.store_for(f"s3://{BUCKET}/x")
    before = objectstore.counts() or (0,) * 7
    store.first(f"s3://{BUCKET}/folder")
    after = objectstore.counts()
    assert after[1] == before[1] + 1 and after[3] == before[3], (before, after)


def _through_proxy(s3, proxy, bucket_root, monkeypatch):
    """The bucket's store reached through ``proxy``, and the name of the root's last object."""
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    objectstore._STORES.clear()
    store = objectstore.store_for(bucket_root)
    return store, sorted(n for n, _, _ in store.list(bucket_root))[-1]


def test_a_samples_403_or_404_while_the_look_at_the_root_fails_blames_no_sample(s3, proxy, bucket_root,
                                                                               monkeypatch):
    # after a sample's 403 or 404 the root is looked at (one listing) to tell whose fault it is; a look
    # that met a 503 or a reset passed for "the root reads", and the sample was blamed: replaced for the
    # rest of the run, the stream changed, for the bucket's hiccup. Now the batch waits until it can tell.
    from prefetchd.executors.storage import SampleUnreadable, StorageUnavailable, read_sample

    store, name = _through_proxy(s3, proxy, bucket_root, monkeypatch)
    url = f"{bucket_root}/{name}"
    want = store.read(url)

    def read():
        return store.read(url)

    for denied in (True, False):  # its ACL (a 403), then the object deleted (a 404: another name)
        if not denied:
            url = f"{bucket_root}/{name}.deleted"
        with proxy.denying(name if denied else "\0"):
            n = proxy.requests
            with pytest.raises(OSError):
                read()
            per_read = proxy.requests - n
            for fault in ("n503", "resets"):  # past obstore's own two tries
                proxy.faults(**{fault: 3}, after_requests=proxy.requests + per_read + 1)
                with pytest.raises(StorageUnavailable) as e:
                    read_sample(read, bucket_root, sleep=lambda s: None)
                said = str(e.value)
                assert "\n" not in said and f"the dataset root {bucket_root} cannot be read now (asking it failed: " \
                    in said, said
                # what the look got, in words: not the request's URL (the endpoint, the query) nor the XML cut short
                assert said.endswith("(asking it failed: it answered 503 SlowDown)" if fault == "n503" else
                                     "(asking it failed: the endpoint did not answer (the connection reset, "
                                     "refused or timed out))"), said
                assert proxy.endpoint.split("//")[1] not in said and "<" not in said, said
                proxy.faults()
            with pytest.raises(SampleUnreadable):  # the root answers: the object's own fault, as before
                read_sample(read, bucket_root, sleep=lambda s: None)
    url = f"{bucket_root}/{name}"
    assert read_sample(read, bucket_root) == want


def test_a_samples_404_while_listings_are_refused_for_good_blames_the_sample_not_a_wait_forever(
        s3, proxy, bucket_root, monkeypatch):
    # a gateway that answers every listing 501 (or 400) while objects read: asking the root again gets the
    # same answer, so waiting for it to answer otherwise waited forever (the batch never made, the trainer
    # stalled on it) for an object deleted mid-run, which was replaced before the look's faults were waited on
    from prefetchd.executors.storage import SampleUnreadable, StorageUnavailable, read_sample

    store, name = _through_proxy(s3, proxy, bucket_root, monkeypatch)
    gone = f"{bucket_root}/{name}.deleted"
    for status in (501, 400):
        proxy.list_status = status
        with pytest.raises(SampleUnreadable):
            read_sample(lambda: store.read(gone), bucket_root, sleep=lambda s: None)
        assert store.read(f"{bucket_root}/{name}")  # the objects read all along
    proxy.list_status = 0
    proxy.faults(n503=3, after_requests=proxy.requests + 2)  # a 503 past obstore's tries: still a wait
    with pytest.raises(StorageUnavailable):
        read_sample(lambda: store.read(gone), bucket_root, sleep=lambda s: None)
