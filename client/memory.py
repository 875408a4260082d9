"""Host memory and host-to-device copies: the CUDA transfer (pinned blocks, side stream, events)
and the small pool of pinned buffers the reader reads into when copying to a GPU.

A yielded batch is never written again: a CUDA batch is copied out of a pinned buffer from the
pool, and a buffer returns to the pool only after the event recorded after its last copy has
completed. ``transfer=`` objects with the same methods as ``CudaTransfer`` stand in for it on
machines without a GPU.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from .clock import WaitClock
from .common import _POLL_MAX_S, _POLL_MIN_S, PrefetchTimeout, _Stopped, torch, torch_or_none


class CudaTransfer:
    """Pinned host memory and asynchronous copies to a CUDA device.

    The client uses a transfer object through these methods only, so tests without a GPU can
    pass a stand-in (``PrefetchClient(..., transfer=...)``) that behaves like pinned memory and a
    copy engine: a copy runs some time after it is queued, and its event says when.

    * ``available()``: can pinned memory and copies be had at all.
    * ``resolve(device)``: the concrete device (``cuda`` -> ``cuda:<current device>``, read in the
      trainer's thread at first use, so ``torch.cuda.set_device`` after construction counts).
    * ``empty(nbytes)``: a fresh uint8 pinned host tensor.
    * ``stream(device)``: a side stream; ``context(device, stream)``: make it current (reader thread).
    * ``to_device(tensor, device)``: queue a copy on the current stream; ``copy_(dst, src)``: queue
      a copy into an existing tensor (the decode stage's PIXELS rows); ``record(stream)``: an
      event (``query()``, ``synchronize()``) after everything queued so far.
    * ``wait(event, device, tensors)``: in the trainer's thread, make its current stream wait for
      the event and mark the tensors as used there.
    """

    def available(self) -> bool:
        t = torch_or_none()
        return t is not None and t.cuda.is_available()

    def resolve(self, device):
        if device.type == "cuda" and device.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        return device

    def empty(self, nbytes: int):
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def stream(self, device):
        return torch.cuda.Stream(device)

    def context(self, device, stream):
        torch.cuda.set_device(device)  # the current device is per thread
        return torch.cuda.stream(stream)

    def to_device(self, tensor, device):
        return tensor.to(device, non_blocking=True)

    def copy_(self, dst, src):
        return dst.copy_(src, non_blocking=True)

    def record(self, stream):
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def wait(self, event, device, tensors) -> None:
        cur = torch.cuda.current_stream(device)
        cur.wait_event(event)
        for t in tensors:
            t.record_stream(cur)  # allocated on the side stream, used on the trainer's


class _PinnedPool:
    """Pinned buffers for the copies to the device. A buffer comes back with the event recorded
    after its last copy and is handed out again only once that event has completed."""

    def __init__(self, transfer, limit: int):
        self._transfer = transfer
        self._limit = limit
        self._free: list[tuple[Any, Any]] = []  # (tensor, event or None)
        self._count = 0
        self.peak = 0  # the most buffers alive at once (never above ``limit``)
        self._lock = threading.Lock()

    def acquire(self, nbytes: int, timeout: float, stop: threading.Event):
        clock = WaitClock()  # a stop of the process (SIGSTOP, a debugger) is not the GPU's delay
        delay = _POLL_MIN_S
        while True:
            with self._lock:
                for i, (t, ev) in enumerate(self._free):
                    if t.numel() >= nbytes and (ev is None or ev.query()):
                        del self._free[i]
                        return t
                if self._count >= self._limit:
                    # a buffer too small for this batch (a short last batch came first) makes room
                    for i, (t, ev) in enumerate(self._free):
                        if t.numel() < nbytes and (ev is None or ev.query()):
                            del self._free[i]
                            self._count -= 1
                            break
                if self._count < self._limit:
                    self._count += 1
                    self.peak = max(self.peak, self._count)
                    grow = True
                else:
                    grow = False
            if grow:
                try:
                    return self._transfer.empty(nbytes)
                except BaseException:
                    with self._lock:
                        self._count -= 1
                    raise
            if stop.is_set():
                raise _Stopped()
            if clock.tick() >= timeout:
                raise PrefetchTimeout(f"waited {clock.said(timeout)} for a pinned buffer's copy to the device to finish; "
                                      "is the GPU hung?")
            time.sleep(delay)
            delay = min(delay * 1.5, _POLL_MAX_S)

    def release(self, tensor, event) -> None:
        base = getattr(tensor, "_base", None)  # the whole buffer, not the batch's view of it
        with self._lock:
            self._free.append((tensor if base is None else base, event))

    def close(self) -> None:
        with self._lock:
            free, self._free = self._free, []
            self._count = 0
        for _, ev in free:
            if ev is not None:
                ev.synchronize()  # the copy must be done before the memory goes back


class _NoContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
