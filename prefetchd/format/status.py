"""The daemon's status and meta files, readable from outside the trainer.

``meta.json`` (written once per start, before any batch is published) tells a client what the
daemon serves: ``{"format": "prefetchd-meta", "version": 1, "pid", "fingerprint" (16 hex
digits, the batch header's u64, ``stream_id``), "num_samples", "num_classes", "batch_size",
"batches_per_epoch", "world_size", "ranks", "epochs", "output_size", "views" (each view's [height, width]), "started",
"dataset_fingerprint", "identity" ({"start", "ns"}: the daemon's process, ``procstate.identity``), ...}``.
A daemon that starts takes the lock, then removes the last daemon's meta.json: a reader may have
read that one first, so it trusts a meta.json only while its ``pid`` holds the lock
(``meta_serves``).

``status.json`` is rewritten about once a second (atomically) with the live figures; its keys
are listed in ``format_status``. Both live in the buffer directory, mode 0640 (``FILE_MODE``)
whatever the umask. Standard library only.

Their readers (the client, ``prefetchd status``, often run by root) read them as they read
any file they did not make: a regular file of at most ``MAX_JSON_BYTES`` or nothing, opened
without following a symlink and without waiting on a FIFO (``untrusted.read_regular``). The
lock file is probed the same way.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import stat
import time
from typing import Any

from prefetchd.format import procstate, untrusted
from prefetchd.format.atomic import write_atomic

META_NAME = "meta.json"
STATUS_NAME = "status.json"
QUARANTINE_NAME = "quarantine.jsonl"
LOCK_NAME = "daemon.lock"
# Written by ``prefetchd launch`` and ``serve()`` into a buffer directory their start created
# (``prefetchd_client.child.Created``): ``{"format": "prefetchd-created", "version": 1, "pid",
# "made": [[directory, outermost parent made for it], ...]}``. Its own start removes those at its
# end; one killed before that (SIGKILL, the OOM killer) leaves it, and the next start that finds
# it with no daemon holding the directory takes the directories over and removes them at its end.
CREATED_NAME = "created.json"
# Every file the daemon writes, whatever its umask: the daemon writes, its group (trainers of
# ``buffer.group``) reads; the directory's own mode keeps everyone else out.
FILE_MODE = 0o640
STALE_AFTER_S = 5.0  # status.json is rewritten every second: older than this, it is stale
MAX_JSON_BYTES = 16 << 20  # status.json of thousands of ranks fits many times over
_MAX_LOCK_BYTES = 64


def stream_id(stream_fingerprint: str, dataset_fingerprint: str, transform_code: str | None = None) -> str:
    """meta.json's ``fingerprint`` (and every loader state's): 16 hex digits naming the batch
    stream, from the config's ``stream_fingerprint()``, the dataset's fingerprint and, with
    ``augment.transform``, its module file's (meta.json's ``transform_code``)."""
    text = f"{stream_fingerprint}|{dataset_fingerprint}" + (f"|{transform_code}" if transform_code else "")
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def lock_pid(directory: str) -> int | None:
    """The pid the daemon holding (or last holding) the lock wrote into it."""
    try:
        text = untrusted.read_regular(os.path.join(directory, LOCK_NAME), _MAX_LOCK_BYTES).decode(errors="replace").strip()
    except (OSError, untrusted.NotRegular):
        return None
    return int(text) if text.isdigit() else None


def daemon_alive(directory: str) -> bool | None:
    """True if a daemon holds the lock on ``directory``, False if none, None if unknown.

    The directory's own lock first: it is the truth (``ring.Lock``), and deleting or replacing
    ``daemon.lock`` does not lose it. Then ``daemon.lock``, which daemons of older versions lock
    alone (and what is left to look at when the directory cannot be opened)."""
    try:
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError:  # not ours to open (its mode): the file tells
        dfd = -1
    if dfd >= 0:
        try:
            fcntl.flock(dfd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            pass
        finally:
            os.close(dfd)
    try:  # O_NONBLOCK: a FIFO put at the lock's name must not hang the caller
        fd = os.open(os.path.join(directory, LOCK_NAME), os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # not a lock a daemon made
            return None
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def lock_holders(directory: str) -> set[int] | None:
    """The pids holding a ``flock`` on ``directory`` itself (the daemon's lock: ``ring.Lock``), from
    the kernel's lock table (``/proc/locks``, pids as this pid namespace sees them: 0 for a process
    it cannot see); None where that cannot be read."""
    try:
        st = os.stat(directory)
        with open("/proc/locks", "rb") as f:
            table = f.read(1 << 22)
    except OSError:
        return None
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}".encode()
    holders = set()
    for line in table.splitlines():
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 4242 00:2f:1234 0 EOF"; a waiter's line has "->" after the number
        if len(fields) >= 6 and fields[1] == b"FLOCK" and fields[5] == want and fields[4].isdigit():
            holders.add(int(fields[4]))
    return holders


def daemon_identity() -> dict[str, int]:
    """meta.json's ``identity``: who wrote it, beyond a pid (which another process may hold
    later), for ``meta_serves``."""
    start, ns = procstate.identity()
    return {"start": start, "ns": ns}


def meta_serves(directory: str, meta: dict[str, Any]) -> bool:
    """Is ``meta`` (a meta.json read from ``directory``) the description of the daemon serving it
    now? Not when its process is gone (a daemon that stopped or died: the next one, which holds
    the lock already, removes its meta.json before writing its own), nor, where the kernel's lock
    table can tell (the daemon in this pid namespace), when its pid does not hold the lock. The
    caller checks first that a daemon holds the lock and that ``daemon.lock`` names ``meta``'s pid:
    in the moment between a new daemon's lock and its pid, the file still names the last one."""
    pid = meta.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool):
        return False
    ident = meta.get("identity") if isinstance(meta.get("identity"), dict) else {}
    start, ns = ident.get("start", 0), ident.get("ns", 0)
    start, ns = (v if isinstance(v, int) and not isinstance(v, bool) else 0 for v in (start, ns))
    if procstate.state(pid, start, ns) == procstate.GONE:
        return False
    if ns and ns == procstate.pid_namespace():
        holders = lock_holders(directory)
        if holders is not None and 0 not in holders and pid not in holders:
            return False
    return True


