"""Which shards ``dataset.root`` names: a folder, a brace pattern, a list file, or one shard.

``resolve(root, key)`` returns (the folder the shard names are relative to, the shard names in
order, the stamps that validate a cache: the folder's or the list file's). The forms:

* a folder: its top-level ``*.tar`` files (not hidden), sorted by name;
* a brace pattern, expanded by webdataset's own ``braceexpand``: ``train-{000000..001023}.tar`` (a
  numeric range, inclusive, zero-padded to the width of a bound written with a leading zero),
  ``{a..c}``, ``{0..9..3}``, ``{a,b,c}`` (alternatives), nested and several braces;
* a text file (any regular file that is not a tar: ``.txt``, ``.list``, ``.lst``, ...): one shard a
  line, relative to the file's folder or absolute; blank lines and ``#`` comments skipped;
* one ``.tar`` file: a set of one shard.

Every named shard must exist: a pattern or list naming shards that are not there is one error
saying how many and which (a set missing some shards trains on part of the data without a word).
"""

from __future__ import annotations

import itertools
import os
import re
import stat

import braceexpand

from prefetchd.core.configsections import IMAGE_EXTENSIONS
from prefetchd.sources.archive import stamp_of
from prefetchd.sources.base import DatasetError

_BRACE = re.compile(r"\{([^{}]*)\}")
_INT_RANGE = re.compile(r"\{(-?\d+)\.\.(-?\d+)(?:\.\.-?(\d+))?\}")  # braceexpand's numeric range
MAX_SHARDS = 1 << 20  # a pattern expanding past this is a mistake, not a data set


COMPRESSED = (".tar.gz", ".tgz", ".tar.zst", ".tar.xz", ".tar.bz2", ".tar.lz4")  # webdataset writes .tar.gz


def compressed(folder: str) -> list[str]:
    """The compressed tars at the top of ``folder``, by name (shards that cannot be read in place)."""
    return sorted(e.name for e in os.scandir(folder) if e.name.lower().endswith(COMPRESSED)
                  and not e.name.startswith(".") and e.is_file())


def is_glob(root: str) -> bool:
    return any(c in root for c in "*?[")


def is_pattern(root: str) -> bool:
    return bool(_BRACE.search(os.path.basename(root)) or _BRACE.search(root))


def expand(pattern: str) -> list[str]:
    """The names a brace pattern stands for, in order: webdataset's own expander (``braceexpand``), so
    every form its users write means the same here: ranges with a step and letters, lists, nesting.
    Numeric ranges are counted first: braceexpand builds a range whole before it yields one name, so a
    typo in a bound (``{0..9999999999}``) would take the memory before any limit could refuse it."""
    count = 1
    for lo, hi, step in _INT_RANGE.findall(pattern):
        count *= abs(int(hi) - int(lo)) // max(int(step or 1), 1) + 1
        if count > MAX_SHARDS:
            raise DatasetError(f"the brace pattern {pattern} names more than {MAX_SHARDS} shards")
    try:
        names = list(itertools.islice(braceexpand.braceexpand(pattern), MAX_SHARDS + 1))
    except braceexpand.UnbalancedBracesError:
        raise DatasetError(f"the brace pattern {pattern} has unbalanced braces") from None
    if len(names) > MAX_SHARDS:
        raise DatasetError(f"the brace pattern {pattern} names more than {MAX_SHARDS} shards")
    return names


# a word of a shard's name that says its split: timm/imagenet-1k-wds holds imagenet1k-train-0000.tar
# beside imagenet1k-validation-00.tar, and its folder as dataset.root trained on the validation set
_SPLITS = {"train", "training", "val", "valid", "validation", "test", "testing", "dev", "eval"}


def _one_split(key: str, root: str, names: list[str]) -> None:
    """A DatasetError if the folder's shards are named for more than one split, saying how to name one's."""
    splits: dict[str, list[str]] = {}
    for n in names:
        words = {w.lower() for w in re.findall(r"[A-Za-z]+", n[:-4])} & _SPLITS
        if len(words) == 1:
            splits.setdefault(words.pop(), []).append(n)
    if len(splits) < 2:
        return
    order = (("validation", "val", "valid", "test", "dev", "eval") if key.startswith("validation")
             else ("train", "training"))
    pick = next((w for w in order if w in splits), sorted(splits)[0])
    found = [re.match(r"^(.*?)(\d+)\.tar$", n) for n in splits[pick]]
    how = "a brace pattern or a file listing them"
    if all(found) and len({m.group(1) for m in found}) == 1 and len({len(m.group(2)) for m in found}) == 1:
        nums = sorted(m.group(2) for m in found)
        if len(nums) == int(nums[-1]) - int(nums[0]) + 1:
            how = os.path.join(root, f"{found[0].group(1)}{{{nums[0]}..{nums[-1]}}}.tar")
    raise DatasetError(f"{key} {root} holds the shards of {len(splits)} splits ({', '.join(sorted(splits))}; e.g. "
                       f"{splits[pick][0]}): a data set is one split; set {key} to one split's shards: {how}")


