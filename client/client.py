"""The trainer's side: read ready batches from the ring, report progress, resume exactly.

Imports only prefetchd's shared format modules (config, batchfile, jpegbatch, progress, status),
numpy and, when installed, torch; never the daemon, Pillow or the pool.

Hybrid decode (``augment.decode: hybrid | gpu``). Some batch files are compact batches (JPEG bytes
and parameters, ``prefetchd.jpegbatch``); the reader thread decodes them with a
``gpudecode.DecodeStage`` on the device (on the side stream, like a copy) and yields the same
uint8 ``[B, 3, H, W]`` images. The stage is made when the client is, so a missing GPU extra is
an error at start; ``decoder=`` replaces its JPEG decoder (a CPU one makes the path run without
a GPU).

Threads. A reader thread per iteration opens, reads, verifies and parses the next batch files
(``prefetch`` of them ahead, bounded), reports each to the daemon once it is in this process's
memory, and with a CUDA device starts its copy on a side stream. The trainer's thread only takes
the next item from a queue (and, on a GPU, makes its stream wait on the copy's event). Errors in
the reader are raised in the trainer's thread, unchanged, when it reaches that batch. The
position the trainer sees (``epoch``, ``batch``, ``state_dict()``) is the trainer's own, never the
reader's read-ahead.

Memory. A yielded batch is never written again: numpy arrays and CPU tensors are fresh per batch;
pinned CPU tensors are fresh blocks of the host allocator (torch's caching allocator reuses a
block only once it is freed and its copies are done); a CUDA batch is copied out of a pinned
buffer from a small pool, and a buffer returns to that pool only after the event recorded after
its last copy has completed.
"""

from __future__ import annotations

import grp
import os
import queue
import secrets
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from prefetchd import batchfile, jpegbatch, progress, status
from prefetchd.config import Config, ConfigError
from prefetchd.config import load as load_config

try:
    import torch
except ImportError:  # numpy arrays only
    torch = None

_POLL_MIN_S = 0.0005
_POLL_MAX_S = 0.005
_QUEUE_POLL_S = 0.05  # how often a blocked reader or trainer looks at the stop flag / the other side
_JOIN_TIMEOUT_S = 10.0  # a stopped reader finishes its current file (milliseconds) and exits
_STATE_FORMAT = "prefetchd-loader"


@dataclass(frozen=True)
class BatchInfo:
    """What the last batch yielded was: its place in the stream, its samples, and whether it was
    an echo (a repeat served instead of waiting, only with ``client.echo_factor`` > 1)."""

    rank: int
    epoch: int
    batch: int
    indices: np.ndarray  # dataset indices of the samples
    # per sample: the index a quarantined sample stood in for, else -1; its own index where the
    # client could decode it neither on the GPU nor on the CPU and zeros stand in (hybrid decode)
    replaced: np.ndarray
    echo: int = 0  # 0: first service; k: the k-th repeat


class PrefetchError(RuntimeError):
    """The client cannot go on; the message says what it waited for or found."""


class PrefetchTimeout(PrefetchError, TimeoutError):
    """No batch arrived within the timeout."""


class _Stopped(Exception):
    """The reader was told to stop (seek, close, a new iteration)."""


