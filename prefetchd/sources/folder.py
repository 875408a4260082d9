"""Two dataset kinds: an ImageFolder and a file list, with their cache.

* an ImageFolder, ``root/<class>/.../<image>``: labels are the index of the class folder's name
  among the sorted class names, and a class's images are in torchvision's ``ImageFolder`` order
  (``sorted(os.walk(class_dir))``: folders by their whole path, then names, all compared as
  ``str``, non-UTF-8 bytes as surrogates); hidden folders, ``._*`` files (macOS AppleDouble
  metadata, which torchvision would read and fail to decode) and a root's ``__MACOSX`` are skipped;
  extensions are matched case-insensitively. Directory symlinks, by one rule that never indexes
  an image twice or under another class's label: one whose target lies inside the root (a loop
  to an ancestor, a link to another class) is not followed, its images are indexed where they
  are; one pointing outside the root is followed, and a directory reached a second time (by
  another link) is skipped. What was skipped is kept with the index (``Index.skipped``, shown by
  ``prefetchd check``).
* a file list: one ``path label`` per line (``#`` comments and blank lines allowed); relative
  paths are relative to the list's directory.

A cache entry is valid while the root's and every scanned directory's ``mtime_ns`` (or the list
file's size and mtime) are unchanged.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace

from prefetchd.core.bars import bar
from prefetchd.sources import devkit as dk
from prefetchd.sources.base import (
    CACHE_VERSION,
    DatasetError,
    Index,
    build_index,
    cache_path,
    check_root,
    read_cache,
    write_cache,
)

log = logging.getLogger("prefetchd.dataset")

META = "meta.json"
MACOSX = "__MACOSX"  # what unzipping a Mac's zip leaves: ._* copies of the tree; as a class, label 0, all shifted


def scan_image_folder(root: str, extensions: tuple[str, ...], key: str = "dataset.root") -> tuple[
        Index, list[tuple[str, int]]]:
    """Scan ``root/<class>/...`` (``key``: the config key naming it, for messages). Returns the
    index and the (dir, mtime_ns) list that validates a cache of it."""
    check_root(root, key)
    exts = tuple(e.lower() for e in extensions)
    stamps: list[tuple[str, int]] = [(root, os.stat(root).st_mtime_ns)]
    entries = [e.name for e in os.scandir(root) if e.is_dir(follow_symlinks=True) and not e.name.startswith(".")]
    classes = sorted(n for n in entries if n != MACOSX)
    skipped: list[str] = [f"{MACOSX} (a Mac zip's metadata folder, not a class)"] if MACOSX in entries else []
    if not classes:
        raise DatasetError(f"{key} {root} has no class folders (expected root/<class>/<image>)")
    rel: list[bytes] = []
    labels: list[int] = []
    empty: list[str] = []
    real_root = os.path.realpath(root)
    seen: set[tuple[int, int]] = set()  # every directory indexed, whichever class reached it
    strays: list[str] = []  # folders of ImageNet's validation or test images among classes
    apple = 0  # ._<image> files: macOS AppleDouble metadata (a copy from a Mac to a FAT or SMB disk), not images
    # a bar on a terminal only (prefetchd check, run in the foreground): a cold scan of a large tree is slow
    classes_bar = bar(classes, desc=f"scanning {root}", unit="class", leave=False)
    for label, cls in enumerate(classes_bar):
        top = os.path.join(root, cls)
        found, tars = 0, []
        groups: list[tuple[str, list[bytes]]] = []  # (folder, its images): ordered by folder path below
        why = _not_followed(top, real_root)
        for dirpath, dirnames, filenames in [] if why else os.walk(top, followlinks=True, onerror=_walk_error):
            st = os.stat(dirpath)
            dir_id = (st.st_dev, st.st_ino)  # not `key`: that names the config key in messages
            if dir_id in seen:  # reached before (by another link): its images have their label already
                skipped.append(f"{os.path.relpath(dirpath, root)} (a directory already indexed by another path)")
                dirnames[:] = []
                continue
            seen.add(dir_id)
            stamps.append((dirpath, st.st_mtime_ns))
            dirnames.sort()
            keep = []
            for d in dirnames:
                why_not = None if d.startswith(".") else _not_followed(os.path.join(dirpath, d), real_root)
                if why_not:
                    skipped.append(f"{os.path.relpath(os.path.join(dirpath, d), root)} {why_not}")
                elif not d.startswith("."):
                    keep.append(d)
            dirnames[:] = keep
            groups.append((dirpath, [os.fsencode(os.path.relpath(os.path.join(dirpath, name), root))
                                     for name in sorted(filenames) if name.lower().endswith(exts)
                                     and not name.startswith("._")]))  # a Mac's AppleDouble metadata
            apple += sum(name.startswith("._") and name.lower().endswith(exts) for name in filenames)
            tars += [os.fsencode(name) for name in filenames if name.lower().endswith(".tar")]
        # torchvision's order: `for root, _, fnames in sorted(os.walk(class_dir)): for f in sorted(fnames)`,
        # folders by their whole path as str (so "a-b" before "a/b"), names as str (surrogateescape)
        for _, images in sorted(groups):
            rel.extend(images)
            labels.extend([label] * len(images))
            found += len(images)
        if why:
            skipped.append(f"{cls} {why}")
        names = [p for _, images in groups for p in images]
        not_class = dk.not_a_class(cls, tars, names)
        if not_class and tars and not names:  # tars, no images: not only the train tar's case
            not_class = f"no images, only {len(tars)} tar file(s) (ImageNet's train tar extracted into it, or a class tar not extracted?)"
        if not_class:  # the train tar extracted into a folder among its classes (the usual recipe without its rm)
            raise DatasetError(f"{key} {root}: the folder {cls} is not a class: {not_class}; read as one, it "
                               "would shift every label after it: move it out of the folder")
        if dk.unlabelled(names):  # a stray only beside real classes (not in ImageNet's val in class folders)
            strays.append(f"{cls} ({dk.unlabelled(names)})")
        if not found:
            empty.append(cls)
        classes_bar.set_postfix_str(f"{len(rel):,} images", refresh=False)
    classes_bar.close()
    if 0 < len(strays) < len(classes):
        raise DatasetError(f"{key} {root}: {len(strays)} of its {len(classes)} folders are not classes: "
                           f"{'; '.join(strays[:5])}; each would be read as a class and shift every label after it: "
                           "move them out of the folder")
    if empty:
        log.warning("%d class folder(s) hold no images (their labels stay reserved): %s",
                    len(empty), ", ".join(empty[:5]) + (" ..." if len(empty) > 5 else ""))
    if apple:
        log.warning("%d ._* file(s) not indexed: macOS AppleDouble metadata (a copy from a Mac), not images", apple)
    if skipped:
        log.warning("%d director%s not indexed (directory symlinks into dataset.root are not followed, a "
                    "directory is indexed once, __MACOSX is no class): %s", len(skipped), "y" if len(skipped) == 1 else "ies",
                    "; ".join(skipped[:5]) + (" ..." if len(skipped) > 5 else ""))
    if not rel:
        raise DatasetError(f"{key} {root} holds no images with extensions {', '.join(exts)}")
    return replace(build_index(root, classes, rel, labels), skipped=tuple(skipped)), stamps


def _not_followed(path: str, real_root: str) -> str | None:
    """Why the directory symlink ``path`` is not followed (its target lies inside the root, where
    its images are indexed under their own class), or None (not a symlink, or pointing outside)."""
    if not os.path.islink(path):
        return None
    target = os.path.realpath(path)
    if target == real_root or target.startswith(real_root.rstrip(os.sep) + os.sep):
        return f"-> {os.readlink(path)} (a directory symlink into dataset.root: its images are indexed where they are)"
    return None


def _walk_error(err: OSError) -> None:
    log.warning("cannot read %s: %s", err.filename, err.strerror)


def scan_file_list(list_path: str, key: str = "dataset.file_list") -> tuple[Index, list[tuple[str, int]]]:
    try:
        st = os.stat(list_path)
        with open(list_path, "rb") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise DatasetError(f"{key} {list_path}: {e.strerror}") from None
    rel, labels = parse_file_list(lines, list_path, key)
    classes = [str(i) for i in range(max(labels) + 1)]
    index = replace(build_index(os.path.dirname(list_path), classes, rel, labels), kind="list")
    return index, [(list_path, st.st_mtime_ns), (list_path + "#size", st.st_size)]


def parse_file_list(lines: list[bytes], list_path: str, key: str) -> tuple[list[bytes], list[int]]:
    """(paths, labels) of a file list's lines (``path label``; ``#`` comments and blank lines)."""
    rel: list[bytes] = []
    labels: list[int] = []
    for lineno, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith(b"#"):
            continue
        parts = line.rsplit(None, 1)
        if len(parts) != 2 or not parts[1].lstrip(b"-").isdigit() or int(parts[1]) < 0:
            raise DatasetError(f"{key} {list_path}:{lineno}: expected 'path label' with a non-negative integer label, got {raw[:80]!r}")
        rel.append(parts[0])
        labels.append(int(parts[1]))
    if not rel:
        raise DatasetError(f"{key} {list_path} lists no images")
    if max(labels) >= 2**31:
        raise DatasetError(f"{key} {list_path}: labels must be below 2**31")
    return rel, labels


