"""Parquet as Hugging Face stores image datasets: written by pyarrow in the HF schema (and by
``datasets`` where it is installed), read back row for row; class names from the ClassLabel
metadata; the odd files one line each; a file rewritten after it was indexed is never read as
other rows."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from prefetchd.sources.base import DatasetError, StorageChanged
from prefetchd.sources.dataset import load_index
from prefetchd.tools.samples import jpeg_bytes, photo_like

pa = pytest.importorskip("pyarrow")  # the dev extra installs it; prefetchd[parquet] for users
pq = pytest.importorskip("pyarrow.parquet")

EXTS = (".jpeg", ".jpg", ".png")
NAMES = ["tench", "goldfish", "shark"]


def _rows(n: int, seed: int = 0) -> list[tuple[bytes, int]]:
    rng = np.random.default_rng(seed)
    return [(jpeg_bytes(photo_like(rng, 40, 32), rng), int(rng.integers(0, len(NAMES)))) for _ in range(n)]


def hf_table(rows, names=NAMES):
    """A table in the schema ``datasets`` writes for Image() and ClassLabel() features."""
    image = pa.array([{"bytes": b, "path": f"{k}.jpg"} for k, (b, _) in enumerate(rows)],
                     pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    label = pa.array([lab for _, lab in rows], pa.int64())
    features = {"image": {"_type": "Image"}, "label": {"names": names, "_type": "ClassLabel"}}
    meta = {b"huggingface": json.dumps({"info": {"features": features}}).encode()}
    return pa.table({"image": image, "label": label}).replace_schema_metadata(meta)


def _indexed(tmp_path, n: int, seed: int, group: int = 4):
    """``n`` rows written to ``tmp_path/x.parquet`` in row groups of ``group``, and their index
    (not cached): (rows, path, index)."""
    rows = _rows(n, seed=seed)
    path = tmp_path / "x.parquet"
    pq.write_table(hf_table(rows), path, row_group_size=group)
    return rows, path, load_index(str(path), None, EXTS, None, use_cache=False)[0]


def _read_all(index):
    return [(index.read(i), int(index.labels[i])) for i in range(len(index))]


def test_hf_schema_parquet_reads_back_row_for_row_with_class_names(tmp_path):
    rows = _rows(25)
    os.makedirs(tmp_path / "hf")
    pq.write_table(hf_table(rows[:10]), tmp_path / "hf" / "train-00000-of-00002.parquet", row_group_size=4)
    pq.write_table(hf_table(rows[10:]), tmp_path / "hf" / "train-00001-of-00002.parquet", row_group_size=4)
    index, cached = load_index(str(tmp_path / "hf"), None, EXTS, str(tmp_path / "c"))
    assert not cached and index.kind == "parquet" and "2 Parquet file(s)" in index.describe()
    assert index.classes == tuple(NAMES) and _read_all(index) == rows
    again, cached = load_index(str(tmp_path / "hf" / "train-*.parquet"), None, EXTS, str(tmp_path / "c2"))
    assert _read_all(again) == rows and again.fingerprint == index.fingerprint
    third, cached = load_index(str(tmp_path / "hf"), None, EXTS, str(tmp_path / "c"))
    assert cached and _read_all(third) == rows


def test_a_binary_image_column_and_other_column_names(tmp_path):
    rows = _rows(6, seed=1)
    t = pa.table({"jpg": pa.array([b for b, _ in rows], pa.binary()), "y": pa.array([lab for _, lab in rows])})
    pq.write_table(t, tmp_path / "x.parquet", row_group_size=2)
    index, _ = load_index(str(tmp_path / "x.parquet"), None, EXTS, None, use_cache=False, image_column="jpg",
                          label_column="y")
    assert _read_all(index) == rows and index.classes == tuple(str(i) for i in range(max(r[1] for r in rows) + 1))


def test_unlabelled_rows_are_skipped_with_their_reason(tmp_path):
    rows = _rows(4, seed=2)
    t = hf_table(rows)
    t = t.set_column(1, "label", pa.array([0, -1, None, 2], pa.int64()))
    pq.write_table(t, tmp_path / "x.parquet")
    index, _ = load_index(str(tmp_path / "x.parquet"), None, EXTS, None, use_cache=False)
    assert [b for b, _ in _read_all(index)] == [rows[0][0], rows[3][0]] and list(index.labels) == [0, 2]
    assert any("row 1 (label -1" in s for s in index.skipped) and any("row 2 (label null" in s for s in index.skipped)


def test_datasets_written_parquet_reads_as_datasets_reads_it(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = _rows(5, seed=3)
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=NAMES)})
    ds = datasets.Dataset.from_dict({"image": [{"bytes": b, "path": None} for b, _ in rows],
                                     "label": [lab for _, lab in rows]}, features=features)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    index, _ = load_index(str(tmp_path / "d.parquet"), None, EXTS, None, use_cache=False)
    back = datasets.Dataset.from_parquet(str(tmp_path / "d.parquet")).cast_column("image", datasets.Image(decode=False))
    assert _read_all(index) == [(r["image"]["bytes"], r["label"]) for r in back] == rows
    assert index.classes == tuple(NAMES)


def _error(root, **kw) -> str:
    with pytest.raises(DatasetError) as e:
        load_index(str(root), None, EXTS, None, use_cache=False, **kw)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_odd_parquet_files_each_get_one_line(tmp_path):
    rows = _rows(3, seed=4)
    pq.write_table(pa.table({"img": pa.array([b for b, _ in rows]), "label": pa.array([0, 1, 2])}), tmp_path / "a.parquet")
    assert "has no column 'image' (its columns: img, label): set dataset.image_column" in _error(tmp_path / "a.parquet")
    pq.write_table(pa.table({"image": pa.array(["x", "y", "z"]), "label": pa.array([0, 1, 2])}), tmp_path / "b.parquet")
    assert "column 'image' is string, not binary nor struct<bytes" in _error(tmp_path / "b.parquet")
    pq.write_table(hf_table(rows), tmp_path / "c.parquet")
    data = (tmp_path / "c.parquet").read_bytes()
    (tmp_path / "c.parquet").write_bytes(data[:-8] + (len(data) * 3).to_bytes(4, "little") + b"PAR1")  # footer length
    assert "c.parquet is not a readable Parquet file" in _error(tmp_path / "c.parquet")
    (tmp_path / "c.parquet").write_bytes(data[:len(data) // 2])  # a cut copy: no footer at all
    assert "c.parquet is not a readable Parquet file" in _error(tmp_path / "c.parquet")
    assert "matches no files" in _error(tmp_path / "none-*.parquet")


def test_a_file_rewritten_after_indexing_is_never_read_as_other_rows(tmp_path):
    rows = _rows(8, seed=5)
    path = tmp_path / "x.parquet"
    pq.write_table(hf_table(rows), path, row_group_size=4)
    index, _ = load_index(str(path), None, EXTS, None, use_cache=False)
    pq.write_table(hf_table(rows[::-1]), path, row_group_size=4)  # the rows in another order
    with pytest.raises(StorageChanged, match="changed since it was indexed"):
        index.read(0)


def test_check_says_it_found_parquet_and_what_a_read_costs(tmp_path):
    import subprocess
    import sys

    from conftest import small_config

    pq.write_table(hf_table(_rows(12, seed=6)), tmp_path / "x.parquet", row_group_size=4)
    cfg = small_config(tmp_path, str(tmp_path / "x.parquet"))
    r = subprocess.run([sys.executable, "-m", "prefetchd", "check", "--config", cfg], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 Parquet file(s)" in r.stdout and "3 row groups of ~4 rows" in r.stdout and "dataset: 12 samples" in r.stdout
    assert "classes: 3 classes: tench, goldfish, shark" in r.stdout


def test_one_corpus_as_folder_shards_and_parquet_gives_one_multiset_of_labels_and_bytes(tmp_path):
    """The packers of ``prefetchd.tools.bench.tarscale`` (what BENCHMARKS.md compares) write the same
    images and labels in each layout: per class name, the same multiset of image bytes."""
    from prefetchd.tools.bench.tarscale import pack_parquet, pack_shards
    from prefetchd.tools.samples import make_image_folder

    make_image_folder(str(tmp_path / "f"), classes=3, per_class=7, seed=2, long_side=48)
    pack_shards(str(tmp_path / "f"), str(tmp_path / "wds"), per_shard=5)
    pack_parquet(str(tmp_path / "f"), str(tmp_path / "p.parquet"), row_group=4)
    seen = []
    for root in ("f", "wds", "p.parquet"):
        index, _ = load_index(str(tmp_path / root), None, EXTS, None, use_cache=False)
        seen.append(sorted((index.classes[int(index.labels[i])] if root != "wds" else
                            f"n{int(index.labels[i]):08d}", index.read(i)) for i in range(len(index))))
    assert len(seen[0]) == 21 and seen[0] == seen[1] == seen[2]


def test_a_file_added_to_the_folder_or_the_glob_is_indexed_not_hidden_by_the_cache(tmp_path):
    rows = _rows(12, seed=3)
    os.makedirs(tmp_path / "hf")
    pq.write_table(hf_table(rows[:6]), tmp_path / "hf" / "train-00000.parquet", row_group_size=4)
    for root in (str(tmp_path / "hf"), str(tmp_path / "hf" / "train-*.parquet")):
        first, cached = load_index(root, None, EXTS, str(tmp_path / "c"))
        assert len(first) == 6
    pq.write_table(hf_table(rows[6:]), tmp_path / "hf" / "train-00001.parquet", row_group_size=4)
    for root in (str(tmp_path / "hf"), str(tmp_path / "hf" / "train-*.parquet")):
        again, cached = load_index(root, None, EXTS, str(tmp_path / "c"))
        assert not cached and _read_all(again) == rows
        third, cached = load_index(root, None, EXTS, str(tmp_path / "c"))
        assert cached and len(third) == 12


def test_a_damaged_row_group_of_the_indexed_file_quarantines_its_samples_not_waits(tmp_path, monkeypatch):
    """pyarrow failing on a row group of the file as indexed (same inode, size and times) is the
    samples' fault: ``read_sample`` says they are unreadable, so the worker quarantines them and
    training goes on, rather than waiting for a restart that would meet the same damage. The
    same failure after the file changed is ``StorageChanged``: its batches wait."""
    from prefetchd.executors.storage import SampleUnreadable, StorageUnavailable, read_sample

    rows, path, index = _indexed(tmp_path, 8, seed=5)
    real = pq.ParquetFile.read_row_group

    def damaged(self, i, *a, **kw):  # pyarrow's error for a bad page, raised for row group 1 alone
        if i == 1:
            raise pa.ArrowInvalid("Corrupt snappy compressed data.")
        return real(self, i, *a, **kw)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", damaged)
    assert [read_sample(lambda i=i: index.read(i), str(path)) for i in range(4)] == [b for b, _ in rows[:4]]
    with pytest.raises(SampleUnreadable, match=r"row group 1 .* \(Corrupt snappy compressed data.\)"):
        read_sample(lambda: index.read(5), str(path))
    os.utime(path, ns=(1, 1))  # the file is no longer the one indexed
    with pytest.raises(StorageUnavailable, match="changed since it was indexed"):
        read_sample(lambda: index.read(6), str(path))


def test_pyarrow_out_of_memory_is_not_taken_for_a_damaged_row_group(tmp_path, monkeypatch):
    from prefetchd.executors.storage import read_sample

    _, path, index = _indexed(tmp_path, 8, seed=6)

    def oom(self, i, *a, **kw):
        raise pa.ArrowMemoryError("malloc of size 1073741824 failed")

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", oom)
    with pytest.raises(MemoryError):  # the worker's failure, not the samples' (never quarantined for it)
        read_sample(lambda: index.read(5), str(path))


def test_the_row_groups_a_worker_keeps_are_bounded_in_bytes_too(tmp_path, monkeypatch):
    from prefetchd.sources import parquet

    _, _, index = _indexed(tmp_path, 40, seed=7)
    parquet._groups.clear()
    monkeypatch.setattr(parquet, "_GROUPS_KEPT", 10)
    one = None
    for i in range(0, 40, 4):
        index.read(i)
        one = one or next(iter(parquet._groups.values())).nbytes
    assert len(parquet._groups) == 10
    monkeypatch.setattr(parquet, "_BYTES_KEPT", int(2.5 * one))
    parquet._groups.clear()
    for i in range(0, 40, 4):
        index.read(i)
        assert sum(c.nbytes for c in parquet._groups.values()) <= 2.5 * one * 1.2
    assert [k[1] for k in parquet._groups] == [8, 9]  # the newest two, by bytes (the count allows 10)
    parquet._groups.clear()


@pytest.mark.parametrize("group, window", [(4, 3), (4, 100), (12, 8)])
def test_check_says_a_window_of_every_row_group_is_a_full_shuffle(tmp_path, group, window):
    """``loader.shuffle_window`` at least the row-group count (a window of 100 over 3 groups, or
    one group): ``check`` says every row is permuted together, not "~400 rows permuted together"
    of a 12-row file; and "1 row group", not "1 row groups"."""
    import subprocess
    import sys

    from conftest import small_config

    pq.write_table(hf_table(_rows(12, seed=6)), tmp_path / "x.parquet", row_group_size=group)
    cfg = small_config(tmp_path, str(tmp_path / "x.parquet"), loader={"batch_size": 2, "shuffle": "block",
                                                                      "shuffle_window": window})
    r = subprocess.run([sys.executable, "-m", "prefetchd", "check", "--config", cfg], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    said = next(line for line in r.stdout.splitlines() if line.startswith("shuffle: block"))
    groups = 12 // group
    if window < groups:
        assert f"{groups} row groups permuted each epoch, then the rows of each {window} consecutive" in said, said
    else:
        assert f"loader.shuffle_window {window} is at least the {groups} row group" in said, said
        assert "all 12 rows together" in said and "consecutive" not in said, said
    assert ("1 row group of ~12 rows" if groups == 1 else f"{groups} row groups of ~{group} rows") in r.stdout
