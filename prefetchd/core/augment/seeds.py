"""Per-sample seeding: every source of randomness a sample's augmentation may use, from ``(seed, epoch, index)``.

One key per sample, ``SeedSequence([AUG_TAG, seed, epoch, index])``, whatever makes the sample:

* the built-in augmentation draws its fixed set of uniforms and normals from a ``PCG64`` seeded
  with the key itself (``augment.draws``);
* a user's transform (``core.augment.transform``) runs after ``seed_sample`` has seeded Python's
  ``random``, numpy's global ``RandomState`` and, when torch is loaded in the process, torch's
  CPU generator from words 4 to 8 of the key's state (``generate_state``), and a callable that
  takes ``rng=`` gets the very generator the built-in draws come from (``PCG64`` of the key,
  which reads words 0 to 3);
* each view of ``augment.views`` draws as the built-in augmentation does, from the key of
  ``(seed, epoch, index, view)``.

So a sample's bytes depend on neither the worker that makes it, nor what that worker made
before, nor restarts and resumes. Pure apart from the global generators ``seed_sample`` sets.
"""

from __future__ import annotations

import random
import sys

import numpy as np

AUG_TAG = 0x41554730  # "AUG0": separates the augmentation's streams from the sampler's
N_UNIFORM = 48  # the built-in draws, in this order: geometry u[0..39], jitter u[40..44, 46, 47], flip u[45]
N_NORMAL = 3  # then the PCA lighting's normals
N_POLICY_DRAWS = 256  # then the policies' fixed block (Draws.p: core.augment.policies, erasing)


def sample_key(seed: int, epoch: int, index: int, view: int | None = None) -> np.random.SeedSequence:
    """The sample's key; the root of everything random about it. ``view``: the key of that view
    of the sample (``augment.views``), the sample's key with the view's number appended."""
    return np.random.SeedSequence([AUG_TAG, seed, epoch, index] + ([] if view is None else [view]))


def sample_draws(seed: int, epoch: int, index: int, view: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The built-in augmentation's draws of a sample, ``(u, z, p)``: ``N_UNIFORM`` uniforms,
    ``N_NORMAL`` standard normals, ``N_POLICY_DRAWS`` uniforms, from a ``PCG64`` of the sample's
    key (``view``: that view's). ``modes.draws`` and the client's random erasing
    (``augment.random_erasing.erase_on: client``) both take them from here; numpy only."""
    rng = np.random.Generator(np.random.PCG64(sample_key(seed, epoch, index, view)))
    return rng.random(N_UNIFORM), rng.standard_normal(N_NORMAL), rng.random(N_POLICY_DRAWS)


def seed_sample(seed: int, epoch: int, index: int, torch=None, rng: bool = False) -> np.random.Generator | None:
    """Seed Python's ``random``, numpy's global generator and (``torch``: the module, when the
    process has loaded it) torch's CPU generator from the sample's key; ``rng``: also return the
    sample's own generator. About 20 us a sample here (BENCHMARKS.md), under 1% of a
    torchvision recipe's; not ``torch.manual_seed``, which also seeds every device's generator and
    costs some 0.8 ms: a worker's transform runs on the CPU."""
    key = sample_key(seed, epoch, index)
    words = key.generate_state(9, np.uint64)  # 0-3 are PCG64's seed (below); the rest are the globals'
    random.seed(int(words[4]) << 64 | int(words[5]))
    np.random.seed(words[6:8].view(np.uint32))
    if torch is not None:
        torch.default_generator.manual_seed(int(words[8] >> np.uint64(1)))
    return np.random.Generator(np.random.PCG64(key)) if rng else None


def loaded_torch():
    """torch, if something in this process imported it (never imported here: a transform that
    does not use torch does not pay for it)."""
    return sys.modules.get("torch")
