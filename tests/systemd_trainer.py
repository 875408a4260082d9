"""A trainer for tests/test_systemd.py: runs inside the namespace as an unprivileged user, with the
service's venv. Prints ``batch EPOCH BATCH SHA256`` for every batch it reads (images as NHWC
bytes, then labels as int64), in order. With ``PAUSE_AFTER GO_FILE`` it writes /tmp/paused after
that many batches and waits for GO_FILE before reading on.

Usage: python systemd_trainer.py CONFIG EPOCHS [PAUSE_AFTER GO_FILE]
"""

from __future__ import annotations

import hashlib
import os
import sys
import time

import numpy as np
from prefetchd_client import PrefetchClient


def main() -> None:
    config, epochs = sys.argv[1], int(sys.argv[2])
    pause_after = int(sys.argv[3]) if len(sys.argv) > 3 else None
    go = sys.argv[4] if len(sys.argv) > 4 else None
    n = 0
    with PrefetchClient(config, rank=0, timeout=120, as_numpy=True) as c:
        for e in range(epochs):
            for b, (x, y) in enumerate(c.iter_epoch(e)):
                h = hashlib.sha256(np.ascontiguousarray(x.transpose(0, 2, 3, 1)).tobytes()
                                   + np.asarray(y, np.int64).tobytes()).hexdigest()
                print(f"batch {e} {b} {h}", flush=True)
                n += 1
                if n == pause_after:
                    open("/tmp/paused", "w").close()
                    deadline = time.monotonic() + 120
                    while not os.path.exists(go) and time.monotonic() < deadline:
                        time.sleep(0.05)


if __name__ == "__main__":
    main()
