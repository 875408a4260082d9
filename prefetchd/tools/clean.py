"""``prefetchd clean --config FILE``: free the RAM a stopped daemon's ring holds.

A daemon that stops keeps its published batches in ``buffer.dir`` (a tmpfs: the node's memory)
for its next start to reuse; its stop line says so, with this command. ``clean`` removes that
directory, batches, status and all (what ``rm -r DIR`` does), holding the buffer's lock while it
does (``daemon.ring.Lock``: no daemon can start on a directory half removed). It refuses, exit 1,
while a daemon holds that lock: stop it first. A buffer directory that is a mount point (a tmpfs
mounted there, ``systemd/run-prefetchd.mount``) is emptied and kept. ``progress.dir`` set outside
the buffer is left alone: it holds the trainers' positions, a few bytes each.

Exit codes: 0 removed (or nothing there), 1 a daemon serves the buffer or it could not be
removed, 78 a bad configuration.
"""

from __future__ import annotations

import os
import shutil
import sys

from prefetchd.core.config import EX_CONFIG, ConfigError, format_size
from prefetchd.core.config import load as load_config
from prefetchd.daemon.ring import BufferBusy, Lock
from prefetchd.format import batchfile


def say(text: str) -> None:
    print(f"prefetchd clean: {text}", file=sys.stderr)


def _batches(directory: str) -> tuple[int, int]:
    """How many batch files (and temp files of unfinished ones) ``directory`` holds, and their bytes."""
    n = size = 0
    with os.scandir(directory) as it:
        for e in it:
            if (batchfile.parse_name(e.name) or e.name.startswith(batchfile.TMP_PREFIX)) \
                    and e.is_file(follow_symlinks=False):
                n += 1
                size += e.stat(follow_symlinks=False).st_size
    return n, size


def _remove_contents(directory: str) -> None:
    with os.scandir(directory) as it:
        for e in it:
            if e.is_dir(follow_symlinks=False):
                shutil.rmtree(e.path)
            else:
                os.unlink(e.path)


def run_clean(config: str) -> int:
    try:
        cfg = load_config(config)
    except ConfigError as e:
        print(f"prefetchd: configuration error: {e}", file=sys.stderr)
        return EX_CONFIG
    d = os.path.abspath(cfg.buffer.dir)
    if not os.path.isdir(d) or os.path.islink(d):
        say(f"nothing to remove: {d} is not a directory")
        return 0
    lock = Lock(d)
    try:
        lock.acquire()
    except BufferBusy as e:
        say(f"{e}; stop it first (its batches are in use)")
        return 1
    except OSError as e:
        say(f"cannot lock {d}: {e.strerror}")
        return 1
    try:
        n, size = _batches(d)
        mount = os.path.ismount(d)
        if mount:  # the tmpfs stays mounted: emptied
            _remove_contents(d)
        else:
            shutil.rmtree(d)
    except OSError as e:
        say(f"cannot remove {e.filename or d}: {e.strerror}")
        return 1
    finally:
        lock.release()  # the removed directory's lock: nobody can take it any more
    say(f"removed {n} batch{'es' if n != 1 else ''} ({format_size(size)}) and {d}" + (" (a mount point: emptied, kept)" if mount else ""))
    return 0
