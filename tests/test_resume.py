"""Resuming on another number of GPUs (issue 20): a state saved at one world size (and batch size)
goes on at another, mid-epoch, with the real daemon restarted on a config for the new job."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import yaml
from conftest import small_config, wait_until
from prefetchd_client import PrefetchClient, PrefetchError, PrefetchTimeout
from test_daemon import published

from prefetchd.core.sampler import Sampler

N = 48  # conftest's image_root
SEED = 7  # small_config's loader.seed


def _config(tmp_path, name: str, root: str, world: int, batch: int) -> str:
    """A config for a job of ``world`` ranks; every job shares one buffer, as a restarted job does."""
    d = tmp_path / name
    d.mkdir()
    return small_config(d, root, loader={"world_size": world, "ranks": list(range(world)), "batch_size": batch},
                        buffer={"dir": str(tmp_path / "buffer")}, dataset={"cache_dir": str(tmp_path / "cache")})


def _read(loader: PrefetchClient, steps: int | None, seen: dict) -> None:
    """``steps`` batches of the current epoch (None: to its end), recording each sample's pixels
    (a sample seen twice in the epoch is kept twice)."""
    it = iter(loader)
    epoch = loader.epoch
    for k, (x, _) in enumerate(it):
        info = loader.last_batch
        assert info.epoch == epoch
        for i, img in zip(info.indices.tolist(), x, strict=True):
            seen.setdefault(i, []).append(np.array(img))
        if steps is not None and k + 1 == steps:
            break


def test_resume_at_2_then_3_then_1_reads_each_sample_of_the_epoch_once_with_the_one_rank_pixels(
        tmp_path, image_root, daemon_factory, caplog):
    caplog.set_level(logging.INFO, logger="prefetchd_client")
    # the pixels of every sample of epoch 0, from a one-rank job
    one = _config(tmp_path, "one", image_root, world=1, batch=6)
    d = daemon_factory(one)
    reference: dict = {}
    with PrefetchClient(one, timeout=60, as_numpy=True) as loader:
        _read(loader, None, reference)
    assert d.stop() == 0
    assert sorted(reference) == list(range(N))

    seen: dict = {}
    # world size 2, batches of 5 (4 per rank and epoch): each rank reads 2, so 20 samples are done
    two = _config(tmp_path, "two", image_root, world=2, batch=5)
    d = daemon_factory(two)
    states = []
    for r in (0, 1):
        with PrefetchClient(two, rank=r, timeout=60, as_numpy=True) as loader:
            _read(loader, 2, seen)
            states.append(loader.state_dict())
    assert d.stop() == 0
    assert [(s["epoch"], s["batch"], s["offset"], s["world_size"], s["batch_size"]) for s in states] == [
        (0, 2, 0, 2, 5)] * 2

    # world size 3, batches of 4: the other 28 samples, shared out as a whole epoch is (10 per
    # rank with the padding, 2 batches of 4 each); each rank reads 1 and saves
    three = _config(tmp_path, "three", image_root, world=3, batch=4)
    d = daemon_factory(three)
    loaders = [PrefetchClient(three, rank=r, timeout=60, as_numpy=True) for r in range(3)]
    try:
        for r, loader in enumerate(loaders):
            loader.load_state_dict(states[r % 2])  # any rank's state: they all saved the same step
            assert (loader.epoch, loader.batch, len(loader)) == (0, 0, 2)
            loader.set_epoch(0)  # the habit: the resumed epoch keeps its position
            assert loader.state_dict()["offset"] == 20 and len(loader) == 2
        for loader in loaders:
            _read(loader, 1, seen)
        states = [loader.state_dict() for loader in loaders]
    finally:
        for loader in loaders:
            loader.close()
    assert d.stop() == 0
    assert [(s["epoch"], s["batch"], s["offset"], s["world_size"], s["batch_size"]) for s in states] == [
        (0, 1, 20, 3, 4)] * 3
    lines = [r.getMessage() for r in caplog.records if r.name == "prefetchd_client"]
    assert lines.count("resuming epoch 0 at sample 20 of 48 with world size 3 (saved at 2), batch size 4 "
                       "(saved at 5)") == 3

    # one rank, batches of 5: resumes the state saved inside the shortened epoch, from sample
    # 20 + 3 x 4 = 32 to the end of the epoch (3 batches; drop_last leaves the 16th sample)
    single = _config(tmp_path, "single", image_root, world=1, batch=5)
    d = daemon_factory(single)
    with PrefetchClient(single, timeout=60, as_numpy=True) as loader:
        loader.load_state_dict(states[2])
        assert (loader.epoch, loader.batch, len(loader), loader.state_dict()["offset"]) == (0, 0, 3, 32)
        _read(loader, None, seen)
        assert (loader.epoch, loader.batch, len(loader)) == (1, 0, 9)  # then whole epochs, at one rank
        assert loader.state_dict()["offset"] == 0
        next(iter(loader))
        assert loader.last_batch.indices.tolist() == Sampler(N, 5, SEED).batch_indices(1, 0, 0).tolist()
    assert d.stop() == 0
    assert [r.getMessage() for r in caplog.records if r.name == "prefetchd_client"][-1] == (
        "resuming epoch 0 at sample 32 of 48 with world size 1 (saved at 3), batch size 5 (saved at 4)")

    twice = {i: len(v) for i, v in seen.items() if len(v) > 1}
    assert not twice, f"samples read twice in the epoch: {twice}"
    missing = set(range(N)) - set(seen)
    assert len(missing) < 1 * 5  # at most the last job's drop_last remainder (world 1 x batch 5)
    perm = Sampler(N, 5, SEED).permutation(0)
    assert missing == set(perm[N - len(missing):].tolist())  # exactly the epoch's last samples
    for i, (img,) in seen.items():
        assert np.array_equal(img, reference[i][0]), f"sample {i}'s pixels differ from the one-rank run's"


def test_ranks_resuming_at_different_steps_are_refused_with_nothing_lost(tmp_path, image_root, daemon_factory):
    three = _config(tmp_path, "three", image_root, world=3, batch=4)
    cfg = yaml.safe_load(open(three))
    buf = cfg["buffer"]["dir"]
    # states of a two-rank job (batches of 5) after 2 steps (sample 20) and after 1 step (sample 10)
    saved = {"epoch": 0, "world_size": 2, "batch_size": 5, "offset": 0, "rank": 0}
    d = daemon_factory(three)
    loaders = [PrefetchClient(three, rank=r, timeout=60, as_numpy=True) for r in range(3)]
    try:
        sample_fp = loaders[0].meta()["sample_fingerprint"]
        at20, at10 = ({**saved, "batch": b, "sample_fingerprint": sample_fp} for b in (2, 1))
        for loader in loaders:
            loader.load_state_dict(at20)
        wait_until(lambda: sum("-o0000000020-" in n for n in published(buf)) == 6, 60,
                   "the 6 batches of the resumed epoch")
        before = set(published(buf))
        agreed = loaders[1].state_dict()

        # rank 1 loads another step's state: the ranks disagree on where epoch 0 resumes
        loaders[1].timeout = 8
        loaders[1].load_state_dict(at10)
        with pytest.raises(PrefetchTimeout) as e:
            next(iter(loaders[1]))
        assert ("ranks disagree on where epoch 0 resumes: rank 0 reads it from sample 20, rank 1 from sample 10"
                in str(e.value)), str(e.value)
        assert "every rank must load the same checkpoint step" in d.log()
        after = set(published(buf))
        assert before <= after, f"deleted while the ranks disagreed: {sorted(before - after)}"
        assert not [n for n in after if "-o0000000010-" in n], "made for the disputed segmentation"

        # rank 1 loads the agreed state again: it reads on, and nothing it had was lost
        loaders[1].timeout = 60
        loaders[1].load_state_dict(agreed)
        expect = Sampler(N, 4, SEED, world_size=3)
        for r, loader in enumerate(loaders):
            got = [loader.last_batch.indices.tolist() for _ in loader]
            assert got == [expect.batch_indices(0, r, b, 20).tolist() for b in range(2)]
        assert "the ranks agree again" in d.log()
    finally:
        for loader in loaders:
            loader.close()
    assert d.stop() == 0


def test_a_state_of_other_samples_or_without_them_is_refused_at_another_world_size(tmp_path, image_root,
                                                                                   daemon_factory):
    three = _config(tmp_path, "three", image_root, world=3, batch=4)
    daemon_factory(three)
    with PrefetchClient(three, rank=0, timeout=60, as_numpy=True) as loader:
        old = {"epoch": 0, "batch": 1, "rank": 0, "world_size": 2, "fingerprint": "0123456789abcdef"}
        with pytest.raises(PrefetchError, match="does not say what its samples were"):
            loader.load_state_dict(old)
        with pytest.raises(PrefetchError, match="for samples ffffffffffffffff.*seed or augment settings changed"):
            loader.load_state_dict({**old, "batch_size": 4, "sample_fingerprint": "ffffffffffffffff"})
        assert (loader.epoch, loader.batch) == (0, 0)  # refused: the position did not move


def test_a_state_saved_with_another_drop_last_names_the_setting(tmp_path, image_root, daemon_factory):
    """Only loader.drop_last changed since the checkpoint: the refusal says so, with both values,
    not "dataset, loader or augment settings changed"."""
    def config(name: str, drop_last: bool) -> str:
        (tmp_path / name).mkdir()
        return small_config(tmp_path / name, image_root, loader={"batch_size": 5, "drop_last": drop_last},
                            buffer={"dir": str(tmp_path / "buffer")}, dataset={"cache_dir": str(tmp_path / "cache")})

    kept, dropped = config("kept", False), config("dropped", True)
    d = daemon_factory(kept)
    with PrefetchClient(kept, rank=0, timeout=60, as_numpy=True) as loader:
        state = loader.state_dict()
    assert d.stop() == 0
    daemon_factory(dropped)
    with PrefetchClient(dropped, rank=0, timeout=60, as_numpy=True) as loader:
        with pytest.raises(PrefetchError, match="loader.drop_last changed: false in the job that saved it, true in this "
                                                "config") as e:
            loader.load_state_dict(state)
        assert "dataset, loader or augment settings changed" not in str(e.value)
        assert (loader.epoch, loader.batch) == (0, 0)
