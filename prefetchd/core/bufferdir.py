"""Where the ring goes when the config names no ``buffer.dir``: a pure function of the
environment, the user and the config file's path.

In order:

1. ``$XDG_RUNTIME_DIR`` is set to an existing absolute directory (a login session: systemd-logind
   makes ``/run/user/<uid>``, a tmpfs of the user's own, mode 0700):
   ``$XDG_RUNTIME_DIR/prefetchd/<config stem>-<8 hex digits of the config's real path>``, so two
   configs, or two users, never share a ring, and the daemon and the trainers of one user, reading
   one file, agree.
2. root (uid 0), with no such directory: ``/run/prefetchd``, the systemd units' tmpfs
   (``systemd/run-prefetchd.mount``).
3. anyone else: a ``ConfigError`` of one line saying to set ``buffer.dir`` (a job, a container,
   ``su`` or ``sudo -u``: no login session, so no per-user RAM disk to choose).

A daemon run by systemd and trainers of other users must agree on one directory, which no
per-user default can give: the shipped units expect ``buffer.dir`` in the config
(``/run/prefetchd/buffer``, made by their ``RuntimeDirectory=``).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping

from prefetchd.core.configvalues import ConfigError

ROOT_DEFAULT = "/run/prefetchd"


def default_buffer_dir(env: Mapping[str, str], uid: int, source: str | None,
                       isdir: Callable[[str], bool] = os.path.isdir) -> str:
    """``buffer.dir`` for a config that does not set it (rules in the module docstring).
    ``source`` is the config file's real path (None for a config built in code)."""
    runtime = env.get("XDG_RUNTIME_DIR") or ""
    if os.path.isabs(runtime) and isdir(runtime):
        if source is None:
            name = "default"
        else:
            stem = os.path.splitext(os.path.basename(source))[0] or "config"
            name = f"{stem}-{hashlib.sha256(source.encode('utf-8', 'surrogateescape')).hexdigest()[:8]}"
        return os.path.join(runtime, "prefetchd", name)
    if uid == 0:
        return ROOT_DEFAULT
    why = (f"$XDG_RUNTIME_DIR ({runtime}) is not a directory here" if runtime
           else "$XDG_RUNTIME_DIR is not set (no login session: a job, a container, su)")
    raise ConfigError("buffer.dir", f"is not set and {why}: set buffer.dir to a directory on a RAM disk you can "
                                    f"write, e.g. /dev/shm/prefetchd-{uid}/<name>")


def is_tmpfs(path: str) -> bool:
    """Is ``path`` on a tmpfs or ramfs (RAM), by the mount that holds it?"""
    import psutil  # here: the client imports this module, and needs no psutil

    real = os.path.realpath(path)
    best, fstype = "", ""
    for part in psutil.disk_partitions(all=True):
        mp = part.mountpoint
        if (real == mp or real.startswith(mp.rstrip("/") + "/")) and len(mp) > len(best):
            best, fstype = mp, part.fstype
    return fstype in ("tmpfs", "ramfs")
