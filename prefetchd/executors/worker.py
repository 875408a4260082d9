"""A pool worker: makes whole batches and writes each one as an unpublished temp file.

The daemon sends a ``Task`` down the worker's pipe; the worker reads the images, decodes and
augments them into one reused ``[B, S, S, 3]`` array, writes the batch file under a ``.tmp-``
name (``O_CREAT|O_EXCL|O_NOFOLLOW``) and answers with a ``Result``. Pixel data never crosses
the pipe. Only the daemon publishes (renames) a batch, so a worker killed mid-batch leaves at
most a temp file that the daemon removes.

With ``augment.transform``, each sample is made by the user's transform (``core.augment.transform``,
made once per worker) into the same array. A sample whose file cannot be read or decoded is
quarantined; one that the transform raises on or makes into something the batch cannot hold
with this epoch's draw is replaced in that batch only (``Quarantined.per_draw``: said, not
quarantined for good, since another draw may succeed). Either way the replacement is chosen
from ``(seed, epoch, index, attempt)`` alone, so batch shapes and the bytes of every batch stay
independent of which worker made it.

Each batch is filled through a builder (``prefetchd.executors.builders``), chosen once per batch:
pixels, or (``augment.decode: hybrid | gpu``, for the batches ``hybrid.on_gpu`` gives the
trainer's GPU) a compact batch. Reading, quarantine and replacement are the same for both.

Several views (a transform returning a tuple, or ``augment.views``): one reused array per view,
``[B, H_v, W_v, 3]`` each; a sample fills its slot of every view, and the batch is written with
one image section per view (``batchfile`` version 2). Their shapes are the stream's
(``WorkerSetup.view_shapes``: the daemon's probe of the transform, or the config's views).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import signal
import time
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection

import numpy as np

from prefetchd.core import hybrid
from prefetchd.core.augment import modes as augment
from prefetchd.core.config import Config, ConfigError
from prefetchd.executors import priority
from prefetchd.executors.builders import Builder, CompactBuilder, PixelBuilder
from prefetchd.executors.helpers import GROUP_SIGNALS
from prefetchd.executors.storage import SampleUnreadable, StorageUnavailable, read_sample
from prefetchd.format import batchfile
from prefetchd.format.progress import VAL_LANE
from prefetchd.format.status import FILE_MODE
from prefetchd.sources import objectstore
from prefetchd.sources.dataset import Index, open_index_files

_REPLACE_TAG = 0x52504C43  # "RPLC"
MAX_REPLACEMENT_TRIES = 16
# Fault injection for the test suite: a sample whose path contains this string kills its worker
# with SIGSEGV, as a decoder crash would. Unset in normal use.
_CRASH_ON = os.environ.get("PREFETCHD_FAULT_CRASH_ON")
# ...and "substring:marker" stops (SIGSTOP) the first worker to decode such a sample, as a read
# hung in the kernel would; the marker file makes it happen once.
_HANG_ON = os.environ.get("PREFETCHD_FAULT_HANG_ONCE")


@dataclass(frozen=True)
class Task:
    rank: int
    epoch: int
    batch: int
    batches_in_epoch: int
    indices: np.ndarray  # int64 dataset indices, from the sampler
    # samples quarantined since the worker started because they killed a worker twice
    crashers: tuple[tuple[int, str], ...] = ()
    # a compact batch's file must not exceed this (the daemon's estimate; 0: no limit): JPEGs
    # that would overrun it (a replacement larger than the sample it stands in for) become pixels
    budget: int = 0
    # the first sample of the epoch's segment (a resumed epoch, see core.sampler); 0: the whole
    # epoch. The file's name and header fingerprint say it, so no reader takes it for another
    offset: int = 0

    def __reduce_ex__(self, protocol):
        # the indices as bytes: pickling the array costs ~15 us a task in the daemon's loop, bytes ~1 us
        ind = self.indices
        if type(ind) is not np.ndarray or ind.dtype != np.int64 or ind.ndim != 1:
            return super().__reduce_ex__(protocol)
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "indices"}
        return _task, (ind.tobytes(), fields)  # every other field as it is: none can be dropped on the way


def _task(indices: bytes, fields: dict) -> Task:
    return Task(indices=np.frombuffer(indices, np.int64).copy(), **fields)


@dataclass(frozen=True)
class Quarantined:
    index: int
    path: str
    reason: str
    # a user transform's failure with this draw, (epoch, sample): replaced in this batch, said, but
    # not quarantined for good (a later draw may succeed; workers that never saw it must agree)
    per_draw: bool = False


@dataclass(frozen=True)
class Result:
    rank: int
    epoch: int
    batch: int
    tmp_path: str | None
    size: int = 0
    seconds: float = 0.0
    samples: int = 0
    quarantined: tuple[Quarantined, ...] = ()
    error: str | None = None  # the whole batch failed (e.g. the buffer filesystem is full)
    unavailable: bool = False  # ...because the dataset root could not be read (storage.StorageUnavailable)
    offset: int = 0  # the task's segment (``Task.offset``)
    storage: tuple = ()  # a bucket's: this process's request totals (``sources.objectstore.counts``)


@dataclass(frozen=True)
class WorkerSetup:
    config: Config
    index_dir: str | None
    index: Index | None  # only when the index could not be cached to files
    fingerprint: int
    buffer_dir: str
    bad: frozenset[int] = field(default_factory=frozenset)  # known quarantined indices
    val: WorkerSetup | None = None  # the validation stream's (validation.enabled)
    index_fingerprint: str | None = None  # the index the files in index_dir must hold (the daemon's)
    transform_code: str | None = None  # augment.transform's module file as the daemon probed it (its stream's)
    # each view's (height, width), as the daemon's probe of augment.transform learned them (None: the config's)
    view_shapes: tuple[tuple[int, int], ...] | None = None


def tmp_name(task: Task | Result, worker_id: int, pid: int | None = None) -> str:
    """The temp file a worker (``pid``, by default this process) writes the batch to."""
    return (f"{batchfile.TMP_PREFIX}r{task.rank:04d}-e{task.epoch:06d}-b{task.batch:08d}"
            f"-w{worker_id}-{os.getpid() if pid is None else pid}")


_ADDRESS = re.compile(r"<[^<>]* at 0x[0-9a-fA-F]+>")


def clean_reason(text: str) -> str:
    """A decoder's message without object addresses (``<_io.BytesIO object at 0x7f...>``), so a
    reason reads the same in every run and every worker."""
    return _ADDRESS.sub("the file", text)


def replacement(seed: int, epoch: int, index: int, attempt: int, n: int) -> int:
    """The sample that stands in for a quarantined one: a pure function of its arguments."""
    ss = np.random.SeedSequence([_REPLACE_TAG, seed, epoch, index, attempt])
    return int(ss.generate_state(2, np.uint64)[0] % np.uint64(n))


class BatchMaker:
    """Makes batch files; one per worker process (also usable in-process, e.g. by ``bench``)."""

    def __init__(self, setup: WorkerSetup, worker_id: int = 0, current=None):
        self.cfg = setup.config
        if self.cfg.dataset.cache:  # a bucket's fetched bytes kept on local disk (sources/bytecache.py)
            from prefetchd.sources import bytecache

            bytecache.configure(self.cfg.dataset.cache)
        self.index = (setup.index if setup.index is not None
                      else open_index_files(setup.index_dir, setup.index_fingerprint))
        # a bucket: its client made with dataset.storage_options; the index's root is the one a file list
        # (of objects, even a local list of URLs) names, and a devkit's bucket may be another
        roots = (self.cfg.dataset.root, self.cfg.validation.root, self.index.root)
        self.bucket = any("://" in (r or "") for r in roots)
        for root in roots:
            if "://" in (root or ""):
                from prefetchd.sources.objectstore import store_for

                store_for(root, self.cfg.dataset.storage_options or None)
        if self.cfg.loader.shuffle == "block" and self.index.block_sizes() is not None:
            from prefetchd.sources import parquet

            parquet.keep_groups(self.cfg.loader.shuffle_window)  # a batch reads from a window of row groups
        self.fingerprint = setup.fingerprint
        self.buffer_dir = setup.buffer_dir
        self.worker_id = worker_id
        self.bad: dict[int, str] = {i: "quarantined earlier" for i in setup.bad}
        self.current = current  # shared int64 slot: the sample being decoded, for the daemon
        self._setup = setup
        self._val: BatchMaker | None = None

        from prefetchd.core.augment import views

        self.transform = None  # a user's transform (augment.transform): made once, here
        if self.cfg.augment.transform is not None:
            from prefetchd.core.augment import transform

            self.transform = transform.load(self.cfg.augment, worker=True)
            want = setup.transform_code
            if want is not None and self.transform.code != want:  # a worker started after an edit: not this stream's
                raise RuntimeError(f"augment.transform's module file {self.transform.module.path} changed since the "
                                   f"daemon started (sha256 {want}, now {self.transform.code}): restart the daemon "
                                   "to serve the edited transform (a new stream), or restore the file")
            if setup.view_shapes is None:  # made in-process (tools, tests): its views learned as the daemon learns them
                try:
                    transform.probe(self.transform, transform.first_samples(self.index), self.cfg.loader.seed)
                except ConfigError:  # said by the samples themselves, as they are made
                    self.transform.shapes = None
            self.transform.shapes = setup.view_shapes or self.transform.shapes or views.stream_shapes(self.cfg.augment)
        self.shapes = self.transform.shapes if self.transform else (setup.view_shapes or
                                                                    views.stream_shapes(self.cfg.augment))
        self._views = [np.empty((self.cfg.loader.batch_size, h, w, 3), dtype=np.uint8) for h, w in self.shapes]
        self._images = self._views[0]
        self.view_cfgs = views.view_configs(self.cfg.augment) if self.cfg.augment.views else None
        self.pixels = PixelBuilder(self.cfg.augment)
        self.compact = CompactBuilder(self.cfg.augment)

    def builder_for(self, epoch: int, batch: int) -> Builder:
        """The builder that makes this batch: compact where ``hybrid.on_gpu`` says so."""
        return self.compact if hybrid.on_gpu(self.cfg.augment, epoch, batch) else self.pixels

    def _load(self, i: int, out, epoch: int, builder: Builder) -> None:
        path = self.index.path(i)
        if self.current is not None:
            self.current[0] = i  # if this sample kills the process, the daemon learns which
        if _CRASH_ON and _CRASH_ON in path:
            os.kill(os.getpid(), signal.SIGSEGV)
        if _HANG_ON:
            _hang_once(path)
        try:  # a storage hiccup raises StorageUnavailable: no sample is blamed (storage.py)
            data = read_sample(lambda: self.index.read(i), self.index.refusal_root)
        except SampleUnreadable as e:
            raise augment.SampleError(f"cannot read: {e.strerror}") from None
        if not data:
            raise augment.SampleError("empty file")
        if self.transform is not None:  # pixels always (augment.decode: cpu, checked with the config)
            self.transform.make(data, self.cfg.loader.seed, epoch, i, out)
        elif self.view_cfgs is not None:  # augment.views (pixels too)
            from prefetchd.core.augment import views

            views.make_views(data, self.view_cfgs, self.cfg.loader.seed, epoch, i, out)
        else:
            builder.add(data, augment.draws(self.cfg.loader.seed, epoch, i), out)

    def fill(self, epoch: int, indices: np.ndarray, builder: Builder | None = None) -> tuple[
            np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[Quarantined]]:
        """Make ``indices`` through ``builder`` (default: pixels) into the reused image array
        (which holds every sample of a pixel batch, and the CPU-made ones of a compact batch);
        the batch is then written by the same builder. Several views: ``images`` is a tuple of
        one array per view."""
        builder = builder or self.pixels
        n = len(indices)
        images = self._images[:n] if len(self._views) == 1 else tuple(v[:n] for v in self._views)
        builder.reset(images)
        used = np.array(indices, dtype=np.int64)
        replaced = np.full(n, -1, dtype=np.int64)
        quarantined: list[Quarantined] = []
        try:
            self._fill(epoch, used, replaced, quarantined, images, builder)
        except StorageUnavailable:  # the batch is made again later: what it quarantined is said then
            for q in quarantined:
                self.bad.pop(q.index, None)
            raise
        labels = self.index.labels[used].astype(np.int64)
        return images, used, labels, replaced, quarantined

    def _fill(self, epoch: int, used: np.ndarray, replaced: np.ndarray, quarantined: list[Quarantined],
              images, builder: Builder) -> None:
        for k in range(len(used)):
            i = int(used[k])
            attempt = 0
            while True:
                try:
                    if i in self.bad:
                        raise augment.SampleError(self.bad[i])
                    slot = images[k] if not isinstance(images, tuple) else tuple(v[k] for v in images)
                    self._load(i, slot, epoch, builder)
                    break
                except augment.SampleError as e:
                    if getattr(e, "per_draw", False):  # the transform's with this draw: not self.bad
                        quarantined.append(Quarantined(i, self.index.path(i), clean_reason(str(e)), per_draw=True))
                    elif i not in self.bad:
                        self.bad[i] = clean_reason(str(e))
                        quarantined.append(Quarantined(i, self.index.path(i), self.bad[i]))
                    attempt += 1
                    if attempt > MAX_REPLACEMENT_TRIES:
                        raise RuntimeError(f"{MAX_REPLACEMENT_TRIES} replacements for sample {int(used[k])} "
                                           "could not be decoded either; is the dataset readable?") from None
                    i = replacement(self.cfg.loader.seed, epoch, int(used[k]), attempt, len(self.index))
            if i != used[k]:
                replaced[k] = used[k]
                used[k] = i

    def make(self, task: Task, queued: tuple[Task, ...] = ()) -> Result:
        """Make ``task``'s batch; ``queued``: the tasks this worker will make after it, in order
        (a bucket's objects for them are read ahead, ``sources.readahead``)."""
        t0 = time.perf_counter()
        for i, reason in task.crashers:
            self.bad.setdefault(i, reason)
        builder = self.builder_for(task.epoch, task.batch)
        if hasattr(self.index, "prefetch"):  # a bucket: the batch's objects fetched together, the next ones' ahead
            ahead = [[i for i in t.indices if i not in self.bad] for t in queued if (t.rank < VAL_LANE) ==
                     (task.rank < VAL_LANE)]
            self.index.prefetch([i for i in task.indices if i not in self.bad], ahead)
        _, used, labels, replaced, quarantined = self.fill(task.epoch, task.indices, builder)
        builder.fit(task.budget)
        if self.current is not None:  # a death from here on (out of memory while writing) is no sample's fault
            self.current[0] = -1
        return write_temp(self.buffer_dir, task, self.fingerprint, self.worker_id, builder, used, labels,
                          replaced, quarantined, time.perf_counter() - t0)

    def make_any(self, task: Task, queued: tuple[Task, ...] = ()) -> Result:
        """``make``, for a task of either stream: a validation lane's batch is made by a second
        maker built from ``setup.val`` (eval augmentation, the val index and fingerprint)."""
        if task.rank < VAL_LANE:
            return self.make(task, queued)
        if self._val is None:
            if self._setup.val is None:
                raise RuntimeError(f"a validation batch (lane {task.rank}) but validation is not set up")
            # no ``current`` slot: a val index must not be blamed (quarantined) as a train sample
            self._val = BatchMaker(self._setup.val, self.worker_id, None)
        return self._val.make(task, queued)


def write_temp(buffer_dir: str, task: Task, fingerprint: int, worker_id: int, builder: Builder,
               used: np.ndarray, labels: np.ndarray, replaced: np.ndarray, quarantined: list[Quarantined],
               seconds: float) -> Result:
    """Write a made batch as an unpublished temp file (the daemon renames it into the ring):
    ``builder`` is what collected it (or ``Packed``, the file a Ray actor made)."""
    fingerprint = batchfile.segment_fingerprint(fingerprint, task.epoch, task.offset)
    meta = batchfile.BatchMeta(task.rank, task.epoch, task.batch, task.batches_in_epoch, fingerprint)
    path = os.path.join(buffer_dir, tmp_name(task, worker_id))
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    except OSError as e:
        return Result(task.rank, task.epoch, task.batch, None, error=f"cannot create {path}: {e.strerror}",
                      quarantined=tuple(quarantined), offset=task.offset)
    try:
        os.fchmod(fd, FILE_MODE)  # whatever the worker's umask
        size = builder.write(fd, meta, used, labels, replaced)
    except BaseException as e:  # whatever it is, no temp file or descriptor outlives it
        os.close(fd)
        _unlink(path)
        if not isinstance(e, Exception):
            raise
        why = e.strerror if isinstance(e, OSError) else f"{type(e).__name__}: {e}"
        return Result(task.rank, task.epoch, task.batch, None, error=f"cannot write a batch: {why}",
                      quarantined=tuple(quarantined), offset=task.offset)
    os.close(fd)
    return Result(task.rank, task.epoch, task.batch, path, size, seconds, len(task.indices), tuple(quarantined),
                  offset=task.offset)


def _hang_once(path: str) -> None:
    what, _, marker = _HANG_ON.partition(":")
    if what in path:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            return
        os.kill(os.getpid(), signal.SIGSTOP)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def worker_main(conn: Connection, worker_id: int, setup: WorkerSetup, current=None) -> None:
    """Entry point of a worker process: serve tasks until the pipe closes or says stop."""
    # Ctrl-C, a hang-up, scancel's SIGTERM reach the whole group: the daemon decides, and ends its
    # workers itself. Born with them blocked (helpers.ensure_helpers): ignored, then unblocked.
    for sig in GROUP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, GROUP_SIGNALS)
    got = priority.apply(setup.config.workers.priority)  # below the trainers: they win a contended core
    maker = BatchMaker(setup, worker_id, current)
    conn.send(("ready", worker_id, os.getpid(), got))
    queued: collections.deque = collections.deque()  # tasks read out of the pipe, made in the order sent
    while True:
        try:
            if maker.bucket:  # what is queued behind this task: its objects are read ahead
                while conn.poll(0):
                    queued.append(conn.recv())
            task = queued.popleft() if queued else conn.recv()
        except (EOFError, OSError):
            return  # the daemon is gone
        if task is None:
            return
        try:
            result = maker.make_any(task, tuple(t for t in queued if t is not None))
        except StorageUnavailable as e:  # said once by the daemon, which tries the batch again soon
            result = Result(task.rank, task.epoch, task.batch, None, error=str(e), unavailable=True,
                            offset=task.offset)
        except Exception as e:  # a bug or an unreadable dataset: report, do not die silently
            result = Result(task.rank, task.epoch, task.batch, None, error=f"{type(e).__name__}: {e}",
                            offset=task.offset)
        if maker.bucket:  # this process's requests, bytes, errors and cache hits so far, with each result
            result = replace(result, storage=objectstore.counts())
        try:
            conn.send(result)
        except (EOFError, OSError, BrokenPipeError):
            if result.tmp_path:
                _unlink(result.tmp_path)
            return
