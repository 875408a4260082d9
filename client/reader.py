"""Reading batch files, in the reader thread: one ``ReadAhead`` per iteration opens, reads,
verifies and parses the next files (``prefetch`` of them ahead, bounded), reports each to the
daemon once it is in this process's memory, and with a CUDA device starts its copy (and, for a
compact batch, its decode) on a side stream. The trainer's thread only takes the next item from a
queue. Errors in the reader are raised in the trainer's thread, unchanged, when it reaches that
batch.

Timeouts measure the daemon's lack of progress, never the trainer's own pause: the reader waits
for a file without a deadline of its own (it may be far ahead of the trainer, or the trainer in
a breakpoint), and the trainer's timeout runs from its asking for a batch, on a ``WaitClock``
(``clock``) that leaves out the spells the process was stopped. What that clock counts is also
what the wait counter (``wait_s``) adds: the time between asking and the batch being there.

``BatchFiles`` is the client's file side (a mixin of ``PrefetchClient``): where a batch's file is,
waiting for it with a deadline, reading it into host memory, checking it, converting it to what
the trainer gets, and saying what the daemon is doing when a wait times out.
"""

from __future__ import annotations

import grp
import math
import os
import queue
import threading
import time
from typing import TYPE_CHECKING

import numpy as np

from prefetchd.core.sampler import ValSampler
from prefetchd.format import batchfile, jpegbatch, procstate, progress, status

from .clock import WaitClock
from .common import (
    _JOIN_TIMEOUT_S,
    _POLL_MAX_S,
    _POLL_MIN_S,
    _PROGRESS_RETRY_S,
    _QUEUE_POLL_S,
    BatchInfo,
    PrefetchError,
    PrefetchTimeout,
    _Stopped,
    torch,
)
from .memory import _NoContext
from .normalize import _normalize_numpy, _normalize_torch

if TYPE_CHECKING:
    from .loader import PrefetchClient


