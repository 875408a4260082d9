"""Why production waits, said once per spell.

A planner says why it holds a batch back (``Plan.blocked``, with its ``cause``: ``max_bytes``,
``too_small``, ``disk``) at every turn of the loop, and a stream limited by ``buffer.max_bytes``
is held back at most turns while its trainer reads (a batch read makes room for one, then the
next waits again). The log gets one line when a spell of waiting starts (or its cause changes);
the spell ends once the stream has gone ``quiet_s`` without waiting. A plan that used every
free worker slot says nothing either way about the spell (it ran out of slots before it could
run out of room), but the status (``blocked``) follows every plan: once one was not held back,
the stream does not wait on bytes or space, whatever the log's spell still counts.
"""

from __future__ import annotations

import logging

log = logging.getLogger("prefetchd")

SPELL_QUIET_S = 10.0


class Waiting:
    def __init__(self, quiet_s: float = SPELL_QUIET_S):
        self.quiet_s = quiet_s
        self.blocked: dict[str, str | None] = {}  # per stream: why it waits now (for the status)
        self._cause: dict[str, str] = {}  # per stream: the cause of the spell being said
        self._clear_since: dict[str, float] = {}

    def note(self, stream: str, cause: str | None, blocked: str | None, now: float,
             all_slots: bool = False) -> None:
        """One plan's outcome for ``stream`` (``cause`` None: it was not held back; ``all_slots``:
        it used every free worker slot)."""
        self.blocked[stream] = blocked
        if cause is None and all_slots:  # no word on the spell: it ran out of slots, not of room
            return
        if cause is None:
            since = self._clear_since.setdefault(stream, now)
            if stream in self._cause and now - since >= self.quiet_s:
                del self._cause[stream]
            return
        self._clear_since.pop(stream, None)
        if self._cause.get(stream) != cause:
            log.warning("waiting: %s", blocked)
            self._cause[stream] = cause
