"""The dataset index: which kind of dataset a root is, chosen in one place, and its index loaded.

The kinds, each in its own module that builds on ``base`` (the errors, the ``Index`` record,
the cache) and never imports this one:

* an ImageFolder or a file list: ``prefetchd.sources.folder``;
* tar archives read in place (ImageNet's train tar of class tars, a folder of class tars, the
  flat validation tar or folder with the devkit): ``prefetchd.sources.imagenet``;
* WebDataset shards (a folder of them, a brace pattern, a list file): ``prefetchd.sources.webdataset``;
* Parquet files (Hugging Face's image datasets): ``prefetchd.sources.parquet``.

``dataset.layout`` names the layout, or ``auto`` (the default) lets ``detect`` tell: a brace
pattern, a list of ``.tar`` files, or tars whose first members pair an image with another member
of its key (a label, a caption) are shards; ``.parquet`` files (one, a folder of them, a glob) are
Parquet; other tars are ImageNet's; the rest as ``choose`` says.

``choose`` decides which kind a root is, ``load_index`` (the entry point: the daemon, ``prefetchd
check``, the tools) loads its index; the names of
``base`` and ``folder`` that callers used from here are re-exported.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import stat
import tarfile
from dataclasses import replace

import numpy as np

from prefetchd.core.configsections import IMAGE_EXTENSIONS, LAYOUTS
from prefetchd.sources import archive, folder, imagenet, objectstore
from prefetchd.sources import devkit as devkit_
from prefetchd.sources.base import (
    DatasetError,
    Index,
    StorageChanged,
    cache_path,
    check_root,
    default_cache_dir,
    index_fingerprint,
    read_all,
    read_cache,
    write_cache,
)
from prefetchd.sources.classlike import refuse_unless_classlike
from prefetchd.sources.folder import scan_file_list, scan_image_folder

__all__ = ["DatasetError", "Index", "StorageChanged", "cache_path", "default_cache_dir", "index_fingerprint",
           "read_all", "read_cache", "write_cache", "scan_file_list", "scan_image_folder", "load_index",
           "val_labels", "refuse_train_as_val", "train_twins", "open_index_files", "index_files_hold", "unchanged_since_scan"]

log = logging.getLogger("prefetchd.dataset")


_LEFTOVERS = {"lost+found": "a file system's lost+found folder, not a class",
              folder.MACOSX: "a Mac zip's metadata folder, not a class"}
_DEVKIT_NOTE = "ImageNet's devkit extracted, not a class"


def choose(root: str | None, file_list: str | None, devkit: str | None, extensions: tuple[str, ...],
           section: str = "dataset") -> tuple[str, tuple[str, ...]]:
    """Which kind of dataset this is, the one place that decides: ``list`` (``file_list``),
    ``folder`` (an ImageFolder), ``tar`` (a tar file: of class tars, or flat), ``tars`` (a folder of
    class tars) or ``flat-folder`` (images with no class folders). Returns the kind and what of
    ``root`` it leaves out, each with why (kept with the index, shown by ``prefetchd check``).
    Mixtures that cannot be meant are a ``DatasetError`` saying what was found: class tars beside
    folders that are not their extracted twins, a devkit with a set it cannot label."""
    key = f"{section}.root"
    if file_list is not None or root is None:
        if devkit:
            raise DatasetError(f"validation.devkit labels a flat validation set (ImageNet's validation tar or its "
                               f"flat folder); {file_list} is not one (its labels are its own): remove validation.devkit")
        return "list", ()
    try:
        st = os.stat(root)
    except OSError:
        st = None
    if st is not None and devkit_.is_devkit(root):  # its gzip or its lone meta.mat gave advice that misled
        also = ("dataset.root to the train tar (ILSVRC2012_img_train.tar)" if section == "dataset"
                else "validation.root to the validation tar (ILSVRC2012_img_val.tar)")
        raise DatasetError(f"{key} {root} is ImageNet's devkit, which holds no images: it labels the validation set; "
                           f"set validation.devkit to it, and {also}")
    if st is not None and stat.S_ISREG(st.st_mode):
        return "tar", ()
    check_root(root, key)  # missing, unreadable or not a directory: that is the mistake, said first
    try:
        entries = [e for e in os.scandir(root) if not e.name.startswith(".")]
        dirs = {e.name for e in entries if e.is_dir()}
        tars = {e.name for e in entries if e.name.lower().endswith(".tar") and e.is_file()}
        images = any(e.name.lower().endswith(extensions) and e.is_file() for e in entries)
    except OSError as e:
        raise DatasetError(f"{key} {root} cannot be listed: {e.strerror}") from None
    devkits = {d for d in dirs if devkit_.DOWNLOAD.match(d) and devkit_.is_devkit(os.path.join(root, d))}
    download = sorted(t for t in tars if devkit_.DOWNLOAD.match(t))
    left: tuple[str, ...] = ()  # what of root is not read, with why (a flat folder keeps it with its index)
    if download and dirs - set(_LEFTOVERS) - devkits and len(download) == len(tars):  # left beside its extracted classes
        log.warning("%s: not read: %s (ImageNet's download tar%s, not class tars); the folders are an ImageFolder",
                    root, ", ".join(download), "s" if len(download) > 1 else "")
        tars = set()
    elif download and images and not dirs - set(_LEFTOVERS) - devkits and len(download) == len(tars):
        # the usual recipe for the validation tar (mv ILSVRC2012_img_val.tar val/; cd val; tar xf ...) leaves
        # it beside the images extracted from it: the images are the set, the tar is not read
        left = tuple(f"{t} (ImageNet's download tar beside the images extracted from it: the images are read)"
                     for t in download)
        log.warning("%s: not read: %s", root, "; ".join(left))
        tars = set()
    if tars:
        stems = {t[:-4] for t in tars}
        leftovers = sorted(d for d in dirs if d in _LEFTOVERS or d in devkits)
        twins = sorted(d for d in dirs if d in stems)
        others = sorted(dirs - set(leftovers) - set(twins))
        if others:
            raise DatasetError(f"{key} {root} holds {len(tars)} class tar(s) ({', '.join(sorted(tars)[:3])}"
                               f"{' ...' if len(tars) > 3 else ''}) and {len(others)} folder(s) that are not one "
                               f"of them extracted ({', '.join(others[:3])}{' ...' if len(others) > 3 else ''}): "
                               "one kind of dataset per root; move the folders out, or extract every class tar "
                               "and move the tars out")
        notes = [f"{d} ({_LEFTOVERS.get(d, _DEVKIT_NOTE)})" for d in leftovers]
        notes += [f"{d} (a folder extracted beside its class tar {d}.tar: the tar is read)" for d in twins]
        if notes:
            log.warning("%s: not read: %s", root, "; ".join(notes[:5]) + (" ..." if len(notes) > 5 else ""))
        return "tars", tuple(notes)
    if dirs or not images:
        if devkit:
            raise DatasetError(f"validation.devkit labels a flat validation set (ImageNet's validation tar or its "
                               f"flat folder); {root} is not one (its labels are its own): remove validation.devkit")
        return "folder", ()
    return "flat-folder", left


_SHARD_PROBES = 8  # tars looked into, past empty ones, before a folder of tars is called no shards


def _tars_are_shards(paths: list[str], exts: tuple[str, ...]) -> bool:
    """Do the first of these tars that holds members look like WebDataset shards? (An empty first
    shard says nothing: the next one is asked, never the class-tar layout taken for it, which
    would label each shard's samples with the shard's number.)"""
    from prefetchd.sources import webdataset

    for path in paths[:_SHARD_PROBES]:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            said = webdataset.looks_like_shards(fd, os.fstat(fd).st_size, tuple(e.encode() for e in exts))
        finally:
            os.close(fd)
        if said is not None:
            return said
    return False


def _refuse_numbered_image_tars(root: str, tars: list[str], key: str) -> None:
    """A DatasetError when the folder's tars are numbered shards (one width, after a prefix that is empty
    or ends in - _ or ., as webdataset's writers and img2dataset name them) of images
    alone whose names do not start with their tar's: unlabelled WebDataset shards as much as class
    tars, and read as class tars each shard's number would become its samples' label."""
    from prefetchd.sources import shardnames

    if not shardnames.numbered(tars):
        return
    for t in tars[:_SHARD_PROBES]:
        try:
            with tarfile.open(os.path.join(root, t), "r:") as f:
                names = [m.name for m in itertools.islice(f, 16) if m.isfile()]
        except (OSError, tarfile.TarError):
            return
        if names:
            break
    else:
        return
    shardnames.refuse_numbered_images(root, tars, t, names, key)


def detect(root: str | None, file_list: str | None, key: str = "dataset.root") -> str:
    """``dataset.layout: auto``: ``webdataset`` when ``root`` names shards (see the module
    docstring), else ``""`` (``choose`` decides among the other layouts). ``key``: the config key
    naming ``root``, for the one error it raises (shards beside folders that are not leftovers)."""
    # imported here: a worker opening its index needs neither
    from prefetchd.sources import shardnames, webdataset

    if root is None or file_list is not None:
        return ""
    if root.endswith(".parquet") or (os.path.isdir(root) and any(
            e.name.endswith(".parquet") for e in os.scandir(root)) and not any(
            e.is_dir() and not e.name.startswith(".") for e in os.scandir(root))):  # .cache: huggingface_hub's
        if not root.endswith(".parquet"):
            names = sorted(e.name for e in os.scandir(root) if e.is_file() and not e.name.startswith("."))
            tars = [n for n in names if n.lower().endswith(".tar")]
            if tars:  # a bucket prefix of both is refused too: the same files give the same dataset anywhere
                raise shardnames.both_kinds(key, root, tars, [n for n in names if n.endswith(".parquet")])
        return "parquet"
    if shardnames.is_pattern(root) and not os.path.exists(root):
        return "webdataset"
    if shardnames.is_glob(root) and not os.path.exists(root) and root.lower().endswith((".tar", *shardnames.COMPRESSED)):
        return "webdataset"  # which says a glob is not expanded
    exts = tuple(webdataset.DEFAULT_EXTENSIONS)
    try:
        if os.path.isdir(root):
            tars = sorted(e.name for e in os.scandir(root) if e.name.lower().endswith(".tar") and e.is_file()
                          and not e.name.startswith("."))
            if not tars and shardnames.compressed(root) and not any(e.is_dir() for e in os.scandir(root)):
                return "webdataset"  # which says they are compressed
            if not tars or not _tars_are_shards([os.path.join(root, t) for t in tars], exts):
                _refuse_numbered_image_tars(root, tars, key)
                return ""
            # lost+found, a Mac zip's folder and shards extracted beside their tars are no class folders
            stems = {t[:-4] for t in tars}
            dirs = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith(".")
                          and e.name not in _LEFTOVERS and e.name not in stems)
            if dirs:
                alone = ", or set dataset.layout: webdataset to read the top-level shards alone" if (
                    key == "dataset.root") else ""
                raise DatasetError(f"{key} {root} holds WebDataset shards ({tars[0]} ...) and folders "
                                   f"({', '.join(dirs[:3])}{' ...' if len(dirs) > 3 else ''}): one kind of dataset "
                                   f"per root; move the folders out{alone}")
            return "webdataset"
        if not os.path.isfile(root):
            return ""
        if root.lower().endswith(".tar"):
            return "webdataset" if _tars_are_shards([root], exts) else ""
        with open(root, "rb") as f:
            head = f.read(4096)
        lines = [ln.strip() for ln in head.splitlines()[:20] if ln.strip() and not ln.startswith(b"#")]
        return "webdataset" if lines and all(ln.lower().endswith(b".tar") for ln in lines[:-1] or lines) else ""
    except OSError:
        return ""


@refuse_unless_classlike  # a root one level too high (only train/ and val/) is refused: sources/classlike.py
def load_index(root: str | None, file_list: str | None, extensions: tuple[str, ...],
               cache_dir: str | None, use_cache: bool = True, devkit: str | None = None,
               section: str = "dataset", layout: str = "auto", label: str = "cls", image_column: str = "image",
               label_column: str = "label", storage_options: dict | None = None,
               cache: dict | None = None) -> tuple[Index, bool]:
    """Return (index, from_cache). Scans and (re)writes the cache when it is missing or stale.
    ``devkit``: the ImageNet devkit that labels a flat validation set (``validation.devkit``).
    ``section``: the config section that names ``root`` or ``file_list`` (``validation`` for the
    validation set), so a message names the key the user wrote. ``layout``: ``dataset.layout``
    (``LAYOUTS``); ``label``: ``dataset.label`` (shards only); ``image_column``, ``label_column``:
    Parquet's; ``storage_options``: a bucket root's client options (``dataset.storage_options``);
    ``cache``: its node-local cache of fetched bytes (``dataset.cache``, ``bytecache``)."""
    from prefetchd.sources import parquet, webdataset

    if layout not in LAYOUTS:
        raise DatasetError(f"dataset.layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    from prefetchd.core.configvalues import lists_objects

    if objectstore.is_url(root) or objectstore.is_url(file_list) or (
            root is None and file_list is not None and lists_objects(file_list)):  # sources/bucketroot.py
        from prefetchd.sources import bucketroot, bytecache

        bytecache.configure(cache)
        return bucketroot.load(root, file_list, extensions, cache_dir, use_cache, devkit, section, layout, label,
                               image_column, label_column, storage_options)
    if objectstore.is_url(devkit):  # a local set labelled by a devkit in a bucket: the config's keys for it
        objectstore.store_for(devkit, storage_options, "validation.devkit")
    found = detect(root, file_list, f"{section}.root") if layout == "auto" else layout
    if found == "parquet":
        if root is None or devkit:
            raise DatasetError(f"{section}.root must name Parquet files (one, a folder or a glob), without "
                               "validation.devkit")
        return parquet.load(root, image_column, label_column, cache_dir, use_cache, key=f"{section}.root")
    if found == "webdataset":
        if root is None or devkit:
            raise DatasetError(f"{section}.root must name WebDataset shards (a folder, a brace pattern or a list "
                               "file), without validation.devkit")
        exts = webdataset.DEFAULT_EXTENSIONS if tuple(extensions) == IMAGE_EXTENSIONS else extensions
        return webdataset.load(root, exts, label, cache_dir, use_cache, key=f"{section}.root")
    kind, notes = choose(root, file_list, devkit, tuple(e.lower() for e in extensions), section)
    if layout == "imagefolder" and kind not in ("folder", "list"):
        raise DatasetError(f"dataset.layout is imagefolder, but {section}.root {root} is not an ImageFolder (it is "
                           f"{_KIND_WORDS[kind]}): set dataset.layout to auto or to what it is")
    if layout == "imagenet_tars" and kind not in ("tar", "tars", "flat-folder"):
        raise DatasetError(f"dataset.layout is imagenet_tars, but {section}.root {root} is {_KIND_WORDS[kind]}: set "
                           "dataset.layout to auto or to what it is")
    if kind in ("tar", "tars", "flat-folder"):
        assert root is not None
        return imagenet.load(root, devkit, extensions, cache_dir, use_cache, key=f"{section}.root", kind=kind,
                             notes=notes)
    source = file_list if kind == "list" else root
    assert source is not None
    return folder.load(source, kind, extensions, cache_dir, use_cache, section)


_KIND_WORDS = {"list": "a file list", "folder": "an ImageFolder", "tar": "a tar file", "tars": "a folder of tars",
               "flat-folder": "a flat folder of images"}
_TWIN_PROBES = 16  # validation samples, spread over the set, looked for in the train set


def train_twins(val, train, probes: int = _TWIN_PROBES) -> tuple[list[str], int]:
    """Which of up to ``probes`` validation samples (spread evenly over ``val``) the train set
    holds too: a train sample of the same file name, in a class of the same name, of the same size
    (the train tar, its class tars or its extracted folder given as the validation set). Returns
    those samples' paths (relative to val's root) and how many were looked at. A search of the
    train index's path blob per probe: no per-sample Python work (ImageNet: ~0.1 s)."""
    n = len(val)
    if not n or not len(train):
        return [], 0
    blob = train.blob.tobytes()
    offsets = np.asarray(train.offsets)
    picks = sorted({int(i) for i in np.linspace(0, n - 1, min(n, probes))})
    twins = []
    for i in picks:
        rel = val.relpath(i)
        base = os.fsencode(os.path.basename(rel))
        cls, size = val.classes[int(val.labels[i])], val.sample_size(i)
        pos, tries = blob.find(base), 0
        while pos >= 0 and size > 0 and tries < 64:  # the same name in other classes: a few hits at most
            j = int(np.searchsorted(offsets, pos, side="right")) - 1
            whole = int(offsets[j + 1]) == pos + len(base) and (pos == int(offsets[j]) or blob[pos - 1] == 0x2F)
            if whole and train.classes[int(train.labels[j])] == cls and train.sample_size(j) == size:
                twins.append(rel)
                break
            pos, tries = blob.find(base, pos + 1), tries + 1
    return twins, len(picks)