def stamps_valid(stamps: list) -> bool:
    try:
        for path, value in stamps:
            if path.endswith("#size"):
                if os.stat(path[:-5]).st_size != value:
                    return False
            elif os.stat(path).st_mtime_ns != value:
                return False
    except OSError:
        return False
    return True


def load_cached(cdir: str, validate: bool = True) -> Index | None:
    """The cached index in ``cdir``; None if there is none or (``validate``) the dataset changed
    since it was scanned."""
    def build(meta: dict, arrays: dict) -> Index:
        return Index(meta["root"], tuple(meta["classes"]), arrays["blob"], arrays["offsets"], arrays["labels"],
                     meta["fingerprint"], files_dir=cdir, skipped=tuple(meta.get("skipped", ())),
                     kind=meta.get("kind", "folder"))

    return read_cache(cdir, META, CACHE_VERSION, build, stamps_valid if validate else None)


def save_cache(cdir: str, index: Index, stamps: list) -> Index:
    write_cache(cdir, META, {k: getattr(index, k) for k in ("blob", "offsets", "labels")},
                {"version": CACHE_VERSION, "root": index.root, "classes": list(index.classes),
                 "fingerprint": index.fingerprint, "stamps": stamps, "count": len(index),
                 "skipped": list(index.skipped), "kind": index.kind})
    cached = load_cached(cdir)
    return cached if cached is not None else index




def load(source: str, kind: str, extensions: tuple[str, ...], cache_dir: str | None, use_cache: bool = True,
         section: str = "dataset") -> tuple[Index, bool]:
    """(index, from_cache) of an ImageFolder (``kind`` "folder") or a file list ("list")."""
    cdir = cache_path(cache_dir, source, kind, extensions)
    if use_cache:
        cached = load_cached(cdir)
        if cached is not None:
            return cached, True
    if kind == "list":
        index, stamps = scan_file_list(source, f"{section}.file_list")
    else:
        index, stamps = scan_image_folder(source, extensions, f"{section}.root")
    if use_cache:
        try:
            index = save_cache(cdir, index, stamps)
        except OSError as e:
            log.warning("cannot write the index cache in %s (%s); the next start scans again", cdir, e.strerror)
    return index, False
