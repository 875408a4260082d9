"""A trainer process's rank and world size, from the environment its launcher gave it.

torchrun (and ``torch.distributed``'s other launchers) set ``RANK`` and ``WORLD_SIZE``. Slurm
with one task per GPU (``srun --ntasks-per-node=8 python train.py``: Lightning's
``SLURMEnvironment``, submitit, NeMo and Megatron run this way) sets no ``RANK``, but
``SLURM_PROCID`` (the task's rank in the step, 0 .. ``SLURM_NTASKS`` - 1), ``SLURM_NTASKS``
and ``SLURM_LOCALID`` (its rank on the node).

torchrun's variables win: under ``srun --ntasks-per-node=1 torchrun ...`` every rank inherits
the Slurm variables of the one task that runs torchrun (``SLURM_PROCID`` is the node's number
there, not the rank), and torchrun sets ``RANK`` for each. Slurm's are read only when neither
``RANK`` nor ``WORLD_SIZE`` is set.

Pure: ``job_rank`` reads the mapping it is given (``os.environ`` in the client).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

TORCHRUN = ("RANK", "WORLD_SIZE")
SLURM = ("SLURM_PROCID", "SLURM_NTASKS")


@dataclass(frozen=True)
class JobRank:
    """What the environment says: ``rank`` and ``world_size`` (None where unset or not a
    number), and the names of the variables they came from, for messages."""

    rank: int | None
    world_size: int | None
    rank_name: str
    world_name: str

    @property
    def slurm(self) -> bool:
        return self.rank_name == SLURM[0]


def _int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name, "").strip()
    return int(value) if value.isdigit() else None


def job_rank(env: Mapping[str, str]) -> JobRank | None:
    """torchrun's ``RANK``/``WORLD_SIZE`` where either is set, else Slurm's
    ``SLURM_PROCID``/``SLURM_NTASKS`` where ``SLURM_PROCID`` is, else None (a process on its
    own: the caller's default)."""
    for rank_name, world_name in (TORCHRUN, SLURM):
        if rank_name in env or (world_name in env and rank_name == TORCHRUN[0]):
            return JobRank(_int(env, rank_name), _int(env, world_name), rank_name, world_name)
    return None
