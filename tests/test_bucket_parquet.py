"""Parquet files in a bucket against a real S3 server (SeaweedFS on loopback, tests/s3fixture.py), no
mock: the index is the local files' (a folder prefix, a glob, one object), built from footers and
label columns with ranged GETs (counted at a proxy: never the images); a sample's read is its row
group's column chunk, one ranged GET; an object overwritten in the bucket is never read as other
rows, and a start indexes it anew; bad roots are one line naming the key; the real daemon makes
the local files' batches byte for byte."""

from __future__ import annotations

import os

import numpy as np
import pytest
from bucketrun import same_batches_from_the_bucket_and_no_secret
from conftest import small_config
from s3fixture import BUCKET, SECRET_KEY
from s3proxy import FaultProxy
from test_daemon import collect

pq = pytest.importorskip("pyarrow.parquet")
pytest.importorskip("obstore", reason="the s3 extra (obstore) is not installed")

from test_parquet import _rows, hf_table  # noqa: E402

from prefetchd.sources import objectstore  # noqa: E402
from prefetchd.sources.base import DatasetError, StorageChanged  # noqa: E402
from prefetchd.sources.dataset import load_index  # noqa: E402

EXTS = (".jpeg", ".jpg", ".png")
ROWS = 30
GROUP = 5


@pytest.fixture(scope="session")
def local_hf(tmp_path_factory):
    """``ROWS`` rows as Hugging Face writes a split: two files of row groups of ``GROUP`` rows."""
    folder = tmp_path_factory.mktemp("hf")
    rows = _rows(ROWS, seed=12)
    half = ROWS // 2
    for k in range(2):
        pq.write_table(hf_table(rows[half * k:half * k + half]), folder / f"train-{k:05d}-of-00002.parquet",
                       row_group_size=GROUP)
    return str(folder), rows


@pytest.fixture(scope="session")
def bucket_hf(s3, local_hf) -> str:
    assert s3.upload_tree(local_hf[0], "hf") == 2
    return f"s3://{BUCKET}/hf"


@pytest.fixture
def proxy(s3):
    p = FaultProxy(s3.port)
    yield p
    p.stop()


def _same(index, local) -> None:
    assert index.classes == local.classes and index.fingerprint == local.fingerprint
    assert [index.relpath(i) for i in range(len(index))] == [local.relpath(i) for i in range(len(local))]
    assert [local.read(i) for i in range(len(local))] == [index.read(i) for i in range(len(index))]


