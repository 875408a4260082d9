from __future__ import annotations

import json
import os

import numpy as np
import pytest

from prefetchd.format import batchfile as bf
from prefetchd.format import progress as pf


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


def test_val_lanes_have_their_own_batch_and_progress_names():
    lane = pf.lane("val", 3)
    assert lane == pf.VAL_LANE + 3 and pf.split_lane(lane) == ("val", 3) and pf.split_lane(3) == ("train", 3)
    assert bf.batch_name(lane, 2, 5) == "v0003-e000002-b00000005.batch"
    assert bf.parse_name("v0003-e000002-b00000005.batch") == (lane, 2, 5)
    assert bf.parse_name("r0003-e000002-b00000005.batch") == (3, 2, 5)
    assert pf.progress_name(lane) == "progress-v0003.json" and pf.parse_progress_name("progress-v0003.json") == lane
    assert pf.parse_progress_name("progress-r0003.json") == 3 and pf.parse_progress_name("progress-x0003.json") is None
    with pytest.raises(ValueError):
        pf.lane("test", 0)


def test_progress_reading_flag():
    p = pf.Progress(rank=pf.lane("val", 0), epoch=1, batch=0, reading=False)
    assert pf.decode(pf.encode(p)) == p
    assert pf.decode(b'{"format": "prefetchd-progress", "version": 1, "rank": 0, "epoch": 0, "batch": 0}').reading
    with pytest.raises(pf.ProgressError, match="'reading' must be true or false"):
        pf.decode(b'{"format": "prefetchd-progress", "version": 1, "rank": 0, "epoch": 0, "batch": 0, "reading": 1}')


def test_metrics_carry_what_the_status_says_of_bytes_waiting_and_the_dataset():
    pytest.importorskip("prometheus_client")
    from prefetchd.daemon.metrics import families

    rec = {"blocked": None, "val_blocked": "buffer.max_bytes (8.0 GiB) reached: ...", "train_bytes": 7 << 30,
           "val_bytes": 1 << 30, "dataset_unreadable": "the dataset root /data is unreadable", "ranks": {}}
    got = {f.name: [s.value for s in f.samples] for f in families(rec)}
    assert got["prefetchd_blocked"] == [0] and got["prefetchd_val_blocked"] == [1]
    assert got["prefetchd_train_bytes"] == [7 << 30] and got["prefetchd_val_bytes"] == [1 << 30]
    assert got["prefetchd_dataset_unreadable"] == [1]
    rec.update(val_blocked=None, val_bytes=None, dataset_unreadable=None, blocked="the buffer filesystem has ...")
    got = {f.name: [s.value for s in f.samples] for f in families(rec)}
    assert got["prefetchd_blocked"] == [1] and got["prefetchd_dataset_unreadable"] == [0]
    assert "prefetchd_val_blocked" not in got and "prefetchd_val_bytes" not in got  # no validation stream


def test_metrics_show_val_lanes_apart():
    pytest.importorskip("prometheus_client")
    from prefetchd.daemon.metrics import families

    rec = {"ranks": {"0": {"position": [1, 2]}},
           "val_ranks": {"0": {"position": [3, 1], "ready": 2, "active": True}}}
    got = {f.name: [(s.labels, s.value) for s in f.samples] for f in families(rec)}
    assert got["prefetchd_val_rank_pass"] == [({"rank": "0"}, 3)]
    assert got["prefetchd_val_rank_reading"] == [({"rank": "0"}, 1)]
    assert got["prefetchd_rank_epoch"] == [({"rank": "0"}, 1)]


def test_a_resumed_segments_batches_have_names_and_fingerprints_of_their_own():
    name = bf.batch_name(3, 2, 5, offset=1234)
    assert name == "r0003-e000002-o0000001234-b00000005.batch"
    assert bf.parse_name(name) == (3, 2, 5, 1234) and bf.batch_name(*bf.parse_name(name)) == name
    assert bf.batch_name(3, 2, 5, 0) == "r0003-e000002-b00000005.batch"  # a whole epoch's name is unchanged
    assert bf.parse_name("r0003-e000002-o0000000000-b00000005.batch") is None  # offset 0 is never written out
    fp = bf.fingerprint_u64("9f2c0011aabbccdd")
    assert bf.segment_fingerprint(fp, 2, 0) == fp
    seg = {bf.segment_fingerprint(fp, e, o) for e in (2, 3) for o in (1, 1234)}
    assert len(seg) == 4 and fp not in seg  # each segmentation is a stream of its own


def test_progress_offset_is_optional_and_checked(tmp_path):
    p = pf.Progress(rank=0, epoch=1, batch=2, offset=36)
    path = pf.write(str(tmp_path), p)
    assert pf.read(path).offset == 36
    d = json.loads(pf.encode(p))
    d.pop("offset")
    assert pf.decode(json.dumps(d).encode()).offset == 0  # written by an older client: a whole epoch
    for bad in (-1, "36", 1.5, True):
        with pytest.raises(pf.ProgressError, match="'offset'"):
            pf.decode(json.dumps({**d, "offset": bad}).encode())


def test_a_task_crosses_the_worker_pipe_with_every_field():
    """Tasks pickle their indices as bytes (cheap in the daemon's loop): every other field, the
    resumed segment's ``offset`` included, must arrive as it was sent."""
    import pickle

    from prefetchd.executors.worker import Task

    t = Task(3, 7, 11, 40, np.arange(5, dtype=np.int64) * 3, ((9, "crashed twice"),), 123456, offset=24)
    back = pickle.loads(pickle.dumps(t, protocol=pickle.HIGHEST_PROTOCOL))
    assert {f: getattr(back, f) for f in ("rank", "epoch", "batch", "batches_in_epoch", "crashers", "budget",
                                          "offset")} == \
        {"rank": 3, "epoch": 7, "batch": 11, "batches_in_epoch": 40, "crashers": ((9, "crashed twice"),),
         "budget": 123456, "offset": 24}
    assert back.indices.dtype == np.int64 and back.indices.flags.writeable and back.indices.tolist() == [0, 3, 6, 9, 12]
