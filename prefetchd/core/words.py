"""Counts in words: ``1 class``, ``2 classes``, ``1 batch`` (never ``1 batches``)."""

from __future__ import annotations


def plural(n: int, one: str, many: str | None = None) -> str:
    """``n`` and the noun in the right number (``many`` defaults to ``one + "s"``)."""
    return f"{n:,} {one if n == 1 else many or one + 's'}"
