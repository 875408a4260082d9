"""Progress bars for the commands a person watches (demo, bench, the index scan): tqdm's.

A bar is drawn only on a terminal: with stderr not a TTY (systemd's journal, a log file, a test
reading the output) or with ``quiet``, nothing is drawn and the output stays one line per
result. ``TQDM_DISABLE=1`` (tqdm's own switch) turns every bar off as well.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any


def bar(iterable: Iterable | None = None, *, quiet: bool = False, **kwargs: Any):
    """A tqdm bar on stderr, or a disabled one (which still iterates) off a terminal or when quiet."""
    from tqdm import tqdm

    # disable=None is tqdm's "off when not a TTY"; passing it overrides tqdm's reading of
    # TQDM_DISABLE, so that switch is read here
    off = quiet or os.environ.get("TQDM_DISABLE", "").lower() in ("1", "true", "yes")
    return tqdm(iterable, disable=True if off else None, dynamic_ncols=True, **kwargs)
