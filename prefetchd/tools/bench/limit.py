"""The decode-only limit of ``prefetchd bench``: Pillow (libjpeg-turbo) merely decoding every
image, at reduced DCT size, in ``procs`` processes; a file it cannot decode (cut short, empty,
not an image) is skipped and counted, as the daemon quarantines it.
"""

from __future__ import annotations

import time
from multiprocessing import get_context

from prefetchd.core.words import plural


def _decode_only(paths: list[str], min_side: int = 256) -> tuple[int, list[str]]:
    """Decode ``paths`` as the limit does: (how many decoded, ``path: why`` of each one that did not)."""
    from PIL import Image

    done, skipped = 0, []
    for p in paths:
        try:  # a file Pillow cannot decode (cut short, empty, not an image) is skipped, as the daemon quarantines it
            with Image.open(p) as im:
                w, h = im.size
                s = min_side / max(1, min(w, h))
                im.draft("RGB", (max(1, int(w * s)), max(1, int(h * s))))
                im.convert("RGB").load()
            done += 1
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
            skipped.append(f"{p}: {e}")
    return done, skipped


def decode_limit(paths: list[str], procs: int) -> tuple[float, list[str]]:
    """The decode-only limit over ``paths`` with ``procs`` processes: (images/s of those decoded,
    ``path: why`` of each file skipped because Pillow cannot decode it)."""
    for p in paths:  # warm the page cache, as the daemon's run will have it
        with open(p, "rb") as f:
            f.read()
    chunks = [paths[i::procs] for i in range(procs)]
    with get_context("forkserver").Pool(procs) as pool:
        pool.map(_decode_only, [c[:10] for c in chunks])
        t = time.perf_counter()
        results = pool.map(_decode_only, chunks)
        dt = time.perf_counter() - t
    n = sum(done for done, _ in results)
    skipped = sorted(x for _, sk in results for x in sk)
    if not n:
        raise ValueError(f"none of the {len(paths)} files could be decoded ({skipped[0] if skipped else 'no files'})")
    return n / dt, skipped


def say_skipped(skipped: list[str]) -> None:
    if skipped:
        print(f"decode-only limit: skipped {plural(len(skipped), 'file')} Pillow cannot decode (the daemon "
              f"quarantines them): " + "; ".join(skipped[:3]) + (" ..." if len(skipped) > 3 else ""), flush=True)
