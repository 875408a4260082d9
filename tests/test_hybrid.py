"""Hybrid decode without a GPU: the compact batch format, the daemon's parameter path, and the
client's decode stage on device="cpu" with a CPU JPEG decoder (simplejpeg) injected in place of
nvImageCodec. What needs a GPU (nvImageCodec itself, CUDA streams, rates) is not tested here."""

from __future__ import annotations

import io
import os
import sys

import numpy as np
import pytest
import simplejpeg
import torch
from PIL import Image, ImageOps
from prefetchd_client import gpudecode, gpuops
from prefetchd_client.gpudecode import DecodeStage, DecodeUnavailable

from prefetchd.core import hybrid
from prefetchd.core.augment import modes as augment
from prefetchd.core.config import AugmentConfig, ConfigError, from_dict
from prefetchd.executors import builders
from prefetchd.executors.worker import BatchMaker, WorkerSetup
from prefetchd.format import batchfile, jpegbatch
from prefetchd.format.batchfile import BatchFileError, BatchMeta
from prefetchd.sources.dataset import load_index
from prefetchd.tools.samples import photo_like

META = BatchMeta(rank=1, epoch=2, batch=3, batches_in_epoch=9, fingerprint=0xABCDEF)
# Tolerances against the CPU path's pixels (0..255 levels), for JPEGs decoded by the stand-in
# (the same libjpeg-turbo as the CPU path). Where the CPU path decodes at full scale the only
# difference is torch's resampling arithmetic against OpenCV's fixed point: measured here, mean
# <= 0.23 and max 1 (5 with jitter, which multiplies a one-level difference by up to 1.4 per op).
# Where the CPU path decodes at a reduced DCT scale, the client box-reduces instead: measured,
# mean <= 1.31, 99th percentile <= 14 (sharp edges; libjpeg's scaled IDCT is not a box), so only
# the mean and the 99th percentile are bounded there.
MEAN_TOL = 2.0
MAX_TOL = {False: 2, True: 8}  # full-scale samples, without and with jitter
P99_TOL_REDUCED = 20


def cpu_decoder(jpegs):
    """The injected stand-in for nvImageCodec: RGB as stored, no EXIF orientation applied."""
    return [torch.from_numpy(simplejpeg.decode_jpeg(bytes(j), colorspace="RGB")) for j in jpegs]


