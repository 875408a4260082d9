"""Which stop signals reached ``prefetchd launch``'s process group, not launch alone.

A signal sent to launch's process group, or to every process of a job, reaches the command too:
a terminal's Ctrl-C (the kernel signals the foreground group), ``kill -TERM -PGID``, ``timeout``,
Slurm's ``scancel`` (every process of the step: by process group with ``proctrack/pgid``, one
process after another with ``proctrack/cgroup``), systemd's ``KillMode=control-group``. One sent
to launch alone does not: ``kill PID``, ``docker stop`` and Kubernetes (PID 1 only), systemd's
``KillMode=mixed``. Nothing in the signal tells the two apart (``kill(pid)`` and ``kill(-pgid)``
both arrive as ``SI_USER`` from the sender's pid), so launch asks a witness.

The witness is a small process in launch's process group (the command's group) with the stop
signals blocked from birth (launch blocks them around its start; the mask is inherited through
``fork`` and ``exec``), so each stays pending in it, in ``ShdPnd`` of ``/proc/PID/status``, for
as long as launch wants to look. When launch gets a stop signal it looks there (``reached``),
for up to ``GRACE_S``, since a sender that signals one process after another may reach the
witness a little after launch: pending means the signal was sent to the group, so the command
has it already; launch then has the witness take it (``sigtimedwait``, acknowledged by a byte),
so that the next signal is judged afresh. The witness reads its control pipe and exits at its
end of file: when launch closes it, or exits in any way (SIGKILL included).

A witness that cannot be started, or that is gone, says "not reached": the signal is forwarded,
as before there was one. Limits: a sender that takes longer than ``GRACE_S`` from launch to the
witness (one process after another on a host too loaded to run it) is taken for launch alone,
and the command sees the signal twice, as before; launch forwards every signal to a command
that moved itself out of launch's group (``setsid``), which a group's signal does not reach.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterable

GRACE_S = 0.1  # a signal not pending in the witness after this was sent to launch alone
_LOOK_EVERY_S = 0.005
_TAKE_TIMEOUT_S = 1.0  # the witness acknowledges a take within this, or is given up (and stopped)
_STOP_TIMEOUT_S = 2.0

# argv: control fd (launch -> witness: a signal number to take), ack fd, the signals, comma-separated
_WITNESS = """\
import os, signal, sys
ctl, ack = int(sys.argv[1]), int(sys.argv[2])
sigs = [int(s) for s in sys.argv[3].split(",")]
signal.pthread_sigmask(signal.SIG_BLOCK, sigs)  # already, from launch; said again for a reader
while True:
    b = os.read(ctl, 1)
    if not b:
        break
    signal.sigtimedwait([b[0]], 0)
    os.write(ack, b)
"""


def signal_mask(status_text: str, field: str) -> set[int]:
    """The signals of ``field`` (``ShdPnd``, ``SigPnd``, ``SigBlk``, ...) in the text of a
    ``/proc/PID/status``: a hex mask, bit n-1 for signal n."""
    for line in status_text.splitlines():
        name, _, value = line.partition(":")
        if name == field:
            mask = int(value.strip(), 16)
            return {n + 1 for n in range(mask.bit_length()) if mask >> n & 1}
    raise ValueError(f"no {field} in the status text")


class Witness:
    """The process that tells whether a signal reached launch's process group; see the module."""

    def __init__(self, signals: Iterable[int]):
        self.signals = tuple(sorted(int(s) for s in signals))
        self.proc: subprocess.Popen | None = None
        self._ctl: int | None = None  # launch's end of the control pipe
        self._ack: int | None = None

    def start(self) -> bool:
        """Start the witness in this process's group; False (and no witness) if it cannot be."""
        ctl_r, ctl_w = os.pipe()
        ack_r, ack_w = os.pipe()
        old = signal.pthread_sigmask(signal.SIG_BLOCK, self.signals)  # blocked from its first instruction
        try:
            self.proc = subprocess.Popen(
                # -I -S: nothing of the environment or site customisation runs in it
                [sys.executable, "-I", "-S", "-c", _WITNESS, str(ctl_r), str(ack_w), ",".join(map(str, self.signals))],
                pass_fds=(ctl_r, ack_w), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, cwd="/")
        except OSError:
            self.proc = None
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)  # what came meanwhile is delivered now
            os.close(ctl_r)
            os.close(ack_w)
        if self.proc is None:
            os.close(ctl_w)
            os.close(ack_r)
            return False
        self._ctl, self._ack = ctl_w, ack_r
        return True

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def _pending(self) -> set[int] | None:
        """The stop signals pending in the witness; None if it is gone or does not block them."""
        if self.proc is None:
            return None
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                text = f.read()
            if not set(self.signals) <= signal_mask(text, "SigBlk"):
                return None
            return signal_mask(text, "ShdPnd") | signal_mask(text, "SigPnd")
        except (OSError, ValueError):
            return None

    def reached(self, signum: int, grace_s: float = GRACE_S) -> bool:
        """Whether ``signum``, just received by launch, was sent to launch's process group too
        (then the witness takes it, for the next one to be judged afresh)."""
        deadline = time.monotonic() + grace_s
        while True:
            pending = self._pending()
            if pending is None:
                return False
            if signum in pending:
                self._take(signum)
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(_LOOK_EVERY_S)

    def _take(self, signum: int) -> None:
        try:
            os.write(self._ctl, bytes([signum]))
            if select.select([self._ack], [], [], _TAKE_TIMEOUT_S)[0] and os.read(self._ack, 1):
                return
        except OSError:
            pass
        self.stop()  # it did not answer: no witness from now on (signals are forwarded)

    def stop(self) -> None:
        """End the witness (its control pipe closes) and reap it."""
        for fd in (self._ctl, self._ack):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._ctl = self._ack = None
        if self.proc is not None:
            try:
                self.proc.wait(_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
