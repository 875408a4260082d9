"""The progress file: where a rank's trainer is, written by the client, read by the daemon.

Shared by both sides; standard library only.

One file per rank, ``progress-r{rank:04d}.json`` in the progress directory (``progress.dir``,
by default ``progress/`` inside the buffer directory), replaced atomically (write ``.progress-*.tmp``, then
``rename(2)``) so a reader sees the old or the new content, never a mix. Content, UTF-8 JSON::

    {"format": "prefetchd-progress", "version": 1,
     "rank": 0, "epoch": 3, "batch": 17,      # the next batch the trainer will read
     "fingerprint": "9f2c...",                # stream fingerprint the trainer expects
     "pid": 4242, "time": 1790000000.0,       # writer and wall-clock time of the write
     "pid_start": 428201, "pid_ns": 4026531836,  # the writer's start time (clock ticks after boot)
                                              # and pid namespace (format.procstate.identity):
                                              # its pid reused or of another namespace is told
     "wait_s": 1.25, "batches": 1234,         # trainer's total wait and batches read so far
     "session": "4242-9f1c2a7b.3",            # changes at every move of the trainer's (a jump)
     "echoed": 0,                             # batches served again (data echoing, opt-in)
     "gpu_fallbacks": 0,                      # hybrid decode: samples the client's GPU decoder
                                              # failed on, decoded on its CPU instead (or replaced)
     "reading": true,                         # false: the trainer reads nothing of this stream now
     "offset": 0,                             # where the segment of `epoch` starts (resumed epochs)
     "waiting_since": 0.0,                    # > 0: blocked in next() for a batch since this time
     "closed": false}                         # true: the trainer is done with this lane (finished)

Resumed epochs (``offset``, optional, 0 when left out). A job resumed at another world size or
batch size than the one that saved its position reads the rest of that epoch as a *segment*: the
epoch's permutation from sample ``offset`` on, shared out among the daemon's ``loader.world_size``
ranks in batches of its ``loader.batch_size`` (``prefetchd.core.sampler``). Then ``batch`` counts
batches of that segment, and its files are named and fingerprinted for it
(``batchfile.batch_name``, ``batchfile.segment_fingerprint``). ``offset`` describes ``epoch``
only: the epochs after it are whole. Every rank of a job must report the same ``offset`` for the
same ``epoch``; the daemon makes nothing for ranks that disagree (among records with its own
``fingerprint``, or none) and says so in ``status.json`` (``resume``). Readers that do not know
the field ignore it (version 1 is kept); they serve whole epochs only.

The validation stream (``validation:`` in the config) has its own files per rank,
``progress-v{rank:04d}.json``, whose ``rank`` field holds the rank's *lane*, ``VAL_LANE + rank``
(``lane()``), and whose ``epoch`` is the pass. A validation client writes ``"reading": true``
while it iterates a pass and ``false`` when the pass ends or is abandoned; the daemon makes
validation batches only for lanes that read. Train progress leaves ``reading`` out (true).

What the trainer is doing (``waiting_since``, ``closed``; both optional, an older client's file
leaves them out and reads as 0 and false). ``waiting_since`` is the wall-clock time at which the
trainer's ``next()`` began to wait for the batch it asks for, written once that wait outlasts the
client's first poll (``_QUEUE_POLL_S``, 50 ms: a batch that is ready costs no write) and set back
to 0 by the record written when the batch arrives (or the wait ends in a timeout), whose
``wait_s`` then counts the whole wait. While it is set, the daemon counts the wait in progress
(``daemon.stalls``): a trainer starved by the daemon is waiting, not stalled. ``closed`` is true
in the last record of a client its trainer closed (``close()``, the end of a ``with`` block left
without an exception) or of a process that exited without an uncaught exception (the client's
``atexit`` hook: Python cannot tell it ``sys.exit(1)`` from ``sys.exit(0)``, so a script that
exits with a status of its own after catching its error is said finished too); a trainer killed by
a signal, ended by an uncaught exception or by ``os._exit`` leaves ``closed`` false, and the
daemon says it is gone. The records that set or clear ``waiting_since`` or set ``closed`` repeat
the last record's position: they move nothing. A daemon that does not know the fields ignores them
(version 1 is kept): it says such a trainer stalled, as before.

Every batch before ``(epoch, batch)`` has been consumed and may be deleted; the daemon keeps
``capacity`` batches ready from that position on. A file that is not exactly this is rejected
whole, with one reason, and the last good value is kept: at most ``MAX_BYTES`` of UTF-8 JSON
whose top level is an object; ``rank``, ``epoch``, ``batch`` integers in ``[0, 2**32)``;
``pid``, ``pid_start``, ``pid_ns``, ``batches``, ``echoed``, ``gpu_fallbacks``, ``offset`` integers in ``[0, 2**63)``;
``time``, ``wait_s`` and ``waiting_since`` finite non-negative numbers; ``reading`` and
``closed`` true or false; ``fingerprint`` and ``session`` strings of at most 128 characters.
Fields not named here are ignored; the optional ones may be left out. Only a regular file is read: a
FIFO, a symlink, a directory or a socket at a progress file's name is refused the same way,
without being waited on (``read``). The file's mode is 0644 (``FILE_MODE``) whatever the
writer's umask, so a daemon running as another user reads it.

Positions only move forward within a ``session``: a client starts a new one at every move its
trainer makes (``seek``, ``set_epoch`` to another epoch, ``load_state_dict``, a new process),
forward or back, and whenever it goes back or into another segment of an epoch; the daemon
treats a new session as a jump. (The client cannot tell back from forward in the daemon's
terms, where a resumed epoch's segment sits after the epoch's own batches, so it need not.) A
record that moves a rank into another segmentation is a jump too, whatever its session. A
backwards move within one session is not a client's doing (a stale copy restored, say): the
daemon keeps the last good position and warns.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass

from prefetchd.format import untrusted
from prefetchd.format.atomic import write_atomic

FORMAT = "prefetchd-progress"
VERSION = 1
# Readable by the daemon whatever the trainer's umask and group: the trainer may be another
# user, in the daemon's group only through a supplementary membership, so its files get the
# trainer's own group. The progress directory (0770 with buffer.group, 0700 without) keeps
# everyone outside the group out; the content is positions, not data.
FILE_MODE = 0o644
MAX_BYTES = 65536
_U32 = 1 << 32
_I64 = 1 << 63
_MAX_STR = 128
VAL_LANE = 1 << 24  # lane of rank r's validation stream: VAL_LANE + r (train: r itself)
STREAMS = ("train", "val")
# Beside the progress files: the lock a launch or serve() that uses a daemon another one started
# holds while it does (prefetchd_client.users); the daemon's watcher does not count it as a stray.
USERS_NAME = ".users.lock"


def lane(stream: str, rank: int) -> int:
    """The lane (the ``rank`` field of the stream's progress and batch files) of ``rank`` in ``stream``."""
    if stream not in STREAMS:
        raise ValueError(f"stream must be one of {STREAMS}, got {stream!r}")
    return rank + (VAL_LANE if stream == "val" else 0)


def split_lane(lane_id: int) -> tuple[str, int]:
    """``(stream, rank)`` of a lane."""
    return ("val", lane_id - VAL_LANE) if lane_id >= VAL_LANE else ("train", lane_id)


class ProgressError(ValueError):
    """A progress file is missing, torn or not ours."""


@dataclass(frozen=True)
class Progress:
    rank: int
    epoch: int
    batch: int
    fingerprint: str = ""
    pid: int = 0
    time: float = 0.0
    wait_s: float = 0.0
    batches: int = 0
    session: str = ""
    echoed: int = 0
    reading: bool = True
    gpu_fallbacks: int = 0
    offset: int = 0  # the first sample of the segment of ``epoch`` this rank reads (0: the whole epoch)
    pid_start: int = 0  # the writer's procstate.identity() (0: not said)
    pid_ns: int = 0
    waiting_since: float = 0.0  # > 0: the trainer's next() waits for a batch since this wall-clock time
    closed: bool = False  # the trainer closed its client, or its process exited cleanly: finished

    @property
    def position(self) -> tuple[int, int]:
        return (self.epoch, self.batch)


def progress_name(rank: int) -> str:
    """The file of a lane (``rank`` for the train stream, ``lane("val", r)`` for validation)."""
    stream, r = split_lane(rank)
    return f"progress-{'v' if stream == 'val' else 'r'}{r:04d}.json"


def parse_progress_name(name: str) -> int | None:
    """The lane a progress file name is for, or None."""
    if not (name.startswith(("progress-r", "progress-v")) and name.endswith(".json")):
        return None
    digits = name[len("progress-r"):-len(".json")]
    if not digits.isdigit() or not digits.isascii():
        return None
    return lane("val" if name[9] == "v" else "train", int(digits))


def progress_path(directory: str, rank: int) -> str:
    return os.path.join(directory, progress_name(rank))


def encode(p: Progress) -> bytes:
    return json.dumps({"format": FORMAT, "version": VERSION, **asdict(p)}).encode()


def decode(data: bytes) -> Progress:
    """Parse and check a progress file's content; any defect raises ``ProgressError`` (never
    anything else: the reader is a long-running daemon and the writer may be anyone in a group)."""
    if len(data) > MAX_BYTES:
        raise ProgressError(f"larger than {MAX_BYTES} bytes")
    try:
        d = json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError:
        raise ProgressError("not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise ProgressError(f"not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise ProgressError("JSON nested too deeply") from None
    except ValueError as e:  # an integer of thousands of digits, NaN or Infinity
        raise ProgressError(f"not valid JSON ({_short(str(e))})") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise ProgressError("not a prefetchd progress file")
    if d.get("version") != VERSION or isinstance(d.get("version"), bool):
        raise ProgressError(f"progress version {_short(repr(d.get('version')))} is not {VERSION}")
    vals: dict = {}
    for k in ("rank", "epoch", "batch"):
        if k not in d:
            raise ProgressError(f"missing field {k!r}")
        vals[k] = _int(d, k, _U32)
    for k in ("pid", "pid_start", "pid_ns", "batches", "echoed", "gpu_fallbacks", "offset"):
        if k in d:
            vals[k] = _int(d, k, _I64)
    for k in ("time", "wait_s", "waiting_since"):
        if k in d:
            v = d[k]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 <= v < 1e300:
                raise ProgressError(f"field {k!r} must be a finite non-negative number, got {_short(repr(v))}")
            vals[k] = float(v)
    for k in ("fingerprint", "session"):
        if k in d:
            v = d[k]
            if not isinstance(v, str) or len(v) > _MAX_STR:
                raise ProgressError(f"field {k!r} must be a string of at most {_MAX_STR} characters, "
                                    f"got {_short(repr(v))}")
            vals[k] = v
    for k in ("reading", "closed"):
        if k in d:
            if not isinstance(d[k], bool):
                raise ProgressError(f"field {k!r} must be true or false, got {_short(repr(d[k]))}")
            vals[k] = d[k]
    return Progress(**vals)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number")


def _int(d: dict, k: str, bound: int) -> int:
    v = d[k]
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < bound:
        raise ProgressError(f"field {k!r} must be an integer in [0, {bound}), got {_short(repr(v))}")
    return v


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def read(path: str) -> Progress:
    """The progress file at ``path``. Whatever a trainer put there, this returns or raises
    ``ProgressError`` at once: a FIFO, a symlink, a directory, a socket or a file larger than
    ``MAX_BYTES`` is refused without blocking (``untrusted.read_regular``)."""
    try:
        data = untrusted.read_regular(path, MAX_BYTES)
    except FileNotFoundError:
        raise ProgressError("no progress file yet") from None
    except untrusted.NotRegular as e:
        raise ProgressError(str(e)) from None
    except OSError as e:
        raise ProgressError(f"cannot read: {e.strerror}") from None
    return decode(data)


def write(directory: str, p: Progress) -> str:
    """Atomically replace the rank's progress file. Returns its path."""
    # the ".progress-" prefix: the daemon's watcher skips a client's temp files by it
    return write_atomic(directory, progress_name(p.rank), lambda f: f.write(encode(p)), FILE_MODE, ".progress-")
