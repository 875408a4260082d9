"""ImageNet training fed by prefetchd, in the shape of pytorch/examples ``imagenet/main.py``.

The daemon decodes and augments; this script only trains. Start the daemon with the config
first (``prefetchd run --config train.yaml``, or the systemd unit), then:

    python examples/imagenet/train.py train.yaml -a resnet50 --epochs 90               # one GPU or CPU
    torchrun --nproc-per-node 8 examples/imagenet/train.py train.yaml -a resnet50      # DDP

* DDP under torchrun (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``): NCCL on GPUs, gloo on CPU. The
  config's ``loader.world_size`` must equal torchrun's world size; each process reads its rank's
  stream, so there is no DistributedSampler.
* AMP: bf16 autocast where the device supports it (recent GPUs, CPUs), else fp16 with a
  GradScaler on CUDA; ``--no-amp`` trains in float32. Model and batches are channels_last.
* ``PrefetchClient(..., normalize=True)`` hands over model-ready floats on the device; the loop is
  the DataLoader loop (``for images, target in train_loader``, one epoch per pass).
* Checkpoints (``--checkpoint``, written atomically by rank 0 after every epoch, and when
  ``--max-steps`` stops a run early) hold the model, optimizer, scheduler, scaler and rank 0's
  loader ``state_dict()``, which every rank loads (the ranks step in lock-step; docs/trainer.md's
  rule): ``--resume`` continues from the very next batch, mid-epoch too. The epoch loop starts
  from ``train_loader.epoch`` (a counter of the script's own that lags the loader, say after a
  run stopped on an epoch's last batch, would have ``set_epoch`` replay that epoch). On
  another number of ranks (a config whose ``loader.world_size`` is the new job's), it continues
  the epoch with the samples the old job had not reached, shared out among the new ranks, and
  the epochs after it are whole: ``torchrun --nproc-per-node 3 train.py train3.yaml --resume
  checkpoint.pt`` goes on from a checkpoint of 2 ranks.
* ``--arch``: any torchvision model when torchvision imports, and ``tiny`` (a small CNN defined
  here) always; ``tiny`` is the default without torchvision.
* ``--log-batches FILE`` appends one JSON line per step and rank (epoch, step, digest of the
  batch, its dataset indices): how the tests check that a resumed run sees the straight run's
  batches, and that a run resumed on another number of ranks reads no sample of the epoch twice.

Recipes: ``--recipe randaugment`` trains with RandAugment made in the daemon (the config's
``augment.transform`` names ``recipes:randaugment``; ``recipes.py`` shows the YAML) and mixup or
CutMix on each batch on the trainer's device (torchvision's v2 where it imports, else plain
torch); the targets are then soft. ``--recipe config`` (the default) trains on what the config makes.

Validation: ``--val`` validates after every epoch on prefetchd's validation stream
(``PrefetchClient(config, split="val")``, with ``validation.enabled`` and ``validation.root`` in the
config: eval augmentation, every rank the same batch count (padded as DistributedSampler pads;
the padding left out of the sums: every sample counted once), the last partial batch kept).
The daemon makes a pass only while it is read. See ``make_val_loader``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from prefetchd_client import PrefetchClient
from recipes import batch_mixer

try:
    import torchvision.models as tv_models
except Exception:  # not installed, or an install that does not import (a torch/torchvision mismatch)
    tv_models = None


class TinyCNN(nn.Module):
    """Three conv blocks and a linear head: enough to train on CPU in tests, and a model whose
    loss falls on real images."""

    def __init__(self, num_classes: int):
        super().__init__()

        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(cout),
                                 nn.ReLU(inplace=True))

        self.features = nn.Sequential(block(3, 16), block(16, 32), block(32, 64), nn.AdaptiveAvgPool2d(1))
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.features(x), 1))


def model_names() -> list[str]:
    names = ["tiny"]
    if tv_models is not None:
        names += sorted(tv_models.list_models(module=tv_models))
    return names


def build_model(arch: str, num_classes: int) -> nn.Module:
    if arch == "tiny":
        return TinyCNN(num_classes)
    if tv_models is None:
        raise SystemExit(f"--arch {arch} needs torchvision, which does not import here; use --arch tiny")
    return tv_models.get_model(arch, num_classes=num_classes)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="ImageNet training fed by prefetchd")
    p.add_argument("config", help="the prefetchd config the daemon runs with (its loader.batch_size is the "
                   "per-rank batch size)")
    p.add_argument("-a", "--arch", default="resnet18" if tv_models is not None else "tiny", choices=model_names(),
                   metavar="ARCH", help="tiny, or a torchvision model (default: resnet18, or tiny without torchvision)")
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--lr", type=float, default=0.1, help="for a batch of 256 across all ranks; scaled linearly")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--wd", "--weight-decay", type=float, default=1e-4, dest="weight_decay")
    p.add_argument("--lr-step", type=int, default=30, help="divide the learning rate by 10 every N epochs")
    p.add_argument("--num-classes", type=int, default=None, help="default: the daemon's class count")
    p.add_argument("--no-amp", dest="amp", action="store_false", help="train in float32")
    p.add_argument("--cpu", action="store_true", help="train on CPU even when CUDA is available")
    p.add_argument("--checkpoint", default="checkpoint.pt", help="where rank 0 saves (default: checkpoint.pt)")
    p.add_argument("--resume", default="", help="a checkpoint to continue from")
    p.add_argument("--max-steps", type=int, default=None,
                   help="stop after this many steps in this run, saving a checkpoint (for tests and trials)")
    p.add_argument("--val", action="store_true", help="validate after each epoch (needs validation: in the config)")
    p.add_argument("--seed", type=int, default=0, help="seeds the model's initial weights")
    p.add_argument("--recipe", default="config", choices=["config", "randaugment"],
                   help="randaugment: the config's augment.transform runs RandAugment in the daemon "
                        "(recipes.py), mixup/CutMix here")
    p.add_argument("-p", "--print-freq", type=int, default=10)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for a batch before giving up")
    p.add_argument("--log-batches", default=None, help="append a JSON line per step and rank (batch digests)")
    return p.parse_args(argv)


# --- set-up ------------------------------------------------------------------------------------------


def setup_distributed(args) -> tuple[torch.device, int, int]:
    """(device, rank, world size); joins the process group under torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available() and not args.cpu:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device, rank, world


