"""The Ray bridge's pure parts: whether a worker can be placed at all, and what to say if not."""

from __future__ import annotations

import os

import pytest

from prefetchd.core.config import RayConfig
from prefetchd.executors.raybridge import fits, placement_problem, worker_needs

NODES = [{"CPU": 2.0, "memory": 1e9}, {"CPU": 4.0, "GPU": 1.0}]


def test_a_worker_that_fits_a_node_has_no_problem():
    assert placement_problem(worker_needs(RayConfig(num_cpus=4)), NODES, "h:1") is None
    assert placement_problem(worker_needs(RayConfig(resources={"GPU": 1})), NODES, "h:1") is None


def test_a_resource_no_node_has_is_named_with_its_key():
    why = placement_problem(worker_needs(RayConfig(resources={"preprocess": 1})), NODES, "h:1")
    assert why.startswith("no node of the Ray cluster at h:1 can host a worker asking {CPU: 1, preprocess: 1}")
    assert "no node has resource 'preprocess' (workers.ray.resources.preprocess: 1)" in why


def test_too_many_cpus_names_the_largest_node_and_num_cpus():
    why = placement_problem(worker_needs(RayConfig(num_cpus=8)), NODES, "h:1")
    assert "the largest node has 4 CPU (workers.ray.num_cpus: 8)" in why


def test_resources_on_different_nodes_but_never_together():
    why = placement_problem(worker_needs(RayConfig(num_cpus=3, resources={"memory": 1})), NODES, "h:1")
    assert "no single node has all of them at once" in why


def test_no_alive_node_and_zero_asks():
    assert "has no alive node" in placement_problem({"CPU": 1.0}, [], "h:1")
    assert worker_needs(RayConfig(num_cpus=0)) == {}
    assert fits({}, {}) > 1000 and fits({"CPU": 1.0}, {"CPU": 2.5}) == 2


def test_status_text_names_the_bridge():
    from prefetchd.format.status import format_status

    text = format_status({"ray": {"state": "unavailable: lost the Ray cluster at h:1", "in_flight": 0, "lost_batches": 2,
                                  "bridge": {"pid": 123, "starts": 2, "deaths": 1}}}, True)
    assert "ray: unavailable: lost the Ray cluster at h:1; 0 batches in flight, 2 lost and remade; bridge pid 123, " \
           "started 2x, died 1x" in text


def test_remote_setup_maps_a_tar_dataset_and_checks_only_sizes_there(tmp_path):
    """The setup an actor gets for a folder of class tars: root moved by path_map, each archive's
    identity reduced to its size (another node's copy has its own inodes and times)."""
    import io
    import tarfile

    import numpy as np
    from PIL import Image

    from prefetchd.executors.raybridge import remote_setup
    from prefetchd.executors.worker import WorkerSetup
    from prefetchd.sources.archive import TarIndex
    from prefetchd.sources.dataset import load_index

    root = tmp_path / "tars"
    root.mkdir()
    for cls in ("a", "b"):
        with tarfile.open(root / f"{cls}.tar", "w") as tf:
            for i in range(2):
                buf = io.BytesIO()
                Image.fromarray(np.full((8, 8, 3), i * 50, np.uint8)).save(buf, "JPEG")
                info = tarfile.TarInfo(f"{cls}_{i}.jpg")
                info.size = len(buf.getvalue())
                tf.addfile(info, io.BytesIO(buf.getvalue()))
    index, _ = load_index(str(root), None, (".jpg",), str(tmp_path / "cache"))
    assert isinstance(index, TarIndex)
    setup = WorkerSetup(None, None, index, 0, str(tmp_path / "buf"))
    mapped = remote_setup(setup, RayConfig(path_map={str(root): "/cluster/tars"})).index
    assert mapped.root == "/cluster/tars" and len(mapped) == len(index) == 4
    sizes = [os.path.getsize(root / f"{c}.tar") for c in ("a", "b")]
    assert sorted(s for ident in mapped.identity for s in ident if s) == sorted(sizes), mapped.identity