def enc(im: Image.Image, fmt: str = "JPEG", **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def with_orientation(im: Image.Image, o: int, **kw) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = o
    return enc(im, exif=exif, **kw)


RNG = np.random.default_rng(4)
PHOTO = photo_like(RNG, 420, 300)


# --- the format ----------------------------------------------------------------------------------


def _some_batch(n: int = 5, s: int = 16, lighting: bool = True):
    rng = np.random.default_rng(n)
    params = jpegbatch.empty_params(n)
    payloads = []
    for k in range(n):
        p = params[k]
        if k % 2:
            p["kind"], p["orientation"], p["coded_width"], p["coded_height"] = jpegbatch.KIND_PIXELS, 1, s, s
            p["roi"] = (0, 0, s, s)
            payloads.append(rng.integers(0, 256, (s, s, 3), dtype=np.uint8))
        else:
            p["kind"], p["orientation"], p["flip"] = jpegbatch.KIND_JPEG, 1 + k % 8, k % 3 == 0
            p["coded_width"], p["coded_height"], p["roi"] = 40, 30, (1, 2, 20, 25)
            p["n_ops"], p["ops"][:2], p["factors"][:2] = 2, (2, 0), (0.75, 1.25)
            p["lighting"] = (0.5, -1.5, 2.0)
            payloads.append(rng.integers(0, 256, 100 + 37 * k, dtype=np.uint8).tobytes())
    args = (META, np.arange(n) * 10, np.arange(n) % 3, np.where(np.arange(n) == 2, 7, -1), params, payloads,
            s, s, "bilinear", lighting)
    return args, params, payloads


def test_compact_batch_round_trips_as_views_and_dispatches_on_its_magic(tmp_path):
    args, params, payloads = _some_batch()
    buf = np.frombuffer(bytearray(jpegbatch.pack(*args)), dtype=np.uint8)
    assert jpegbatch.is_compact(buf[:8]) and jpegbatch.expected_size(buf[:128]) == len(buf)
    b = jpegbatch.parse_any(buf)
    assert isinstance(b, jpegbatch.JpegBatch)
    assert (b.rank, b.epoch, b.batch, b.batches_in_epoch, b.fingerprint) == (1, 2, 3, 9, 0xABCDEF)
    assert (b.height, b.width, b.interpolation, b.lighting) == (16, 16, "bilinear", True)
    assert b.flags & jpegbatch.FLAG_REPLACED and b.replaced.tolist() == [-1, -1, 7, -1, -1]
    assert b.indices.tolist() == [0, 10, 20, 30, 40] and b.labels.tolist() == [0, 1, 2, 0, 1]
    for name in ("kind", "orientation", "flip", "n_ops", "ops", "coded_width", "roi", "factors", "lighting"):
        assert np.array_equal(b.params[name], params[name]), name
    for k, want in enumerate(payloads):
        got = b.payload(k)
        assert np.shares_memory(got, buf)  # a view, not a copy
        assert got.tobytes() == (want.tobytes() if isinstance(want, np.ndarray) else want)
        assert got.shape == ((16, 16, 3) if k % 2 else (len(want),))
    # a pixel batch still parses through the same entry points
    px = np.random.default_rng(0).integers(0, 256, (2, 8, 8, 3), dtype=np.uint8)
    plain = _pixel_batch_bytes(px, tmp_path)
    assert not jpegbatch.is_compact(plain[:8]) and jpegbatch.expected_size(plain[:128]) == len(plain)
    assert np.array_equal(jpegbatch.parse_any(plain).images, px)


def _pixel_batch_bytes(images: np.ndarray, tmp_path) -> bytes:
    n = len(images)
    path = str(tmp_path / "pixels.batch")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
    try:
        batchfile.write_batch(fd, META, np.arange(n), np.arange(n), np.full(n, -1), images)
    finally:
        os.close(fd)
    with open(path, "rb") as f:
        return f.read()


def test_write_batch_to_a_file_equals_pack(tmp_path):
    args, _, _ = _some_batch(7)
    path = str(tmp_path / batchfile.batch_name(1, 2, 3))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
    try:
        size = jpegbatch.write_batch(fd, *args)
    finally:
        os.close(fd)
    data = open(path, "rb").read()
    assert size == len(data) and data == jpegbatch.pack(*args)
    assert len(jpegbatch.read_file(path)) == 7


@pytest.mark.parametrize("where", ["header", "indices", "params", "jpeg", "pixels", "last"])
def test_any_flipped_byte_is_a_checksum_error(where):
    args, _, _ = _some_batch()
    buf = bytearray(jpegbatch.pack(*args))
    b = jpegbatch.parse(bytes(buf))
    pos = {"header": 44, "indices": 130, "params": 128 + 24 * 5 + 33,
           "jpeg": int(b.params[0]["offset"]) + 5, "pixels": int(b.params[1]["offset"]) + 7, "last": len(buf) - 1}[where]
    buf[pos] ^= 0x10
    with pytest.raises(BatchFileError):
        jpegbatch.parse(bytes(buf))


def test_torn_foreign_and_inconsistent_files_are_refused():
    args, _, _ = _some_batch()
    good = jpegbatch.pack(*args)
    with pytest.raises(BatchFileError, match="torn or truncated"):
        jpegbatch.parse(good[:-1])
    with pytest.raises(BatchFileError, match="shorter than"):
        jpegbatch.parse(good[:100])
    with pytest.raises(BatchFileError, match="bad magic"):
        jpegbatch.parse(b"PFDXXXXX" + good[8:])
    with pytest.raises(BatchFileError, match="version"):
        jpegbatch.parse(good[:8] + b"\x09\x00" + good[10:])
    # well-checksummed but nonsensical parameters are refused too (a writer's bug, not bit rot)
    for field, value, msg in (("roi", (0, 0, 41, 30), "crop lies outside"), ("kind", 9, "unknown sample kind"),
                              ("orientation", 0, "orientation"), ("offset", 10, "outside the data section")):
        a, params, payloads = _some_batch()
        params[0][field] = value
        raw = b"".join(bytes(p) for p in jpegbatch.encode(*a[:4], params, *a[5:]))
        if field == "offset":  # encode() fills offsets: patch the record after the fact
            raw = bytearray(raw)
            po = 128 + 24 * 5
            raw[po + 80: po + 88] = (10).to_bytes(8, "little")
            raw = bytes(raw)
        with pytest.raises(BatchFileError, match=msg):
            jpegbatch.parse(raw, verify=False)


# --- which batches, which files ---------------------------------------------------------------------


@pytest.mark.parametrize("share", [0.1, 0.25, 0.5, 0.7, 1.0])
def test_batches_for_the_gpu_are_an_even_pure_spread(share):
    cfg = AugmentConfig(decode="hybrid", gpu_share=share)
    picks = [[hybrid.on_gpu(cfg, e, b) for b in range(1000)] for e in range(3)]
    assert picks[0] == picks[1] == picks[2]  # a function of the batch number alone
    assert sum(picks[0]) == int(1000 * share)
    gaps = np.diff(np.flatnonzero(picks[0]))
    assert gaps.max() - gaps.min() <= 1  # evenly spread, never bunched
    assert not any(hybrid.on_gpu(AugmentConfig(), 0, b) for b in range(100))
    assert all(hybrid.on_gpu(AugmentConfig(decode="gpu"), 0, b) for b in range(100))


def test_decode_keys_are_validated_and_fingerprinted_only_when_used(tmp_path):
    with pytest.raises(ConfigError, match="augment.decode must be one of cpu, hybrid, gpu, got 'gpu0'"):
        AugmentConfig(decode="gpu0")
    with pytest.raises(ConfigError, match="augment.gpu_share must be > 0"):
        AugmentConfig(decode="hybrid", gpu_share=0)
    with pytest.raises(ConfigError, match="augment.gpu_share"):
        AugmentConfig(gpu_share=1.5)

    def fp(**aug):
        return from_dict({"dataset": {"root": str(tmp_path)}, "augment": aug}).stream_fingerprint()

    assert fp() == fp(decode="cpu", gpu_share=0.3)  # unused keys change no byte and no fingerprint
    assert len({fp(), fp(decode="gpu"), fp(decode="hybrid"), fp(decode="hybrid", gpu_share=0.3)}) == 4
    assert fp(decode="gpu") == fp(decode="gpu", gpu_share=0.3)


def _cmyk_jpeg() -> bytes:
    return enc(PHOTO.convert("CMYK"), quality=90)


@pytest.mark.parametrize("name, data, refusal", [
    ("baseline 4:2:0", enc(PHOTO, quality=90), None),
    ("baseline 4:4:4", enc(PHOTO, quality=90, subsampling=0), None),
    ("baseline 4:2:2", enc(PHOTO, quality=90, subsampling=1), None),
    ("greyscale", enc(PHOTO.convert("L"), quality=90), None),
    ("restart markers", enc(PHOTO, quality=90, restart_marker_blocks=4), None),
    ("progressive", enc(PHOTO, quality=90, progressive=True), "progressive"),
    ("cmyk", _cmyk_jpeg(), "4 colour components"),
    ("truncated", enc(PHOTO, quality=90)[:-600], "truncated"),
    ("png", enc(PHOTO, "PNG"), "not a well-formed JPEG"),
    ("garbage", b"\xff\xd8\xff\xe0\x00", "not a well-formed JPEG"),
])
def test_sniffing_sends_only_what_the_hardware_takes(name, data, refusal):
    got = hybrid.hw_refusal(hybrid.scan_jpeg(data))
    assert (got is None) if refusal is None else (refusal in got), (name, got)


def _after_soi(data: bytes, segment: bytes) -> bytes:
    return data[:2] + segment + data[2:]


def _in_the_scan(data: bytes, at: float, new: bytes, old: int = 0) -> bytes:
    """``data`` with ``new`` put inside its entropy-coded data, at fraction ``at`` of it, in place of ``old`` bytes."""
    sos = data.index(b"\xff\xda")
    start = sos + 2 + int.from_bytes(data[sos + 2: sos + 4], "big")
    i = start + int((len(data) - 2 - start) * at)
    while data[i - 1] == 0xFF or data[i] == 0xFF:  # not in the middle of a stuffed byte or marker
        i += 1
    return data[:i] + new + data[i + old:]


def _rst_renumbered(data: bytes) -> bytes:
    sos = data.index(b"\xff\xda")
    i = data.index(b"\xff\xd1", sos)
    return data[:i] + b"\xff\xd5" + data[i + 2:]


def _table_selector(data: bytes, ids: int) -> bytes:
    sos = data.index(b"\xff\xda")
    return data[:sos + 6] + bytes([ids]) + data[sos + 7:]


_BASE = enc(PHOTO, quality=90)
_RST = enc(PHOTO, quality=90, restart_marker_blocks=4)
# JPEGs libjpeg may take but the GPU path must not: each name, the file, and the reason the daemon's
# check gives (tests/test_nvimgcodec_contract.py checks these against nvImageCodec's parser too)
CORRUPT_JPEGS = [
    ("TEM before the scan", _after_soi(_BASE, b"\xff\x01"), "stray marker"),
    ("RST before the scan", _after_soi(_BASE, b"\xff\xd3"), "stray marker"),
    ("RST without a restart interval", _in_the_scan(_BASE, 0.5, b"\xff\xd0"), "restart markers where"),
    ("a restart marker lost", _in_the_scan(_RST, 0.0, b"", 0).replace(b"\xff\xd2", b"", 1), "restart markers"),
    ("restart markers out of sequence", _rst_renumbered(_RST), "out of sequence"),
    ("a DHT marker inside the scan", _in_the_scan(_BASE, 0.5, b"\xff\xc4"), "marker FFC4 inside"),
    ("cut short, an EOI appended", _BASE[:_BASE.index(b"\xff\xda") + 60] + b"\xff\xd9", "(truncated)"),
    ("an undefined Huffman table", _table_selector(_BASE, 0x33), "Huffman table"),
]


@pytest.mark.parametrize("name, data, reason", CORRUPT_JPEGS, ids=[c[0] for c in CORRUPT_JPEGS])
def test_jpegs_with_unsound_markers_or_entropy_data_stay_on_the_cpu(name, data, reason):
    """The hardware decoder reports success for corrupt entropy data (a garbage image): the
    daemon keeps files whose markers or entropy-coded data are unsound, for the CPU path to
    decode or quarantine. The well-formed variants of the same files go to the GPU."""
    assert hybrid.hw_refusal(hybrid.scan_jpeg(_BASE)) is None and hybrid.hw_refusal(hybrid.scan_jpeg(_RST)) is None
    got = hybrid.hw_refusal(hybrid.scan_jpeg(data))
    assert got is not None and reason in got, (name, got)


def test_rgb_coded_jpegs_stay_on_the_cpu():
    """libjpeg-turbo (and so the CPU path) reads components named R, G, B as RGB, not YCbCr; a
    decoder that assumed YCbCr would get the colours wrong, so the daemon keeps such files."""
    data = bytearray(enc(PHOTO, quality=90, subsampling=0))
    info = hybrid.scan_jpeg(bytes(data))
    assert hybrid.hw_refusal(info) is None and [c[0] for c in info.components] == [1, 2, 3]
    sof = data.index(b"\xff\xc0")
    for k, name in enumerate(b"RGB"):  # component ids at SOF + 10, 13, 16
        data[sof + 10 + 3 * k] = name
    assert "RGB-coded" in hybrid.hw_refusal(hybrid.scan_jpeg(bytes(data)))


def test_a_thumbnail_eoi_before_the_scan_does_not_hide_truncation():
    thumb = enc(PHOTO.resize((40, 30)), quality=70)  # a whole JPEG, EOI included, in an APP segment
    full = enc(PHOTO, quality=90)
    app = b"\xff\xe1" + (len(thumb) + 2).to_bytes(2, "big") + thumb
    data = full[:2] + app + full[2:]
    assert hybrid.hw_refusal(hybrid.scan_jpeg(data)) is None
    assert "truncated" in hybrid.hw_refusal(hybrid.scan_jpeg(data[:-300]))


# --- the parameter path ------------------------------------------------------------------------------


MODES = [dict(mode="scale", scale_min=256, scale_max=480),
         dict(mode="random_resized_crop"),
         dict(mode="eval"),
         dict(mode="scale", output_size=96, scale_min=100, scale_max=300, brightness=0.4, contrast=0.4,
              saturation=0.4, lighting=0.1)]


@pytest.mark.parametrize("aug", MODES)
@pytest.mark.parametrize("orientation", [1, 6])
@pytest.mark.parametrize("decoder", ["auto", "pillow"])
def test_crops_and_flips_equal_the_cpu_paths_over_many_draws(aug, orientation, decoder):
    """The GPU sample's crop is the region the CPU path resamples, in the image at the DCT
    reduction the CPU path decodes at, and its flip, jitter and lighting are the CPU path's."""
    cfg = AugmentConfig(decoder=decoder, **aug)
    rng = np.random.default_rng(orientation)
    flips, reductions = 0, set()
    for i in range(60):
        w, h = int(rng.integers(150, 900)), int(rng.integers(150, 900))
        data = with_orientation(Image.new("RGB", (w, h), (90, 120, 150)), orientation, quality=60)
        d = augment.draws(5, 3, i)
        plan = hybrid.plan_sample(data, cfg, d)
        assert isinstance(plan, hybrid.GpuSample) and plan.orientation == orientation
        uw, uh = (h, w) if orientation == 6 else (w, h)
        arr, crop = augment._decode_region(data, cfg, d)  # what make_sample resamples
        assert plan.reduce == -(-uw // arr.shape[1])  # the CPU path's DCT reduction (1 when rotated)
        assert plan.roi == augment.roi_box(crop, arr.shape[1], arr.shape[0])  # in that image
        reductions.add(plan.reduce)
        assert plan.flip == crop.flip
        assert plan.ops == tuple(augment.jitter_ops(cfg, d))
        want_light = augment.lighting_offset(cfg.lighting, d) if cfg.lighting else np.zeros(3)
        assert np.array_equal(plan.lighting, want_light)
        flips += plan.flip
    if cfg.flip and cfg.mode != "eval":
        assert 15 < flips < 45  # both ways, about half
    if orientation != 1:
        assert reductions == {1}  # the CPU path decodes rotated images at full scale
    if orientation == 1 and cfg.output_size == 96:
        assert len(reductions) > 1  # reduced and full-scale decodes are both covered


def test_orientation_and_coded_box_match_pil():
    base = np.random.default_rng(0).integers(0, 256, (13, 21, 3), dtype=np.uint8)
    rng = np.random.default_rng(1)
    for o in range(1, 9):
        im = Image.fromarray(base)
        exif = im.getexif()
        exif[0x0112] = o
        im.info["exif"] = exif.tobytes()
        ref = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(enc(im, "PNG", exif=exif.tobytes())))))
        up = gpuops.orient(torch.from_numpy(base), o).numpy()
        assert np.array_equal(up, ref), o
        uh, uw = up.shape[:2]
        for _ in range(20):
            x0, y0 = int(rng.integers(0, uw - 1)), int(rng.integers(0, uh - 1))
            x1, y1 = int(rng.integers(x0 + 1, uw + 1)), int(rng.integers(y0 + 1, uh + 1))
            cx0, cy0, cx1, cy1 = gpuops.coded_box((x0, y0, x1, y1), o, 21, 13)
            got = gpuops.orient(torch.from_numpy(base[cy0:cy1, cx0:cx1]), o).numpy()
            assert np.array_equal(got, up[y0:y1, x0:x1]), (o, (x0, y0, x1, y1))