def refuse_train_as_val(val, train) -> None:
    """A validation set that is the train set (most samples looked at are train samples: same
    name, class and size) measures nothing: a ``DatasetError`` in one line, saying what to give."""
    twins, looked = train_twins(val, train)
    if looked and len(twins) * 2 > looked:
        raise DatasetError(f"validation.root {val.root} holds the train set's images: {len(twins)} of {looked} "
                           f"validation samples looked at are in dataset.root too (same file name, class and size; "
                           f"e.g. {twins[0]}); validating on them measures nothing: set validation.root to held-out "
                           "images (ImageNet's validation tar, ILSVRC2012_img_val.tar, with validation.devkit)")


def val_labels(val, train):
    """The validation index with the TRAIN set's class-to-index mapping: an ImageFolder's class
    folders are looked up by name in the train classes (one missing there is an error); a file
    list's labels are kept and must be below the train set's class count. A validation set that
    is the train set itself is refused (``refuse_train_as_val``)."""
    refuse_train_as_val(val, train)
    if val.classes == train.classes:
        return val
    if all(c.isdigit() for c in val.classes) and not all(c.isdigit() for c in train.classes):
        if len(val.classes) > len(train.classes):
            raise DatasetError(f"validation labels go up to {len(val.classes) - 1} but the train set has "
                               f"{len(train.classes)} classes")
        return replace(val, classes=train.classes, files_dir=None)
    where = {c: i for i, c in enumerate(train.classes)}
    missing = [c for c in val.classes if c not in where]
    if missing:
        raise DatasetError(f"validation class folder(s) {missing[:5]} are not in the train set's classes "
                           f"(dataset.root); validation.root must use the train set's class names")
    table = np.array([where[c] for c in val.classes], dtype=np.int32)
    return replace(val, classes=train.classes, labels=table[np.asarray(val.labels)], files_dir=None)


