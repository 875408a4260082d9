"""Several views of one sample, the pure parts: the batch file's version 2 (a view table, one
image section per view) beside version 1, ``augment.views`` as configured and as made, and a
user transform's tuple of views."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from prefetchd.core.augment import ops, transform, views
from prefetchd.core.config import AugmentConfig, Config, ConfigError
from prefetchd.format import batchfile, jpegbatch
from prefetchd.tools.samples import jpeg_bytes, photo_like

DINO_SMALL = [{"count": 2, "output_size": 64, "rrc_scale": [0.4, 1.0]},
              {"count": 6, "output_size": 32, "rrc_scale": [0.05, 0.4], "brightness": 0.4, "saturation": 0.2}]


def _arrays(n: int, shapes, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (n, h, w, 3), dtype=np.uint8) for h, w in shapes]


def _file(images, n: int = 5, meta=None) -> bytes:
    meta = meta or batchfile.BatchMeta(3, 1, 2, 9, 0x1234)
    i = np.arange(n, dtype=np.int64)
    return b"".join(bytes(p) for p in batchfile.encode(meta, i + 10, i % 4, np.where(i == 2, 7, -1), images))


# --- the batch file -------------------------------------------------------------------------------------


def test_a_batch_of_several_views_round_trips_each_view_with_its_own_shape():
    shapes = [(16, 16), (8, 12), (8, 12), (5, 3)]
    imgs = _arrays(5, shapes)
    data = _file(imgs)
    b = batchfile.parse(data)
    assert b.shapes == tuple(shapes) and len(b.views) == 4 and b.images is b.views[0]
    for got, want in zip(b.views, imgs, strict=True):
        assert np.array_equal(got, want)
    assert b.indices.tolist() == [10, 11, 12, 13, 14] and b.replaced.tolist() == [-1, -1, 7, -1, -1]
    assert (b.rank, b.epoch, b.batch, b.batches_in_epoch, b.fingerprint) == (3, 1, 2, 9, 0x1234)
    assert struct.unpack_from("<H", data, 8)[0] == 2 and struct.unpack_from("<H", data, 70)[0] == 4
    assert len(data) == b.file_size == batchfile.views_file_size(5, shapes) == jpegbatch.expected_size(data[:128])
    assert jpegbatch.parse_any(np.frombuffer(data, np.uint8)).shapes == tuple(shapes)
    for v in range(4):  # each section starts aligned
        assert (b.views[v].ctypes.data - b.indices.ctypes.data + batchfile.HEADER_SIZE) % batchfile.IMAGE_ALIGN == 0


def _v1_by_the_docstring(meta: batchfile.BatchMeta, idx, labels, replaced, images) -> bytes:
    """A version 1 file written from the layout table alone, as a writer in another language (or
    this package before views existed) writes it."""
    n, h, w, c = images.shape
    arrays = b"".join(np.asarray(a, "<i8").tobytes() for a in (idx, labels, replaced))
    imo = -(-(128 + len(arrays)) // 4096) * 4096
    fsize = imo + images.nbytes

    def header(checksum):
        return struct.pack("<8sHHIQQIIQIIIIIBBHQQQQQQQ", b"PFDBATCH", 1, 128, int((replaced >= 0).any()), checksum,
                           meta.fingerprint, meta.rank, meta.epoch, meta.batch, meta.batches_in_epoch, n, h, w, c,
                           1, 1, 0, 128, 128 + 8 * n, 128 + 16 * n, imo, images.nbytes, fsize, 0)
    body = arrays + bytes(imo - 128 - len(arrays)) + images.tobytes()
    import xxhash

    return header(xxhash.xxh3_64_intdigest(header(0) + body)) + body


def test_a_single_view_batch_is_still_version_1_byte_for_byte_and_old_files_read():
    meta = batchfile.BatchMeta(0, 4, 5, 6, 0xfeed)
    (img,) = _arrays(5, [(16, 16)])
    i = np.arange(5, dtype=np.int64)
    old = _v1_by_the_docstring(meta, i + 10, i % 4, np.where(i == 2, 7, -1), img)
    assert _file(img, meta=meta) == old == _file([img], meta=meta)
    b = batchfile.parse(old)
    assert b.shapes == ((16, 16),) and np.array_equal(b.images, img) and len(b.views) == 1
    assert batchfile.max_file_size(5, 16, 16) == len(old) == batchfile.views_file_size(5, [(16, 16)])


def test_a_reader_of_version_1_alone_refuses_a_batch_of_several_views_by_its_version():
    data = _file(_arrays(5, [(16, 16), (8, 8)]))
    with pytest.raises(batchfile.BatchFileError, match="version 2 is not supported .*knows 1"):
        batchfile.check_header(memoryview(data), batchfile.HEADER, batchfile.MAGIC, batchfile.VERSION, "")


def test_every_truncation_of_a_batch_of_views_is_refused():
    data = _file(_arrays(3, [(8, 8), (4, 4), (4, 4)]), n=3)
    for cut in list(range(0, 300, 7)) + [len(data) - 4096, len(data) - 1]:
        with pytest.raises(batchfile.BatchFileError):
            batchfile.parse(data[:cut])


@pytest.mark.parametrize("where, value", [
    (70, 4),            # the header's view count, one more...
    (70, 2),            # ...or one less than the table holds
    (70, 1),            # a version 2 file of one view
    (128 + 24 * 5 + 24 + 4, 9),  # view 1's width in the table
    (128 + 24 * 5 + 24 + 8, 0),  # view 1's offset in the table
])
def test_a_view_table_that_disagrees_with_itself_is_refused_even_unverified(where, value):
    data = bytearray(_file(_arrays(5, [(8, 8), (4, 4), (4, 4)])))
    struct.pack_into("<H" if where == 70 else "<I", data, where, value)
    with pytest.raises(batchfile.BatchFileError):
        batchfile.parse(bytes(data), verify=False)


def test_a_flipped_pixel_in_any_view_fails_the_checksum():
    data = _file(_arrays(5, [(8, 8), (4, 4)]))
    b = batchfile.parse(data)
    for v in b.views:
        at = v.ctypes.data - b.indices.ctypes.data + batchfile.HEADER_SIZE + 7
        bad = bytearray(data)
        bad[at] ^= 1
        with pytest.raises(batchfile.BatchFileError, match="checksum"):
            batchfile.parse(bytes(bad))


def test_views_of_another_sample_count_are_refused_at_encode():
    a, b = _arrays(5, [(8, 8)])[0], _arrays(4, [(8, 8)])[0]
    with pytest.raises(ValueError, match="every view must have the batch's 5 samples"):
        _file([a, b])


# --- augment.views, the config ------------------------------------------------------------------------


@pytest.mark.parametrize("views_, key, words", [
    ([{"count": 2}], "augment.views[0].output_size", "is required"),
    ([{"count": 2, "output_size": 64, "rrc_scal": [0.1, 1]}], "augment.views[0].rrc_scal",
     "did you mean 'augment.views[0].rrc_scale'"),
    ([{"count": 0, "output_size": 64}], "augment.views[0].count", ""),
    ([{"count": 2, "output_size": 64, "rrc_scale": [0.5]}], "augment.views[0].rrc_scale", "two numbers"),
    ([{"count": 2, "output_size": 64, "brightness": 2}], "augment.views[0].brightness", ""),
    ([{"output_size": 64}], "augment.views", "makes 1 view: list two or more"),
    ({"count": 2, "output_size": 64}, "augment.views", "must be a list of view groups"),
    (["big"], "augment.views[0]", "must be a mapping"),
])
def test_bad_views_are_one_line_errors_naming_the_key(views_, key, words):
    with pytest.raises(ConfigError) as e:
        AugmentConfig(views=views_)
    assert str(e.value).startswith(key) and words in str(e.value) and "\n" not in str(e.value)


def test_views_are_refused_beside_a_transform_and_with_hybrid_decode():
    with pytest.raises(ConfigError, match=r"^augment.views and augment.transform are exclusive"):
        AugmentConfig(views=DINO_SMALL, transform="m:f")
    with pytest.raises(ConfigError, match=r"^augment.decode must be cpu with augment.views"):
        AugmentConfig(views=DINO_SMALL, decode="hybrid")
    with pytest.raises(ConfigError, match=r"^augment.lighting is not applied to augment.views"):
        AugmentConfig(views=DINO_SMALL, lighting=0.1)
    for extra in ({"policy": "randaugment"}, {"random_erasing": {"p": 0.25}}, {"ops": {"vflip": 0.5}}):
        (k, _), = extra.items()  # each view group has its own (tests/test_views_policies.py)
        with pytest.raises(ConfigError, match=rf"^augment.{k} is not applied to augment.views"):
            AugmentConfig(views=DINO_SMALL, **extra)


@pytest.mark.parametrize("section", [{"flip": False}, {"brightness": 0.3}, {"contrast": 0.3}, {"saturation": 0.3},
                                     {"rrc_scale": [0.3, 1.0]}, {"rrc_ratio": [0.5, 2.0]}])
def test_the_sections_crop_flip_and_jitter_beside_views_are_refused_not_ignored(section):
    # seen: accepted, and the views were made with each group's own (flip: false at the section still
    # flipped every view; a section brightness: 0.4 jittered none), with a new stream fingerprint
    (k, v), = section.items()
    cfgs = views.view_configs(AugmentConfig(views=DINO_SMALL))
    assert all(getattr(c, k) != (tuple(v) if isinstance(v, list) else v) for c in cfgs)  # what the views use
    with pytest.raises(ConfigError) as e:
        AugmentConfig(views=DINO_SMALL, **section)
    said = str(e.value)
    assert said.startswith(f"augment.{k} is not applied to augment.views") and f"set {k} in each group" in said
    assert "\n" not in said
    AugmentConfig(views=DINO_SMALL, flip=True, rrc_scale=[0.08, 1.0], interpolation="bicubic")  # the defaults pass


def test_views_are_in_the_stream_fingerprint_and_configs_without_them_keep_theirs():
    assert "views" not in AugmentConfig().stream_dict()
    assert AugmentConfig(views=[]).stream_dict() == AugmentConfig().stream_dict()
    a, b = AugmentConfig(views=DINO_SMALL).stream_dict(), AugmentConfig(views=DINO_SMALL[:1] * 2).stream_dict()
    assert a["views"] != b["views"] and a != AugmentConfig().stream_dict()


def test_the_validation_stream_keeps_one_eval_crop_whatever_the_views():
    from prefetchd.core.configsections import DatasetConfig

    cfg = Config(dataset=DatasetConfig(root="/tmp"), augment=AugmentConfig(views=DINO_SMALL))
    assert cfg.val_augment().views == () and views.stream_shapes(cfg.val_augment()) == ((224, 224),)


# --- augment.views, the pixels --------------------------------------------------------------------------


def _jpeg(w=200, h=150, seed=0) -> bytes:
    return jpeg_bytes(photo_like(np.random.default_rng(seed), w, h), np.random.default_rng(seed))


def test_each_view_has_its_size_and_is_a_pure_function_of_the_sample_and_view():
    cfg = AugmentConfig(views=DINO_SMALL)
    cfgs = views.view_configs(cfg)
    assert views.stream_shapes(cfg) == ((64, 64),) * 2 + ((32, 32),) * 6 and len(cfgs) == 8
    data = _jpeg()
    a = views.make_views(data, cfgs, 7, 0, 5)
    assert [v.shape for v in a] == [(64, 64, 3)] * 2 + [(32, 32, 3)] * 6 and all(v.dtype == np.uint8 for v in a)
    outs = [np.zeros_like(v) for v in a]
    views.make_views(data, cfgs, 7, 0, 5, outs)  # into the batch's slots, made again
    assert all(np.array_equal(x, y) for x, y in zip(a, outs, strict=True))
    # two views of one group differ (their own draws); another epoch, another crop
    assert not np.array_equal(a[0], a[1]) and not np.array_equal(a[2], a[3])
    b = views.make_views(data, cfgs, 7, 1, 5)
    assert not np.array_equal(a[0], b[0])


def test_a_view_is_the_random_resized_crop_of_its_parameters_and_its_own_key():
    from dataclasses import replace

    from prefetchd.core.augment import modes

    cfg = AugmentConfig(views=DINO_SMALL, decoder="pillow")
    data = _jpeg(seed=2)
    got = views.make_views(data, views.view_configs(cfg), 3, 1, 11)
    for v, group in ((1, DINO_SMALL[0]), (6, DINO_SMALL[1])):
        one = replace(AugmentConfig(mode="random_resized_crop", decoder="pillow"), output_size=group["output_size"],
                      rrc_scale=tuple(group["rrc_scale"]), brightness=group.get("brightness", 0.0),
                      saturation=group.get("saturation", 0.0))
        alone = modes.make_sample(data, one, modes.draws(3, 1, 11, v))
        # the views share one decode (reduced only as far as every view allows): within rounding
        diff = np.abs(alone.astype(int) - got[v].astype(int))
        assert diff.mean() < 6, (v, diff.mean())


# --- a user transform's tuple of views ------------------------------------------------------------------


def test_a_tuple_of_images_is_one_view_each_in_any_layout():
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 256, (48, 48, 3), dtype=np.uint8), rng.integers(0, 256, (24, 20, 3), dtype=np.uint8)
    got = transform.to_views((a, np.ascontiguousarray(b.transpose(2, 0, 1))), 64)
    assert np.array_equal(got[0], a) and np.array_equal(got[1], b)
    assert transform.to_views([a], 48)[0] is a  # a tuple of one is one view, output_size square
    with pytest.raises(transform.SizeError):
        transform.to_views([a], 64)


@pytest.mark.parametrize("output, words", [
    (lambda a, b: (a, b, b), "returned 3 view(s) (48x48, 24x20, 24x20) where the stream has 2 (48x48, 24x20"),
    (lambda a, b: a, "returned 1 view(s) (48x48) where the stream has 2"),
    (lambda a, b: (a, a), "returned view 1 of 48x48 where the stream's view 1 is 24x20"),
    (lambda a, b: (a, b.astype(np.float32)), "view 1 of 2: augment.transform returns float32 pixels"),
    (lambda a, b: (), "returns an empty tuple"),
])
def test_views_that_change_between_samples_say_what_changed(output, words):
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 256, (48, 48, 3), dtype=np.uint8), rng.integers(0, 256, (24, 20, 3), dtype=np.uint8)
    with pytest.raises(transform.OutputError) as e:
        transform.to_views(output(a, b), 48, ((48, 48), (24, 20)))
    assert words in str(e.value) and "\n" not in str(e.value)


VARYING = '''
import numpy as np


def make():
    def views(im):
        a = np.asarray(im.resize((32, 32)))
        small = 24 if im.size[0] % 2 else 20  # another size on images of even width
        return a, np.asarray(im.resize((small, small)))
    return views
'''


def test_the_probe_learns_the_views_and_refuses_a_transform_whose_views_vary(tmp_path):
    (tmp_path / "uv_vary.py").write_text(VARYING)
    t = transform.load(AugmentConfig(output_size=32, transform="uv_vary:make", transform_path=str(tmp_path)))
    odd, even = _jpeg(201, 150, 1), _jpeg(200, 150, 2)
    said = transform.probe(t, [(0, odd), (1, odd)], seed=1)
    assert t.shapes == ((32, 32), (24, 24)) and "2 views (32x32, 24x24) uint8" in said
    with pytest.raises(ConfigError) as e:
        transform.probe(t, [(0, odd), (1, even)], seed=1)
    assert "returned view 1 of 20x20 where the stream's view 1 is 24x24" in str(e.value)
    assert "(sample 1)" in str(e.value) and "\n" not in str(e.value)
    t.shapes = ((32, 32), (24, 24))  # a worker's, from the daemon: a sample that differs is a per-draw fault
    with pytest.raises(transform.OutputError, match="view 1 of 20x20"):
        t.make(even, 1, 0, 1)
    slots = (np.zeros((32, 32, 3), np.uint8), np.zeros((24, 24, 3), np.uint8))
    assert t.make(odd, 1, 0, 0, slots) is slots and slots[1].any()


def test_capacity_auto_counts_every_view_a_batch_holds():
    """``buffer.capacity: auto`` fits max_bytes with the batch's views, not with view 0 alone."""
    from prefetchd.core.configsections import BufferConfig, DatasetConfig, LoaderConfig
    from prefetchd.core.limits import Host
    from prefetchd.core.sizing import resolve

    host = Host(affinity=2, memory_total=64 << 30, fs_size=64 << 30)
    one = batchfile.max_file_size(32, 224, 224)

    def capacity(**augment) -> int:
        cfg = Config(dataset=DatasetConfig(root="/tmp"), loader=LoaderConfig(batch_size=32),
                     buffer=BufferConfig(capacity="auto", max_bytes=12 * one, refill_at=1),
                     augment=AugmentConfig(**augment))
        return resolve(cfg, host).cfg.buffer.capacity

    two = capacity(views=[{"count": 2, "output_size": 224}])
    assert capacity() == 12 and two == 6, (capacity(), two)