def amp_settings(device: torch.device, enabled: bool) -> tuple[bool, torch.dtype, bool]:
    """(autocast on, its dtype, GradScaler needed)."""
    if not enabled:
        return False, torch.float32, False
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return True, torch.bfloat16, False
        return True, torch.float16, True  # fp16 gradients underflow without loss scaling
    return True, torch.bfloat16, False  # CPU autocast supports bf16


def make_train_loader(args, device: torch.device) -> PrefetchClient:
    # normalize=True: (x/255 - mean) / std as float32 on the device; the rank comes from $RANK
    return PrefetchClient(args.config, device=device, timeout=args.timeout, normalize=True)


def make_val_loader(args, device: torch.device):
    # The validation stream of the same daemon and config (validation: in the YAML): eval
    # augmentation, no shuffle, every sample once per pass across ranks, the last partial batch
    # kept (ranks' shares may differ by one sample; validate() sums correct and total across ranks).
    if not args.val:
        return None
    return PrefetchClient(args.config, split="val", device=device, timeout=args.timeout, normalize=True)


# --- the loops ------------------------------------------------------------------------------------------


def accuracy(output: torch.Tensor, target: torch.Tensor, topk=(1, 5)) -> list[torch.Tensor]:
    """Correct predictions among the top k, as counts (summed across ranks later)."""
    k = min(max(topk), output.shape[1])
    pred = output.topk(k, 1).indices.t()
    correct = pred.eq(target.view(1, -1))
    return [correct[: min(t, k)].reshape(-1).float().sum() for t in topk]


def batch_digest(images: torch.Tensor, target: torch.Tensor) -> str:
    h = hashlib.blake2b(digest_size=12)
    h.update(images.detach().to("cpu").contiguous().numpy().tobytes())
    h.update(target.detach().to("cpu").numpy().tobytes())
    return h.hexdigest()


