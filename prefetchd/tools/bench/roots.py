"""``prefetchd bench --root A --root B``: the daemon's throughput on several dataset roots, side by side.

The same corpus in two forms (an ImageFolder and the tar of class tars made from it, say) is run
through the real daemon in turn, alternating root by root in every repeat so that drift in the
machine's load touches each alike; images/s from the first batch the client got to the last (the
index scan is outside it), then mean, spread and the ratio to the first root.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable


def compare_roots(roots: list[str], run: Callable[[str], dict], workers: int, repeats: int) -> list[dict]:
    """``run(root)`` is one run of the daemon on ``root`` (``throughput.daemon_run`` with the
    bench's options bound): its ``img_s``, ``images`` and ``first_batch_s``."""
    runs: dict[str, list[float]] = {r: [] for r in roots}
    for rep in range(repeats):
        for root in roots:
            d = run(root)
            runs[root].append(d["img_s"])
            print(f"[{rep + 1}/{repeats}] {root}: {d['img_s']:,.0f} img/s ({d['images']} images, {workers} workers), "
                  f"first batch {d['first_batch_s']:.2f} s", flush=True)
    rows = []
    base = statistics.mean(runs[roots[0]])
    for root in roots:
        vals = runs[root]
        sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
        rows.append({"root": root, "img_s": vals, "mean": statistics.mean(vals), "stdev": sd})
        print(f"{root}: {statistics.mean(vals):,.0f} ± {sd:,.0f} img/s over {len(vals)} run(s), "
              f"{statistics.mean(vals) / base:.3f} x {roots[0]}")
    return rows
