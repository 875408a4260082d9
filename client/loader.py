"""The public loader, ``PrefetchClient``: the trainer's position, DataLoader habits (``len``,
``set_epoch``, ``state_dict``), the daemon's metadata, iteration, progress reports, lifetime.

Imports only prefetchd's shared modules (``prefetchd.format``, ``prefetchd.core.config``), numpy
and, when installed, torch; never the daemon, Pillow or the pool. Reading files is
``reader.BatchFiles``'s (a mixin of the client, run in the reader thread), host memory and copies
``memory``'s, normalisation ``normalize``'s, decoding compact batches ``gpudecode``'s.

Hybrid decode (``augment.decode: hybrid | gpu``). Some batch files are compact batches (JPEG bytes
and parameters, ``prefetchd.format.jpegbatch``); the reader thread decodes them with a
``gpudecode.DecodeStage`` on the device (on the side stream, like a copy) and yields the same
uint8 ``[B, 3, H, W]`` images. The stage is made when the client is, so a missing GPU extra is
an error at start; ``decoder=`` replaces its JPEG decoder (a CPU one makes the path run without
a GPU).

The position the trainer sees (``epoch``, ``batch``, ``state_dict()``) is the trainer's own, never
the reader's read-ahead.

Memory. A yielded batch is never written again: numpy arrays and CPU tensors are fresh per batch;
pinned CPU tensors are fresh blocks of the host allocator (torch's caching allocator reuses a
block only once it is freed and its copies are done); CUDA batches come through ``memory``'s pool.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np

from prefetchd.core.config import Config
from prefetchd.core.config import ConfigError as _CoreConfigError
from prefetchd.core.config import load as load_config
from prefetchd.core.streamkeys import differences, stream_settings
from prefetchd.format import procstate, progress, status

from .common import (
    _PASSING_ERRNOS,
    _POLL_MIN_S,
    BatchInfo,
    ConfigError,
    PrefetchError,
    PrefetchTimeout,
    _lane_lock,
    _owns_lane,
    _Stopped,
    _take_lane,
    config_from_env,
    torch,
    torch_or_none,
)
from .erasing import check_client as check_erasing
from .erasing import from_meta as erasing_from_meta
from .jobenv import job_rank
from .lifetime import _ITERATIONS, _UNFINISHED, Lifetime
from .memory import CudaTransfer, _PinnedPool
from .reader import BatchFiles, ReadAhead
from .shapes import DataLoaderShape, check_batch_size, normalize_constants
from .state import LoaderState

_log = logging.getLogger("prefetchd_client")


class PrefetchClient(DataLoaderShape, LoaderState, BatchFiles, Lifetime):
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
      ``as_numpy=True``. A stream of several views (a transform returning a tuple, or
      ``augment.views``) yields ``(view_0, ..., view_k-1, labels)``, each view ``[B, 3, H_v, W_v]``
      and handled as ``images`` is (``docs/views.md``). ``normalize=True`` yields ``(x / 255 - mean) / std`` in ``dtype`` (default
      float32; ``mean=``, ``std=``: ImageNet's by default) on the images' device instead of uint8.
    * ``config``: the daemon's config file (or a loaded ``Config``); None takes the path in
      ``$PREFETCHD_CONFIG``, which ``prefetchd launch`` and ``prefetchd_client.serve`` set.
    * ``rank``: default from ``$RANK`` (torchrun), else 0. ``batch_size=``, if given, must be the config's.
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
      is ``epoch``), ``len()`` is this rank's val batches, the last batch may be partial. Every
      rank's pass has the same number of batches (``validation.pad``, as DistributedSampler pads:
      a loop that all-reduces per batch cannot hang); ``last_batch.padding`` marks the repeated
      samples, so ``~padding`` counts each sample once across ranks. With ``validation.pad:
      false`` each sample is read once and ranks' batch counts may differ by one. The daemon
      makes a pass only while it is iterated. ``padding_mask=True`` yields ``(images, labels,
      padding)``: the mask beside its batch, for loops that read ahead (as Lightning's does).
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

    def __init__(self, config: str | Config | None = None, rank: int | None = None, device: Any = None,
                 timeout: float = 60.0, as_numpy: bool = False, pin_memory: bool | None = None,
                 verify: bool = True, normalize: bool = False, dtype: Any = None, prefetch: int | None = None,
                 transfer: Any = None, decoder: Any = None, split: str = "train", padding_mask: bool = False,
                 batch_size: int | None = None, mean: Any = None, std: Any = None):
        self._closed = True  # until fully built: __del__ must not trip over a half-made client
        self._reader: ReadAhead | None = None
        self._pool: _PinnedPool | None = None
        config = config_from_env(config)
        self.cfg = config if isinstance(config, Config) else _load_config(config)
        self.rank = _resolve_rank(self.cfg, rank)
        if split not in progress.STREAMS:
            raise ValueError(f"split must be one of {progress.STREAMS}, got {split!r}")
        if split == "val" and not self.cfg.validation.enabled:
            raise ConfigError("validation.enabled", "is false in this config: split='val' needs the daemon's "
                              "validation stream (set validation.enabled and validation.root)")
        self.split = split
        check_batch_size(batch_size, self.batch_size, "validation.batch_size" if split == "val" else
                         "loader.batch_size", self.cfg.source)
        self.padding_mask = bool(padding_mask)
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
        self.mean, self.std = normalize_constants(self.normalize, mean, std)
        check_erasing(self.cfg, self.normalize, split)  # erase_on: client erases the normalised batch
        if dtype is not None and not self.normalize:
            raise ValueError("dtype= is the dtype of normalized images; pass normalize=True with it")
        self.as_numpy = as_numpy or torch_or_none() is None
        self._transfer = transfer if transfer is not None else CudaTransfer()
        self.device = None
        self._copy = False  # copy to the device through the transfer (pinned buffers, side stream)
        if device is not None:
            if torch_or_none() is None:
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
        # (epoch, offset): a resumed epoch read as a segment, from sample ``offset`` of its
        # permutation (load_state_dict of a state saved at another world or batch size); else None
        self._segment: tuple[int, int] | None = None
        self.wait_s = 0.0
        self.echo_factor = self.cfg.client.echo_factor
        self.echoed = 0
        self.last_batch: BatchInfo | None = None
        self.batches_read = 0
        self.bytes_read = 0
        self._meta: dict | None = None
        self._eraser = None  # erase_on: client: what erases the normalised batches (from the meta)
        self._val_sampler = None  # which val samples are padding (from the meta)
        self._progress_lock = threading.Lock()
        self._session = f"{os.getpid()}-{secrets.token_hex(4)}"
        self._identity = (0, 0, 0)  # (pid, start, pid namespace) said in the progress file
        self._jumps = 0
        self._last_written: tuple[int, int, int] | None = None  # (epoch, batch, offset)
        self._held: object | None = None  # the iteration under way (its token), if any
        self._unsaved: progress.Progress | None = None  # a progress record not written yet (a full disk)
        self._said_no_daemon = False  # "no daemon holds the buffer: waiting" said (once)
        # what the trainer is doing, in every record: its next() waits since (0: it does not), it
        # is done with the lane (progress.py: waiting_since, closed)
        self._waiting_since = 0.0
        self._finished = False
        self._last_record: progress.Progress | None = None  # the last record written (or tried)
        self._closed = False
        _UNFINISHED.add(self)

    # --- position ----------------------------------------------------------------------------------

    def seek(self, epoch: int, batch: int = 0) -> None:
        """Continue at (epoch, batch); the daemon is told at once and refills from there. Waits
        (up to the timeout) for the daemon to create its directories when it is starting too."""
        self._seek(epoch, batch)

    def _seek(self, epoch: int, batch: int, offset: int = 0) -> None:
        """``seek``, into the segment of ``epoch`` from sample ``offset`` (0: the whole epoch)."""
        if epoch < 0 or batch < 0:
            raise ValueError("epoch and batch must be >= 0")
        self._stop_reader()
        self._held = None  # an iteration this ends leaves the position to this seek
        self.epoch, self.batch = int(epoch), int(batch)
        self._segment = (self.epoch, int(offset)) if offset else None
        self._write_progress(self.epoch, self.batch, jump=True)

    def _offset_of(self, epoch: int) -> int:
        """Where this client's segment of ``epoch`` starts: 0 but in a resumed epoch."""
        return self._segment[1] if self._segment is not None and self._segment[0] == epoch else 0

    def set_epoch(self, epoch: int) -> None:
        """As ``DistributedSampler.set_epoch``: the next ``for`` runs ``epoch``. The current epoch
        keeps its position (a resumed epoch goes on where it was); another epoch starts at batch 0."""
        if int(epoch) != self.epoch:
            self.seek(int(epoch), 0)

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
                    and m.get("pid") == status.lock_pid(self.dir) and status.meta_serves(self.dir, m)):
                break
            self._say_no_daemon()
            if time.monotonic() >= deadline:
                raise PrefetchTimeout(f"waited {self.timeout:.1f} s for the daemon's meta.json in {self.dir}; "
                                      + self._daemon_state())
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        if m.get("stream_fingerprint") != self.cfg.stream_fingerprint():
            raise PrefetchError(f"the daemon serving {self.dir} (pid {m.get('pid')}) makes a different stream than "
                                f"{self.cfg.source or 'this config'} describes ({self._stream_diff(m)}); use the "
                                f"daemon's config file" + (f" ({m['config']})" if m.get("config") else "")
                                + " or restart the daemon with this one")
        if self.rank not in m.get("ranks", []):
            raise PrefetchError(f"the daemon serving {self.dir} serves ranks {m.get('ranks')}, not rank {self.rank}")
        if self.split == "val" and not isinstance(m.get("validation"), dict):
            raise PrefetchError(f"the daemon serving {self.dir} (pid {m.get('pid')}) makes no validation stream; "
                                "restart it with validation.enabled in its config")
        if self.split == "val" and m["validation"].get("stream_fingerprint") != self.cfg.val_stream_fingerprint():
            raise PrefetchError(f"the daemon serving {self.dir} (pid {m.get('pid')}) makes a different validation "
                                f"stream than {self.cfg.source or 'this config'} describes (validation settings "
                                "differ); use the daemon's config file")
        self._eraser = erasing_from_meta(self.cfg, m, self.split)  # erase_on: client (client/erasing.py)
        self._meta, self._val_sampler = m, None
        return m

    def _stream_diff(self, m: dict) -> str:
        """The stream settings that differ from the daemon's (``m``: its meta.json), by key."""
        mine = stream_settings(self.cfg)
        theirs = m.get("stream")
        if not isinstance(theirs, dict):  # a daemon of an older version: what its meta says
            theirs = {k: m[k.split(".")[1]] for k in ("loader.batch_size", "loader.world_size") if k.split(".")[1] in m}
            mine = {k: mine[k] for k in theirs}
        return differences(mine, theirs) or "loader or augment settings differ"

    def _say_no_daemon(self) -> None:
        """Once per client, at the first wait with no daemon holding the buffer: say so, and how long it waits."""
        if not self._said_no_daemon and status.daemon_alive(self.dir) is False:
            self._said_no_daemon = True
            _log.warning("prefetchd: no daemon holds %s (nothing locks %s): waiting up to %.0f s (timeout=) for "
                         "one to start: prefetchd run --config %s", self.dir, status.LOCK_NAME, self.timeout,
                         self.cfg.source or "<the daemon's config>")

    def _fingerprint(self) -> str:
        m = self.meta()
        return m["validation"]["fingerprint"] if self.split == "val" else m["fingerprint"]

    @property
    def batches_per_epoch(self) -> int:
        if self.split == "val":
            return int(self.meta()["validation"]["batches"][str(self.rank)])
        return int(self.meta()["batches_per_epoch"])

    def __len__(self) -> int:
        """This rank's batches per epoch (waits, up to the timeout, only until the daemon has said);
        in a resumed epoch (``load_state_dict`` at another world size), that epoch's."""
        return self._epoch_len(self.epoch)

    def _epoch_len(self, epoch: int) -> int:
        offset = self._offset_of(epoch)
        return self._sampler().batches_in(offset) if offset else self.batches_per_epoch

    # --- iteration ---------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        """One epoch from the current position; afterwards the position is (epoch + 1, 0), so the
        next ``for`` runs the next epoch, as a DataLoader with ``set_epoch`` does. For
        ``split="val"`` each ``for`` is a whole new pass: a pass left early (``break``) counts
        as done, and an iteration still held (``it = iter(val); next(it)``) is ended here, its
        pass over, so the new one starts at its first batch."""
        if self.split == "val" and self._held is not None:
            self._stop_reader()
            self._held = None
            self._end_pass()
        return self.iter_epoch(self.epoch)

    def iter_epoch(self, epoch: int) -> Iterator[tuple[Any, Any]]:
        """Yield (images, labels) for this rank's batches of ``epoch``, from the sought batch on."""
        if self._closed:
            raise PrefetchError("this PrefetchClient is closed")
        it = self._iter_epoch(int(epoch))
        _ITERATIONS.add(it)  # ended at exit if left unfinished (lifetime.py)
        return it

    def _iter_epoch(self, epoch: int) -> Iterator[tuple[Any, Any]]:
        meta = self.meta()
        epochs = meta.get("epochs")
        if self.split == "train" and epochs is not None and epoch >= epochs:
            raise PrefetchError(f"epoch {epoch} is past loader.epochs ({epochs}) of the daemon's config")
        self._stop_reader()
        self._resolve_device()
        start = self.batch if epoch == self.epoch else 0
        if epoch != self.epoch:
            self._segment = None  # another epoch, from its start: a whole one
        self.epoch, self.batch = epoch, start
        val = self.split == "val"
        self._reading = True
        self._write_progress(epoch, start)
        n = self._epoch_len(epoch)
        if start >= n:
            self.epoch, self.batch = epoch + 1, 0
            if val:
                self._end_pass()
            return
        reader = self._reader = ReadAhead(self, epoch, start, n, self.prefetch)
        token = self._held = object()  # this iteration, until it ends or a newer one ends it
        echo = self.echo_factor > 1 and not val
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
        finally:
            reader.close()
            if self._reader is reader:
                self._reader = None
            mine = self._held is token  # not ended by seek() or a newer iteration, which own the position
            if mine:
                self._held = None
            # a client closed first (an iteration left unfinished, then close() or the end of its
            # with block) said its last word: an iteration the garbage collector ends later says none
            if val and mine and not self._closed:  # done or left early: the pass is over, the daemon deletes what it made
                self._end_pass(take=False)
        if not val and not self._closed:
            self._write_progress(self.epoch, self.batch, take=False)

    def _end_pass(self, take: bool = True) -> None:
        """A val pass ended or was abandoned: the next ``for`` is the next pass; the daemon stops."""
        if self.batch:
            self.epoch, self.batch = self.epoch + 1, 0
        self._reading = False
        self._write_progress(self.epoch, self.batch, take=take)

    def _next(self, reader: ReadAhead, epoch: int, batch: int):
        try:
            # timed from this asking, leaving out a stop of the process: see reader.ReadAhead.get
            item = reader.get(batch, self.timeout)
        finally:
            self.wait_s += reader.waited  # the time from asking to the batch being there
            if reader.announced:  # the wait is over (a batch, a timeout): the record counts it whole
                self._say_waiting(0.0)
        images, labels, event, info = item
        self.last_batch = info
        views = images if isinstance(images, tuple) else (images,)  # several views: one tensor each
        if event is not None:
            self._transfer.wait(event, self.device, views + (labels,))
        if self.padding_mask:
            return (*views, labels, self._mask(info))
        return (*views, labels)

    def _stop_reader(self) -> None:
        r, self._reader = self._reader, None
        if r is not None:
            r.close()


    # --- the device and the decode stage ---------------------------------------------------------

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
        if torch_or_none() is None:
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

    # --- progress ----------------------------------------------------------------------------------

    def _write_progress(self, epoch: int, batch: int, reader: threading.Event | None = None,
                        jump: bool = False, take: bool = True) -> None:
        """Tell the daemon where this rank is. ``jump``: the trainer moved the position (``seek``,
        ``set_epoch``, ``load_state_dict``), a new session, which the daemon honours whichever way
        it goes: the client cannot tell backwards from forwards in the daemon's terms (a resumed
        epoch's segment sits after its epoch's own batches there), so it never has to. The trainer's
        moves (``take``) make this client its lane's in this process; a reader's report (``reader``)
        or a clean-up (``take=False``) of a client another one has taken the lane from says nothing
        (and that reader stops)."""
        lane = (self.progress_dir, self._lane)
        with self._progress_lock, _lane_lock(lane):
            if reader is not None and reader.is_set():
                raise _Stopped()  # a stopped reader's report would undo the seek that stopped it
            if reader is None and take:
                _take_lane(lane, self)
            elif not _owns_lane(lane, self):
                if reader is not None:
                    reader.set()
                    raise _Stopped()
                return
            where = (epoch, batch, self._offset_of(epoch))
            last = self._last_written
            if jump or (last is not None and (epoch < last[0] or epoch == last[0] and (
                    where[2] != last[2] or batch < last[1]))):
                self._jumps += 1  # moved by the trainer, or back, or into another segment: a new session
            self._last_written = where
            fp = self._fingerprint() if self._meta else ""
            if self._identity[0] != os.getpid():  # who this process is (a fork is another)
                self._identity = (os.getpid(), *procstate.identity())
            p = progress.Progress(rank=self._lane, epoch=epoch, batch=batch, fingerprint=fp, pid=os.getpid(),
                                  pid_start=self._identity[1], pid_ns=self._identity[2],
                                  time=time.time(), wait_s=round(self.wait_s, 6), batches=self.batches_read,
                                  session=f"{self._session}.{self._jumps}", echoed=self.echoed,
                                  gpu_fallbacks=self._stage.fallbacks if self._stage is not None else 0,
                                  reading=self._reading, offset=self._offset_of(epoch),
                                  waiting_since=self._waiting_since, closed=self._finished)
            self._last_record = p
            deadline = None
            while True:
                try:
                    progress.write(self.progress_dir, p)
                    break
                except FileNotFoundError:
                    # the daemon creates the directory as it starts: a trainer started beside it waits
                    self._say_no_daemon()
                    now = time.monotonic()
                    deadline = deadline or now + self.timeout
                    if now >= deadline:
                        raise PrefetchTimeout(f"waited {self.timeout:.1f} s for the progress directory "
                                              f"{self.progress_dir} to appear; " + self._daemon_state()) from None
                    time.sleep(0.01)
                except OSError as e:
                    if e.errno not in _PASSING_ERRNOS:  # permission denied, read-only: a deployment error
                        raise PrefetchError(f"cannot write the progress file in {self.progress_dir}: "
                                            f"{e.strerror}") from None
                    # a full RAM disk (the progress dir is in the buffer by default) must not end the
                    # training: it goes on from the ring, the write is tried again while the reader
                    # waits and with the next batch, and the daemon keeps the last position it saw
                    if self._unsaved is None:
                        _log.warning("cannot write the progress file in %s: %s; reading on from the ring and "
                                     "trying again", self.progress_dir, e.strerror)
                    self._unsaved = p
                    return
            if self._unsaved is not None:
                _log.info("the progress file in %s is written again", self.progress_dir)
                self._unsaved = None

    def _retry_progress(self) -> None:
        """Write the progress record a full disk refused (while the reader waits for a batch)."""
        with self._progress_lock:
            if self._unsaved is None:
                return
            try:
                progress.write(self.progress_dir, self._unsaved)
            except OSError:
                return
            _log.info("the progress file in %s is written again", self.progress_dir)
            self._unsaved = None

