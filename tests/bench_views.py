"""Per-sample cost of DINO's multi-crop (2 x 224 + 6 x 96) made by augment.views (one decode shared
by the 8 views) against 8 separate make_sample calls (a decode per view), and one 224 crop.
Run: ``.venv/bin/python tests/bench_views.py`` (BENCHMARKS.md, "Several views").
"""
import sys
import time

import numpy as np

from prefetchd.core.augment import modes, views
from prefetchd.core.config import AugmentConfig
from prefetchd.tools.samples import jpeg_bytes, photo_like

rng = np.random.default_rng(0)
datas = [jpeg_bytes(photo_like(np.random.default_rng(i), 500, 375), np.random.default_rng(i)) for i in range(32)]
J = dict(brightness=0.4, contrast=0.4, saturation=0.2)
cfg = AugmentConfig(views=[{"count": 2, "output_size": 224, "rrc_scale": [0.4, 1.0], **J},
                           {"count": 6, "output_size": 96, "rrc_scale": [0.05, 0.4], **J}])
cfgs = views.view_configs(cfg)
one = AugmentConfig(mode="random_resized_crop", output_size=224, **J)


def run(fn, reps=3):
    best = 1e9
    for _ in range(reps):
        t = time.perf_counter()
        for i, d in enumerate(datas):
            fn(d, i)
        best = min(best, (time.perf_counter() - t) / len(datas))
    return best * 1e3


shared = run(lambda d, i: views.make_views(d, cfgs, 0, 0, i))
separate = run(lambda d, i: [modes.make_sample(d, c, modes.draws(0, 0, i, v)) for v, c in enumerate(cfgs)])
single = run(lambda d, i: modes.make_sample(d, one, modes.draws(0, 0, i)))
print(f"500x375 JPEGs, ms per sample (best of 3 passes over 32): augment.views 2x224+6x96 (one decode) {shared:.2f}; "
      f"8 separate make_sample {separate:.2f}; one random_resized_crop 224 {single:.2f}", file=sys.stdout)
