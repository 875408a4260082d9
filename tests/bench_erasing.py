"""Per-batch cost of the client's random erasing (``augment.random_erasing.erase_on: client``) on a
normalised batch of 256 x 3 x 224 x 224 float32: the draws of 256 sample keys, the boxes and
normals (numpy, host), and the fills, on CPU tensors (one torch thread) and, where CUDA is
present, on the GPU (queued on a side stream, timed to its completion). Beside it, the client's
normalisation of the same batch. Run: ``.venv/bin/python tests/bench_erasing.py`` (docs/policies.md).
"""
import time

import numpy as np
import torch
from prefetchd_client import normalize
from prefetchd_client.erasing import ClientErasing

from prefetchd.core.augment.seeds import sample_draws

B, S = 256, 224
torch.set_num_threads(1)


def best(fn, reps=5, sync=None):
    ts = []
    for r in range(reps):
        t = time.perf_counter()
        fn(r)
        if sync is not None:
            sync()
        ts.append(time.perf_counter() - t)
    return min(ts) * 1e3, float(np.median(ts)) * 1e3


def main() -> None:
    x8 = torch.randint(0, 256, (B, 3, S, S), dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    print("normalize, CPU: {:.1f} ms (median {:.1f})".format(*best(lambda r: normalize(x8))))
    print("draws of {} keys: {:.1f} ms (median {:.1f})".format(B, *best(lambda r: [sample_draws(7, r, i) for i in range(B)])))
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for dev in devices:
        xn = normalize(x8.to(dev))
        sync = torch.cuda.synchronize if dev == "cuda" else None
        side = torch.cuda.Stream() if dev == "cuda" else None
        for p in (0.25, 1.0):
            for mode in ("const", "rand", "pixel"):
                er = ClientErasing({"p": p, "scale": [0.02, 1 / 3], "ratio": [0.3, 1 / 0.3], "mode": mode,
                                    "count": [1, 1], "seed": 7})
                y = xn.clone()

                def run(r, er=er, y=y, side=side):
                    if side is None:
                        er(y, r, np.arange(B) + 1000 * r)
                    else:
                        with torch.cuda.stream(side):
                            er(y, r, np.arange(B) + 1000 * r)

                boxes = len(er.plan(0, np.arange(B), S, S))
                plan = best(lambda r, er=er: er.plan(r, np.arange(B) + 1000 * r, S, S))
                t = best(run, sync=sync)
                print(f"{dev} p={p} {mode}: {boxes} boxes; erase {t[0]:.1f} ms (median {t[1]:.1f}); boxes and "
                      f"normals alone {plan[0]:.1f} ms")


if __name__ == "__main__":
    main()
