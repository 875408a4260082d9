"""ImageNet as downloaded, read in place: the train tar of class tars, a folder of class tars, the
flat validation tar (or folder) with the devkit; hostile members; the cache; the real daemon."""

from __future__ import annotations

import errno
import io
import logging
import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import replace

import numpy as np
import pytest
from conftest import small_config
from imagenet_archives import make_imagenet, tar_bytes

from prefetchd.core import config as C
from prefetchd.core.sampler import Sampler
from prefetchd.executors.storage import StorageUnavailable
from prefetchd.executors.worker import BatchMaker, WorkerSetup
from prefetchd.sources import archive, store
from prefetchd.sources import imagenet as imagenet_tars
from prefetchd.sources.archive import TarIndex
from prefetchd.sources.dataset import DatasetError, load_index, val_labels
from prefetchd.sources.devkit import loadmat, read_devkit
from prefetchd.tools.samples import jpeg_bytes, photo_like

EXTS = (".jpeg", ".jpg", ".png")


@pytest.fixture(scope="module")
def imagenet(tmp_path_factory):
    return make_imagenet(str(tmp_path_factory.mktemp("imagenet")), classes=5, per_class=7, val=13)


def _cfg(root: str, cache: str) -> C.Config:
    return C.from_dict({"dataset": {"root": root, "cache_dir": cache}, "loader": {"batch_size": 8, "seed": 5},
                        "augment": {"output_size": 32, "scale_min": 36, "scale_max": 60}})


def _epochs(index, cfg, buffer_dir: str) -> list[tuple[bytes, bytes]]:
    """Two epochs made in-process, as a worker makes them from the index's cache files."""
    maker = BatchMaker(WorkerSetup(cfg, index.files_dir, None, 0, buffer_dir))
    assert type(maker.index) is type(index)  # the worker opened the same kind of index from the cache
    s = Sampler(len(index), 8, 5, True, False, 1)
    out = []
    for e in (0, 1):
        for b in range(s.batches_per_epoch):
            images, used, labels, _, quarantined = maker.fill(e, s.batch_indices(e, 0, b))
            assert not quarantined
            out.append((images.tobytes(), labels.tobytes() + used.tobytes()))
    return out


def test_train_tar_epochs_equal_the_extracted_folder_byte_for_byte(imagenet, tmp_path):
    cache = str(tmp_path / "cache")
    folder, _ = load_index(imagenet.train_folder, None, EXTS, cache)
    reference = _epochs(folder, _cfg(imagenet.train_folder, cache), str(tmp_path))
    for root, layout in ((imagenet.train_tar, "tar"), (imagenet.train_tars, "tars")):
        index, cached = load_index(root, None, EXTS, cache)
        assert isinstance(index, TarIndex) and index.layout == layout and not cached
        assert index.classes == folder.classes == tuple(imagenet.wnids)
        assert [index.relpath(i) for i in range(len(index))] == [folder.relpath(i) for i in range(len(folder))]
        assert index.fingerprint == folder.fingerprint and index.labels.tolist() == folder.labels.tolist()
        for i in range(len(index)):  # one positioned read gives the file's bytes
            with open(folder.path(i), "rb") as f:
                assert index.read(i) == f.read()
        assert index.path(0).endswith(f"{index.classes[0]}.tar/{os.path.basename(folder.path(0))}")
        assert _epochs(index, _cfg(root, cache), str(tmp_path)) == reference


@pytest.mark.parametrize("val_root", ["val_tar", "val_folder"])
@pytest.mark.parametrize("devkit", ["devkit_tgz", "devkit_folder"])
def test_every_validation_image_gets_its_class_label(imagenet, tmp_path, val_root, devkit):
    train, _ = load_index(imagenet.train_tar, None, EXTS, str(tmp_path / "c"))
    val, _ = load_index(getattr(imagenet, val_root), None, EXTS, str(tmp_path / "c"), devkit=getattr(imagenet, devkit))
    val = val_labels(val, train)
    names = [os.path.basename(val.relpath(i)) for i in range(len(val))]
    assert names == sorted(imagenet.val_wnid)  # every image, in name order
    assert [train.classes[k] for k in val.labels.tolist()] == [imagenet.val_wnid[n] for n in names]
    for i, n in enumerate(names):
        with open(os.path.join(imagenet.val_folder, n), "rb") as f:
            assert val.read(i) == f.read()


