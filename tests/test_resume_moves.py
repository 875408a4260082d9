"""The trainer's moves of a resumed loader's position (issue 29), each found by the random walk
(``test_resume_walk``) and kept here as a plain test: moving back within a resumed epoch, loading
one state after another, a state's own geometry checked, rank 0's state on every rank."""

from __future__ import annotations

import json
import os

import pytest
import yaml
from conftest import small_config, wait_until
from prefetchd_client import PrefetchClient, PrefetchError
from test_daemon import published

from prefetchd.core.sampler import Sampler
from prefetchd.format.status import stream_id

N = 48  # conftest's image_root
SEED = 7  # small_config's loader.seed


def _config(tmp_path, name: str, root: str, world: int, batch: int, **loader) -> str:
    d = tmp_path / name
    d.mkdir()
    return small_config(d, root, loader={"world_size": world, "ranks": list(range(world)), "batch_size": batch,
                                         "epochs": None, **loader},
                        buffer={"dir": str(tmp_path / "buffer")}, dataset={"cache_dir": str(tmp_path / "cache")})


def _two_rank_state(loader: PrefetchClient, batch: int) -> dict:
    """What rank 0 of a job of 2 ranks x batches of 5 saves after ``batch`` steps of epoch 0."""
    return {"epoch": 0, "batch": batch, "rank": 0, "world_size": 2, "batch_size": 5, "offset": 0, "split": "train",
            "sample_fingerprint": loader.meta()["sample_fingerprint"]}


def _next_indices(loader: PrefetchClient) -> list[int]:
    next(iter(loader))
    return loader.last_batch.indices.tolist()


@pytest.fixture
def one_rank(tmp_path, image_root, daemon_factory):
    """A job of one rank, batches of 6 (8 per epoch), and its loader (a short timeout: a hang fails)."""
    cfg = _config(tmp_path, "one", image_root, world=1, batch=6)
    daemon_factory(cfg)
    with PrefetchClient(cfg, timeout=15, as_numpy=True) as loader:
        yield loader, yaml.safe_load(open(cfg))["buffer"]["dir"]


def _segment_published(buf: str, offset: int) -> None:
    """The daemon has taken the resumed segment from ``offset`` (it made files of it)."""
    wait_until(lambda: any(f"-o{offset:010d}-" in n for n in published(buf)), 60, f"batches of the segment from {offset}")


ONE = Sampler(N, 6, SEED)


def test_seeking_back_within_a_resumed_epoch_reads_there(one_rank):
    loader, _ = one_rank
    loader.load_state_dict(_two_rank_state(loader, 1))  # 10 samples done: 38 left, 6 batches of 6
    it = iter(loader)
    next(it)
    next(it)
    assert loader.batch == 2
    loader.seek(0, 3)  # batch 3 of the whole epoch: behind the resumed segment in the daemon's terms
    assert _next_indices(loader) == ONE.batch_indices(0, 0, 3).tolist()


def test_seek_to_the_epochs_start_right_after_a_resume_reads_there(one_rank):
    loader, buf = one_rank
    loader.load_state_dict(_two_rank_state(loader, 1))
    _segment_published(buf, 10)  # the daemon read the resume before the seek
    loader.seek(0, 0)
    assert _next_indices(loader) == ONE.batch_indices(0, 0, 0).tolist()


def test_loading_an_earlier_step_after_a_later_one_reads_the_earlier(one_rank):
    loader, buf = one_rank
    loader.load_state_dict(_two_rank_state(loader, 2))  # from sample 20
    _segment_published(buf, 20)
    loader.load_state_dict(_two_rank_state(loader, 1))  # the right checkpoint: from sample 10
    assert _next_indices(loader) == ONE.batch_indices(0, 0, 0, 10).tolist()


def test_a_record_into_another_segmentation_is_a_jump_even_in_the_same_session():
    """An older client keeps its session across a resume: the daemon takes the move all the same."""
    from prefetchd.daemon.sessions import Sessions
    from prefetchd.format.progress import Progress

    s = Sessions([0], 8, "fp")
    assert s.apply(0, Progress(0, 0, 6, session="a"), 0.0).batch == 6
    assert s.apply(0, Progress(0, 0, 2, session="a"), 0.0) is None  # back within a session: a stale copy
    move = s.apply(0, Progress(0, 0, 2, session="a"), 0.0, jump=True)
    assert (move.epoch, move.batch, move.consumed) == (0, 2, 0)


# --- a state is checked as the job that saved it cut the epoch (item 2) ---------------------------------


def _real_two_rank_state(loader: PrefetchClient, batch: int) -> dict:
    """``_two_rank_state`` as ``state_dict()`` writes it today: its stream and drop_last too."""
    fp = stream_id(loader.cfg.stream_fingerprint(world_size=2, batch_size=5, drop_last=True),
                   loader.meta()["dataset_fingerprint"])
    return {**_two_rank_state(loader, batch), "fingerprint": fp, "drop_last": True}


