from __future__ import annotations

import os

import numpy as np
import pytest

from prefetchd.sources.dataset import DatasetError, load_index, scan_image_folder


def touch(path, data=b"x"):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def test_image_folder_labels_are_sorted_class_indices_and_extensions_case_insensitive(tmp_path):
    for rel in ("b/2.JPEG", "b/1.jpg", "a/z.PNG", "a/sub/y.jpeg", "c/readme.txt", "a/.hidden/x.jpg"):
        touch(str(tmp_path / rel))
    (tmp_path / "d").mkdir()  # an empty class keeps its label
    index, _ = scan_image_folder(str(tmp_path), (".jpeg", ".jpg", ".png"))
    assert index.classes == ("a", "b", "c", "d")
    assert [index.relpath(i) for i in range(len(index))] == ["a/z.PNG", "a/sub/y.jpeg", "b/1.jpg", "b/2.JPEG"]
    assert index.labels.tolist() == [0, 0, 1, 1]
    assert index.labels.dtype == np.int32 and index.blob.dtype == np.uint8


def test_cache_is_reused_and_invalidated_by_a_change(tmp_path):
    root, cache = tmp_path / "root", str(tmp_path / "cache")
    touch(str(root / "a/1.jpg"))
    touch(str(root / "b/1.jpg"))  # two classes: one alone is refused (core/classlike.py)
    i1, cached1 = load_index(str(root), None, (".jpg",), cache)
    i2, cached2 = load_index(str(root), None, (".jpg",), cache)
    assert (cached1, cached2) == (False, True) and i1.fingerprint == i2.fingerprint
    assert isinstance(i2.blob, np.memmap)  # workers share the pages
    touch(str(root / "a/2.jpg"))
    i3, cached3 = load_index(str(root), None, (".jpg",), cache)
    assert not cached3 and len(i3) == 3 and i3.fingerprint != i1.fingerprint


def test_file_list(tmp_path):
    touch(str(tmp_path / "imgs/x.jpg"))
    lst = tmp_path / "train.txt"
    lst.write_text("# path label\nimgs/x.jpg 3\n\n/abs/y.jpg 0\n")
    index, _ = load_index(None, str(lst), (".jpg",), str(tmp_path / "c"))
    assert index.path(0) == str(tmp_path / "imgs/x.jpg") and index.path(1) == "/abs/y.jpg"
    assert index.labels.tolist() == [3, 0] and len(index.classes) == 4
    lst.write_text("imgs/x.jpg three\n")
    with pytest.raises(DatasetError, match=":1: expected 'path label'"):
        load_index(None, str(lst), (".jpg",), str(tmp_path / "c"))


@pytest.mark.parametrize("setup, words", [
    (lambda p: None, "does not exist"),
    (lambda p: p.mkdir(), "has no class folders"),
    (lambda p: (p / "a").mkdir(parents=True), "holds no images"),
    (lambda p: p.write_text("x"), "is not a directory"),
])
def test_unusable_roots_say_why(tmp_path, setup, words):
    root = tmp_path / "root"
    setup(root)
    with pytest.raises(DatasetError, match=words):
        load_index(str(root), None, (".jpg",), str(tmp_path / "c"))


def test_symlink_loops_are_not_followed_forever(tmp_path):
    touch(str(tmp_path / "a/1.jpg"))
    os.symlink(str(tmp_path / "a"), str(tmp_path / "a/loop"))
    index, _ = scan_image_folder(str(tmp_path), (".jpg",))
    assert len(index) == 1


def test_a_directory_symlink_to_an_ancestor_indexes_every_image_once_with_its_own_label(tmp_path):
    for c in ("a", "b", "c"):
        touch(str(tmp_path / c / "1.jpg"))
    touch(str(tmp_path / "a" / "sub" / "2.jpg"))
    os.symlink("..", str(tmp_path / "a" / "up"))  # a loop through the root: b and c again, as label 0
    os.symlink("../b", str(tmp_path / "c" / "b-again"))  # another class's folder
    outside = tmp_path.parent / (tmp_path.name + "-outside")
    touch(str(outside / "3.jpg"))
    os.symlink(str(outside), str(tmp_path / "c" / "ext"))  # outside the root: followed...
    os.symlink(str(outside), str(tmp_path / "b" / "ext2"))  # ...once
    index, _ = scan_image_folder(str(tmp_path), (".jpg",))
    got = sorted((index.relpath(i), index.classes[index.labels[i]]) for i in range(len(index)))
    assert got == [("a/1.jpg", "a"), ("a/sub/2.jpg", "a"), ("b/1.jpg", "b"), ("b/ext2/3.jpg", "b"),
                   ("c/1.jpg", "c")]
    assert sorted(s.split()[0] for s in index.skipped) == ["a/up", "c/b-again", "c/ext"]


@pytest.mark.parametrize("devkit", [False, True])
def test_a_mistyped_validation_root_is_named_by_its_own_key(tmp_path, image_root, devkit):
    """``prefetchd check`` names the key the user got wrong (validation.root), not dataset.root, and
    with validation.devkit set does not blame the devkit for a root that is not there."""
    import subprocess
    import sys

    from conftest import small_config

    val = {"enabled": True, "root": str(tmp_path / "vall"), "batch_size": 4}
    if devkit:
        val["devkit"] = str(tmp_path / "devkit")
        os.makedirs(val["devkit"])
    cfg = small_config(tmp_path, image_root, validation=val)
    r = subprocess.run([sys.executable, "-m", "prefetchd", "check", "--config", cfg], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 78, (r.stdout, r.stderr)
    assert f"validation.root {tmp_path / 'vall'} does not exist" in r.stderr, r.stderr
    assert "dataset.root" not in r.stderr and "remove validation.devkit" not in r.stderr, r.stderr


def test_every_index_describes_itself_and_the_cache_keeps_what_it_is(tmp_path):
    touch(str(tmp_path / "root/a/1.jpg"))
    touch(str(tmp_path / "root/b/1.jpg"))
    (tmp_path / "list.txt").write_text("root/a/1.jpg 0\n")
    cache = str(tmp_path / "cache")
    for _ in range(2):  # scanned, then from the cache
        folder, _ = load_index(str(tmp_path / "root"), None, (".jpg",), cache)
        listed, _ = load_index(None, str(tmp_path / "list.txt"), (".jpg",), cache)
        assert folder.describe() == "root, an ImageFolder"
        assert listed.describe() == f"a file list in {tmp_path}"


def test_a_cache_write_that_fails_leaves_no_temp_file_and_the_old_cache(tmp_path):
    from prefetchd.sources.dataset import read_cache, write_cache

    cdir = str(tmp_path / "c")
    write_cache(cdir, "meta.json", {"a": np.arange(3)}, {"version": 1, "fingerprint": "f1"})
    with pytest.raises(ValueError):  # an array np.save refuses (objects need pickle)
        write_cache(cdir, "meta.json", {"a": np.array([object()])}, {"version": 1, "fingerprint": "f2"})
    assert sorted(os.listdir(cdir)) == ["a-f1.npy", "meta.json"]
    assert read_cache(cdir, "meta.json", 1, lambda meta, arrays: arrays["a"].tolist()) == [0, 1, 2]
    assert read_cache(cdir, "meta.json", 2, lambda meta, arrays: 0) is None  # another version
