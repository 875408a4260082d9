"""systemd's notify protocol, spoken directly (no dependency): datagrams to ``$NOTIFY_SOCKET``.

``READY=1`` once the first batches are ready, ``STATUS=`` a one-line summary, ``WATCHDOG=1``
only while the pipeline makes progress, ``RELOADING=1`` (with ``MONOTONIC_USEC``) and
``STOPPING=1``. An address starting with ``@`` is in the abstract namespace. Without
``$NOTIFY_SOCKET`` every call is a no-op.
"""

from __future__ import annotations

import logging
import os
import socket
import time

log = logging.getLogger("prefetchd.sdnotify")


class Notifier:
    def __init__(self, address: str | None = None, watchdog_usec: str | None = None, watchdog_pid: str | None = None):
        address = address if address is not None else os.environ.get("NOTIFY_SOCKET")
        self.address: str | bytes | None = None
        if address:
            self.address = "\0" + address[1:] if address.startswith("@") else address
        self.sock: socket.socket | None = None
        wd_usec = watchdog_usec if watchdog_usec is not None else os.environ.get("WATCHDOG_USEC")
        wd_pid = watchdog_pid if watchdog_pid is not None else os.environ.get("WATCHDOG_PID")
        self.watchdog_s: float | None = None
        if wd_usec and wd_usec.isdigit() and (not wd_pid or wd_pid == str(os.getpid())):
            self.watchdog_s = int(wd_usec) / 1e6

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *fields: str) -> bool:
        if self.address is None:
            return False
        try:
            if self.sock is None:
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self.sock.sendto("\n".join(fields).encode(), self.address)
            return True
        except OSError as e:
            log.debug("sd_notify failed: %s", e)
            return False

    def ready(self) -> bool:
        return self.send("READY=1")

    def status(self, text: str) -> bool:
        return self.send("STATUS=" + text.replace("\n", " "))

    def reloading(self) -> bool:
        return self.send("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")

    def stopping(self) -> bool:
        return self.send("STOPPING=1")

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
