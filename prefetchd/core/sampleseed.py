"""Per-sample seeding: every source of randomness a sample's augmentation may use, from ``(seed, epoch, index)``.

One key per sample, ``SeedSequence([AUG_TAG, seed, epoch, index])``, whatever makes the sample:

* the built-in augmentation draws its fixed set of uniforms and normals from a ``PCG64`` seeded
  with the key itself (``augment.draws``);
* a user's transform (``core.transform``) runs after ``seed_sample`` has seeded, from four
  children of the key (``SeedSequence.spawn``: deterministic on a fresh key), the generator
  handed to a callable that takes ``rng=`` (child 0), Python's ``random`` (child 1), numpy's
  global ``RandomState`` (child 2) and, when torch is loaded in the process, torch's default
  generator (child 3).

So a sample's bytes depend on neither the worker that makes it, nor what that worker made
before, nor restarts and resumes. Pure apart from the global generators ``seed_sample`` sets.
"""

from __future__ import annotations

import random
import sys

import numpy as np

AUG_TAG = 0x41554730  # "AUG0": separates the augmentation's streams from the sampler's


def sample_key(seed: int, epoch: int, index: int) -> np.random.SeedSequence:
    """The sample's key; the root of everything random about it."""
    return np.random.SeedSequence([AUG_TAG, seed, epoch, index])


def seed_sample(seed: int, epoch: int, index: int, torch=None) -> np.random.Generator:
    """Seed Python's ``random``, numpy's global generator and (``torch``: the module, when the
    process has loaded it) torch's from the sample's key; returns the sample's own generator."""
    rng_ss, py_ss, np_ss, torch_ss = sample_key(seed, epoch, index).spawn(4)
    random.seed(int.from_bytes(py_ss.generate_state(4, np.uint32).tobytes(), "little"))
    np.random.seed(np_ss.generate_state(4, np.uint32))
    if torch is not None:
        torch.manual_seed(int(torch_ss.generate_state(1, np.uint64)[0] >> np.uint64(1)))
    return np.random.Generator(np.random.PCG64(rng_ss))


def loaded_torch():
    """torch, if something in this process imported it (never imported here: a transform that
    does not use torch does not pay for it)."""
    return sys.modules.get("torch")