def test_colour_ops_on_the_device_are_bit_identical_to_the_cpu_paths():
    rng = np.random.default_rng(0)
    for trial in range(40):
        img = rng.integers(0, 256, (32, 40, 3), dtype=np.uint8)
        strengths = [(0.4, 0, 0), (0, 0.4, 0), (0, 0, 0.4), (0.4, 0.4, 0.4)][trial % 4]
        cfg = AugmentConfig(brightness=strengths[0], contrast=strengths[1], saturation=strengths[2], lighting=0.2)
        d = augment.draws(1, 0, trial)
        ref = augment._lighting(augment._jitter(img, cfg, d), cfg.lighting, d)
        ops = augment.jitter_ops(cfg, d)
        codes, factors = np.full((1, 3), jpegbatch.OP_NONE), np.zeros((1, 3))
        for j, (op, f) in enumerate(ops):
            codes[0, j], factors[0, j] = op, f
        x = torch.from_numpy(img).permute(2, 0, 1)[None].contiguous()
        y = gpuops.apply_jitter(x, np.array([len(ops)]), codes, factors)
        y = gpuops.apply_lighting(y, augment.lighting_offset(cfg.lighting, d)[None])
        assert np.array_equal(y[0].permute(1, 2, 0).numpy(), ref), (trial, ops)