@pytest.mark.parametrize("bad, refused", [
    ({"batch": 50, "_sampler_iter_state": {"epoch": 0, "batch": 50}},
     "batch 50 of epoch 0, which has 4 batches in the job of world_size 2, batch_size 5 that saved it: past its end"),
    ({"world_size": 0}, "world_size must be positive, got 0"),
    ({"batch_size": 0}, "batch_size must be positive, got 0"),
    ({"fingerprint": "0123456789abcdef"}, "is for stream 0123456789abcdef, which is not this dataset's at world_size 2"),
    ({"drop_last": False}, "which is not this dataset's at world_size 2, batch_size 5"),
])
def test_a_state_of_another_world_size_is_checked_in_its_own_geometry(one_rank, bad, refused):
    loader, _ = one_rank
    good = _real_two_rank_state(loader, 2)
    with pytest.raises(PrefetchError, match=refused):
        loader.load_state_dict({**good, **bad})
    assert (loader.epoch, loader.batch, loader.state_dict()["offset"]) == (0, 0, 0)  # nothing moved
    loader.load_state_dict({**good, "batch": 4, "_sampler_iter_state": {"epoch": 0, "batch": 4}})  # its last
    assert (loader.epoch, loader.batch) == (0, 0) and loader.state_dict()["offset"] == 40


def test_a_state_without_drop_last_finds_it_by_its_fingerprint(tmp_path, image_root, daemon_factory):
    cfg = _config(tmp_path, "one", image_root, world=1, batch=6)
    daemon_factory(cfg)
    with PrefetchClient(cfg, timeout=15, as_numpy=True) as loader:
        fp = stream_id(loader.cfg.stream_fingerprint(world_size=3, batch_size=7, drop_last=False),
                       loader.meta()["dataset_fingerprint"])
        state = {**_two_rank_state(loader, 0), "world_size": 3, "batch_size": 7, "fingerprint": fp}
        # 16 samples per rank of 3: 3 batches of 7 with the short tail kept (2 with drop_last)
        loader.load_state_dict({**state, "batch": 2, "_sampler_iter_state": {"epoch": 0, "batch": 2}})
        assert loader.state_dict()["offset"] == 42
        with pytest.raises(PrefetchError, match="batch 4 of epoch 0, which has 3 batches"):
            loader.load_state_dict({**state, "batch": 4, "_sampler_iter_state": {"epoch": 0, "batch": 4}})


# --- one rule: rank 0's state on every rank, at the same world size too (item 5) ------------------------


def test_rank_0s_state_resumes_every_rank_at_the_same_world_size(tmp_path, image_root, daemon_factory):
    cfg = _config(tmp_path, "two", image_root, world=2, batch=5)
    daemon_factory(cfg)
    loaders = [PrefetchClient(cfg, rank=r, timeout=15, as_numpy=True) for r in range(2)]
    try:
        for ld in loaders:
            it = iter(ld)
            next(it)
            next(it)
            it.close()
        saved = loaders[0].state_dict()
        assert saved["_num_yielded"] == 2
        for ld in loaders:
            ld.seek(1, 3)
            ld.load_state_dict(saved)  # rank 0's, on rank 1 too
        two = Sampler(N, 5, SEED, world_size=2)
        assert [_next_indices(ld) for ld in loaders] == [two.batch_indices(0, r, 2).tolist() for r in range(2)]
    finally:
        for ld in loaders:
            ld.close()


# --- smaller (item 6) ---------------------------------------------------------------------------------


def test_a_resumed_rank_is_said_in_its_own_numbering_and_counts_the_whole_epoch(one_rank):
    loader, buf = one_rank
    loader.load_state_dict(_real_two_rank_state(loader, 2))  # from sample 20: 28 left, 4 batches of 6
    loader.prefetch = 1
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    assert (state["batch"], state["offset"], state["_num_yielded"]) == (1, 20, 8 - 4 + 1)

    def rank0():
        try:
            with open(os.path.join(buf, "status.json")) as f:
                return json.load(f)["ranks"]["0"]
        except (OSError, ValueError, KeyError):
            return None

    # the reader reads a batch or two ahead of the trainer: the rank reads batch 1 to 3 of its segment
    at = wait_until(lambda: (rank0() or {}).get("offset") == 20 and rank0()["position"][1] >= 1 and rank0(), 30,
                    "status.json to show the rank in its segment")
    assert at["position"][0] == 0 and 1 <= at["position"][1] < 4, at  # the daemon's own numbering: 5 to 7
    it.close()


def test_a_train_state_into_another_ranks_val_loader_names_the_split(tmp_path, image_root, val_image_root):
    cfg = small_config(tmp_path, image_root, loader={"world_size": 2, "ranks": [0, 1]},
                       validation={"enabled": True, "root": val_image_root, "batch_size": 4})
    with PrefetchClient(cfg, rank=1, split="val", timeout=15, as_numpy=True) as v:
        train0 = {"epoch": 0, "batch": 1, "rank": 0, "world_size": 2, "fingerprint": "0123456789abcdef",
                  "split": "train"}
        with pytest.raises(PrefetchError, match="split='train' loader's, this client reads split='val'"):
            v.load_state_dict(train0)
