"""ImageNet's tars in a bucket against a real S3 server (SeaweedFS on loopback, tests/s3fixture.py),
no mock: each form (the train tar of class tars, a prefix of class tars, the flat validation tar
with the devkit, local or in the bucket) gives the local index (classes, order, labels,
fingerprint) and the same bytes; the headers are read by range, never the whole train tar in one
GET (counted at a proxy); an object overwritten in the bucket is never read at its indexed
offsets; bad inputs are one line; the real daemon makes the local tar's batches byte for byte."""

from __future__ import annotations

import os
import shutil
from urllib.parse import unquote

import pytest
from bucketrun import same_batches_from_the_bucket_and_no_secret
from imagenet_archives import make_imagenet, tar_bytes
from s3fixture import BUCKET, SECRET_KEY
from s3proxy import FaultProxy

pytest.importorskip("obstore", reason="the s3 extra (obstore) is not installed")

from prefetchd.sources import bucketimagenet, objectstore  # noqa: E402
from prefetchd.sources.base import DatasetError, StorageChanged  # noqa: E402
from prefetchd.sources.dataset import load_index, unchanged_since_scan  # noqa: E402

EXTS = (".jpeg", ".jpg", ".png")
P = "inet"  # this file's prefix in the session's bucket


@pytest.fixture(scope="session")
def inet(tmp_path_factory):
    return make_imagenet(str(tmp_path_factory.mktemp("inet")), classes=4, per_class=7, val=9, seed=3)  # 28: 8 batches of 6 in 2 epochs


@pytest.fixture(scope="session")
def uploaded(s3, inet) -> str:
    """The archives under ``s3://BUCKET/inet``: the train and validation tars, the devkit, the class tars."""
    return s3.upload_imagenet(inet, P)


@pytest.fixture
def proxy(s3_proxy):
    return s3_proxy


def _same(index, local) -> None:
    assert index.classes == local.classes and index.fingerprint == local.fingerprint
    assert index.layout == local.layout and len(index) == len(local)
    assert [index.relpath(i) for i in range(len(index))] == [local.relpath(i) for i in range(len(local))]
    assert list(index.labels) == list(local.labels)
    assert [index.read(i) for i in range(len(index))] == [local.read(i) for i in range(len(local))]


def test_each_form_of_imagenets_tars_in_a_bucket_is_the_local_index_read_by_ranges(
        s3_env, inet, uploaded, proxy, tmp_path):
    forms = [(inet.train_tar, f"{uploaded}/ILSVRC2012_img_train.tar", None, None),
             (inet.train_tars, f"{uploaded}/train_tars", None, None),
             (inet.val_tar, f"{uploaded}/ILSVRC2012_img_val.tar", inet.devkit_tgz, inet.devkit_tgz),
             (inet.val_tar, f"{uploaded}/ILSVRC2012_img_val.tar", inet.devkit_tgz, f"{uploaded}/ILSVRC2012_devkit_t12.tar.gz"),
             (inet.val_tar, f"{uploaded}/ILSVRC2012_img_val.tar", inet.devkit_tgz, f"{uploaded}/devkit")]
    for local_root, url, local_devkit, devkit in forms:
        section = "validation" if devkit else "dataset"
        local, _ = load_index(local_root, None, EXTS, str(tmp_path / "local"), devkit=local_devkit, section=section)
        before = len(proxy.log)
        index, cached = load_index(url, None, EXTS, str(tmp_path / "cache"), devkit=devkit, section=section)
        assert not cached and index.root == url and local.layout in ("tar", "tars", "flat-tar")
        scan = proxy.log[before:]
        tar_gets = [e for e in scan if e[0] == "GET" and "ILSVRC2012_img" in e[1] or "train_tars/" in e[1]]
        assert tar_gets and all(r is not None for _, _, r, _ in tar_gets), scan  # ranged, never a whole tar
        _same(index, local)
        again, cached = load_index(url, None, EXTS, str(tmp_path / "cache"), devkit=devkit, section=section)
        assert cached and again.fingerprint == index.fingerprint
        assert unchanged_since_scan(again.files_dir, again.fingerprint)
    for dirpath, _, files in os.walk(tmp_path / "cache"):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                assert SECRET_KEY.encode() not in f.read()


