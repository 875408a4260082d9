"""Fault soak: workers killed at random for a minute while a trainer reads, and one worker
stopped (SIGSTOP) in a decode. ``PREFETCHD_SOAK_S`` changes the minute."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import threading
import time

import numpy as np
import psutil
from conftest import small_config, wait_until
from prefetchd_client import PrefetchClient

from prefetchd.core.config import load as load_config
from prefetchd.core.sampler import Sampler
from prefetchd.executors.worker import BatchMaker, WorkerSetup
from prefetchd.format import batchfile, status
from prefetchd.sources.dataset import load_index

SOAK_S = float(os.environ.get("PREFETCHD_SOAK_S", "60"))
MAX_BYTES = 6 * 81920  # six of these batches: max_bytes, not capacity, bounds the buffer


def _digest(images, labels) -> str:
    return hashlib.sha256(np.ascontiguousarray(images).tobytes() + labels.tobytes()).hexdigest()


def _on_disk(buf: str) -> int:
    n = 0
    for name in os.listdir(buf):
        if name.endswith(batchfile.SUFFIX) or name.startswith(batchfile.TMP_PREFIX):
            try:
                n += os.stat(os.path.join(buf, name)).st_size
            except FileNotFoundError:
                pass  # published or removed meanwhile
    return n


def test_random_worker_kills_and_a_stopped_worker_change_nothing(tmp_path, image_root, daemon_factory):
    cfg = small_config(tmp_path, image_root, loader={"epochs": None},
                       buffer={"capacity": 8, "refill_at": 8, "max_bytes": MAX_BYTES},
                       workers={"count": 2, "task_timeout_s": 2.0})
    buf = str(tmp_path / "buffer")
    marker = str(tmp_path / "hung-once")
    d = daemon_factory(cfg, env={"PREFETCHD_FAULT_HANG_ONCE": f"img_00007:{marker}"})
    got: dict = {}
    stop = threading.Event()
    errors: list = []

    def trainer():
        try:
            with PrefetchClient(cfg, timeout=60, as_numpy=True) as c:
                e = 0
                while not stop.is_set():
                    for b, (x, y) in enumerate(c.iter_epoch(e)):
                        got[(e, b)] = _digest(x.transpose(0, 2, 3, 1), y)
                        time.sleep(0.02)  # a training step
                    e += 1
        except Exception as ex:  # reported below
            errors.append(ex)

    t = threading.Thread(target=trainer, daemon=True)
    t.start()
    wait_until(lambda: got, 30, "the first batch")
    rnd = random.Random(11)
    kills = 0
    over_bytes = []
    end = time.monotonic() + SOAK_S
    while time.monotonic() < end and t.is_alive():
        time.sleep(rnd.uniform(0.1, 0.6))
        pids = (status.read_json(buf, status.STATUS_NAME) or {}).get("worker_pids", [])
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_STOPPED:  # the hung one is left to its deadline
                    alive.append(pid)
            except psutil.Error:
                pass
        if not alive:
            continue
        pid = rnd.choice(alive)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        kills += 1
        wait_until(lambda pid=pid: not [n for n in os.listdir(buf) if n.startswith(batchfile.TMP_PREFIX)
                                        and n.endswith(f"-{pid}")], 5, f"worker {pid}'s temp file removed")
        used = _on_disk(buf)
        if used > MAX_BYTES:
            over_bytes.append(used)
        assert d.proc.poll() is None
    stop.set()
    t.join(120)
    assert not errors and not t.is_alive()
    assert not over_bytes, f"published + temp bytes over max_bytes: {over_bytes[:5]}"
    log = d.log()
    assert os.path.exists(marker) and "(workers.task_timeout_s); killing it" in log  # the stopped one
    st = status.read_json(buf, status.STATUS_NAME)
    assert d.stop() == 0
    assert not [n for n in os.listdir(buf) if n.startswith(batchfile.TMP_PREFIX)]
    assert "quarantined sample" not in log and not os.path.exists(os.path.join(buf, status.QUARANTINE_NAME))

    c = load_config(cfg)
    index, _ = load_index(c.dataset.root, None, c.dataset.extensions, c.dataset.cache_dir)
    L = c.loader
    sampler = Sampler(len(index), L.batch_size, L.seed, L.shuffle, L.drop_last, L.world_size)
    maker = BatchMaker(WorkerSetup(c, index.files_dir, None, 0, c.buffer.dir))
    for (e, b), h in sorted(got.items()):
        images, _, labels, _, _ = maker.fill(e, sampler.batch_indices(e, 0, b))
        assert h == _digest(images, labels), (e, b)
    print(f"\nsoak {SOAK_S:.0f} s: {kills} workers killed, {len(got)} batches read and identical, "
          f"{st['worker_restarts']} restarts, {st['worker_timeouts']} replaced after the deadline")