def test_the_devkit_fixture_is_as_hard_as_the_real_one(imagenet):
    """IDs out of WNID order and inner synsets: a label of ID - 1 or of all synsets would be wrong."""
    with tarfile.open(imagenet.devkit_tgz) as tf:
        meta = loadmat(tf.extractfile("ILSVRC2012_devkit_t12/data/meta.mat").read())["synsets"]
    leaves = [(int(s["ILSVRC2012_ID"][0]), s["WNID"]) for s in meta if int(s["num_children"][0]) == 0]
    assert len(meta) > len(leaves) == 5
    assert [w for _, w in sorted(leaves)] != sorted(w for _, w in leaves)
    wnids, labels = read_devkit(imagenet.devkit_tgz)
    assert wnids == imagenet.wnids and len(labels) == 13


@pytest.mark.parametrize("compress", [False, True])
def test_mat_reader_reads_what_scipy_writes(tmp_path, compress):
    from scipy.io import savemat

    s = np.zeros((3, 1), dtype=[("id", "O"), ("name", "O"), ("kids", "O")])
    for k in range(3):
        s[k, 0] = (np.array([[k + 7]], np.uint16), f"n{k:08d}", np.array([[1.0, 2.0]]) if k else np.zeros((1, 0)))
    path = str(tmp_path / "m.mat")
    savemat(path, {"synsets": s, "grid": np.arange(6.0).reshape(2, 3), "cells": np.array(["ab", "cde"], dtype=object),
                   "txt": np.array(["abc", "xyz"])}, do_compression=compress)
    with open(path, "rb") as f:
        got = loadmat(f.read())
    assert [(int(x["id"][0]), x["name"], x["kids"].tolist()) for x in got["synsets"]] == [
        (7, "n00000000", []), (8, "n00000001", [1.0, 2.0]), (9, "n00000002", [1.0, 2.0])]
    assert got["grid"].tolist() == [0.0, 3.0, 1.0, 4.0, 2.0, 5.0]  # column-major, as MATLAB stores it
    assert got["cells"] == ["ab", "cde"] and got["txt"] == "abc\nxyz"


# --- hostile and unusual members -----------------------------------------------------------------------


def _block(info: tarfile.TarInfo, data: bytes = b"", fmt: int = tarfile.GNU_FORMAT) -> bytes:
    info.size = len(data)
    return info.tobuf(fmt, "utf-8", "surrogateescape") + data + bytes(-len(data) % 512)


def _member(name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE, fmt: int = tarfile.GNU_FORMAT, **kw) -> bytes:
    info = tarfile.TarInfo(name)
    info.type = kind
    for k, v in kw.items():
        setattr(info, k, v)
    return _block(info, data, fmt)


def _hostile_class_tar(jpeg: bytes, other: bytes) -> bytes:
    parts = [
        _member("a.JPEG", jpeg),
        _member("/abs.JPEG", jpeg),
        _member("../up.JPEG", jpeg),
        _member("x/../../up2.JPEG", jpeg),
        _member("link.JPEG", kind=tarfile.SYMTYPE, linkname="/etc/passwd"),
        _member("hard.JPEG", kind=tarfile.LNKTYPE, linkname="a.JPEG"),
        _member("dev.JPEG", kind=tarfile.CHRTYPE, devmajor=1, devminor=3),
        _member("fifo.JPEG", kind=tarfile.FIFOTYPE),
        _member("sparse.JPEG", jpeg, kind=tarfile.GNUTYPE_SPARSE),
        _member("dup.JPEG", other),
        _member("L" * 120 + ".JPEG", jpeg),  # a GNU long-name header, then the member: read by its long name
        _member("pax.JPEG", jpeg, fmt=tarfile.PAX_FORMAT, pax_headers={"comment": "x"}),  # a PAX header, then it
        tarfile.TarInfo._create_pax_generic_header({"comment": "global"}, tarfile.XGLTYPE, "utf-8"),
        _member("dup.JPEG", jpeg),
        # the PAX size record, not the header's 0, says where the data ends (and the next header starts)
        _member("psize.JPEG", other, fmt=tarfile.PAX_FORMAT, pax_headers={"size": str(len(other))}),
        # extension headers do not make a hostile member safe: it is judged by its full name and kind
        _member("ok1.JPEG", jpeg, fmt=tarfile.PAX_FORMAT, pax_headers={"path": "../pax-up.JPEG"}),
        _member("ok2.JPEG", jpeg, fmt=tarfile.PAX_FORMAT, pax_headers={"path": "/pax-abs.JPEG"}),
        _member("psparse.JPEG", jpeg, fmt=tarfile.PAX_FORMAT, pax_headers={
            "GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.name": "psparse.JPEG",
            "GNU.sparse.realsize": str(len(jpeg))}),
        _member("x/" + "y" * 110 + "/../../../evil.JPEG", jpeg),  # a GNU long name with '..'
        _member("l" * 120 + ".JPEG", kind=tarfile.SYMTYPE, linkname="/etc/" + "p" * 120),  # long name and link
        _member("z.JPEG", other),
    ]
    return b"".join(parts) + bytes(1024)