# --- host memory and host-to-device copies --------------------------------------------------------------


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
        return torch is not None and torch.cuda.is_available()

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
        deadline = time.monotonic() + timeout
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
            if time.monotonic() >= deadline:
                raise PrefetchTimeout(f"waited {timeout:.1f} s for a pinned buffer's copy to the device to finish; "
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


# --- the read-ahead thread ---------------------------------------------------------------------------------


class _ReadAhead:
    """One epoch's read-ahead: a thread loads batches ``start..n-1`` into a queue of ``depth``."""

    def __init__(self, client: PrefetchClient, epoch: int, start: int, n: int, depth: int):
        self.epoch = epoch
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
                    item = client._load(epoch, b, self.stop, self._opened)
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

    def get(self, timeout: float, waiting_for: str):
        """The next item, waiting at most ``timeout`` (the reader bounds its own waits by the
        same timeout, so this only fires if the reader itself is stuck)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                kind, value = self._q.get(timeout=_QUEUE_POLL_S)
            except queue.Empty:
                if self.stop.is_set():
                    raise PrefetchError("this iteration was ended by seek(), load_state_dict(), set_epoch(), "
                                        "close() or a newer iteration of the same client") from None
                if not self._thread.is_alive() and self._q.empty():
                    raise PrefetchError(f"the reader thread ended without {waiting_for}") from None
                if time.monotonic() >= deadline:
                    raise PrefetchTimeout(f"waited {timeout:.1f} s for the reader thread to deliver {waiting_for}") from None
                continue
            if kind == "error":
                raise value
            return value

    def close(self) -> None:
        self.stop.set()
        while True:  # drop what was read ahead (and wake a reader blocked on a full queue)
            try:
                self._q.get_nowait()
            except queue.Empty:
                break
        if self._thread is not threading.current_thread():
            self._thread.join(_JOIN_TIMEOUT_S)


# --- the client --------------------------------------------------------------------------------------------


class PrefetchClient:
    """Iterate the batches prefetchd prepared for one rank.

    DataLoader habits::

        loader = PrefetchClient("train.yaml", device="cuda", normalize=True, dtype=torch.bfloat16)
        loader.load_state_dict(ckpt["loader"])      # resume, if resuming
        for epoch in range(loader.epoch, epochs):
            loader.set_epoch(epoch)                 # optional, as with DistributedSampler
            for images, labels in loader:           # one epoch, then the position is (epoch + 1, 0)
                ...
                ckpt["loader"] = loader.state_dict()

    * ``images``: uint8 ``[B, 3, H, W]`` (channels-last in memory), ``labels``: int64 ``[B]``;
      torch tensors (on ``device`` when given) or numpy arrays when torch is absent or
      ``as_numpy=True``. ``normalize=True`` yields ``(x / 255 - mean) / std`` in ``dtype``
      (default float32) on the images' device instead of uint8.
    * ``rank``: default from the ``RANK`` environment variable (torchrun), else 0.
    * ``for x, y in loader`` runs one epoch from the current position; ``iter_epoch(e)`` runs
      epoch ``e`` (from the current batch if ``e`` is the current epoch); ``set_epoch(e)``,
      ``seek(epoch, batch)``, ``state_dict()``, ``load_state_dict()`` move or carry the position.
    * ``prefetch`` batches (default ``client.prefetch`` of the config) are read ahead in a
      thread; with a CUDA ``device`` they are copied on a side stream from pinned buffers.
      ``pin_memory=True`` without a device yields pinned CPU tensors (when CUDA is present).
    * every wait has ``timeout`` seconds; a timeout raises :class:`PrefetchTimeout` saying what it
      waited for and whether the daemon is alive.
    * ``split="val"`` reads the daemon's validation stream (``validation:`` in the config) with the
      same API: each ``for`` is one pass over this rank's share of the val set (the pass number
      is ``epoch``), ``len()`` is this rank's val batches, the last batch may be partial. Ranks'
      shares may differ by one sample and their batch counts by one (no padding): sum correct and
      total across ranks. The daemon makes a pass only while it is iterated.
    * ``close()`` (or ``with``) stops the reader and returns the pinned buffers (once their copies
      are done) to torch's caching host allocator, which keeps them for reuse; so does garbage
      collection.
    * ``transfer``: how pinned memory and device copies are made (default :class:`CudaTransfer`);
      tests on machines without a GPU pass a stand-in with the same methods.
    * ``decoder``: with ``augment.decode: hybrid | gpu``, what decodes the JPEGs of compact
      batches (default: nvImageCodec on the CUDA ``device``, from ``pip install 'prefetchd[gpu]'``;
      without it, or without CUDA, the constructor raises :class:`PrefetchError` naming the extra).
      Called as ``decoder(jpegs)`` with a list of uint8 numpy arrays (the files), it returns per
      file a uint8 tensor ``[h, w, 3]`` (RGB, as stored, no EXIF orientation applied) on the
      images' device (the CPU when ``device`` is None), or None where it failed. Ignored with
      ``augment.decode: cpu``.
    """

    def __init__(self, config: str | Config, rank: int | None = None, device: Any = None,
                 timeout: float = 60.0, as_numpy: bool = False, pin_memory: bool | None = None,
                 verify: bool = True, normalize: bool = False, dtype: Any = None, prefetch: int | None = None,
                 transfer: Any = None, decoder: Any = None, split: str = "train"):
        self._closed = True  # until fully built: __del__ must not trip over a half-made client
        self._reader: _ReadAhead | None = None
        self._pool: _PinnedPool | None = None
        self.cfg = config if isinstance(config, Config) else load_config(config)
        self.rank = _resolve_rank(self.cfg, rank)
        if split not in progress.STREAMS:
            raise ValueError(f"split must be one of {progress.STREAMS}, got {split!r}")
        if split == "val" and not self.cfg.validation.enabled:
            raise ConfigError("validation.enabled", "is false in this config: split='val' needs the daemon's "
                              "validation stream (set validation.enabled and validation.root)")
        self.split = split
        self._lane = progress.lane(split, self.rank)
        self._reading = split == "train"  # a val client reads only while it iterates a pass
        self.dir = self.cfg.buffer.dir
        self.progress_dir = self.cfg.progress_dir
        self.timeout = float(timeout)
        self.verify = verify
        self.prefetch = self.cfg.client.prefetch if prefetch is None else int(prefetch)
        if not 1 <= self.prefetch <= 64:
            raise ValueError(f"prefetch must be between 1 and 64 batches, got {self.prefetch}"
                             + (" (client.prefetch of the config)" if prefetch is None else ""))
        self.normalize = bool(normalize)
        if dtype is not None and not self.normalize:
            raise ValueError("dtype= is the dtype of normalized images; pass normalize=True with it")
        self.as_numpy = as_numpy or torch is None
        self._transfer = transfer if transfer is not None else CudaTransfer()
        self.device = None
        self._copy = False  # copy to the device through the transfer (pinned buffers, side stream)
        if device is not None:
            if torch is None:
                raise PrefetchError("device= needs torch; install prefetchd[torch] or leave device=None")
            self.device = torch.device(device)
            self.as_numpy = False
            if transfer is not None or self.device.type == "cuda":
                if not self._transfer.available():
                    raise PrefetchError(f"device {device!r} asked for, but CUDA is not available; "
                                        "pass device=None for CPU tensors")
                self._copy = True
            elif self.device.type == "cpu":
                self.device = None
        if self.as_numpy:
            self.dtype = np.dtype(dtype) if dtype is not None else np.dtype(np.float32)
        else:
            self.dtype = dtype if dtype is not None else torch.float32
        # pinning is for copies to a GPU: pin_memory=True without one (a DataLoader habit) falls
        # back to pageable memory
        want_pin = self._copy if pin_memory is None else bool(pin_memory)
        self.pin_memory = bool(want_pin and not self.as_numpy and self._transfer.available())
        self._stream = None
        self._device_resolved = False
        self._decoder = decoder
        self._stage = None  # decodes compact batches (augment.decode: hybrid | gpu)
        if self.cfg.augment.decode != "cpu":
            self._stage = self._make_stage(self.device)
        self.epoch = 0
        self.batch = 0
        self.wait_s = 0.0
        self.echo_factor = self.cfg.client.echo_factor
        self.echoed = 0
        self.last_batch: BatchInfo | None = None
        self.batches_read = 0
        self.bytes_read = 0
        self._meta: dict | None = None
        self._progress_lock = threading.Lock()
        self._session = f"{os.getpid()}-{secrets.token_hex(4)}"
        self._jumps = 0
        self._last_written: tuple[int, int] | None = None
        self._closed = False

    # --- DataLoader-shaped attributes ----------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        return self.cfg.validation.batch_size if self.split == "val" else self.cfg.loader.batch_size

    @property
    def drop_last(self) -> bool:
        return False if self.split == "val" else self.cfg.loader.drop_last

    @property
    def world_size(self) -> int:
        return self.cfg.loader.world_size

    @property
    def dataset(self) -> _Sized:
        """Sized like a DataLoader's dataset: ``len()`` is the samples of the stream's dataset."""
        m = self.meta()
        return _Sized(int(m["validation"]["num_samples"] if self.split == "val" else m["num_samples"]))

    @property
    def sampler(self) -> _Sized:
        """Sized like a ``DistributedSampler``: ``len()`` is ``ceil(len(dataset) / world_size)``, what
        it reports without ``drop_last``. Scripts that look for the samples such a sampler leaves
        out (``len(sampler) * world_size < len(dataset)``, as pytorch/examples' ``validate`` does)
        find none: the validation stream leaves none out (rank shares may be one sample shorter)."""
        return _Sized(-(-len(self.dataset) // self.world_size))

    # --- position ----------------------------------------------------------------------------------

    def seek(self, epoch: int, batch: int = 0) -> None:
        """Continue at (epoch, batch); the daemon is told at once and refills from there. Waits
        (up to the timeout) for the daemon to create its directories when it is starting too."""
        if epoch < 0 or batch < 0:
            raise ValueError("epoch and batch must be >= 0")
        self._stop_reader()
        self.epoch, self.batch = int(epoch), int(batch)
        self._write_progress(self.epoch, self.batch)

    def set_epoch(self, epoch: int) -> None:
        """As ``DistributedSampler.set_epoch``: the next ``for`` runs ``epoch``. The current epoch
        keeps its position (a resumed epoch goes on where it was); another epoch starts at batch 0."""
        if int(epoch) != self.epoch:
            self.seek(int(epoch), 0)

    def state_dict(self) -> dict:
        """The trainer's position (not the reader's read-ahead), shaped like torchdata's
        StatefulDataLoader state: ``_num_yielded`` batches of epoch ``epoch`` are done."""
        fp = self._fingerprint() if self._meta else None
        return {"_num_yielded": self.batch, "_sampler_iter_yielded": self.batch,
                "_sampler_iter_state": {"epoch": self.epoch, "batch": self.batch}, "_iterator_finished": False,
                "format": _STATE_FORMAT, "epoch": self.epoch, "batch": self.batch, "rank": self.rank,
                "world_size": self.world_size, "fingerprint": fp}

    def load_state_dict(self, state: Mapping) -> None:
        """Continue where ``state`` (from :meth:`state_dict`, or the older ``{epoch, batch, rank,
        fingerprint}``) was. Refuses another rank's state, another world size, or another stream's."""
        if not isinstance(state, Mapping):
            raise PrefetchError(f"a loader state is a dict from state_dict(), got {type(state).__name__}")
        pos = state.get("_sampler_iter_state") if isinstance(state.get("_sampler_iter_state"), Mapping) else state
        try:
            epoch, batch = _state_int(pos, "epoch"), _state_int(pos, "batch")
            rank, world = _state_int(state, "rank", None), _state_int(state, "world_size", None)
        except ValueError as e:
            raise PrefetchError(f"not a prefetchd loader state ({e}); keys {sorted(map(str, state))}") from None
        if rank is not None and rank != self.rank:
            raise PrefetchError(f"this loader state is rank {state['rank']}'s, not rank {self.rank}'s; "
                                "load each rank's own state")
        if world is not None and world != self.world_size:
            raise PrefetchError(f"this loader state is from a job of world_size {state['world_size']}, this config "
                                f"has loader.world_size {self.world_size}; positions do not carry over")
        fp = state.get("fingerprint")
        if fp:
            have = self._fingerprint()
            if fp != have:
                raise PrefetchError(f"this loader state is for stream {fp}, the daemon serving {self.dir} makes stream "
                                    f"{have} (dataset, loader or augment settings changed); resuming would not "
                                    "continue the same stream: start the loader afresh or use the old config")
        self.seek(epoch, batch)

    # --- daemon metadata ---------------------------------------------------------------------------

    def meta(self, refresh: bool = False) -> dict:
        """The daemon's meta.json (waits for it up to the timeout)."""
        if self._meta is not None and not refresh:
            return self._meta
        deadline = time.monotonic() + self.timeout
        delay = _POLL_MIN_S
        while True:
            m = status.read_json(self.dir, status.META_NAME)
            # only the running daemon's meta counts: one that is starting may still hold the lock
            # beside the last daemon's meta.json (with another config, say)
            if (m is not None and m.get("format") == "prefetchd-meta" and status.daemon_alive(self.dir)
                    and m.get("pid") == status.lock_pid(self.dir)):
                break
            if time.monotonic() >= deadline:
                raise PrefetchTimeout(f"waited {self.timeout:.1f} s for the daemon's meta.json in {self.dir}; "
                                      + self._daemon_state())
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        if m.get("stream_fingerprint") != self.cfg.stream_fingerprint():
            raise PrefetchError(f"the daemon serving {self.dir} (pid {m.get('pid')}) makes a different stream than "
                                f"{self.cfg.source or 'this config'} describes (loader or augment settings differ); "
                                "use the daemon's config file")
        if self.rank not in m.get("ranks", []):
            raise PrefetchError(f"the daemon serving {self.dir} serves ranks {m.get('ranks')}, not rank {self.rank}")
        if self.split == "val" and not isinstance(m.get("validation"), dict):
            raise PrefetchError(f"the daemon serving {self.dir} (pid {m.get('pid')}) makes no validation stream; "
                                "restart it with validation.enabled in its config")
        if self.split == "val" and m["validation"].get("stream_fingerprint") != self.cfg.val_stream_fingerprint():
            raise PrefetchError(f"the daemon serving {self.dir} (pid {m.get('pid')}) makes a different validation "
                                f"stream than {self.cfg.source or 'this config'} describes (validation settings "
                                "differ); use the daemon's config file")
        self._meta = m
        return m

    def _fingerprint(self) -> str:
        m = self.meta()
        return m["validation"]["fingerprint"] if self.split == "val" else m["fingerprint"]

    @property
    def batches_per_epoch(self) -> int:
        if self.split == "val":
            return int(self.meta()["validation"]["batches"][str(self.rank)])
        return int(self.meta()["batches_per_epoch"])

    def __len__(self) -> int:
        """This rank's batches per epoch (waits, up to the timeout, only until the daemon has said)."""
        return self.batches_per_epoch

    # --- iteration ---------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        """One epoch (a pass, for ``split="val"``) from the current position; afterwards the
        position is (epoch + 1, 0), so the next ``for`` runs the next epoch, as a DataLoader with
        ``set_epoch`` does. A val pass left early (``break``) counts as done: the next ``for``
        is a new pass from its first batch."""
        return self.iter_epoch(self.epoch)

    def iter_epoch(self, epoch: int) -> Iterator[tuple[Any, Any]]:
        """Yield (images, labels) for this rank's batches of ``epoch``, from the sought batch on."""
        if self._closed:
            raise PrefetchError("this PrefetchClient is closed")
        return self._iter_epoch(int(epoch))

    def _iter_epoch(self, epoch: int) -> Iterator[tuple[Any, Any]]:
        meta = self.meta()
        epochs = meta.get("epochs")
        if self.split == "train" and epochs is not None and epoch >= epochs:
            raise PrefetchError(f"epoch {epoch} is past loader.epochs ({epochs}) of the daemon's config")
        self._stop_reader()
        self._resolve_device()
        start = self.batch if epoch == self.epoch else 0
        self.epoch, self.batch = epoch, start
        val = self.split == "val"
        self._reading = True
        self._write_progress(epoch, start)
        n = self.batches_per_epoch
        if start >= n:
            self.epoch, self.batch = epoch + 1, 0
            if val:
                self._end_pass()
            return
        reader = self._reader = _ReadAhead(self, epoch, start, n, self.prefetch)
        echo = self.echo_factor > 1 and not val
        done = False
        try:
            for b in range(start, n):
                out = self._next(reader, epoch, b)
                self.epoch, self.batch = (epoch, b + 1) if b + 1 < n else (epoch + 1, 0)
                yield out
                if echo and b + 1 < n:
                    # data echoing (opt-in): rather than wait, serve this batch again, up to the factor
                    k = 0
                    # "not ready": b + 1's file is not there and the reader does not hold it (it
                    # may be parsing, copying or decoding it: the daemon deletes a file once it is
                    # read). Asked in this order: the reader notes a file as opened before the
                    # daemon can delete it, so a file gone by the first check is seen by the second
                    while (k < self.echo_factor - 1 and not os.path.exists(self._path(epoch, b + 1))
                           and not reader.in_hand(b + 1)):
                        k += 1
                        self.echoed += 1
                        self.last_batch = replace(self.last_batch, echo=k)
                        yield out
                # hold no batch while the trainer runs: freeing one (munmap of 38.5 MB) is the
                # trainer's business, not a cost of the next next()
                out = None
            done = True
        finally:
            reader.close()
            if self._reader is reader:
                self._reader = None
            if val and not done:  # left early: the pass is over, the daemon deletes what it made
                self._end_pass()
        if val:
            self._end_pass()
        else:
            self._write_progress(self.epoch, self.batch)

    def _end_pass(self) -> None:
        """A val pass ended or was abandoned: the next ``for`` is the next pass; the daemon stops."""
        if self.batch:
            self.epoch, self.batch = self.epoch + 1, 0
        self._reading = False
        self._write_progress(self.epoch, self.batch)

    def _next(self, reader: _ReadAhead, epoch: int, batch: int):
        t0 = time.monotonic()
        try:
            # the reader bounds each of its own waits (file, pinned buffer, directory) by the timeout
            item = reader.get(2 * self.timeout + 10.0, f"rank {self.rank} epoch {epoch} batch {batch}")
        finally:
            self.wait_s += time.monotonic() - t0
        images, labels, event, info = item
        self.last_batch = info
        if event is not None:
            self._transfer.wait(event, self.device, (images, labels))
        return images, labels

    def _stop_reader(self) -> None:
        r, self._reader = self._reader, None
        if r is not None:
            r.close()

    # --- reading (in the reader thread) -------------------------------------------------------------

    def _resolve_device(self) -> None:
        """Fix the CUDA device at first use, in the trainer's thread (torchrun scripts call
        ``torch.cuda.set_device(local_rank)`` after building the loader)."""
        if self._device_resolved or not self._copy:
            return
        self.device = self._transfer.resolve(self.device)
        self._stream = self._transfer.stream(self.device)
        if self._stage is not None:  # now on the device the trainer settled on
            self._stage = self._make_stage(self.device)
        self._pool = _PinnedPool(self._transfer, self.prefetch + 1)
        self._device_resolved = True

    def _make_stage(self, device):
        if torch is None:
            raise PrefetchError(f"augment.decode: {self.cfg.augment.decode} needs torch in the trainer; "
                                "install prefetchd[torch,gpu] or set augment.decode: cpu")
        from .gpudecode import GPU_EXTRA_HINT, DecodeStage, DecodeUnavailable

        mode = self.cfg.augment.decode
        if device is None and self._decoder is None:
            raise PrefetchError(f"augment.decode: {mode} has the trainer's GPU decode JPEGs: pass device='cuda' and "
                                f"{GPU_EXTRA_HINT}; or pass decoder= (a JPEG decoder of your own); or set "
                                "augment.decode: cpu")
        try:
            return DecodeStage(device if device is not None else torch.device("cpu"), self._decoder)
        except DecodeUnavailable as e:
            raise PrefetchError(f"augment.decode: {mode}: {e}".replace(f"{mode}: augment.decode: ", "")) from None

    def _reader_context(self):
        if self._copy:
            return self._transfer.context(self.device, self._stream)
        return _NoContext()

    def _path(self, epoch: int, batch: int) -> str:
        return os.path.join(self.dir, batchfile.batch_name(self._lane, epoch, batch))

    def _open_when_ready(self, epoch: int, batch: int, stop: threading.Event) -> int:
        path = self._path(epoch, batch)
        deadline = time.monotonic() + self.timeout
        delay = _POLL_MIN_S
        while True:
            try:
                return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                pass
            if stop.is_set():
                raise _Stopped()
            if time.monotonic() >= deadline:
                raise PrefetchTimeout(f"waited {self.timeout:.1f} s for rank {self.rank} epoch {epoch} batch {batch} "
                                      f"({path}); " + self._daemon_state())
            time.sleep(delay)
            delay = min(delay * 1.5, _POLL_MAX_S)

    def _daemon_state(self) -> str:
        denied = self._permission_denied()
        if denied:
            return denied
        alive = status.daemon_alive(self.dir)
        if alive is False:
            return f"no daemon holds {os.path.join(self.dir, status.LOCK_NAME)}: is prefetchd running with this config?"
        s = status.read_json(self.dir, status.STATUS_NAME) or {}
        state = f"the daemon (pid {s.get('pid', '?')}) is {'alive' if alive else 'in an unknown state'}; "
        if not isinstance(s.get("updated"), (int, float)):
            return state + f"{os.path.join(self.dir, status.STATUS_NAME)} cannot be read"
        rs = s.get("ranks", {}).get(str(self.rank), {})
        extra = f"; it says: {s['blocked']}" if s.get("blocked") else ""
        return (state + f"its status is {time.time() - s['updated']:.0f} s old, rank {self.rank} has "
                f"{rs.get('ready', '?')} ready from epoch/batch {rs.get('position', '?')}{extra}")

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

    def _load(self, epoch: int, batch: int, stop: threading.Event, opened=None):
        path = self._path(epoch, batch)
        fd = self._open_when_ready(epoch, batch, stop)
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
            fp = batchfile.fingerprint_u64(self._fingerprint())
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
        info = BatchInfo(self.rank, b.epoch, b.batch, b.indices.copy(), b.replaced.copy())
        return self._convert(b, host, info.replaced) + (info,)

    def _give_back(self, host, event) -> None:
        if host is not None and self._copy and self.pin_memory:
            self._pool.release(host, event)

    def _convert(self, b: batchfile.Batch | jpegbatch.JpegBatch, host, replaced: np.ndarray) -> tuple:
        """(images, labels, event or None) as the trainer gets them; ``replaced`` (the batch's, a
        copy) is marked where the decode stage had to put a stand-in in place of a sample."""
        if isinstance(b, jpegbatch.JpegBatch):
            return self._convert_compact(b, host, replaced)
        if self.as_numpy:
            images = b.images.transpose(0, 3, 1, 2)
            if self.normalize:
                images = _normalize_numpy(images, dtype=self.dtype)
            return (images, b.labels.copy(), None)
        if host is None:
            images = torch.from_numpy(b.images).permute(0, 3, 1, 2)  # [N, C, H, W], channels-last strides
            labels = torch.from_numpy(b.labels.astype(np.int64))
        else:  # views of the pinned tensor itself (not of its numpy alias), so torch sees pinned memory
            lay = batchfile.Layout(*b.images.shape)
            images = host[lay.images_offset: lay.images_offset + lay.images_nbytes].view(*b.images.shape)
            images = images.permute(0, 3, 1, 2)
            labels = host[lay.labels_offset: lay.labels_offset + 8 * lay.n].view(torch.int64)
        if not self._copy:
            if self.normalize:
                images = _normalize_torch(images, self.dtype)
            return (images, labels, None)
        # pinned or pageable (host is None), the copies and the normalize run on the side stream:
        # the trainer's stream waits on the event recorded after them and marks the outputs as
        # used there (record_stream), else it could read them early and the allocator reuse them
        try:
            gi = self._transfer.to_device(images, self.device)
            gl = self._transfer.to_device(labels, self.device)
            if self.normalize:
                gi = _normalize_torch(gi, self.dtype)  # on the side stream, after the copy
            ev = self._transfer.record(self._stream)
        except BaseException:
            self._give_back(host, None)
            raise
        self._give_back(host, ev)  # reused only once ev (after both copies) has completed
        return (gi, gl, ev)

    def _convert_compact(self, b: jpegbatch.JpegBatch, host, replaced: np.ndarray) -> tuple:
        """A compact batch decoded by the stage: in the reader thread, on the side stream when
        copying to a CUDA device (the trainer's stream waits on the event recorded after it)."""
        if self.as_numpy:
            images = self._stage(b, replaced=replaced).numpy()  # [N, C, H, W] view of a channels-last array
            if self.normalize:
                images = _normalize_numpy(images, dtype=self.dtype)
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
                images = _normalize_torch(images, self.dtype)
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
            if self.normalize:
                gi = _normalize_torch(gi, self.dtype)
            ev = self._transfer.record(self._stream)
        except BaseException:
            self._give_back(host, None)
            raise
        self._give_back(host, ev)  # the pinned file is read by the decode and copies before ev
        return (gi, gl, ev)

    # --- progress ----------------------------------------------------------------------------------

    def _write_progress(self, epoch: int, batch: int, reader: threading.Event | None = None) -> None:
        with self._progress_lock:
            if reader is not None and reader.is_set():
                raise _Stopped()  # a stopped reader's report would undo the seek that stopped it
            if self._last_written is not None and (epoch, batch) < self._last_written:
                self._jumps += 1  # going back on purpose: a new session tells the daemon it is a jump
            self._last_written = (epoch, batch)
            fp = self._fingerprint() if self._meta else ""
            p = progress.Progress(rank=self._lane, epoch=epoch, batch=batch, fingerprint=fp, pid=os.getpid(),
                                  time=time.time(), wait_s=round(self.wait_s, 6), batches=self.batches_read,
                                  session=f"{self._session}.{self._jumps}", echoed=self.echoed,
                                  gpu_fallbacks=self._stage.fallbacks if self._stage is not None else 0,
                                  reading=self._reading)
            deadline = None
            while True:
                try:
                    progress.write(self.progress_dir, p)
                    return
                except FileNotFoundError:
                    # the daemon creates the directory as it starts: a trainer started beside it waits
                    now = time.monotonic()
                    deadline = deadline or now + self.timeout
                    if now >= deadline:
                        raise PrefetchTimeout(f"waited {self.timeout:.1f} s for the progress directory "
                                              f"{self.progress_dir} to appear; " + self._daemon_state()) from None
                    time.sleep(0.01)
                except OSError as e:
                    raise PrefetchError(f"cannot write the progress file in {self.progress_dir}: {e.strerror}") from None

    # --- lifetime -------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the reader thread and free the pinned buffers (after their copies are done)."""
        if self._closed:
            return
        self._closed = True
        self._stop_reader()
        if self._pool is not None:
            self._pool.close()
        if self._reading and self.split == "val":  # closed mid-pass: the daemon stops making it
            try:
                self._end_pass()
            except Exception:
                pass

    def __enter__(self) -> PrefetchClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class _Sized:
    """Only a length (``loader.dataset`` and ``loader.sampler``; nothing to index or iterate)."""

    def __init__(self, n: int):
        self._n = n

    def __len__(self) -> int:
        return self._n


