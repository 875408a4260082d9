"""The real daemon on WebDataset shards: the batches made in-process, byte for byte, with 1 or 2
workers and across a restart; a resume on another world size reads each sample once with the
one-rank pixels; a shard rewritten in place while it runs makes its batches wait (said in the
log), never gives another sample's pixels, and a restart reads it anew."""

from __future__ import annotations

import io
import os
import tarfile

import numpy as np
import pytest
from conftest import small_config, wait_until
from prefetchd_client import PrefetchClient, PrefetchError
from test_daemon import collect, published, reference_batches
from test_shards import _add, _samples, write_shards

N = 36  # samples: 3 shards of 12


@pytest.fixture
def shards(tmp_path):
    samples = _samples(N, seed=11, classes=4)
    paths = write_shards(tmp_path / "wds", samples, per_shard=12)
    return str(tmp_path / "wds" / "train-{000000..000002}.tar"), paths, samples


def _config(tmp_path, name: str, root: str, **loader) -> str:
    d = tmp_path / name
    d.mkdir()
    return small_config(d, root, loader={"epochs": 2, **loader}, buffer={"dir": str(tmp_path / "buffer")},
                        dataset={"cache_dir": str(tmp_path / "cache")})


def test_shards_batches_are_the_in_process_ones_with_1_or_2_workers_and_after_a_restart(tmp_path, shards,
                                                                                       daemon_factory):
    root, _, _ = shards
    cfg = _config(tmp_path, "a", root)
    ref, index = reference_batches(cfg)
    assert index.layout == "webdataset" and len(index) == N
    for workers in (2, 1):
        c = small_config(tmp_path / "a", root, loader={"epochs": 2}, workers={"count": workers},
                         buffer={"dir": str(tmp_path / "buffer")}, dataset={"cache_dir": str(tmp_path / "cache")})
        d = daemon_factory(c)
        got = collect(c)
        assert d.stop() == 0
        assert sorted(got) == sorted(ref)
        for k in ref:
            assert np.array_equal(got[k][0], ref[k][0]) and np.array_equal(got[k][1], ref[k][1]), (workers, k)


def _read(loader, steps, seen: dict) -> None:
    for k, (x, _) in enumerate(iter(loader)):
        for i, img in zip(loader.last_batch.indices.tolist(), x, strict=True):
            seen.setdefault(i, []).append(np.array(img))
        if steps is not None and k + 1 == steps:
            break


def test_a_resume_on_another_world_size_reads_each_sample_once_with_the_one_rank_pixels(tmp_path, shards,
                                                                                        daemon_factory):
    root, _, _ = shards
    one = _config(tmp_path, "one", root, world_size=1, ranks=[0], batch_size=6)
    d = daemon_factory(one)
    reference: dict = {}
    with PrefetchClient(one, timeout=60, as_numpy=True) as loader:
        _read(loader, None, reference)
    assert d.stop() == 0 and sorted(reference) == list(range(N))
    two = _config(tmp_path, "two", root, world_size=2, ranks=[0, 1], batch_size=5)
    d = daemon_factory(two)
    seen: dict = {}
    states = []
    for r in (0, 1):
        with PrefetchClient(two, rank=r, timeout=60, as_numpy=True) as loader:
            _read(loader, 2, seen)
            states.append(loader.state_dict())
    assert d.stop() == 0
    single = _config(tmp_path, "single", root, world_size=1, ranks=[0], batch_size=4)
    d = daemon_factory(single)
    with PrefetchClient(single, timeout=60, as_numpy=True) as loader:
        loader.load_state_dict(states[0])
        _read(loader, None, seen)
    assert d.stop() == 0
    assert all(len(v) == 1 for v in seen.values()), "a sample read twice in one epoch"
    assert len(seen) == N  # 20 before the resume, 16 after (4 batches of 4)
    for i, (img,) in seen.items():
        assert np.array_equal(img, reference[i][0]), i


def _rewrite_reversed(path: str, samples) -> None:
    """``path`` rewritten in place with its members in reverse order: the same size and inode,
    other bytes at every indexed offset."""
    size = os.path.getsize(path)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as t:
        for key, jpg, lab in samples[::-1]:
            _add(t, key + ".jpg", jpg)
            _add(t, key + ".cls", str(lab).encode())
    data = buf.getvalue()
    assert len(data) <= size
    with open(path, "r+b") as f:
        f.write(data.ljust(size, b"\0"))


