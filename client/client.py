"""The trainer's side: read ready batches from the ring, report progress, resume exactly.

Imports only prefetchd's shared format modules (config, batchfile, progress, status), numpy
and, when installed, torch; never the daemon, Pillow or the pool.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from prefetchd import batchfile, progress, status
from prefetchd.config import Config, ConfigError
from prefetchd.config import load as load_config

try:
    import torch
except ImportError:  # numpy arrays only
    torch = None

_POLL_MIN_S = 0.0005
_POLL_MAX_S = 0.005


@dataclass(frozen=True)
class BatchInfo:
    """What the last batch yielded was: its place in the stream, its samples, and whether it was
    an echo (a repeat served instead of waiting, only with ``client.echo_factor`` > 1)."""

    rank: int
    epoch: int
    batch: int
    indices: np.ndarray  # dataset indices of the samples
    replaced: np.ndarray  # per sample: the index a quarantined sample stood in for, else -1
    echo: int = 0  # 0: first service; k: the k-th repeat


class PrefetchError(RuntimeError):
    """The client cannot go on; the message says what it waited for or found."""


class PrefetchTimeout(PrefetchError, TimeoutError):
    """No batch arrived within the timeout."""


class PrefetchClient:
    """Iterate the batches prefetchd prepared for one rank.

    ``with PrefetchClient("cfg.yaml", device="cuda") as client:``
    ``    for images, labels in client.iter_epoch(epoch): ...``

    * ``images``: uint8 ``[B, 3, H, W]`` (channels-last in memory), ``labels``: int64 ``[B]``;
      torch tensors (on ``device`` when given) or numpy arrays when torch is absent or
      ``as_numpy=True``. Normalise on the device with :func:`normalize`.
    * ``rank``: default from the ``RANK`` environment variable (torchrun), else 0.
    * ``seek(epoch, batch)`` then ``iter_epoch(epoch)`` starts at ``batch``; ``state_dict()``
      and ``load_state_dict()`` carry the position through a checkpoint.
    * with a CUDA ``device``, each file is read straight into one of two reused pinned buffers
      and copied to the device with ``non_blocking`` on a side stream while the previous batch
      trains; the next file is read ahead. Without CUDA no memory is pinned and each batch gets
      fresh arrays (one copy: file to array).
    * every wait has ``timeout`` seconds; a timeout raises :class:`PrefetchTimeout` saying what it
      waited for and whether the daemon is alive.
    """

    def __init__(self, config_path: str | Config, rank: int | None = None, device: Any = None,
                 timeout: float = 60.0, as_numpy: bool = False, pin_memory: bool | None = None,
                 verify: bool = True):
        self.cfg = config_path if isinstance(config_path, Config) else load_config(config_path)
        self.rank = _resolve_rank(self.cfg, rank)
        self.dir = self.cfg.buffer.dir
        self.progress_dir = self.cfg.progress_dir
        self.timeout = float(timeout)
        self.verify = verify
        self.as_numpy = as_numpy or torch is None
        self.device = None
        if device is not None:
            if torch is None:
                raise PrefetchError("device= needs torch; install prefetchd[torch] or leave device=None")
            self.device = torch.device(device)
            if self.device.type == "cuda" and not torch.cuda.is_available():
                raise PrefetchError(f"device {device!r} asked for, but CUDA is not available; pass device=None for CPU tensors")
            self.as_numpy = False
        self._cuda = self.device is not None and self.device.type == "cuda"
        self.pin_memory = self._cuda if pin_memory is None else bool(pin_memory)
        self.epoch = 0
        self.batch = 0
        self.wait_s = 0.0
        self.echo_factor = self.cfg.client.echo_factor
        self.echoed = 0
        self.last_batch: BatchInfo | None = None
        self.batches_read = 0
        self.bytes_read = 0
        self._meta: dict | None = None
        self._pinned: list = []
        self._events: list = [None, None]
        self._slot = 0
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._closed = False
        self._session = f"{os.getpid()}-{secrets.token_hex(4)}"
        self._jumps = 0
        self._last_written: tuple[int, int] | None = None

    # --- position ----------------------------------------------------------------------------------

    def seek(self, epoch: int, batch: int = 0) -> None:
        """Continue at (epoch, batch); the daemon is told at once and refills from there."""
        if epoch < 0 or batch < 0:
            raise ValueError("epoch and batch must be >= 0")
        self.epoch, self.batch = int(epoch), int(batch)
        self._write_progress(self.epoch, self.batch)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch": self.batch, "rank": self.rank,
                "fingerprint": self.meta().get("fingerprint") if self._meta else None}

    def load_state_dict(self, state: dict) -> None:
        if int(state.get("rank", self.rank)) != self.rank:
            raise PrefetchError(f"this state is rank {state.get('rank')}'s, not rank {self.rank}'s")
        self.seek(int(state["epoch"]), int(state["batch"]))

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
        self._meta = m
        return m

    @property
    def batches_per_epoch(self) -> int:
        return int(self.meta()["batches_per_epoch"])

    def __len__(self) -> int:
        return self.batches_per_epoch

    # --- iteration ---------------------------------------------------------------------------------

    def iter_epoch(self, epoch: int) -> Iterator[tuple[Any, Any]]:
        """Yield (images, labels) for this rank's batches of ``epoch``, from the sought batch on."""
        meta = self.meta()
        epochs = meta.get("epochs")
        if epochs is not None and epoch >= epochs:
            raise PrefetchError(f"epoch {epoch} is past loader.epochs ({epochs}) of the daemon's config")
        start = self.batch if epoch == self.epoch else 0
        self.epoch, self.batch = epoch, start
        self._write_progress(epoch, start)
        n = self.batches_per_epoch
        if start >= n:
            self.epoch, self.batch = epoch + 1, 0
            return
        echo = self.echo_factor > 1
        pending = self._load(epoch, start)
        for b in range(start, n):
            current = pending
            if b + 1 < n and not echo:
                pending = self._load(epoch, b + 1)  # read ahead while b trains
            out = self._finish(current)
            self.epoch, self.batch = (epoch, b + 1) if b + 1 < n else (epoch + 1, 0)
            yield out
            if echo and b + 1 < n:
                # data echoing (opt-in): rather than wait, serve this batch again, up to the factor
                k = 0
                while k < self.echo_factor - 1 and not os.path.exists(self._path(epoch, b + 1)):
                    k += 1
                    self.echoed += 1
                    self.last_batch = replace(self.last_batch, echo=k)
                    yield out
                pending = self._load(epoch, b + 1)
        self._write_progress(self.epoch, self.batch)

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        """Endless iteration across epochs from the current position."""
        while True:
            epochs = self.meta().get("epochs")
            if epochs is not None and self.epoch >= epochs:
                return
            yield from self.iter_epoch(self.epoch)

    # --- reading -----------------------------------------------------------------------------------

    def _path(self, epoch: int, batch: int) -> str:
        return os.path.join(self.dir, batchfile.batch_name(self.rank, epoch, batch))

    def _open_when_ready(self, epoch: int, batch: int) -> int:
        path = self._path(epoch, batch)
        t0 = time.monotonic()
        deadline = t0 + self.timeout
        delay = _POLL_MIN_S
        while True:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                break
            except FileNotFoundError:
                pass
            now = time.monotonic()
            if now >= deadline:
                self.wait_s += now - t0
                raise PrefetchTimeout(f"waited {self.timeout:.1f} s for rank {self.rank} epoch {epoch} batch {batch} "
                                      f"({path}); " + self._daemon_state())
            time.sleep(delay)
            delay = min(delay * 1.5, _POLL_MAX_S)
        self.wait_s += time.monotonic() - t0
        return fd

    def _daemon_state(self) -> str:
        alive = status.daemon_alive(self.dir)
        if alive is False:
            return f"no daemon holds {os.path.join(self.dir, status.LOCK_NAME)}: is prefetchd running with this config?"
        s = status.read_json(self.dir, status.STATUS_NAME) or {}
        rs = s.get("ranks", {}).get(str(self.rank), {})
        extra = f"; it says: {s['blocked']}" if s.get("blocked") else ""
        return (f"the daemon (pid {s.get('pid', '?')}) is {'alive' if alive else 'in an unknown state'}; "
                f"its status is {time.time() - s.get('updated', 0):.0f} s old, rank {self.rank} has "
                f"{rs.get('ready', '?')} ready from epoch/batch {rs.get('position', '?')}{extra}")

    def _buffer(self, size: int) -> tuple[Any, np.ndarray]:
        """Where to read a file of ``size`` bytes: (torch tensor or None, numpy view)."""
        if not self.pin_memory:
            arr = np.empty(size, dtype=np.uint8)
            return None, arr
        slot = self._slot
        self._slot ^= 1
        if self._events[slot] is not None:
            self._events[slot].synchronize()  # its last copy to the device must be done
            self._events[slot] = None
        if len(self._pinned) < 2 or self._pinned[slot].numel() < size:
            try:
                t = torch.empty(size, dtype=torch.uint8).pin_memory()
            except RuntimeError:  # no CUDA or no pinnable memory: pageable memory still works
                self.pin_memory = False
                return self._buffer(size)
            while len(self._pinned) < 2:
                self._pinned.append(t)
            self._pinned[slot] = t
        t = self._pinned[slot][:size]
        return (t, slot), t.numpy()

    def _load(self, epoch: int, batch: int):
        fd = self._open_when_ready(epoch, batch)
        try:
            st = os.fstat(fd)
            head = os.pread(fd, batchfile.HEADER_SIZE, 0)
            try:
                size = batchfile.expected_size(head)
            except batchfile.BatchFileError as e:
                raise PrefetchError(f"{self._path(epoch, batch)}: {e}") from None
            if st.st_uid != os.stat(self.dir).st_uid:
                raise PrefetchError(f"{self._path(epoch, batch)} is owned by uid {st.st_uid}, not by the daemon's; refusing it")
            if st.st_size != size:
                raise PrefetchError(f"{self._path(epoch, batch)} is {st.st_size} bytes, its header says {size}")
            handle, arr = self._buffer(size)
            batchfile.copy_into(fd, arr)
        finally:
            os.close(fd)
        try:
            b = batchfile.parse(arr, verify=self.verify)
        except batchfile.BatchFileError as e:
            raise PrefetchError(f"{self._path(epoch, batch)}: {e}") from None
        fp = batchfile.fingerprint_u64(self.meta()["fingerprint"])
        if (b.rank, b.epoch, b.batch, b.fingerprint) != (self.rank, epoch, batch, fp):
            raise PrefetchError(f"{self._path(epoch, batch)} holds rank {b.rank} epoch {b.epoch} batch {b.batch} of "
                                f"stream {b.fingerprint:016x}, not the expected one of {fp:016x} (stale batch)")
        self.batches_read += 1
        self.bytes_read += size
        # the file is in our memory now: the daemon may delete it and make the next
        self._write_progress(epoch, batch + 1)
        info = BatchInfo(b.rank, b.epoch, b.batch, b.indices.copy(), b.replaced.copy())
        return self._start_copy(b, handle) + (info,)

    def _start_copy(self, b: batchfile.Batch, handle) -> tuple:
        if self.as_numpy:
            return (b.images.transpose(0, 3, 1, 2), b.labels.copy(), None)
        images = torch.from_numpy(b.images).permute(0, 3, 1, 2)  # [N, C, H, W], channels-last strides
        labels = torch.from_numpy(b.labels.astype(np.int64))
        if self.device is None:
            return (images, labels, None)
        if not self._cuda or handle is None:
            return (images.to(self.device), labels.to(self.device), None)
        pinned, slot = handle
        lay = batchfile.Layout(*b.images.shape)
        # a view of the pinned tensor itself (not of its numpy alias), so torch sees pinned memory
        src = pinned[lay.images_offset: lay.images_offset + lay.images_nbytes].view(*b.images.shape).permute(0, 3, 1, 2)
        with torch.cuda.stream(self._stream):
            gi = src.to(self.device, non_blocking=True)  # pinned source: a true async copy
            gl = labels.to(self.device, non_blocking=True)  # labels were copied out of the buffer
            ev = torch.cuda.Event()
            ev.record(self._stream)
        self._events[slot] = ev
        return (gi, gl, ev)

    def _finish(self, item):
        gi, gl, ev, info = item
        self.last_batch = info
        if ev is None:
            return (gi, gl)
        cur = torch.cuda.current_stream(self.device)
        cur.wait_event(ev)
        gi.record_stream(cur)  # allocated on the side stream, used on the trainer's
        gl.record_stream(cur)
        return (gi, gl)

    # --- progress ----------------------------------------------------------------------------------

    def _write_progress(self, epoch: int, batch: int) -> None:
        if self._last_written is not None and (epoch, batch) < self._last_written:
            self._jumps += 1  # going back on purpose: a new session tells the daemon it is a jump
        self._last_written = (epoch, batch)
        fp = self._meta.get("fingerprint", "") if self._meta else ""
        p = progress.Progress(rank=self.rank, epoch=epoch, batch=batch, fingerprint=fp, pid=os.getpid(),
                              time=time.time(), wait_s=round(self.wait_s, 6), batches=self.batches_read,
                              session=f"{self._session}.{self._jumps}", echoed=self.echoed)
        try:
            progress.write(self.progress_dir, p)
        except OSError as e:
            raise PrefetchError(f"cannot write the progress file in {self.progress_dir}: {e.strerror}") from None

    # --- lifetime -------------------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for ev in self._events:
            if ev is not None:
                ev.synchronize()
        self._pinned.clear()

    def __enter__(self) -> PrefetchClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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
