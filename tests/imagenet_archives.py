"""Small ImageNet archives in the official layout, written with Python's ``tarfile`` (a writer
independent of our reader) and, for the devkit's meta.mat, ``scipy.io.savemat``.

* ``train.tar``: a tar of per-class tars ``<wnid>.tar``, each holding ``<wnid>_<k>.JPEG``; the
  class tars and the members inside each are in shuffled order, as in the real archive;
* ``val.tar``: a flat tar of ``ILSVRC2012_val_{k:08d}.JPEG``, shuffled;
* ``devkit.tar.gz``: ``ILSVRC2012_devkit_t12/data/meta.mat`` (synsets: the leaves with
  ILSVRC2012_IDs NOT in WNID order, and inner synsets with children, interleaved) and
  ``data/ILSVRC2012_validation_ground_truth.txt``;
* the extracted forms beside them: ``train/<wnid>/...`` (the ImageFolder), ``train_tars/``
  (the train tar extracted one level), ``val/`` (flat) and ``devkit/``.
"""

from __future__ import annotations

import io
import os
import tarfile
from dataclasses import dataclass

import numpy as np

from prefetchd.tools.samples import jpeg_bytes, photo_like


@dataclass
class ImageNetFiles:
    train_tar: str
    train_folder: str
    train_tars: str
    val_tar: str
    val_folder: str
    devkit_tgz: str
    devkit_folder: str
    wnids: list[str]  # sorted: the train set's classes
    val_wnid: dict[str, str]  # val file name -> its class's WNID


def _add(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 1_300_000_000, 0o644
    tf.addfile(info, io.BytesIO(data))


def tar_bytes(members: list[tuple[str, bytes]], fmt: int = tarfile.GNU_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for name, data in members:
            _add(tf, name, data)
    return buf.getvalue()


def write_meta_mat(path: str, leaves: list[tuple[int, str]], inner: list[tuple[int, str, list[int]]]) -> None:
    """meta.mat as the devkit has it: ``synsets``, an N x 1 struct array, leaves and inner nodes."""
    from scipy.io import savemat

    rows = [(i, w, 0, np.zeros((1, 0))) for i, w in leaves] + [(i, w, len(c), np.array([c], float)) for i, w, c in inner]
    rows.sort(key=lambda r: r[0])  # meta.mat lists synsets by ILSVRC2012_ID
    dt = [("ILSVRC2012_ID", "O"), ("WNID", "O"), ("words", "O"), ("num_children", "O"), ("children", "O"),
          ("wordnet_height", "O"), ("num_train_images", "O")]
    arr = np.zeros((len(rows), 1), dtype=dt)
    for k, (i, w, nc, ch) in enumerate(rows):
        arr[k, 0] = (np.array([[i]], float), w, f"words of {w}", np.array([[nc]], float), ch,
                     np.array([[0 if nc == 0 else 1]], float), np.array([[1300 if nc == 0 else 0]], float))
    savemat(path, {"synsets": arr}, do_compression=True)


def make_imagenet(dest: str, classes: int = 5, per_class: int = 7, val: int = 13, seed: int = 0,
                  side: int = 72) -> ImageNetFiles:
    rng = np.random.default_rng(seed)
    wnids = sorted(f"n{int(x):08d}" for x in rng.choice(10**7, classes, replace=False))
    os.makedirs(dest, exist_ok=True)
    train_folder, train_tars = os.path.join(dest, "train"), os.path.join(dest, "train_tars")
    os.makedirs(train_tars)
    inner = {}
    for w in wnids:
        os.makedirs(os.path.join(train_folder, w))
        members = []
        for k in rng.permutation(per_class):
            data = jpeg_bytes(photo_like(rng, side + int(rng.integers(0, 30)), side), rng)
            name = f"{w}_{int(k) * 37 + 1}.JPEG"
            members.append((name, data))
            with open(os.path.join(train_folder, w, name), "wb") as f:
                f.write(data)
        inner[w] = tar_bytes(members)  # members in shuffled order
        with open(os.path.join(train_tars, w + ".tar"), "wb") as f:
            f.write(inner[w])
    train_tar = os.path.join(dest, "ILSVRC2012_img_train.tar")
    with open(train_tar, "wb") as f:
        f.write(tar_bytes([(w + ".tar", inner[w]) for w in rng.permutation(wnids)]))

    # the devkit: leaf IDs in an order unrelated to the WNIDs, inner synsets with IDs among them
    ids = [int(i) + 1 for i in rng.permutation(classes + 3)]
    leaf_ids = dict(zip(wnids[::-1], ids[:classes], strict=True))  # reversed: ID order is not WNID order
    inner_synsets = [(ids[classes + j], f"n{90000000 + j:08d}", [ids[j], ids[j + 1]]) for j in range(3)]
    val_folder = os.path.join(dest, "val")
    os.makedirs(val_folder)
    val_wnid, truth, val_members = {}, [], []
    for k in range(1, val + 1):
        w = wnids[int(rng.integers(0, classes))]
        name = f"ILSVRC2012_val_{k:08d}.JPEG"
        data = jpeg_bytes(photo_like(rng, side, side + 8), rng)
        val_wnid[name] = w
        truth.append(str(leaf_ids[w]))
        val_members.append((name, data))
        with open(os.path.join(val_folder, name), "wb") as f:
            f.write(data)
    val_tar = os.path.join(dest, "ILSVRC2012_img_val.tar")
    with open(val_tar, "wb") as f:
        f.write(tar_bytes([val_members[int(i)] for i in rng.permutation(val)]))
    devkit_folder = os.path.join(dest, "devkit", "ILSVRC2012_devkit_t12")
    os.makedirs(os.path.join(devkit_folder, "data"))
    write_meta_mat(os.path.join(devkit_folder, "data", "meta.mat"), [(i, w) for w, i in leaf_ids.items()],
                   inner_synsets)
    with open(os.path.join(devkit_folder, "data", "ILSVRC2012_validation_ground_truth.txt"), "w") as f:
        f.write("\n".join(truth) + "\n")
    devkit_tgz = os.path.join(dest, "ILSVRC2012_devkit_t12.tar.gz")
    with tarfile.open(devkit_tgz, "w:gz") as tf:
        tf.add(devkit_folder, arcname="ILSVRC2012_devkit_t12")
    return ImageNetFiles(train_tar, train_folder, train_tars, val_tar, val_folder, devkit_tgz,
                         os.path.dirname(devkit_folder), wnids, val_wnid)
