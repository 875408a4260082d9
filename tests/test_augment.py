from __future__ import annotations

import io
import math
import random
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from prefetchd.core.augment import modes as A
from prefetchd.core.config import AugmentConfig
from prefetchd.tools.samples import jpeg_bytes, photo_like

RNG = np.random.default_rng(11)
PHOTO = photo_like(RNG, 500, 375)


def enc(im: Image.Image, fmt: str = "JPEG", **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


JPEG = enc(PHOTO, quality=92)


def sample(data: bytes, cfg: AugmentConfig | None = None, index: int = 0, epoch: int = 0) -> np.ndarray:
    return A.make_sample(data, cfg or AugmentConfig(), A.draws(1, epoch, index))


def test_same_seed_epoch_index_same_bytes_and_epochs_differ():
    a, b = sample(JPEG, index=5), sample(JPEG, index=5)
    assert a.dtype == np.uint8 and a.shape == (224, 224, 3)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, sample(JPEG, index=5, epoch=1))


@pytest.mark.parametrize("mode", ["scale", "random_resized_crop", "eval"])
@pytest.mark.parametrize("jitter", [0.0, 0.4])
def test_every_mode_makes_uint8_squares(mode, jitter):
    cfg = AugmentConfig(mode=mode, output_size=96, scale_min=100, scale_max=200, eval_resize=110,
                        brightness=jitter, contrast=jitter, saturation=jitter, lighting=jitter / 4)
    out = np.empty((96, 96, 3), np.uint8)
    A.make_sample(JPEG, cfg, A.draws(0, 0, 3), out)
    assert out.std() > 5  # a picture, not a constant


def _reference_scale(im: Image.Image, cfg: AugmentConfig, d: A.Draws) -> np.ndarray:
    """The definition, done the slow way: resize the whole image, then crop, then flip."""
    w, h = im.size
    s = A._randint(d.u[0], cfg.scale_min, cfg.scale_max)
    rw, rh = A._resize_shorter(w, h, s)
    big = im.resize((rw, rh), Image.Resampling.BILINEAR)
    x, y = A._randint(d.u[1], 0, rw - cfg.output_size), A._randint(d.u[2], 0, rh - cfg.output_size)
    out = np.asarray(big)[y:y + cfg.output_size, x:x + cfg.output_size]
    return out[:, ::-1] if (cfg.flip and d.u[45] < 0.5) else out


@pytest.mark.parametrize("decoder", ["auto", "pillow"])
def test_pixels_match_resize_then_crop(decoder):
    cfg = AugmentConfig(decoder=decoder)
    png = enc(PHOTO, "PNG")  # lossless, so only the resampling differs
    for i in range(12):
        d = A.draws(0, 0, i)
        got = A.make_sample(png, cfg, d).astype(int)
        ref = _reference_scale(PHOTO, cfg, d).astype(int)
        assert np.abs(got - ref).mean() < 4.0, i


def test_eval_mode_is_the_centre_crop():
    cfg = AugmentConfig(mode="eval")
    got = sample(enc(PHOTO, "PNG"), cfg).astype(int)
    big = PHOTO.resize(A._resize_shorter(500, 375, 256), Image.Resampling.BILINEAR)
    ref = np.asarray(big)[16:240, 58:282].astype(int)  # (256-224)/2, (341-224)/2
    assert np.abs(got - ref).mean() < 3.0


def _direct_scale_geometry(rng: random.Random, w, h, lo, hi, out):
    s = rng.randint(lo, hi)
    rw, rh = (s, int(s * h / w)) if w <= h else (int(s * w / h), s)
    return s, rng.randint(0, rw - out) / (rw - out), rng.randint(0, rh - out) / max(rh - out, 1)


def _direct_rrc(rng: random.Random, w, h, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    """torchvision's RandomResizedCrop.get_params, transcribed with Python's random."""
    area = w * h
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1])))
        cw, ch = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
        if 0 < cw <= w and 0 < ch <= h:
            return cw, ch, rng.randint(0, w - cw), rng.randint(0, h - ch)
    r = w / h
    if r < ratio[0]:
        cw, ch = w, int(round(w / ratio[0]))
    elif r > ratio[1]:
        ch, cw = h, int(round(h * ratio[1]))
    else:
        cw, ch = w, h
    return cw, ch, (w - cw) // 2, (h - ch) // 2


def _close(a, b, tol):
    qs = [0.05, 0.25, 0.5, 0.75, 0.95]
    return np.allclose(np.quantile(a, qs), np.quantile(b, qs), rtol=0, atol=tol) and abs(np.mean(a) - np.mean(b)) < tol


