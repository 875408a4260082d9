"""Random erasing in the client (``augment.random_erasing.erase_on: client``): timm's
``RandomErasing`` on the normalised batch, where the batch is (a CUDA device, the CPU, numpy), as
timm's loader erases on the GPU after its normalisation.

The daemon's ``meta.json`` says ``"erasing": {p, scale, ratio, mode, count, seed}`` (None: the
client erases nothing) and its workers leave the boxes alone. Sample ``k`` of a batch of epoch
``e`` is erased from the draws of its key ``(seed, e, indices[k])`` (``seeds.sample_draws``: the
batch file's indices are the samples it holds, replacements included, and a replacement is made
from its own index's draws in the workers too): the boxes are ``core.augment.erasing.boxes`` of
those draws and the noise is ``erasing.noise`` of them (the same normals the daemon's erasing
maps to pixels), so a batch's erasing is a pure function of its samples' keys: the worker count,
a restart or a resume change nothing. In normalised space, ``const`` fills with 0 (the mean),
``rand`` with one N(0, 1) value per channel per box, ``pixel`` with N(0, 1) per pixel.

With ``augment.views`` the meta says ``"erasing": {"seed", "views": [a spec or None per view]}``
(each view group's ``random_erasing``): view ``v`` of sample ``i`` is erased from the draws of the
key ``(seed, e, i, v)``, the key the workers make that view from, and views whose group does not
erase in the client are left alone.

The noise is made in numpy on the host and copied (one copy a batch, pinned, on the current
stream) rather than drawn by a ``torch.Generator`` on the device: a CUDA generator's numbers are
not a CPU generator's, so the pixels would depend on the device and could not be checked here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from prefetchd.core.augment import erasing
from prefetchd.core.augment.seeds import sample_draws
from prefetchd.core.policyspec import ErasingConfig

from .common import ConfigError, PrefetchError

_KEY = "augment.random_erasing.erase_on"


def _client_key(cfg) -> str | None:
    """The key of the first erasing the client is asked to do (``augment.random_erasing.erase_on``
    or a view group's), None when none is."""
    a = cfg.augment
    named = [(f"augment.views[{i}].random_erasing.erase_on", g.random_erasing) for i, g in enumerate(a.views)]
    for key, e in [(_KEY, a.random_erasing)] + named:
        if e.erase_on == "client" and e.p:
            return key
    return None


def check_client(cfg, normalize: bool, split: str) -> None:
    """Refuse a client that cannot erase as ``erase_on: client`` asks: one that yields uint8
    images (erasing those is the daemon's job). The validation stream is never erased."""
    key = _client_key(cfg)
    if split == "train" and key is not None and not normalize:
        raise ConfigError(key, f"is client in {cfg.source or 'the config'}: the client erases the batch it "
                          "normalises, as timm's loader does; pass normalize=True (and device='cuda' to erase on the "
                          "GPU), or set erase_on: daemon to erase the uint8 samples in the workers")


def from_meta(cfg, meta: dict, split: str) -> ClientErasing | None:
    """The erasing this client does (None: none), as the daemon's ``meta.json`` says."""
    if split != "train":
        return None
    spec = meta.get("erasing")
    key = _client_key(cfg)
    if spec is None and key is not None:
        raise PrefetchError(f"{key} is client but the daemon serving {cfg.buffer.dir} (pid {meta.get('pid')}) does "
                            "not say how to erase (a prefetchd older than this client?): restart it with this "
                            "version, or set erase_on: daemon")
    return ClientErasing(spec) if spec else None


def _erasing_config(spec: dict[str, Any]) -> ErasingConfig:
    return ErasingConfig(p=float(spec["p"]), scale=tuple(spec["scale"]), ratio=tuple(spec["ratio"]),
                         mode=str(spec["mode"]), count=tuple(spec["count"]), erase_on="client")


class ClientErasing:
    """The erasing a daemon's ``meta.json`` asks of the client (its ``"erasing"`` entry): one spec
    for the batch's images, or (``augment.views``) ``{"seed", "views": [a spec or None per view]}``,
    each view then erased from the draws of its own key ``(seed, epoch, index, view)``, as the
    workers draw that view's crop."""

    def __init__(self, spec: dict[str, Any]):
        self.seed = int(spec["seed"])
        self.per_view = "views" in spec
        if self.per_view:
            self.cfgs = [None if v is None else _erasing_config(v) for v in spec["views"]]
        else:
            self.cfg = _erasing_config(spec)

    def plan(self, epoch: int, indices: np.ndarray, h: int, w: int,
             view: int | None = None) -> list[tuple[int, int, int, int, int, Any]]:
        """``(k, top, left, height, width, noise)`` of every box of the batch (``view``: of that view
        of a stream of ``augment.views``): ``noise`` is None (const), float32 [3] (rand) or float32
        [height, width, 3] (pixel: channels last, as the batches are in memory, so the fill copies
        in memory order)."""
        cfg = self.cfg if not self.per_view else self.cfgs[view] if view is not None and view < len(self.cfgs) else None
        if cfg is None:
            return []
        key_view = view if self.per_view else None
        out = []
        for k, i in enumerate(indices):
            p = sample_draws(self.seed, int(epoch), int(i), key_view)[2]
            bs = erasing.boxes(cfg, p, h, w)
            if not bs:
                continue
            for (top, left, eh, ew, _), z in zip(bs, erasing.noise(cfg, p, bs), strict=True):
                if z is not None:
                    z = np.asarray(z, dtype=np.float32)  # rand: from float64; pixel: as it is
                out.append((k, top, left, eh, ew, z))
        return out

    def __call__(self, images: Any, epoch: int, indices: np.ndarray, view: int | None = None) -> Any:
        """Erase the normalised ``images`` ([N, 3, H, W], a torch tensor on any device or a numpy
        array; ``view``: the batch's view of that number) in place; returns them. With a CUDA
        tensor, call it on the stream the batch is made on (the copy of the noise and the fills
        are queued there)."""
        boxes = self.plan(epoch, indices, images.shape[2], images.shape[3], view)
        if not boxes:
            return images
        if isinstance(images, np.ndarray):
            for k, top, left, eh, ew, z in boxes:
                dst = images[k, :, top:top + eh, left:left + ew]
                dst[...] = 0 if z is None else (z[:, None, None] if z.ndim == 1 else z.transpose(2, 0, 1))
            return images
        return _erase_torch(images, boxes)


def _erase_torch(images, boxes):
    import torch

    noise = [z.ravel() for *_, z in boxes if z is not None]
    flat = None
    if noise:
        on_host = images.device.type == "cpu"
        # on a device: one copy a batch, from pinned memory (written in place), so it is queued on
        # the current stream without a host sync; torch's host allocator keeps the block until
        # the copy is done
        flat = torch.empty(sum(z.size for z in noise), dtype=torch.float32, pin_memory=not on_host)
        np.concatenate(noise, out=flat.numpy())
        if not on_host:
            flat = flat.to(images.device, non_blocking=True)
    at = 0
    for k, top, left, eh, ew, z in boxes:
        dst = images[k, :, top:top + eh, left:left + ew]
        if z is None:
            dst.zero_()
            continue
        n = z.size
        src = flat[at: at + n]
        at += n
        dst.copy_(src.view(3, 1, 1).expand(3, eh, ew) if z.ndim == 1 else src.view(eh, ew, 3).permute(2, 0, 1))
    return images
