#!/usr/bin/env python3
"""A user transform's batches through device='cuda', normalize=True, against the same batches read
as numpy from a second daemon started afresh (batches are a pure function of seed, epoch, batch)."""
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import yaml
from prefetchd_client import PrefetchClient

root, out = sys.argv[1], sys.argv[2]
N = 8
def run(kind):
    tmp = tempfile.mkdtemp(dir="/dev/shm", prefix="pfd-u-")
    cfg = {"dataset": {"root": root}, "loader": {"batch_size": 128, "epochs": None, "seed": 7}, "workers": {"count": 14},
           "buffer": {"dir": tmp + "/buf", "capacity": 16, "max_bytes": "8GiB"},
           "augment": {"transform": "mytf:make_train", "transform_args": {"size": 224},
                       "transform_path": os.path.abspath(".gpu")}}
    yaml.safe_dump(cfg, open(tmp + "/c.yaml", "w"))
    d = subprocess.Popen([sys.executable, "-m", "prefetchd", "run", "--config", tmp + "/c.yaml"],
                         stdout=open(tmp + ".log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    got = []
    t0 = time.perf_counter()
    try:
        if kind == "cuda":
            with PrefetchClient(tmp + "/c.yaml", device="cuda", normalize=True, timeout=120) as c:
                for x, y in c:
                    assert x.device.type == "cuda" and x.dtype == torch.float32 and tuple(x.shape) == (128, 3, 224, 224), (x.device, x.dtype, x.shape)
                    got.append((x.cpu().numpy(), y.cpu().numpy()))
                    if len(got) == N:
                        break
        else:
            with PrefetchClient(tmp + "/c.yaml", as_numpy=True, normalize=True, timeout=120) as c:
                for x, y in c:
                    got.append((np.asarray(x), np.asarray(y)))
                    if len(got) == N:
                        break
    finally:
        d.terminate()
        d.wait(30)
        print(open(tmp + ".log").read()[-1500:] if d.returncode not in (0, -15) else f"daemon rc {d.returncode}")
        subprocess.run(["rm", "-rf", tmp])
    return got, time.perf_counter() - t0
a, ta = run("cuda")
b, tb = run("numpy")
diff = max(float(np.abs(x - u).max()) for (x, _), (u, _) in zip(a, b, strict=True))
labels_same = all((y == v).all() for (_, y), (_, v) in zip(a, b, strict=True))
res = {"check": "user_transform_cuda_normalize", "batches": N, "max_abs_diff_vs_numpy_restart": diff,
       "labels_same": bool(labels_same), "cuda_run_s": round(ta, 1), "numpy_run_s": round(tb, 1),
       "mean_of_first": float(a[0][0].mean())}
print(json.dumps(res), flush=True)
open(out, "a").write(json.dumps(res) + "\n")
assert diff < 1e-4 and labels_same, res
