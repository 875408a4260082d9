"""The batch file of several views walked at random (hypothesis): generated batches of 1 to 6
views of random shapes and sample counts round-trip through ``batchfile.encode``/``parse`` view
for view against a pure model (the arrays themselves), and every damage a torn write or a flipped
bit can do to the header and the view table is refused cleanly: never an exception of another
kind, never a view with other pixels."""

from __future__ import annotations

import struct

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from prefetchd.format import batchfile, jpegbatch  # noqa: E402

_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def batches(draw):
    """(meta, indices, labels, replaced, views): a batch as the daemon hands it to ``encode``."""
    n = draw(st.integers(1, 5))
    k = draw(st.integers(1, 6))
    shapes = [(draw(st.integers(1, 12)), draw(st.integers(1, 12))) for _ in range(k)]
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    views = [rng.integers(0, 256, (n, h, w, 3), dtype=np.uint8) for h, w in shapes]
    meta = batchfile.BatchMeta(rank=draw(st.integers(0, 2**31 - 1)), epoch=draw(st.integers(0, 2**31 - 1)),
                               batch=draw(st.integers(0, 2**40)), batches_in_epoch=draw(st.integers(0, 2**31 - 1)),
                               fingerprint=draw(st.integers(0, 2**64 - 1)))
    indices = rng.integers(0, 2**40, n, dtype=np.int64)
    labels = rng.integers(0, 21841, n, dtype=np.int64)
    replaced = np.where(rng.random(n) < 0.3, rng.integers(0, 2**40, n), -1).astype(np.int64)
    return meta, indices, labels, replaced, views


def _bytes(b) -> bytes:
    meta, indices, labels, replaced, views = b
    return b"".join(bytes(p) for p in batchfile.encode(meta, indices, labels, replaced, views))


def _same_or_refused(buf: bytes, views, verify: bool) -> batchfile.Batch | None:
    """Parse ``buf``: a BatchFileError (None), or a batch whose every view is the model's."""
    try:
        got = jpegbatch.parse_any(buf, verify=verify)  # what the client calls
    except batchfile.BatchFileError:
        return None
    assert isinstance(got, batchfile.Batch)
    assert len(got.views) == len(views)
    for g, w in zip(got.views, views, strict=True):
        assert g.shape == w.shape and np.array_equal(g, w)
    return got


@_SETTINGS
@given(batches())
def test_every_generated_batch_of_views_decodes_to_its_views(b):
    meta, indices, labels, replaced, views = b
    data = _bytes(b)
    got = batchfile.parse(data)
    assert (got.rank, got.epoch, got.batch, got.batches_in_epoch, got.fingerprint) == (
        meta.rank, meta.epoch, meta.batch, meta.batches_in_epoch, meta.fingerprint)
    assert [v.shape for v in got.views] == [v.shape for v in views]
    for g, w in zip(got.views, views, strict=True):
        assert np.array_equal(g, w)
    assert np.array_equal(got.images, views[0])
    assert np.array_equal(got.indices, indices) and np.array_equal(got.labels, labels)
    assert np.array_equal(got.replaced, replaced)
    assert got.flags == (batchfile.FLAG_REPLACED if (replaced >= 0).any() else 0)
    assert got.file_size == len(data) == batchfile.views_file_size(len(indices), [v.shape[1:3] for v in views])
    # the documented layout, byte for byte: version, view count, the table, 4096-aligned sections
    version, k = struct.unpack_from("<H", data, 8)[0], struct.unpack_from("<H", data, 70)[0]
    assert (version, k) == ((1, 0) if len(views) == 1 else (2, len(views)))
    at = 128 + 24 * len(indices)
    prev_end = at + (24 * len(views) if len(views) > 1 else 0)
    for v, w in enumerate(views):
        if len(views) > 1:
            h, wd, off, nb = struct.unpack_from("<IIQQ", data, at + 24 * v)
            assert (h, wd, nb) == (w.shape[1], w.shape[2], w.nbytes)
        else:
            off = struct.unpack_from("<Q", data, 96)[0]
        assert off % 4096 == 0 and prev_end <= off < prev_end + 4096
        assert data[off: off + w.nbytes] == w.tobytes()
        prev_end = off + w.nbytes
    assert prev_end == len(data)


@_SETTINGS
@given(batches(), st.data())
def test_every_truncation_is_refused(b, data):
    views = b[4]
    full = _bytes(b)
    # every cut inside the header and the view table, and some past them
    cuts = set(range(0, min(len(full), 128 + 24 * len(b[1]) + 24 * len(views) + 1)))
    cuts |= set(data.draw(st.lists(st.integers(0, len(full) - 1), max_size=8)))
    for cut in sorted(cuts):
        for verify in (True, False):
            with pytest.raises(batchfile.BatchFileError):
                jpegbatch.parse_any(full[:cut], verify=verify)


@_SETTINGS
@given(batches())
def test_every_bit_flip_of_the_header_and_view_table_is_refused_or_changes_no_pixel(b):
    views = b[4]
    full = _bytes(b)
    end = 128 + 24 * len(b[1]) + (24 * len(views) if len(views) > 1 else 0)
    for byte in list(range(128)) + list(range(128 + 24 * len(b[1]), end)):
        for bit in range(8):
            bad = bytearray(full)
            bad[byte] ^= 1 << bit
            bad = bytes(bad)
            with pytest.raises(batchfile.BatchFileError):  # the checksum covers the header and table
                jpegbatch.parse_any(bad, verify=True)
            # unverified (PrefetchClient(verify=False)): refused, or the same pixels
            _same_or_refused(bad, views, verify=False)


_FIELDS = {  # offset: struct format of the header fields a writer of another version might set
    8: "<H", 10: "<H", 52: "<I", 56: "<I", 60: "<I", 64: "<I", 68: "<B", 69: "<B", 70: "<H",
    72: "<Q", 80: "<Q", 88: "<Q", 96: "<Q", 104: "<Q", 112: "<Q",
}


@_SETTINGS
@given(batches(), st.data())
def test_header_fields_rewritten_to_any_value_are_refused_or_change_no_pixel(b, data):
    """A foreign or damaged writer: one or several header or view-table fields set to values of
    its choosing (a version 2 file said to be version 1, a view count of 1, swapped heights...)."""
    views = b[4]
    full = bytearray(_bytes(b))
    n = len(b[1])
    spots = dict(_FIELDS)
    if len(views) > 1:
        for v in range(len(views)):
            at = 128 + 24 * n + 24 * v
            spots.update({at: "<I", at + 4: "<I", at + 8: "<Q", at + 16: "<Q"})
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.sampled_from(sorted(spots)))
        fmt = spots[at]
        size = struct.calcsize(fmt)
        value = data.draw(st.one_of(st.integers(0, 8), st.integers(0, 2 ** (8 * size) - 1),
                                    st.just(struct.unpack_from(fmt, full, at)[0] + 1)).map(
            lambda x, s=size: x % 2 ** (8 * s)))
        struct.pack_into(fmt, full, at, value)
    _same_or_refused(bytes(full), views, verify=False)