# --- whole batches: the worker's compact path, against the CPU path -----------------------------------


class HybridMaker(BatchMaker):
    """The worker making compact batches (``fill(..., self.compact)``), packed in memory."""

    def make_compact(self, epoch: int, indices: np.ndarray):
        _, used, labels, replaced, quarantined = self.fill(epoch, indices, self.compact)
        return self.compact.pack(META, used, labels, replaced), quarantined


def _makers(root: str, tmp_path, batch_size: int = 8, **aug):
    cfg = from_dict({"dataset": {"root": root, "cache_dir": str(tmp_path / "cache")},
                     "loader": {"batch_size": batch_size, "seed": 7},
                     "augment": {"output_size": 64, "scale_min": 72, "scale_max": 120, "decode": "gpu", **aug}})
    index, _ = load_index(root, None, cfg.dataset.extensions, cfg.dataset.cache_dir)
    setup = WorkerSetup(cfg, index.files_dir, None, 0, str(tmp_path))
    return BatchMaker(setup), HybridMaker(setup), len(index)


def _compare(cpu: BatchMaker, hyb: HybridMaker, epoch: int, indices: np.ndarray, jitter: bool):
    images, used, labels, replaced, q_cpu = cpu.fill(epoch, indices)
    ref = images.copy()
    raw, q_hyb = hyb.make_compact(epoch, indices)
    b = jpegbatch.parse(raw)
    assert b.indices.tolist() == used.tolist() and b.labels.tolist() == labels.tolist()
    assert b.replaced.tolist() == replaced.tolist()
    assert [(q.index, q.reason) for q in q_hyb] == [(q.index, q.reason) for q in q_cpu]
    x = DecodeStage("cpu", decoder=cpu_decoder)(b)
    assert x.dtype == torch.uint8 and x.shape == (len(indices), 3, 64, 64)
    assert x.is_contiguous(memory_format=torch.channels_last)  # the same strides as the CPU path's batches
    got = x.permute(0, 2, 3, 1).numpy()
    for k, kind in enumerate(b.params["kind"]):
        diff = np.abs(got[k].astype(int) - ref[k].astype(int))
        if kind == jpegbatch.KIND_PIXELS:
            assert diff.max() == 0, k  # decoded by the daemon: bit-identical
        elif b.params["reduce"][k] == 1:
            assert diff.mean() < MEAN_TOL and diff.max() <= MAX_TOL[jitter], (k, diff.mean(), diff.max())
        else:
            assert diff.mean() < MEAN_TOL and np.percentile(diff, 99) <= P99_TOL_REDUCED, (k, diff.mean())
    return b