def test_a_shard_rewritten_while_the_daemon_runs_waits_and_a_restart_reads_it_anew(tmp_path, shards,
                                                                                  daemon_factory):
    root, paths, samples = shards
    cfg = _config(tmp_path, "a", root, epochs=1, shuffle=False)  # batches 0-3: shards 0 and 1; 4-5: shard 2
    ref, _ = reference_batches(cfg, epochs=1)
    d = daemon_factory(cfg)
    wait_until(lambda: len(published(str(tmp_path / "buffer"))) >= 4, 60, "4 batches in the buffer")
    _rewrite_reversed(paths[2], samples[24:])
    with PrefetchClient(cfg, timeout=60, as_numpy=True) as loader:
        for b, (x, _) in enumerate(loader.iter_epoch(0)):
            assert np.array_equal(np.ascontiguousarray(x.transpose(0, 2, 3, 1)), ref[(0, 0, b)][0])
            if b == 3:
                break
        wait_until(lambda: "changed since it was indexed" in d.log(), 60, "the daemon to say the shard changed")
        # batch 3 goes once the daemon reads that it was consumed; batch 4 waits: nothing made of the moved bytes
        wait_until(lambda: not published(str(tmp_path / "buffer")), 30, "an empty buffer (batch 3 evicted, 4 not made)")
    assert d.stop() == 0
    ref2, index = reference_batches(cfg, epochs=1)  # indexed anew: shard 2's samples in their new order
    assert index.relpath(24) == "train-000002.tar/" + samples[-1][0] + ".jpg"
    d = daemon_factory(cfg)
    got = collect(cfg, epochs=(0,))
    assert d.stop() == 0
    for k in ref2:
        assert np.array_equal(got[k][0], ref2[k][0]) and np.array_equal(got[k][1], ref2[k][1]), k
    assert not np.array_equal(ref2[(0, 0, 4)][0], ref[(0, 0, 4)][0])


def _hf_files(folder, rows, group: int) -> None:
    """``rows`` as Hugging Face writes a split: two files, ``train-0000k-of-00002.parquet``, in row
    groups of ``group`` rows."""
    pq = pytest.importorskip("pyarrow.parquet")
    from test_parquet import hf_table

    os.makedirs(folder)
    half = len(rows) // 2
    for k in range(2):
        pq.write_table(hf_table(rows[half * k:half * k + half]), folder / f"train-{k:05d}-of-00002.parquet",
                       row_group_size=group)


def test_parquet_batches_are_the_in_process_ones_with_2_workers(tmp_path, daemon_factory):
    pytest.importorskip("pyarrow.parquet")
    from test_parquet import _rows

    _hf_files(tmp_path / "hf", _rows(30, seed=12), group=5)
    cfg = _config(tmp_path, "p", str(tmp_path / "hf"))
    ref, index = reference_batches(cfg)
    assert index.kind == "parquet" and len(index) == 30
    d = daemon_factory(cfg)
    got = collect(cfg)
    assert d.stop() == 0
    assert sorted(got) == sorted(ref)
    for k in ref:
        assert np.array_equal(got[k][0], ref[k][0]) and np.array_equal(got[k][1], ref[k][1]), k


