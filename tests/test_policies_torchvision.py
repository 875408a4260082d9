"""The policy ops against torchvision itself, where torchvision imports (skipped otherwise: the
project's CPU torch 2.13 has none; torch 2.14.1 + torchvision 0.29.1 install together). Run it
with such a venv and the project on PYTHONPATH:

    PYTHONPATH=. /work/tvenv/bin/python -m pytest -q -p no:cacheprovider tests/test_policies_torchvision.py

* torchvision's own ``_apply_op`` (what RandAugment, TrivialAugmentWide and AutoAugment call)
  on PIL images, at every bin of its magnitude tables: identical pixels, nearest and fill;
* ``torchvision.transforms.v2.functional`` on uint8 tensors (its own kernels, not Pillow's):
  within the tolerances stated per op below;
* the magnitude tables against the policies' ``_augmentation_space``, bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tv = pytest.importorskip("torchvision")
from PIL import Image  # noqa: E402
from torchvision.transforms import InterpolationMode  # noqa: E402
from torchvision.transforms import autoaugment as tv_aa  # noqa: E402
from torchvision.transforms.v2 import functional as F  # noqa: E402

from prefetchd.core.augment import ops, policies  # noqa: E402


def _photo(h: int, w: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    field = rng.integers(0, 256, (5, 6, 3), dtype=np.uint8)
    im = np.asarray(Image.fromarray(field).resize((w, h), Image.BICUBIC)).astype(int)
    return np.clip(im + rng.integers(-12, 13, im.shape), 0, 255).astype(np.uint8)


IMAGES = [_photo(224, 224, 1), _photo(160, 208, 2), np.random.default_rng(3).integers(0, 256, (96, 80, 3), dtype=np.uint8)]


@pytest.mark.parametrize("kind", ["randaugment", "trivialaugment", "autoaugment"])
def test_magnitude_tables_are_torchvisions(kind):
    cls = {"randaugment": tv_aa.RandAugment, "trivialaugment": tv_aa.TrivialAugmentWide, "autoaugment": tv_aa.AutoAugment}[kind]
    bins = 10 if kind == "autoaugment" else 31
    for h, w in ((224, 224), (160, 208)):
        space = cls()._augmentation_space(bins, (h, w)) if kind != "trivialaugment" else cls()._augmentation_space(bins)
        mine = policies.magnitude_table(kind, bins, h, w)
        assert list(space) == list(mine) or set(space) == set(mine)
        for name, (mags, signed) in space.items():
            mm, ms = mine[name]
            assert ms == signed, name
            if mags.ndim == 0:
                assert mm is None, name
            else:
                np.testing.assert_array_equal(mm, mags.numpy(), err_msg=f"{kind} {name} {h}x{w}")


@pytest.mark.parametrize("kind", ["randaugment", "trivialaugment", "autoaugment"])
def test_every_op_at_every_bin_is_torchvisions_apply_op_on_pil(kind):
    bins = 10 if kind == "autoaugment" else 31
    for img in IMAGES:
        h, w = img.shape[:2]
        pil = Image.fromarray(img)
        for name, (mags, signed) in policies.magnitude_table(kind, bins, h, w).items():
            values = [0.0] if mags is None else [float(v) for v in mags]
            if signed:
                values += [-v for v in values]
            for m in values[:: 3 if len(values) > 20 else 1]:
                for fill in ([0.0, 0.0, 0.0], [124.0, 116.0, 104.0]):
                    want = np.asarray(tv_aa._apply_op(pil, name, m, interpolation=InterpolationMode.NEAREST, fill=fill))
                    arg = float(int(m)) if name in ("TranslateX", "TranslateY", "Posterize") else m
                    got = ops.apply_op(img, name, arg, "nearest", tuple(int(v) for v in fill))
                    np.testing.assert_array_equal(got, want, err_msg=f"{kind} {name}({m}) fill {fill} {h}x{w}")


def _t(img: np.ndarray):
    return torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1).contiguous()


def _n(t) -> np.ndarray:
    return t.permute(1, 2, 0).numpy()


# v2's tensor kernels: their own float math (brightness/contrast/saturation blends in float32
# then truncation, grey weights 0.2989/0.587/0.114, the SMOOTH kernel by conv2d), so up to a
# level or two off Pillow's; the lookup-table ops are the same tables
TENSOR_CASES = [
    ("Brightness", lambda t, m: F.adjust_brightness(t, 1 + m), [-0.9, -0.3, 0.45, 0.9], 1, 0.0),
    # v2 blends with the float mean grey, Pillow with the mean rounded to a level: 1 level, often
    ("Contrast", lambda t, m: F.adjust_contrast(t, 1 + m), [-0.9, -0.3, 0.45, 0.9], 1, 1.0),
    ("Color", lambda t, m: F.adjust_saturation(t, 1 + m), [-0.9, -0.3, 0.45, 0.9], 1, 1.0),
    ("Sharpness", lambda t, m: F.adjust_sharpness(t, 1 + m), [-0.9, -0.3, 0.45, 0.9], 2, 0.05),
    ("Posterize", lambda t, m: F.posterize(t, int(m)), [1, 3, 5, 7], 0, 0.0),
    ("Solarize", lambda t, m: F.solarize(t, m), [255.0, 170.0, 85.0, 8.5], 0, 0.0),
    ("AutoContrast", lambda t, m: F.autocontrast(t), [0.0], 1, 0.01),
    ("Equalize", lambda t, m: F.equalize(t), [0.0], 1, 0.05),
    ("Invert", lambda t, m: F.invert(t), [0.0], 0, 0.0),
]


@pytest.mark.parametrize("name, fn, mags, max_diff, max_share", TENSOR_CASES, ids=[c[0] for c in TENSOR_CASES])
def test_colour_ops_are_close_to_v2_functional_on_tensors(name, fn, mags, max_diff, max_share):
    for img in IMAGES:
        for m in mags:
            want = _n(fn(_t(img), m)).astype(int)
            got = ops.apply_op(img, name, m).astype(int)
            diff = np.abs(got - want)
            assert diff.max() <= max_diff, f"{name}({m}): max {diff.max()}"
            assert (diff > 0).mean() <= max_share, f"{name}({m}): {(diff > 0).mean():.3f} of the values differ"


GEOMETRY = [("ShearX", [-0.3, 0.14, 0.99]), ("ShearY", [-0.99, 0.2]), ("TranslateX", [-32.0, 7.0]),
            ("TranslateY", [-9.0, 31.0]), ("Rotate", [-30.0, 13.5, 90.0, 135.0])]


@pytest.mark.parametrize("name, mags", GEOMETRY)
def test_geometry_takes_v2_tensor_kernels_coordinates_up_to_their_rounding(name, mags):
    # v2's tensor affine samples by grid_sample in its own convention: a shear about [0, 0] lands
    # half a pixel from Pillow's (torchvision's two backends differ there), so nearest picks the
    # neighbour on some rows; the geometry that matters, Pillow's, is checked exactly above
    for img in IMAGES[:2]:
        for m in mags:
            t = _t(img)
            if name.startswith("Shear"):
                import math
                sh = [math.degrees(math.atan(m)), 0.0] if name == "ShearX" else [0.0, math.degrees(math.atan(m))]
                want = F.affine(t, angle=0.0, translate=[0, 0], scale=1.0, shear=sh, center=[0, 0],
                                interpolation=InterpolationMode.NEAREST, fill=0)
            elif name.startswith("Translate"):
                tr = [int(m), 0] if name == "TranslateX" else [0, int(m)]
                want = F.affine(t, angle=0.0, translate=tr, scale=1.0, shear=[0.0, 0.0],
                                interpolation=InterpolationMode.NEAREST, fill=0)
            else:
                want = F.rotate(t, m, interpolation=InterpolationMode.NEAREST, fill=0)
            got = ops.apply_op(img, name, m, "nearest", (0, 0, 0))
            same = np.all(got == _n(want), axis=2).mean()
            assert same >= (0.9 if name.startswith("Shear") else 0.99), f"{name}({m}): {same:.4f} of the pixels are v2's"


@pytest.mark.parametrize("shift", [-0.5, -0.3, -0.1, -0.004, 0.0, 0.004, 0.1, 0.25, 0.5])
def test_hue_is_torchvisions_adjust_hue_on_pil(shift):
    from prefetchd.core.augment import modes

    for img in IMAGES:
        want = np.asarray(F.adjust_hue(Image.fromarray(img), shift))
        np.testing.assert_array_equal(modes.adjust_hue(img, shift), want, err_msg=str(shift))