@pytest.mark.parametrize("aug", [dict(), dict(mode="random_resized_crop"), dict(mode="eval"),
                                 dict(brightness=0.4, contrast=0.4, saturation=0.4, lighting=0.1)])
def test_stand_in_gpu_decode_matches_the_cpu_path(image_root, tmp_path, aug):
    cpu, hyb, n = _makers(image_root, tmp_path, **aug)
    kinds = []
    for epoch in (0, 1):
        for start in range(0, n - 8, 8):
            b = _compare(cpu, hyb, epoch, np.arange(start, start + 8), jitter=bool(aug.get("brightness")))
            kinds += b.params["kind"].tolist()
    assert kinds.count(jpegbatch.KIND_JPEG) > 0.7 * len(kinds)  # most go to the (stand-in) GPU
    assert kinds.count(jpegbatch.KIND_PIXELS) > 0  # the progressive ones do not


@pytest.fixture(scope="module")
def odd_root(tmp_path_factory) -> str:
    """Two classes of odd files among plain ones, all named .JPEG."""
    root = tmp_path_factory.mktemp("odd")
    rng = np.random.default_rng(9)
    files = {
        "plain": enc(photo_like(rng, 300, 200), quality=90),
        "progressive": enc(photo_like(rng, 260, 300), quality=90, progressive=True),
        "cmyk": enc(photo_like(rng, 280, 210).convert("CMYK"), quality=90),
        "png": enc(photo_like(rng, 240, 320), "PNG"),
        "grey": enc(photo_like(rng, 310, 230).convert("L"), quality=90),
        "truncated": enc(photo_like(rng, 300, 300), quality=90)[:3000],
        "empty": b"",
        "s444": enc(photo_like(rng, 200, 260), quality=90, subsampling=0),
    }
    for o in range(2, 9):
        files[f"exif{o}"] = with_orientation(photo_like(rng, 330, 220), o, quality=90)
    for c in ("n0", "n1"):
        os.makedirs(root / c)
        for name, data in files.items():
            (root / c / f"{name}.JPEG").write_bytes(data)
    return str(root)


