"""Parquet as users have it, against what pyarrow and Hugging Face ``datasets`` read from the same
files: images kept by path only (``Dataset.to_parquet`` of images loaded from files), rows without
image bytes, a folder of several splits (``mnist/``: train and test), huggingface_hub's ``.cache``
beside the files, labels as strings, other Arrow types. Each reads as the reference reads it (same
rows, same labels) or is one line saying what to change, and doing what it says works."""

from __future__ import annotations

import os

import numpy as np
import pytest

from prefetchd.sources.base import DatasetError
from prefetchd.sources.dataset import load_index
from prefetchd.tools.samples import jpeg_bytes, photo_like

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

EXTS = (".jpeg", ".jpg", ".png")


def _jpgs(n: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [jpeg_bytes(photo_like(rng, 24, 20), rng) for _ in range(n)]


def _ours(root, **kw) -> list[tuple[bytes, int]]:
    index, _ = load_index(str(root), None, EXTS, None, use_cache=False, **kw)
    assert index.kind == "parquet"
    return [(index.read(i), int(index.labels[i])) for i in range(len(index))]


def _error(root, **kw) -> str:
    with pytest.raises(DatasetError) as e:
        load_index(str(root), None, EXTS, None, use_cache=False, **kw)
    assert "\n" not in str(e.value)
    return str(e.value)


def _pyarrow_reads(paths, image="image", label="label") -> list[tuple[bytes, int]]:
    """Rows with image bytes and a label, as pyarrow reads them, file by file."""
    out = []
    for p in paths:
        t = pq.read_table(p)
        for img, lab in zip(t.column(image).to_pylist(), t.column(label).to_pylist(), strict=True):
            data = img.get("bytes") if isinstance(img, dict) else img
            if data and lab is not None and lab >= 0:
                out.append((data, lab))
    return out


def test_datasets_to_parquet_of_images_from_files_is_one_line_and_its_advice_works(tmp_path):
    datasets = pytest.importorskip("datasets")
    from datasets.table import embed_table_storage

    paths = []
    for k, data in enumerate(_jpgs(5, seed=1)):
        paths.append(str(tmp_path / f"{k}.jpg"))
        open(paths[-1], "wb").write(data)
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b", "c"])})
    ds = datasets.Dataset.from_dict({"image": paths, "label": [k % 3 for k in range(5)]}, features=features)
    ds.to_parquet(str(tmp_path / "paths.parquet"))  # writes {"bytes": None, "path": ...}: every read would fail
    assert "its column 'image' holds no image bytes, only paths" in _error(tmp_path / "paths.parquet")
    embedded = ds.with_format("arrow").map(embed_table_storage, batched=True).with_format(None)  # what it says
    embedded.to_parquet(str(tmp_path / "bytes.parquet"))
    back = datasets.Dataset.from_parquet(str(tmp_path / "bytes.parquet")).cast_column(
        "image", datasets.Image(decode=False))
    assert _ours(tmp_path / "bytes.parquet") == [(r["image"]["bytes"], r["label"]) for r in back] == [
        (open(p, "rb").read(), k % 3) for k, p in enumerate(paths)]


def test_rows_without_image_bytes_are_skipped_with_their_reason_never_read(tmp_path):
    jpgs = _jpgs(8, seed=2)
    kind = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    images = [{"bytes": b, "path": None} for b in jpgs]
    images[1] = None  # a null image
    images[5] = {"bytes": None, "path": "/elsewhere/5.jpg"}  # kept by path only
    t = pa.table({"image": pa.array(images, kind), "label": pa.array([k % 3 for k in range(8)], pa.int64())})
    pq.write_table(t, tmp_path / "x.parquet", row_group_size=3)
    index, _ = load_index(str(tmp_path / "x.parquet"), None, EXTS, None, use_cache=False)
    assert [(index.read(i), int(index.labels[i])) for i in range(len(index))] == _pyarrow_reads(
        [tmp_path / "x.parquet"])
    assert len(index) == 6 and sum("no image bytes" in s for s in index.skipped) == 2
    assert any("row 5 (no image bytes: its image is kept by path only)" in s for s in index.skipped)


def test_a_folder_of_several_hugging_face_splits_is_one_line_and_its_glob_reads_one(tmp_path):
    jpgs = _jpgs(9, seed=3)
    root = tmp_path / "mnist"  # as snapshot_download leaves ylecun/mnist: mnist/{train,test}-00000-of-00001.parquet
    root.mkdir()
    for name, part in (("train-00000-of-00002.parquet", jpgs[:3]), ("train-00001-of-00002.parquet", jpgs[3:6]),
                       ("test-00000-of-00001.parquet", jpgs[6:])):
        pq.write_table(pa.table({"image": pa.array(part, pa.binary()), "label": pa.array([1, 2, 0])}), root / name)
    msg = _error(root)
    assert "holds the Parquet files of 2 splits (test, train" in msg and "train-*.parquet" in msg, msg
    assert "2 splits" in _error(root / "*.parquet")
    glob = str(root / "train-*.parquet")  # what it says
    assert glob in msg and _ours(glob) == _pyarrow_reads(sorted(str(p) for p in root.glob("train-*")))


@pytest.mark.parametrize("hidden", [".cache/huggingface", ".ipynb_checkpoints"])
def test_a_hidden_folder_beside_the_parquet_files_is_left_alone(tmp_path, hidden):
    pq.write_table(pa.table({"image": pa.array(_jpgs(4, seed=4)), "label": pa.array([0, 1, 2, 1])}),
                   tmp_path / "train-00000-of-00001.parquet")
    os.makedirs(tmp_path / hidden)  # huggingface_hub's local_dir keeps its .cache there
    assert _ours(tmp_path) == _pyarrow_reads([tmp_path / "train-00000-of-00001.parquet"])


def test_string_labels_are_one_line_naming_class_encode_column_which_works(tmp_path):
    datasets = pytest.importorskip("datasets")
    jpgs = _jpgs(5, seed=5)
    names = ["dog", "cat", "dog", "eel", "cat"]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("string")})
    ds = datasets.Dataset.from_dict({"image": [{"bytes": b, "path": None} for b in jpgs], "label": names},
                                    features=features)
    ds.to_parquet(str(tmp_path / "s.parquet"))
    msg = _error(tmp_path / "s.parquet")
    assert "column 'label' is string, not integer class indices" in msg and "class_encode_column('label')" in msg
    ds.class_encode_column("label").to_parquet(str(tmp_path / "i.parquet"))  # what it says
    index, _ = load_index(str(tmp_path / "i.parquet"), None, EXTS, None, use_cache=False)
    assert [index.classes[int(lab)] for lab in index.labels] == names  # the names kept, each row's own
    assert [index.read(i) for i in range(5)] == jpgs
    dictionary = pa.table({"image": pa.array(jpgs), "label": pa.array(names).dictionary_encode()})
    pq.write_table(dictionary, tmp_path / "d.parquet")  # a pandas Categorical's column
    assert "not integer class indices" in _error(tmp_path / "d.parquet")


