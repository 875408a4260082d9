"""The image ops of torchvision's and timm's augmentation policies on uint8 RGB arrays [H, W, 3]. Pure.

Each op gives what torchvision's op gives on a PIL image (``_apply_op`` of
``torchvision.transforms.autoaugment``, which calls Pillow), computed with OpenCV and numpy:

* geometry (ShearX/Y, TranslateX/Y, Rotate) builds Pillow's own ``Image.transform`` AFFINE
  coefficients (output pixel centre -> input position, torchvision's
  ``_get_inverse_affine_matrix``; Rotate: ``Image.rotate``'s matrix about (w/2, h/2), with its
  transposes at 90, 180 and 270 degrees). Nearest (torchvision's default) is Pillow's own
  arithmetic: its 16.16 fixed-point source positions (``affine_fixed``), floored, gathered with
  ``cv2.remap``; translations go through ``cv2.warpAffine``, exact for whole pixels. Bilinear
  and bicubic hand the matrix to ``cv2.warpAffine`` half a pixel over (Pillow's coordinates are
  pixel corners, OpenCV's centres) and differ in the kernel (OpenCV's bicubic a = -0.75,
  Pillow's -0.5) and at the image border;
* Brightness, Contrast, Color, Sharpness are ``ImageEnhance``'s blends, reproduced to the bit:
  ``degenerate + factor * (image - degenerate)`` in float32, truncated and clipped as
  ``ImagingBlend`` does, with Pillow's RGB -> L weights (19595, 38470, 7471 / 65536) and its
  SMOOTH kernel (borders copied) for the degenerate images;
* Posterize, Solarize, SolarizeAdd, Invert, AutoContrast, Equalize are ``ImageOps``' lookup
  tables, identical.

``magnitude`` is torchvision's signed magnitude (an enhance factor is ``1 + magnitude``).
"""

from __future__ import annotations

import math

import cv2
import numpy as np

_CV_INTER = {"nearest": cv2.INTER_NEAREST, "bilinear": cv2.INTER_LINEAR, "bicubic": cv2.INTER_CUBIC}
_RAMP = np.arange(256, dtype=np.float64)
_RAMP_F32 = np.arange(256, dtype=np.float32)
_IDENTITY = np.arange(256, dtype=np.uint8)
_NEAREST_NUDGE = 1e-4
_SMOOTH = np.array([[1, 1, 1], [1, 5, 1], [1, 1, 1]], np.float32) / np.float32(13)
cv2.setNumThreads(1)


def _lut(img: np.ndarray, table: np.ndarray) -> np.ndarray:
    """One table [256] for all channels, or one per channel [256, 3]."""
    if table.ndim == 2:
        return cv2.LUT(img, np.ascontiguousarray(table.astype(np.uint8)).reshape(256, 1, 3))
    return cv2.LUT(img, table.astype(np.uint8))


# --- geometry ------------------------------------------------------------------------------------


def inverse_affine(center: tuple[float, float], angle: float, translate: tuple[float, float],
                   scale: float, shear: tuple[float, float]) -> list[float]:
    """torchvision's ``_get_inverse_affine_matrix``: Pillow's six AFFINE coefficients."""
    rot = math.radians(angle)
    sx, sy = math.radians(shear[0]), math.radians(shear[1])
    cx, cy = center
    tx, ty = translate
    a = math.cos(rot - sy) / math.cos(sy)
    b = -math.cos(rot - sy) * math.tan(sx) / math.cos(sy) - math.sin(rot)
    c = math.sin(rot - sy) / math.cos(sy)
    d = -math.sin(rot - sy) * math.tan(sx) / math.cos(sy) + math.cos(rot)
    m = [d / scale, -b / scale, 0.0, -c / scale, a / scale, 0.0]
    m[2] += m[0] * (-cx - tx) + m[1] * (-cy - ty)
    m[5] += m[3] * (-cx - tx) + m[4] * (-cy - ty)
    m[2] += cx
    m[5] += cy
    return m