def test_another_nodes_copy_repacked_at_the_same_size_is_never_read_at_the_indexed_offsets(tmp_path):
    """An actor's node has its own copy of the class tars (path_map), checked by size only: a copy
    re-packed in another order at the same size read other members' bytes under the indexed
    labels. Now each copy is vouched for member by member when first opened: a good copy reads
    on (and is then held to its own identity), the re-packed one waits (StorageChanged)."""
    import io
    import shutil
    import tarfile

    from prefetchd.executors.raybridge import remote_setup
    from prefetchd.executors.worker import WorkerSetup
    from prefetchd.sources.base import StorageChanged
    from prefetchd.sources.dataset import load_index

    root, copy = tmp_path / "tars", tmp_path / "node2"
    root.mkdir()
    for cls in ("a", "b"):
        with tarfile.open(root / f"{cls}.tar", "w") as tf:
            for i in range(3):
                data = bytes([65 + i]) * 700  # members of one size, told apart by their bytes
                info = tarfile.TarInfo(f"{cls}_{i}.jpg")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    index, _ = load_index(str(root), None, (".jpg",), None, use_cache=False)
    shutil.copytree(root, copy)
    with tarfile.open(root / "b.tar") as old, tarfile.open(copy / "b.tar", "w") as new:
        for m in reversed(old.getmembers()):  # another order, the same size
            new.addfile(m, old.extractfile(m))
    assert os.path.getsize(copy / "b.tar") == os.path.getsize(root / "b.tar")
    mapped = remote_setup(WorkerSetup(None, None, index, 0, str(tmp_path / "buf")),
                          RayConfig(path_map={str(root): str(copy)})).index
    for i in range(len(mapped)):
        if mapped.relpath(i).startswith("a/"):
            assert mapped.read(i) == index.read(i)
        else:
            with pytest.raises(StorageChanged, match=r"node2/b.tar changed since it was indexed \(this node's copy is "
                                                     r"not the one indexed: the header before the data of b_0.jpg"):
                mapped.read(i)
    os.chmod(copy / "a.tar", 0o640)  # vouched for: a ctime change there is checked again, and reads on
    assert [mapped.read(i) for i in range(len(mapped)) if mapped.relpath(i).startswith("a/")] == \
        [index.read(i) for i in range(len(index)) if index.relpath(i).startswith("a/")]
    with open(copy / "a.tar", "r+b") as f:  # rewritten in place: mtime moves, held to its own identity
        f.write(open(root / "a.tar", "rb").read())
    with pytest.raises(StorageChanged, match="mtime_ns"):
        mapped.read(0)


def test_a_local_ray_cluster_is_refused_with_the_key():
    """``address: local`` made each bridge start its own Ray cluster; a bridge killed (hung, or
    stopped while starting) left that cluster's agents and actor processes running, orphaned."""
    from prefetchd.core.config import ConfigError

    for address in ("local", " Local "):
        with pytest.raises(ConfigError, match=r"workers.ray.address.*'local' would start a Ray cluster"):
            RayConfig(address=address)
    assert RayConfig(address="auto").address == "auto"


def test_a_bridge_with_no_ready_worker_gets_no_resubmit_loop_and_one_log_line(caplog):
    """The head goes down: every actor restarts, the bridge answers each task "no Ray worker is
    ready". The daemon's side (``RayPool``, driven as the loop drives it: submit while idle, make
    each lost batch again) stops sending until an UP names a ready worker, and logs one line, not
    one per answer (issue 41: ~25,000 lines in 5 s, the CPU burnt); when a worker is ready again,
    batches go to it."""
    import logging
    import socket
    import threading
    import time
    from multiprocessing.connection import Connection, wait

    import numpy as np

    from prefetchd.executors.raybridge import Bridge, _Actor
    from prefetchd.executors.raypool import RayPool
    from prefetchd.executors.worker import Task

    ours, theirs = socket.socketpair()
    daemon_end, bridge_end = Connection(ours.detach()), Connection(theirs.detach())
    bridge = Bridge(bridge_end, RayConfig(workers=2), None, 9999)
    bridge.actors = {i: _Actor(i, None, where_ref=object(), node=f"node{i}:1") for i in range(2)}  # both restarting
    reader = threading.Thread(target=bridge._read, daemon=True)
    reader.start()
    pool = RayPool(RayConfig(workers=2), None, 2, lambda: None)
    pool._conn, pool._inited = daemon_end, True
    pool.workers = {0: "node0:1", 1: "node1:1"}  # the last UP, before the outage
    tasks = [Task(0, 0, b, 100, np.arange(4, dtype=np.int64)) for b in range(8)]
    todo = list(tasks)
    caplog.set_level(logging.DEBUG, logger="prefetchd.ray")
    try:
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            while todo and pool.idle():
                assert pool.submit(todo[0])
                todo.pop(0)
            wait([daemon_end], 0.05)
            _, lost = pool.results()
            todo += lost  # made again: back to whichever executor is idle
        lines = [r for r in caplog.records if r.levelno >= logging.INFO and "was lost" in r.getMessage()]
        assert len(lines) == 1, f"{len(lines)} lines: {[r.getMessage() for r in lines[:3]]}"
        assert pool.restarts <= 4, f"{pool.restarts} batches lost and remade: a resubmit loop"
        assert not pool.workers and not pool.idle()
        with bridge.lock:  # a worker is ready again: the bridge says so, the daemon sends to it
            bridge.actors[0].where_ref = None
        bridge._up()
        sent = []
        bridge.actors[0].handle = type("Handle", (), {"fill": type("Fill", (), {
            "remote": staticmethod(lambda *a: sent.append(a) or object())})})()
        deadline = time.monotonic() + 5
        while not sent and time.monotonic() < deadline:
            wait([daemon_end], 0.05)
            pool.results()
            while todo and pool.idle():
                assert pool.submit(todo.pop(0))
        assert sent and pool.workers == {0: "node0:1"}
        assert any("were lost and made again" in r.getMessage() or "connected" in r.getMessage()
                   for r in caplog.records if r.levelno == logging.INFO)
    finally:
        bridge.stop.set()
        daemon_end.close()  # the bridge's reader sees the end, then its end is closed
        reader.join(5)
        bridge_end.close()
