"""The last way out after SIGTERM or SIGINT: the process ends within a deadline, whatever it does.

The daemon stops cleanly from its loop: the signal handler only records the signal and wakes
the loop, which tears down. That needs the main thread to come back to the loop; a call that
blocks in the kernel and is retried after the handler runs (PEP 475: ``open()`` of a FIFO,
a read of a hung filesystem) never does, and under systemd only the watchdog or SIGKILL after
``TimeoutStopSec`` would end it. ``StopGuard`` is a thread that waits for a stop signal
(``arm``, one ``write`` to a pipe: safe in a handler) and then for the clean stop (``done``).
If ``deadline_s`` passes first it says where the main thread is stuck, kills the processes
``children()`` names (the workers, which would otherwise outlive it) and ends the process with
``exit_code`` (0: it was asked to stop, and it stopped). What the clean teardown would have done
is left to the next start: temp files are removed there and published batches checked.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import sys
import threading
import traceback
from collections.abc import Callable

log = logging.getLogger("prefetchd")

STOP_DEADLINE_S = 7.0  # under the 10 s a stop may take (systemd's TimeoutStopSec= is 20 s)
_LOG_TIMEOUT_S = 1.0  # a log line waits this long at most (the main thread may hold the handler's lock)


class StopGuard:
    def __init__(self, children: Callable[[], list[int]] = list, deadline_s: float = STOP_DEADLINE_S,
                 exit_code: int = 0, exit: Callable[[int], object] = os._exit):
        self.children = children
        self.deadline_s = deadline_s
        self.exit_code = exit_code
        self._exit = exit
        self._main = threading.main_thread().ident
        self._r, self._w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._done = threading.Event()
        self.fired = False
        self._thread = threading.Thread(target=self._watch, name="prefetchd-stop-guard", daemon=True)

    def start(self) -> StopGuard:
        self._thread.start()
        return self

    def arm(self) -> None:
        """A stop signal came: the deadline runs from now. Safe in a signal handler."""
        if self._w < 0:
            return  # done
        try:
            os.write(self._w, b"s")
        except OSError:
            pass  # already armed

    def done(self) -> None:
        """The process stops cleanly: disarm and end the thread."""
        self._done.set()
        self.arm()
        self._thread.join(timeout=2)
        fds, self._r, self._w = (self._r, self._w), -1, -1
        for fd in fds:
            os.close(fd)

    def _watch(self) -> None:
        select.select([self._r], [], [])  # until armed (or done); a signal's EINTR is retried
        if self._done.wait(self.deadline_s):
            return
        self.fired = True
        killed = []
        try:
            for pid in self.children():
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except OSError:
                    pass
        except Exception:  # noqa: BLE001 - the exit below must happen
            pass
        self._say(f"still running {self.deadline_s:.0f} s after the stop signal (the main thread is at "
                  f"{self._where()}); exiting now without the clean teardown: killed {len(killed)} worker(s); "
                  "temp files are removed at the next start")
        self._exit(self.exit_code)

    def _where(self) -> str:
        frame = sys._current_frames().get(self._main)
        if frame is None:
            return "an unknown place"
        stack = traceback.extract_stack(frame)[-3:]
        return " < ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(stack))

    def _say(self, msg: str) -> None:
        # logging takes its handler's lock, which the stuck main thread may hold (a write to a
        # full journal pipe): log from a thread of its own and give up after a moment
        t = threading.Thread(target=log.error, args=("%s", msg), daemon=True)
        t.start()
        t.join(_LOG_TIMEOUT_S)
