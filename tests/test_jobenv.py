"""The client's rank under Slurm with one task per GPU (``srun --ntasks-per-node=8 python
train.py``): ``SLURM_PROCID``/``SLURM_NTASKS`` where torchrun's ``RANK``/``WORLD_SIZE`` are unset."""

from __future__ import annotations

import pytest
from conftest import small_config
from prefetchd_client import PrefetchClient
from prefetchd_client.jobenv import JobRank, job_rank

from prefetchd.core.config import ConfigError

SLURM_TASK = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "1"}


@pytest.mark.parametrize("env, want", [
    ({}, None),
    ({"RANK": "3", "WORLD_SIZE": "4"}, JobRank(3, 4, "RANK", "WORLD_SIZE")),
    (SLURM_TASK, JobRank(5, 8, "SLURM_PROCID", "SLURM_NTASKS")),
    # srun --ntasks-per-node=1 torchrun: each rank has the node's task's SLURM_PROCID; torchrun's win
    ({**SLURM_TASK, "RANK": "9", "WORLD_SIZE": "16"}, JobRank(9, 16, "RANK", "WORLD_SIZE")),
    ({**SLURM_TASK, "WORLD_SIZE": "16"}, JobRank(None, 16, "RANK", "WORLD_SIZE")),
    ({"SLURM_NTASKS": "8"}, None),  # an allocation's shell (salloc): no task of a step
    ({"SLURM_PROCID": "x", "SLURM_NTASKS": ""}, JobRank(None, None, "SLURM_PROCID", "SLURM_NTASKS")),
])
def test_job_rank_prefers_torchrun_then_slurm(env, want):
    assert job_rank(env) == want


@pytest.fixture
def no_launcher(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", *SLURM_TASK):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_a_slurm_task_per_gpu_reads_its_rank_from_slurm_procid(tmp_path, image_root, no_launcher):
    cfg = small_config(tmp_path, image_root, loader={"world_size": 8, "ranks": [4, 5, 6, 7]})
    for name, value in SLURM_TASK.items():
        no_launcher.setenv(name, value)
    assert PrefetchClient(cfg).rank == 5
    assert PrefetchClient(cfg, rank=4).rank == 4  # rank= wins
    no_launcher.setenv("SLURM_PROCID", "2")
    with pytest.raises(ConfigError, match=r"does not include rank 2 \(SLURM_PROCID=2 in the environment"):
        PrefetchClient(cfg)


def test_a_slurm_step_of_another_size_than_the_config_is_a_clear_error(tmp_path, image_root, no_launcher):
    cfg = small_config(tmp_path, image_root, loader={"world_size": 8})
    for name, value in {**SLURM_TASK, "SLURM_NTASKS": "16"}.items():
        no_launcher.setenv(name, value)
    with pytest.raises(ConfigError, match="loader.world_size is 8 .* but SLURM_NTASKS=16 in the environment"):
        PrefetchClient(cfg)
    assert PrefetchClient(cfg, rank=5).rank == 5  # rank= given: the step's size is not the job's to check


def test_torchrun_under_srun_takes_torchruns_rank_not_the_tasks(tmp_path, image_root, no_launcher):
    cfg = small_config(tmp_path, image_root, loader={"world_size": 16, "ranks": list(range(8, 16))})
    for name, value in {**SLURM_TASK, "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "RANK": "11",
                        "WORLD_SIZE": "16"}.items():
        no_launcher.setenv(name, value)
    assert PrefetchClient(cfg).rank == 11
