"""``prefetchd node-config``: one node's config of a multi-node job, written from the job's."""

from __future__ import annotations

import subprocess
import sys

import yaml

from prefetchd.core.config import load as load_config
from prefetchd.tools.nodeconfig import node_config


def test_the_node_serves_its_block_of_the_jobs_ranks_with_paths_made_absolute():
    doc = {"dataset": {"root": "data/train", "cache_dir": "~/cache"}, "loader": {"batch_size": 6, "ranks": "all"},
           "buffer": {"dir": "/run/ring"}}
    cfg = node_config(doc, "/jobs/a", nodes=3, node=2, per_node=4)
    assert cfg["loader"] == {"batch_size": 6, "ranks": [8, 9, 10, 11], "world_size": 12}
    assert cfg["dataset"]["root"] == "/jobs/a/data/train" and cfg["buffer"]["dir"] == "/run/ring"
    assert doc["loader"] == {"batch_size": 6, "ranks": "all"}  # the job's is left as it was
    moved = node_config(doc, "/jobs/a", nodes=1, node=0, per_node=2, buffer_dir="/dev/shm/job-7/ring")
    assert moved["buffer"]["dir"] == "/dev/shm/job-7/ring" and moved["progress"]["dir"] is None


def test_the_command_writes_a_config_the_daemon_reads_and_refuses_a_node_outside_the_job(tmp_path, image_root):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"dataset": {"root": image_root}, "loader": {"batch_size": 6},
                                   "buffer": {"dir": str(tmp_path / "ring")}}))
    out = tmp_path / "node.yaml"
    cmd = [sys.executable, "-m", "prefetchd", "node-config", "--config", str(job), "--nodes", "2", "--per-node", "2",
           "--out", str(out)]
    assert subprocess.run([*cmd, "--node", "1"], timeout=60).returncode == 0
    cfg = load_config(str(out))
    assert (cfg.loader.world_size, cfg.loader.ranks) == (4, (2, 3))
    bad = subprocess.run([*cmd, "--node", "2"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 78 and "node 2 of 2 nodes" in bad.stderr, bad.stderr
    assert load_config(str(out)).loader.ranks == (2, 3)  # the last good copy stays whole
