"""Sample data: an ImageFolder of photo-like JPEGs, made on the spot (for demo, bench, tests).

Each image is a smooth random colour field with shapes and sensor-like grain, at
ImageNet-like sizes (mostly 500 on the long side, 4:3, 3:2 and 1:1 both ways, a tail larger),
quality 85..95, 4:2:0, about one in ten progressive. The grain matters: decoding costs by
entropy, and flat synthetic images decode unrealistically fast. Deterministic for a seed.
"""

from __future__ import annotations

import io
import os

import numpy as np
from PIL import Image, ImageDraw


def photo_like(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    # a low-resolution random field, upsampled smoothly: large soft colour regions
    field = rng.integers(0, 256, size=(4, 5, 3), dtype=np.uint8)
    im = Image.fromarray(field, "RGB").resize((width, height), Image.Resampling.BICUBIC)
    draw = ImageDraw.Draw(im)
    for _ in range(int(rng.integers(3, 9))):
        x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
        x1, y1 = x0 + int(rng.integers(10, width // 2 + 11)), y0 + int(rng.integers(10, height // 2 + 11))
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x0, y0, x1, y1), fill=colour)
    a = np.asarray(im, dtype=np.int16) + rng.normal(0, 7.0, (height, width, 1)).astype(np.int16)
    return Image.fromarray(np.clip(a, 0, 255).astype(np.uint8), "RGB")


def jpeg_bytes(im: Image.Image, rng: np.random.Generator) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=int(rng.integers(85, 96)), subsampling=2, progressive=bool(rng.random() < 0.1))
    return buf.getvalue()


def make_image_folder(root: str, classes: int = 8, per_class: int = 80, seed: int = 0,
                      long_side: int = 500) -> int:
    """Write ``root/n0000000k/img_j.JPEG`` files; returns how many."""
    rng = np.random.default_rng(seed)
    aspects = (4 / 3, 3 / 4, 3 / 2, 2 / 3, 1.0)
    n = 0
    for c in range(classes):
        d = os.path.join(root, f"n{c:08d}")
        os.makedirs(d, exist_ok=True)
        for j in range(per_class):
            long = long_side if rng.random() < 0.85 else int(rng.integers(long_side // 2, long_side * 2))
            a = aspects[int(rng.integers(0, len(aspects)))]
            w, h = (long, round(long / a)) if a >= 1 else (round(long * a), long)
            with open(os.path.join(d, f"img_{j:05d}.JPEG"), "wb") as f:
                f.write(jpeg_bytes(photo_like(rng, w, h), rng))
            n += 1
    return n