def test_the_train_tars_headers_are_read_in_chunks_that_skip_large_members(s3, s3_env, tmp_path, proxy,
                                                                            monkeypatch):
    big = make_imagenet(str(tmp_path / "big"), classes=3, per_class=4, val=2, seed=5, side=400)
    with open(big.train_tar, "rb") as f:
        data = f.read()
    s3.put("inet-big/ILSVRC2012_img_train.tar", data)
    local, _ = load_index(big.train_tar, None, EXTS, str(tmp_path / "local"))
    assert min(int(s) for s in local.size) > 16 << 10  # every member larger than a chunk
    monkeypatch.setattr(bucketimagenet, "CHUNK", 8 << 10)
    monkeypatch.setattr(bucketimagenet, "TOP_CHUNK", 4 << 10)
    before = len(proxy.log)
    index, _ = load_index(f"s3://{BUCKET}/inet-big/ILSVRC2012_img_train.tar", None, EXTS, str(tmp_path / "cache"),
                          layout="imagenet_tars")  # auto's probe (one GET of 256 KiB) apart
    gets = [e for e in proxy.log[before:] if e[0] == "GET" and e[1].endswith("ILSVRC2012_img_train.tar")]
    fetched = sum(n for *_, n in gets)
    assert all(r is not None for _, _, r, _ in gets) and fetched < len(data) // 2, (fetched, len(data))
    # the first header, the top level (3 class tars, the end) and each class tar's 4 headers and its end
    # (a header read takes 4 KiB, which may straddle two chunks); never one GET of a member's data
    assert len(gets) <= 1 + 4 + 3 * 2 * (4 + 1), gets
    _same(index, local)


def test_an_overwritten_tar_is_never_read_at_its_old_offsets_and_a_start_indexes_it_anew(
        s3, s3_env, inet, tmp_path, caplog):
    with open(inet.train_tar, "rb") as f:
        s3.put("inet-over/ILSVRC2012_img_train.tar", f.read())
    url = f"s3://{BUCKET}/inet-over/ILSVRC2012_img_train.tar"
    index, _ = load_index(url, None, EXTS, str(tmp_path / "cache"))
    local, _ = load_index(inet.train_tar, None, EXTS, str(tmp_path / "local"))
    assert index.read(0) == local.read(0)
    # the same class tars in another order: the same size, every member elsewhere
    inner = {w: open(os.path.join(inet.train_tars, w + ".tar"), "rb").read() for w in inet.wnids}
    new = tar_bytes([(w + ".tar", inner[w]) for w in sorted(inet.wnids, reverse=True)])
    assert len(new) == os.path.getsize(inet.train_tar)
    s3.put("inet-over/ILSVRC2012_img_train.tar", new)
    objectstore._STORES.clear()
    with pytest.raises(StorageChanged, match="changed since it was indexed"):
        index.read(0)
    assert not unchanged_since_scan(index.files_dir, index.fingerprint)
    with caplog.at_level("WARNING", logger="prefetchd.dataset"):
        again, cached = load_index(url, None, EXTS, str(tmp_path / "cache"))
    assert not cached and "changed since it was indexed (1 overwritten" in caplog.text
    _same(again, local)  # the same classes and members, read at their new offsets


def _error(root, tmp_path, key="dataset.root", **kw) -> str:
    with pytest.raises(DatasetError) as e:
        load_index(root, None, EXTS, str(tmp_path / "cache"), **kw)
    said = str(e.value)
    assert "\n" not in said and key in said, said
    return said