def _labels_at(b: jpegbatch.JpegBatch) -> int:
    """Where the labels go in a pinned block after a compact batch's decoded images (8-aligned)."""
    return -(-len(b) * b.height * b.width * 3 // 8) * 8


class _NoContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_CONSTANTS: dict = {}


def _constants(mean, std, device, dtype):
    """(scale, shift) with x * scale + shift == (x / 255 - mean) / std, made once per device,
    dtype and stream without a host-to-device copy (a pageable copy would sync the host)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    key = (tuple(mean), tuple(std), device, dtype, stream)
    c = _CONSTANTS.get(key)
    if c is None:
        scale = torch.empty(len(mean), device=device, dtype=dtype)
        shift = torch.empty(len(mean), device=device, dtype=dtype)
        for i, (m, s) in enumerate(zip(mean, std, strict=True)):
            scale[i].fill_(1.0 / (255.0 * s))  # a fill kernel with a host scalar: no copy, no sync
            shift[i].fill_(-m / s)
        c = _CONSTANTS[key] = (scale.view(1, -1, 1, 1), shift.view(1, -1, 1, 1))
    return c


IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def _normalize_torch(images, dtype=None, mean=IMAGENET_MEAN, std=IMAGENET_STD):
    dtype = dtype or torch.float32
    # low-precision outputs are computed in float32 and rounded once
    work = dtype if dtype in (torch.float32, torch.float64) else torch.float32
    scale, shift = _constants(mean, std, images.device, work)
    out = torch.addcmul(shift, images.to(work), scale)
    return out if work == dtype else out.to(dtype)


def _normalize_numpy(images, dtype=np.float32, mean=IMAGENET_MEAN, std=IMAGENET_STD):
    scale = (1.0 / (255.0 * np.asarray(std, dtype=np.float32))).reshape(1, -1, 1, 1)
    shift = (-np.asarray(mean, dtype=np.float32) / np.asarray(std, dtype=np.float32)).reshape(1, -1, 1, 1)
    return (np.asarray(images, dtype=np.float32) * scale + shift).astype(dtype or np.float32, copy=False)


def _state_int(state: Mapping, key: str, *default):
    """``state[key]`` as a non-negative int (or ``default`` when absent or None)."""
    if key not in state and not default:
        raise ValueError(f"no {key!r}")
    v = state.get(key)
    if v is None and default:
        return default[0]
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
        raise ValueError(f"{key} must be a non-negative integer, got {v!r}")
    return int(v)


def _resolve_rank(cfg: Config, rank: int | None) -> int:
    env_world = os.environ.get("WORLD_SIZE")
    if env_world is not None and env_world.isdigit() and int(env_world) != cfg.loader.world_size:
        raise ConfigError("loader.world_size", f"is {cfg.loader.world_size} but WORLD_SIZE={env_world} in the environment")
    if rank is None:
        env = os.environ.get("RANK")
        rank = int(env) if env is not None and env.isdigit() else 0
    if rank not in cfg.loader.ranks:
        raise ConfigError("loader.ranks", f"{list(cfg.loader.ranks)} does not include rank {rank}")
    return rank