def test_odd_files_go_the_cpu_way_and_bad_ones_are_quarantined_as_now(odd_root, tmp_path):
    cpu, hyb, n = _makers(odd_root, tmp_path, batch_size=30)
    names = sorted(f for f in os.listdir(os.path.join(odd_root, "n0")))
    want_cpu = {"cmyk.JPEG", "png.JPEG", "progressive.JPEG"}
    bad = {"truncated.JPEG", "empty.JPEG"}
    for epoch in (0, 1):
        b = _compare(cpu, hyb, epoch, np.arange(n), jitter=False)
        for k, i in enumerate(b.indices):
            name = names[i % len(names)]
            assert name not in bad
            want = jpegbatch.KIND_PIXELS if name in want_cpu else jpegbatch.KIND_JPEG
            assert b.params["kind"][k] == want, name
            if name.startswith("exif"):
                assert b.params["orientation"][k] == int(name[4])
        stood_in = {names[int(r) % len(names)] for r in b.replaced if r >= 0}
        assert stood_in == bad  # the truncated and empty files were replaced in both paths
    assert set(hyb.bad) == set(cpu.bad) and len(hyb.bad) == 4


def test_same_config_same_bytes(image_root, tmp_path):
    _, a, n = _makers(image_root, tmp_path, mode="random_resized_crop", brightness=0.3)
    _, b, _ = _makers(image_root, tmp_path, mode="random_resized_crop", brightness=0.3)
    idx = np.arange(0, n, 3)[:8]
    first = a.make_compact(0, idx)[0]
    assert first == b.make_compact(0, idx)[0]
    assert a.make_compact(0, idx)[0] == first  # reuse of the builder leaves nothing behind
    assert a.make_compact(1, idx)[0] != first  # another epoch, other draws


# --- the decode stage's errors -------------------------------------------------------------------------


def test_without_the_extra_or_cuda_the_error_names_the_extra(monkeypatch):
    with pytest.raises(DecodeUnavailable, match=r"CUDA device.*prefetchd\[gpu\]"):
        DecodeStage("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", None)  # import fails as if not installed
    monkeypatch.setitem(sys.modules, "nvidia", None)
    with pytest.raises(DecodeUnavailable, match=r"nvImageCodec is not installed.*pip install 'prefetchd\[gpu\]'"):
        DecodeStage("cuda:0")


