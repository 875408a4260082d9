"""ImageNet's tars in a bucket as users' buckets break them (docs/object-storage.md), against the real
S3 server (SeaweedFS, tests/s3fixture.py) and the local path as the reference: a key that expires
while the tars are indexed, a devkit given as its extracted ``data/`` folder, ImageNet's download
folder given as the root, a file list rewritten before a reload, a full or unwritable index cache,
an endpoint gone while the class tars are indexed. Each test here failed before its fix, but one:
generated tars (GNU, PAX, long and non-UTF-8 names, links, padding, cut short) read in chunks of
a few hundred bytes index as the local tars do, which held, kept so that the chunked reader stays the local one's equal."""

from __future__ import annotations

import io
import os
import random
import subprocess
import sys
import tarfile
import textwrap

import pytest
from imagenet_archives import make_imagenet
from s3fixture import BUCKET

pytest.importorskip("obstore", reason="the s3 extra (obstore) is not installed")

from prefetchd.sources import objectstore  # noqa: E402
from prefetchd.sources.base import DatasetError  # noqa: E402
from prefetchd.sources.dataset import load_index  # noqa: E402

EXTS = (".jpeg", ".jpg", ".png")
P = "inet-contact"  # this file's prefix in the session's bucket


@pytest.fixture(scope="module")
def inet(tmp_path_factory):
    return make_imagenet(str(tmp_path_factory.mktemp("inet-contact")), classes=3, per_class=4, val=5, seed=11)


@pytest.fixture(scope="module")
def uploaded(s3, inet) -> str:
    return s3.upload_imagenet(inet, P)


@pytest.fixture
def proxy(s3_env, s3_proxy):
    return s3_proxy


def test_a_key_that_expires_while_the_tars_are_indexed_is_one_line_saying_to_renew_it(inet, uploaded, proxy,
                                                                                        tmp_path):
    # a session token expiring mid-index answers 403 ExpiredToken to every request from then on; the
    # user saw obstore's text: "The operation lacked the necessary privileges ... Error performing GET
    # http://.../ILSVRC2012_img_train.tar in 348µs - Server returned non-2xx status code: 403 Forbidden:
    # <Error><Code>ExpiredToken</Code>...", with nothing to do
    forms = [(f"{uploaded}/ILSVRC2012_img_train.tar", None), (f"{uploaded}/train_tars", None),
             (f"{uploaded}/ILSVRC2012_img_val.tar", f"{uploaded}/ILSVRC2012_devkit_t12.tar.gz"),
             (f"{uploaded}/ILSVRC2012_img_val.tar", f"{uploaded}/devkit")]
    keys, expired = set(), 0
    for n, (url, devkit) in enumerate(forms):
        for after in range(1, 8):  # the listing, a HEAD, the headers' GETs, the devkit's: each in turn
            proxy.faults(n403=1000, after_requests=proxy.requests + after)
            section = "validation" if devkit else "dataset"
            try:
                load_index(url, None, EXTS, str(tmp_path / f"{n}-{after}"), devkit=devkit, section=section,
                           layout="imagenet_tars")
                said = ""  # indexed before the key expired
            except DatasetError as e:
                said = str(e)
            proxy.faults()
            if not said:
                continue
            # a HEAD's 403 has no body to tell an expired token from a wrong key: both say what to check
            assert "\n" not in said and ("expired (403 ExpiredToken): renew them" in said or
                                         "access denied (403): check the key pair" in said), said
            assert "Error performing" not in said and "<Error>" not in said, said
            keys.add(said.split(" ", 1)[0])
            expired += "ExpiredToken" in said
    assert expired > len(forms), expired  # the GETs' answers say so
    assert keys == {"dataset.root", "validation.root", "validation.devkit"}, keys