@pytest.mark.parametrize("packed", ["tar", "tars"])
def test_hostile_members_are_skipped_with_a_warning_and_never_read(tmp_path, caplog, packed):
    rng = np.random.default_rng(1)
    jpeg, other = (jpeg_bytes(photo_like(rng, 40, 30), rng) for _ in range(2))
    inner = _hostile_class_tar(jpeg, other)
    if packed == "tar":
        root = str(tmp_path / "train.tar")
        with open(root, "wb") as f:
            f.write(tar_bytes([("n1.tar", inner), ("/n0.tar", inner), ("../n2.tar", inner)]))
    else:
        root = str(tmp_path / "tars")
        os.makedirs(root)
        with open(os.path.join(root, "n1.tar"), "wb") as f:
            f.write(inner)
    with caplog.at_level(logging.WARNING, "prefetchd.dataset"):
        index, _ = load_index(root, None, EXTS, None, use_cache=False)
    assert index.classes == ("n1",)
    assert [index.relpath(i) for i in range(len(index))] == [
        "n1/" + "L" * 120 + ".JPEG", "n1/a.JPEG", "n1/dup.JPEG", "n1/pax.JPEG", "n1/psize.JPEG", "n1/z.JPEG"]
    # a duplicate: the last copy, as tar x would; offsets exact after every extension header
    assert [index.read(i) for i in range(len(index))] == [jpeg, jpeg, jpeg, jpeg, other, other]
    text = caplog.text
    for name, why in [("/abs.JPEG", "an absolute path"), ("../up.JPEG", "a '..' component"), ("x/../../up2.JPEG", "a '..' component"),
                      ("link.JPEG", "a symbolic link"), ("hard.JPEG", "a hard link"), ("dev.JPEG", "a character device"),
                      ("fifo.JPEG", "a FIFO"), ("sparse.JPEG", "a GNU sparse file"), ("dup.JPEG", "a duplicate name"),
                      ("PaxHeader", "a PAX global header"), ("../pax-up.JPEG", "a '..' component"),
                      ("/pax-abs.JPEG", "an absolute path"), ("psparse.JPEG", "a PAX sparse file"),
                      ("y" * 110 + "/../../../evil.JPEG", "a '..' component"), ("l" * 120 + ".JPEG", "a symbolic link")]:
        assert f"{name} ({why}" in text, (name, why, text)
    if packed == "tar":
        assert "/n0.tar (an absolute path)" in text and "../n2.tar (a '..' component)" in text


