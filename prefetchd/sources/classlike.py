"""Are an index's classes class-like? A root one level too high trains with every label 0.

An ImageFolder takes each folder under ``dataset.root`` as a class. Pointed one level too high,
at a root holding only ``train/`` and ``val/`` (or one folder holding every image), it makes 1
or 2 "classes" and every train label is 0: the model learns nothing, and nothing says why. The
judgement here refuses such a root with one line that says what was found and what was probably
meant; it is a pure function of the class names and their sizes (``judge``), applied once to
every index ``dataset.load_index`` returns (``refuse_unless_classlike``).

Not class-like:

* every class name is a split's or a generic folder's (``train``, ``val``, ``test``, ``images``,
  ...; ``SPLIT_NAMES``): the splits were meant, ``root/train`` for ``dataset.root`` and
  ``root/val`` for ``validation.root``;
* one class folder only (``dataset.root`` an ImageFolder): every label would be 0. Its images in sub-folders
  (``root/x/<sub>/<image>``): ``root/x`` was probably meant; all in one folder: there are no
  class folders at all. Unless ``dataset.one_class`` says one class is meant: a generative or
  self-supervised model's unlabelled images (torchvision's ImageFolder reads them so, from
  ``root/<folder>/<image>``); the refusal names that key.

File lists (``dataset.file_list``) are not judged: their labels are the user's own.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

from prefetchd.core.words import plural
from prefetchd.sources.base import DatasetError

SPLIT_NAMES = frozenset({"train", "training", "val", "valid", "validation", "test", "testing", "dev",
                         "images", "imgs", "img", "data", "dataset", "all"})
_TRAIN_FIRST = ("train", "training", "images", "imgs", "img", "data", "dataset", "all")
_VAL_FIRST = ("val", "validation", "valid", "dev", "test", "testing")


def judge(root: str, key: str, classes: Sequence[str], counts: Sequence[int],
          sub_folders: Sequence[str] = (), folder: bool = True, one_class: bool = False) -> str | None:
    """Why the classes ``classes`` (``counts[i]`` images each) found under ``root`` (the config
    key ``key`` names it: ``dataset.root`` or ``validation.root``) are not class-like, in one line
    that says what to set; None when they are. ``sub_folders``: for a single class, the names of
    the sub-folders its images lie in (empty: its images lie in it directly). ``folder``: the
    classes are an ImageFolder's folders (False: class archives, where one class is judged fine).
    ``one_class``: ``dataset.one_class``, one class folder is meant (a generative or self-supervised
    model, whose labels are unused: ``root/<folder>/<image>`` is how torchvision's ImageFolder
    reads a folder of unlabelled images), so one class is fine."""
    names = [str(c) for c in classes]
    if not names or (one_class and len(names) == 1):
        return None
    opt_in = ("; if one class is meant (labels unused: a generative or self-supervised model), set "
             "dataset.one_class: true") if len(names) == 1 and key.startswith("dataset") else ""
    root_s = root.rstrip(os.sep) or root
    one = len(names) == 1 and folder and not key.startswith("validation")
    if all(n.lower() in SPLIT_NAMES for n in names) and not (one and not sub_folders):  # images/ of flat images: below
        order = _VAL_FIRST + _TRAIN_FIRST if key.startswith("validation") else _TRAIN_FIRST + _VAL_FIRST
        lower = {n.lower(): n for n in names}
        meant = next((lower[o] for o in order if o in lower), names[0])
        found = " and ".join(f"{n}/" for n in names) if len(names) <= 2 else ", ".join(f"{n}/" for n in names)
        what = ("folders of splits or of all images, not classes: each would be one class"
                if len(names) > 1 else "a folder of a split or of all images, not a class: every label would be 0")
        return (f"{key} {root_s} holds only {found} ({what}): set {key}: {os.path.join(root_s, meant)}")
    if one:
        only, n = names[0], int(counts[0]) if len(counts) else 0
        if sub_folders:
            subs = ", ".join(sub_folders[:3]) + (", ..." if len(sub_folders) > 3 else "")
            return (f"{key} {root_s} holds one folder, {only}/, so all {plural(n, 'image')} would be one class "
                    f"with label 0; its images lie in sub-folders ({subs}), probably the classes: "
                    f"set {key}: {os.path.join(root_s, only)}{opt_in}")
        return (f"{key} {root_s} holds one folder, {only}/, with all {plural(n, 'image')}: every label would be 0; "
                f"an ImageFolder needs one folder per class ({key}/<class>/<image>): put each class's images in "
                f"a folder of its own under {root_s}, or list them with their labels in dataset.file_list{opt_in}")
    return None


def describe_classes(classes: Sequence[str], counts: Sequence[int], first: int = 5) -> str:
    """The first class names and the smallest and largest class, in one line (``prefetchd check``)."""
    names = [str(c) for c in classes]
    if not names:
        return "no classes (unlabelled: every label -1)"
    head = ", ".join(names[:first]) + (", ..." if len(names) > first else "")
    lo = min(range(len(names)), key=lambda i: (counts[i], i))
    hi = max(range(len(names)), key=lambda i: (counts[i], -i))
    return (f"{plural(len(names), 'class', 'classes')}: {head}; smallest {names[lo]} "
            f"({plural(int(counts[lo]), 'image')}), largest {names[hi]} ({plural(int(counts[hi]), 'image')})")


def class_counts(index) -> list[int]:
    """How many samples each of ``index``'s classes holds (unlabelled samples, -1, in none)."""
    import numpy as np

    labels = np.asarray(index.labels)
    return np.bincount(labels[labels >= 0], minlength=len(index.classes)).tolist()


def _sub_folders(index, samples: int = 1000) -> list[str]:
    """The sub-folders (``class/<sub>/image``) that a sample of ``index``'s paths lie in, sorted."""
    n = len(index)
    picks = range(n) if n <= samples else sorted({i * (n - 1) // (samples - 1) for i in range(samples)})
    subs = set()
    for i in picks:
        parts = index.relpath(i).split(os.sep)
        if len(parts) >= 3:
            subs.add(parts[1])
    return sorted(subs)


def refuse_unless_classlike(load):
    """Wrap ``dataset.load_index``: an index (folder or archives, not a file list) whose classes
    ``judge`` finds not class-like raises DatasetError with its line."""

    @functools.wraps(load)
    def wrapper(root, file_list, *args, section: str = "dataset", one_class: bool = False, **kwargs):
        index, cached = load(root, file_list, *args, section=section, **kwargs)
        if file_list is None and getattr(index, "kind", "folder") not in ("list", "webdataset", "parquet") and len(index.classes) <= len(SPLIT_NAMES):
            folder = getattr(index, "layout", None) is None  # archives (archive.TarIndex) have a layout
            subs = _sub_folders(index) if folder and len(index.classes) == 1 else []
            problem = judge(index.root, f"{section}.root", index.classes, class_counts(index), subs, folder, one_class)
            if problem:
                raise DatasetError(problem)
        return index, cached

    return wrapper