def test_bad_imagenet_inputs_in_a_bucket_are_one_line_each(s3, s3_env, inet, uploaded, image_root, tmp_path):
    val = f"{uploaded}/ILSVRC2012_img_val.tar"
    said = _error(val, tmp_path, "validation.devkit", devkit=f"{uploaded}/no-such-devkit.tar.gz", section="validation")
    assert "is not in the bucket (404)" in said, said
    said = _error(val, tmp_path, "validation.root", section="validation", layout="imagenet_tars")
    assert "flat set of 9 images" in said and "validation.devkit" in said, said
    s3.put("inet-bad/junk/ILSVRC2012_img_train.tar", os.urandom(4096))
    said = _error(f"s3://{BUCKET}/inet-bad/junk/ILSVRC2012_img_train.tar", tmp_path)
    assert "no valid tar header at offset 0" in said, said
    with open(os.path.join(inet.train_tars, inet.wnids[0] + ".tar"), "rb") as f:
        s3.put("inet-bad/mixed/n01.tar", f.read())
    s3.upload_tree(image_root, "inet-bad/mixed")
    said = _error(f"s3://{BUCKET}/inet-bad/mixed", tmp_path)
    assert "holds class tars (n01.tar ...) and folders (n00000000, n00000001, n00000002 ...)" in said, said
    s3.put("inet-bad/download/ILSVRC2012_img_train.tar", open(inet.train_tar, "rb").read())
    s3.put("inet-bad/download/ILSVRC2012_img_val.tar", open(inet.val_tar, "rb").read())
    said = _error(f"s3://{BUCKET}/inet-bad/download", tmp_path)
    assert "looks like ImageNet's download folder" in said, said
    said = _error(f"{uploaded}/train_tars", tmp_path, "validation.root", section="validation",
                  devkit=inet.devkit_tgz)
    assert "is a folder of class tars (a train set), but validation.devkit labels" in said, said
    s3.put("inet-bad/devkit-junk.tar.gz", b"not a gzip")
    said = _error(val, tmp_path, "validation.devkit", section="validation",
                  devkit=f"s3://{BUCKET}/inet-bad/devkit-junk.tar.gz")
    assert "is not a readable tar" in said, said


def test_a_local_validation_tar_labelled_by_a_devkit_in_the_bucket(s3_env, inet, uploaded, tmp_path):
    local, _ = load_index(inet.val_tar, None, EXTS, str(tmp_path / "a"), devkit=inet.devkit_tgz, section="validation")
    other, cached = load_index(inet.val_tar, None, EXTS, str(tmp_path / "b"), section="validation",
                               devkit=f"{uploaded}/ILSVRC2012_devkit_t12.tar.gz")
    assert not cached and other.fingerprint == local.fingerprint and other.classes == local.classes
    again, cached = load_index(inet.val_tar, None, EXTS, str(tmp_path / "b"), section="validation",
                               devkit=f"{uploaded}/ILSVRC2012_devkit_t12.tar.gz")
    assert cached and unchanged_since_scan(again.files_dir, again.fingerprint)


def test_the_daemon_on_the_train_tar_in_a_bucket_makes_the_local_tars_batches_and_writes_no_secret(
        s3, inet, uploaded, tmp_path, daemon_factory):
    same_batches_from_the_bucket_and_no_secret(tmp_path, inet.train_tar, f"{uploaded}/ILSVRC2012_img_train.tar",
                                               s3.env(), daemon_factory, "bucket-imagenetmeta.json",
                                               SECRET_KEY.encode())


def test_the_daemon_on_a_prefix_of_class_tars_makes_the_local_folders_batches(
        s3, inet, uploaded, tmp_path, daemon_factory):
    local = tmp_path / "tars"
    shutil.copytree(inet.train_tars, local)
    same_batches_from_the_bucket_and_no_secret(tmp_path, str(local), f"{uploaded}/train_tars", s3.env(),
                                               daemon_factory, "bucket-imagenetmeta.json", SECRET_KEY.encode())


def test_a_devkit_that_is_no_archive_is_one_line_on_a_disk_too(inet, tmp_path):
    junk = tmp_path / "ILSVRC2012_devkit_t12.tar.gz"
    junk.write_bytes(b"not a gzip")  # tarfile's r:* said each compression it tried, one line each
    said = _error(inet.val_tar, tmp_path, "validation.devkit", section="validation", devkit=str(junk))
    assert "is not a readable tar or .tar.gz archive (neither a tar nor a gzip, bzip2 or xz file)" in said, said


# --- file lists of objects (dataset.file_list: s3://..., or a local list of s3:// URLs) ---------------


def _listed(root: str, tmp_path) -> str:
    """A file list of the ImageFolder ``root`` (every other image, labels by class), beside it."""
    lines = ["# path label"]
    for label, cls in enumerate(sorted(os.listdir(root))):
        lines += [f"{cls}/{n} {label}" for n in sorted(os.listdir(os.path.join(root, cls)))[::2]]
    return "\n".join(lines) + "\n"