def test_parquet_block_shuffle_batches_are_the_in_process_ones_with_1_or_2_workers_and_after_a_restart(
        tmp_path, daemon_factory):
    """``loader.shuffle: block`` on Parquet: the daemon's batches are the sampler's block order,
    the same with 1 and 2 workers and across a restart mid-epoch; ``check`` says which shuffle
    the layout gets, and refuses a block shuffle of an ImageFolder in one line."""
    import subprocess
    import sys

    pytest.importorskip("pyarrow.parquet")
    from test_parquet import _rows

    _hf_files(tmp_path / "hf", _rows(40, seed=13), group=4)
    root = str(tmp_path / "hf")
    cfg = _config(tmp_path, "p", root, shuffle="block", shuffle_window=2)
    ref, index = reference_batches(cfg)
    assert list(index.block_sizes()) == [4] * 10
    r = subprocess.run([sys.executable, "-m", "prefetchd", "check", "--config", cfg], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "shuffle: block: 10 row groups permuted each epoch" in r.stdout, r.stdout + r.stderr
    for workers in (1, 2):
        c = small_config(tmp_path / "p", root, loader={"epochs": 2, "shuffle": "block", "shuffle_window": 2},
                         workers={"count": workers}, buffer={"dir": str(tmp_path / "buffer")},
                         dataset={"cache_dir": str(tmp_path / "cache")})
        d = daemon_factory(c)
        got = collect(c, epochs=(0,))
        if workers == 2:  # a restart: epoch 1's batches, read by a daemon started afresh (mid-epoch: the test below)
            assert d.stop() == 0
            d = daemon_factory(c)
        got.update(collect(c, epochs=(1,)))
        assert d.stop() == 0
        assert sorted(got) == sorted(ref)
        for k in ref:
            assert np.array_equal(got[k][0], ref[k][0]) and np.array_equal(got[k][1], ref[k][1]), (workers, k)
    folder = _config(tmp_path, "f", str(tmp_path / "hf"), shuffle="block")
    with open(folder) as f:
        text = f.read()
    from prefetchd.tools.samples import make_image_folder

    make_image_folder(str(tmp_path / "imgs"), classes=2, per_class=4, seed=1, long_side=64)
    with open(folder, "w") as f:
        f.write(text.replace(str(tmp_path / "hf"), str(tmp_path / "imgs")))
    r = subprocess.run([sys.executable, "-m", "prefetchd", "check", "--config", folder], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and "loader.shuffle block needs a layout read in blocks" in r.stderr + r.stdout
    assert len((r.stderr + r.stdout).strip().splitlines()) == 1, r.stderr + r.stdout


def test_a_block_shuffle_reads_each_row_group_a_few_times_not_once_per_row():
    """The read amplification the block shuffle exists for, measured with the reader's own
    counter: an epoch read in the block order, in one process keeping a window of row groups,
    against the full permutation's."""
    pq = pytest.importorskip("pyarrow.parquet")
    import tempfile

    from test_parquet import EXTS, _rows, hf_table

    from prefetchd.core.configsections import LoaderConfig
    from prefetchd.core.sampler import for_loader
    from prefetchd.sources import parquet
    from prefetchd.sources.dataset import load_index

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "x.parquet")
        pq.write_table(hf_table(_rows(240, seed=14)), path, row_group_size=20)
        index, _ = load_index(path, None, EXTS, None, use_cache=False)
        image_bytes = sum(len(index.read(i)) for i in range(len(index)))
        read = {}
        for shuffle in (True, "block"):
            L = LoaderConfig(batch_size=16, shuffle=shuffle, **({"shuffle_window": 3} if shuffle == "block" else {}))
            perm = for_loader(L, len(index), index.block_sizes()).permutation(0)
            parquet.keep_groups(3) if shuffle == "block" else parquet.keep_groups(0)
            parquet._groups.clear()
            before = parquet._read_bytes[0]
            for i in perm:
                index.read(int(i))
            read[shuffle] = (parquet._read_bytes[0] - before) / image_bytes
        parquet.keep_groups(0)
    # measured here: 0.75 (block; the column chunks are compressed) against 10.7 (full, 20 rows a group)
    assert read["block"] < 1.3 and read[True] > 3 * read["block"], read


def test_a_block_shuffles_stream_names_its_row_groups():
    """The same rows in other row groups make another block order: the dataset's part of the
    stream's identity differs under ``loader.shuffle: block`` (a restart or a resume does not take
    the old order's batches or state for the new one), and stays the index's under a full shuffle."""
    pq = pytest.importorskip("pyarrow.parquet")
    import tempfile

    from test_parquet import EXTS, _rows, hf_table

    from prefetchd.core.configsections import LoaderConfig
    from prefetchd.core.sampler import for_index
    from prefetchd.sources.dataset import load_index

    rows = _rows(40, seed=15)
    with tempfile.TemporaryDirectory() as d:
        got = {}
        for size in (4, 8):
            path = os.path.join(d, f"g{size}", "x.parquet")
            os.makedirs(os.path.dirname(path))
            pq.write_table(hf_table(rows), path, row_group_size=size)
            index, _ = load_index(path, None, EXTS, None, use_cache=False)
            got[size] = [index.fingerprint] + [for_index(LoaderConfig(batch_size=4, shuffle=s), index)
                                               .dataset_fingerprint(index.fingerprint) for s in (True, "block")]
    assert got[4][0] == got[8][0]  # the index names the same rows either way
    assert got[4][1] == got[4][0] and got[8][1] == got[8][0]  # a full shuffle: the index's
    assert got[4][2] != got[8][2] and got[4][2] != got[4][0]


def test_a_block_shuffled_parquet_epoch_resumed_on_another_world_size_reads_each_row_once(tmp_path, daemon_factory):
    """``loader.shuffle: block``: 2 ranks read 2 batches each, their state goes to 1 rank of
    another batch size, which reads the rest: every row once in the epoch, its pixels those of
    an unbroken 1-rank run."""
    pq = pytest.importorskip("pyarrow.parquet")
    from test_parquet import _rows, hf_table

    os.makedirs(tmp_path / "hf")
    pq.write_table(hf_table(_rows(40, seed=16)), tmp_path / "hf" / "x.parquet", row_group_size=4)
    root = str(tmp_path / "hf")
    block = {"shuffle": "block", "shuffle_window": 3, "epochs": 1}
    one = _config(tmp_path, "one", root, world_size=1, ranks=[0], batch_size=6, **block)
    d = daemon_factory(one)
    reference: dict = {}
    with PrefetchClient(one, timeout=60, as_numpy=True) as loader:
        _read(loader, None, reference)
    assert d.stop() == 0 and len(reference) == 36  # 6 batches of 6 (drop_last)
    two = _config(tmp_path, "two", root, world_size=2, ranks=[0, 1], batch_size=5, **block)
    d = daemon_factory(two)
    seen: dict = {}
    states = []
    for r in (0, 1):
        with PrefetchClient(two, rank=r, timeout=60, as_numpy=True) as loader:
            _read(loader, 2, seen)
            states.append(loader.state_dict())
    assert d.stop() == 0
    single = _config(tmp_path, "single", root, world_size=1, ranks=[0], batch_size=4, **block)
    d = daemon_factory(single)
    with PrefetchClient(single, timeout=60, as_numpy=True) as loader:
        loader.load_state_dict(states[0])
        _read(loader, None, seen)
    assert d.stop() == 0
    assert all(len(v) == 1 for v in seen.values()), "a row read twice in one epoch"
    assert len(seen) == 40  # 20 before the resume, 20 after (5 batches of 4)
    for i, (img,) in seen.items():
        if i in reference:
            assert np.array_equal(img, reference[i][0]), i


def test_check_warns_when_a_block_shuffle_meets_rows_grouped_by_label(tmp_path):
    """Class-sorted Parquet (as many exports are) under ``shuffle: block``: every window, so every
    batch, holds few classes; ``check`` says so with the numbers, and not for rows in no order."""
    import subprocess
    import sys

    pq = pytest.importorskip("pyarrow.parquet")
    from test_parquet import _rows, hf_table

    rows = _rows(60, seed=17)
    for name, order in (("sorted", sorted(rows, key=lambda r: r[1])), ("mixed", rows)):
        os.makedirs(tmp_path / name)
        pq.write_table(hf_table(order), tmp_path / name / "x.parquet", row_group_size=5)
        cfg = _config(tmp_path, "c" + name, str(tmp_path / name), shuffle="block", shuffle_window=1, batch_size=4)
        r = subprocess.run([sys.executable, "-m", "prefetchd", "check", "--config", cfg], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        said = "the files' rows are grouped by label" in r.stdout
        assert said == (name == "sorted"), r.stdout


def test_check_does_not_call_rows_in_no_order_grouped_when_one_label_dominates(tmp_path):
    """200 labels, 80% of the rows one of them, in no order: a window of ~80 rows holds ~16 labels,
    what rows drawn at random from these labels hold; ``check`` compared that with ~64 (every
    label equally common) and said the rows were grouped by label. The same rows sorted by
    label are still said to be."""
    import subprocess
    import sys

    pq = pytest.importorskip("pyarrow.parquet")
    from test_parquet import hf_table

    from prefetchd.tools.samples import jpeg_bytes, photo_like

    rng = np.random.default_rng(20)
    image = jpeg_bytes(photo_like(rng, 40, 32), rng)
    labels = np.where(rng.random(2000) < 0.8, 0, rng.integers(1, 200, 2000))
    names = [f"c{k}" for k in range(200)]
    for name, order in (("mixed", labels), ("sorted", np.sort(labels))):
        os.makedirs(tmp_path / name)
        pq.write_table(hf_table([(image, int(x)) for x in order], names=names), tmp_path / name / "x.parquet",
                       row_group_size=10)
        cfg = _config(tmp_path, "c" + name, str(tmp_path / name), shuffle="block", batch_size=8)
        r = subprocess.run([sys.executable, "-m", "prefetchd", "check", "--config", cfg], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        said = "the files' rows are grouped by label" in r.stdout
        assert said == (name == "sorted"), r.stdout


def test_a_state_saved_under_another_shuffle_names_it_at_the_same_and_another_batch_size(tmp_path, daemon_factory):
    """A checkpoint of ``loader.shuffle: true`` loaded after a switch to ``block`` (or to another
    ``shuffle_window``): the refusal names the setting with both values, as a switch of true and
    false does, not "dataset, loader or augment settings changed", at the job's own batch size
    and at another (where the samples' fingerprint is compared)."""
    pq = pytest.importorskip("pyarrow.parquet")
    from test_parquet import _rows, hf_table

    os.makedirs(tmp_path / "hf")
    pq.write_table(hf_table(_rows(24, seed=17)), tmp_path / "hf" / "x.parquet", row_group_size=4)
    root = str(tmp_path / "hf")
    full = _config(tmp_path, "full", root, batch_size=4)
    d = daemon_factory(full)
    with PrefetchClient(full, timeout=60, as_numpy=True) as loader:
        next(iter(loader))
        state = loader.state_dict()
    assert d.stop() == 0
    for name, loader_keys, said in (
            ("block", {"batch_size": 4}, r"loader.shuffle changed: true in the job that saved it, block \(shuffle_window "
                                         r"8\) in this config"),
            ("resharded", {"batch_size": 3}, r"\(loader.shuffle changed: true in the job that saved it, block"),
            ("window", {"batch_size": 4, "shuffle_window": 2}, None)):
        cfg = _config(tmp_path, name, root, shuffle="block", **loader_keys)
        d = daemon_factory(cfg)
        with PrefetchClient(cfg, timeout=60, as_numpy=True) as loader:
            assert loader.sampler.shuffle is True  # DistributedSampler's is a bool (it was "block")
            if said is None:  # a state of the block shuffle at window 8, loaded at window 2
                state = dict(state, shuffle="block:8", fingerprint=loader.state_dict()["fingerprint"][::-1])
                said = r"loader.shuffle_window changed: 8 in the job that saved it, 2 in this config"
            with pytest.raises(PrefetchError, match=said) as e:
                loader.load_state_dict(state)
            assert "settings changed" not in str(e.value), str(e.value)
        assert d.stop() == 0


def test_a_state_saved_before_a_parquet_file_was_added_says_the_dataset_changed(tmp_path, daemon_factory):
    """A block-shuffled Parquet folder gains a file between runs: the checkpoint is refused (its
    order is not this dataset's), and the refusal says the dataset changed, with both lengths,
    not "dataset, loader or augment settings changed"."""
    pq = pytest.importorskip("pyarrow.parquet")
    from test_parquet import _rows, hf_table

    os.makedirs(tmp_path / "hf")
    pq.write_table(hf_table(_rows(24, seed=18)), tmp_path / "hf" / "a.parquet", row_group_size=4)
    cfg = _config(tmp_path, "c", str(tmp_path / "hf"), batch_size=4, shuffle="block", shuffle_window=2)
    d = daemon_factory(cfg)
    with PrefetchClient(cfg, timeout=60, as_numpy=True) as loader:
        next(iter(loader))
        state = loader.state_dict()
    assert d.stop() == 0
    pq.write_table(hf_table(_rows(8, seed=19)), tmp_path / "hf" / "b.parquet", row_group_size=4)
    d = daemon_factory(cfg)
    with PrefetchClient(cfg, timeout=60, as_numpy=True) as loader:
        with pytest.raises(PrefetchError, match="the dataset changed: 32 samples now, 24 when the state was saved: "
                                                "files were added or removed") as e:
            loader.load_state_dict(state)
        assert "settings changed" not in str(e.value) and "as it was" not in str(e.value)
        assert (loader.epoch, loader.batch) == (0, 0)
    assert d.stop() == 0
