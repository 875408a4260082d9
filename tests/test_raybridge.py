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

    from prefetchd.core.dataset import load_index
    from prefetchd.core.tarindex import TarIndex
    from prefetchd.executors.raybridge import remote_setup
    from prefetchd.executors.worker import WorkerSetup

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


def test_a_local_ray_cluster_is_refused_with_the_key():
    """``address: local`` made each bridge start its own Ray cluster; a bridge killed (hung, or
    stopped while starting) left that cluster's agents and actor processes running, orphaned."""
    from prefetchd.core.config import ConfigError

    for address in ("local", " Local "):
        with pytest.raises(ConfigError, match=r"workers.ray.address.*'local' would start a Ray cluster"):
            RayConfig(address=address)
    assert RayConfig(address="auto").address == "auto"