def _fix(v: float) -> int:
    return math.floor(v * 65536.0 + 0.5)


def _fits_fixed(m: list[float], w: int, h: int) -> bool:
    # Pillow's check_fixed at the four corners: its 16.16 fixed-point path is taken then
    return all(abs(x * m[0] + y * m[1] + m[2]) < 32768.0 and abs(x * m[3] + y * m[4] + m[5]) < 32768.0
               for x, y in ((0, 0), (w, h), (0, h), (w, 0)))


def _pil_nearest_fixed(img: np.ndarray, m: list[float], fill: tuple[int, int, int]) -> np.ndarray:
    """Pillow's ``affine_fixed``: 16.16 fixed-point source positions, floored; integer sums, so
    reproduced exactly, and the source pixels gathered by ``cv2.remap``."""
    h, w = img.shape[:2]
    a0, a1, a3, a4 = _fix(m[0]), _fix(m[1]), _fix(m[3]), _fix(m[4])
    a2, a5 = _fix(m[2] + m[1] * 0.5 + m[0] * 0.5), _fix(m[5] + m[4] * 0.5 + m[3] * 0.5)
    ys = np.arange(h, dtype=np.int64)[:, None]
    xs = np.arange(w, dtype=np.int64)[None, :]
    xin = np.clip((a2 + ys * a1 + xs * a0) >> 16, -1, w)
    yin = np.clip((a5 + ys * a4 + xs * a3) >> 16, -1, h)
    xy = np.stack([xin, yin], axis=2).astype(np.int16)
    return cv2.remap(img, xy, None, cv2.INTER_NEAREST, borderMode=cv2.BORDER_CONSTANT,
                     borderValue=tuple(int(v) for v in fill))


def pil_affine(img: np.ndarray, m: list[float], interpolation: str, fill: tuple[int, int, int]) -> np.ndarray:
    """``Image.transform(size, AFFINE, m, resample, fillcolor=fill)`` on a uint8 [H, W, 3]."""
    a, b, c, d, e, f = m
    h, w = img.shape[:2]
    if interpolation == "nearest" and not (b == 0 and d == 0) and _fits_fixed(m, w, h):
        return _pil_nearest_fixed(img, m, fill)
    # Pillow: input = m @ (x + 0.5, y + 0.5, 1) in corner coordinates; OpenCV: centre coordinates.
    # Nearest (here: translations, Pillow's exact float path): Pillow takes floor(position),
    # OpenCV rounds half to even; a nudge far below a pixel (but above OpenCV's float32 step)
    # sends the ties Pillow's way
    off = 0.5 - (_NEAREST_NUDGE if interpolation == "nearest" else 0.0)
    cvm = np.array([[a, b, c + 0.5 * (a + b) - off], [d, e, f + 0.5 * (d + e) - off]], np.float64)
    return cv2.warpAffine(img, cvm, (w, h), flags=_CV_INTER[interpolation] | cv2.WARP_INVERSE_MAP,
                          borderMode=cv2.BORDER_CONSTANT, borderValue=tuple(int(v) for v in fill))


def shear_x(img, magnitude, interpolation="nearest", fill=(0, 0, 0)):
    # torchvision: F.affine(shear=[degrees(atan(m)), 0], center=[0, 0])
    m = inverse_affine((0.0, 0.0), 0.0, (0.0, 0.0), 1.0, (math.degrees(math.atan(magnitude)), 0.0))
    return pil_affine(img, m, interpolation, fill)


def shear_y(img, magnitude, interpolation="nearest", fill=(0, 0, 0)):
    m = inverse_affine((0.0, 0.0), 0.0, (0.0, 0.0), 1.0, (0.0, math.degrees(math.atan(magnitude))))
    return pil_affine(img, m, interpolation, fill)


