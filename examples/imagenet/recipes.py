"""The ImageNet example's ``--recipe randaugment``: RandAugment in the daemon, mixup/CutMix in the trainer.

The daemon's half is a transform factory its workers run (``augment.transform``)::

    augment:
      output_size: 224
      transform: "recipes:randaugment"
      transform_path: examples/imagenet        # this directory (relative to the config file)
      transform_args: {size: 224, num_ops: 2, magnitude: 9}

``randaugment`` is torchvision's recipe (``RandomResizedCrop``, horizontal flip, ``RandAugment``)
ending in ``PILToTensor``: uint8 out, normalised by the client (``normalize=True``), seeded per
sample by the daemon, so the batches are the same whatever its workers. It needs torchvision in
the daemon's environment.

The trainer's half, ``batch_mixer``, mixes each batch on its device (mixup or CutMix, one of the
two per batch, as timm's and torchvision's reference recipes do): torchvision's ``v2.MixUp`` and
``v2.CutMix`` where torchvision imports, else the same two in plain torch. Targets become soft
(class probabilities), which ``nn.CrossEntropyLoss`` takes as they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def randaugment(size: int = 224, num_ops: int = 2, magnitude: int = 9):
    """The daemon's transform (a factory ``augment.transform`` names): a PIL image in, uint8 CHW out."""
    from torchvision.transforms import v2

    return v2.Compose([v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip(),
                       v2.RandAugment(num_ops=num_ops, magnitude=magnitude), v2.PILToTensor()])


def batch_mixer(num_classes: int, mixup_alpha: float = 0.2, cutmix_alpha: float = 1.0):
    """``(mix, what)``: ``mix(images, target) -> (images, soft target)``, and which implementation it is."""
    try:
        from torchvision.transforms import v2

        mix = v2.RandomChoice([v2.MixUp(alpha=mixup_alpha, num_classes=num_classes),
                               v2.CutMix(alpha=cutmix_alpha, num_classes=num_classes)])
        return mix, "torchvision.transforms.v2 MixUp/CutMix"
    except Exception:  # not installed, or an install that does not import beside this torch

        def mix(images: torch.Tensor, target: torch.Tensor):
            return mix_batch(images, target, num_classes, mixup_alpha, cutmix_alpha)
        return mix, "mixup/CutMix in plain torch (torchvision does not import)"


def mix_batch(images: torch.Tensor, target: torch.Tensor, num_classes: int, mixup_alpha: float = 0.2,
              cutmix_alpha: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch mixed with itself rolled by one (as torchvision's v2 does): mixup or CutMix, even
    odds, the weight from Beta(alpha, alpha) of torch's generator. Float images [N, C, H, W]."""
    soft = F.one_hot(target, num_classes).to(images.dtype)
    cut = bool(torch.rand(()) < 0.5)
    alpha = cutmix_alpha if cut else mixup_alpha
    lam = float(torch.distributions.Beta(alpha, alpha).sample())
    other = images.roll(1, 0)
    if cut:  # a box of area (1 - lam) of the image from the other sample; lam is then what is left
        h, w = images.shape[-2:]
        ch, cw = int(h * (1 - lam) ** 0.5), int(w * (1 - lam) ** 0.5)
        cy, cx = int(torch.randint(h, ())), int(torch.randint(w, ()))
        y0, y1 = max(cy - ch // 2, 0), min(cy + ch // 2, h)
        x0, x1 = max(cx - cw // 2, 0), min(cx + cw // 2, w)
        images = images.clone()
        images[..., y0:y1, x0:x1] = other[..., y0:y1, x0:x1]
        lam = 1.0 - (y1 - y0) * (x1 - x0) / (h * w)
    else:
        images = images * lam + other * (1.0 - lam)
    return images, soft * lam + soft.roll(1, 0) * (1.0 - lam)