def test_the_bucket_parquet_index_is_the_local_one_read_with_ranged_gets(s3_env, bucket_hf, local_hf, proxy,
                                                                           monkeypatch, tmp_path):
    local, _ = load_index(local_hf[0], None, EXTS, str(tmp_path / "local-cache"))
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    objectstore._STORES.clear()
    index, cached = load_index(bucket_hf, None, EXTS, str(tmp_path / "cache"))
    assert not cached and index.kind == "parquet" and index.root == bucket_hf
    # auto's listing, the files' listing, then per file its footer and its label column's chunks (one a row
    # group at most): never the image column
    assert proxy.requests <= 2 + 2 * (1 + ROWS // GROUP), proxy.requests
    before = proxy.requests
    for i in range(len(index)):
        assert index.read(i) == local.read(i)
    groups = ROWS // GROUP
    # a row group's image column: one GET (two files' footers: one GET each, kept by the process)
    assert proxy.requests - before <= groups + 2, proxy.requests - before
    _same(index, local)
    again, cached = load_index(bucket_hf, None, EXTS, str(tmp_path / "cache"))
    assert cached and again.fingerprint == index.fingerprint
    for root in (bucket_hf + "/train-*.parquet", bucket_hf + "/train-0000[01]-of-00002.parquet"):
        other, _ = load_index(root, None, EXTS, str(tmp_path / "cache"))
        _same(other, local)
    one, _ = load_index(bucket_hf + "/train-00001-of-00002.parquet", None, EXTS, str(tmp_path / "cache"))
    assert len(one) == ROWS // 2 and one.read(0) == local.read(ROWS // 2)
    for dirpath, _, files in os.walk(tmp_path / "cache"):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                assert SECRET_KEY.encode() not in f.read()


def test_an_overwritten_parquet_object_is_never_read_as_other_rows_and_a_start_indexes_it_anew(
        bucket, local_hf, tmp_path, caplog):
    """gs://: fake-gcs-server ignores If-Match; the answer's ETag, checked too, tells."""
    server, scheme = bucket
    folder, rows = local_hf
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            server.put(f"hfover/{name}", f.read())
    root = f"{scheme}://{BUCKET}/hfover"
    index, _ = load_index(root, None, EXTS, str(tmp_path / "cache"))
    assert index.read(len(index) - 1) == rows[-1][0]
    import io

    buf = io.BytesIO()
    pq.write_table(hf_table(rows[ROWS // 2:][::-1]), buf, row_group_size=GROUP)  # other rows in the same places
    server.put("hfover/train-00001-of-00002.parquet", buf.getvalue())
    objectstore._STORES.clear()
    from prefetchd.sources import bucketparquet

    bucketparquet._FOOTERS.clear()
    from prefetchd.sources import parquet

    parquet._groups.clear()
    with pytest.raises(StorageChanged, match="changed since it was indexed"):
        index.read(len(index) - 1)
    assert index.read(0) == rows[0][0]  # the other file reads on
    with caplog.at_level("WARNING", logger="prefetchd.dataset"):
        again, cached = load_index(root, None, EXTS, str(tmp_path / "cache"))
    assert not cached and "1 overwritten, e.g. train-00001-of-00002.parquet" in caplog.text
    assert again.read(len(again) - 1) == rows[ROWS // 2][0] and int(again.labels[-1]) == rows[ROWS // 2][1]


def _error(root, tmp_path, **kw) -> str:
    with pytest.raises(DatasetError) as e:
        load_index(root, None, EXTS, str(tmp_path / "cache"), **kw)
    said = str(e.value)
    assert "\n" not in said and "s3://" in said, said  # the root (dataset.root) or the object at fault
    return said


def test_bad_bucket_parquet_roots_are_one_line_each_naming_the_key(s3, s3_env, bucket_hf, image_root, tmp_path):
    assert "lists no objects" in _error(f"s3://{BUCKET}/no-such-prefix", tmp_path, layout="parquet")
    assert "matches no objects" in _error(f"s3://{BUCKET}/hf/test-*.parquet", tmp_path)
    assert "no such object" in _error(f"s3://{BUCKET}/hf/nothere.parquet", tmp_path)
    s3.upload_tree(image_root, "pimgs")
    said = _error(f"s3://{BUCKET}/pimgs", tmp_path, layout="parquet")
    assert "holds no .parquet files at its top level" in said and "n00000000/" in said, said
    s3.put("splits/train-00000-of-00001.parquet", b"x")
    s3.put("splits/test-00000-of-00001.parquet", b"x")
    assert "holds the Parquet files of 2 splits" in _error(f"s3://{BUCKET}/splits", tmp_path)
    s3.put("cut/train.parquet", b"PAR1" + bytes(100))
    assert "is not a readable Parquet file" in _error(f"s3://{BUCKET}/cut", tmp_path)
    s3.put("nocol/train.parquet", b"")
    import io

    import pyarrow as pa

    buf = io.BytesIO()
    pq.write_table(pa.table({"img": [b"x"], "label": [1]}), buf)
    s3.put("nocol/train.parquet", buf.getvalue())
    assert "has no column 'image'" in _error(f"s3://{BUCKET}/nocol", tmp_path)


def test_the_daemon_on_bucket_parquet_makes_the_local_files_batches_and_writes_no_secret(
        s3, bucket_hf, local_hf, tmp_path, daemon_factory):
    same_batches_from_the_bucket_and_no_secret(tmp_path, local_hf[0], bucket_hf, s3.env(), daemon_factory,
                                               "bucket-parquetmeta.json", SECRET_KEY.encode())


def test_a_reload_sees_a_parquet_object_overwritten_since_the_index(s3, s3_env, local_hf, tmp_path):
    import io

    from prefetchd.sources.dataset import unchanged_since_scan

    folder, rows = local_hf
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            s3.put(f"hfreload/{name}", f.read())
    index, _ = load_index(f"s3://{BUCKET}/hfreload", None, EXTS, str(tmp_path / "cache"))
    assert unchanged_since_scan(index.files_dir, index.fingerprint)
    buf = io.BytesIO()
    pq.write_table(hf_table(rows[:ROWS // 2][::-1]), buf, row_group_size=GROUP)
    s3.put("hfreload/train-00000-of-00002.parquet", buf.getvalue())
    assert not unchanged_since_scan(index.files_dir, index.fingerprint)


def test_a_block_shuffle_from_bucket_parquet_makes_the_local_files_batches(s3, bucket_hf, local_hf, tmp_path,
                                                                          daemon_factory):
    got = {}
    for name, root, env in (("local", local_hf[0], None), ("bucket", bucket_hf, s3.env())):
        (tmp_path / name).mkdir()
        cfg = small_config(tmp_path / name, root, loader={"shuffle": "block", "shuffle_window": 2})
        d = daemon_factory(cfg, env=env)
        got[name] = collect(cfg)
        assert d.stop() == 0
    assert sorted(got["local"]) == sorted(got["bucket"]) and len(got["local"]) >= 8
    for k, (x, y) in got["local"].items():
        assert np.array_equal(got["bucket"][k][0], x) and np.array_equal(got["bucket"][k][1], y), k


def test_shards_beside_parquet_files_are_one_line_in_a_bucket_as_on_a_disk_and_a_layout_reads_either(
        s3, s3_env, local_hf, tmp_path):
    """The same folder of both kinds gave the Parquet rows from a local disk and the shards from a
    bucket: one dataset.root, two datasets, depending only on where the files lay."""
    from test_shards import _samples, write_shards

    mixed = tmp_path / "mixed"
    write_shards(mixed, _samples(8, seed=3), per_shard=4)
    for name in os.listdir(local_hf[0]):
        (mixed / name).write_bytes(open(os.path.join(local_hf[0], name), "rb").read())
    assert s3.upload_tree(str(mixed), "pqmixed") == 4  # (test_bucket_shards has its own mixed/: one bucket, one session)
    for root in (str(mixed), f"s3://{BUCKET}/pqmixed"):
        with pytest.raises(DatasetError) as e:
            load_index(root, None, EXTS, str(tmp_path / "cache"))
        assert "holds both .tar files (train-000000.tar ...) and Parquet files" in str(e.value), str(e.value)
        assert "dataset.layout: webdataset or parquet" in str(e.value) and "\n" not in str(e.value)
    for layout, n in (("webdataset", 8), ("parquet", ROWS)):
        local, _ = load_index(str(mixed), None, EXTS, str(tmp_path / "cache"), layout=layout)
        bucket, _ = load_index(f"s3://{BUCKET}/pqmixed", None, EXTS, str(tmp_path / "cache"), layout=layout)
        assert len(local) == n
        _same(bucket, local)


def test_a_prefix_one_level_above_the_shards_or_parquet_files_names_the_folder_to_set(s3, s3_env, local_hf,
                                                                                      tmp_path):
    """A prefix of train/ and val/ shard folders, or a Hugging Face repo's root (its Parquet under
    data/): read as an ImageFolder, it said only 'holds no images with extensions .jpeg, ...'."""
    from test_shards import _samples, write_shards

    for p in write_shards(tmp_path / "wds", _samples(8, seed=4), per_shard=4):
        for split in ("train", "val"):
            s3.put(f"above/{split}/{os.path.basename(p)}", open(p, "rb").read())
    name = sorted(os.listdir(local_hf[0]))[0]
    s3.put(f"hfrepo/data/{name}", open(os.path.join(local_hf[0], name), "rb").read())
    s3.put("hfrepo/README.md", b"---\nlicense: mit\n---\n")
    for root, folder, kind in ((f"s3://{BUCKET}/above", "train", ".tar"), (f"s3://{BUCKET}/hfrepo/", "data", ".parquet")):
        said = _error(root, tmp_path)
        assert f"the folder {folder}/ is not a class: no images, only" in said and kind in said, said
        assert f"set dataset.root to {root.rstrip('/')}/{folder}/ to read them" in said, said
        assert len(load_index(f"{root.rstrip('/')}/{folder}/", None, EXTS, str(tmp_path / "cache"))[0]) in (8, ROWS // 2)


def test_an_endpoint_gone_while_the_footers_are_read_is_unavailable_not_a_corrupt_file(s3_env, bucket_hf, proxy,
                                                                                       monkeypatch, tmp_path):
    """The listing answered, then the endpoint went away past the retries while pyarrow read a
    footer: the start said the file was 'not a readable Parquet file ... a corrupt copy?' and exited
    78, which the shipped unit never restarts; it is the bucket not answering (exit 75)."""
    from prefetchd.sources.base import StorageUnavailable

    monkeypatch.setattr(objectstore, "_RETRY_TIMEOUT_S", 1.0)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    objectstore._STORES.clear()
    proxy.outage(60.0, after_requests=3)  # auto's listing and the files' listing answer, then nothing
    with pytest.raises(StorageUnavailable, match="train-00000-of-00002.parquet cannot be read: the bucket did not answer") as e:
        load_index(bucket_hf, None, EXTS, str(tmp_path / "cache"))
    assert "corrupt" not in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_key_that_expires_while_the_footers_are_read_is_said_as_the_key_not_a_corrupt_file(s3_env, bucket_hf, proxy,
                                                                                              monkeypatch, tmp_path):
    """The listings answered, then the session token expired (403 ExpiredToken) while pyarrow read a
    footer: the start blamed the file ('not a readable Parquet file ... a corrupt copy? write it
    again'), as ImageNet's tars in a bucket no longer do (they say to renew the credentials)."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    objectstore._STORES.clear()
    proxy.faults(n403=1000, after_requests=3)  # auto's listing and the files' listing answer, then 403s
    with pytest.raises(DatasetError) as e:
        load_index(bucket_hf, None, EXTS, str(tmp_path / "cache"))
    said = str(e.value)
    assert "corrupt" not in said and "\n" not in said, said
    assert "expired (403 ExpiredToken): renew them" in said and "train-00000-of-00002.parquet" in said, said


def test_one_parquet_file_refused_by_its_acl_is_the_roots_refusal_not_each_rows(s3_env, bucket_hf, proxy, monkeypatch,
                                                                                tmp_path):
    # the 403 was asked of the index's root, the file's folder, which still lists: every row of the one file
    # the dataset is was blamed in turn. The refusal is asked of the file (a HEAD); of a folder of files, a
    # refused file's rows are its own fault.
    from prefetchd.executors.storage import SampleUnreadable, StorageUnavailable, read_sample

    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    objectstore._STORES.clear()
    one = f"{bucket_hf}/train-00001-of-00002.parquet"
    index, _ = load_index(one, None, EXTS, str(tmp_path / "one"))
    with proxy.denying("/train-00001-of-00002.parquet"):
        with pytest.raises(StorageUnavailable) as e:
            read_sample(lambda: index.read(1), index.refusal_root, sleep=lambda s: None)
    assert f"the dataset root {one} cannot be read now (access denied (403)" in str(e.value), e.value
    both, _ = load_index(bucket_hf, None, EXTS, str(tmp_path / "both"))
    assert both.refusal_root == both.root == bucket_hf
    with proxy.denying("-00001-of-00002.parquet"):
        with pytest.raises(SampleUnreadable):
            read_sample(lambda: both.read(len(both) - 1), both.refusal_root, sleep=lambda s: None)