EMPTY_VIEW = '''
import numpy as np


def make():
    def views(im):
        a = np.asarray(im.resize((32, 32)))
        return a, a[:0]  # a crop that came out empty
    return views
'''


def test_a_transform_whose_view_is_empty_is_refused_at_start_not_retried_forever(tmp_path):
    # seen: the probe learnt "2 views (32x32, 0x32)", then every batch failed to be written
    # (TypeError: memoryview: cannot cast view with zeros in shape) and was retried without end
    (tmp_path / "uv_empty.py").write_text(EMPTY_VIEW)
    t = transform.load(AugmentConfig(output_size=32, transform="uv_empty:make", transform_path=str(tmp_path)))
    with pytest.raises(ConfigError) as e:
        transform.probe(t, [(0, _jpeg(201, 150, 1))], seed=1)
    assert str(e.value).startswith("augment.transform ") and "view 1 of 2" in str(e.value)
    assert "empty image (0x32)" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(transform.OutputError, match=r"empty image \(0x0\)"):
        transform.to_views(np.zeros((0, 0, 3), np.uint8), 32)


def test_a_transform_returning_more_views_than_a_batch_holds_is_refused_at_start(tmp_path):
    # seen: the probe learnt 65 views, then every batch failed to be written ("a batch holds 1 to
    # 64 views, got 65") and was retried without end
    (tmp_path / "uv_many.py").write_text(EMPTY_VIEW.replace("return a, a[:0]", "return (a,) * 65"))
    t = transform.load(AugmentConfig(output_size=32, transform="uv_many:make", transform_path=str(tmp_path)))
    with pytest.raises(ConfigError) as e:
        transform.probe(t, [(0, _jpeg(201, 150, 1))], seed=1)
    assert str(e.value).startswith("augment.transform ") and "returns 65 views: a batch holds at most 64" in str(e.value)
    assert len(transform.to_views((np.zeros((8, 8, 3), np.uint8),) * 64, 8)) == 64  # the limit itself is fine