def _tar_of(folder: str, dest: str, fmt: int) -> None:
    """``folder``'s files in a tar written by Python's ``tarfile`` in ``fmt`` (PAX: its default),
    with an extended attribute on each file, as bsdtar and ``tar --xattrs`` record them."""
    with tarfile.open(dest, "w", format=fmt) as tf:
        for d, dirs, files in sorted(os.walk(folder)):
            dirs.sort()
            for f in sorted(files)[::-1]:  # not in name order
                info = tf.gettarinfo(os.path.join(d, f), os.path.relpath(os.path.join(d, f), folder))
                if fmt == tarfile.PAX_FORMAT:
                    info.pax_headers = {"SCHILY.xattr.user.origin": "camera", "mtime": "1700000000.25"}
                with open(os.path.join(d, f), "rb") as fh:
                    tf.addfile(info, fh)


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT], ids=["pax", "gnu"])
@pytest.mark.parametrize("packed", ["tar", "tars"])
def test_tars_with_pax_headers_and_gnu_long_names_index_as_their_extracted_folder(tmp_path, fmt, packed):
    """What users' tars hold: PAX headers (Python's default, tar --format=posix, bsdtar's xattrs)
    and GNU long names. Each is the next member's metadata: the tar indexes and reads every image
    exactly as the extracted folder does."""
    rng = np.random.default_rng(2)
    folder = tmp_path / "folder"
    names = ["plain.JPEG", "caf\u00e9-\u5199\u771f.JPEG", "a" * 150 + ".JPEG", "sub/" + "b" * 120 + "/deep.JPEG"]
    for cls in ("n01", "n02"):
        for k, name in enumerate(names):
            path = folder / cls / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(jpeg_bytes(photo_like(rng, 40 + k, 30), rng))
    tars = tmp_path / "tars"
    tars.mkdir()
    for cls in ("n01", "n02"):
        _tar_of(str(folder / cls), str(tars / f"{cls}.tar"), fmt)
    root = str(tars)
    if packed == "tar":
        root = str(tmp_path / "train.tar")
        _tar_of(str(tars), root, fmt)
    ref, _ = load_index(str(folder), None, EXTS, None, use_cache=False)
    index, _ = load_index(root, None, EXTS, None, use_cache=False)
    assert isinstance(index, TarIndex) and index.layout == packed and not index.skipped, index.skipped
    assert [index.relpath(i) for i in range(len(index))] == [ref.relpath(i) for i in range(len(ref))]
    assert len(index) == 8 and index.labels.tolist() == ref.labels.tolist() and index.fingerprint == ref.fingerprint
    assert [index.read(i) for i in range(len(index))] == [ref.read(i) for i in range(len(ref))]


def test_a_pax_global_header_that_sets_every_path_is_a_clear_error(tmp_path):
    rng = np.random.default_rng(3)
    inner = (tarfile.TarInfo._create_pax_generic_header({"path": "same.JPEG"}, tarfile.XGLTYPE, "utf-8")
             + _member("a.JPEG", jpeg_bytes(photo_like(rng, 40, 30), rng)) + bytes(1024))
    with pytest.raises(DatasetError, match=r"n1\.tar: the PAX global header at offset 0 sets path for every member"):
        load_index(_train_tar(tmp_path, inner), None, EXTS, None, use_cache=False)