def test_a_file_list_in_the_bucket_or_of_urls_is_the_local_lists_index(s3, s3_env, image_root, tmp_path, proxy):
    text = _listed(image_root, tmp_path)
    local_list = os.path.join(tmp_path, "imgs", "list.txt")
    shutil.copytree(image_root, tmp_path / "imgs")
    with open(local_list, "w") as f:
        f.write(text)
    local, _ = load_index(None, local_list, EXTS, str(tmp_path / "local"))
    s3.upload_tree(str(tmp_path / "imgs"), "inet-list")
    index, cached = load_index(None, f"s3://{BUCKET}/inet-list/list.txt", EXTS, str(tmp_path / "cache"))
    assert not cached and index.root == f"s3://{BUCKET}/inet-list" and index.kind == "list"
    _same_plain(index, local)
    again, cached = load_index(None, f"s3://{BUCKET}/inet-list/list.txt", EXTS, str(tmp_path / "cache"))
    assert cached and again.fingerprint == index.fingerprint
    urls = tmp_path / "urls.txt"  # a local list naming the objects by URL
    urls.write_text("".join(f"s3://{BUCKET}/inet-list/{line}\n" for line in text.splitlines()[1:]))
    by_url, _ = load_index(None, str(urls), EXTS, str(tmp_path / "cache"))
    assert by_url.root == f"s3://{BUCKET}/inet-list"
    _same_plain(by_url, local)


def test_a_file_list_lists_only_the_folders_its_images_lie_in(s3, s3_env, image_root, tmp_path, proxy):
    # the list's paths were checked against one listing of everything under the list's folder: for a
    # list at a bucket's top, the whole bucket. Now each folder named is listed at its own level.
    classes = sorted(os.listdir(image_root))
    kept = classes[1:3]
    text = "".join(f"{cls}/{n} {label}\n" for label, cls in enumerate(kept)
                   for n in sorted(os.listdir(os.path.join(image_root, cls)))[:3])
    s3.upload_tree(image_root, "inet-flist")
    s3.put("inet-flist/list.txt", text.encode())
    (tmp_path / "imgs").mkdir()
    for cls in kept:
        shutil.copytree(os.path.join(image_root, cls), tmp_path / "imgs" / cls)
    (tmp_path / "imgs" / "list.txt").write_text(text)
    local, _ = load_index(None, str(tmp_path / "imgs" / "list.txt"), EXTS, str(tmp_path / "local"))
    before = len(proxy.log)
    index, _ = load_index(None, f"s3://{BUCKET}/inet-flist/list.txt", EXTS, str(tmp_path / "cache"))
    _same_plain(index, local)
    listings = sorted(unquote(path) for _, path, _, _ in proxy.log[before:] if "list-type" in path)
    assert len(listings) == 2 and all("delimiter=/" in p for p in listings), listings
    assert [p.split("prefix=")[1].split("&")[0] for p in listings] == [f"inet-flist/{c}/" for c in kept], listings
    # an image a folder (more folders than the listed objects' pages, and over 64): one listing of all
    many = tmp_path / "many"
    for i in range(65):
        (many / f"d{i:02d}").mkdir(parents=True)
        shutil.copy(os.path.join(image_root, kept[0], sorted(os.listdir(os.path.join(image_root, kept[0])))[0]),
                    many / f"d{i:02d}" / "x.jpg")
    (many / "list.txt").write_text("".join(f"d{i:02d}/x.jpg {i % 2}\n" for i in range(65)))
    s3.upload_tree(str(many), "inet-flist-many")
    before = len(proxy.log)
    wide, _ = load_index(None, f"s3://{BUCKET}/inet-flist-many/list.txt", EXTS, str(tmp_path / "cache"))
    assert len(wide) == 65 and wide.read(64) == wide.read(0)
    listings = [unquote(path) for _, path, _, _ in proxy.log[before:] if "list-type" in path]
    assert len(listings) == 1 and "delimiter" not in listings[0], listings


def _same_plain(index, local) -> None:
    assert index.classes == local.classes and index.fingerprint == local.fingerprint
    assert [index.read(i) for i in range(len(index))] == [local.read(i) for i in range(len(local))]