def write_json(directory: str, name: str, data: dict[str, Any]) -> None:
    # one write: json.dump writes each token to the file object (2,000 calls for 32 ranks)
    write_atomic(directory, name, lambda f: f.write(json.dumps(data, indent=1, sort_keys=True).encode()), FILE_MODE)


def read_json(directory: str, name: str) -> dict[str, Any] | None:
    """The JSON object in the file, or None: missing, unreadable, not a regular file, larger
    than ``MAX_JSON_BYTES`` or not a JSON object. Never blocks."""
    try:
        data = json.loads(untrusted.read_regular(os.path.join(directory, name), MAX_JSON_BYTES).decode("utf-8"))
    except (OSError, ValueError, RecursionError):  # NotRegular, UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None
    return data if isinstance(data, dict) else None


def is_stale(s: dict[str, Any], now: float | None = None) -> bool:
    """A running daemon's status older than ``STALE_AFTER_S`` (it is rewritten every second):
    its figures no longer describe the daemon (it cannot write the file: a full filesystem)."""
    updated = s.get("updated")
    if s.get("state") == "stopped" or not isinstance(updated, (int, float)):
        return False
    return (time.time() if now is None else now) - updated > STALE_AFTER_S


def describe_stall(st: dict[str, Any]) -> str:
    """A rank's ``stalled`` record as said: ``no progress for 32 s (since 22:36:17; pid 4242
    stopped)``, the time local, the trainer's process ``running``, ``stopped``, ``gone`` or
    ``unknown`` (another pid namespace: said so)."""
    pid = f"pid {st.get('pid')} {st.get('process', '?')}" if st.get("pid") else "no pid"
    if st.get("process") == "unknown":
        pid = f"pid {st.get('pid')} in another pid namespace, its state unknown"
    since = time.strftime("%H:%M:%S", time.localtime(st.get("since") or 0))
    return f"no progress for {st.get('age_s') or 0:.0f} s (since {since}; {pid})"


def describe_waiting(w: dict[str, Any]) -> str:
    """A rank's ``waiting`` record as said: ``WAITING for data: its next() has waited 12 s for a
    batch (since 22:36:17)``, the time local: the daemon starves it, the trainer is not to blame."""
    since = time.strftime("%H:%M:%S", time.localtime(w.get("since") or 0))
    return f"WAITING for data: its next() has waited {w.get('for_s') or 0:.0f} s for a batch (since {since})"


