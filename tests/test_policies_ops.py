"""The policy ops (core.augment.ops) against Pillow, called as torchvision calls it on PIL images.

torchvision's ``_apply_op`` on a PIL image is ``F.affine``/``F.rotate`` -> ``Image.transform`` /
``Image.rotate``, ``ImageEnhance.*(img).enhance(1 + m)`` and ``ImageOps.*``: so Pillow is the
reference wherever torchvision does not install (tests/test_policies_torchvision.py compares
with torchvision itself where it does). Lookup-table and enhance ops must be identical;
nearest geometry identical (Pillow's own 16.16 fixed-point positions);
bilinear/bicubic geometry within the tolerances below (kernels and borders differ).
"""

from __future__ import annotations

import cv2
import numpy as np
import pytest
from PIL import Image, ImageEnhance, ImageOps

from prefetchd.core.augment import ops

_NEAREST = {"nearest": Image.NEAREST, "bilinear": Image.BILINEAR, "bicubic": Image.BICUBIC}


def _images():
    rng = np.random.default_rng(7)
    noise = rng.integers(0, 256, (57, 64, 3), dtype=np.uint8)
    yy, xx = np.mgrid[0:60, 0:48]
    grad = np.stack([xx * 3 + 20, yy * 2 + 40, (xx + yy) + 60], axis=2).astype(np.uint8)
    grad = np.clip(grad.astype(int) + rng.integers(-9, 10, grad.shape), 0, 255).astype(np.uint8)
    narrow = rng.integers(90, 140, (40, 40, 3), dtype=np.uint8)  # autocontrast/equalize have work
    flat = np.full((16, 16, 3), 77, np.uint8)
    flat[3, 4] = (80, 70, 77)
    return [noise, grad, narrow, flat]


IMAGES = _images()


def _pil(a: np.ndarray) -> Image.Image:
    return Image.fromarray(a, "RGB")


@pytest.mark.parametrize("name, ref, mags", [
    ("Brightness", lambda im, m: ImageEnhance.Brightness(im).enhance(1 + m), [-0.9, -0.33, 0.0, 0.27, 0.6, 0.99]),
    ("Color", lambda im, m: ImageEnhance.Color(im).enhance(1 + m), [-0.9, -0.33, 0.27, 0.99]),
    ("Contrast", lambda im, m: ImageEnhance.Contrast(im).enhance(1 + m), [-0.9, -0.33, 0.27, 0.99]),
    ("Sharpness", lambda im, m: ImageEnhance.Sharpness(im).enhance(1 + m), [-0.9, -0.33, 0.27, 0.99]),
    ("Posterize", lambda im, m: ImageOps.posterize(im, int(m)), [1, 2, 4, 6, 7]),
    ("Solarize", lambda im, m: ImageOps.solarize(im, m), [255.0, 187.0, 128.0, 42.5, 0.0]),
    ("AutoContrast", lambda im, m: ImageOps.autocontrast(im), [0.0]),
    ("Equalize", lambda im, m: ImageOps.equalize(im), [0.0]),
    ("Invert", lambda im, m: ImageOps.invert(im), [0.0]),
])
def test_colour_and_table_ops_are_identical_to_pillow(name, ref, mags):
    for img in IMAGES:
        for m in mags:
            want = np.asarray(ref(_pil(img), m))
            got = ops.apply_op(img.copy(), name, m)
            assert got.dtype == np.uint8 and got.shape == img.shape
            np.testing.assert_array_equal(got, want, err_msg=f"{name}({m}) on a {img.shape} image")


def test_solarize_add_is_timms_table():
    img = IMAGES[0]
    add, thresh = 57, 128
    lut = [min(255, i + add) if i < thresh else i for i in range(256)]
    want = np.asarray(_pil(img).point(lut * 3))
    np.testing.assert_array_equal(ops.solarize_add(img, add), want)


def _pil_geometry(im: Image.Image, name: str, m: float, interp: str, fill) -> Image.Image:
    """What torchvision's _apply_op does on a PIL image, with the matrices written out."""
    res = _NEAREST[interp]
    kw = {"fillcolor": tuple(fill)}
    if name == "ShearX":  # F.affine(shear=[deg(atan m), 0], center=[0, 0]): inverse (1, m, 0, 0, 1, 0)
        return im.transform(im.size, Image.AFFINE, (1, m, 0, 0, 1, 0), res, **kw)
    if name == "ShearY":
        return im.transform(im.size, Image.AFFINE, (1, 0, 0, m, 1, 0), res, **kw)
    if name == "TranslateX":
        return im.transform(im.size, Image.AFFINE, (1, 0, -int(m), 0, 1, 0), res, **kw)
    if name == "TranslateY":
        return im.transform(im.size, Image.AFFINE, (1, 0, 0, 0, 1, -int(m)), res, **kw)
    assert name == "Rotate"
    return im.rotate(m, res, fillcolor=tuple(fill))


