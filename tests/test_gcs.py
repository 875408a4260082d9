"""gs:// roots against a GCS emulator (fake-gcs-server on loopback, tests/gcsfixture.py), no mock:
the calls prefetchd makes answered as it reads them (listings, GETs, ranged GETs, HEADs, ETags), the
three layouts' indexes and the real daemon's batches byte for byte the local root's, ``prefetchd
check``'s lines, its one line for credentials it cannot use, ``STORAGE_EMULATOR_HOST``, and no
line of the service account's private key in anything the daemon writes.

The emulator ignores ``If-Match`` on a GET (GCS answers a stale one 412): the answer's ETag,
which prefetchd checks too, is what refuses an overwritten shard here (tests/test_bucket_shards.py
runs its overwrite tests on both providers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from bucketrun import same_batches_from_the_bucket_and_no_secret
from conftest import small_config
from gcsfixture import BUCKET, CLIENT_EMAIL, GCSServer

obstore = pytest.importorskip("obstore", reason="the gcs extra (obstore) is not installed")
pq = pytest.importorskip("pyarrow.parquet")

from test_parquet import _rows, hf_table  # noqa: E402
from test_shards import _samples, write_shards  # noqa: E402

from prefetchd.sources import bytecache, objectstore  # noqa: E402
from prefetchd.sources.base import DatasetError, StorageChanged  # noqa: E402
from prefetchd.sources.dataset import load_index  # noqa: E402

EXTS = (".jpeg", ".jpg", ".png")


@pytest.fixture(scope="session")
def gcs_roots(gcs, image_root, tmp_path_factory) -> dict:
    """One corpus of each layout on local disk and uploaded to the emulator: {layout: (local, gs://)}."""
    shards = tmp_path_factory.mktemp("gcs-wds")
    write_shards(shards, _samples(24, seed=5, classes=3), per_shard=8)
    hf = tmp_path_factory.mktemp("gcs-hf")
    rows = _rows(30, seed=6)  # 5 batches of 6 an epoch: the helper wants 8 batches in 2 epochs
    for k in range(2):
        pq.write_table(hf_table(rows[15 * k:15 * k + 15]), hf / f"train-{k:05d}-of-00002.parquet", row_group_size=5)
    roots = {"folder": (image_root, "folder"), "shards": (str(shards), "wds"), "parquet": (str(hf), "hf")}
    for local, prefix in roots.values():
        assert gcs.upload_tree(local, prefix) > 0
    return {k: (local, f"gs://{BUCKET}/{prefix}") for k, (local, prefix) in roots.items()}


def test_the_emulator_answers_the_calls_prefetchd_makes_with_one_etag_per_object(gcs, gcs_env, gcs_roots,
                                                                                   tmp_path):
    """A listing gave the ETag bare, a HEAD and a GET quoted: an ImageFolder object was never kept
    in the node-local cache (its GET's ETag never matched the listing's), and a shard's ranged
    GET, whose answer's ETag is held to the listed one, would have been refused every time."""
    data = bytes(range(256)) * 64
    gcs.put("calls/a/one.bin", data)
    gcs.put("calls/two.bin", b"two")
    store = objectstore.store_for(f"gs://{BUCKET}/calls")
    listed = {name: (size, etag) for name, size, etag in store.list(f"gs://{BUCKET}/calls")}
    assert sorted(listed) == ["a/one.bin", "two.bin"] and listed["a/one.bin"][0] == len(data)
    objects, folders = store.list_top(f"gs://{BUCKET}/calls")
    assert [o[0] for o in objects] == ["two.bin"] and folders == ["a"]
    h = store.open(f"gs://{BUCKET}/calls/a/one.bin")
    assert store.identity(h) == listed["a/one.bin"] and objects[0][1:] == listed["two.bin"]
    assert store.read_tagged(f"gs://{BUCKET}/calls/a/one.bin") == (data, listed["a/one.bin"][1])
    assert store.pread(h, 100, 1000) == data[1000:1100] and store.pread(h, 100, len(data) - 10) == data[-10:]
    with pytest.raises(FileNotFoundError):
        store.read(f"gs://{BUCKET}/calls/missing.bin")
    # the node-local cache keeps an ImageFolder object only when its GET's ETag is the listed one
    try:
        index, _ = load_index(f"gs://{BUCKET}/folder", None, EXTS, str(tmp_path / "cache"),
                              cache={"dir": str(tmp_path / "bytes"), "max_bytes": 1 << 30})
        first = index.read(0)
        assert bytecache.current().stats["misses"] == 1
        assert index.read(0) == first and bytecache.current().stats["hits"] == 1
    finally:
        bytecache.configure(None)


def test_the_emulator_ignores_if_match_and_the_answers_etag_still_tells(gcs, gcs_env):
    """fake-gcs-server serves an overwritten object's new bytes to a ranged GET whose If-Match is
    stale (GCS: 412): prefetchd also compares the answer's ETag with the one indexed, so a sample is
    never read at its old offsets (tests/test_bucket_shards.py, [gs]). The day the first assert
    fails, the emulator answers 412 itself."""
    gcs.put("ifmatch/one.tar", b"a" * 4096)
    store = objectstore.store_for(f"gs://{BUCKET}/ifmatch")
    h = store.open(f"gs://{BUCKET}/ifmatch/one.tar")
    gcs.put("ifmatch/one.tar", b"b" * 4096)
    got = obstore.get(store.client(), "ifmatch/one.tar", options={"range": (0, 4), "if_match": h.etag})
    assert bytes(got.bytes()) == b"bbbb"  # If-Match ignored
    with pytest.raises(StorageChanged, match="changed since it was indexed"):
        store.pread(h, 4, 0, cache=False)


@pytest.mark.parametrize("layout", ["folder", "shards", "parquet"])
def test_each_layouts_gcs_index_is_the_local_one(gcs_roots, gcs_env, layout, tmp_path):
    local_root, root = gcs_roots[layout]
    local, _ = load_index(local_root, None, EXTS, str(tmp_path / "local-cache"))
    index, cached = load_index(root, None, EXTS, str(tmp_path / "cache"))
    assert not cached and index.root == root and index.kind == local.kind
    assert index.classes == local.classes and index.fingerprint == local.fingerprint
    assert [index.relpath(i) for i in range(len(index))] == [local.relpath(i) for i in range(len(local))]
    assert [index.read(i) for i in range(len(index))] == [local.read(i) for i in range(len(local))]
    again, cached = load_index(root, None, EXTS, str(tmp_path / "cache"))
    assert cached and again.fingerprint == index.fingerprint  # the next start lists, finds it unchanged


@pytest.mark.parametrize("layout,meta", [("folder", "bucket-meta.json"), ("shards", "bucket-tarmeta.json"),
                                         ("parquet", "bucket-parquetmeta.json")])
def test_the_daemon_on_gcs_makes_the_local_batches_and_writes_no_line_of_the_private_key(
        gcs, gcs_roots, layout, meta, tmp_path, daemon_factory):
    local_root, root = gcs_roots[layout]
    same_batches_from_the_bucket_and_no_secret(tmp_path, local_root, root, gcs.env(), daemon_factory, meta,
                                               gcs.secret)


def _check(cfg: str, env: dict) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("GOOGLE_", "STORAGE_EMULATOR"))}
    return subprocess.run([sys.executable, "-m", "prefetchd", "check", "--config", cfg], capture_output=True,
                          text=True, timeout=120, env={**clean, **env})