def translate_x(img, pixels, interpolation="nearest", fill=(0, 0, 0)):
    """Shift right by ``pixels`` (torchvision passes ``int(magnitude)``; timm a float)."""
    h, w = img.shape[:2]
    m = inverse_affine((w * 0.5, h * 0.5), 0.0, (pixels, 0.0), 1.0, (0.0, 0.0))
    return pil_affine(img, m, interpolation, fill)


def translate_y(img, pixels, interpolation="nearest", fill=(0, 0, 0)):
    h, w = img.shape[:2]
    m = inverse_affine((w * 0.5, h * 0.5), 0.0, (0.0, pixels), 1.0, (0.0, 0.0))
    return pil_affine(img, m, interpolation, fill)


def rotate(img, degrees, interpolation="nearest", fill=(0, 0, 0)):
    """``Image.rotate(degrees, resample, expand=False, fillcolor=fill)``: counter-clockwise."""
    angle = degrees % 360.0
    h, w = img.shape[:2]
    if angle == 0:
        return img.copy()
    if angle == 180:
        return cv2.rotate(img, cv2.ROTATE_180)
    if angle in (90, 270) and w == h:  # Pillow transposes then
        return cv2.rotate(img, cv2.ROTATE_90_COUNTERCLOCKWISE if angle == 90 else cv2.ROTATE_90_CLOCKWISE)
    r = -math.radians(angle)
    m = [round(math.cos(r), 15), round(math.sin(r), 15), 0.0, round(-math.sin(r), 15), round(math.cos(r), 15), 0.0]
    cx, cy = w / 2.0, h / 2.0
    m[2] = m[0] * -cx + m[1] * -cy + cx
    m[5] = m[3] * -cx + m[4] * -cy + cy
    return pil_affine(img, m, interpolation, fill)


# --- ImageEnhance ------------------------------------------------------------------------------------


def _blend_table(degenerate: float, factor: float) -> np.ndarray:
    """``ImagingBlend`` of a constant with every level: float32, truncated, clipped."""
    t = np.float32(degenerate) + np.float32(factor) * (_RAMP_F32 - np.float32(degenerate))
    return np.clip(t, 0, 255).astype(np.uint8)


def _blend(degenerate: np.ndarray, img: np.ndarray, factor: float) -> np.ndarray:
    if factor == 1.0:
        return img.copy()
    if factor == 0.0:
        return degenerate.copy()
    d = degenerate.astype(np.float32)
    t = d + np.float32(factor) * (img.astype(np.float32) - d)
    np.clip(t, 0, 255, out=t)
    return t.astype(np.uint8)


def pil_gray(img: np.ndarray) -> np.ndarray:
    """Pillow's ``convert("L")``: (19595 R + 38470 G + 7471 B + 2^15) >> 16, uint8 [H, W]."""
    x = img.astype(np.uint32)
    return ((x[..., 0] * 19595 + x[..., 1] * 38470 + x[..., 2] * 7471 + 0x8000) >> 16).astype(np.uint8)


def brightness(img, magnitude, *_):
    return cv2.LUT(img, _blend_table(0.0, 1.0 + magnitude))


def contrast(img, magnitude, *_):
    hist = np.bincount(pil_gray(img).ravel(), minlength=256)
    mean = int(float(hist @ _RAMP) / img.shape[0] / img.shape[1] + 0.5)  # ImageStat's mean, rounded
    return cv2.LUT(img, _blend_table(mean, 1.0 + magnitude))


def color(img, magnitude, *_):
    grey = pil_gray(img)
    return _blend(np.repeat(grey[..., None], 3, axis=2), img, 1.0 + magnitude)


def sharpness(img, magnitude, *_):
    # ImageFilter.SMOOTH (3x3, 5 at the centre, / 13), rounded; Pillow leaves the border as is
    smooth = cv2.filter2D(img.astype(np.float32), -1, _SMOOTH, borderType=cv2.BORDER_REPLICATE)
    degenerate = img.copy()
    degenerate[1:-1, 1:-1] = np.clip(smooth[1:-1, 1:-1] + np.float32(0.5), 0, 255).astype(np.uint8)
    return _blend(degenerate, img, 1.0 + magnitude)