@pytest.mark.parametrize("image_type", [pa.binary(), pa.large_binary(),
                                        pa.struct([("path", pa.large_string()), ("bytes", pa.large_binary())])])
def test_other_arrow_types_read_as_pyarrow_reads_them(tmp_path, image_type):
    jpgs = _jpgs(7, seed=6)
    values = [{"bytes": b, "path": None} for b in jpgs] if pa.types.is_struct(image_type) else jpgs
    t = pa.table({"image": pa.array(values, image_type), "label": pa.array([2, 0, None, 1, 0, -1, 2], pa.int8())})
    pq.write_table(t, tmp_path / "x.parquet", row_group_size=2, use_dictionary=True)
    assert _ours(tmp_path / "x.parquet") == _pyarrow_reads([tmp_path / "x.parquet"])


def test_files_whose_class_label_names_differ_are_one_line_never_one_label_for_two_classes(tmp_path):
    import json

    def hf(jpgs, labels, names):
        features = {"image": {"_type": "Image"}, "label": {"names": names, "_type": "ClassLabel"}}
        t = pa.table({"image": pa.array([{"bytes": b, "path": None} for b in jpgs],
                                        pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
                      "label": pa.array(labels, pa.int64())})
        return t.replace_schema_metadata({b"huggingface": json.dumps({"info": {"features": features}}).encode()})

    jpgs = _jpgs(6, seed=7)
    pq.write_table(hf(jpgs[:3], [0, 1, 2], ["cat", "dog", "eel"]), tmp_path / "a.parquet")
    pq.write_table(hf(jpgs[3:], [0, 1, 2], ["eel", "cat", "dog"]), tmp_path / "b.parquet")  # label 0 is eel here
    msg = _error(tmp_path)
    assert "b.parquet: its ClassLabel names (eel, cat, dog ...) are not those of a.parquet" in msg, msg
    pq.write_table(hf(jpgs[3:], [0, 1, 2], ["cat", "dog", "eel"]), tmp_path / "b.parquet")
    index, _ = load_index(str(tmp_path), None, EXTS, None, use_cache=False)
    assert index.classes == ("cat", "dog", "eel") and list(index.labels) == [0, 1, 2, 0, 1, 2]


def test_a_label_that_is_an_id_is_one_line_not_gigabytes_of_class_names(tmp_path):
    t = pa.table({"image": pa.array(_jpgs(2, seed=8)), "label": pa.array([1, 1 << 40], pa.int64())})
    pq.write_table(t, tmp_path / "x.parquet")
    msg = _error(tmp_path / "x.parquet")
    assert f"labels go up to {1 << 40} (e.g. {tmp_path / 'x.parquet'}#1)" in msg, msg


def test_a_glob_over_the_hubs_split_folders_is_one_line_and_its_glob_reads_one(tmp_path):
    root = tmp_path / "default"  # the Hub's Parquet conversion (refs/convert/parquet): default/<split>/0000.parquet
    jpgs = _jpgs(6, seed=9)
    for split, part in (("train", jpgs[:4]), ("test", jpgs[4:])):
        (root / split).mkdir(parents=True)
        pq.write_table(pa.table({"image": pa.array(part), "label": pa.array(range(len(part)))}),
                       root / split / "0000.parquet")
    msg = _error(root / "*" / "*.parquet")
    assert "holds the Parquet files of 2 splits (test, train; e.g. train/0000.parquet)" in msg, msg
    one = str(root / "train" / "*.parquet")
    assert msg.endswith(one) and _ours(one) == _pyarrow_reads([root / "train" / "0000.parquet"])