def test_the_devkits_data_folder_in_a_bucket_labels_as_the_local_one_and_a_change_to_it_shows(
        s3, s3_env, inet, uploaded, tmp_path):
    # a local devkit may be given as its extracted data/ folder; the same prefix in the bucket said
    # "has no data/meta.mat or data/ILSVRC2012_validation_ground_truth.txt", and its cache stamp held
    # neither file, so a ground truth rewritten there was not seen
    data = os.path.join(inet.devkit_folder, "ILSVRC2012_devkit_t12", "data")
    local, _ = load_index(inet.val_tar, None, EXTS, str(tmp_path / "local"), devkit=data, section="validation")
    s3.upload_tree(data, f"{P}/dk-data/data")
    url = f"s3://{BUCKET}/{P}/dk-data/data"
    index, cached = load_index(f"{uploaded}/ILSVRC2012_img_val.tar", None, EXTS, str(tmp_path / "b"), devkit=url,
                               section="validation")
    assert not cached and index.classes == local.classes and index.fingerprint == local.fingerprint
    assert list(index.labels) == list(local.labels)
    with open(os.path.join(data, "ILSVRC2012_validation_ground_truth.txt"), "rb") as f:
        truth = f.read().split()
    s3.put(f"{P}/dk-data/data/ILSVRC2012_validation_ground_truth.txt", b"\n".join(truth[::-1]) + b"\n")
    again, cached = load_index(f"{uploaded}/ILSVRC2012_img_val.tar", None, EXTS, str(tmp_path / "b"), devkit=url,
                               section="validation")
    assert not cached and list(again.labels) != list(index.labels)


def test_imagenets_download_folder_with_its_tars_extracted_beside_them_says_to_set_the_train_tar(
        s3, s3_env, inet, tmp_path):
    # the folder above the one meant: the download folder, the class tars and the devkit extracted into
    # folders beside the tars; it said "holds class tars (ILSVRC2012_img_train.tar ...) and folders
    # (devkit, train_tars) ...: move the folders out, or set dataset.layout: imagefolder", which reads
    # no image (with the validation tar alone beside the folders too: "class tars (ILSVRC2012_img_val.tar ...)")
    for name, tars in (("all", (inet.train_tar, inet.val_tar)), ("val", (inet.val_tar,))):
        for path in (*tars, inet.devkit_tgz):
            with open(path, "rb") as f:
                s3.put(f"{P}/dl-{name}/{os.path.basename(path)}", f.read())
        s3.upload_tree(inet.train_tars, f"{P}/dl-{name}/train_tars")
        s3.upload_tree(inet.devkit_folder, f"{P}/dl-{name}/devkit")
        with pytest.raises(DatasetError) as e:
            load_index(f"s3://{BUCKET}/{P}/dl-{name}", None, EXTS, str(tmp_path / name))
        said = str(e.value)
        assert "\n" not in said and "looks like ImageNet's download folder" in said, said
        assert "set dataset.root to the train tar (ILSVRC2012_img_train.tar)" in said, said


def test_a_reload_sees_a_file_list_rewritten_in_the_bucket_or_on_the_disk(s3, s3_env, image_root, tmp_path):
    # a reload (SIGHUP) asks the index cache's stamps; a file list of objects had none, so lines added
    # to the list (in the bucket, or a local list of URLs) were "unchanged, N samples (the index
    # cache's stamps hold: not scanned again)"
    from prefetchd.daemon.rescan import _verdict
    from prefetchd.sources.dataset import unchanged_since_scan

    names = sorted(os.listdir(os.path.join(image_root, sorted(os.listdir(image_root))[0])))[:3]
    cls = sorted(os.listdir(image_root))[0]
    for n in names:
        with open(os.path.join(image_root, cls, n), "rb") as f:
            s3.put(f"{P}/list/{cls}/{n}", f.read())
    lines = [f"{cls}/{n} {k % 2}\n" for k, n in enumerate(names)]
    s3.put(f"{P}/list/train.txt", "".join(lines[:2]).encode())
    local = tmp_path / "urls.txt"
    local.write_text("".join(f"s3://{BUCKET}/{P}/list/{line}" for line in lines[:2]))
    for n, (list_path, rewrite) in enumerate((
            (f"s3://{BUCKET}/{P}/list/train.txt", lambda: s3.put(f"{P}/list/train.txt", "".join(lines).encode())),
            (str(local), lambda: local.write_text(local.read_text() + f"s3://{BUCKET}/{P}/list/{lines[2]}")))):
        index, _ = load_index(None, list_path, EXTS, str(tmp_path / f"c{n}"))
        assert len(index) == 2 and unchanged_since_scan(index.files_dir, index.fingerprint)
        rewrite()
        assert not unchanged_since_scan(index.files_dir, index.fingerprint), list_path
        rescan = load_index(None, list_path, EXTS, str(tmp_path / f"c{n}"), use_cache=False)[0]
        _, said = _verdict(index, lambda i=index: unchanged_since_scan(i.files_dir, i.fingerprint),
                           lambda r=rescan: r)
        assert "1 samples added" in said, said