def test_bad_file_lists_of_objects_are_one_line_each(s3, s3_env, image_root, tmp_path):
    def said(path, text=None) -> str:
        if text is not None:
            s3.put(path.split(f"{BUCKET}/", 1)[1], text.encode()) if path.startswith("s3://") else open(
                path, "w").write(text)
        with pytest.raises(DatasetError) as e:
            load_index(None, path, EXTS, str(tmp_path / "cache"))
        assert "\n" not in str(e.value) and "dataset.file_list" in str(e.value), e.value
        return str(e.value)

    s3.upload_tree(image_root, "inet-badlist")
    base = f"s3://{BUCKET}/inet-badlist"
    assert "no such object in the bucket" in said(f"{base}/nothere.txt")
    assert "1 of the 2 images it lists are not in the bucket (e.g. " in said(
        f"{base}/a.txt", "n00000000/img_00000.JPEG 0\nn00000000/gone.jpg 1\n")
    assert "is not under the list's folder" in said(f"{base}/b.txt", "../x.jpg 0\n")
    assert "expected 'path label'" in said(f"{base}/c.txt", "n00000000/img_00000.JPEG\n")
    assert "names objects in a bucket" in said(str(tmp_path / "mixed.txt"),
                                               f"{base}/n00000000/img_00000.JPEG 0\nlocal.jpg 1\n")


def test_the_daemon_on_a_file_list_in_the_bucket_makes_the_local_lists_batches(s3, image_root, tmp_path,
                                                                                 daemon_factory):
    import numpy as np
    from conftest import small_config
    from test_daemon import collect

    shutil.copytree(image_root, tmp_path / "imgs")
    (tmp_path / "imgs" / "list.txt").write_text(_listed(image_root, tmp_path))
    s3.upload_tree(str(tmp_path / "imgs"), "inet-dlist")
    refs = []
    for name, lst, env in (("l", str(tmp_path / "imgs" / "list.txt"), None),
                           ("b", f"s3://{BUCKET}/inet-dlist/list.txt", s3.env())):
        (tmp_path / name).mkdir()
        cfg = small_config(tmp_path / name, None, dataset={"root": None, "file_list": lst})
        d = daemon_factory(cfg, env=env) if env else daemon_factory(cfg)
        refs.append(collect(cfg))
        assert d.stop() == 0
    ref, got = refs
    assert sorted(got) == sorted(ref) and len(ref) >= 6
    for k in ref:
        assert np.array_equal(got[k][0], ref[k][0]) and np.array_equal(got[k][1], ref[k][1]), k


def test_a_byte_cache_is_accepted_for_a_file_list_of_objects_and_refused_for_local_files(tmp_path):
    from prefetchd.core import config as C

    def load(file_list: str) -> C.Config:
        p = tmp_path / "c.yaml"
        p.write_text(f"dataset: {{file_list: '{file_list}', cache: {{dir: {tmp_path}/b, max_bytes: 1GiB}}}}\n")
        return C.load(str(p))

    assert load("s3://b/lists/train.txt").dataset.cache["max_bytes"] == 1 << 30
    (tmp_path / "urls.txt").write_text("# path label\ns3://b/x/a.jpg 0\n")
    assert load(str(tmp_path / "urls.txt")).dataset.cache["max_bytes"] == 1 << 30
    (tmp_path / "files.txt").write_text("x/a.jpg 0\n")
    with pytest.raises(C.ConfigError, match="not a bucket URL: remove dataset.cache"):
        load(str(tmp_path / "files.txt"))


def test_the_wrong_object_as_the_devkit_or_the_devkit_as_the_root_is_one_line_and_nothing_large_read(
        s3, s3_env, inet, uploaded, proxy, tmp_path, monkeypatch):
    from prefetchd.sources import devkit

    val = f"{uploaded}/ILSVRC2012_img_val.tar"
    monkeypatch.setattr(devkit, "_MAX_BYTES", 4096, raising=False)  # the train tar (147 GB) as the devkit: here a few KB
    before = len(proxy.log)
    said = _error(val, tmp_path, "validation.devkit", section="validation",
                  devkit=f"{uploaded}/ILSVRC2012_img_train.tar")
    assert "bytes, not ImageNet's devkit (2.5 MB): give ILSVRC2012_devkit_t12.tar.gz" in said, said
    assert not [e for e in proxy.log[before:] if e[0] == "GET" and e[1].endswith("ILSVRC2012_img_train.tar")]
    with open(inet.devkit_tgz, "rb") as f:  # a folder holding the devkit's archive, not the devkit extracted
        s3.put("inet-dk/ILSVRC2012_devkit_t12.tar.gz", f.read())
    said = _error(val, tmp_path, "validation.devkit", section="validation", devkit=f"s3://{BUCKET}/inet-dk/")
    assert f"set validation.devkit to s3://{BUCKET}/inet-dk/ILSVRC2012_devkit_t12.tar.gz" in said, said
    said = _error(val, tmp_path, "validation.devkit", section="validation", devkit=f"s3://{BUCKET}/no-devkit/")
    assert "lists no objects" in said, said
    said = _error(f"{uploaded}/ILSVRC2012_devkit_t12.tar.gz", tmp_path)
    assert "is ImageNet's devkit, which holds no images" in said, said


