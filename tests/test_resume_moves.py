"""The trainer's moves of a resumed loader's position (issue 29), each found by the random walk
(``test_resume_walk``) and kept here as a plain test: moving back within a resumed epoch, loading
one state after another, a state's own geometry checked, rank 0's state on every rank."""

from __future__ import annotations

import pytest
import yaml
from conftest import small_config, wait_until
from prefetchd_client import PrefetchClient, PrefetchError
from test_daemon import published

from prefetchd.core.sampler import Sampler

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
