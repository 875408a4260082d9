"""examples/kubernetes: the pod parses as the Kubernetes API's Pod (the official client's models),
and agrees with its prefetchd config: paths, volumes and their sizes, users, commands, memory.
The startup probe's command is run against the real daemon."""

from __future__ import annotations

import inspect
import json
import os
import pathlib
import subprocess
import sys

import pytest
import yaml
from conftest import DaemonProc, small_config, wait_until

from prefetchd.core.config import load as load_config
from prefetchd.format import batchfile

k8s = pytest.importorskip("kubernetes", reason="the dev extra's kubernetes client is not installed")
from kubernetes.client import ApiClient, V1Pod  # noqa: E402
from kubernetes.utils import parse_quantity  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "kubernetes"
CONFIG = "/etc/prefetchd/train.yaml"  # where the pod mounts the config
_WORKER_BYTES = 60 * 2**20  # README, "Run it as a service": about 60 MB per worker, plus a batch array


class _Response:  # what ApiClient.deserialize read before kubernetes 34: a response with the body in .data
    def __init__(self, doc: dict):
        self.data = json.dumps(doc)


def _deserialize(doc: dict, kind: str):
    """The client's own JSON -> model path, as for an API server's answer."""
    api = ApiClient()
    if "content_type" in inspect.signature(api.deserialize).parameters:  # the newer generator's
        return api.deserialize(json.dumps(doc), kind, "application/json")
    return api.deserialize(_Response(doc), kind)


@pytest.fixture(scope="module")
def doc() -> dict:
    return yaml.safe_load((EXAMPLE / "pod.yaml").read_text())


@pytest.fixture(scope="module")
def pod(doc) -> V1Pod:
    return _deserialize(doc, "V1Pod")


@pytest.fixture(scope="module")
def cfg():
    return load_config(str(EXAMPLE / "train.yaml"))


def _exec(probe) -> list[str]:
    return (getattr(probe, "var_exec", None) or probe._exec).command  # the field's name by client version


def _under(path: str, mount: str) -> bool:
    return path == mount or path.startswith(mount.rstrip("/") + "/")


def _mounts(container) -> dict[str, str]:
    return {m.name: m.mount_path for m in container.volume_mounts}


def test_the_manifest_is_a_pod_of_the_api_with_no_unknown_or_misspelt_key(doc, pod):
    assert isinstance(pod, V1Pod) and pod.kind == "Pod"
    # the models drop what they do not know: a round trip equal to the file means every key is the API's
    assert ApiClient().sanitize_for_serialization(pod) == doc
    bad = json.loads(json.dumps(doc))
    bad["spec"]["initContainers"][0]["restartPolicyy"] = "Always"
    assert ApiClient().sanitize_for_serialization(_deserialize(bad, "V1Pod")) != bad  # the check sees a typo


def test_the_daemon_is_a_native_sidecar_and_its_startup_probe_gates_the_trainer(pod):
    (side,) = pod.spec.init_containers
    assert side.restart_policy == "Always"
    assert side.command == ["prefetchd", "run", "--config", CONFIG]
    assert _exec(side.startup_probe) == ["prefetchd", "status", "--config", CONFIG, "--ready"]
    assert _exec(side.readiness_probe)[:4] == ["prefetchd", "status", "--config", CONFIG]
    (trainer,) = pod.spec.containers
    assert {e.name: e.value for e in trainer.env}["PREFETCHD_CONFIG"] == CONFIG
    for c in (side, trainer):
        assert _under(CONFIG, _mounts(c)["config"])


def test_ring_and_progress_are_memory_emptydirs_that_hold_what_the_config_asks(pod, cfg):
    vols = {v.name: v for v in pod.spec.volumes}
    ring, progress = vols["ring"].empty_dir, vols["progress"].empty_dir
    assert ring.medium == "Memory" and progress.medium == "Memory"
    assert parse_quantity(ring.size_limit) >= cfg.buffer.max_bytes + cfg.buffer.min_free_bytes
    assert parse_quantity(progress.size_limit) <= 64 * 2**20  # small: a few KiB per rank
    for c in (*pod.spec.init_containers, *pod.spec.containers):
        m = _mounts(c)
        # the daemon makes its directories inside the mounts (a mount point is root's, not the daemon's)
        assert _under(cfg.buffer.dir, m["ring"]) and cfg.buffer.dir != m["ring"]
        assert _under(cfg.progress_dir, m["progress"]) and cfg.progress_dir != m["progress"]
    side = _mounts(pod.spec.init_containers[0])
    assert _under(cfg.dataset.root, side["dataset"]) and _under(cfg.dataset.cache_dir, side["cache"])


def test_both_containers_run_as_one_non_root_user_and_group(pod, cfg):
    sc = pod.spec.security_context
    assert sc.run_as_non_root and sc.run_as_user not in (None, 0) and sc.run_as_group not in (None, 0)
    for c in (*pod.spec.init_containers, *pod.spec.containers):
        assert c.security_context.run_as_user is None and c.security_context.run_as_group is None  # the pod's
        assert c.security_context.allow_privilege_escalation is False
        assert c.security_context.capabilities.drop == ["ALL"]
    assert cfg.buffer.group is None  # one user: its directories stay private to it


def test_the_sidecars_memory_limit_holds_the_ring_and_the_workers(pod, cfg):
    """tmpfs pages are charged to the container that writes them: the daemon's."""
    side = pod.spec.init_containers[0]
    s = cfg.augment.output_size
    need = cfg.buffer.max_bytes + cfg.workers.resolved_count() * (
        _WORKER_BYTES + batchfile.max_file_size(cfg.loader.batch_size, s, s))
    limit = parse_quantity(side.resources.limits["memory"])
    assert limit >= need, f"{limit} < {need}"
    assert side.resources.requests == side.resources.limits  # not the first to be evicted
    assert parse_quantity(side.resources.limits["cpu"]) == cfg.workers.resolved_count()


def test_the_trainer_runs_every_rank_the_config_serves(pod, cfg):
    cmd = pod.spec.containers[0].command
    nproc = int(cmd[cmd.index("--nproc-per-node") + 1])
    assert nproc == cfg.loader.world_size and list(cfg.loader.ranks) == list(range(nproc))
    assert parse_quantity(pod.spec.containers[0].resources.limits["nvidia.com/gpu"]) == nproc


def test_the_startup_probe_answers_3_then_0_once_the_daemon_has_batches(tmp_path, image_root, pod):
    config = small_config(tmp_path, image_root)
    probe = [a if a != CONFIG else config for a in _exec(pod.spec.init_containers[0].startup_probe)]

    def run_probe() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "prefetchd", *probe[1:]], capture_output=True, text=True,
                              timeout=60)

    first = run_probe()
    assert first.returncode == 3 and first.stdout.startswith("not running"), first
    d = DaemonProc(config, str(tmp_path / "daemon.log"))
    try:
        done = wait_until(lambda: (p := run_probe()).returncode == 0 and p, 60, "the probe to pass")
        assert done.stdout.startswith("ready")
    finally:
        assert d.stop() == 0
    assert os.path.isdir(tmp_path / "buffer")
