from __future__ import annotations

import os

import numpy as np
import pytest

from prefetchd import batchfile as bf
from prefetchd import progress as pf


def _write(tmp_path, n=3, h=8, w=8):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (n, h, w, 3), dtype=np.uint8)
    idx = np.arange(n) * 10
    labels = np.arange(n) % 2
    replaced = np.full(n, -1)
    replaced[1] = 99
    meta = bf.BatchMeta(rank=1, epoch=2, batch=3, batches_in_epoch=9, fingerprint=0xABCDEF)
    path = tmp_path / bf.batch_name(1, 2, 3)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    size = bf.write_batch(fd, meta, idx, labels, replaced, images)
    os.close(fd)
    return path, size, images, idx, labels, replaced


def test_batch_round_trip(tmp_path):
    path, size, images, idx, labels, replaced = _write(tmp_path)
    assert size == os.path.getsize(path) == bf.Layout(3, 8, 8).file_size
    b = bf.read_file(str(path))
    assert (b.rank, b.epoch, b.batch, b.batches_in_epoch, b.fingerprint) == (1, 2, 3, 9, 0xABCDEF)
    assert np.array_equal(b.images, images) and np.array_equal(b.indices, idx)
    assert np.array_equal(b.labels, labels) and np.array_equal(b.replaced, replaced)
    assert b.flags & bf.FLAG_REPLACED
    assert bf.Layout(3, 8, 8).images_offset % bf.IMAGE_ALIGN == 0
    assert bf.parse_name(path.name) == (1, 2, 3)


@pytest.mark.parametrize("where", [30, 200, -1])
def test_a_flipped_byte_fails_the_checksum(tmp_path, where):
    path, *_ = _write(tmp_path)
    data = bytearray(path.read_bytes())
    data[where] ^= 0x40
    with pytest.raises(bf.BatchFileError):
        bf.parse(data)


def test_truncated_and_foreign_files_are_refused(tmp_path):
    path, size, *_ = _write(tmp_path)
    data = path.read_bytes()
    with pytest.raises(bf.BatchFileError, match="torn or truncated"):
        bf.parse(data[:-1])
    with pytest.raises(bf.BatchFileError, match="shorter than"):
        bf.parse(data[:50])
    with pytest.raises(bf.BatchFileError, match="bad magic"):
        bf.parse(b"GIF89a" + data[6:])
    with pytest.raises(bf.BatchFileError, match="version"):
        bf.parse(data[:8] + b"\x09\x00" + data[10:])


def test_progress_round_trip_and_garbage(tmp_path):
    p = pf.Progress(rank=2, epoch=1, batch=7, fingerprint="ab", pid=3, time=1.5, wait_s=0.25, batches=8)
    path = pf.write(str(tmp_path), p)
    assert pf.read(path) == p
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
    for bad in (b"", b"{", b"[]", b'{"format": "prefetchd-progress", "version": 1, "rank": 0, "epoch": -1, "batch": 0}',
                b'{"format": "other"}', b"\xff\xfe"):
        with open(path, "wb") as f:
            f.write(bad)
        with pytest.raises(pf.ProgressError):
            pf.read(path)
