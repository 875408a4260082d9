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
* ``state_dict()`` / ``load_state_dict()`` carry the loader's position in Lightning's checkpoints.

Validation needs prefetchd's validation stream (``PrefetchClient(config, split="val")``), which
this version does not have: ``val_dataloader`` is not defined until it is.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from prefetchd_client import PrefetchClient


class PrefetchDataModule(L.LightningDataModule):
    def __init__(self, config: str, timeout: float = 120.0, normalize: bool = True):
        super().__init__()
        self.config = config
        self.timeout = timeout
        self.normalize = normalize
        self.train: PrefetchClient | None = None
        self._pending_state: dict | None = None
        self.final_state: dict | None = None  # the loader's position when teardown closed it

    def setup(self, stage: str) -> None:
        if self.train is not None:
            return
        rank = self.trainer.global_rank if self.trainer is not None else None
        root = self.trainer.strategy.root_device if self.trainer is not None else None
        device = root if root is not None and root.type == "cuda" else None
        self.train = PrefetchClient(self.config, rank=rank, device=device, timeout=self.timeout,
                                    normalize=self.normalize)
        if self._pending_state is not None:  # a checkpoint restored before setup
            self.train.load_state_dict(self._pending_state)
            self._pending_state = None

    def train_dataloader(self) -> PrefetchClient:
        assert self.train is not None, "setup() opens the loader"
        return self.train

    @property
    def num_classes(self) -> int:
        assert self.train is not None, "setup() opens the loader"
        return int(self.train.meta()["num_classes"])

    def state_dict(self) -> dict[str, Any]:
        return {"loader": self.train.state_dict()} if self.train is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "loader" not in state_dict:
            return
        if self.train is None:
            self._pending_state = state_dict["loader"]
        else:
            self.train.load_state_dict(state_dict["loader"])

    def teardown(self, stage: str) -> None:
        if self.train is not None:
            self.final_state = self.train.state_dict()
            self.train.close()
            self.train = None