def _trainer_said(rs: dict[str, Any]) -> str:
    """The end of a rank's line: what its trainer is doing, when that is news."""
    if rs.get("stalled"):
        return f"; STALLED: {describe_stall(rs['stalled'])}"
    if rs.get("waiting"):
        return f"; {describe_waiting(rs['waiting'])}"
    if rs.get("trainer") == "finished" and not rs.get("done"):
        return "; trainer finished (it closed its loader or exited cleanly)"
    return ""


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


_SAY_STUCK_AFTER_S = 5.0  # format_status names a pipeline that has made nothing for this long
LIVE_AFTER_S = 30.0  # status --live: the systemd unit's WatchdogSec=60 withholds WATCHDOG=1 past half of it


def liveness(rec: dict[str, Any] | None, alive: bool | None, lock: int | None, now: float,
             after_s: float = LIVE_AFTER_S) -> tuple[int, str]:
    """``status --live``, the watchdog's judgement for a probe (Kubernetes' livenessProbe): (exit
    code, line). 0 while the daemon's loop turns (its status is rewritten about every second)
    and its pipeline moves (no batch in the making for ``after_s`` without one made), or while
    it starts (holds the buffer, has written no status of its own yet); 1 when its loop has not
    rewritten the status for ``after_s`` (hung, or it cannot write it) or its workers have made
    nothing for ``after_s``; 3 when no daemon runs. ``lock``: the pid in the buffer's lock file."""
    if not alive:
        return 3, "not running: no daemon holds the buffer"
    if rec is None or rec.get("pid") != lock:
        return 0, f"starting: pid {lock} holds the buffer and has written no status yet"
    updated = rec.get("updated")
    age = now - updated if isinstance(updated, (int, float)) else None
    if age is None or age > after_s:
        return 1, (f"not live: pid {lock} has not rewritten {STATUS_NAME} for "
                   f"{'ever' if age is None else f'{age:.0f} s'} (hung, or its filesystem is full)")
    stuck = rec.get("stuck_s") or 0.0
    if stuck > after_s:
        return 1, f"not live: pid {lock} has had batches in the making for {stuck:.0f} s without making one"
    return 0, f"live: pid {lock}, status {age:.0f} s old, {rec.get('produced_batches', 0)} batches made"