def open_index_files(files_dir: str, fingerprint: str | None = None) -> Index:
    """Open a cached index read-only by memory map (what workers do).

    The dataset is not looked at: a worker serves the index its daemon read, even if the
    dataset changed since (noticing that is the daemon's job, see ``Daemon._rescan``). With
    ``fingerprint``, the files must hold that index (another process may have rescanned a
    changed dataset and replaced them): ``index_files_hold`` tells beforehand."""
    from prefetchd.sources import bucketfolder, bucketimagenet, bucketparquet, bucketshards, parquet

    index = archive.open_files(files_dir) or parquet.open_files(files_dir) or bucketfolder.open_files(files_dir) \
        or bucketshards.open_files(files_dir) or bucketparquet.open_files(files_dir) \
        or bucketimagenet.open_files(files_dir) \
        or folder.load_cached(files_dir, validate=False)
    if index is None:
        raise DatasetError(f"the index cache in {files_dir} is missing or unreadable")
    if fingerprint is not None and index.fingerprint != fingerprint:
        raise DatasetError(f"the index cache in {files_dir} holds index {index.fingerprint}, not {fingerprint}")
    return index


def _meta_of(files_dir: str):
    """(the meta file's name, its stamps' check) of the cache in ``files_dir``, by which it holds."""
    from prefetchd.sources import bucketfolder, bucketimagenet, bucketparquet, bucketshards, parquet

    for mod in (archive, parquet, bucketfolder, bucketshards, bucketparquet, bucketimagenet):
        if os.path.exists(os.path.join(files_dir, mod.META)):
            return mod.META, mod.stamps_valid
    return folder.META, folder.stamps_valid


