"""examples/kubernetes: the pod (pod.yaml) and the Indexed Job with its headless Service
(indexed-job.yaml) parse as the Kubernetes API's Pod, Job and Service (the official client's
models), and agree with their prefetchd config: paths, volumes and their sizes, users, commands,
memory, CPU requests that keep the ranks first, probes with real timeouts. The startup and
liveness probes' commands are run against the real daemon, the Job's sidecar line writes each
node's config, and a trainer of another uid, or root without capabilities, reads the ring through
the pod's fsGroup while one outside it cannot."""

from __future__ import annotations

import inspect
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import yaml
from conftest import DaemonProc, small_config, wait_until

from prefetchd.core.config import load as load_config
from prefetchd.format import batchfile, status

k8s = pytest.importorskip("kubernetes", reason="the dev extra's kubernetes client is not installed")
from kubernetes.client import ApiClient, V1Job, V1Pod, V1Service  # noqa: E402
from kubernetes.utils import parse_quantity  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "kubernetes"
CONFIG = "/etc/prefetchd/train.yaml"  # where the pod mounts the config
PROBE_TIMEOUT_S = 5  # a Python start on a busy node: the kubelet's default 1 s counts it as a failure
_WORKER_BYTES = 60 * 2**20  # docs/systemd.md: about 60 MB per worker, plus a batch array


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
def job_docs() -> dict:
    return {d["kind"]: d for d in yaml.safe_load_all((EXAMPLE / "indexed-job.yaml").read_text())}


@pytest.fixture(scope="module")
def job(job_docs) -> V1Job:
    return _deserialize(job_docs["Job"], "V1Job")


@pytest.fixture(scope="module")
def specs(pod, job) -> list:
    """The pod specs of both shapes: one pod (pod.yaml), a pod per node (indexed-job.yaml)."""
    return [pod.spec, job.spec.template.spec]


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


def test_ring_and_progress_are_memory_emptydirs_that_hold_what_the_config_asks(specs, cfg):
    for spec in specs:
        vols = {v.name: v for v in spec.volumes}
        ring, progress = vols["ring"].empty_dir, vols["progress"].empty_dir
        assert ring.medium == "Memory" and progress.medium == "Memory"
        assert parse_quantity(ring.size_limit) >= cfg.buffer.max_bytes + cfg.buffer.min_free_bytes
        assert parse_quantity(progress.size_limit) <= 64 * 2**20  # small: a few KiB per rank
        for c in (*spec.init_containers, *spec.containers):
            m = _mounts(c)
            # the daemon makes its directories inside the mounts (a mount point is root's, not the daemon's)
            assert _under(cfg.buffer.dir, m["ring"]) and cfg.buffer.dir != m["ring"]
            assert _under(cfg.progress_dir, m["progress"]) and cfg.progress_dir != m["progress"]
        side = _mounts(spec.init_containers[0])
        assert _under(cfg.dataset.root, side["dataset"]) and _under(cfg.dataset.cache_dir, side["cache"])


def test_the_daemon_runs_as_a_non_root_user_and_the_trainer_as_its_image_says_through_fs_group(specs, cfg):
    """The trainer image's user, root or any uid, reads the ring through the group the pod's
    fsGroup gives every container and buffer.group names: the daemon's own group."""
    for spec in specs:
        (side,), (trainer,) = spec.init_containers, spec.containers
        sc = side.security_context
        assert sc.run_as_non_root and sc.run_as_user not in (None, 0) and sc.run_as_group not in (None, 0)
        assert trainer.security_context.run_as_user is None and trainer.security_context.run_as_group is None
        assert spec.security_context.run_as_user is None and spec.security_context.run_as_non_root is None
        assert cfg.buffer.group == str(spec.security_context.fs_group) == str(sc.run_as_group)
        for c in (side, trainer):
            assert c.security_context.allow_privilege_escalation is False
            assert c.security_context.capabilities.drop == ["ALL"]


def test_the_sidecars_memory_limit_holds_the_ring_and_the_workers(specs, cfg):
    """tmpfs pages are charged to the container that writes them: the daemon's."""
    s = cfg.augment.output_size
    need = cfg.buffer.max_bytes + cfg.workers.resolved_count() * (
        _WORKER_BYTES + batchfile.max_file_size(cfg.loader.batch_size, s, s))
    for spec in specs:
        side = spec.init_containers[0]
        limit = parse_quantity(side.resources.limits["memory"])
        assert limit >= need, f"{limit} < {need}"
        assert side.resources.requests["memory"] == side.resources.limits["memory"]  # not the first to be evicted
        assert parse_quantity(side.resources.limits["cpu"]) == cfg.workers.resolved_count()