def test_a_view_whose_layout_cannot_be_told_is_refused_not_misread():
    # seen: a CHW view 40 high and 3 wide ([3, 40, 3]) was read as HWC, 3 high and 40 wide: the
    # stream's view was 3x40 of scrambled pixels, said nowhere
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
    chw = np.ascontiguousarray(rng.integers(0, 256, (40, 3, 3), dtype=np.uint8).transpose(2, 0, 1))
    with pytest.raises(transform.OutputError) as e:
        transform.to_views((a, chw), 32)
    assert "view 1 of 2" in str(e.value) and "[3, 40, 3]" in str(e.value) and "cannot be told" in str(e.value)
    assert transform.to_views((a, chw[:, :, :2]), 32)[1].shape == (40, 2, 3)  # unambiguous CHW
    assert transform.to_views((a, a[:4, :5]), 32)[1].shape == (4, 5, 3)  # HWC
    with pytest.raises(transform.OutputError, match="cannot be told"):  # 3 rows is the same shape as 3 columns
        transform.to_views((a, a[:3, :5]), 32)


def test_a_view_groups_ops_are_made_on_its_views_alone():
    """``augment.views[i].ops``: grayscale on the global group's views (each the plain view made
    grey: the crop and jitter draws are unchanged), nothing changed in the local group's."""
    rng = np.random.default_rng(3)
    data = jpeg_bytes(photo_like(rng, 120, 96), rng)
    plain = [{"count": 2, "output_size": 64, "rrc_scale": [0.4, 1.0], "brightness": 0.4},
             {"count": 2, "output_size": 32, "rrc_scale": [0.1, 0.4]}]
    grey = [{**plain[0], "ops": {"grayscale": 1.0}}, plain[1]]
    for i in range(6):
        a = views.make_views(data, views.view_configs(AugmentConfig(views=plain)), 7, 0, i)
        b = views.make_views(data, views.view_configs(AugmentConfig(views=grey)), 7, 0, i)
        for v in (0, 1):
            assert np.array_equal(b[v], ops.grayscale(a[v])) and not np.array_equal(a[v], b[v]), (i, v)
            assert np.array_equal(b[v][..., 0], b[v][..., 1])
        for v in (2, 3):
            assert np.array_equal(a[v], b[v]), (i, v)