def index_files_hold(files_dir: str, fingerprint: str) -> bool:
    """Do the cache files in ``files_dir`` still hold the index ``fingerprint`` (cheap: meta.json
    and the files' presence; the arrays are not read)?"""
    try:
        name = _meta_of(files_dir)[0]
        with open(os.path.join(files_dir, name), encoding="utf-8") as f:
            meta = json.load(f)
        return (meta.get("fingerprint") == fingerprint
                and all(os.path.isfile(os.path.join(files_dir, f)) for f in meta["files"].values()))
    except (OSError, ValueError, KeyError, TypeError):
        return False


def unchanged_since_scan(files_dir: str | None, fingerprint: str) -> bool:
    """Is the dataset as it was when the index ``fingerprint``, cached in ``files_dir``, was
    scanned? Cheap: the cache's own stamps, as a start-up with the cache checks them (one stat
    per archive for tar files; every scanned folder's mtime for a folder, so a file added, gone
    or renamed shows; the list file's for a file list). False when it cannot tell (no cache, or
    the cache holds another index now): scan to know."""
    if files_dir is None:
        return False
    try:
        name, valid = _meta_of(files_dir)
        with open(os.path.join(files_dir, name), encoding="utf-8") as f:
            meta = json.load(f)
        if meta.get("fingerprint") != fingerprint:
            return False
        return valid(meta["stamps"])
    except (OSError, ValueError, KeyError, TypeError):
        return False


