"""ImageNet's tars at first contact (issue 28): archives rewritten in place, leftovers, mistakes.

Each test is a case a new user meets with the files and habits of real machines; each failed on
the tree before the fix (wrong pixels or labels without a word, or a traceback)."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time

import numpy as np
import pytest
from conftest import small_config, wait_until
from PIL import Image

from prefetchd.sources.dataset import load_index

EXTS = (".jpeg", ".jpg", ".png")
_LEVELS = (30, 128, 225)
COLOURS = [(r, g, b) for r in _LEVELS for g in _LEVELS for b in _LEVELS]  # 27, far apart


def solid_jpeg(colour, size: int = 2400, side: int = 48) -> bytes:
    """A JPEG of one colour, padded with a comment segment to exactly ``size`` bytes (members of
    one size: a re-packed archive keeps its size, as the issue's re-packed train tar did)."""
    buf = io.BytesIO()
    Image.new("RGB", (side, side), colour).save(buf, "JPEG", quality=95)
    data = buf.getvalue()
    pad = size - len(data) - 4
    assert 0 <= pad < 65000, len(data)
    return data[:2] + b"\xff\xfe" + (pad + 2).to_bytes(2, "big") + bytes(pad) + data[2:]


def tar_of(members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 1_300_000_000
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def class_tars(root: str, classes: int = 3, per_class: int = 8) -> dict[str, tuple[int, int, int]]:
    """A folder of class tars; returns each member's colour by its relative path (``n0/n0_3.JPEG``)."""
    os.makedirs(root)
    colour_of = {}
    for c in range(classes):
        members = []
        for k in range(per_class):
            colour = COLOURS[c * per_class + k]
            members.append((f"n{c}_{k}.JPEG", solid_jpeg(colour)))
            colour_of[f"n{c}/n{c}_{k}.JPEG"] = colour
        with open(os.path.join(root, f"n{c}.tar"), "wb") as f:
            f.write(tar_of(members))
    return colour_of


def _check_colours(x: np.ndarray, indices, index, colour_of) -> None:
    """Every sample's pixels are its own member's colour (x: N x H x W x 3)."""
    for img, i in zip(x, indices, strict=True):
        want = np.array(colour_of[index.relpath(int(i))], float)
        got = img.reshape(-1, 3).mean(0)
        assert np.abs(got - want).max() < 25, f"sample {i} ({index.relpath(int(i))}): pixels {got} are not {want}"


def test_an_archive_rewritten_in_place_never_yields_another_members_pixels(tmp_path, daemon_factory):
    """A class tar re-packed in another member order and written over the old one (same size, same
    inode: ``cp`` over it, ``rsync --inplace``) while training: no batch is made from it (one log
    line says why and what to do), a restart indexes it again, and every sample is its own member's
    pixels throughout; no good sample is quarantined."""
    from prefetchd_client import PrefetchClient, PrefetchTimeout

    root = str(tmp_path / "tars")
    colour_of = class_tars(root)
    cfg = small_config(tmp_path, root, loader={"batch_size": 4, "epochs": 4, "shuffle": True},
                       augment={"output_size": 32, "scale_min": 40, "scale_max": 48})
    index, _ = load_index(root, None, EXTS, None, use_cache=False)
    d = daemon_factory(cfg)
    seen = 0
    with PrefetchClient(cfg, as_numpy=True, timeout=60) as c:  # 60 s for a start under load
        try:
            for x, _ in c.iter_epoch(0):
                _check_colours(np.ascontiguousarray(x.transpose(0, 2, 3, 1)), c.last_batch.indices, index, colour_of)
                seen += 1
                if seen == 1:  # the next batches are made after the archive is rewritten
                    path = os.path.join(root, "n0.tar")
                    ino, size = os.stat(path).st_ino, os.stat(path).st_size
                    with open(path, "rb") as f:
                        old = tarfile.open(fileobj=io.BytesIO(f.read()))
                        members = [(m.name, old.extractfile(m).read()) for m in old.getmembers()][::-1]
                    with open(path, "r+b") as f:  # in place: same inode
                        f.write(tar_of(members))
                    assert (os.stat(path).st_ino, os.stat(path).st_size) == (ino, size)
                    c.timeout = 4  # from here on, the batches from the changed archive wait
        except PrefetchTimeout:
            pass  # the batches from the changed archive wait
    wait_until(lambda: "n0.tar changed since it was indexed" in d.log(), 30, "the one line about the changed archive")
    assert d.log().count("changed since it was indexed") == 1, d.log()
    assert d.stop() == 0
    d2 = daemon_factory(cfg)  # a restart indexes it again
    index2, _ = load_index(root, None, EXTS, None, use_cache=False)
    with PrefetchClient(cfg, as_numpy=True, timeout=60) as c:
        n = 0
        for x, _ in c.iter_epoch(1):
            _check_colours(np.ascontiguousarray(x.transpose(0, 2, 3, 1)), c.last_batch.indices, index2, colour_of)
            n += 1
        assert n == 6
    assert "quarantined sample" not in d.log() + d2.log()
    assert d2.stop() == 0


def test_a_trainer_timing_out_after_an_archive_changed_is_told_why(tmp_path, daemon_factory):
    """The trainer's PrefetchTimeout says what the status knows: the archive changed since it was
    indexed (not only "0 ready")."""
    from prefetchd_client import PrefetchClient, PrefetchTimeout

    root = str(tmp_path / "tars")
    class_tars(root, classes=2, per_class=6)
    cfg = small_config(tmp_path, root, loader={"batch_size": 4, "epochs": 4},
                       augment={"output_size": 32, "scale_min": 40, "scale_max": 48})
    d = daemon_factory(cfg)
    path = os.path.join(root, "n0.tar")
    with PrefetchClient(cfg, as_numpy=True, timeout=60) as c:
        c.seek(0, 0)
        next(iter(c))
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "r+b") as f:  # in place, same size: every batch needing n0.tar waits
            f.write(data[::-1])
        # The ring may hold every batch made before the rewrite: the trainer reads on, short timeouts,
        # until a batch that needs n0.tar is the next one; the daemon finds out only when it makes
        # that batch (90 s: its workers run at SCHED_IDLE, slow to get to it on a loaded machine).
        c.timeout = 3
        deadline = time.monotonic() + 90
        while True:
            with pytest.raises(PrefetchTimeout) as e:
                for epoch in range(c.epoch, 4):
                    for _ in c.iter_epoch(epoch):
                        pass
            if "n0.tar changed since it was indexed" in str(e.value) or time.monotonic() > deadline:
                break
    assert "n0.tar changed since it was indexed" in d.log()
    assert "n0.tar changed since it was indexed" in str(e.value), str(e.value)
    assert d.stop() == 0


def test_a_quarantine_line_made_for_other_content_is_not_held_against_the_new(tmp_path):
    """A sample quarantined in an archive that was then re-packed (its identity, hence the sample's
    stamp, changed; the index fingerprint did not) is tried again, not kept quarantined."""
    from prefetchd.daemon.quarantine import QuarantineLog
    from prefetchd.executors.worker import Quarantined

    root = str(tmp_path / "tars")
    class_tars(root, classes=2, per_class=3)
    index, _ = load_index(root, None, EXTS, None, use_cache=False)
    q = QuarantineLog(str(tmp_path), index.fingerprint, index.path, index.content_stamp)
    q.add(Quarantined(1, index.path(1), "cannot decode"), 0)
    again = QuarantineLog(str(tmp_path), index.fingerprint, index.path, index.content_stamp)
    again.load()
    assert set(again.records) == {1}  # the same content: still quarantined
    path = os.path.join(root, "n0.tar")
    data = open(path, "rb").read()
    with open(path, "r+b") as f:
        f.write(data)  # rewritten in place, same bytes even: mtime and ctime move
    index2, _ = load_index(root, None, EXTS, None, use_cache=False)
    assert index2.fingerprint == index.fingerprint
    fresh = QuarantineLog(str(tmp_path), index2.fingerprint, index2.path, index2.content_stamp)
    fresh.load()
    assert not fresh.records
    with open(os.path.join(str(tmp_path), "quarantine.jsonl")) as f:
        assert all("stamp" in json.loads(line) for line in f)


def test_a_kept_descriptor_of_an_archive_rewritten_in_place_is_not_read_from(tmp_path):
    """The worker keeps archives open: the same inode rewritten at the same size is caught at the
    next read (fstat against the indexed identity), not served at the old offsets."""
    from prefetchd.sources.base import StorageChanged

    root = str(tmp_path / "tars")
    class_tars(root, classes=1, per_class=4)
    index, _ = load_index(root, None, EXTS, None, use_cache=False)
    assert index.read(0)
    path = os.path.join(root, "n0.tar")
    data = open(path, "rb").read()
    with open(path, "r+b") as f:
        f.write(data[::-1])
    with pytest.raises(StorageChanged, match="n0.tar changed since it was indexed .*mtime_ns"):
        index.read(0)


def test_an_archive_whose_ctime_alone_moved_with_every_member_in_place_is_read_on(tmp_path, caplog):
    """A chmod, chown or hard link moves ctime alone: every sample's header is still right before its
    data, so the reads go on (same bytes, one log line), and the archive is checked once, not at
    every read. On the tree before, its batches waited for a restart."""
    import logging

    from prefetchd.sources import tarrecheck

    root = str(tmp_path / "tars")
    class_tars(root, classes=2, per_class=3)
    index, _ = load_index(root, None, EXTS, None, use_cache=False)
    before = [index.read(i) for i in range(len(index))]
    time.sleep(0.05)  # past the kernel's coarse clock tick
    os.chmod(os.path.join(root, "n0.tar"), 0o640)
    os.link(os.path.join(root, "n1.tar"), str(tmp_path / "n1-link.tar"))
    checks = []
    real = tarrecheck.misplaced
    with caplog.at_level(logging.INFO, logger="prefetchd.dataset"):
        try:
            tarrecheck.misplaced = lambda *a: checks.append(a[2]) or real(*a)
            assert [index.read(i) for i in range(len(index))] * 2 == before * 2
        finally:
            tarrecheck.misplaced = real
    assert sorted(checks) == [0, 1], checks  # once per archive
    assert caplog.text.count("changed its ctime alone (mode, owner or links)") == 2, caplog.text


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT])
def test_long_member_names_are_vouched_for_after_a_chmod_in_every_tar_format(tmp_path, fmt):
    """Names over 100 bytes live in a GNU long-name or PAX header, or a ustar prefix: the member's
    own header holds them in part or split, and the check still finds every member in place."""
    root = tmp_path / "tars"
    root.mkdir()
    names = [f"{'d' * 60}/{'x' * 70}_{k}.JPEG" for k in range(3)]
    with tarfile.open(root / "n0.tar", "w", format=fmt) as tf:
        for k, name in enumerate(names):
            data = solid_jpeg(COLOURS[k])
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    index, _ = load_index(str(root), None, EXTS, None, use_cache=False)
    assert len(index) == 3
    before = [index.read(i) for i in range(3)]
    time.sleep(0.05)
    os.chmod(root / "n0.tar", 0o640)
    assert [index.read(i) for i in range(3)] == before