def test_check_says_which_service_account_and_endpoint_and_whether_it_lists_and_reads(gcs, gcs_roots, tmp_path):
    root = gcs_roots["folder"][1]
    r = _check(small_config(tmp_path, root), gcs.env())
    lines = r.stdout.splitlines()
    assert lines[0] == f"storage: {root} as service account {CLIENT_EMAIL} (GOOGLE_APPLICATION_CREDENTIALS " \
                       f"{gcs.key_path}), endpoint {gcs.endpoint}", r.stdout + r.stderr
    assert lines[1].startswith(f"list: ok ({root}/") and lines[2].startswith("read: ok (")
    assert gcs.secret.decode() not in r.stdout + r.stderr


def test_a_credentials_file_that_cannot_be_used_is_one_line_naming_it_and_no_key(gcs, gcs_roots, tmp_path):
    with open(gcs.key_path, encoding="utf-8") as f:
        account = json.load(f)
    cut = tmp_path / "cut.json"
    pem = account["private_key"].splitlines()
    cut.write_text(json.dumps({**account, "private_key": "\n".join(pem[:5] + pem[-1:]) + "\n"}))  # cut short
    r = _check(small_config(tmp_path, gcs_roots["folder"][1]), {**gcs.env(), "GOOGLE_APPLICATION_CREDENTIALS": str(cut)})
    said = r.stdout + r.stderr
    assert r.returncode != 0 and gcs.secret.decode() not in said and pem[2] not in said, said
    lines = [ln for ln in said.splitlines() if "credentials cannot be used" in ln]
    assert len(lines) == 1 and str(cut) in lines[0] and "GOOGLE_APPLICATION_CREDENTIALS" in lines[0], said