def test_a_key_that_expires_mid_run_blames_no_sample_and_the_batch_waits_saying_why(inet, uploaded, proxy,
                                                                                      tmp_path):
    # a sample's read answered 403 was the sample's fault (SampleUnreadable: replaced, quarantined), so a
    # session token expiring mid-run had every sample replaced in turn and the log said "16 replacements
    # for sample 9 could not be decoded either; is the dataset readable?"
    from prefetchd.executors.storage import StorageUnavailable, read_sample

    for url in (f"{uploaded}/ILSVRC2012_img_train.tar", f"{uploaded}/train_tars"):
        index, _ = load_index(url, None, EXTS, str(tmp_path / url.rsplit("/", 1)[1]))
        assert read_sample(lambda i=index: i.read(0), index.root)  # readable before the key expires
        proxy.faults(n403=1000)
        with pytest.raises(StorageUnavailable) as e:
            read_sample(lambda i=index: i.read(1), index.root, sleep=lambda s: None)
        proxy.faults()
        said = str(e.value)
        assert "\n" not in said and f"the dataset root {index.root} cannot be read now" in said, said
        assert "expired (403 ExpiredToken): renew them" in said, said
        # one 403, and the bucket lists: read once more (an ACL mended between the read, perhaps a read-ahead's
        # seconds before, and the look at the root had the sample quarantined for good); a 403 that stays is the
        # sample's fault (the next test)
        proxy.faults(n403=1)
        assert read_sample(lambda i=index: i.read(2), index.root, sleep=lambda s: None) == index.read(2)


def test_a_root_that_is_one_object_refused_by_its_acl_is_the_roots_refusal_not_each_samples(inet, uploaded, proxy,
                                                                                             tmp_path):
    # the check of a sample's 403 asked with a listing, which a bucket still answers when only the train
    # tar's ACL refuses it: every sample was then blamed in turn (quarantined, replaced by others that
    # failed the same way), though none of them could be read. A root of one object is asked with a HEAD.
    from prefetchd.executors.storage import SampleUnreadable, StorageUnavailable, read_sample

    tar = f"{uploaded}/ILSVRC2012_img_train.tar"
    index, _ = load_index(tar, None, EXTS, str(tmp_path / "one"))
    assert index.refusal_root == tar  # what a worker asks (its archives are ("",): the root itself), not "tar/"
    with proxy.denying("/ILSVRC2012_img_train.tar"):
        with pytest.raises(StorageUnavailable) as e:
            read_sample(lambda: index.read(1), index.refusal_root, sleep=lambda s: None)
    said = str(e.value)
    assert "\n" not in said and f"the dataset root {tar} cannot be read now (access denied (403)" in said, said
    assert read_sample(lambda: index.read(1), index.refusal_root)  # the ACL mended: read again, nothing quarantined
    # a prefix of class tars, one refused: the samples in it are theirs to blame, as files a local
    # folder cannot open (the others are read)
    prefix = load_index(f"{uploaded}/train_tars", None, EXTS, str(tmp_path / "prefix"))[0]
    first = prefix.read(0)
    with proxy.denying(".tar"):
        with pytest.raises(SampleUnreadable):
            read_sample(lambda: prefix.read(len(prefix) - 1), prefix.refusal_root, sleep=lambda s: None)
    assert read_sample(lambda: prefix.read(0), prefix.refusal_root) == first