def test_a_file_the_decoder_fails_on_is_decoded_on_the_cpu_or_replaced_never_an_error(caplog, monkeypatch):
    # a JPEG the GPU decoder refuses (None) or misreads (wrong shape) is decoded on the CPU; one
    # that the CPU cannot decode either (corrupt entropy data) becomes zeros, marked as replaced
    builder = builders.CompactBuilder(AugmentConfig(output_size=32, scale_min=40, scale_max=60, decode="gpu"))
    images = np.zeros((3, 32, 32, 3), np.uint8)
    builder.reset(images)
    good = enc(PHOTO, quality=80)
    sos = good.index(b"\xff\xda")  # the entropy-coded data follows the SOS segment: garble it
    corrupt = good[:sos + 20] + bytes([0xFF, 0xD0 + 5]) * 64 + b"\xff\xd9"
    with pytest.raises(ValueError):
        simplejpeg.decode_jpeg(corrupt, colorspace="RGB")
    assert "restart markers" in hybrid.hw_refusal(hybrid.scan_jpeg(corrupt))  # the daemon keeps such a file
    with monkeypatch.context() as m:  # ... but should one get through, the client copes
        m.setattr(hybrid, "hw_refusal", lambda info: None)
        for k, data in enumerate((good, good, corrupt)):
            builder.add(data, augment.draws(0, 0, k), images[k])
    b = jpegbatch.parse(builder.pack(META, np.array([11, 12, 13]), np.zeros(3), np.full(3, -1)))
    assert (b.params["kind"] == jpegbatch.KIND_JPEG).all()
    want = DecodeStage("cpu", decoder=lambda jpegs: cpu_decoder(jpegs[:2]) + [None])(b)

    def failing(jpegs):  # sample 12 refused, and 13 (corrupt) too
        return [cpu_decoder(jpegs[:1])[0], None, None]

    def wrong_size(jpegs):
        return [torch.zeros((10, 10, 3), dtype=torch.uint8) for _ in jpegs]

    def raising(jpegs):  # whatever the decoder raises ends no batch: every sample falls back alone
        raise TypeError("decode(): incompatible function arguments")

    # the first fallback is logged, the next ones only counted; each stand-in is logged
    for decoder, warned, fallbacks in ((failing, [12, 13], 2), (wrong_size, [11, 13], 3), (raising, [11, 13], 3)):
        caplog.clear()
        replaced = np.full(3, -1)
        stage = DecodeStage("cpu", decoder=decoder)
        with caplog.at_level("WARNING", logger="prefetchd_client.gpudecode"):
            x = stage(b, replaced=replaced)
        assert torch.equal(x[:2], want[:2])  # the CPU decode of the same file, bit for bit
        assert int(x[2].max()) == 0 and replaced.tolist() == [-1, -1, 13]
        assert [int(r.getMessage().split("dataset sample ")[1].split()[0]) for r in caplog.records] == warned
        assert (stage.fallbacks, stage.replaced, stage.batches) == (fallbacks, 1, 1)
    # a thousand more fallbacks make one more line, not a thousand
    monkeypatch.setattr(gpudecode, "_WARN_EVERY", 4)
    stage = DecodeStage("cpu", decoder=lambda jpegs: [None, None, None])
    caplog.clear()
    with caplog.at_level("WARNING", logger="prefetchd_client.gpudecode"):
        for _ in range(4):
            stage(b)
    fell_back = [r.getMessage() for r in caplog.records if "decoded it on the CPU instead" in r.getMessage()]
    # fallbacks 1, 4 and 8 were logged (12 was sample 13's, whose stand-in is logged on its own)
    assert stage.fallbacks == 12 and len(fell_back) == 3 and "8 such samples so far" in fell_back[-1]


def test_pixels_come_from_the_source_tensor_when_given():
    args, _, payloads = _some_batch()
    raw = jpegbatch.pack(*args)
    src = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    b = jpegbatch.parse(src.numpy())
    # no JPEG decoding wanted here: only the PIXELS samples are looked at
    stage = DecodeStage("cpu", decoder=lambda jpegs: [torch.zeros((30, 40, 3), dtype=torch.uint8) for _ in jpegs])
    x = stage(b, source=src)
    for k in (1, 3):
        assert np.array_equal(x[k].permute(1, 2, 0).numpy(), payloads[k])


def _has_nvimgcodec() -> bool:
    try:
        from nvidia import nvimgcodec  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(not _has_nvimgcodec(), reason="needs CUDA and nvImageCodec (pip install 'prefetchd[gpu]')")
def test_nvimgcodec_on_the_gpu_matches_the_cpu_path(image_root, tmp_path):
    """Where a GPU is present: the default decoder, end to end, within the stand-in's tolerances
    (the hardware IDCT may differ from libjpeg-turbo's by a level, so the max bound is relaxed)."""
    cpu, hyb, n = _makers(image_root, tmp_path)
    stage = DecodeStage("cuda")
    for start in range(0, n - 8, 8):
        idx = np.arange(start, start + 8)
        images, *_ = cpu.fill(0, idx)
        ref = images.copy()
        b = jpegbatch.parse(hyb.make_compact(0, idx)[0])
        x = stage(b)
        assert x.is_cuda and x.is_contiguous(memory_format=torch.channels_last)
        got = x.permute(0, 2, 3, 1).cpu().numpy()
        for k, kind in enumerate(b.params["kind"]):
            diff = np.abs(got[k].astype(int) - ref[k].astype(int))
            if kind == jpegbatch.KIND_PIXELS:
                assert diff.max() == 0
            else:
                assert diff.mean() < MEAN_TOL and np.percentile(diff, 99) <= P99_TOL_REDUCED, (k, diff.mean())


# --- the batched geometry ---------------------------------------------------------------------------