def test_an_archive_rewritten_with_its_mtime_put_back_and_members_moved_waits(tmp_path):
    """A rewrite in place that puts the mtime back (``touch -d``, ``rsync --inplace -t``) moves ctime
    alone too: with its members moved (same size, another order), no read is served from it, and
    the line names the first sample out of place."""
    from prefetchd.sources.base import StorageChanged

    root = str(tmp_path / "tars")
    class_tars(root, classes=1, per_class=3)
    index, _ = load_index(root, None, EXTS, None, use_cache=False)
    path = os.path.join(root, "n0.tar")
    st = os.stat(path)
    old = tarfile.open(path)
    members = [(m.name, old.extractfile(m).read()) for m in old.getmembers()][::-1]
    old.close()
    with open(path, "r+b") as f:
        f.write(tar_of([members[1], members[0], members[2]]))  # same size, other order
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (os.stat(path).st_size, os.stat(path).st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    with pytest.raises(StorageChanged, match=r"\(ctime_ns \d+ -> \d+; its ctime alone, and its members moved: a "
                                             r"rewrite with its mtime put back \(the header before the data of "):
        index.read(0)


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_long_names_alike_in_their_first_100_bytes_swapped_with_the_mtime_put_back_wait(tmp_path, fmt):
    """Two members of one size whose long names differ only past their first 100 bytes (all the
    member's own header holds; the rest is in the GNU long-name or PAX header before it), swapped by
    a rewrite in place that puts the mtime back: the check reads the whole name, so no sample is
    served with the other's pixels. On the tree before, a 90-byte prefix vouched for them."""
    from prefetchd.sources.base import StorageChanged

    root = tmp_path / "tars"
    root.mkdir()
    members = [(f"{'d' * 60}/{'x' * 70}_{k}.JPEG", solid_jpeg(COLOURS[k])) for k in range(2)]

    def write(order):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
            for name, data in order:
                info = tarfile.TarInfo(name)
                info.size, info.mtime = len(data), 1_300_000_000
                tf.addfile(info, io.BytesIO(data))
        return buf.getvalue()

    path = root / "n0.tar"
    path.write_bytes(write(members))
    index, _ = load_index(str(root), None, EXTS, None, use_cache=False)
    assert len(index) == 2
    first = index.read(0)
    st = os.stat(path)
    time.sleep(0.05)
    with open(path, "r+b") as f:
        f.write(write(members[::-1]))  # same size, the two swapped
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (os.stat(path).st_size, os.stat(path).st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    with pytest.raises(StorageChanged, match="its members moved"):
        assert index.read(0) == first, "sample 0 read with the other member's pixels"


def test_an_archive_found_with_its_members_moved_is_not_checked_again_at_every_try(tmp_path):
    """A batch that waits is tried again every half second, and the check of a train tar reads all
    its headers (about 1 s per 200,000 members): an archive found with its members moved is not
    checked again until it changes again. On the tree before, every try checked it again."""
    from prefetchd.sources import tarrecheck
    from prefetchd.sources.base import StorageChanged

    root = str(tmp_path / "tars")
    class_tars(root, classes=1, per_class=3)
    index, _ = load_index(root, None, EXTS, None, use_cache=False)
    path = os.path.join(root, "n0.tar")
    st = os.stat(path)
    with tarfile.open(path) as old:
        members = [(m.name, old.extractfile(m).read()) for m in old.getmembers()]
    time.sleep(0.05)
    with open(path, "r+b") as f:
        f.write(tar_of([members[1], members[0], members[2]]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    checks = []
    real = tarrecheck.misplaced
    try:
        tarrecheck.misplaced = lambda *a: checks.append(a[2]) or real(*a)
        for i in [0, 1, 2, 0, 1, 2]:
            with pytest.raises(StorageChanged, match="its members moved"):
                index.read(i)
        assert checks == [0], checks
        time.sleep(0.05)
        os.chmod(path, 0o640)  # changed again: checked again
        with pytest.raises(StorageChanged, match="its members moved"):
            index.read(0)
        assert checks == [0, 0], checks
    finally:
        tarrecheck.misplaced = real


def test_class_tars_of_one_size_swapped_in_a_train_tar_with_the_mtime_put_back_wait(tmp_path):
    """A tar of class tars whose members have the same names in every class (``0.JPEG``, ...) and one
    size: two class tars swapped in place, the mtime put back. Each member's header is in place
    with its name and size, but under the other class: the check finds each sample outside the
    class tar it was indexed in, so no sample is served under the other class's label. On the tree
    before, they were served so."""
    from prefetchd.sources.base import StorageChanged

    classes = [(f"n{c}.tar", tar_of([(f"{k}.JPEG", solid_jpeg(COLOURS[c * 2 + k])) for k in range(2)]))
               for c in range(2)]
    path = str(tmp_path / "train.tar")
    with open(path, "wb") as f:
        f.write(tar_of(classes))
    index, _ = load_index(path, None, EXTS, None, use_cache=False)
    assert index.layout == "tar" and len(index) == 4
    before = [index.read(i) for i in range(4)]
    time.sleep(0.05)
    os.chmod(path, 0o640)  # each sample in its class tar: read on
    assert [index.read(i) for i in range(4)] == before
    first = before[0]
    st = os.stat(path)
    time.sleep(0.05)
    with open(path, "r+b") as f:
        f.write(tar_of(classes[::-1]))  # same size, n1.tar first
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (os.stat(path).st_size, os.stat(path).st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    with pytest.raises(StorageChanged, match="its members moved"):
        assert index.read(0) == first, "sample 0 read with the other class's pixels"


def test_a_chmod_of_a_class_tar_while_training_keeps_its_batches_coming(tmp_path, daemon_factory):
    """The daemon (its workers keep the archives open) reads on after a ``chmod`` of a class tar in
    the middle of an epoch: every batch of two epochs comes, each sample its own member's pixels."""
    from prefetchd_client import PrefetchClient

    root = str(tmp_path / "tars")
    colour_of = class_tars(root)
    cfg = small_config(tmp_path, root, loader={"batch_size": 4, "epochs": 2, "shuffle": True},
                       augment={"output_size": 32, "scale_min": 40, "scale_max": 48})
    index, _ = load_index(root, None, EXTS, None, use_cache=False)
    d = daemon_factory(cfg)
    with PrefetchClient(cfg, as_numpy=True, timeout=60) as c:
        n = 0
        for epoch in (0, 1):
            for x, _ in c.iter_epoch(epoch):
                _check_colours(np.ascontiguousarray(x.transpose(0, 2, 3, 1)), c.last_batch.indices, index, colour_of)
                n += 1
                if n == 1:
                    for k in range(3):
                        os.chmod(os.path.join(root, f"n{k}.tar"), 0o640)
        assert n == 2 * len(index) // 4
    assert "changed since it was indexed" not in d.log(), d.log()
    assert d.stop() == 0


# --- wrong labels: leftovers and mistakes (items 2, 3, 4, 9), said by `prefetchd check` -----------------


def _check(tmp_path, root: str, **sections) -> tuple[int, str]:
    import subprocess
    import sys

    cfg = small_config(tmp_path, root, loader={"batch_size": 2}, **sections)
    r = subprocess.run([sys.executable, "-m", "prefetchd", "check", "--config", cfg], capture_output=True,
                       text=True, timeout=120)
    assert "Traceback" not in r.stderr, r.stderr
    return r.returncode, r.stdout + r.stderr


@pytest.fixture(scope="module")
def imagenet(tmp_path_factory):
    from imagenet_archives import make_imagenet

    return make_imagenet(str(tmp_path_factory.mktemp("imagenet")), classes=4, per_class=3, val=8)


def _copytree(src: str, dest: str) -> str:
    import shutil

    shutil.copytree(src, dest)
    return dest


def test_the_train_tar_left_beside_its_extracted_class_tars_is_refused(imagenet, tmp_path):
    import shutil

    root = _copytree(imagenet.train_tars, str(tmp_path / "train"))
    shutil.copy(imagenet.train_tar, root)  # mv ILSVRC2012_img_train.tar train/; cd train; tar xf ...
    rc, out = _check(tmp_path, root)
    assert rc == 78 and "1 of its 5 tars are not class tars: ILSVRC2012_img_train.tar (a tar of tars" in out, out
    shutil.copy(imagenet.val_tar, os.path.join(root, "ILSVRC2012_img_train.tar"))  # any non-class archive
    rc, out = _check(tmp_path, root)
    assert rc == 78 and "(a flat set of validation images" in out, out


def test_the_download_folder_as_dataset_root_is_refused_saying_what_it_holds(imagenet, tmp_path):
    import shutil

    root = str(tmp_path / "download")
    os.makedirs(root)
    for f in (imagenet.train_tar, imagenet.val_tar, imagenet.devkit_tgz):
        shutil.copy(f, root)
    rc, out = _check(tmp_path, root)
    assert rc == 78 and "looks like ImageNet's download folder" in out and "ILSVRC2012_devkit_t12.tar.gz" in out, out
    assert len([ln for ln in out.splitlines() if "configuration error" in ln]) == 1, out


def test_validation_root_set_to_the_train_tar_with_the_devkit_is_refused(imagenet, tmp_path):
    rc, out = _check(tmp_path, imagenet.train_tar, validation={
        "enabled": True, "root": imagenet.train_tar, "devkit": imagenet.devkit_tgz, "batch_size": 2})
    assert rc == 78 and "validation.root" in out and "is a tar of class tars (a train set), but validation.devkit" in out, out


def test_lost_found_and_a_class_extracted_beside_its_tar_leave_the_class_tars_as_they_are(imagenet, tmp_path):
    import shutil

    root = _copytree(imagenet.train_tars, str(tmp_path / "train"))
    os.makedirs(os.path.join(root, "lost+found"))  # the root of every ext4 data disk
    w = imagenet.wnids[1]
    shutil.copytree(os.path.join(imagenet.train_folder, w), os.path.join(root, w))  # a half-run extraction
    rc, out = _check(tmp_path, root)
    assert rc == 0 and "dataset: 12 samples, 4 classes" in out and "a folder of per-class tars" in out, out
    assert "lost+found (a file system's lost+found folder, not a class)" in out, out
    assert f"{w} (a folder extracted beside its class tar {w}.tar: the tar is read)" in out, out
    index, _ = load_index(root, None, EXTS, None, use_cache=False)
    folder, _ = load_index(imagenet.train_folder, None, EXTS, None, use_cache=False)
    assert index.fingerprint == folder.fingerprint  # the extracted folder's labels and order
    os.makedirs(os.path.join(root, "stray"))
    rc, out = _check(tmp_path, root)
    assert rc == 78 and "1 folder(s) that are not one of them extracted (stray)" in out, out


def test_misleading_advice_is_gone(imagenet, tmp_path):
    """The val tar as dataset.root is told it is a validation set (the devkit labels no train set);
    a tar of an ImageFolder, or of class tars under a leading folder, is told to be extracted."""
    rc, out = _check(tmp_path, imagenet.val_tar)
    assert rc == 78 and "ImageNet's validation set): a train set needs class folders" in out, out
    assert "set validation.devkit" not in out, out
    for name, src, want in (("folder.tar", imagenet.train_folder, "is a tar of image folders"),
                            ("lead.tar", imagenet.train_tars, "holds its class tars under train_tars/")):
        path = str(tmp_path / name)
        with tarfile.open(path, "w") as tf:
            tf.add(src, arcname=os.path.basename(src))
        rc, out = _check(tmp_path, path)
        assert rc == 78 and want in out and "extract it" in out and "flat set of 0" not in out, out


# --- a download cut short (item 6) -----------------------------------------------------------------------


def _cut_after_member(src: str, dest: str, keep: int) -> None:
    """``src`` cut right after its ``keep``-th member's data (at a record boundary: no end blocks)."""
    with tarfile.open(src) as tf:
        m = tf.getmembers()[keep - 1]
    end = m.offset_data + -(-m.size // 512) * 512
    with open(src, "rb") as f, open(dest, "wb") as g:
        g.write(f.read(end))


def test_a_tar_cut_at_a_member_boundary_says_the_download_is_incomplete(imagenet, tmp_path):
    cut = str(tmp_path / "ILSVRC2012_img_train.tar")
    _cut_after_member(imagenet.train_tar, cut, 2)
    rc, out = _check(tmp_path, cut)
    assert rc == 78 and "without the end-of-archive blocks" in out and "download it again" in out, out
    val = str(tmp_path / "ILSVRC2012_img_val.tar")
    _cut_after_member(imagenet.val_tar, val, 4)
    rc, out = _check(tmp_path, imagenet.train_tar, validation={
        "enabled": True, "root": val, "devkit": imagenet.devkit_tgz, "batch_size": 2})
    assert rc == 78 and "without the end-of-archive blocks" in out, out


def test_a_validation_set_shorter_than_its_ground_truth_is_said(imagenet, tmp_path):
    import shutil

    val = str(tmp_path / "val")
    os.makedirs(val)
    for name in sorted(os.listdir(imagenet.val_folder))[:5]:  # a half-run extraction
        shutil.copy(os.path.join(imagenet.val_folder, name), val)
    rc, out = _check(tmp_path, imagenet.train_tar, validation={
        "enabled": True, "root": val, "devkit": imagenet.devkit_tgz, "batch_size": 2})
    assert rc == 0 and "5 validation images of the devkit ground truth's 8: the set is incomplete" in out, out


# --- ulimit -n (item 5) ----------------------------------------------------------------------------------


def test_a_folder_of_more_class_tars_than_open_files_allowed_is_indexed(tmp_path):
    import subprocess
    import sys

    root = str(tmp_path / "tars")
    os.makedirs(root)
    one = tar_of([("a.JPEG", solid_jpeg((30, 30, 30)))])
    for c in range(150):
        with open(os.path.join(root, f"n{c:04d}.tar"), "wb") as f:
            f.write(one)
    code = ("import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (100, resource.getrlimit("
            "resource.RLIMIT_NOFILE)[1])); from prefetchd.sources.dataset import load_index; "
            f"i, _ = load_index({root!r}, None, ('.jpeg',), None, use_cache=False); print(len(i), len(i.classes))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["150", "150"], r.stderr[-2000:]


def test_the_units_raise_the_open_file_limit():
    here = os.path.join(os.path.dirname(__file__), "..", "systemd")
    for unit in ("prefetchd.service", "prefetchd@.service"):
        with open(os.path.join(here, unit)) as f:
            lines = [ln.strip() for ln in f]
        assert any(ln.startswith("LimitNOFILE=") for ln in lines), unit


# --- a damaged meta.mat (item 8) -------------------------------------------------------------------------


def test_a_damaged_meta_mat_is_a_one_line_error_rc_78(imagenet, tmp_path):
    import shutil

    devkit = _copytree(imagenet.devkit_folder, str(tmp_path / "devkit"))
    meta = os.path.join(devkit, "ILSVRC2012_devkit_t12", "data", "meta.mat")
    from imagenet_archives import write_meta_mat
    from scipy.io import loadmat, savemat

    write_meta_mat(meta, [(3, "n1"), (1, "n2"), (2, "n3")], [(4, "n9", [1, 2])])
    savemat(meta, {"synsets": loadmat(meta)["synsets"]}, do_compression=False)  # uncompressed, as the issue's
    data = bytearray(open(meta, "rb").read())
    assert len(data) == 2096
    data[1076] = 186  # one byte of an element's size: the fuzz's IndexError
    open(meta, "wb").write(bytes(data))
    rc, out = _check(tmp_path, imagenet.train_tar, validation={
        "enabled": True, "root": imagenet.val_tar, "devkit": devkit, "batch_size": 2})
    assert rc == 78 and "meta.mat is not the ImageNet devkit's" in out, out
    assert len([ln for ln in out.splitlines() if "configuration error" in ln]) == 1, out
    shutil.rmtree(devkit)


def test_an_imagefolder_without_images_names_the_config_key_not_a_directory_id(tmp_path):
    from prefetchd.sources.dataset import DatasetError

    root = tmp_path / "root"
    (root / "a" / "sub").mkdir(parents=True)
    (root / "a" / "notes.txt").write_text("x")
    with pytest.raises(DatasetError, match=r"^dataset\.root .* holds no images"):
        load_index(str(root), None, EXTS, None, use_cache=False)


def test_imagenets_test_tar_or_any_of_its_files_beside_class_tars_is_refused(imagenet, tmp_path):
    """The download page's third tar (ILSVRC2012_img_test_v10102019.tar: test/ILSVRC2012_test_*.JPEG,
    no labels) beside the class tars was read as a class sorted first: every label shifted by one,
    check rc 0 without a word. So was any ILSVRC2012_* download tar holding images."""
    root = _copytree(imagenet.train_tars, str(tmp_path / "train"))
    test = [(f"test/ILSVRC2012_test_{k:08d}.JPEG", solid_jpeg((k, 0, 0))) for k in range(1, 4)]
    with open(os.path.join(root, "ILSVRC2012_img_test_v10102019.tar"), "wb") as f:
        f.write(tar_of(test))
    rc, out = _check(tmp_path, root)
    assert rc == 78 and "ILSVRC2012_img_test_v10102019.tar (a set of unlabelled test images" in out, out
    os.rename(os.path.join(root, "ILSVRC2012_img_test_v10102019.tar"), os.path.join(root, "ILSVRC2012_img_x.tar"))
    with open(os.path.join(root, "ILSVRC2012_img_x.tar"), "wb") as f:
        f.write(tar_of([("a.JPEG", solid_jpeg((1, 2, 3)))]))
    rc, out = _check(tmp_path, root)
    assert rc == 78 and "ILSVRC2012_img_x.tar (named as one of ImageNet's download files" in out, out
    os.unlink(os.path.join(root, "ILSVRC2012_img_x.tar"))
    rc, out = _check(tmp_path, root)
    assert rc == 0, out


def test_the_devkit_as_a_root_is_named_as_the_devkit(imagenet, tmp_path):
    """The devkit (a .tar.gz) as dataset.root was told "it is gzip-compressed: decompress it first",
    and once decompressed, or its folder, "a flat set of 0 images" or "holds no images": advice
    that leads nowhere. It is named as the devkit, with the keys to set."""
    import gzip
    import shutil

    tgz = shutil.copy(imagenet.devkit_tgz, str(tmp_path))
    with open(tgz, "ab") as f:  # as large as the real one (2.5 MB): past the "too short for a tar" check
        f.write(bytes(4096))
    plain = str(tmp_path / "ILSVRC2012_devkit_t12.tar")
    with gzip.open(imagenet.devkit_tgz) as src, open(plain, "wb") as dst:
        dst.write(src.read())
    for root in (tgz, plain, imagenet.devkit_folder):
        rc, out = _check(tmp_path, root)
        assert rc == 78 and f"dataset.root {root} is ImageNet's devkit" in out, out
        assert "set validation.devkit to it, and dataset.root to the train tar" in out, out
    rc, out = _check(tmp_path, imagenet.train_tar, validation={
        "enabled": True, "root": imagenet.devkit_folder, "devkit": imagenet.devkit_tgz, "batch_size": 2})
    assert rc == 78 and "validation.root to the validation tar (ILSVRC2012_img_val.tar)" in out, out
    download = tmp_path / "download"  # the devkit extracted beside the tars: the download folder, not a devkit
    os.makedirs(download)
    for f in (imagenet.train_tar, imagenet.val_tar):
        shutil.copy(f, download)
    inner = os.listdir(imagenet.devkit_folder)[0]
    shutil.copytree(os.path.join(imagenet.devkit_folder, inner), download / inner)
    rc, out = _check(tmp_path, str(download))
    assert rc == 78 and "it looks like ImageNet's download folder" in out, out


_APPLEDOUBLE = b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X        " + bytes(64)  # what a Mac's ._x.JPEG holds


def test_macos_appledouble_files_are_not_samples_in_a_folder_or_a_tar(imagenet, tmp_path):
    """A Mac's tar (bsdtar) writes ./._x.JPEG beside every file with extended attributes (every
    downloaded file has com.apple.quarantine), and a copy from a Mac to a FAT or SMB disk leaves
    ._x.JPEG files: each was indexed as an image, so half the samples were quarantined one warning
    at a time and replaced, and a flat validation tar's ._ILSVRC2012_val_* took its image's label
    a second time. Skipped in all three, the folder and its tars still index alike."""
    folder, tars = tmp_path / "folder", tmp_path / "tars"
    for c in range(2):
        os.makedirs(folder / f"n{c}")
        members = []
        for k in range(3):
            jpeg = solid_jpeg(COLOURS[c * 3 + k])
            (folder / f"n{c}" / f"x{k}.JPEG").write_bytes(jpeg)
            (folder / f"n{c}" / f"._x{k}.JPEG").write_bytes(_APPLEDOUBLE)
            members += [(f"./._x{k}.JPEG", _APPLEDOUBLE), (f"./x{k}.JPEG", jpeg)]
        os.makedirs(tars, exist_ok=True)
        (tars / f"n{c}.tar").write_bytes(tar_of(members))
    a, _ = load_index(str(folder), None, EXTS, None, use_cache=False)
    b, _ = load_index(str(tars), None, EXTS, None, use_cache=False)
    assert [a.relpath(i) for i in range(len(a))] == [f"n{c}/x{k}.JPEG" for c in range(2) for k in range(3)]
    assert a.fingerprint == b.fingerprint
    assert any("._x0.JPEG (a macOS AppleDouble file" in s for s in b.skipped), b.skipped
    val = tmp_path / "val.tar"
    with tarfile.open(imagenet.val_tar) as tf:
        members = [(m.name, tf.extractfile(m).read()) for m in tf if m.isfile()]
    val.write_bytes(tar_of([(f"._{n}", _APPLEDOUBLE) for n, _ in members] + members))
    v, _ = load_index(str(val), None, EXTS, None, use_cache=False, devkit=imagenet.devkit_tgz, section="validation")
    assert len(v) == len(members) == 8 and not any(v.relpath(i).startswith("._") for i in range(len(v)))


def test_a_file_restored_in_place_with_its_old_times_is_tried_again(tmp_path):
    """A bit-rotted JPEG (same size) quarantined, then restored from a backup in place with its old
    mtime (``cp -p``, ``rsync --inplace -t``, ``touch -r``): size, inode and mtime as before, so
    the stamp (size:mtime:inode) held the good file quarantined for good. ctime moves."""
    from prefetchd.daemon.quarantine import QuarantineLog
    from prefetchd.executors.worker import Quarantined

    root = tmp_path / "folder"
    os.makedirs(root / "a")
    os.makedirs(root / "b")
    for c in "ab":
        for k in range(2):
            (root / c / f"{k}.JPEG").write_bytes(solid_jpeg(COLOURS[k]))
    index, _ = load_index(str(root), None, EXTS, None, use_cache=False)
    path = index.path(0)
    good, st = open(path, "rb").read(), os.stat(path)
    with open(path, "r+b") as f:
        f.write(b"\0" * 64)  # bit rot, same size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    q = QuarantineLog(str(tmp_path), index.fingerprint, index.path, index.content_stamp)
    q.add(Quarantined(0, path, "cannot decode"), 0)
    time.sleep(0.05)  # past the kernel's coarse clock tick: a restore is a human's later act
    with open(path, "r+b") as f:  # restored in place, its old mtime put back
        f.write(good)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    again = QuarantineLog(str(tmp_path), index.fingerprint, index.path, index.content_stamp)
    again.load()
    assert not again.records


def _load(root: str, section: str = "dataset"):
    from prefetchd.sources.dataset import DatasetError

    try:
        return load_index(root, None, EXTS, None, use_cache=False, section=section)[0]
    except DatasetError as e:
        return str(e)


def test_imagenet_files_among_class_folders_are_refused_and_val_in_class_folders_or_tars_is_taken(imagenet, tmp_path):
    """The usual recipe run without its first rm (the find loop extracts ILSVRC2012_img_train.tar
    too, into ILSVRC2012_img_train/ of class tars) gave a class of no images sorted first, every
    label shifted, rc 0 and a warning; the flat val folder left in train/ was a class of its own.
    Per-class validation tars (val/<wnid>/ILSVRC2012_val_* packed per class) were refused as
    "ImageNet's download folder". Class tars n1.tar and n1.TAR were two classes of one name. The
    train tar left beside the folders it was extracted to refused the ImageFolder as a mixture."""
    import shutil

    root = _copytree(imagenet.train_folder, str(tmp_path / "a"))
    shutil.copytree(imagenet.train_tars, os.path.join(root, "ILSVRC2012_img_train"))
    assert "the folder ILSVRC2012_img_train is not a class: no images, only 4 tar file(s) (ImageNet's train tar" in _load(
        root)
    root = _copytree(imagenet.train_folder, str(tmp_path / "b"))
    shutil.copytree(imagenet.val_folder, os.path.join(root, "val"))
    assert "1 of its 5 folders are not classes: val (a flat set of validation images" in _load(root)
    valprep, valtars = tmp_path / "valprep", tmp_path / "valtars"
    for name in sorted(os.listdir(imagenet.val_folder)):
        w = os.path.join(valprep, _wnid(imagenet, name))
        os.makedirs(w, exist_ok=True)
        shutil.copy(os.path.join(imagenet.val_folder, name), w)
    os.makedirs(valtars)
    for w in sorted(os.listdir(valprep)):
        with open(valtars / f"{w}.tar", "wb") as f:
            f.write(tar_of([(n, (valprep / w / n).read_bytes()) for n in sorted(os.listdir(valprep / w))]))
    a, b = _load(str(valprep), "validation"), _load(str(valtars), "validation")
    assert not isinstance(a, str) and not isinstance(b, str), (a, b)
    assert a.fingerprint == b.fingerprint and len(a) == 8
    twins = _copytree(imagenet.train_tars, str(tmp_path / "twins"))
    first = sorted(os.listdir(twins))[0]
    shutil.copy(os.path.join(twins, first), os.path.join(twins, first[:-4] + ".TAR"))
    assert f"more than one tar of the class {first[:-4]}" in _load(twins)
    left = _copytree(imagenet.train_folder, str(tmp_path / "left"))
    shutil.copy(imagenet.train_tar, left)  # tar xf ILSVRC2012_img_train.tar, no rm
    index = _load(left)
    assert not isinstance(index, str) and index.fingerprint == _load(imagenet.train_folder).fingerprint, index
    disk = tmp_path / "disk"  # a data disk's root: lost+found is no class folder to keep the tar beside
    os.makedirs(disk / "lost+found")
    shutil.copy(imagenet.train_tar, disk)
    assert "it looks like ImageNet's download folder" in _load(str(disk))


def _wnid(imagenet, name: str) -> str:
    return imagenet.val_wnid[name]


def test_a_sighup_rescan_says_an_archive_rewritten_in_place_is_waited_on_not_unchanged(tmp_path):
    """The daemon's batches from an archive rewritten in place wait ("restart the daemon"); a
    SIGHUP rescan found the same samples (same names, same labels) and said "unchanged": the
    archives whose identity moved are named, and the restart they need."""
    import logging

    from prefetchd.daemon.rescan import _verdict

    root = str(tmp_path / "tars")
    class_tars(root, classes=2, per_class=2)
    index, _ = load_index(root, None, EXTS, None, use_cache=False)
    path = os.path.join(root, "n1.tar")
    data = open(path, "rb").read()
    time.sleep(0.05)
    with open(path, "r+b") as f:
        f.write(data)
    level, line = _verdict(index, lambda: False, lambda: load_index(root, None, EXTS, None, use_cache=False)[0])
    assert level == logging.WARNING and "the same 4 samples, but 1 archive(s) changed" in line, line
    assert path in line and "restart the daemon" in line, line
    level, line = _verdict(index, lambda: False, lambda: index)
    assert level == logging.INFO and "unchanged, 4 samples" in line


def test_a_mac_zips_macosx_folder_is_not_class_0(tmp_path):
    """Unzipping a zip made on a Mac leaves __MACOSX/<class>/._<image> beside the classes: it sorted
    first, so as a class (of ._ files, or of none once those are skipped) it took label 0 and
    shifted every label after it, rc 0 (torchvision's ImageFolder does the same, then fails to
    decode). It is skipped, and said; beside class tars it is a leftover, not a mixture."""
    root = tmp_path / "unzipped"
    for c in ("cats", "dogs"):
        os.makedirs(root / c)
        os.makedirs(root / "__MACOSX" / c)
        (root / c / "1.jpg").write_bytes(solid_jpeg(COLOURS[0]))
        (root / "__MACOSX" / c / "._1.jpg").write_bytes(_APPLEDOUBLE)
    index = _load(str(root))
    assert not isinstance(index, str) and index.classes == ("cats", "dogs"), index
    assert any("__MACOSX (a Mac zip's metadata folder" in s for s in index.skipped), index.skipped
    tars = tmp_path / "tars"
    class_tars(str(tars), classes=2, per_class=2)
    os.makedirs(tars / "__MACOSX")
    index = _load(str(tars))
    assert not isinstance(index, str) and index.classes == ("n0", "n1"), index


@pytest.mark.parametrize("which", ["train_tar", "train_tars", "train_folder"])
def test_the_train_set_given_as_the_validation_set_is_refused_in_one_line(imagenet, tmp_path, which):
    """validation.root set to the train tar itself, its class tars or its extracted folder (no
    devkit) validates on the images trained on: refused, in one line naming validation.root."""
    rc, out = _check(tmp_path, imagenet.train_tar, validation={"enabled": True, "root": getattr(imagenet, which),
                                                                "batch_size": 2})
    assert rc == 78 and "validation.root" in out and "holds the train set's images" in out, out
    assert len([ln for ln in out.splitlines() if "configuration error" in ln]) == 1, out


def test_the_daemon_refuses_the_train_set_as_the_validation_set(imagenet, tmp_path, daemon_factory):
    cfg = small_config(tmp_path, imagenet.train_tar, loader={"batch_size": 2},
                       validation={"enabled": True, "root": imagenet.train_folder, "batch_size": 2})
    d = daemon_factory(cfg)
    assert d.proc.wait(120) == 78 and "holds the train set's images" in d.log(), d.log()[-2000:]


def test_the_val_tar_left_beside_the_images_extracted_from_it_is_not_read(imagenet, tmp_path):
    """The usual recipe (mv ILSVRC2012_img_val.tar val/; cd val; tar xf ILSVRC2012_img_val.tar)
    leaves the tar beside its images: the images are the validation set, the tar is not read (one
    warning, and ``check`` lists it as left out), never "a folder of class tars (a train set)"."""
    val = tmp_path / "val"
    val.mkdir()
    shutil.copy(imagenet.val_tar, val / "ILSVRC2012_img_val.tar")
    with tarfile.open(val / "ILSVRC2012_img_val.tar") as tf:
        tf.extractall(val, filter="data")
    rc, out = _check(tmp_path, imagenet.train_tar, validation={"enabled": True, "root": str(val),
                                                                "devkit": imagenet.devkit_tgz, "batch_size": 2})
    assert rc == 0 and "validation: 8 samples" in out, out
    assert "not read: ILSVRC2012_img_val.tar (ImageNet's download tar beside the images extracted from it" in out, out
    assert "class tars (a train set)" not in out


def test_a_download_folder_as_validation_root_names_dataset_root_for_the_train_tar(imagenet, tmp_path):
    val = tmp_path / "download"
    val.mkdir()
    shutil.copy(imagenet.val_tar, val / "ILSVRC2012_img_val.tar")
    rc, out = _check(tmp_path, imagenet.train_tar, validation={"enabled": True, "root": str(val), "batch_size": 2})
    assert rc == 78 and "looks like ImageNet's download folder" in out, out
    assert "set dataset.root to the train tar" in out and "set validation.root to the train tar" not in out, out


def test_images_a_short_ground_truth_leaves_out_are_said_by_every_check(imagenet, tmp_path):
    """A devkit whose ground truth is shorter than the val tar: the images it does not label are
    left out, and every ``check`` says which, not only the first (the scan's)."""
    devkit = tmp_path / "devkit"
    shutil.copytree(imagenet.devkit_folder, devkit)
    truth = next(devkit.rglob("ILSVRC2012_validation_ground_truth.txt"))
    truth.write_text("".join(truth.read_text().splitlines(keepends=True)[:6]))
    sections = {"validation": {"enabled": True, "root": imagenet.val_tar, "devkit": str(devkit), "batch_size": 2}}
    outs = []
    for k in range(2):
        (tmp_path / str(k)).mkdir()
        cfg = small_config(tmp_path / str(k), imagenet.train_tar, loader={"batch_size": 2},
                           dataset={"cache_dir": str(tmp_path / "cache")}, **sections)
        r = subprocess.run([sys.executable, "-m", "prefetchd", "check", "--config", cfg], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        outs.append(r.stdout)
    assert "scanned" in outs[0] and "cached index" in outs[1], outs
    for out in outs:
        assert "validation: 6 samples" in out, out
        skipped = [ln for ln in out.splitlines() if ln.startswith("  skipped") and "ground truth" in ln]
        assert len(skipped) == 2 and "ILSVRC2012_val_0000000" in skipped[0], out