def test_cpu_requests_keep_the_ranks_first(specs, cfg):
    """A busy node's CPUs go to containers by their requests (cgroup weights): the trainer's must
    outweigh the daemon's, whose workers' idle priority orders processes only inside its cgroup."""
    for spec in specs:
        (side,), (trainer,) = spec.init_containers, spec.containers
        ranks = len(cfg.loader.ranks)
        want = parse_quantity(trainer.resources.requests["cpu"])
        assert want >= ranks, "a CPU per rank at least"
        assert "cpu" not in (trainer.resources.limits or {}), "a CPU limit throttles the ranks"
        # the whole daemon weighs at most as much as one rank, and may use idle CPUs up to workers.count
        assert parse_quantity(side.resources.requests["cpu"]) <= want / ranks
        assert parse_quantity(side.resources.requests["cpu"]) < parse_quantity(side.resources.limits["cpu"])


def test_every_probe_has_a_real_timeout_and_a_liveness_probe_replaces_the_watchdog(specs):
    for spec in specs:
        (side,) = spec.init_containers
        config = _exec(side.startup_probe)[3]
        probes = {"startup": side.startup_probe, "liveness": side.liveness_probe, "readiness": side.readiness_probe}
        for name, probe in probes.items():
            assert probe is not None, name
            assert (probe.timeout_seconds or 1) >= PROBE_TIMEOUT_S, f"{name}: the default 1 s outlasts no Python start"
            assert probe.period_seconds >= probe.timeout_seconds / 2
        assert _exec(side.liveness_probe) == ["prefetchd", "status", "--config", config, "--live"]
        # stuck --live-after (30 s) plus the failures the kubelet waits for: about the unit's WatchdogSec=60
        live = side.liveness_probe
        assert 30 <= status.LIVE_AFTER_S + live.period_seconds * live.failure_threshold <= 120


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


def test_the_liveness_probe_answers_3_then_0_and_1_once_the_daemon_hangs(tmp_path, image_root, pod):
    config = small_config(tmp_path, image_root)
    live = pod.spec.init_containers[0].liveness_probe
    probe = [a if a != CONFIG else config for a in _exec(live)]

    def run_probe(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "prefetchd", *probe[1:], *extra], capture_output=True,
                              text=True, timeout=60)

    first = run_probe()
    assert first.returncode == 3 and first.stdout.startswith("not running"), first
    d = DaemonProc(config, str(tmp_path / "daemon.log"))
    try:
        wait_until(lambda: run_probe().stdout.startswith("live: "), 60, "the probe to pass")
        t0 = time.monotonic()
        assert run_probe().returncode == 0
        took = time.monotonic() - t0
        assert took < live.timeout_seconds / 2, f"the probe took {took:.1f} s of its {live.timeout_seconds} s"
        os.kill(d.pid, signal.SIGSTOP)  # the daemon's loop hangs: status.json is no longer rewritten
        try:
            hung = wait_until(lambda: (p := run_probe("--live-after", "2")).returncode == 1 and p, 30,
                              "the probe to fail")
            assert "has not rewritten status.json" in hung.stdout, hung
        finally:
            os.kill(d.pid, signal.SIGCONT)
        wait_until(lambda: run_probe("--live-after", "2").returncode == 0, 30, "the probe to pass again")
    finally:
        assert d.stop() == 0


@pytest.mark.parametrize("rec, alive, want", [
    (None, False, (3, "not running")),
    (None, True, (0, "starting")),
    ({"pid": 99, "updated": 100.0}, True, (0, "starting")),  # the last daemon's status: not this one's yet
    ({"pid": 42, "updated": 100.0, "stuck_s": 0.0}, True, (0, "live")),
    ({"pid": 42, "updated": 100.0, "stuck_s": 29.0}, True, (0, "live")),
    ({"pid": 42, "updated": 100.0, "stuck_s": 31.0}, True, (1, "not live: pid 42 has had batches in the making")),
    ({"pid": 42, "updated": 60.0, "stuck_s": 0.0}, True, (1, "not live: pid 42 has not rewritten status.json")),
])
def test_liveness_is_the_watchdogs_rule(rec, alive, want):
    code, line = status.liveness(rec, alive, 42, now=110.0)
    assert (code, line[:len(want[1])]) == want, line


def test_the_status_text_names_a_pipeline_that_makes_nothing():
    rec = {"pid": 9, "state": "running", "updated": time.time(), "stuck_s": 12.0, "ranks": {}}
    assert "; batches in the making, none made for 12 s (status --live fails after 30 s)" in \
        status.format_status(rec, True)
    assert "in the making" not in status.format_status({**rec, "stuck_s": 1.0}, True)