def test_class_tars_are_indexed_several_at_once_in_label_order(s3, s3_env, inet, uploaded, tmp_path, monkeypatch):
    local, _ = load_index(inet.train_tars, None, EXTS, str(tmp_path / "local"))
    p = FaultProxy(s3.port, latency_s=0.02)  # each GET waits: the class tars' GETs overlap
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", p.endpoint)
        objectstore._STORES.clear()
        for url in (f"{uploaded}/train_tars", f"{uploaded}/ILSVRC2012_img_train.tar"):
            p.max_in_flight = 0
            index, _ = load_index(url, None, EXTS, str(tmp_path / "cache"), layout="imagenet_tars")
            assert p.max_in_flight >= 3, (url, p.max_in_flight)  # 4 class tars, up to 8 at once
            assert index.fingerprint == local.fingerprint
    finally:
        p.stop()


def test_the_train_tar_left_beside_its_class_tars_is_refused_before_it_is_read(s3, s3_env, inet, tmp_path, proxy):
    s3.upload_tree(inet.train_tars, "inet-beside")
    with open(inet.train_tar, "rb") as f:
        s3.put("inet-beside/ILSVRC2012_img_train.tar", f.read())
    before = len(proxy.log)
    said = _error(f"s3://{BUCKET}/inet-beside", tmp_path, layout="imagenet_tars")
    assert "1 of its 5 tars are not class tars: ILSVRC2012_img_train.tar (named as one of ImageNet's" in said, said
    assert not [e for e in proxy.log[before:] if e[0] == "GET" and "ILSVRC2012_img_train.tar" in e[1]]


def test_the_daemon_reads_imagenet_and_a_file_list_from_the_bucket_with_the_storage_options_alone(
        s3, inet, uploaded, image_root, tmp_path, daemon_factory, monkeypatch):
    """The train tar, the validation tar and its devkit in the bucket, nothing in the environment:
    the validation labels are the devkit's; then a file list in the bucket, read by the workers with
    the config's keys (their client was made for dataset.root and validation.root only)."""
    import numpy as np
    from conftest import small_config
    from prefetchd_client import PrefetchClient
    from s3fixture import ACCESS_KEY

    for k in s3.env():
        monkeypatch.delenv(k, raising=False)
    objectstore._STORES.clear()
    options = {"access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY, "endpoint": s3.endpoint,
               "region": "us-east-1"}
    (tmp_path / "a").mkdir()
    cfg = small_config(tmp_path / "a", f"{uploaded}/ILSVRC2012_img_train.tar", workers={"count": 1},
                       dataset={"storage_options": options},
                       validation={"enabled": True, "root": f"{uploaded}/ILSVRC2012_img_val.tar", "batch_size": 4,
                                   "devkit": f"{uploaded}/ILSVRC2012_devkit_t12.tar.gz"})
    d = daemon_factory(cfg)
    with PrefetchClient(cfg, split="val", timeout=60, as_numpy=True) as v:
        labels = np.concatenate([y.copy() for _, y in v])
    assert d.stop() == 0
    want = sorted(inet.wnids.index(w) for w in inet.val_wnid.values())
    assert sorted(labels.tolist()) == want and "quarantined" not in d.log()
    shutil.copytree(image_root, tmp_path / "imgs")
    (tmp_path / "imgs" / "list.txt").write_text(_listed(image_root, tmp_path))
    s3.upload_tree(str(tmp_path / "imgs"), "inet-olist")
    (tmp_path / "b").mkdir()
    cfg = small_config(tmp_path / "b", None, workers={"count": 1},
                       dataset={"root": None, "file_list": f"s3://{BUCKET}/inet-olist/list.txt",
                                "storage_options": options})
    d = daemon_factory(cfg)
    with PrefetchClient(cfg, timeout=60, as_numpy=True) as c:
        c.set_epoch(0)
        got = sum(len(y) for _, y in c)
    assert d.stop() == 0
    assert got == 24 and "quarantined" not in d.log() and "unreadable" not in d.log(), d.log()[-2000:]


