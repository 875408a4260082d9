"""The quarantine log: samples that cannot become a batch's sample, kept across restarts.

``quarantine.jsonl`` in the buffer directory holds one JSON object per line (``index``,
``path``, ``reason``, ``epoch``, ``time``, ``dataset``, ``stamp``); lines of another dataset, or
that cannot be parsed, are skipped. ``stamp`` is what the sample's bytes were when it was
quarantined (``Index.content_stamp``: its archive's identity and place, or its file's size, mtime,
inode and ctime): a line whose stamp is not the sample's now (an archive rewritten and indexed again, a
file replaced) is dropped at load, so a sample is not held quarantined for content it no longer
has; it is tried again. Each sample is recorded and warned about once. A sample that was
being decoded when its worker died twice is quarantined too (its worker's death, not a write or
a timeout, names it).
"""

from __future__ import annotations

import json
import logging
import os
import time

from prefetchd.executors.worker import Quarantined
from prefetchd.format import status

log = logging.getLogger("prefetchd")

_DEATHS_TO_QUARANTINE = 2


class QuarantineLog:
    def __init__(self, buffer_dir: str, dataset_fingerprint: str, path_of, stamp_of=None):
        self.path = os.path.join(buffer_dir, status.QUARANTINE_NAME)
        self.dataset = dataset_fingerprint
        self._path_of = path_of
        self._stamp_of = stamp_of  # index -> Index.content_stamp; None: lines are kept whatever the content
        self.records: dict[int, dict] = {}
        self._deaths: dict[int, int] = {}
        self.crashers: tuple[tuple[int, str], ...] = ()  # sent with each task

    def load(self) -> None:
        stale: list[int] = []
        try:
            with open(self.path, encoding="utf-8", errors="replace") as f:
                for line in f:
                    try:
                        q = json.loads(line)
                        if isinstance(q, dict) and q.get("dataset") == self.dataset:
                            if self._changed(q):
                                stale.append(int(q["index"]))
                                continue
                            self.records[int(q["index"])] = q
                    except (ValueError, KeyError, TypeError, RecursionError):
                        continue
        except FileNotFoundError:
            pass
        stale = sorted(set(stale) - set(self.records))
        if stale:
            log.info("%d sample(s) quarantined earlier are tried again: their content changed since (%s)",
                     len(stale), ", ".join(map(str, stale[:10])) + (" ..." if len(stale) > 10 else ""))

    def _changed(self, q: dict) -> bool:
        """Was the line ``q`` made for other content than sample ``q["index"]`` has now?"""
        if self._stamp_of is None or q.get("stamp") is None:
            return False
        try:
            return self._stamp_of(int(q["index"])) != q["stamp"]
        except IndexError:
            return True

    def add(self, q: Quarantined, epoch: int) -> None:
        if q.index in self.records:
            return
        rec = {"index": q.index, "path": q.path, "reason": q.reason, "epoch": epoch, "time": time.time(),
               "dataset": self.dataset}
        if self._stamp_of is not None:
            rec["stamp"] = self._stamp_of(q.index)
        self.records[q.index] = rec
        log.warning("quarantined sample %d (%s): %s; a deterministic replacement stands in for it",
                    q.index, q.path, q.reason)
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                         status.FILE_MODE)
            with open(fd, "a", encoding="utf-8") as f:
                os.fchmod(fd, status.FILE_MODE)  # whatever the umask: the group reads it
                f.write(json.dumps(rec) + "\n")
        except OSError as e:
            log.error("cannot append to the quarantine list: %s", e.strerror)

    def worker_died(self, index: int, how: str) -> None:
        self._deaths[index] = self._deaths.get(index, 0) + 1
        if self._deaths[index] >= _DEATHS_TO_QUARANTINE and index not in self.records:
            reason = f"its worker {how} twice while decoding it"
            self.crashers += ((index, reason),)
            self.add(Quarantined(index, self._path_of(index), reason), -1)

    def __len__(self) -> int:
        return len(self.records)
