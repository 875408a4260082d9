"""Train a small CNN (or a torchvision model) with PyTorch Lightning on prefetchd's batches.

    prefetchd run --config train.yaml &
    python examples/lightning/train.py train.yaml --max-epochs 2
    python examples/lightning/train.py train.yaml --devices 2 --strategy ddp   # one rank per device

The data side is ``PrefetchDataModule`` (datamodule.py beside this file). ``--ckpt-path`` resumes
every rank at its next batch (``--save-every-n-steps`` writes mid-epoch checkpoints), on another
number of devices too (with a config whose ``loader.world_size`` is the new one); pass the
same ``--seed`` to a straight and a resumed run and they train on the same batches to the same
weights (tests/test_examples.py checks it with two ranks). With ``validation:`` enabled in the
config, Lightning validates after every epoch on the daemon's validation stream.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from datamodule import PrefetchDataModule  # noqa: E402


def tiny_cnn(num_classes: int) -> nn.Module:
    def block(cin: int, cout: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(cout),
                             nn.ReLU(inplace=True))

    return nn.Sequential(block(3, 16), block(16, 32), block(32, 64), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(64, num_classes))


class Classifier(L.LightningModule):
    def __init__(self, arch: str, lr: float, num_classes: int | None = None, log_batches: str | None = None):
        super().__init__()
        self.save_hyperparameters()
        self.model: nn.Module | None = None

    def configure_model(self) -> None:
        # runs after the datamodule's setup: the class count can come from the daemon
        if self.model is not None:
            return
        n = self.hparams.num_classes or self.trainer.datamodule.num_classes
        if self.hparams.arch == "tiny":
            model = tiny_cnn(n)
        else:
            import torchvision.models as tv_models  # only for a torchvision architecture

            model = tv_models.get_model(self.hparams.arch, num_classes=n)
        self.model = model.to(memory_format=torch.channels_last)

    def training_step(self, batch, batch_idx):
        images, target = batch
        if self.hparams.log_batches:  # a digest per step and rank: how the tests compare runs
            h = hashlib.blake2b(images.detach().cpu().contiguous().numpy().tobytes(), digest_size=12)
            h.update(target.detach().cpu().numpy().tobytes())
            with open(self.hparams.log_batches, "a") as f:
                last = self.trainer.datamodule.train.last_batch  # the samples, as the daemon made them
                f.write(json.dumps({"rank": self.global_rank, "epoch": self.current_epoch, "step": self.global_step,
                                    "digest": h.hexdigest(), "indices": last.indices.tolist()}) + "\n")
        logits = self.model(images.contiguous(memory_format=torch.channels_last))
        loss = F.cross_entropy(logits, target)
        acc = (logits.argmax(1) == target).float().mean()
        self.log_dict({"train_loss": loss, "train_acc": acc}, prog_bar=True)
        return loss

    def on_validation_epoch_start(self) -> None:
        self._val_sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # correct, total

    def validation_step(self, batch, batch_idx):
        images, target, padding = batch  # padding: repeats that even the ranks' passes out
        logits = self.model(images.contiguous(memory_format=torch.channels_last))
        real = ~padding
        self._val_sums[0] += ((logits.argmax(1) == target) & real).sum()
        self._val_sums[1] += real.sum()

    def on_validation_epoch_end(self) -> None:
        # exact counts: the padding left out per step, one sum across ranks at the end
        correct, total = self.trainer.strategy.reduce(self._val_sums, reduce_op="sum").tolist()
        self.log("val_acc", correct / max(total, 1.0), rank_zero_only=True)
        if self.trainer.is_global_zero and not self.trainer.sanity_checking:
            print(f"validation: {int(total)} samples, acc {100 * correct / max(total, 1.0):.2f}", flush=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9, weight_decay=1e-4)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Lightning training fed by prefetchd")
    p.add_argument("config", help="the prefetchd config the daemon runs with")
    p.add_argument("-a", "--arch", default="tiny", help="tiny, or a torchvision model name")
    p.add_argument("--max-epochs", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=-1)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--accelerator", default="auto")
    p.add_argument("--devices", default="auto")
    p.add_argument("--strategy", default="auto")
    p.add_argument("--precision", default=None, help="e.g. bf16-mixed (default: 32, or bf16-mixed on CUDA)")
    p.add_argument("--ckpt-path", default=None, help="a Lightning checkpoint to resume from")
    p.add_argument("--default-root-dir", default=None, help="where Lightning writes checkpoints")
    p.add_argument("--save-every-n-steps", type=int, default=None, help="also checkpoint every N steps")
    p.add_argument("--seed", type=int, default=0, help="seeds the initial weights (the same on every run)")
    p.add_argument("--log-batches", default=None, help="append a JSON line per step and rank (batch digests)")
    args = p.parse_args(argv)

    L.seed_everything(args.seed, verbose=False)
    dm = PrefetchDataModule(args.config)
    precision = args.precision or ("bf16-mixed" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "32")
    callbacks = []
    if args.save_every_n_steps:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(every_n_train_steps=args.save_every_n_steps, save_top_k=-1,
                                                             filename="{step}"))
    trainer = L.Trainer(max_epochs=args.max_epochs, max_steps=args.max_steps, accelerator=args.accelerator,
                        devices=args.devices, strategy=args.strategy, precision=precision,
                        use_distributed_sampler=False,  # each rank reads its own stream
                        enable_progress_bar=sys.stderr.isatty(), logger=False, log_every_n_steps=1,
                        default_root_dir=args.default_root_dir, callbacks=callbacks)
    model = Classifier(args.arch, args.lr, log_batches=args.log_batches)
    trainer.fit(model, datamodule=dm, ckpt_path=args.ckpt_path)
    pos = dm.final_state or {}
    if trainer.is_global_zero:
        print(f"trained {trainer.global_step} steps; the loader stopped at epoch {pos.get('epoch')} batch "
              f"{pos.get('batch')}; train_loss {float(trainer.callback_metrics.get('train_loss', float('nan'))):.4f}",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