def test_a_prefix_of_numbered_tars_of_images_alone_is_refused_as_a_local_folder_of_them(s3, s3_env, inet,
                                                                                        tmp_path):
    """Unlabelled shards or class tars? Read as class tars, each shard's number would be its label."""
    names = sorted(os.listdir(inet.val_folder))
    for k in range(3):
        members = [(n, open(os.path.join(inet.val_folder, n), "rb").read()) for n in names[3 * k:3 * k + 3]]
        data = tar_bytes([(f"img{3 * k + j}.jpg", d) for j, (_, d) in enumerate(members)])
        (tmp_path / "local").mkdir(exist_ok=True)
        (tmp_path / "local" / f"{k:06d}.tar").write_bytes(data)
        s3.put(f"inet-numbered/{k:06d}.tar", data)
    local = _error(str(tmp_path / "local"), tmp_path)
    said = _error(f"s3://{BUCKET}/inet-numbered", tmp_path)
    assert "holds numbered tars of images alone (000000.tar ... 000002.tar)" in said and said.split(": ", 1)[1] == \
        local.split(": ", 1)[1].replace(str(tmp_path / "local"), f"s3://{BUCKET}/inet-numbered"), (said, local)


def test_a_second_pass_over_the_train_tar_reads_the_node_local_cache_and_asks_the_bucket_nothing(
        s3_env, inet, uploaded, proxy, tmp_path):
    from prefetchd.sources import bytecache

    try:
        index, _ = load_index(f"{uploaded}/ILSVRC2012_img_train.tar", None, EXTS, str(tmp_path / "idx"),
                              cache={"dir": str(tmp_path / "bytes"), "max_bytes": 1 << 30})
        first = [index.read(i) for i in range(len(index))]
        before = proxy.requests
        assert [index.read(i) for i in range(len(index))] == first and proxy.requests == before
        assert bytecache.current().stats["hits"] == len(index)
    finally:
        bytecache.configure(None)


def test_check_on_a_file_list_in_the_bucket_probes_its_folder(s3, image_root, tmp_path):
    import subprocess
    import sys

    from conftest import small_config

    shutil.copytree(image_root, tmp_path / "imgs")
    (tmp_path / "imgs" / "list.txt").write_text(_listed(image_root, tmp_path))
    s3.upload_tree(str(tmp_path / "imgs"), "inet-clist")
    cfg = small_config(tmp_path, None, dataset={"root": None, "file_list": f"s3://{BUCKET}/inet-clist/list.txt"})
    r = subprocess.run([sys.executable, "-m", "prefetchd", "check", "--config", cfg], capture_output=True, text=True,
                       timeout=120, env={**os.environ, **s3.env()})
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"storage: s3://{BUCKET}/inet-clist as access key ...") and r.returncode == 0, r
    assert lines[1].startswith("list: ok") and lines[2].startswith("read: ok"), r.stdout
    assert "24 samples, 4 classes" in r.stdout and "a file list in a bucket" in r.stdout, r.stdout


def test_a_tar_of_images_alone_as_the_root_says_how_to_read_it_as_a_shard(s3, s3_env, tmp_path):
    """One .tar object of images alone (an unlabelled WebDataset shard) was read as shards from a
    bucket until ImageNet's tars were; now, as on a disk, it is a flat set of images, refused with
    advice for ImageNet only: the line did not say that dataset.layout: webdataset reads it."""
    import io
    import tarfile

    import numpy as np
    from imagenet_archives import jpeg_bytes, photo_like

    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for i in range(4):
            data = jpeg_bytes(photo_like(rng, 40, 40), rng)
            info = tarfile.TarInfo(f"s{i:04d}.jpg")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    s3.put("solo/shard-000000.tar", buf.getvalue())
    local = tmp_path / "shard-000000.tar"
    local.write_bytes(buf.getvalue())
    for root in (str(local), f"s3://{BUCKET}/solo/shard-000000.tar"):
        with pytest.raises(DatasetError) as e:
            load_index(root, None, EXTS, str(tmp_path / "cache"), label="none")
        assert "set dataset.layout: webdataset (dataset.label: none)" in str(e.value), str(e.value)
        index, _ = load_index(root, None, EXTS, str(tmp_path / "cache"), label="none", layout="webdataset")
        assert len(index) == 4