class ReadAhead:
    """One epoch's read-ahead: a thread loads batches ``start..n-1`` into a queue of ``depth``."""

    # what close() needs, held by the class: an iteration left unfinished is closed by the garbage
    # collector, at interpreter exit too, when module globals may already be gone
    _Empty = queue.Empty
    _current_thread = staticmethod(threading.current_thread)
    _join_s = _JOIN_TIMEOUT_S

    def __init__(self, client: PrefetchClient, epoch: int, start: int, n: int, depth: int):
        self.epoch = epoch
        self.waited = 0.0  # what the last get() counted as waiting (its WaitClock's)
        self.announced = False  # the last get() told the daemon it waits (its first poll missed)
        self._client = client
        self.stop = threading.Event()
        self.opened = start - 1  # the last batch whose file the reader has opened (it is in hand)
        self._q: queue.Queue = queue.Queue(depth)
        self._thread = threading.Thread(target=self._run, args=(client, epoch, start, n),
                                        name=f"prefetchd-reader-r{client.rank}-e{epoch}", daemon=True)
        self._thread.start()

    def _run(self, client: PrefetchClient, epoch: int, start: int, n: int) -> None:
        try:
            with client._reader_context():
                for b in range(start, n):
                    # no deadline here: the trainer's get() times the wait from its asking
                    item = client._load(epoch, b, self.stop, self._opened, timeout=math.inf)
                    if not self._put(("ok", item)):
                        return
        except _Stopped:
            return
        except BaseException as e:  # raised again in the trainer's thread, as it was
            self._put(("error", e))

    def _put(self, msg) -> bool:
        while not self.stop.is_set():
            try:
                self._q.put(msg, timeout=_QUEUE_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _opened(self, batch: int) -> None:
        self.opened = batch

    def ready(self) -> bool:
        return not self._q.empty()

    def in_hand(self, batch: int) -> bool:
        """Whether ``batch`` is delivered or on its way: the reader has opened its file (the
        daemon may delete the file from then on) or an item (or error) is waiting."""
        return self.opened >= batch or not self._q.empty()

    def get(self, batch: int, timeout: float):
        """The next item, batch ``batch`` of the epoch, waiting ``timeout`` seconds of this
        process's running time from now (a ``WaitClock``: a stop of the process is not counted).
        Before it gives up, the batch is looked for once more: if the daemon has made it or the
        reader holds it, the reader gets another ``timeout`` to deliver it. ``waited`` is then
        what this call counted as waiting; ``announced``, whether the daemon was told it waits
        (once the first poll missed: a batch that is ready costs no write)."""
        clock = WaitClock()
        limit = timeout
        announced = False
        try:
            while True:
                try:
                    kind, value = self._q.get(timeout=_QUEUE_POLL_S)
                except queue.Empty:
                    if not announced:  # a wait, not a handover: the daemon counts it while it lasts
                        announced = self._client._say_waiting(time.time() - clock.tick(), block=False)
                    if self.stop.is_set():
                        raise self._ended() from None
                    if not self._thread.is_alive() and self._q.empty():
                        raise PrefetchError(f"the reader thread ended without rank {self._client.rank} epoch "
                                            f"{self.epoch} batch {batch}") from None
                    if clock.tick() >= limit:
                        there = self.in_hand(batch) or os.path.exists(self._client._path(self.epoch, batch))
                        if there and limit == timeout:
                            limit += timeout  # made, or being read: the reader was slow, not the daemon
                            continue
                        raise PrefetchTimeout(self._client._timeout_message(self.epoch, batch, clock, limit,
                                                                            self.in_hand(batch))) from None
                    continue
                if self.stop.is_set():  # put by a reader that checked just before close() drained the queue
                    raise self._ended()
                if kind == "error":
                    raise value
                return value
        finally:
            self.waited = clock.tick(final=True)
            self.announced = announced

    def _ended(self) -> PrefetchError:
        return PrefetchError("this iteration was ended by seek(), load_state_dict(), set_epoch(), close() or a "
                             "newer iteration of the same client, or by another PrefetchClient of rank "
                             f"{self._client.rank} moving in this process")

    def close(self) -> None:
        self.stop.set()
        while True:  # drop what was read ahead (and wake a reader blocked on a full queue)
            try:
                self._q.get_nowait()
            except self._Empty:
                break
        if self._thread is not self._current_thread():
            self._thread.join(self._join_s)



class BatchFiles:
    """The client's reading of batch files (see the module docstring); runs in the reader thread."""

    def _reader_context(self):
        if self._copy:
            return self._transfer.context(self.device, self._stream)
        return _NoContext()

    def _path(self, epoch: int, batch: int) -> str:
        return os.path.join(self.dir, batchfile.batch_name(self._lane, epoch, batch, self._offset_of(epoch)))

    def _open_when_ready(self, epoch: int, batch: int, stop: threading.Event, timeout: float) -> int:
        """The batch's file, opened once the daemon has published it; waits ``timeout`` seconds
        of this process's running time (``math.inf``: until ``stop``)."""
        path = self._path(epoch, batch)
        clock = WaitClock()
        delay = _POLL_MIN_S
        retry_at = 0.0
        while True:
            try:
                return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                pass
            if stop.is_set():
                raise _Stopped()
            if clock.tick() >= timeout:
                raise PrefetchTimeout(self._timeout_message(epoch, batch, clock, timeout, False))
            if self._unsaved is not None and time.monotonic() >= retry_at:  # the daemon makes this
                self._retry_progress()  # batch once it knows where we are
                retry_at = time.monotonic() + _PROGRESS_RETRY_S
            time.sleep(delay)
            delay = min(delay * 1.5, _POLL_MAX_S)

    def _timeout_message(self, epoch: int, batch: int, clock: WaitClock, limit: float, in_hand: bool) -> str:
        """What a trainer that waited ``limit`` seconds for a batch is told: the wait (and the
        pause of its own it did not count), the batch, and what the daemon is doing."""
        path = self._path(epoch, batch)
        if in_hand:
            return (f"waited {clock.said(limit)} for the reader thread to read rank {self.rank} epoch {epoch} batch "
                    f"{batch} ({path}), whose file it has open: is the buffer's filesystem or the GPU stuck?")
        return (f"waited {clock.said(limit)} for rank {self.rank} epoch {epoch} batch {batch} ({path}); "
                + self._daemon_state())

    def _daemon_state(self) -> str:
        denied = self._permission_denied()
        if denied:
            return denied
        return self._other_trainer() + self._daemon_said()

    def _other_trainer(self) -> str:
        """What the trainer is told when another process wrote its rank's progress since it did
        (two trainers started with the same rank: each moves the daemon away from the other)."""
        try:
            p = progress.read(progress.progress_path(self.progress_dir, self._lane))
        except progress.ProgressError:
            return ""
        if p.pid in (0, os.getpid()):
            return ""
        state = procstate.state(p.pid, p.pid_start, p.pid_ns)
        return (f"another process (pid {p.pid}, {state}) wrote rank {self.rank}'s progress after this trainer (pid "
                f"{os.getpid()}) did: two trainers read rank {self.rank} (started with the same RANK?); give each "
                "trainer its own rank; ")

    def _daemon_said(self) -> str:
        alive = status.daemon_alive(self.dir)
        if alive is False:
            return f"no daemon holds {os.path.join(self.dir, status.LOCK_NAME)}: is prefetchd running with this config?"
        s = status.read_json(self.dir, status.STATUS_NAME) or {}
        state = f"the daemon (pid {s.get('pid', '?')}) is {'alive' if alive else 'in an unknown state'}; "
        if (alive and isinstance(s.get("pid"), int) and isinstance(s.get("pid_ns", 0), int)
                and procstate.state(s["pid"], 0, s.get("pid_ns", 0)) == procstate.STOPPED):  # (not its pid 1 in a pod)
            state = (f"the daemon (pid {s['pid']}) is alive but stopped, making nothing (SIGSTOP or a debugger; "
                     f"`kill -CONT {s['pid']}` lets it go on); ")
        if not isinstance(s.get("updated"), (int, float)):
            return state + f"{os.path.join(self.dir, status.STATUS_NAME)} cannot be read"
        age = f"its status is {time.time() - s['updated']:.0f} s old, "
        # why nothing is made, where the daemon knows: an archive changed or a root unreadable
        unreadable = (f"; it waits for the dataset: {s['dataset_unreadable']}" if s.get("dataset_unreadable")
                      and isinstance(s["dataset_unreadable"], str) else "")
        if self.split == "val":
            return state + age + self._val_lane_state(s) + unreadable
        rs = s.get("ranks", {}).get(str(self.rank), {})
        extra = f"; it says: {s['blocked']}" if s.get("blocked") else ""
        return (state + age + f"rank {self.rank} has "
                f"{rs.get('ready', '?')} ready from epoch/batch {rs.get('position', '?')}{extra}{unreadable}")

    def _val_lane_state(self, s: dict) -> str:
        """What the status says of this rank's validation lane (not of its train rank)."""
        rs = (s.get("val_ranks") or {}).get(str(self.rank), {})
        doing = "reading" if rs.get("active") else "idle, not reading"
        extra = f"; it says: {s['val_blocked']}" if s.get("val_blocked") else ""
        return (f"rank {self.rank}'s validation lane ({doing}) has {rs.get('ready', '?')} ready and "
                f"{rs.get('in_flight', '?')} in flight at pass/batch {rs.get('position', '?')} of "
                f"{rs.get('pass_batches', '?')} batches{extra}")

    def _permission_denied(self) -> str | None:
        """What a trainer outside the buffer's group is told: the file it may not read, the group."""
        path = os.path.join(self.dir, status.META_NAME)
        try:
            os.close(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC))
            return None
        except PermissionError:
            pass
        except OSError:
            return None
        group = self.cfg.buffer.group
        if group is None:
            try:
                group = grp.getgrgid(os.stat(self.dir).st_gid).gr_name
            except (OSError, KeyError):
                group = "of the buffer"
        return f"cannot read {path}: permission denied: is this user in group {group} (buffer.group)?"

    def _host_buffer(self, size: int, stop: threading.Event):
        """Where to read a file of ``size`` bytes: (torch tensor or None, numpy view of it)."""
        if self._copy and self.pin_memory:
            t = self._pool.acquire(size, self.timeout, stop)[:size]
            return t, t.numpy()
        if self.pin_memory:  # pinned CPU tensors for the trainer: a fresh block per batch
            t = self._transfer.empty(size)
            return t, t.numpy()
        arr = np.empty(size, dtype=np.uint8)
        return None, arr

    def _load(self, epoch: int, batch: int, stop: threading.Event, opened=None, timeout: float | None = None):
        """Batch ``batch`` of ``epoch``, waited for ``timeout`` seconds (None: the client's)."""
        path = self._path(epoch, batch)
        fd = self._open_when_ready(epoch, batch, stop, self.timeout if timeout is None else timeout)
        if opened is not None:
            opened(batch)
        try:
            st = os.fstat(fd)
            head = os.pread(fd, batchfile.HEADER_SIZE, 0)
            try:
                size = jpegbatch.expected_size(head)  # either kind: pixels or compact
            except batchfile.BatchFileError as e:
                raise PrefetchError(f"{path}: {e}") from None
            if st.st_uid != os.stat(self.dir).st_uid:
                raise PrefetchError(f"{path} is owned by uid {st.st_uid}, not by the daemon's; refusing it")
            if st.st_size != size:
                raise PrefetchError(f"{path} is {st.st_size} bytes, its header says {size}")
            host, arr = self._host_buffer(size, stop)
            try:
                batchfile.copy_into(fd, arr)
            except BaseException:
                self._give_back(host, None)
                raise
        finally:
            os.close(fd)
        try:
            try:
                b = jpegbatch.parse_any(arr, verify=self.verify)
            except batchfile.BatchFileError as e:
                raise PrefetchError(f"{path}: {e}") from None
            if isinstance(b, jpegbatch.JpegBatch) and self._stage is None:
                raise PrefetchError(f"{path} is a compact batch (hybrid decode) but this client's config has "
                                    "augment.decode: cpu; use the daemon's config")
            # a resumed epoch's segment has a fingerprint of its own: no batch of another segmentation passes
            fp = batchfile.segment_fingerprint(batchfile.fingerprint_u64(self._fingerprint()), epoch,
                                               self._offset_of(epoch))
            if (b.rank, b.epoch, b.batch, b.fingerprint) != (self._lane, epoch, batch, fp):
                raise PrefetchError(f"{path} holds lane {b.rank} epoch {b.epoch} batch {b.batch} of "
                                    f"stream {b.fingerprint:016x}, not the expected one of {fp:016x} (stale batch)")
            self.batches_read += 1
            self.bytes_read += size
            # the file is in this process's memory now: the daemon may delete it and make the next
            # (a stop landing here raises _Stopped: the buffer goes back to the pool all the same)
            self._write_progress(epoch, batch + 1, reader=stop)
        except BaseException:
            self._give_back(host, None)
            raise
        info = BatchInfo(self.rank, b.epoch, b.batch, b.indices.copy(), b.replaced.copy(),
                         padding=self._val_padding(b.batch) if self.split == "val" else None)
        return self._convert(b, host, info.replaced) + (info,)

    def _val_padding(self, batch: int) -> np.ndarray:
        """Which samples of this rank's val ``batch`` are padding (the daemon's meta says how it pads)."""
        s = self._val_sampler
        if s is None:
            v = self.meta()["validation"]  # a daemon of an older version says no "pad": it did not pad
            s = self._val_sampler = ValSampler(int(v["num_samples"]), int(v["batch_size"]), self.world_size,
                                               bool(v.get("pad", False)))
        return s.padding(self.rank, batch)

    def _mask(self, info: BatchInfo):
        """``padding_mask=True``: the batch's padding mask (bool, True: a repeat), beside its labels."""
        pad = info.padding if info.padding is not None else np.zeros(len(info.indices), dtype=bool)
        if self.as_numpy:
            return pad
        mask = torch.from_numpy(pad)
        if self.device is None:
            return mask
        if self.device.type == "cuda":  # no sync of the trainer's stream for a pageable copy
            return mask.pin_memory().to(self.device, non_blocking=True)
        return mask.to(self.device)

    def _give_back(self, host, event) -> None:
        if host is not None and self._copy and self.pin_memory:
            self._pool.release(host, event)

    def _convert(self, b: batchfile.Batch | jpegbatch.JpegBatch, host, replaced: np.ndarray) -> tuple:
        """(images, labels, event or None) as the trainer gets them; ``replaced`` (the batch's, a
        copy) is marked where the decode stage had to put a stand-in in place of a sample. A batch
        of several views gives ``images`` as a tuple of one [N, C, H_v, W_v] per view."""
        if isinstance(b, jpegbatch.JpegBatch):
            return self._convert_compact(b, host, replaced)
        views = b.views or (b.images,)
        several = len(views) > 1
        if self.as_numpy:
            out = [v.transpose(0, 3, 1, 2) for v in views]
            if self.normalize:
                out = self._erase([_normalize_numpy(v, self.dtype, self.mean, self.std) for v in out], b)
            return (tuple(out) if several else out[0], b.labels.copy(), None)
        if host is None:
            out = [torch.from_numpy(v).permute(0, 3, 1, 2) for v in views]  # [N, C, H, W], channels-last strides
            labels = torch.from_numpy(b.labels.astype(np.int64))
        else:  # views of the pinned tensor itself (not of its numpy alias), so torch sees pinned memory
            start = b.indices.ctypes.data - batchfile.HEADER_SIZE  # the file's first byte (host's too)
            out = []
            for v in views:
                at = v.ctypes.data - start
                out.append(host[at: at + v.nbytes].view(*v.shape).permute(0, 3, 1, 2))
            lo = b.labels.ctypes.data - start
            labels = host[lo: lo + 8 * len(b.labels)].view(torch.int64)
        if not self._copy:
            if self.normalize:
                out = self._erase([_normalize_torch(v, self.dtype, self.mean, self.std) for v in out], b)
            return (tuple(out) if several else out[0], labels, None)
        # pinned or pageable (host is None), the copies and the normalize run on the side stream:
        # the trainer's stream waits on the event recorded after them and marks the outputs (every
        # view's and the labels) as used there (record_stream), else it could read them early and
        # the allocator reuse them
        try:
            gv = [self._transfer.to_device(v, self.device) for v in out]
            gl = self._transfer.to_device(labels, self.device)
            if self.normalize:  # on the side stream, after the copies
                gv = self._erase([_normalize_torch(v, self.dtype, self.mean, self.std) for v in gv], b)
            ev = self._transfer.record(self._stream)
        except BaseException:
            self._give_back(host, None)
            raise
        self._give_back(host, ev)  # reused only once ev (after every copy) has completed
        return (tuple(gv) if several else gv[0], gl, ev)

    def _erase(self, views: list, b: batchfile.Batch | jpegbatch.JpegBatch) -> list:
        """``erase_on: client``: the normalised views erased where they are, from the keys of the
        samples the file holds (``client/erasing.py``); as they were otherwise."""
        if self._eraser is None:
            return views
        return [self._eraser(v, b.epoch, b.indices, k) for k, v in enumerate(views)]

    def _convert_compact(self, b: jpegbatch.JpegBatch, host, replaced: np.ndarray) -> tuple:
        """A compact batch decoded by the stage: in the reader thread, on the side stream when
        copying to a CUDA device (the trainer's stream waits on the event recorded after it)."""
        if self.as_numpy:
            images = self._stage(b, replaced=replaced).numpy()  # [N, C, H, W] view of a channels-last array
            if self.normalize:
                images = self._erase([_normalize_numpy(images, self.dtype, self.mean, self.std)], b)[0]
            return (images, b.labels.copy(), None)
        if not self._copy:
            # pin_memory=True without a device: the decoded batch and its labels in a fresh pinned block
            dst = self._transfer.empty(_labels_at(b) + 8 * len(b)) if self.pin_memory else None
            images = self._stage(b, source=host, replaced=replaced, out=dst)
            if dst is None:
                labels = torch.from_numpy(b.labels.copy())
            else:
                labels = dst[_labels_at(b):].view(torch.int64)
                labels.copy_(torch.from_numpy(b.labels))
            if self.normalize:
                images = self._erase([_normalize_torch(images, self.dtype, self.mean, self.std)], b)[0]
            return (images, labels, None)
        # on the side stream, pinned or not: the trainer waits on the event recorded after it all
        try:
            if host is not None:  # the labels section, viewed in the pinned buffer b was parsed from
                lo = b.labels.ctypes.data - b.buffer.ctypes.data
                labels = host[lo: lo + 8 * len(b)].view(torch.int64)
            else:
                labels = torch.from_numpy(b.labels.copy())
            # copied before the decode is queued: a pageable copy waits for the stream's earlier work
            gl = self._transfer.to_device(labels, self.device)
            gi = self._stage(b, source=host, replaced=replaced, transfer=self._transfer)
            if self.normalize:  # on the side stream, after the decode
                gi = self._erase([_normalize_torch(gi, self.dtype, self.mean, self.std)], b)[0]
            ev = self._transfer.record(self._stream)
        except BaseException:
            self._give_back(host, None)
            raise
        self._give_back(host, ev)  # the pinned file is read by the decode and copies before ev
        return (gi, gl, ev)


def _labels_at(b: jpegbatch.JpegBatch) -> int:
    """Where the labels go in a pinned block after a compact batch's decoded images (8-aligned)."""
    return -(-len(b) * b.height * b.width * 3 // 8) * 8