def test_the_indexed_job_and_its_service_are_the_apis_with_no_unknown_key(job_docs, job):
    assert ApiClient().sanitize_for_serialization(job) == job_docs["Job"]
    svc = _deserialize(job_docs["Service"], "V1Service")
    assert isinstance(svc, V1Service) and ApiClient().sanitize_for_serialization(svc) == job_docs["Service"]


def test_the_indexed_job_runs_one_pod_per_node_named_by_a_headless_service(job_docs, job):
    svc = _deserialize(job_docs["Service"], "V1Service")
    s, tpl = job.spec, job.spec.template
    assert s.completion_mode == "Indexed" and s.completions == s.parallelism
    assert svc.spec.cluster_ip == "None" and svc.spec.publish_not_ready_addresses
    assert svc.spec.selector.items() <= tpl.metadata.labels.items()
    assert tpl.spec.subdomain == svc.metadata.name
    (side,), (trainer,) = tpl.spec.init_containers, tpl.spec.containers
    for c in (side, trainer):
        env = {e.name: e for e in c.env}
        assert int(env["NNODES"].value) == s.completions
        assert env["NODE_RANK"].value_from.field_ref.field_path == \
            "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    cmd = trainer.command
    assert cmd[:cmd.index("--nproc-per-node") + 2] == [
        "torchrun", "--nnodes", "$(NNODES)", "--node-rank", "$(NODE_RANK)", "--nproc-per-node", "$(NPROC_PER_NODE)"]
    # an Indexed Job's pod <job>-<index> in the Service's subdomain: node 0 is the rendezvous
    assert cmd[cmd.index("--master-addr") + 1] == f"{job.metadata.name}-0.{svc.metadata.name}"
    assert str(svc.spec.ports[0].port) == cmd[cmd.index("--master-port") + 1]


@pytest.mark.parametrize("index", [0, 1])
def test_each_pods_sidecar_writes_its_nodes_config_and_serves_it(tmp_path, job, cfg, index):
    """The sidecar's shell line, run with this pod's environment (the paths under tmp_path): the
    node's config is the job's with the job's world size and the node's ranks, and it is the one
    the daemon, the probes and the trainer's clients read."""
    spec = job.spec.template.spec
    (side,), (trainer,) = spec.init_containers, spec.containers
    env = {e.name: e.value for e in side.env if e.value is not None}
    nodes, per = int(env["NNODES"]), int(env["NPROC_PER_NODE"])
    node_config = {e.name: e.value for e in trainer.env}["PREFETCHD_CONFIG"]
    assert _exec(side.startup_probe)[3] == node_config
    for c in (side, trainer):
        assert _under(node_config, _mounts(c)["node-config"])
    etc, node_dir = tmp_path / "etc", tmp_path / "node"
    etc.mkdir()
    node_dir.mkdir()
    (etc / "train.yaml").write_text((EXAMPLE / "train.yaml").read_text())
    shim = tmp_path / "bin" / "prefetchd"  # `prefetchd run` says what it would serve; the rest is prefetchd's
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\nif [ "$1" = run ]; then echo "run $*"; exit 0; fi\nexec {sys.executable} -m prefetchd "$@"\n')
    shim.chmod(0o755)
    assert side.command[:2] == ["sh", "-c"]
    line = side.command[2].replace("/etc/prefetchd/", f"{etc}/").replace(os.path.dirname(node_config) + "/",
                                                                        f"{node_dir}/")
    r = subprocess.run(["sh", "-c", line], capture_output=True, text=True, timeout=60,
                       env={**os.environ, **env, "NODE_RANK": str(index), "PATH": f"{shim.parent}:{os.environ['PATH']}"})
    out = node_dir / os.path.basename(node_config)
    assert r.returncode == 0 and r.stdout.strip() == f"run run --config {out}", r
    mine = load_config(str(out))
    assert mine.loader.world_size == nodes * per and list(mine.loader.ranks) == list(range(index * per, (index + 1) * per))
    assert mine.stream_fingerprint() != cfg.stream_fingerprint()  # the world size is the stream's
    assert (mine.buffer.dir, mine.progress_dir, mine.buffer.group) == (cfg.buffer.dir, cfg.progress_dir, cfg.buffer.group)


_READ_TWO = """
import sys
import tempfile
from prefetchd_client import PrefetchClient
with PrefetchClient(sys.argv[1], rank=int(sys.argv[2]), timeout=15, as_numpy=True) as c:
    it = c.iter_epoch(0)
    next(it), next(it)
print("read", c.rank)
"""