def test_a_full_disk_under_the_index_cache_is_one_line_saying_so_not_a_truncated_tar(s3_env, uploaded, tmp_path):
    # the class tars' chunks are kept in dataset.cache_dir/tmp while they are indexed; on a full disk
    # the write was short and unchecked, so the read back was short: "s3://.../n06126983.tar is
    # truncated: it ends inside the header after member ... (download it again)", of a whole object.
    # The file size limit (RLIMIT_FSIZE, in a child) makes the same short write as a full disk.
    urls = [f"{uploaded}/train_tars", f"{uploaded}/ILSVRC2012_img_train.tar"]
    code = textwrap.dedent(f"""
        import resource, signal
        from prefetchd.sources.dataset import load_index
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit: EFBIG, not killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 10, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        for url in {urls!r}:
            try:
                load_index(url, None, {EXTS!r}, {str(tmp_path / "cache")!r}, use_cache=False, layout="imagenet_tars")
                print("indexed", url)
            except Exception as e:
                print(type(e).__name__, e)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == 2, r
    for line in lines:
        assert line.startswith("DatasetError indexing s3://") and "truncated" not in line, line
        assert f"cannot be kept in {tmp_path / 'cache' / 'tmp'}" in line, line
        assert "free space there or set dataset.cache_dir to a disk with room" in line, line


def test_an_index_cache_that_cannot_be_written_is_one_line_naming_dataset_cache_dir(s3_env, uploaded, tmp_path):
    # a local root indexes with an unwritable dataset.cache_dir (a warning, the next start scans again);
    # a bucket's tars need its tmp for their chunks: a raw "OSError: [Errno 20] Not a directory" (from
    # the layout's probe or the scan), or on a read-only disk "dataset.root s3://... cannot be read
    # (.../tmp/.shard-x): Read-only file system", blaming the bucket
    (tmp_path / "a-file").write_text("")
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "tmp").write_text("")  # its tmp a file: made by hand, or another tool's
    for cache in (tmp_path / "a-file" / "cache", tmp_path / "cache"):
        for url, layout in ((f"{uploaded}/train_tars", "auto"), (f"{uploaded}/ILSVRC2012_img_train.tar", "auto"),
                            (f"{uploaded}/train_tars", "imagenet_tars")):
            with pytest.raises(DatasetError) as e:
                load_index(url, None, EXTS, str(cache), layout=layout)
            said = str(e.value)
            assert "\n" not in said and said.startswith(f"dataset.cache_dir: the temporary files of an index of "
                                                         f"tars in a bucket cannot be made in {cache / 'tmp'}"), said
            assert "set dataset.cache_dir to a folder this user can write" in said, said


# --- the bucket's reader of tar headers (chunks of a few hundred bytes) against the local reader -------


def _class_tar(r: random.Random, jpegs: list[bytes]) -> bytes:
    """A class tar as tools write them: GNU or PAX, long and odd names (non-UTF-8 too), links,
    folders, sub-folders, PAX records of any length, empty, padded past its end blocks."""
    fmt = r.choice([tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt, encoding="utf-8", errors="surrogateescape") as tf:
        for k in range(r.randint(0, 5)):
            kind = r.choice(["plain"] * 4 + ["long", "dir", "sym", "hard", "odd", "sub", "big"])
            name = {"long": "L" * r.randint(90, 300) + ".JPEG", "sub": f"sub/d{k}.JPEG",
                    "odd": r.choice(["a b.JPEG", "-x.jpg", "caf\u00e9.JPEG", "._a.JPEG", ".h.jpg",
                                     b"\xff_x.JPEG".decode("utf-8", "surrogateescape")])}.get(kind, f"i{k}.JPEG")
            ti = tarfile.TarInfo(name)
            if kind in ("dir", "sym", "hard"):
                ti.type = {"dir": tarfile.DIRTYPE, "sym": tarfile.SYMTYPE, "hard": tarfile.LNKTYPE}[kind]
                ti.linkname = "i0.JPEG" if kind != "dir" else ""
                tf.addfile(ti)
                continue
            data = r.choice(jpegs) * (r.randint(3, 6) if kind == "big" else 1)
            if fmt == tarfile.PAX_FORMAT and r.random() < 0.3:
                ti.pax_headers = {"comment": "x" * r.randint(0, 3000)}
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue() + b"\0" * 512 * (r.randint(1, 25) if r.random() < 0.2 else 0)


def _outcome(root: str, cache: str):
    try:
        index, _ = load_index(root, None, EXTS, cache, layout="imagenet_tars", use_cache=False)
    except DatasetError as e:
        return "refused", str(e).replace(root, "ROOT")
    return (index.classes, index.fingerprint, list(index.labels), index.skipped and len(index.skipped),
            [index.read(i) for i in range(len(index))])


def test_generated_train_and_class_tars_index_in_a_bucket_as_on_a_disk_in_small_chunks(s3, s3_env, inet, tmp_path,
                                                                                       monkeypatch):
    from prefetchd.sources import bucketimagenet

    monkeypatch.setattr(bucketimagenet, "CHUNK", 700)  # every header, PAX record and name across chunks
    monkeypatch.setattr(bucketimagenet, "TOP_CHUNK", 300)
    with tarfile.open(inet.val_tar) as tf:
        jpegs = [tf.extractfile(m).read() for m in tf.getmembers()[:3]]
    for seed in range(10):
        r = random.Random(seed)
        inner = [(f"n{w:08d}.tar", _class_tar(r, jpegs)) for w in sorted(r.sample(range(100), r.randint(1, 4)))]
        r.shuffle(inner)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=r.choice([tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])) as tf:
            for name, data in inner:
                ti = tarfile.TarInfo(name)
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))
        train = buf.getvalue()
        if seed % 3 == 2:  # cut short exactly after its last member's data: no end-of-archive blocks
            with tarfile.open(fileobj=io.BytesIO(train)) as tf:
                last = tf.getmembers()[-1]
            train = train[:last.offset_data + -(-last.size // 512) * 512]
        folder = tmp_path / str(seed)
        (folder / "tars").mkdir(parents=True)
        (folder / "ILSVRC2012_img_train.tar").write_bytes(train)
        s3.put(f"{P}/gen/{seed}/ILSVRC2012_img_train.tar", train)
        for name, data in inner:
            (folder / "tars" / name).write_bytes(data)
            s3.put(f"{P}/gen/{seed}/tars/{name}", data)
        for local, url in ((folder / "ILSVRC2012_img_train.tar", f"s3://{BUCKET}/{P}/gen/{seed}/ILSVRC2012_img_train.tar"),
                           (folder / "tars", f"s3://{BUCKET}/{P}/gen/{seed}/tars")):
            assert _outcome(url, str(folder / "b")) == _outcome(str(local), str(folder / "l")), (seed, url)


def test_an_endpoint_gone_while_class_tars_are_indexed_is_said_after_one_retry_episode(s3, proxy, tmp_path,
                                                                                        monkeypatch):
    """Eight class tars are walked ahead at once and a ninth waits for a thread. When the endpoint
    went away, the first walk ahead to give up (a whole retry episode) freed its thread for the
    ninth, which began an episode of its own, and the scan walked the first class tar again through
    another: exit 75 came after two episodes (four minutes), not one."""
    from prefetchd.sources.base import StorageUnavailable

    inet = make_imagenet(str(tmp_path / "inet"), classes=10, per_class=2, val=2, seed=4)
    s3.upload_tree(inet.train_tars, f"{P}/gone")
    monkeypatch.setattr(objectstore, "_RETRY_TIMEOUT_S", 1.0)
    objectstore._STORES.clear()
    proxy.outage(600.0, after_requests=proxy.requests + 2)  # the listing answers, then nothing
    with pytest.raises(StorageUnavailable, match="the bucket did not answer"):
        load_index(f"s3://{BUCKET}/{P}/gone", None, EXTS, str(tmp_path / "cache"), layout="imagenet_tars")
    ninth = sorted(os.listdir(inet.train_tars))[8]
    assert proxy.refused and not [p for p in proxy.refused if p.endswith("/" + ninth)], proxy.refused