def test_check_reports_the_skipped_members_also_from_the_cache(tmp_path):
    rng = np.random.default_rng(1)
    jpeg, other = (jpeg_bytes(photo_like(rng, 40, 30), rng) for _ in range(2))
    root = tmp_path / "tars"
    root.mkdir()
    (root / "n1.tar").write_bytes(_hostile_class_tar(jpeg, other))
    cfg = small_config(tmp_path, str(root), loader={"batch_size": 2})
    for how in ("scanned", "cached index"):  # the second check reads the cache the first one wrote
        r = subprocess.run([sys.executable, "-m", "prefetchd", "check", "--config", cfg], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0 and f"dataset: 6 samples, 1 class ({how} in" in r.stdout, (r.stdout, r.stderr)
        assert "archive members or folders not indexed (only regular members" in r.stdout, r.stdout
        assert f"  skipped {root / 'n1.tar'}: link.JPEG (a symbolic link)" in r.stdout, r.stdout
        assert "/abs.JPEG (an absolute path)" in r.stdout, r.stdout


def _train_tar(tmp_path, inner: bytes, name="n1.tar") -> str:
    path = str(tmp_path / "t.tar")
    with open(path, "wb") as f:
        f.write(tar_bytes([(name, inner)]))
    return path


def test_a_truncated_archive_is_an_error_naming_the_member(imagenet, tmp_path):
    data = open(imagenet.train_tar, "rb").read()
    for cut, words in ((len(data) // 2, r"member n\d+\.tar needs \d+ bytes .* truncated"),
                       (512 * ((len(data) // 2) // 512) + 100, "truncated|needs")):
        p = tmp_path / "cut.tar"
        p.write_bytes(data[:cut])
        with pytest.raises(DatasetError, match=words):
            load_index(str(p), None, EXTS, None, use_cache=False)


def test_a_member_larger_than_its_inner_tar_is_an_error_naming_it(tmp_path):
    good = _member("a.JPEG", b"x" * 600)
    liar = bytearray(_member("big.JPEG", b"y" * 10))
    liar[124:136] = b"%011o\0" % 10**6  # claims a megabyte inside a 2 KB class tar
    liar[148:156] = b"        "
    liar[148:156] = b"%06o\0 " % sum(liar[:512])
    with pytest.raises(DatasetError, match=r"t\.tar/n1\.tar: member big\.JPEG needs 1000000 bytes"):
        load_index(_train_tar(tmp_path, good + bytes(liar) + bytes(1024)), None, EXTS, None, use_cache=False)


def test_a_corrupt_header_or_compressed_archive_is_a_clear_error(tmp_path):
    inner = bytearray(_member("a.JPEG", b"x" * 600) + _member("b.JPEG", b"y") + bytes(1024))
    inner[1536 + 10] ^= 0xFF  # b.JPEG's header no longer checks out
    with pytest.raises(DatasetError, match=r"n1\.tar: no valid tar header at offset 1536 \(after member a\.JPEG\)"):
        load_index(_train_tar(tmp_path, bytes(inner)), None, EXTS, None, use_cache=False)
    gz = tmp_path / "train.tar.gz"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        tf.addfile(tarfile.TarInfo("n1.tar"), io.BytesIO())
    gz.write_bytes(buf.getvalue() + bytes(2048))
    with pytest.raises(DatasetError, match="not a directory .* nor an uncompressed tar archive.*gzip-compressed"):
        load_index(str(gz), None, EXTS, None, use_cache=False)


def test_an_archive_cut_or_replaced_after_indexing_makes_the_batch_wait_blaming_no_sample(imagenet, tmp_path):
    """Offsets hold for the file that was indexed only: another file (or a cut one) at the path is
    the storage's state, so the batch waits for it (StorageUnavailable) and no sample is quarantined."""
    root = str(tmp_path / "train.tar")
    shutil.copy(imagenet.train_tar, root)
    index, _ = load_index(root, None, EXTS, None, use_cache=False)
    original = open(root, "rb").read()
    last = int(np.argmax(index.block))
    maker = BatchMaker(WorkerSetup(_cfg(root, str(tmp_path)), None, index, 0, str(tmp_path)))
    maker.fill(0, np.array([0]))  # the archive is open in the worker from here on
    os.truncate(root, int(index.block[last]) * 512 + 5)
    with pytest.raises(StorageUnavailable, match="train.tar changed since it was indexed .*size"):
        maker.fill(0, np.array([last]))
    with open(root + ".new", "wb") as f:  # another file of the same size put in its place (as rsync does)
        f.write(original[::-1])
    os.replace(root + ".new", root)
    with pytest.raises(StorageUnavailable, match="changed since it was indexed"):
        maker.fill(0, np.array([1]))
    assert not maker.bad
    with open(root, "wb") as f:  # as it was: the batch is made, nothing was quarantined
        f.write(original)
    index = replace(index, identity=(store.identity_of(os.stat(root)),))  # (the test cannot restore inode, ctime)
    maker = BatchMaker(WorkerSetup(_cfg(root, str(tmp_path)), None, index, 0, str(tmp_path)))
    _, used, _, _, quarantined = maker.fill(0, np.array([last, 1]))
    assert not quarantined and used.tolist() == [last, 1]


def test_a_stale_archive_descriptor_is_dropped_and_the_read_tried_again(imagenet, tmp_path, monkeypatch):
    """A kept descriptor that went stale (an NFS remount) fails every read: the retry of a transient
    errno must open the archive again, not quarantine sample after sample through the dead one."""
    root = str(tmp_path / "train.tar")
    shutil.copy(imagenet.train_tar, root)
    index, _ = load_index(root, None, EXTS, None, use_cache=False)
    maker = BatchMaker(WorkerSetup(_cfg(root, str(tmp_path)), None, index, 0, str(tmp_path)))
    maker.fill(0, np.array([0]))
    dead = set(store.LOCAL._fds.values())
    assert dead
    real_pread, real_close = os.pread, os.close

    def pread(fd, n, off):
        if fd in dead:
            raise OSError(errno.ESTALE, os.strerror(errno.ESTALE))
        return real_pread(fd, n, off)

    def close(fd):  # closing the dead descriptor frees it; a new one under the same number is alive
        dead.discard(fd)
        real_close(fd)

    monkeypatch.setattr(os, "pread", pread)
    monkeypatch.setattr(os, "close", close)
    n = min(len(index), 8)
    _, used, _, replaced, quarantined = maker.fill(0, np.arange(n))
    assert not quarantined and used.tolist() == list(range(n)) and (replaced == -1).all()


def test_kept_archive_descriptors_are_evicted_least_recently_used_first(tmp_path, monkeypatch):
    paths = []
    for k in range(3):
        paths.append(str(tmp_path / f"{k}.tar"))
        open(paths[-1], "wb").close()
    monkeypatch.setattr(store.LOCAL, "max_open", 2)
    monkeypatch.setattr(store.LOCAL, "_fds", {})
    fd0 = archive._open(paths[0])
    archive._open(paths[1])
    assert archive._open(paths[0]) == fd0  # used again: now the most recent
    archive._open(paths[2])  # evicts paths[1], the least recently used
    assert list(store.LOCAL._fds) == [paths[0], paths[2]]
    for p in list(store.LOCAL._fds):
        store.LOCAL.forget(p)


def test_a_flat_tar_without_the_devkit_says_to_set_it(imagenet):
    with pytest.raises(DatasetError, match="validation.root .* set validation.devkit"):
        load_index(imagenet.val_tar, None, EXTS, None, use_cache=False, section="validation")


# --- the cache, check and the daemon ---------------------------------------------------------------------


def test_cache_is_keyed_by_the_archive_identity(imagenet, tmp_path):
    root, cache = str(tmp_path / "train.tar"), str(tmp_path / "cache")
    shutil.copy(imagenet.train_tar, root)
    i1, c1 = load_index(root, None, EXTS, cache)
    i2, c2 = load_index(root, None, EXTS, cache)
    assert (c1, c2) == (False, True) and isinstance(i2.block, np.memmap) and i2.scan_s == i1.scan_s
    assert i2.identity == i1.identity == (store.identity_of(os.stat(root)),)
    st = os.stat(root)
    os.utime(root, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert load_index(root, None, EXTS, cache)[1] is False  # a new mtime
    st = os.stat(root)
    shutil.copy(root, root + ".new")
    os.utime(root + ".new", ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(root + ".new", root)  # same size and mtime, another inode
    assert load_index(root, None, EXTS, cache)[1] is False
    assert load_index(root, None, EXTS, cache)[1] is True


def test_check_reports_the_archive_classes_samples_and_scan_time(imagenet, tmp_path):
    cfg = small_config(tmp_path, imagenet.train_tar, validation={
        "enabled": True, "root": imagenet.val_tar, "devkit": imagenet.devkit_tgz, "batch_size": 4})
    r = subprocess.run([sys.executable, "-m", "prefetchd", "check", "--config", cfg], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "dataset: 35 samples, 5 classes (scanned in" in r.stdout
    assert "ILSVRC2012_img_train.tar, a tar of per-class tars (indexed in " in r.stdout
    assert "validation: 13 samples (ILSVRC2012_img_val.tar, a flat tar labelled by the devkit" in r.stdout


def test_daemon_serves_the_tars_as_the_folder_would(imagenet, tmp_path, daemon_factory):
    from prefetchd_client import PrefetchClient

    cfg = small_config(tmp_path, imagenet.train_tar, loader={"epochs": 1}, validation={
        "enabled": True, "root": imagenet.val_tar, "devkit": imagenet.devkit_tgz, "batch_size": 4})
    daemon_factory(cfg)
    c_cfg = C.load(cfg)
    folder, _ = load_index(imagenet.train_folder, None, EXTS, str(tmp_path / "c2"))
    maker = BatchMaker(WorkerSetup(c_cfg, None, folder, 0, str(tmp_path)))
    s = Sampler(len(folder), 6, 7, True, True, 1)
    with PrefetchClient(cfg, as_numpy=True, timeout=90) as c:
        got = [(np.ascontiguousarray(x.transpose(0, 2, 3, 1)).copy(), y.copy()) for x, y in c.iter_epoch(0)]
    assert len(got) == s.batches_per_epoch
    for b, (x, y) in enumerate(got):  # the extracted folder's batches, made in-process
        images, _, labels, _, _ = maker.fill(0, s.batch_indices(0, 0, b))
        assert np.array_equal(x, images) and np.array_equal(y, labels)
    val, _ = load_index(imagenet.val_tar, None, EXTS, str(tmp_path / "cache"), devkit=imagenet.devkit_tgz)
    seen = []
    with PrefetchClient(cfg, split="val", as_numpy=True, timeout=90) as c:
        for _, y in c:
            for label, i in zip(y.tolist(), c.last_batch.indices.tolist(), strict=True):
                assert folder.classes[label] == imagenet.val_wnid[val.relpath(i)]
                seen.append(i)
    assert sorted(seen) == list(range(13))



def test_a_train_subset_gets_validation_labels_for_the_classes_it_has(tmp_path):
    net = make_imagenet(str(tmp_path / "net"), classes=5, per_class=2, val=3, seed=4)
    used = set(net.val_wnid.values())
    unused = [w for w in net.wnids if w not in used]
    assert unused  # 3 val images, 5 classes
    subset = str(tmp_path / "subset")
    os.makedirs(subset)
    for w in net.wnids:
        if w != unused[0]:
            shutil.copy(os.path.join(net.train_tars, w + ".tar"), subset)
    train, _ = load_index(subset, None, EXTS, None, use_cache=False)
    val = val_labels(load_index(net.val_tar, None, EXTS, None, use_cache=False, devkit=net.devkit_tgz)[0], train)
    assert [train.classes[k] for k in val.labels.tolist()] == [net.val_wnid[val.relpath(i)] for i in range(3)]
    os.unlink(os.path.join(subset, sorted(used)[0] + ".tar"))  # a class that val images have: a clear error
    train, _ = load_index(subset, None, EXTS, None, use_cache=False)
    with pytest.raises(DatasetError, match=sorted(used)[0]):
        val_labels(load_index(net.val_tar, None, EXTS, None, use_cache=False, devkit=net.devkit_tgz)[0], train)


@pytest.mark.parametrize("kind", ["tar", "tars"])
def test_an_archive_rewritten_while_it_is_indexed_is_refused_not_read_at_old_offsets(tmp_path, monkeypatch, kind):
    """A train tar re-packed in place (same size, inode; classes in another order) between its
    top-level headers and its class tars' headers: the identity taken after the scan vouched for
    offsets of the old file, so every read passed its check and gave n2's pixels under n1's label."""
    def train(order):
        return tar_bytes([(f"{c}.tar", tar_bytes([(f"{c}_{i}.JPEG", c.encode() * (500 + i)) for i in range(3)]))
                          for c in order])

    old, new = train(["n1", "n2"]), train(["n2", "n1"])
    assert len(old) == len(new)
    if kind == "tar":
        root = path = str(tmp_path / "train.tar")
        open(path, "wb").write(old)
    else:
        root, path = str(tmp_path / "tars"), str(tmp_path / "tars" / "n1.tar")
        os.mkdir(root)
        old, new = (tar_bytes([(f"n1_{i}.JPEG", c * (500 + i)) for i in order]) for c, order in
                    ((b"n1", (0, 1, 2)), (b"xx", (2, 1, 0))))
        open(path, "wb").write(old)  # a class tar re-packed as its headers are read
    real, calls = imagenet_tars.members, []

    def members(fd, *args, **kwargs):
        out = real(fd, *args, **kwargs)
        if not calls:
            with open(path, "r+b") as f:  # cp over it: same inode, same size
                os.utime(path, ns=(1, 1))  # mtime moved at least once; ctime moves anyway
                f.write(new)
        calls.append(1)
        return out

    monkeypatch.setattr(imagenet_tars, "members", members)
    with pytest.raises(DatasetError, match="changed while it was being indexed.*start again once it is complete"):
        index, _ = imagenet_tars.scan(root, None, EXTS, kind=kind)
        for i in range(len(index)):  # before the fix: no StorageChanged, other members' bytes
            assert index.read(i)[:2] == index.relpath(i)[:2].encode(), (index.relpath(i), index.read(i)[:2])


def test_an_archive_on_a_remounted_share_is_the_same_archive_but_a_rewritten_one_is_not(tmp_path):
    """NFS gives a mount a new device number at a remount: the file (inode, size, times) is the
    one indexed and reads on; a changed inode, size or time is another file's bytes and raises."""
    from prefetchd.sources.base import StorageChanged

    path = tmp_path / "a.tar"
    path.write_bytes(b"x" * 1024)
    fd = os.open(path, os.O_RDONLY)
    try:
        ident = store.identity_of(os.fstat(fd))
        archive._check(fd, str(path), (ident[0] + 1, *ident[1:]))  # another device number: same file
        for i in (1, 2, 3, 4):  # inode, size, mtime, ctime
            other = list(ident)
            other[i] += 1
            with pytest.raises(StorageChanged):
                archive._check(fd, str(path), tuple(other))
    finally:
        os.close(fd)