def train_one_epoch(loader, model, criterion, optimizer, scaler, epoch: int, state: dict, args, amp, device,
                    rank: int) -> bool:
    """One pass of the loader (the rest of the epoch when resumed mid-epoch). Returns False when
    --max-steps stopped it."""
    use_amp, amp_dtype, _ = amp
    model.train()
    n = len(loader)
    seen = 0
    t0 = end = time.monotonic()
    data_s = 0.0
    for i, (images, target) in enumerate(loader):
        data_s += time.monotonic() - end
        images = images.contiguous(memory_format=torch.channels_last)
        if args.log_batches:
            with open(args.log_batches, "a") as f:
                f.write(json.dumps({"rank": rank, "epoch": epoch, "step": state["steps"],
                                    "digest": batch_digest(images, target),
                                    "indices": loader.last_batch.indices.tolist()}) + "\n")
        if getattr(args, "mix", None) is not None:  # --recipe randaugment: soft targets from here on
            images, target = args.mix(images, target)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=use_amp):
            output = model(images)
            loss = criterion(output, target)
        optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        seen += images.shape[0]
        state["steps"] += 1
        state["run_steps"] += 1
        if rank == 0 and (i % args.print_freq == 0 or i + 1 == n):
            top1, _ = accuracy(output.float(), target.argmax(1) if target.ndim == 2 else target)
            dt = time.monotonic() - t0
            print(f"Epoch: [{epoch}][{i + 1}/{n}]\tloss {loss.item():.4f}\tacc@1 {100 * top1.item() / len(target):6.2f}"
                  f"\t{seen / max(dt, 1e-9):,.0f} img/s per rank\tdata {data_s:.2f} s of {dt:.2f} s", flush=True)
        if args.max_steps is not None and state["run_steps"] >= args.max_steps:
            return False
        end = time.monotonic()
    return True


@torch.no_grad()
def validate(loader, model, criterion, args, amp, device, world: int) -> float:
    """Top-1 accuracy over one pass of the validation stream, summed across ranks. Every rank's pass
    has the same number of batches (validation.pad, as DistributedSampler pads); the samples that
    pad it out are left out of the sums, so they count every sample exactly once."""
    use_amp, amp_dtype, _ = amp
    model.eval()
    totals = torch.zeros(4, dtype=torch.float64, device=device)  # loss sum, top1, top5, count
    for images, target in loader:
        images = images.contiguous(memory_format=torch.channels_last)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=use_amp):
            output = model(images)
        pad = loader.last_batch.padding
        if pad is not None and pad.any():  # repeats that even the ranks' passes out: not counted
            keep = torch.from_numpy(~pad).to(output.device)
            output, target = output[keep], target[keep]
            if not len(target):
                continue
        loss = criterion(output.float(), target)
        top1, top5 = accuracy(output.float(), target)
        totals += torch.stack([loss * len(target), top1, top5, torch.tensor(float(len(target)), device=device)]).double()
    if world > 1:
        dist.all_reduce(totals)
    loss_sum, c1, c5, count = totals.tolist()
    count = max(count, 1.0)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f" * validation: {int(count)} samples, loss {loss_sum / count:.4f}, acc@1 {100 * c1 / count:.2f}, "
              f"acc@5 {100 * c5 / count:.2f}", flush=True)
    return 100 * c1 / count


# --- checkpoints ---------------------------------------------------------------------------------------------


