"""The last way out after SIGTERM or SIGINT: the process ends within a deadline, whatever it does.

The daemon stops cleanly from its loop: the signal handler only records the signal and wakes
the loop, which tears down. That needs the main thread to come back to the loop; a call that
blocks in the kernel and is retried after the handler runs (PEP 475: ``open()`` of a FIFO,
a read of a hung filesystem) never does, and under systemd only the watchdog or SIGKILL after
``TimeoutStopSec`` would end it. ``StopGuard`` is a thread that waits for a stop signal
(``arm``, one ``write`` to a pipe: safe in a handler) and then for the clean stop (``done``).

It guards the loop: the main thread must be back from it (``tearing_down``) within
``deadline_s`` of the signal. The teardown that follows is bounded step by step (workers:
terminate, wait, kill; the multiprocessing helpers likewise), so once it runs it is given until
``total_s`` after the signal, which stays under the 10 s a stop may take: a clean stop that is
slow on a loaded machine is not cut short. If a deadline passes first the guard says where the
main thread is, kills the processes ``children()`` names (the workers and the forkserver and
resource tracker, which would otherwise outlive it: a stopped forkserver never goes by itself)
and ends the process with ``exit_code`` (0: it was asked to stop, and it stopped). What the
clean teardown would have done is left to the next start: temp files are removed there and
published batches checked.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable

log = logging.getLogger("prefetchd")

STOP_DEADLINE_S = 7.0  # the loop must have returned this long after the stop signal...
STOP_TOTAL_S = 9.5  # ...and the teardown be done after this: under the 10 s a stop may take (TimeoutStopSec= is 20 s)
_LOG_TIMEOUT_S = 1.0  # a log line waits this long at most (the main thread may hold the handler's lock)


class StopGuard:
    def __init__(self, children: Callable[[], list[int]] = list, deadline_s: float = STOP_DEADLINE_S,
                 exit_code: int = 0, exit: Callable[[int], object] = os._exit, total_s: float = STOP_TOTAL_S):
        self.children = children
        self.deadline_s = deadline_s
        self.total_s = max(total_s, deadline_s)
        self._tearing_down = False
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

    def tearing_down(self) -> None:
        """The main thread is back from the loop and stops what it started: the deadline becomes
        ``total_s`` after the signal (before or after this call)."""
        self._tearing_down = True

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
        armed = time.monotonic()
        while True:  # the deadline only ever moves later (tearing_down), so waiting it out and looking again holds
            limit = self.total_s if self._tearing_down else self.deadline_s
            left = armed + limit - time.monotonic()
            if left <= 0:
                break
            if self._done.wait(left):
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
        what = "the clean teardown did not finish" if self._tearing_down else "without the clean teardown"
        self._say(f"still running {time.monotonic() - armed:.0f} s after the stop signal (the main thread is at "
                  f"{self._where()}); exiting now, {what}: killed {len(killed)} child process(es) (workers, "
                  "forkserver, resource tracker); temp files are removed at the next start")
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
