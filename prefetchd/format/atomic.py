"""Replacing a file whole: written under a temp name in the same directory, then renamed over the
old one, so a reader sees the old file or the new one, never a torn one; nothing is left behind
when the write fails."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import BinaryIO


def write_atomic(directory: str, name: str, write: Callable[[BinaryIO], object], file_mode: int | None = None,
                 prefix: str | None = None) -> str:
    """``write(f)`` into a temp file (``prefix``, default ``.NAME-``) in ``directory`` and rename it
    to ``name``; ``file_mode`` is set whatever the writer's umask (default: mkstemp's 0600).
    Returns the path."""
    fd, tmp = tempfile.mkstemp(prefix=prefix or f".{name}-", suffix=".tmp", dir=directory)
    path = os.path.join(directory, name)
    try:
        if file_mode is not None:
            os.fchmod(fd, file_mode)
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path
