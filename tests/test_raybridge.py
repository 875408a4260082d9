"""The Ray bridge's pure parts: whether a worker can be placed at all, and what to say if not."""

from __future__ import annotations

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