def _lifetime(s: dict[str, Any], alive: bool | None) -> str:
    """``up 9 s`` for a running daemon; for one that stopped (or died), since when, and how long
    it had been up: its last status's uptime is no uptime now."""
    up = s.get("uptime_s", 0) or 0
    if alive is not False and s.get("state") != "stopped":
        return f"up {up:.0f} s"
    updated = s.get("updated")
    if not isinstance(updated, (int, float)):
        return f"stopped, after {up:.0f} s up"
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(updated))
    ago = _ago(time.time() - updated)
    if s.get("state") == "stopped":
        return f"stopped since {when} ({ago} ago), after {up:.0f} s up"
    return f"up {up:.0f} s at its last status ({when}), then ended without a final one (killed?)"


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def format_status(s: dict[str, Any], alive: bool | None) -> str:
    """A human-readable view of a status record."""
    age = time.time() - s.get("updated", 0)
    state = s.get("state", "?")
    if alive is False:
        state = "not running" if state == "stopped" else f"not running (last status {age:.0f} s ago said {state!r})"
    elif is_stale(s):
        state = (f"{state}, but these figures are STALE: written {age:.0f} s ago; the daemon cannot rewrite "
                 f"{STATUS_NAME} (is the buffer's filesystem full?)")
    lines = [
        f"prefetchd pid {s.get('pid')}: {state}; {_lifetime(s, alive)}; buffer {s.get('buffer_dir')}",
        f"  production {_rate(s.get('produced_img_s'))} img/s ({s.get('produced_batches', 0)} batch{'' if s.get('produced_batches', 0) == 1 else 'es'}), "
        f"consumption {_rate(s.get('consumed_img_s'))} img/s, workers {s.get('workers_alive', 0)}/"
        f"{s.get('workers', 0)} (busy {100 * s.get('worker_utilisation', 0):.0f}%, restarts {s.get('worker_restarts', 0)}, "
        f"timeouts {s.get('worker_timeouts', 0)})"
        + (f"; the next worker starts in {s['worker_respawn_in_s']:.1f} s (back-off)"
           if s.get("worker_respawn_in_s") is not None and alive is not False and s.get("state") != "stopped" else "")
        + f"; forkserver restarts {s.get('forkserver_restarts', 0)}, resource tracker restarts "
          f"{s.get('resource_tracker_restarts', 0)}",
        f"  bytes {s.get('bytes_used', 0) / 2**20:,.1f} MiB of {s.get('max_bytes', 0) / 2**20:,.0f} MiB, "
        f"filesystem free {s.get('fs_free', 0) / 2**20:,.0f} MiB, quarantined samples {s.get('quarantined', 0)}, "
        f"rss {s.get('rss_bytes', 0) / 2**20:,.0f} MiB",
        f"  failed batches {s.get('failed_batches', 0)} (each tried again after a back-off), "
        f"main process CPU {s.get('main_cpu_s') or 0:.1f} s"
        + (f"; batches in the making, none made for {s['stuck_s']:.0f} s (status --live fails after "
           f"{LIVE_AFTER_S:.0f} s)" if (s.get("stuck_s") or 0) >= _SAY_STUCK_AFTER_S else ""),
    ]
    if s.get("sizing"):
        lines.append("  sizing: " + "; ".join(s["sizing"]))
    if s.get("ray"):
        r = s["ray"]
        b = r.get("bridge") or {}  # the process that is Ray's driver (executors/raybridge.py)
        lines.append(f"  ray: {r.get('state')}; {r.get('in_flight', 0)} batches in flight, {r.get('lost_batches', 0)} lost and remade"
                     + (f"; bridge pid {b.get('pid')}, started {b.get('starts', 0)}x, died {b.get('deaths', 0)}x" if b else ""))
    if s.get("val_bytes") is not None:
        lines.append(f"  of max_bytes, train holds {s.get('train_bytes', 0) / 2**20:,.2f} MiB, validation "
                     f"{s['val_bytes'] / 2**20:,.2f} MiB")
    if s.get("blocked"):
        lines.append(f"  waiting: {s['blocked']}")
    if s.get("val_blocked"):
        lines.append(f"  validation waiting: {s['val_blocked']}")
    if s.get("dataset_unreadable"):
        lines.append(f"  waiting: {s['dataset_unreadable']}; batches are tried again until it is back")
    for r, rs in sorted(s.get("ranks", {}).items(), key=lambda kv: int(kv[0])):
        e, b = rs.get("position", [0, 0])
        lines.append(f"  rank {r}: trainer at epoch {e} batch {b}; ready {rs.get('ready', 0)}/{s.get('capacity', '?')}"
                     f" (+{rs.get('in_flight', 0)} in flight"
                     + (f", {rs['retrying']} failed waiting to be tried again" if rs.get("retrying") else "")
                     + f"), {rs.get('ahead', 0)} ahead; "
                     f"trainer waited {rs.get('wait_s', 0):.1f} s"
                     + (f"; {rs['echoed']} echoed" if rs.get("echoed") else "")
                     + (f"; {rs['gpu_fallbacks']} samples its GPU could not decode, decoded on its CPU"
                        if rs.get("gpu_fallbacks") else "") + ("; done" if rs.get("done") else "")
                     + _trainer_said(rs))
    shares = [(r, rs) for r, rs in sorted(s.get("ranks", {}).items(), key=lambda kv: int(kv[0]))
              if rs.get("waited_share") is not None]
    if shares:  # daemon/autosize.py: the share of the last minute each trainer waited for a batch
        lines.append("  trainers waited, last minute: " + ", ".join(
            f"rank {r} {rs['waited_share']:.0%}" + (" (data-bound)" if rs.get("would_help") else "") for r, rs in shares))
        lines += [f"  rank {r} is data-bound; would help: {rs['would_help']}" for r, rs in shares if rs.get("would_help")]
    for r, rs in sorted((s.get("val_ranks") or {}).items(), key=lambda kv: int(kv[0])):
        p, b = rs.get("position", [0, 0])
        lines.append(f"  rank {r} validation: " + (f"reading pass {p} at batch {b} of {rs.get('pass_batches', '?')}; "
                     f"ready {rs.get('ready', 0)} (+{rs.get('in_flight', 0)} in flight)" if rs.get("active")
                     else f"idle (next pass {p})"))
    return "\n".join(lines)
