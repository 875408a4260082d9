"""max_bytes: auto in a memory cgroup (issue 30 item 3): the daemon, its workers and 8 trainers in
one cgroup limited to 2 GiB, the buffer on a tmpfs (whose pages are charged to that cgroup), every
sizing setting at its default: max_bytes becomes 25% of the limit and says so, the 8 ranks read 3
epochs, nothing is OOM-killed, and the ring never holds more than max_bytes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid

import pytest
import yaml
from conftest import rmdir_gone, wait_until

from prefetchd.tools.samples import make_image_folder

GiB = 1 << 30
RANKS = 8
EPOCHS = 3


def _memory_cgroup() -> str:
    if os.geteuid() != 0:
        pytest.skip("needs root to make a memory cgroup")
    parent = None
    for line in open("/proc/self/cgroup"):
        _, ctrls, path = line.rstrip("\n").split(":", 2)
        if "memory" in ctrls.split(","):
            parent = "/sys/fs/cgroup/memory" + path
    if parent is None or not os.path.isdir(parent):
        pytest.skip("no cgroup v1 memory controller here")
    path = os.path.join(parent, f"prefetchd-test-{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(path)
        with open(os.path.join(path, "memory.limit_in_bytes"), "w") as f:
            f.write(str(2 * GiB))
    except OSError as e:
        pytest.skip(f"cannot make a memory cgroup here: {e}")
    return path


def _join(cgroup: str):
    def join():
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    return join


def _oom_kills(cgroup: str) -> int:
    for line in open(os.path.join(cgroup, "memory.oom_control")):
        if line.startswith("oom_kill "):
            return int(line.split()[1])
    return 0


_READER = """
import sys
from prefetchd_client import PrefetchClient
cfg, rank, epochs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
n = 0
with PrefetchClient(cfg, rank=rank, timeout=300, as_numpy=True) as c:
    for e in range(epochs):
        for x, y in c.iter_epoch(e):
            n += len(y)
print(n)
"""


def test_eight_ranks_at_default_sizing_fit_a_2gib_memory_cgroup_with_a_tmpfs_buffer(tmp_path):
    if not os.path.isdir("/dev/shm") or os.statvfs("/dev/shm").f_blocks * os.statvfs("/dev/shm").f_frsize < GiB:
        pytest.skip("needs a tmpfs at /dev/shm")
    cgroup = _memory_cgroup()
    buffer = f"/dev/shm/prefetchd-test-{uuid.uuid4().hex[:8]}"
    root = str(tmp_path / "data")
    make_image_folder(root, classes=8, per_class=64, seed=5, long_side=128)
    cfg = tmp_path / "cfg.yaml"
    # every workers.* and buffer.* setting at its default; only the data, the ranks and the buffer's place
    cfg.write_text(yaml.safe_dump({
        "dataset": {"root": root, "cache_dir": str(tmp_path / "cache")},
        "loader": {"batch_size": 32, "world_size": RANKS, "epochs": EPOCHS},
        "buffer": {"dir": buffer},
        "progress": {"poll_interval_s": 0.05},
    }))
    log = open(tmp_path / "daemon.log", "wb")
    procs = []
    try:
        daemon = subprocess.Popen([sys.executable, "-m", "prefetchd", "run", "--config", str(cfg)], stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_join(cgroup))
        procs.append(daemon)
        readers = [subprocess.Popen([sys.executable, "-c", _READER, str(cfg), str(r), str(EPOCHS)],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    preexec_fn=_join(cgroup)) for r in range(RANKS)]
        procs += readers
        most, st = 0, None
        deadline = time.monotonic() + 600
        while any(r.poll() is None for r in readers):
            assert time.monotonic() < deadline, "8 ranks did not read 3 epochs in 10 min"
            try:
                with open(os.path.join(buffer, "status.json")) as f:
                    st = json.load(f)
                most = max(most, st["bytes_used"])
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.1)
        outs = [r.communicate() for r in readers]
        assert all(r.returncode == 0 for r in readers), [o[1][-500:] for o in outs]
        assert all(int(o[0]) == 8 * 64 // RANKS * EPOCHS for o in outs), [o[0] for o in outs]
        assert _oom_kills(cgroup) == 0
        assert st is not None and st["max_bytes"] == GiB // 2, st["max_bytes"]
        why = [w for w in st["sizing"] if w.startswith("max_bytes")][0]
        assert why.startswith("max_bytes 512.0 MiB: 25% of the 2.0 GiB memory limit (cgroup v1 "), why
        assert most <= st["max_bytes"]
        assert daemon.poll() is None  # not killed either
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
        try:
            os.killpg(procs[0].pid, 9)
        except (ProcessLookupError, IndexError):
            pass
        log.close()
        shutil.rmtree(buffer, ignore_errors=True)
        wait_until(lambda: rmdir_gone(cgroup), 20, "the test cgroup removed")