def _one_sample(region: torch.Tensor, orientation: int, r: int, hh: int, ww: int, interpolation: str):
    """The reference, one sample at a time: reduce, orient, then ``gpuops.resample``."""
    x = region.expand(-1, -1, 3).permute(2, 0, 1).unsqueeze(0).float()
    if r > 1:
        x = torch.nn.functional.avg_pool2d(x, r, ceil_mode=True).round().clamp(0, 255)
    x = gpuops.orient(x[0].permute(1, 2, 0), orientation).permute(2, 0, 1).unsqueeze(0)
    return gpuops.resample(x, hh, ww, interpolation)[0].to(torch.uint8)


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic", "lanczos", "area", "nearest"])
@pytest.mark.parametrize("hh, ww", [(24, 24), (20, 28)])
def test_the_batched_geometry_equals_one_sample_at_a_time(interpolation, hh, ww):
    rng = np.random.default_rng(len(interpolation) + hh)
    regions, orientations, reductions = [], [], []
    for j in range(14):
        o = int(rng.integers(1, 9))
        r = int(rng.choice([1, 2, 4])) if o == 1 else 1
        h, w = int(rng.integers(6, 150)), int(rng.integers(6, 150))
        c = 1 if j % 5 == 0 else 3  # greyscale JPEGs decode to one channel with some decoders
        regions.append(torch.from_numpy(rng.integers(0, 256, (h, w, c), dtype=np.uint8)))
        orientations.append(o)
        reductions.append(r)
    regions[3] = None  # a sample neither decoder could make: zeros
    got = gpuops.resample_batch(regions, np.array(orientations), np.array(reductions), hh, ww, interpolation, "cpu")
    assert got.shape == (14, 3, hh, ww) and got.dtype == torch.uint8 and int(got[3].abs().max()) == 0
    for j, reg in enumerate(regions):
        if reg is None:
            continue
        want = _one_sample(reg, orientations[j], reductions[j], hh, ww, interpolation)
        diff = (got[j].int() - want.int()).abs()
        # the same arithmetic in another order: a sum landing on .5 may round the other way
        assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 0.01, (j, orientations[j], reductions[j])


def test_the_padded_batch_is_cut_into_chunks_within_the_memory_budget(monkeypatch):
    rng = np.random.default_rng(3)
    regions = [torch.from_numpy(rng.integers(0, 256, (int(rng.integers(40, 90)), int(rng.integers(40, 90)), 3),
                                             dtype=np.uint8)) for _ in range(9)]
    args = (np.ones(9, int), np.ones(9, int), 16, 16, "bilinear", "cpu")
    whole = gpuops.resample_batch(regions, *args)
    budget = 3 * 90 * 90 * 4 * 2  # two samples of the largest size a chunk
    monkeypatch.setattr(gpuops, "_PAD_BUDGET_BYTES", budget)
    chunks = []
    real = gpuops._run_steps

    def run_steps(regs, plans, hmax, wmax, device):
        chunks.append((len(regs), hmax, wmax))
        return real(regs, plans, hmax, wmax, device)

    monkeypatch.setattr(gpuops, "_run_steps", run_steps)
    assert torch.equal(gpuops.resample_batch(regions, *args), whole)
    assert sum(n for n, _, _ in chunks) == 9 and len(chunks) >= 3
    assert all(n * 3 * h * w * 4 <= budget for n, h, w in chunks), chunks


class _CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += not func.is_view  # a view (slice, permute) launches nothing
        return func(*args, **(kwargs or {}))


def test_the_stage_makes_a_few_torch_calls_per_batch_not_ten_per_image(tmp_path):
    """Each torch call but a view is a kernel launch on a GPU: the decode stage issues about one per image
    (its copy into the padded batch) and a few dozen per batch, whatever the batch size."""
    builder = builders.CompactBuilder(AugmentConfig(output_size=32, scale_min=40, scale_max=120, decode="gpu",
                                                  brightness=0.3, contrast=0.3, saturation=0.3, lighting=0.1))
    rng = np.random.default_rng(5)
    datas = [with_orientation(photo_like(rng, int(rng.integers(60, 200)), int(rng.integers(60, 200))),
                              1 + i % 8, quality=85) for i in range(64)]

    def ops_for(n: int) -> int:
        images = np.zeros((n, 32, 32, 3), np.uint8)
        builder.reset(images)
        for k in range(n):
            builder.add(datas[k], augment.draws(0, 0, k), images[k])
        b = jpegbatch.parse(builder.pack(META, np.arange(n), np.zeros(n), np.full(n, -1)))
        assert (b.params["kind"] == jpegbatch.KIND_JPEG).all()
        stage = DecodeStage("cpu", decoder=cpu_decoder)
        with _CountOps() as count:
            stage(b)
        return count.ops - n  # less the decoder's own from_numpy per file

    small, large = ops_for(16), ops_for(64)
    per_image = (large - small) / 48
    assert per_image <= 1.5, (small, large)  # the per-sample loop made 10-20
    assert small - 16 <= 200, small  # about 180 a batch (colour jitter's three steps are most of them)