def test_view_group_ops_are_checked_and_in_the_fingerprint_and_groups_without_keep_theirs():
    with pytest.raises(ConfigError, match=r"^augment.views\[1\].ops.blur must be") as e:
        AugmentConfig(views=[{"count": 2, "output_size": 64}, {"output_size": 32, "ops": {"blur": 2}}])
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"^augment.views\[0\].ops.hue is the colour jitter's, not an op"):
        AugmentConfig(views=[{"count": 2, "output_size": 64, "ops": {"hue": 0.1}}])
    with pytest.raises(ConfigError, match=r"^augment.views\[0\].ops.sharpen is not an op key"):
        AugmentConfig(views=[{"count": 2, "output_size": 64, "ops": {"sharpen": 0.1}}])
    base = [{"count": 2, "output_size": 64}]
    assert AugmentConfig(views=base).stream_dict()["views"] == [
        {"output_size": 64, "count": 2, "rrc_scale": [0.08, 1.0], "rrc_ratio": [0.75, 4 / 3], "flip": True,
         "brightness": 0.0, "contrast": 0.0, "saturation": 0.0}]  # what it was before groups had ops
    with_ops = AugmentConfig(views=[{**base[0], "ops": {"solarize": 0.2}}]).stream_dict()["views"]
    assert with_ops[0]["ops"]["solarize"] == 0.2


def test_a_view_groups_hue_and_jitter_p_reach_its_views_and_the_fingerprint_only_when_set():
    groups = [{"count": 2, "output_size": 64, "brightness": 0.4, "hue": 0.1, "jitter_p": 0.8},
              {"count": 2, "output_size": 32, "brightness": 0.4}]
    cfgs = views.view_configs(AugmentConfig(views=groups))
    assert [(c.hue, c.jitter_p) for c in cfgs] == [(0.1, 0.8)] * 2 + [(0.0, 1.0)] * 2
    d = AugmentConfig(views=groups).stream_dict()["views"]
    assert (d[0]["hue"], d[0]["jitter_p"]) == (0.1, 0.8) and "hue" not in d[1] and "jitter_p" not in d[1]