GEOMETRY_CASES = [("ShearX", [-0.3, -0.11, 0.02, 0.29]), ("ShearY", [-0.3, 0.13, 0.29]),
                  ("TranslateX", [-20.0, -3.0, 7.0, 31.9]), ("TranslateY", [-13.0, 5.0, 22.0]),
                  ("Rotate", [-30.0, -13.5, 4.5, 29.0, 90.0, -90.0, 180.0, 135.0])]


@pytest.mark.parametrize("name, mags", GEOMETRY_CASES)
def test_nearest_geometry_takes_pillows_source_pixels(name, mags):
    # every pixel of the noise image is (almost surely) unique: equal pixels = equal coordinates
    for img in IMAGES[:2]:
        for m in mags:
            for fill in ((0, 0, 0), (124, 116, 104)):
                want = np.asarray(_pil_geometry(_pil(img), name, m, "nearest", fill))
                got = ops.apply_op(img, name, int(m) if name.startswith("Translate") else m, "nearest", fill)
                same = np.all(got == want, axis=2).mean()
                assert same == 1.0, f"{name}({m}) fill {fill}: {same:.4f} of the pixels match Pillow"


def test_nearest_geometry_is_pillows_at_random_magnitudes_and_sizes():
    rng = np.random.default_rng(12)
    for _ in range(60):
        h, w = (int(v) for v in rng.integers(8, 240, 2))
        img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        name = str(rng.choice(["ShearX", "ShearY", "Rotate", "TranslateX", "TranslateY"]))
        m = float(rng.uniform(-135, 135) if name == "Rotate" else rng.uniform(-0.99, 0.99) if name.startswith("Shear")
                  else int(rng.uniform(-40, 40)))
        want = np.asarray(_pil_geometry(_pil(img), name, m, "nearest", (5, 6, 7)))
        np.testing.assert_array_equal(ops.apply_op(img, name, m, "nearest", (5, 6, 7)), want, err_msg=f"{name}({m}) {h}x{w}")


@pytest.mark.parametrize("interp", ["bilinear", "bicubic"])
@pytest.mark.parametrize("name, mags", GEOMETRY_CASES)
def test_smooth_geometry_is_close_to_pillow(name, mags, interp):
    img = IMAGES[1]  # resampling differences are a matter of smooth images
    for m in mags:
        want = np.asarray(_pil_geometry(_pil(img), name, m, interp, (0, 0, 0))).astype(int)
        got = ops.apply_op(img, name, int(m) if name.startswith("Translate") else m, interp, (0, 0, 0)).astype(int)
        inner = (slice(3, -3), slice(3, -3))
        # inside the image (away from the fill's edge): Pillow's bicubic a = -0.5 against OpenCV's -0.75
        # and rounding give a few levels; at the edge Pillow clamps where OpenCV blends with the fill
        diff = np.abs(got - want)
        inside = np.asarray(_pil_geometry(_pil(np.full_like(img, 255)), name, m, "nearest", (0, 0, 0)))[..., 0] == 255
        valid = cv2.erode(inside.astype(np.uint8), np.ones((7, 7), np.uint8)).astype(bool)  # 3 pixels from the fill
        core = diff[inner][valid[inner]]
        assert core.size == 0 or np.percentile(core, 99) <= 3, f"{name}({m}) {interp}"
        assert core.size == 0 or core.mean() <= 1.0, f"{name}({m}) {interp}: mean {core.mean():.2f}"


def test_grayscale_is_pillows_l_three_times():
    for img in IMAGES:
        want = np.asarray(_pil(img).convert("L").convert("RGB"))
        np.testing.assert_array_equal(ops.grayscale(img), want)


def test_gaussian_blur_matches_torchs_float_reference():
    torch = pytest.importorskip("torch")
    img = IMAGES[1]
    for k, sigma in ((3, 0.5), (9, 1.7), (23, 2.0)):
        half = (k - 1) * 0.5
        x = torch.linspace(-half, half, steps=k)
        pdf = torch.exp(-0.5 * (x / sigma).pow(2))
        k1 = pdf / pdf.sum()
        t = torch.from_numpy(img).permute(2, 0, 1)[:, None].float()  # as torchvision's _gaussian_blur
        pad = k // 2
        t = torch.nn.functional.pad(t, [pad, pad, pad, pad], mode="reflect")
        t = torch.nn.functional.conv2d(t, k1[None, None, None, :])
        t = torch.nn.functional.conv2d(t, k1[None, None, :, None])
        want = t.round().clamp(0, 255).to(torch.uint8)[:, 0].permute(1, 2, 0).numpy()
        got = ops.gaussian_blur(img, k, sigma)
        assert np.abs(got.astype(int) - want.astype(int)).max() <= 1, (k, sigma)