@pytest.mark.parametrize("w, h", [(500, 375), (375, 500), (1000, 300)])
def test_scale_crop_sizes_and_positions_match_the_definition(w, h):
    cfg = AugmentConfig()
    rng = random.Random(0)
    n = 6000
    crops = [A.crop_for(cfg, w, h, A.draws(0, 0, i)) for i in range(n)]
    # S is exact along the shorter side: S = out * short / (crop extent along the short side)
    s_ours = np.array([224 * w / c.width if w <= h else 224 * h / c.height for c in crops])
    x_ours = np.array([c.left / (w - c.width) for c in crops])
    y_ours = np.array([c.top / (h - c.height) for c in crops])
    direct = np.array([_direct_scale_geometry(rng, w, h, 256, 480, 224) for _ in range(n)])
    assert np.allclose(s_ours, np.round(s_ours)) and s_ours.min() >= 256 and s_ours.max() <= 480
    assert _close(s_ours, direct[:, 0], 8)
    assert _close(x_ours, direct[:, 1], 0.03)
    assert _close(y_ours, direct[:, 2], 0.03)
    assert abs(np.mean([c.flip for c in crops]) - 0.5) < 0.03  # flip half the time


@pytest.mark.parametrize("w, h", [(500, 375), (200, 800)])
def test_random_resized_crop_matches_torchvision_algorithm(w, h):
    cfg = AugmentConfig(mode="random_resized_crop")
    rng = random.Random(1)
    n = 6000
    ours = [A.crop_for(cfg, w, h, A.draws(0, 0, i)) for i in range(n)]
    direct = [_direct_rrc(rng, w, h) for _ in range(n)]
    area_o = np.array([c.width * c.height / (w * h) for c in ours])
    area_d = np.array([cw * ch / (w * h) for cw, ch, _, _ in direct])
    asp_o = np.log([c.width / c.height for c in ours])
    asp_d = np.log([cw / ch for cw, ch, _, _ in direct])
    cx_o = np.array([(c.left + c.width / 2) / w for c in ours])
    cx_d = np.array([(x + cw / 2) / w for cw, _, x, _ in direct])
    cy_o = np.array([(c.top + c.height / 2) / h for c in ours])
    cy_d = np.array([(y + ch / 2) / h for _, ch, _, y in direct])
    assert _close(area_o, area_d, 0.03)
    assert _close(asp_o, asp_d, 0.03)
    assert _close(cx_o, cx_d, 0.03) and _close(cy_o, cy_d, 0.03)


# --- hostile and unusual files: each becomes an RGB sample or a SampleError -----------------------


def _png_bomb() -> bytes:
    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", 30000, 30000, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 100)) + chunk(b"IEND", b"")


def _exif_rotated() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 CW to display
    return enc(PHOTO, quality=95, exif=exif.tobytes())


GOOD = {
    "cmyk_jpeg": lambda: enc(PHOTO.convert("CMYK"), quality=90),
    "grayscale_jpeg": lambda: enc(PHOTO.convert("L"), quality=90),
    "png_named_jpeg": lambda: enc(PHOTO, "PNG"),
    "rgba_png": lambda: enc(PHOTO.convert("RGBA"), "PNG"),
    "palette_png": lambda: enc(PHOTO.convert("P"), "PNG"),
    "sixteen_bit_png": lambda: enc(Image.fromarray(np.asarray(PHOTO.convert("L")).astype(np.uint16) * 257), "PNG"),
    "progressive_jpeg": lambda: enc(PHOTO, quality=90, progressive=True),
    "tiny_jpeg": lambda: enc(PHOTO.resize((12, 9)), quality=90),
    "huge_jpeg": lambda: enc(PHOTO.resize((4000, 3000)), quality=80),
    "exif_rotated": _exif_rotated,
}
BAD = {
    "truncated_jpeg": lambda: JPEG[: len(JPEG) // 2],
    "empty": lambda: b"",
    "random_bytes": lambda: np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8).tobytes(),
    "decompression_bomb": _png_bomb,
    "gif": lambda: enc(PHOTO.convert("P"), "GIF"),  # not a decoder the project allows
}


@pytest.mark.parametrize("name", sorted(GOOD))
def test_unusual_images_become_rgb_samples(name):
    out = sample(GOOD[name]())
    assert out.shape == (224, 224, 3) and out.dtype == np.uint8 and out.std() > 1


def test_grayscale_and_sixteen_bit_are_grey_not_white():
    for name in ("grayscale_jpeg", "sixteen_bit_png"):
        out = sample(GOOD[name]()).astype(int)
        assert np.abs(out[..., 0] - out[..., 1]).max() <= 2  # grey
        assert 40 < out.mean() < 215, name  # the top 8 bits, not clipped to white


def test_exif_orientation_is_applied():
    upright = PHOTO.transpose(Image.Transpose.ROTATE_270)  # what a viewer shows for orientation 6
    cfg = AugmentConfig(mode="eval")
    got = sample(_exif_rotated(), cfg).astype(int)
    ref = sample(enc(upright, quality=95), cfg).astype(int)
    assert np.abs(got - ref).mean() < 3


@pytest.mark.parametrize("name", sorted(BAD))
def test_broken_files_raise_sample_error(name):
    with pytest.raises(A.SampleError):
        sample(BAD[name]())


def test_jpeg_helper_round_trips():
    assert Image.open(io.BytesIO(jpeg_bytes(PHOTO, np.random.default_rng(0)))).size == (500, 375)