def test_an_image_deleted_from_a_bucket_imagefolder_is_its_samples_fault_not_a_wait_for_none(bucket, image_root,
                                                                                              tmp_path):
    # obstore raises a GET's 404 as the builtin FileNotFoundError, with no errno: the read was taken for the
    # bucket's outage, and the batch waited for good, saying "the dataset root ... cannot be read now (None)"
    import obstore

    from prefetchd.executors.storage import SampleUnreadable, StorageUnavailable, read_sample

    server, scheme = bucket
    (tmp_path / "if").mkdir()
    for cls in sorted(os.listdir(image_root))[:2]:
        shutil.copytree(os.path.join(image_root, cls), tmp_path / "if" / cls)
    for dirpath, _, files in os.walk(tmp_path / "if"):
        for f in files:
            with open(os.path.join(dirpath, f), "rb") as fh:
                server.put(f"gone-if/{os.path.relpath(os.path.join(dirpath, f), tmp_path / 'if')}", fh.read())
    index, _ = load_index(f"{scheme}://{BUCKET}/gone-if", None, EXTS, str(tmp_path / "c"))
    client = objectstore.store_for(index.root).client()
    obstore.delete(client, f"gone-if/{index.relpath(1)}")
    with pytest.raises(SampleUnreadable) as e:
        read_sample(lambda: index.read(1), index.refusal_root, sleep=lambda s: None)
    assert "404" in e.value.strerror or "not found" in e.value.strerror.lower(), e.value.strerror
    assert read_sample(lambda: index.read(0), index.refusal_root)
    for i in range(len(index)):  # the prefix emptied: the root gone, as a local folder removed, waits
        if i != 1:
            obstore.delete(client, f"gone-if/{index.relpath(i)}")
    with pytest.raises(StorageUnavailable, match=r"cannot be read now \(not found \(404\)\)"):
        read_sample(lambda: index.read(0), index.refusal_root, sleep=lambda s: None)


def test_a_file_lists_folder_listing_that_finds_the_endpoint_gone_starts_no_other_folders(s3, s3_env, proxy,
                                                                                          monkeypatch, tmp_path):
    # the folders' listings were 8 threads of a pool left to run to its end: one that gave up after a whole
    # retry episode (the endpoint gone) freed its thread for the next folder's, which began an episode of its
    # own: a list of 64 folders said "did not answer" after 8 episodes (16 minutes), not one
    names = [f"f{k:02d}/x.jpg" for k in range(20)]
    for n in names:
        s3.put(f"flist-gone/{n}", b"x")
    s3.put("flist-gone/list.txt", "".join(f"{n} 0\n" for n in names).encode())
    monkeypatch.setattr(objectstore, "_RETRY_TIMEOUT_S", 1.0)
    proxy.outage(600.0, after_requests=proxy.requests + 2)  # the list is read, then nothing answers
    with pytest.raises(DatasetError, match="did not answer") as e:
        load_index(None, f"s3://{BUCKET}/flist-gone/list.txt", EXTS, str(tmp_path / "cache"))
    assert "\n" not in str(e.value) and str(e.value).startswith("dataset.file_list "), e.value
    asked = {unquote(p).split("prefix=")[1].split("&")[0] for p in proxy.refused if "prefix=" in p}
    assert 0 < len(asked) <= 8, sorted(asked)


def test_an_imagefolder_at_a_buckets_top_emptied_mid_run_waits_as_a_root_gone(s3, s3_env, image_root, tmp_path):
    # an emptied prefix is the root gone (a HEAD of it answers 404); at a bucket's top the HEAD of no key
    # asked the bucket, which answered: every image's 404 was then its own, each sample blamed in turn
    import obstore

    from prefetchd.executors.storage import StorageUnavailable, read_sample

    s3.make_bucket("top-emptied")
    names = [f"{cls}/{sorted(os.listdir(os.path.join(image_root, cls)))[0]}" for cls in sorted(os.listdir(image_root))[:2]]
    for n in names:
        with open(os.path.join(image_root, n), "rb") as f:
            s3.put(n, f.read(), "top-emptied")
    obstore.delete(s3.store("top-emptied"), ".prefetchd-probe")
    index, _ = load_index("s3://top-emptied", None, EXTS, str(tmp_path / "c"))
    for n in names:
        obstore.delete(s3.store("top-emptied"), n)
    with pytest.raises(StorageUnavailable, match=r"the dataset root s3://top-emptied cannot be read now"):
        read_sample(lambda: index.read(0), index.refusal_root, sleep=lambda s: None)