# The pod, as far as users and modes go: emptyDirs as the kubelet makes them under fsGroup (root's,
# group FS_GROUP, setgid, 0777), the daemon as uid:gid 1000:1000 (the sidecar's securityContext),
# trainers as the image's user with FS_GROUP among their groups. A private mount namespace puts
# a readable /root over the real one so that other users can run this interpreter (pyenv's, under
# /root); the rest is this machine's.
_AS_THE_POD = r"""
set -eu
top=$1 py=$2 cfg=$3 gid=$4 trainer=$5
mount --make-rprivate /
mkdir "$top/pyenv"
mount --bind /root/.pyenv "$top/pyenv"
mount -t tmpfs -o mode=0755 tmpfs /root
mkdir /root/.pyenv
mount --bind "$top/pyenv" /root/.pyenv
setpriv --reuid "$gid" --regid "$gid" --clear-groups "$py" -m prefetchd run --config "$cfg" > "$top/daemon.log" 2>&1 &
daemon=$!
trap 'kill $daemon; wait $daemon' EXIT
for i in $(seq 120); do "$py" -m prefetchd status --config "$cfg" --ready > /dev/null && break; sleep 0.5; done
echo "any uid: $(setpriv --reuid 4242 --regid 4242 --groups "$gid" "$py" "$trainer" "$cfg" 0 2>&1 | tail -n 1)"
echo "root, no capability: $(setpriv --groups "$gid" --bounding-set -all --inh-caps -all "$py" "$trainer" "$cfg" 1 2>&1 | tail -n 1)"
echo "no fsGroup: $(setpriv --reuid 4343 --regid 4343 --clear-groups "$py" "$trainer" "$cfg" 2 2>&1 | tail -n 1)"
"""


def test_a_trainer_of_any_uid_or_root_without_capabilities_reads_through_the_pods_group(pod, cfg, image_root, request):
    if os.geteuid() != 0:
        pytest.skip("acts as other users (setpriv) in a private mount namespace: needs root")
    for tool in ("unshare", "setpriv"):
        if not shutil.which(tool):
            pytest.skip(f"{tool} is missing (util-linux)")
    gid = pod.spec.security_context.fs_group
    top = tempfile.mkdtemp(dir="/dev/shm")  # pytest's base dir is root's alone: other users cannot reach it
    request.addfinalizer(lambda: shutil.rmtree(top, ignore_errors=True))
    os.chmod(top, 0o755)
    shutil.copytree(image_root, f"{top}/data")
    for d, _, files in os.walk(f"{top}/data"):  # the dataset volume: readable by the daemon's user
        os.chmod(d, 0o755)
        for name in files:
            os.chmod(os.path.join(d, name), 0o644)
    for d in ("ring", "progress", "cache"):
        os.mkdir(f"{top}/{d}")
        os.chown(f"{top}/{d}", 0, gid)
        os.chmod(f"{top}/{d}", 0o2777)
    config = f"{top}/train.yaml"
    with open(config, "w") as f:
        yaml.safe_dump({"dataset": {"root": f"{top}/data", "cache_dir": f"{top}/cache/prefetchd"},
                        "loader": {"batch_size": 6, "world_size": 3},
                        "workers": {"count": 1},
                        "buffer": {"dir": f"{top}/ring/buffer", "group": cfg.buffer.group, "capacity": 2,
                                   "max_bytes": "32MiB", "min_free_bytes": "1MiB"},
                        "progress": {"dir": f"{top}/progress/trainers", "poll_interval_s": 0.05},
                        "augment": {"output_size": 32, "scale_min": 36, "scale_max": 60}}, f)
    trainer = f"{top}/trainer.py"
    with open(trainer, "w") as f:
        f.write(_READ_TWO)
    r = subprocess.run(["unshare", "--mount", "bash", "-c", _AS_THE_POD, "pod", top, sys.executable, config, str(gid),
                        trainer], capture_output=True, text=True, timeout=240)
    log = open(f"{top}/daemon.log").read() if os.path.exists(f"{top}/daemon.log") else ""
    said = dict(line.split(": ", 1) for line in r.stdout.splitlines() if ": " in line)
    assert said.get("any uid") == "read 0" and said.get("root, no capability") == "read 1", f"{r.stdout}{r.stderr}\n{log}"
    assert f"is this user in group {gid} (buffer.group)?" in said.get("no fsGroup", ""), f"{r.stdout}{r.stderr}"
