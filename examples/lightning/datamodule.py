"""A LightningDataModule on prefetchd: the daemon makes the batches, Lightning trains on them.

    dm = PrefetchDataModule("train.yaml")
    trainer = L.Trainer(max_epochs=90, use_distributed_sampler=False)
    trainer.fit(model, datamodule=dm)

* ``setup`` opens one :class:`PrefetchClient` per process for the trainer's global rank (under
  DDP every process reads its own rank's stream; the config's ``loader.world_size`` must equal the
  trainer's world size). There is no sampler for Lightning to replace:
  ``use_distributed_sampler=False``.
* The client is the train dataloader: each ``iter()`` Lightning takes per epoch yields one epoch
  from the loader's position and then moves it to the next epoch, as a DataLoader with
  ``DistributedSampler.set_epoch`` does. ``len()`` is this rank's batches per epoch.
* On a CUDA root device the client copies each batch to the device itself (pinned memory, a side
  stream); Lightning's own transfer is then a no-op. Batches come normalised (float32,
  ImageNet mean and std) unless ``normalize=False``.
* Lightning keeps the loader's state in its checkpoints (as for a StatefulDataLoader): rank 0's
  position (the ranks step in lock-step, so it is every rank's), and ``ckpt_path=`` resumes every
  rank from it at its next batch, mid-epoch too; on another number of devices too (a config
  whose ``loader.world_size`` is the new one): the rest of the epoch is shared out among the new
  ranks. docs/trainer.md's rule: rank 0's state, loaded on every rank.

* With ``validation.enabled`` in the config, ``val_dataloader`` is the validation stream
  (``PrefetchClient(config, split="val", padding_mask=True)``): each validation run is one pass,
  every rank the same number of batches (padded as DistributedSampler pads, so a per-step
  ``sync_dist`` cannot hang), each batch ``(images, target, padding)``: leave the padding out and
  sum correct and total across ranks at the epoch's end (as ``train.py``'s ``Classifier`` does)
  to count every sample exactly once. Without it, ``val_dataloader`` is
  empty and Lightning skips validation.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from prefetchd_client import PrefetchClient


class PrefetchValLoader:
    """The validation client as Lightning's val dataloader: one pass per ``iter()``, ``len()`` this
    rank's val batches. Only those two: Lightning treats an object with a ``dataset`` as a
    DataLoader (the client has one, sized, for scripts that read it), and a pass has no state
    worth a checkpoint."""

    def __init__(self, client: PrefetchClient):
        self.client = client

    def __iter__(self):
        return iter(self.client)

    def __len__(self) -> int:
        return len(self.client)


class PrefetchTrainLoader(PrefetchValLoader):
    """The client as Lightning's train dataloader. Iteration is the client's; the state is this
    rank's position, of which the checkpoint (which rank 0 writes) keeps rank 0's, and every rank
    loads it. Lightning saves and restores it as it does a StatefulDataLoader.

    Lightning ends an epoch when its count of the epoch's batches reaches ``len()``, and restores
    that count from the checkpoint. A checkpoint of another world or batch size counted other
    batches: after loading, the count is moved to the batches of this job's epoch the loader stands
    after (``_num_yielded``), and ``len()`` is a whole epoch's, so the two meet at the epoch's end."""

    def __init__(self, client: PrefetchClient, trainer: Any = None):
        super().__init__(client)
        self.trainer = trainer

    def __len__(self) -> int:
        return self.client.batches_per_epoch

    def state_dict(self) -> dict[str, Any]:
        return {"ranks": [self.client.state_dict()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # rank 0's state on every rank (a checkpoint of an older version holds every rank's:
        # rank 0's is among them), at this world size or another
        states = sorted(state["ranks"], key=lambda s: int(s.get("rank", 0)))
        self.client.load_state_dict(states[0])
        if self.trainer is not None:  # Lightning's restored count, moved (all its fields alike) to the loader's
            current = self.trainer.fit_loop.epoch_loop.batch_progress.current
            shift = self.client.state_dict()["_num_yielded"] - current.ready
            current.ready, current.started = current.ready + shift, current.started + shift
            current.processed, current.completed = current.processed + shift, current.completed + shift


class PrefetchDataModule(L.LightningDataModule):
    def __init__(self, config: str, timeout: float = 120.0, normalize: bool = True):
        super().__init__()
        self.config = config
        self.timeout = timeout
        self.normalize = normalize
        self.train: PrefetchClient | None = None
        self.val: PrefetchClient | None = None
        self.final_state: dict | None = None  # the loader's position when teardown closed it

    def setup(self, stage: str) -> None:
        if self.train is not None:
            return
        rank = self.trainer.global_rank if self.trainer is not None else None
        root = self.trainer.strategy.root_device if self.trainer is not None else None
        device = root if root is not None and root.type == "cuda" else None
        self.train = PrefetchClient(self.config, rank=rank, device=device, timeout=self.timeout,
                                    normalize=self.normalize)
        if self.train.cfg.validation.enabled:
            self.val = PrefetchClient(self.train.cfg, rank=rank, device=device, timeout=self.timeout,
                                      normalize=self.normalize, split="val", padding_mask=True)

    def train_dataloader(self) -> PrefetchTrainLoader:
        assert self.train is not None, "setup() opens the loader"
        return PrefetchTrainLoader(self.train, self.trainer)

    def val_dataloader(self) -> PrefetchValLoader | list:
        """The validation stream, one pass per ``iter()``; empty without ``validation.enabled``."""
        assert self.train is not None, "setup() opens the loader"
        return PrefetchValLoader(self.val) if self.val is not None else []

    @property
    def num_classes(self) -> int:
        assert self.train is not None, "setup() opens the loader"
        return int(self.train.meta()["num_classes"])

    def teardown(self, stage: str) -> None:
        if self.train is not None:
            self.final_state = self.train.state_dict()
            self.train.close()
            self.train = None
        if self.val is not None:
            self.val.close()
            self.val = None
