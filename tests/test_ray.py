"""Batches made on a real multi-node Ray cluster on this machine: same bytes as local ones."""

from __future__ import annotations

import os
import signal

import pytest
from conftest import small_config, wait_until
from test_daemon import collect, digest, reference_batches

from prefetchd.format import status

# Keep the whole cluster on loopback: with this, Ray resolves its own address to 127.0.0.1 instead
# of the machine's interface address (read when ray is imported; the daemon and nodes inherit it).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
ray_cluster_utils = pytest.importorskip("ray.cluster_utils", reason="prefetchd[ray] is not installed")

# everything on loopback: the cluster's nodes and the daemon's driver
NODE = {"num_cpus": 2, "object_store_memory": 100 * 2**20, "node_ip_address": "127.0.0.1"}
LOOP = {"node_ip_address": "127.0.0.1"}


def _kill_scoped(temp_dir: str) -> None:
    """``ray stop --force`` for one test's clusters only: every process whose command line names
    its temp dir (raylets, GCS, workers and agents of those sessions), nobody else's."""
    me = os.getpid()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == me:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if temp_dir.encode() in f.read():
                    os.kill(int(pid), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


@pytest.fixture(scope="module")
def ray_temp_dir():
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="pfray", dir="/tmp")  # short: Ray's socket paths live under it
    # a head writes its address to $TMPDIR/ray/ray_current_cluster (Ray's default temp dir: RAY_TMPDIR,
    # else TMPDIR, else /tmp) whatever its temp_dir, but makes that directory only when it is the
    # temp_dir: where Ray never ran (or in the suite's own TMPDIR: conftest.py), the start failed
    os.makedirs(os.path.join(os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp", "ray"), exist_ok=True)
    yield d
    _kill_scoped(d)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(ray_temp_dir):
    c = ray_cluster_utils.Cluster(initialize_head=True, head_node_args={**NODE, "temp_dir": ray_temp_dir})
    worker = c.add_node(**NODE)
    c.wait_for_nodes()
    assert c.address.startswith("127.0.0.1:"), c.address
    c.loopback_address = c.address
    yield c, worker
    c.shutdown()


def _live_actors(c) -> list[dict]:
    """The daemons' actors the cluster still has (placed, pending or restarting), from its GCS."""
    table = c.global_state.actor_table(None)
    return [a for a in table.values() if "BatchActor" in a["ActorClassName"] and a["State"] != "DEAD"]


def _ray_status(buf: str) -> dict:
    return (status.read_json(buf, status.STATUS_NAME) or {}).get("ray") or {}


def _reference_digest(cfg: str) -> str:
    ref, _ = reference_batches(cfg)
    return digest({k: v[:2] for k, v in ref.items()})


def test_ray_executor_makes_the_same_bytes_on_two_nodes(tmp_path, image_root, daemon_factory, cluster):
    c, _ = cluster
    cfg = small_config(tmp_path, image_root, workers={"executor": "ray", "ray": {"address": c.loopback_address, "workers": 2, **LOOP}})
    buf = str(tmp_path / "buffer")
    d = daemon_factory(cfg)
    got = collect(cfg, timeout=120)
    assert digest(got) == _reference_digest(cfg)
    # actors start as they are placed: the first may serve before the second is up
    wait_until(lambda: "2 workers on 2 node(s)" in _ray_status(buf).get("state", ""), 60, "both workers connected")
    assert d.stop() == 0
    assert "remote workers ready; stopping the local stand-ins" in d.log()



def test_ray_executor_makes_the_validation_stream_too(tmp_path, image_root, val_image_root, daemon_factory, cluster):
    import numpy as np
    from prefetchd_client import PrefetchClient
    from test_validation import read_pass, val_reference

    c, _ = cluster
    cfg = small_config(tmp_path, image_root, workers={"executor": "ray", "ray": {"address": c.loopback_address,
                                                                                 "workers": 2, **LOOP}},
                       validation={"enabled": True, "root": val_image_root, "batch_size": 5})
    buf = str(tmp_path / "buffer")
    d = daemon_factory(cfg)
    wait_until(lambda: _ray_status(buf).get("state", "").startswith("connected"), 120, "a connected status")
    with PrefetchClient(cfg, split="val", as_numpy=True, timeout=120) as v:
        got = read_pass(v)
    ref = val_reference(cfg, 0)
    assert len(got) == len(ref) == 10  # 48 samples in batches of 5: the last one has 3
    for (x, y, i), (rx, ry, ri) in zip(got, ref, strict=True):
        assert np.array_equal(x, rx) and np.array_equal(y, ry) and np.array_equal(i, ri)
    assert d.stop() == 0

def test_killed_ray_worker_means_retried_work_not_lost_batches(tmp_path, image_root, daemon_factory, cluster):
    c, _ = cluster
    cfg = small_config(tmp_path, image_root, workers={"executor": "ray", "max_tasks_in_flight": 1,
                                                      "ray": {"address": c.loopback_address, "workers": 2, **LOOP}},
                       loader={"epochs": 2}, buffer={"capacity": 2, "refill_at": 2})
    buf = str(tmp_path / "buffer")
    d = daemon_factory(cfg)
    st = wait_until(lambda: _ray_status(buf).get("where") and _ray_status(buf), 120, "remote workers")
    pid = int(st["where"][0].split(":")[1])
    import numpy as np
    from prefetchd_client import PrefetchClient

    got = {}
    with PrefetchClient(cfg, timeout=120, as_numpy=True) as cl:
        for e in (0, 1):
            for b, (x, y) in enumerate(cl.iter_epoch(e)):
                got[(0, e, b)] = (np.ascontiguousarray(x.transpose(0, 2, 3, 1)), y.copy())
                if (e, b) == (0, 1):
                    os.kill(pid, signal.SIGKILL)  # an actor process dies mid-run
    assert digest(got) == _reference_digest(cfg)
    assert d.stop() == 0


def test_a_storage_outage_on_the_cluster_waits_for_the_storage_and_keeps_the_actors(tmp_path, daemon_factory,
                                                                                     cluster):
    """A batch that meets an unreadable root on an actor is the storage's, not the actor's: no batch
    lost, no actor dropped; the batches are made once the root is back, byte for byte."""
    import shutil
    import time

    import numpy as np
    from prefetchd_client import PrefetchClient

    from prefetchd.tools.samples import make_image_folder

    c, _ = cluster
    root = tmp_path / "root"
    make_image_folder(str(root), classes=4, per_class=12, seed=3, long_side=160)
    cfg = small_config(tmp_path, str(root), workers={"executor": "ray", "ray": {"address": c.loopback_address,
                                                                               "workers": 2, **LOOP}},
                       buffer={"capacity": 2, "refill_at": 2})
    buf = str(tmp_path / "buffer")
    ref = _reference_digest(cfg)
    d = daemon_factory(cfg)
    wait_until(lambda: "stopping the local stand-ins" in d.log(), 120, "the remote workers taking over")
    wait_until(lambda: _ray_status(buf).get("workers") == 2, 120, "both actors up (they start one by one)")
    got = {}
    try:
        with PrefetchClient(cfg, timeout=120, as_numpy=True) as cl:
            for e in (0, 1):
                for b, (x, y) in enumerate(cl.iter_epoch(e)):
                    got[(0, e, b)] = (np.ascontiguousarray(x.transpose(0, 2, 3, 1)), y.copy())
                    if (e, b) == (0, 1):  # the storage goes away while the actors make the next batches
                        os.rename(root, str(root) + ".away")
                        time.sleep(3)  # the fault itself: the root gone for this long
                        os.rename(str(root) + ".away", root)
    finally:
        if not root.exists():
            os.rename(str(root) + ".away", root)
    assert digest(got) == ref
    st = _ray_status(buf)
    assert st["workers"] == 2 and st["lost_batches"] == 0, st
    assert d.stop() == 0
    log = d.log()
    assert "was lost" not in log and "dropping it" not in log, log
    assert f"the dataset root {root} is unreadable" in log and "the dataset root is readable again" in log, log
    shutil.rmtree(root)


def test_mixed_executor_and_node_loss(tmp_path, image_root, daemon_factory, cluster):
    c, worker = cluster
    cfg = small_config(tmp_path, image_root, workers={"executor": "mixed", "count": 1,
                                                      "ray": {"address": c.loopback_address, "workers": 2, **LOOP}},
                       loader={"epochs": 3})
    buf = str(tmp_path / "buffer")
    d = daemon_factory(cfg)
    wait_until(lambda: "2 workers on 2 node(s)" in _ray_status(buf).get("state", ""), 120, "both actors up")
    dead = worker.node_id[:12]
    assert any(w.startswith(dead) for w in _ray_status(buf)["where"])
    c.remove_node(worker)  # a whole node goes away: its actor restarts on the head
    got = collect(cfg, epochs=(0, 1, 2), timeout=180)
    ref, _ = reference_batches(cfg, epochs=3)
    assert digest(got) == digest({k: v[:2] for k, v in ref.items()})
    # the status follows: the dead node's actor is said where it runs now
    st = wait_until(lambda: (s := _ray_status(buf)).get("workers") == 2 and not any(w.startswith(dead) for w in s["where"])
                    and s, 60, "the status without the dead node")
    assert "2 workers on 1 node(s)" in st["state"], st
    assert d.stop() == 0
    cluster[0].add_node(**NODE)  # give the module's later tests their second node back


def test_unreachable_cluster_means_local_workers_and_a_status_saying_so(tmp_path, image_root, daemon_factory):
    cfg = small_config(tmp_path, image_root, workers={"executor": "ray", "ray": {"address": "127.0.0.1:9",
                                                                                  "connect_timeout_s": 5, **LOOP}})
    buf = str(tmp_path / "buffer")
    d = daemon_factory(cfg)
    got = collect(cfg, timeout=120)
    assert digest(got) == _reference_digest(cfg)
    st = wait_until(lambda: "unavailable" in _ray_status(buf).get("state", "") and _ray_status(buf), 120,
                    "an unavailable status")
    assert "cannot reach the Ray cluster at 127.0.0.1:9" in st["state"] and "local workers" in st["state"]
    assert d.stop() == 0


def test_dataset_not_readable_on_the_cluster_is_said_clearly(tmp_path, image_root, daemon_factory, cluster):
    c, _ = cluster
    cfg = small_config(tmp_path, image_root, workers={"executor": "ray", "ray": {
        "address": c.loopback_address, "workers": 1, "path_map": {image_root: "/nonexistent/imagenet"}, "retry_s": 1,
        **LOOP}})
    buf = str(tmp_path / "buffer")
    d = daemon_factory(cfg)
    got = collect(cfg, timeout=120)  # made locally meanwhile
    assert len(got) == 16
    st = wait_until(lambda: "unavailable" in _ray_status(buf).get("state", "") and _ray_status(buf), 120,
                    "an unavailable status")
    assert "cannot read the dataset" in st["state"] and "/nonexistent/imagenet" in st["state"]
    wait_until(lambda: _ray_status(buf)["bridge"]["starts"] >= 3, 120, "three tries")
    assert d.stop() == 0
    assert d.log().count("cannot read the dataset") == 1, d.log()  # said once, not at every retry_s
    assert not _live_actors(c)


def test_a_cluster_that_comes_up_later_is_joined(tmp_path, image_root, daemon_factory):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = small_config(tmp_path, image_root, loader={"epochs": None}, workers={"executor": "ray", "ray": {
        "address": f"127.0.0.1:{port}", "workers": 1, "connect_timeout_s": 5, "retry_s": 2, **LOOP}})
    buf = str(tmp_path / "buffer")
    d = daemon_factory(cfg)
    st = wait_until(lambda: "unavailable" in _ray_status(buf).get("state", "") and _ray_status(buf), 60, "unavailable")
    assert "trying again every 2 s" in st["state"]
    late = ray_cluster_utils.Cluster(initialize_head=True, head_node_args={**NODE, "gcs_server_port": port})
    try:
        wait_until(lambda: _ray_status(buf).get("state", "").startswith("connected"), 120, "the late cluster joined")
        got = collect(cfg, epochs=(0,), timeout=120)
        ref, _ = reference_batches(cfg, epochs=1)
        assert digest(got) == digest({k: v[:2] for k, v in ref.items()})
        assert d.stop() == 0
    finally:
        late.shutdown()


def test_ray_workers_make_compact_batches_byte_for_byte_as_local_ones(tmp_path, image_root, daemon_factory, cluster):
    """augment.decode: gpu on Ray: the actor packs the compact batch, the daemon writes and
    publishes it; the client (CPU stand-in decoder) sees what the in-process worker makes."""
    import numpy as np
    from prefetchd_client import PrefetchClient
    from test_hybrid_daemon import CountingDecoder, _reference

    c, _ = cluster
    cfg = small_config(tmp_path, image_root, augment={"decode": "gpu"},
                       workers={"executor": "ray", "ray": {"address": c.loopback_address, "workers": 2, **LOOP}})
    buf = str(tmp_path / "buffer")
    d = daemon_factory(cfg)
    # connected before the trainer reads: all but the first ring's worth are made on the cluster
    wait_until(lambda: _ray_status(buf).get("state", "").startswith("connected"), 120, "a connected status")
    ref = _reference(cfg)
    with PrefetchClient(cfg, timeout=120, as_numpy=True, decoder=CountingDecoder()) as cl:
        for e in (0, 1):
            for b, (x, y) in enumerate(cl.iter_epoch(e)):
                assert np.array_equal(np.ascontiguousarray(x.transpose(0, 2, 3, 1)), ref[(e, b)][0]), (e, b)
                assert np.array_equal(y, ref[(e, b)][1]), (e, b)
    assert d.stop() == 0
    assert "Traceback" not in d.log()


def _read(cfg: str, epochs, got: dict, at=None, fault=None) -> None:
    """Read ``epochs`` as a trainer does into ``got``; ``fault()`` once batch ``at`` is read."""
    import numpy as np
    from prefetchd_client import PrefetchClient

    with PrefetchClient(cfg, timeout=60, as_numpy=True) as cl:
        for e in epochs:
            for b, (x, y) in enumerate(cl.iter_epoch(e)):
                got[(0, e, b)] = (np.ascontiguousarray(x.transpose(0, 2, 3, 1)), y.copy())
                if (e, b) == at:
                    fault()


def test_the_head_killed_mid_stream_leaves_the_daemon_serving_and_it_rejoins_the_restarted_head(
        tmp_path, image_root, daemon_factory, ray_temp_dir):
    """SIGKILL of the head's GCS and raylet (Ray then ends its driver): the daemon stays up, the
    trainer reads on without a timeout, the stream is byte-identical to a local-only one; a head
    started again on the same port (the address in the config) is used again within retry_s."""
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    head_args = {**NODE, "gcs_server_port": port, "temp_dir": ray_temp_dir}
    retry_s = 3
    cfg = small_config(tmp_path, image_root, loader={"epochs": 6}, buffer={"capacity": 2, "refill_at": 2},
                       workers={"executor": "ray", "ray": {"address": f"127.0.0.1:{port}", "workers": 2,
                                                           "connect_timeout_s": 5, "retry_s": retry_s, **LOOP}})
    buf = str(tmp_path / "buffer")
    ref, _ = reference_batches(cfg, epochs=6)
    old = ray_cluster_utils.Cluster(initialize_head=True, head_node_args=head_args)
    new = None
    try:
        old.add_node(**NODE, temp_dir=ray_temp_dir)  # its actor lives on after the head: the driver still waits on it
        old.wait_for_nodes()
        d = daemon_factory(cfg)
        wait_until(lambda: "2 workers on 2 node(s)" in _ray_status(buf).get("state", ""), 120, "both actors up")

        def kill_head():
            old.head_node.kill_gcs_server()
            old.head_node.kill_raylet()

        got: dict = {}
        _read(cfg, (0, 1, 2), got, at=(0, 2), fault=kill_head)
        assert d.proc.poll() is None
        st = wait_until(lambda: _ray_status(buf).get("state", "").startswith("unavailable") and _ray_status(buf), 30,
                        "the lost cluster said")
        assert "local workers" in st["state"] and f"trying again every {retry_s} s" in st["state"], st
        time.sleep(2 * retry_s)  # tries that fail while the head is down: not said again
        said = [line for line in d.log().splitlines() if " WARNING " in line and "ray: unavailable" in line]
        assert len(said) == 1 and ("lost the Ray cluster" in said[0] or "the Ray bridge" in said[0]), said
        new = ray_cluster_utils.Cluster(initialize_head=True, head_node_args=head_args)  # the same port, free again
        t0 = time.monotonic()
        # used again = the local stand-ins stopped again: every actor up, or some for the partial
        # grace (10 s) while the old node's raylet rejoins; a first actor alone is not that yet
        wait_until(lambda: d.log().count("stopping the local stand-ins") >= 2, retry_s + 60,
                   "the restarted head used again")
        rejoined_s = time.monotonic() - t0
        _read(cfg, (3, 4, 5), got)
        assert digest(got) == digest({k: v[:2] for k, v in ref.items()})
        assert d.stop() == 0
        log = d.log()
        print(f"rejoined {rejoined_s:.1f} s after the new head was up (retry_s {retry_s})")
        assert "Traceback" not in log and "SIGTERM" not in log and "PrefetchTimeout" not in log, log
        assert log.count("stopping the local stand-ins") >= 2, log  # served by the new head at the end
        # one line per kind of loss while no worker is ready, not one per resubmitted batch (issue 41)
        lost = [line for line in log.splitlines() if "was lost" in line and " DEBUG " not in line]
        assert len(lost) <= 4, f"{len(lost)} lines of lost batches: {lost[:5]}"
        assert not _live_actors(new)
    finally:
        for c in (new, old):
            if c is not None:
                try:
                    c.shutdown()
                except Exception:  # the killed head's processes are gone already
                    pass


def test_actors_no_node_can_host_are_never_created_and_the_missing_resource_is_said_once(
        tmp_path, image_root, daemon_factory, cluster):
    c, _ = cluster
    cfg = small_config(tmp_path, image_root, workers={"executor": "ray", "ray": {
        "address": c.loopback_address, "workers": 2, "resources": {"preprocess": 1}, "retry_s": 1, **LOOP}})
    buf = str(tmp_path / "buffer")
    d = daemon_factory(cfg)
    assert digest(collect(cfg, timeout=120)) == _reference_digest(cfg)  # made locally
    st = wait_until(lambda: _ray_status(buf).get("bridge", {}).get("starts", 0) >= 3 and _ray_status(buf), 120,
                    "three tries")
    assert "no node has resource 'preprocess' (workers.ray.resources.preprocess: 1)" in st["state"], st
    assert "local workers" in st["state"] and "no answer" not in st["state"], st
    assert not _live_actors(c)  # none created, none pending
    assert d.stop() == 0
    log = d.log()
    assert log.count("no node has resource 'preprocess'") == 1, log  # said once, not at every try
    assert "ActorDiedError" not in log and "SIGTERM" not in log, log


def test_two_daemons_on_a_full_cluster_start_with_what_can_be_placed_and_take_the_rest_later(
        tmp_path, image_root, daemon_factory, cluster):
    """4 CPUs: A takes 3; B gets 1 of its 2 at once and serves with it; the other is placed when
    A stops. Stopping leaves nothing of either in the actor table."""
    c, _ = cluster
    ta, tb = tmp_path / "a", tmp_path / "b"
    ta.mkdir()
    tb.mkdir()
    ray_a = {"executor": "ray", "ray": {"address": c.loopback_address, "workers": 3, **LOOP}}
    cfg_a = small_config(ta, image_root, loader={"epochs": None}, workers=ray_a)
    cfg_b = small_config(tb, image_root, workers={"executor": "ray", "ray": {"address": c.loopback_address,
                                                                            "workers": 2, **LOOP}})
    a = daemon_factory(cfg_a)
    wait_until(lambda: _ray_status(str(ta / "buffer")).get("workers") == 3, 120, "A's three actors")
    b = daemon_factory(cfg_b)
    buf_b = str(tb / "buffer")
    st = wait_until(lambda: _ray_status(buf_b).get("workers") and _ray_status(buf_b), 120, "B's first actor")
    assert st["workers"] == 1 and "1 more starting (or waiting for a node with free {CPU: 1}" in st["state"], st
    assert digest(collect(cfg_b, timeout=120)) == _reference_digest(cfg_b)
    live = _live_actors(c)
    assert sorted(a["State"] for a in live) == ["ALIVE"] * 4 + ["PENDING_CREATION"], live  # B's second waits
    assert a.stop() == 0
    wait_until(lambda: _ray_status(buf_b).get("workers") == 2, 120, "B's second actor placed once A is gone")
    assert b.stop() == 0
    assert wait_until(lambda: not _live_actors(c), 30, "an empty actor table")
    for log in (a.log(), b.log()):
        assert "ActorDiedError" not in log and "SIGTERM" not in log and "Traceback" not in log, log


@pytest.mark.parametrize("fault", [signal.SIGSTOP, signal.SIGKILL])
def test_a_bridge_hung_or_killed_mid_stream_leaves_local_workers_serving_and_a_new_bridge(
        tmp_path, image_root, daemon_factory, cluster, fault):
    """The bridge itself (not the head) stopped (SIGSTOP: it holds its batches and says nothing)
    or SIGKILLed while the trainer reads: its batches are made again, the stream stays identical,
    a new bridge takes over, and the old one's actors leave the actor table. A stopped bridge
    used to hold its batches for ever (the trainer timed out)."""
    import psutil

    c, _ = cluster
    cfg = small_config(tmp_path, image_root, loader={"epochs": 3}, buffer={"capacity": 2, "refill_at": 2},
                       workers={"executor": "ray", "task_timeout_s": 5,
                                "ray": {"address": c.loopback_address, "workers": 2, "retry_s": 2, **LOOP}})
    buf = str(tmp_path / "buffer")
    d = daemon_factory(cfg)
    wait_until(lambda: _ray_status(buf).get("workers") == 2, 120, "both actors up")
    old = _ray_status(buf)["bridge"]["pid"]
    got: dict = {}
    try:
        _read(cfg, (0, 1, 2), got, at=(0, 1), fault=lambda: os.kill(old, fault))
        ref, _ = reference_batches(cfg, epochs=3)
        assert digest(got) == digest({k: v[:2] for k, v in ref.items()})
        assert d.proc.poll() is None
        assert not psutil.pid_exists(old) or psutil.Process(old).status() == psutil.STATUS_ZOMBIE
        st = wait_until(lambda: (s := _ray_status(buf)).get("workers") == 2 and s["bridge"]["pid"] != old and s,
                        120, "a new bridge with both actors")
        assert st["bridge"]["starts"] >= 2, st
        assert d.stop() == 0
        assert wait_until(lambda: not _live_actors(c), 60, "an empty actor table")
        log = d.log()
        if fault == signal.SIGSTOP:
            assert "without an answer (workers.task_timeout_s 5); killed it" in log, log
        assert "Traceback" not in log, log
    finally:
        if psutil.pid_exists(old):
            os.kill(old, signal.SIGKILL)


def test_sigterm_to_the_daemons_group_leaves_the_ray_bridge_to_the_daemon(tmp_path, image_root, daemon_factory,
                                                                           cluster):
    """``scancel`` or ``kill -TERM -PGID`` with ``executor: ray``: the bridge, in the daemon's group,
    died of the signal, and the daemon's loop said a lost cluster and started a new bridge during
    its stop. Born with the group's stop signals blocked, it is the daemon's to stop."""
    c, _ = cluster
    cfg = small_config(tmp_path, image_root, workers={"executor": "ray", "ray": {"address": c.loopback_address,
                                                                                 "workers": 2, **LOOP}},
                       loader={"epochs": None}, buffer={"capacity": 40, "refill_at": 39})
    buf = str(tmp_path / "buffer")
    d = daemon_factory(cfg)
    st = wait_until(lambda: _ray_status(buf).get("where") and _ray_status(buf), 120, "remote workers")
    bridge = st["bridge"]["pid"]
    with open(f"/proc/{bridge}/status") as f:
        blocked = int(next(ln for ln in f if ln.startswith("SigBlk")).split()[1], 16)
    assert all(blocked >> (s - 1) & 1 for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)), hex(blocked)
    os.killpg(d.pid, signal.SIGTERM)
    wait_until(lambda: d.proc.poll() is not None, 60, "the daemon to stop")
    log = d.log()
    assert d.proc.returncode == 0, log
    assert " ERROR " not in log and "ray: unavailable" not in log, log
    assert (status.read_json(buf, status.STATUS_NAME) or {})["ray"]["bridge"]["starts"] == 1