def test_storage_emulator_host_alone_reaches_the_emulator_unsigned(gcs, gcs_roots, tmp_path):
    """Google's client libraries and gcsfs read STORAGE_EMULATOR_HOST; obstore does not: a user of
    an emulator who set it was sent to storage.googleapis.com with no credentials."""
    root = gcs_roots["folder"][1]
    r = _check(small_config(tmp_path, root), {"STORAGE_EMULATOR_HOST": f"127.0.0.1:{gcs.port}"})
    lines = r.stdout.splitlines()
    assert lines[:1] == [f"storage: {root} as anonymous (STORAGE_EMULATOR_HOST and no credentials), endpoint "
                         f"{gcs.endpoint}"], r.stdout + r.stderr
    assert lines[1].startswith("list: ok") and lines[2].startswith("read: ok")


def test_an_emulator_not_serving_the_xml_api_is_said_so_not_no_such_bucket(gcs, tmp_path):
    """fake-gcs-server as its own examples start it (no -public-host) answers obstore's listing
    404: check said "no such bucket (404)" of a bucket that was there."""
    bare = GCSServer(str(tmp_path), xml_api=False)
    bare.start()
    try:
        bare.put("x/a/1.jpg", b"x")
        r = _check(small_config(tmp_path, f"gs://{BUCKET}/x"), {"STORAGE_EMULATOR_HOST": bare.endpoint})
    finally:
        bare.stop()
    said = [ln for ln in (r.stdout + r.stderr).splitlines() if "cannot be listed" in ln]
    assert r.returncode != 0 and len(said) == 1, r.stdout + r.stderr
    assert f"start fake-gcs-server with -public-host 127.0.0.1:{bare.port}" in said[0], said[0]


def test_the_same_bucket_name_at_the_emulator_and_at_gcs_is_two_buckets(monkeypatch):
    for k in ("GOOGLE_BASE_URL", "STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_SERVICE_ACCOUNT",
              "GOOGLE_SERVICE_ACCOUNT_PATH", "GOOGLE_SERVICE_ACCOUNT_KEY"):
        monkeypatch.delenv(k, raising=False)
    store = objectstore.ObjectStore("gs", BUCKET)
    at_gcs = store.endpoint(), store.cache_key("gs://b/x")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "localhost:4443")
    at_emulator = store.endpoint(), store.cache_key("gs://b/x")
    assert at_gcs[0] == "" and at_emulator[0] == "http://localhost:4443" and at_gcs[1] != at_emulator[1]
    assert objectstore.ObjectStore("gs", BUCKET, {"base_url": "http://h:1"}).endpoint() == "http://h:1"


def test_a_gcs_error_line_never_carries_a_private_key():
    said = objectstore._first_line(RuntimeError(
        "Generic error: bad key -----BEGIN PRIVATE KEY-----\\nMIIEvQIBADANBgkqhkiG9w0B\\n-----END PRIVATE KEY-----"
        " in file\n\nDebug source: ..."))
    assert "MIIEvQ" not in said and "[a private key]" in said and said.endswith("in file")


