"""Issue 34, item 1: a dataset.root one level too high (only train/ and val/, or one folder holding
every image) is refused with one line saying what was found and what was meant, by ``check`` and
``run`` alike (exit 78); ``check`` prints the first class names and the smallest and largest class."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from conftest import small_config

from prefetchd.core.words import plural
from prefetchd.sources.classlike import describe_classes, judge
from prefetchd.sources.dataset import DatasetError, load_index


def _split_root(tmp_path, image_root, splits=("train", "val")) -> str:
    """``root/<split>/<class>/<image>``: an ImageFolder per split, the root one level above them."""
    root = tmp_path / "imagenet"
    for s in splits:
        shutil.copytree(image_root, root / s)
    return str(root)


# --- the pure judgement --------------------------------------------------------------------------


def test_class_like_names_pass():
    assert judge("/d", "dataset.root", ["cat", "dog"], [3, 4]) is None
    assert judge("/d", "dataset.root", [f"n{i:08d}" for i in range(1000)], [1300] * 1000) is None
    assert judge("/d", "dataset.root", ["train", "cat"], [3, 4]) is None  # one real class beside: a class set


def test_splits_are_refused_naming_the_split_meant():
    msg = judge("/data/imagenet", "dataset.root", ["train", "val"], [1281167, 50000])
    assert msg == ("dataset.root /data/imagenet holds only train/ and val/ (folders of splits or of all images, "
                   "not classes: each would be one class): set dataset.root: /data/imagenet/train")
    assert judge("/data/x/", "dataset.root", ["Test", "Train", "Val"], [1, 2, 3]).endswith(
        "set dataset.root: /data/x/Train")
    assert judge("/data/imagenet", "validation.root", ["train", "val"], [5, 5]).endswith(
        "set validation.root: /data/imagenet/val")
    one = judge("/data/imagenet", "dataset.root", ["train"], [9], ["cat", "dog"])
    assert "holds only train/" in one and "every label would be 0" in one and one.endswith("/data/imagenet/train")


def test_one_folder_of_every_image_is_refused():
    nested = judge("/d", "dataset.root", ["photos"], [40], ["cat", "dog", "eel", "fox"])
    assert "holds one folder, photos/, so all 40 images would be one class with label 0" in nested
    assert "(cat, dog, eel, ...)" in nested and "set dataset.root: /d/photos; if one class is meant" in nested
    flat = judge("/d", "dataset.root", ["photos"], [1])
    assert "holds one folder, photos/, with all 1 image: every label would be 0" in flat
    assert "one folder per class" in flat and "dataset.file_list" in flat
    flat_images = judge("/d", "dataset.root", ["images"], [40])  # root/images/<image>: no classes at all
    assert "holds one folder, images/, with all 40 images: every label would be 0" in flat_images, flat_images
    assert judge("/d", "dataset.root", ["n01"], [7], folder=False) is None  # one class tar: fine
    assert judge("/d", "validation.root", ["n01"], [7]) is None  # a validation subset of one class


def test_describe_classes_and_plurals():
    line = describe_classes(["a", "b", "c", "d", "e", "f"], [5, 1, 9, 9, 3, 1], first=3)
    assert line == "6 classes: a, b, c, ...; smallest b (1 image), largest c (9 images)"
    assert describe_classes(["x"], [1]) == "1 class: x; smallest x (1 image), largest x (1 image)"
    assert plural(1, "batch", "batches") == "1 batch" and plural(2, "batch", "batches") == "2 batches"


# --- where the index is loaded: every caller gets it -----------------------------------------------


def test_load_index_refuses_a_root_of_splits_from_a_scan_and_from_the_cache(tmp_path, image_root):
    root = _split_root(tmp_path, image_root)
    for _ in range(2):
        with pytest.raises(DatasetError, match=r"holds only train/ and val/ .*set dataset\.root: .*imagenet/train$"):
            load_index(root, None, (".jpeg",), str(tmp_path / "cache"))
    index, _ = load_index(os.path.join(root, "train"), None, (".jpeg",), str(tmp_path / "cache"))
    assert len(index.classes) == 4


def _cli(cmd: str, cfg: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefetchd", cmd, "--config", cfg], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("cmd", ["check", "run"])
def test_check_and_run_refuse_a_root_one_level_too_high(tmp_path, image_root, cmd):
    root = _split_root(tmp_path, image_root)
    r = _cli(cmd, small_config(tmp_path, root))
    assert r.returncode == 78, (r.stdout, r.stderr)
    assert f"dataset.root {root} holds only train/ and val/" in r.stderr, r.stderr
    assert f"set dataset.root: {root}/train" in r.stderr.strip().splitlines()[-1], r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("cmd", ["check", "run"])
def test_check_and_run_refuse_one_folder_holding_every_image(tmp_path, image_root, cmd):
    root = tmp_path / "root"
    shutil.copytree(image_root, root / "images" / "all")  # root/images/all/<class>/<image>: one class "all"
    r = _cli(cmd, small_config(tmp_path, str(root / "images")))
    assert r.returncode == 78, (r.stdout, r.stderr)
    assert "holds only all/" in r.stderr and f"set dataset.root: {root}/images/all" in r.stderr, r.stderr
    flat = tmp_path / "flat" / "pics"
    flat.mkdir(parents=True)
    for c in os.listdir(image_root):
        for f in os.listdir(os.path.join(image_root, c)):
            shutil.copy(os.path.join(image_root, c, f), flat / f"{c}-{f}")
    r = _cli(cmd, small_config(tmp_path, str(flat.parent)))
    assert r.returncode == 78 and "holds one folder, pics/, with all 48 images: every label would be 0" in r.stderr, (
        r.stdout, r.stderr)


def test_check_prints_the_first_classes_and_the_smallest_and_largest(tmp_path, image_root):
    root = tmp_path / "root"
    shutil.copytree(image_root, root)
    classes = sorted(os.listdir(root))
    victim = root / classes[2]
    for f in sorted(os.listdir(victim))[:7]:
        os.unlink(victim / f)
    r = _cli("check", small_config(tmp_path, str(root)))
    assert r.returncode == 0, (r.stdout, r.stderr)
    line = next(x for x in r.stdout.splitlines() if x.startswith("classes: "))
    assert line.startswith(f"classes: 4 classes: {', '.join(classes)}; smallest {classes[2]} (5 images), "
                           f"largest {classes[0]} (12 images)"), line


def test_one_class_on_purpose_is_taken_with_dataset_one_class():
    """A generative or self-supervised model's unlabelled images, root/<folder>/<image> (PyTorch's
    DCGAN tutorial: data/celeba/img_align_celeba/*.jpg, "ImageFolder requires there to be
    subdirectories"; FFHQ's images1024x1024/00000/...): refused without a word of a way through
    but a file list; the refusal names dataset.one_class, and that key takes one class."""
    flat = judge("/data/celeba", "dataset.root", ["img_align_celeba"], [202599])
    assert flat.endswith("set dataset.one_class: true"), flat
    nested = judge("/data/ffhq", "dataset.root", ["images1024x1024"], [70000], ["00000", "01000"])
    assert nested.endswith("set dataset.one_class: true"), nested
    assert judge("/d", "dataset.root", ["img_align_celeba"], [9], one_class=True) is None
    assert judge("/d", "dataset.root", ["images"], [9], ["a", "b"], one_class=True) is None
    assert judge("/d", "dataset.root", ["train", "val"], [9, 9], one_class=True)  # two splits: still refused
    assert "one_class" not in judge("/d", "dataset.root", ["train", "val"], [9, 9])
    assert "one_class" not in judge("/d", "validation.root", ["val"], [9])


def test_check_takes_one_class_folder_with_dataset_one_class(tmp_path, image_root):
    root = tmp_path / "celeba"
    pics = root / "img_align_celeba"
    pics.mkdir(parents=True)
    for c in os.listdir(image_root):
        for f in os.listdir(os.path.join(image_root, c)):
            shutil.copy(os.path.join(image_root, c, f), pics / f"{c}-{f}")
    r = _cli("check", small_config(tmp_path, str(root)))
    assert r.returncode == 78 and r.stderr.strip().endswith("set dataset.one_class: true"), (r.stdout, r.stderr)
    r = _cli("check", small_config(tmp_path, str(root), dataset={"one_class": True}))
    assert r.returncode == 0 and "1 class: img_align_celeba" in r.stdout, (r.stdout, r.stderr)
    with pytest.raises(DatasetError):
        load_index(str(root), None, (".jpeg",), str(tmp_path / "cache"))
    index, _ = load_index(str(root), None, (".jpeg",), str(tmp_path / "cache"), one_class=True)
    assert index.classes == ("img_align_celeba",) and len(index) == 48