def _no_gaps(key: str, root: str, names: list[str]) -> None:
    """A DatasetError if the folder's shards are numbered (one prefix, one width) with numbers missing
    between the first and the last: what a copy still running leaves (rsync writes each shard under
    a hidden name until it is whole, aws s3 sync under a suffix), as a pattern naming them would say."""
    found = [re.match(r"^(.*?)(\d+)\.tar$", n) for n in names]
    if len(names) < 2 or not all(found) or len({(m.group(1), len(m.group(2))) for m in found}) != 1:
        return
    nums = {int(m.group(2)) for m in found}
    missing = sorted(set(range(min(nums), max(nums) + 1)) - nums)
    if missing:
        prefix, width = found[0].group(1), len(found[0].group(2))
        shown = ", ".join(f"{prefix}{k:0{width}d}.tar" for k in missing[:3]) + (" ..." if len(missing) > 3 else "")
        raise DatasetError(f"{key} {root}: {len(missing)} shard(s) numbered between its first and last are not there "
                           f"({shown}): a copy or download still running, or removed? a set without them trains on "
                           "part of the data; restore them, or name the shards present in a list file")


def _missing(key: str, root: str, paths: list[str], absent: list[str], what: str) -> DatasetError:
    if len(absent) == len(paths):
        return DatasetError(f"{key} {root}: none of the {len(paths)} shard(s) {what} exists (e.g. {absent[0]}): "
                            "check the path and the range")
    shown = ", ".join(absent[:3]) + (" ..." if len(absent) > 3 else "")
    return DatasetError(f"{key} {root}: {len(absent)} of the {len(paths)} shards {what} are missing ({shown}): "
                        "a set without them trains on part of the data; restore them, or name only those present")


def both_kinds(key: str, root: str, tars: list[str], parquets: list[str]) -> DatasetError:
    """A root holding ``.tar`` shards and ``.parquet`` files side by side (a local folder or a bucket
    prefix alike): which one is the dataset is the user's to say."""
    return DatasetError(f"{key} {root} holds both .tar files ({tars[0]} ...) and Parquet files ({parquets[0]} ...): "
                        "one kind of dataset per root; set dataset.layout: webdataset or parquet to read one, or "
                        "move the other out")


def resolve(root: str, key: str = "dataset.root") -> tuple[str, list[str], list]:
    """(base folder, shard names relative to it, cache stamps) of ``root``: see the module docstring."""
    if is_pattern(root) and not os.path.exists(root):
        base = os.path.dirname(root[:root.index("{")])  # a brace may stand for folders too
        names = [os.path.relpath(p, base) for p in expand(root)]
        absent = [n for n in names if not os.path.isfile(os.path.join(base, n))]
        if absent:
            raise _missing(key, root, names, absent, "the pattern names")
        return base, names, []
    if is_glob(root) and not os.path.exists(root):
        raise DatasetError(f"{key} {root} is a glob, which is not expanded for shards: name their folder, "
                           "a brace pattern (train-{000000..000099}.tar) or a file listing them")
    try:
        st = os.stat(root)
    except OSError as e:
        raise DatasetError(f"{key} {root} cannot be read: {e.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        names = sorted(e.name for e in os.scandir(root)
                       if e.name.lower().endswith(".tar") and not e.name.startswith(".") and e.is_file())
        if not names:
            packed = compressed(root)
            if packed:
                raise DatasetError(f"{key} {root} holds compressed shards ({packed[0]} ...), not .tar ones: shards are "
                                   "read in place, uncompressed; decompress them (gunzip, zstd -d, ...) or write "
                                   "them without compression")
            raise DatasetError(f"{key} {root} holds no .tar shards")
        _one_split(key, root, names)
        _no_gaps(key, root, names)
        return root, names, [stamp_of(root)]
    if root.lower().endswith(".tar"):
        return os.path.dirname(root), [os.path.basename(root)], []
    base = os.path.dirname(root)
    try:
        with open(root, encoding="utf-8-sig") as f:  # -sig: Notepad's byte order mark is no part of a name
            lines = [ln.strip() for ln in f]
    except (OSError, UnicodeDecodeError) as e:
        raise DatasetError(f"{key} {root} is not a readable list of shards: {e}") from None
    names = [ln for ln in lines if ln and not ln.startswith("#")]
    if not names:
        raise DatasetError(f"{key} {root} lists no shards")
    absent = [n for n in names if not os.path.isfile(os.path.join(base, n))]
    if absent:
        raise _missing(key, root, names, absent, "the list names")
    return base, names, [stamp_of(root)]


def numbered(tars: list[str]) -> bool:
    """Are ``tars`` (two or more) named as numbered shards (``dataset._refuse_numbered_image_tars``)?"""
    found = [re.match(r"^(.*?)(\d+)\.tar$", t) for t in tars]  # 000000.tar, train-000000.tar, not n01440764.tar
    return len(tars) >= 2 and all(found) and len({(m.group(1), len(m.group(2))) for m in found}) == 1 and (
        found[0].group(1)[-1:] in ("", "-", "_", "."))


def refuse_numbered_images(root: str, tars: list[str], t: str, names: list[str], key: str) -> None:
    """The DatasetError of ``dataset._refuse_numbered_image_tars`` when the tar ``t``'s first member ``names``
    are images not named after it (a bucket prefix's too: ``bucketroot``)."""
    stem = t[:-4]
    if any(os.path.basename(n).startswith(stem) or not n.lower().endswith((*IMAGE_EXTENSIONS, ".webp")) for n in names):
        return  # ImageNet's class tars name their images after the tar (n01440764.tar: n01440764_10026.JPEG)
    raise DatasetError(f"{key} {root} holds numbered tars of images alone ({tars[0]} ... {tars[-1]}): unlabelled "
                       "WebDataset shards or class tars (each tar's name a label)? set dataset.layout: webdataset "
                       "(with dataset.label: none) or imagenet_tars")