def test_a_listing_error_says_what_to_do_for_gcs():
    import errno

    denied = OSError(errno.EACCES, "Server returned non-2xx status code: 403 Forbidden", "gs://b/x")
    assert "roles/storage.objectViewer" in objectstore.words(denied, "gs")
    assert "AWS_ACCESS_KEY_ID" in objectstore.words(denied, "s3")
    no_token = OSError(errno.EIO, "Generic GCS error: Error performing token request: connection refused")
    assert "gcloud auth application-default login" in objectstore.words(no_token, "gs")
    with pytest.raises(DatasetError, match="gs://BUCKET/PREFIX"):
        objectstore.split("gcs://b/x")


def test_a_keys_json_given_where_a_path_is_meant_is_never_said(monkeypatch):
    """GOOGLE_APPLICATION_CREDENTIALS (or GOOGLE_SERVICE_ACCOUNT) set to a key's JSON itself, not its
    file's path, as CI secrets often are: ``describe`` said the variable's value, private key and all,
    in ``prefetchd check``'s line and in every listing error the daemon logs."""
    body = "MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQ"
    key = json.dumps({"type": "service_account", "client_email": CLIENT_EMAIL,
                      "private_key": f"-----BEGIN PRIVATE KEY-----\n{body}\n-----END PRIVATE KEY-----\n"})
    for k in ("GOOGLE_BASE_URL", "STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_SERVICE_ACCOUNT",
              "GOOGLE_SERVICE_ACCOUNT_PATH", "GOOGLE_SERVICE_ACCOUNT_KEY"):
        monkeypatch.delenv(k, raising=False)
    for var in ("GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_SERVICE_ACCOUNT"):
        monkeypatch.setenv(var, key)
        objectstore._STORES.clear()
        with pytest.raises(DatasetError) as e:  # obstore cannot open the "file": no request is sent
            objectstore.probe(f"gs://{BUCKET}/x", {"base_url": "http://127.0.0.1:9"})
        said = [objectstore.ObjectStore("gs", BUCKET).describe(), str(e.value)]
        for line in said:
            assert body not in line and "\n" not in line, line
        assert CLIENT_EMAIL in said[0] and var in said[0], said[0]
        monkeypatch.delenv(var)


def test_a_gs_objects_refusal_met_while_indexing_or_reading_gives_gcs_advice_not_aws():
    """The shards' and ImageNet's scans, the devkit's read and a sample's read say a refusal by
    ``objectstore.words(e)`` with no scheme: a gs:// object's 403 said 'check the key pair
    (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)'."""
    import errno

    # as ``_os_error`` makes it: the URL is the filename
    denied = OSError(errno.EACCES, "Server returned non-2xx status code: 403 Forbidden", f"gs://{BUCKET}/n01.tar")
    said = objectstore.words(denied)
    assert "roles/storage.objectViewer" in said and "AWS" not in said, said
    s3_denied = OSError(errno.EACCES, "Server returned non-2xx status code: 403 Forbidden", "s3://b/n01.tar")
    assert "AWS_ACCESS_KEY_ID" in objectstore.words(s3_denied)


def test_a_stores_endpoint_is_the_one_its_client_was_made_for_read_once(gcs, gcs_env, tmp_path, monkeypatch):
    """``cache_key`` (every sample's read: the node-local cache's key) found a gs:// endpoint anew
    each time, reading and parsing the service account's key file (80 us a read, ten times s3://'s);
    and a key file rewritten mid-run moved the key off the endpoint the client still reads."""
    with open(gcs.key_path, encoding="utf-8") as f:
        key = json.load(f)
    path = tmp_path / "sa.json"
    path.write_text(json.dumps({**key, "gcs_base_url": gcs.endpoint}))
    monkeypatch.delenv("GOOGLE_BASE_URL")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(path))
    store = objectstore.ObjectStore("gs", BUCKET)
    assert store.endpoint() == gcs.endpoint  # before the client is made: found
    store.client()
    before = store.cache_key(f"gs://{BUCKET}/x")
    assert before.startswith(gcs.endpoint + "|"), before
    path.write_text(json.dumps({**key, "gcs_base_url": "http://127.0.0.1:9"}))
    assert store.cache_key(f"gs://{BUCKET}/x") == before
