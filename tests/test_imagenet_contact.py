"""ImageNet's tars at first contact (issue 28): archives rewritten in place, leftovers, mistakes.

Each test is a case a new user meets with the files and habits of real machines; each failed on
the tree before the fix (wrong pixels or labels without a word, or a traceback)."""

from __future__ import annotations

import io
import json
import os
import tarfile

import numpy as np
import pytest
from conftest import small_config, wait_until
from PIL import Image

from prefetchd.core.dataset import load_index

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
    with PrefetchClient(cfg, as_numpy=True, timeout=4) as c:
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
    from prefetchd.core.indexbase import StorageChanged

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