def save_checkpoint(path: str, epoch: int, model, optimizer, scheduler, scaler, loader, best_acc1: float, args,
                    world: int, rank: int, steps: int) -> None:
    """Rank 0's loader state (the ranks step in lock-step: every rank resumes from it, the
    rule of docs/trainer.md) and the rest, from rank 0; written to a temporary file and renamed into place."""
    if rank != 0:
        return
    state = loader.state_dict()
    states = [state]  # a list: checkpoints of older versions held every rank's
    module = model.module if hasattr(model, "module") else model
    ckpt = {"epoch": epoch, "arch": args.arch, "model": module.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict() if scaler is not None else None,
            "best_acc1": best_acc1, "loader": states, "world_size": world, "steps": steps}
    tmp = f"{path}.tmp"
    torch.save(ckpt, tmp)
    os.replace(tmp, path)
    print(f"=> saved checkpoint {path} (epoch {epoch}, loader at {state.get('epoch')}/{state.get('batch')})", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # the loader says how it resumed
    device, rank, world = setup_distributed(args)
    amp = amp_settings(device, args.amp)
    train_loader = make_train_loader(args, device)
    if args.recipe == "randaugment" and train_loader.cfg.augment.transform is None:
        train_loader.close()
        raise SystemExit(f"--recipe randaugment runs RandAugment in the daemon: set augment.transform: "
                         f"\"recipes:randaugment\" and augment.transform_path: {os.path.dirname(os.path.abspath(__file__))} "
                         f"in {args.config} (recipes.py shows the keys), then restart the daemon")
    val_loader = make_val_loader(args, device)
    num_classes = args.num_classes or int(train_loader.meta()["num_classes"])
    args.mix, mixed_by = batch_mixer(num_classes) if args.recipe == "randaugment" else (None, "")
    if rank == 0 and mixed_by:
        print(f"=> recipe randaugment: {train_loader.cfg.augment.transform} in the daemon, {mixed_by} here",
              flush=True)
    if rank == 0:
        print(f"=> {args.arch} for {num_classes} classes on {device}, world size {world}, batch "
              f"{train_loader.batch_size} per rank, {len(train_loader)} steps per epoch, amp "
              f"{str(amp[1]).replace('torch.', '') if amp[0] else 'off'}", flush=True)

    torch.manual_seed(args.seed)  # the same initial weights on every rank and on every run
    model = build_model(args.arch, num_classes).to(device, memory_format=torch.channels_last)
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    criterion = nn.CrossEntropyLoss().to(device)
    lr = args.lr * train_loader.batch_size * world / 256
    optimizer = torch.optim.SGD(model.parameters(), lr, momentum=args.momentum, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=args.lr_step, gamma=0.1)
    scaler = torch.amp.GradScaler("cuda") if amp[2] else None

    start_epoch, best_acc1 = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device, weights_only=True)
        (model.module if world > 1 else model).load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        if scaler is not None and ckpt["scaler"] is not None:
            scaler.load_state_dict(ckpt["scaler"])
        # continues at the very next batch; saved by another number of ranks (all saved the same
        # step), the rest of that epoch is shared out among this job's ranks
        train_loader.load_state_dict(ckpt["loader"][0])  # rank 0's state on every rank (docs/trainer.md's rule)
        start_epoch, best_acc1 = train_loader.epoch, ckpt["best_acc1"]
        if rank == 0:
            print(f"=> resumed from {args.resume} at epoch {start_epoch}"
                  + (f" (saved by {ckpt['world_size']} ranks, continued on {world})" if ckpt["world_size"] != world
                     else ""), flush=True)

    state = {"steps": ckpt["steps"] if args.resume else 0, "run_steps": 0}
    try:
        # the epochs count from the loader's own (as the checkpoint's): a counter of the script's
        # that fell behind it would have set_epoch seek back to the start of an epoch already read
        for epoch in range(train_loader.epoch, args.epochs):
            # as DistributedSampler.set_epoch; at the epoch a resumed loader stands in, it keeps its batch
            train_loader.set_epoch(epoch)
            stopped = not train_one_epoch(train_loader, model, criterion, optimizer, scaler, epoch, state, args, amp,
                                          device, rank)
            if train_loader.epoch == epoch:  # --max-steps stopped it inside the epoch
                save_checkpoint(args.checkpoint, epoch, model, optimizer, scheduler, scaler, train_loader,
                                best_acc1, args, world, rank, state["steps"])
                break
            # the epoch is done (--max-steps may have stopped on its last batch: it is done all the same)
            if val_loader is not None:
                best_acc1 = max(best_acc1, validate(val_loader, model, criterion, args, amp, device, world))
            scheduler.step()
            save_checkpoint(args.checkpoint, epoch + 1, model, optimizer, scheduler, scaler, train_loader,
                            best_acc1, args, world, rank, state["steps"])
            if stopped:
                break
        if dist.is_initialized():
            # leave together: rank 0 may still be writing the checkpoint. Without this, rank 1 died
            # of SIGABRT at exit in 3 of about 30 test runs ("terminate called without an active
            # exception" in the one whose output was kept)
            dist.barrier()
    finally:
        train_loader.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
