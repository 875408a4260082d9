"""A scan's work spread over processes, its results in order: what indexing many shards uses.

``ordered(fn, items, procs, name_of)`` yields ``fn(*item)`` for each item, in the items' order
whatever order they finish in, computed by ``procs`` processes (each takes the next item when
it is done with one). So a result built from them is the same for any ``procs``, and the error
raised is the first item's error in that order, as a loop over the items would raise it.

The processes are fresh interpreters (``sys.executable``) importing this very ``prefetchd``:
none of the caller's threads, locks or ``multiprocessing`` state (the daemon scans on a thread,
and its workers' forkserver is set up after the scan), and unlike ``multiprocessing``'s spawn,
the caller's main script is not run again in them (a user's script without a
``__main__`` guard would start its own work there). Items and results go as pickles over their
stdin and stdout pipes. They ignore SIGINT: a Ctrl-C reaches the whole foreground group, and the
caller, who gets the ``KeyboardInterrupt``, ends them. One whose caller is killed is killed too
(Linux's parent-death signal; elsewhere it reads the end of its input after its item and exits).

Teardown, on every way out (done, an item's error, a process that died, ``KeyboardInterrupt``, the
generator closed early): done, each reads the end of its input and is waited for; otherwise each is
terminated, then killed if it does not go within ``_JOIN_TIMEOUT_S``. An interpreter that exits
mid-scan (the daemon stopped during its scan, which runs on a thread it does not wait for) kills
those still running as it exits (``atexit``): none is left behind. A process that dies mid-item is
a ``DatasetError`` naming the item and how it died. Processes that cannot be started at all (no
fork: a pids limit; an interpreter that cannot be run or import ``prefetchd``: each says it is
ready before its first item) are ``Unavailable``: the caller does the work itself.
"""

from __future__ import annotations

import atexit
import importlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as mp_wait

from prefetchd.sources.base import DatasetError

_JOIN_TIMEOUT_S = 5.0
_WAIT_S = 1.0  # each wait for a result; the loop then looks again
_live: set[_Proc] = set()  # started, not yet waited for: what an exit mid-scan kills
_CHILD = "import sys; sys.path.insert(0, sys.argv[1]); from prefetchd.sources.scanpool import serve; serve()"
_PR_SET_PDEATHSIG = 1
_READY = "ready"


class Unavailable(Exception):
    """No process could be started for the work, or one could not run it (said why)."""


def serve() -> None:
    """The child: (fn, item) pickles in on stdin, (ok, result or exception) out on stdout."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:  # killed with the thread that started it (Linux): a caller killed mid-item leaves none behind
        import ctypes

        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != int(sys.argv[2]):  # that caller died before the line above
        return
    out = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)  # a print on the way goes to stderr, not into the results
    inp = Connection(0, writable=False)
    importlib.import_module(sys.argv[3])  # the work's module: it imports here, or the caller does the work
    out.send(_READY)
    while True:
        try:
            fn, item = inp.recv()
        except EOFError:  # done, or the caller is gone
            return
        try:
            res = (True, fn(*item))
        except Exception as e:  # noqa: BLE001 -- handed to the caller, raised there in order
            res = (False, e)
        try:
            out.send(res)
        except Exception as e:  # noqa: BLE001 -- an exception that does not pickle: its type and text
            out.send((False, DatasetError(f"{type(e).__name__}: {e}")))


def _how(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}" + (", perhaps out of memory?" if -code == signal.SIGKILL else "")
    return f"exited with status {code}"


class _Proc:
    def __init__(self, module: str):
        top = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # above prefetchd/
        try:
            self.p = subprocess.Popen([sys.executable, "-c", _CHILD, top, str(os.getpid()), module],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
        except OSError as e:  # no fork (EAGAIN: a pids limit), no interpreter
            raise Unavailable(f"{sys.executable} cannot be started: {e.strerror or e}") from None
        self.send = Connection(os.dup(self.p.stdin.fileno()), readable=False)
        self.recv = Connection(os.dup(self.p.stdout.fileno()), writable=False)
        self.p.stdin.close()
        self.p.stdout.close()
        self.item: int | None = None  # in flight
        self.ready = False  # it said so: started, the work's module imported
        _live.add(self)

    def died(self, name: str) -> Exception:
        try:
            self.p.wait(_JOIN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
        if not self.ready:
            return Unavailable(f"{sys.executable} {_how(self.p.returncode)} before it was ready")
        return DatasetError(f"the process indexing {name} {_how(self.p.returncode)}; index again (dataset.root)")


def ordered(fn: Callable, items: Sequence[tuple], procs: int, name_of: Callable[[int], str]) -> Iterator:
    """``fn(*item)`` for each of ``items`` in order, by ``procs`` processes (see the module
    docstring); ``fn`` must be importable by name (a module's function). ``name_of(i)``: item
    ``i`` in a message."""
    workers: list[_Proc] = []
    clean = False
    todo = iter(range(len(items)))

    def hand(w: _Proc) -> None:
        w.item = next(todo, None)
        if w.item is not None:
            try:
                w.send.send((fn, items[w.item]))
            except BrokenPipeError:
                raise w.died(name_of(w.item)) from None

    try:
        for _ in range(max(1, min(procs, len(items)))):
            workers.append(_Proc(fn.__module__))
            hand(workers[-1])
        done: dict = {}
        first = 0
        while first < len(items):
            if first in done:
                ok, out = done.pop(first)
                if not ok:
                    raise out
                first += 1
                yield out
                continue
            busy = [w for w in workers if w.item is not None]
            for conn in mp_wait([w.recv for w in busy], _WAIT_S):
                w = next(w for w in busy if w.recv is conn)
                try:
                    msg = w.recv.recv()
                except EOFError:
                    raise w.died(name_of(w.item)) from None
                if not w.ready:  # its first word: ready (its first item is already on its way)
                    w.ready = msg == _READY
                    continue
                done[w.item] = msg
                hand(w)
        clean = True
    finally:
        _stop(workers, clean)


def _stop(workers: list[_Proc], clean: bool) -> None:
    for w in workers:
        w.send.close()  # the end of its input: it exits
        if not clean:
            w.p.terminate()
    for w in workers:
        try:
            w.p.wait(_JOIN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            w.p.kill()
            w.p.wait(_JOIN_TIMEOUT_S)
        w.recv.close()
        _live.discard(w)


@atexit.register
def _kill_live() -> None:
    for w in list(_live):
        w.p.kill()
        w.p.wait()