def _load_config(path) -> Config:
    try:
        return load_config(path)
    except _CoreConfigError as e:  # a missing or invalid file: the client's error, a PrefetchError
        raise ConfigError.of(e) from None


def _resolve_rank(cfg: Config, rank: int | None) -> int:
    L, where = cfg.loader, f" in {cfg.source}" if cfg.source else ""
    job = job_rank(os.environ)  # torchrun's RANK/WORLD_SIZE, else Slurm's (its task count is the world size
    env_world = job.world_size if job is not None and (rank is None or not job.slurm) else None  # but for rank=)
    if env_world is not None and env_world != L.world_size:
        raise ConfigError("loader.world_size", f"is {L.world_size}{where} but {job.world_name}={env_world} in the "
                          f"environment (the job's world size): set loader.world_size: {env_world} and restart the "
                          "daemon with that config (the stream depends on it)")
    given = f"rank={rank}"
    if rank is None:
        found = job is not None and job.rank is not None
        rank = job.rank if found else 0
        given = f"{job.rank_name}={rank} in the environment" if found else "rank 0, the default"
    if rank not in L.ranks:
        every = "ranks: all at " if L.ranks == tuple(range(L.world_size)) else ""
        todo = (f"set loader.world_size to the job's world size (more than {rank}) and restart the daemon"
                if rank >= L.world_size else f"add {rank} to loader.ranks, or run rank {rank} where a config serves it")
        raise ConfigError("loader.ranks", f"{list(L.ranks)} does not include rank {rank} ({given}; {every}world size "
                          f"{L.world_size}{where}): {todo}")
    return rank