# --- ImageOps lookup tables ---------------------------------------------------------------------------


def posterize(img, bits, *_):
    bits = int(bits)
    if bits >= 8:
        return img.copy()
    return cv2.LUT(img, _IDENTITY & np.uint8(~(2 ** (8 - bits) - 1) & 0xFF))


def solarize(img, threshold, *_):
    return cv2.LUT(img, np.where(_RAMP < threshold, _IDENTITY, 255 - _IDENTITY).astype(np.uint8))


def solarize_add(img, add, *_, threshold=128):
    """timm's ``solarize_add``: ``min(255, i + add)`` below the threshold."""
    t = np.where(_RAMP < threshold, np.minimum(255, _RAMP + int(add)), _RAMP)
    return cv2.LUT(img, t.astype(np.uint8))


def invert(img, *_):
    return cv2.LUT(img, 255 - _IDENTITY)


def _hists(img: np.ndarray) -> list[np.ndarray]:
    return [cv2.calcHist([img], [c], None, [256], [0, 256]).ravel().astype(np.int64) for c in range(3)]


def autocontrast(img, *_):
    tables = []
    for h in _hists(img):
        nz = np.flatnonzero(h)
        lo, hi = (int(nz[0]), int(nz[-1])) if nz.size else (0, 0)
        if hi <= lo:
            tables.append(_RAMP)
            continue
        scale = 255.0 / (hi - lo)
        tables.append(np.clip(np.trunc(_RAMP * scale + -lo * scale), 0, 255))
    return _lut(img, np.stack(tables, axis=1))


def equalize(img, *_):
    tables = []
    for h in _hists(img):
        nz = h[h > 0]
        step = (int(nz.sum()) - int(nz[-1])) // 255 if nz.size > 1 else 0
        if step == 0:
            tables.append(_RAMP)
            continue
        n = step // 2 + np.concatenate(([0], np.cumsum(h)[:-1]))
        tables.append(np.minimum(n // step, 255))
    return _lut(img, np.stack(tables, axis=1))


def identity(img, *_):
    return img


# --- ops outside the policies ---------------------------------------------------------------------------


def grayscale(img: np.ndarray) -> np.ndarray:
    """torchvision's ``rgb_to_grayscale(num_output_channels=3)`` on PIL: ``convert("L")`` x 3."""
    return cv2.cvtColor(pil_gray(img), cv2.COLOR_GRAY2RGB)


def gaussian_blur(img: np.ndarray, kernel: int, sigma: float) -> np.ndarray:
    """torchvision's ``gaussian_blur`` (a ``kernel`` x ``kernel`` Gaussian of ``sigma``, reflected
    border); OpenCV's 8-bit fixed-point sums may differ from torch's float ones by 1 level."""
    return cv2.GaussianBlur(img, (kernel, kernel), sigmaX=sigma, sigmaY=sigma, borderType=cv2.BORDER_REFLECT_101)


OPS = {
    "Identity": identity,
    "ShearX": shear_x,
    "ShearY": shear_y,
    "TranslateX": translate_x,
    "TranslateY": translate_y,
    "Rotate": rotate,
    "Brightness": brightness,
    "Color": color,
    "Contrast": contrast,
    "Sharpness": sharpness,
    "Posterize": posterize,
    "Solarize": solarize,
    "AutoContrast": autocontrast,
    "Equalize": equalize,
    "Invert": invert,
    "SolarizeAdd": solarize_add,
}
GEOMETRY = frozenset(("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate"))


def apply_op(img: np.ndarray, name: str, magnitude: float, interpolation: str = "nearest",
             fill: tuple[int, int, int] = (0, 0, 0)) -> np.ndarray:
    """One op by torchvision's name, with torchvision's signed magnitude (``int`` already
    applied for Translate and Posterize by the caller, as torchvision does)."""
    if name in GEOMETRY:
        return OPS[name](img, magnitude, interpolation, fill)
    return OPS[name](img, magnitude)
