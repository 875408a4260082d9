"""Parquet files as Hugging Face ``datasets`` stores images: the ``parquet`` layout's index and read.

**Which files**: ``dataset.root`` is one ``.parquet`` file, a folder of them (its top level, by
name) or a glob (``/data/hf/train-*.parquet``, by name). Samples are the rows, file by file.

**Columns**: ``dataset.image_column`` (default ``image``) is a struct with a ``bytes`` field (the
``Image()`` feature: ``struct<bytes: binary, path: string>``) or a binary column;
``dataset.label_column`` (default ``label``) an integer column. Class names come from the
``ClassLabel`` feature in the file's ``huggingface`` schema metadata where present, else
``"0" .. str(max label)``. A row whose label is null or negative (Hugging Face writes -1 for an
unlabelled row), or whose image holds no bytes (kept by path only), is skipped with its reason; a
file whose images all are is an error. A folder or glob of the files of several Hugging Face
splits (``train-00000-of-00001.parquet`` beside ``test-...``) is an error naming one split's glob.
A file without either column, with a column of another type, whose ``ClassLabel`` names differ
from the first file's, or whose footer cannot be read is a one-line error naming it.

**Index**: from each file's footer (row groups and their row counts) and its label column alone
(the images are not read): per sample, the file, the row group and the row within it.

**Reading**: Parquet's smallest unit that pyarrow reads cheaply is a row group's column chunk,
so a sample's read is that of its row group's image column (pages are compressed together); a
worker keeps the ``_GROUPS_KEPT`` most recently read row groups (with ``loader.shuffle: block``
a window's worth and two more: ``keep_groups``; at most ``_BYTES_KEPT`` bytes of them), so
samples of one row group in one batch cost
one read. The read amplification (bytes read per image byte) under a full permutation is about
the rows per row group; under a block shuffle, about a window's rows per batch's rows (at most
the worker count), measured in BENCHMARKS.md. Each file's identity
(``store.identity_of``) is taken before its footer is read and checked after every read: a file
rewritten or replaced since it was indexed raises ``StorageChanged`` (its batches wait), never
another row's bytes. Reading needs ``pyarrow`` (``pip install 'prefetchd[parquet]'``).
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import logging
import os
import re
import stat
import time
from collections import OrderedDict
from dataclasses import dataclass, replace

import numpy as np

from prefetchd.core.words import plural
from prefetchd.sources.base import (
    DatasetError,
    Index,
    StorageChanged,
    StorageUnavailable,
    build_index,
    cache_path,
    numbered_classes,
    open_cached,
    read_cache,
    write_cache,
)
from prefetchd.sources.store import LOCAL, identity_of

log = logging.getLogger("prefetchd.dataset")

META = "parquetmeta.json"
_VERSION = 1
_GROUPS_KEPT = 4  # row groups' image columns a worker keeps (the batch's samples of one group: one read)


_BYTES_KEPT = 512 << 20  # and at most this many bytes of them (pyarrow's own writes make groups of 100s of MB)


def keep_groups(window: int) -> None:
    """Keep a block shuffle's window of row groups and two more in this process; never fewer than
    the default. A batch at a window's edge reads rows of two windows, but in position order (the
    end of one window's, then the next one's), so a least-recently-used window's worth reads each once."""
    global _GROUPS_KEPT
    _GROUPS_KEPT = max(4, int(window) + 2)
_ARRAYS = ("blob", "offsets", "labels", "file_ids", "group", "row")


def pyarrow_parquet():
    """``pyarrow.parquet``, or a one-line DatasetError saying how to install it."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError("reading Parquet needs pyarrow, which is not installed: pip install 'prefetchd[parquet]' "
                           "(or pip install pyarrow)") from None
    return pq


# Hugging Face's names for a split's files (push_to_hub: data/train-00000-of-00004.parquet; older
# ones end in a hash), or its folders (the Hub's Parquet conversion: default/train/0000.parquet):
# a folder or glob of several splits (mnist/: train and test) is several data sets
_SPLIT_FILE = re.compile(r"^(.+?)-\d{5}-of-\d{5}(?:-[0-9a-f]+)?\.parquet$")
_SPLIT_FOLDERS = ("train", "test", "validation", "valid", "val", "dev")


def _one_split(root: str, key: str, base: str, names: list[str]) -> None:
    """A DatasetError if ``names`` are the files of more than one Hugging Face split: the test
    split read into the train set without a word."""
    splits: dict[str, str] = {}
    for n in names:
        m = _SPLIT_FILE.match(os.path.basename(n))
        folder = os.path.basename(os.path.dirname(n))
        if m or folder in _SPLIT_FOLDERS:
            splits.setdefault(m.group(1) if m else folder, n)
    if len(splits) > 1:
        pick = "train" if "train" in splits else sorted(splits)[0]
        one = os.path.join(os.path.dirname(splits[pick]), pick + "-*.parquet") if _SPLIT_FILE.match(
            os.path.basename(splits[pick])) else os.path.join(os.path.dirname(splits[pick]), "*.parquet")
        raise DatasetError(f"{key} {root} holds the Parquet files of {len(splits)} splits ({', '.join(sorted(splits))}"
                           f"; e.g. {splits[pick]}): a data set is one split; set {key} to one split's files, e.g. "
                           f"{os.path.join(base, one)}")


def files_of(root: str, key: str = "dataset.root") -> tuple[str, list[str]]:
    """(base folder, the ``.parquet`` files ``root`` names, relative to it, in order); the files of
    one Hugging Face split (``_one_split``)."""
    base, names = _files_of(root, key)
    _one_split(root, key, base, names)
    return base, names


def _files_of(root: str, key: str) -> tuple[str, list[str]]:
    if any(c in root for c in "*?[") and not os.path.exists(root):
        found = sorted(glob.glob(root))
        if not found:
            raise DatasetError(f"{key} {root} matches no files")
        base = os.path.dirname(root[:min(root.index(c) for c in "*?[" if c in root)])
        return base, [os.path.relpath(p, base) for p in found]
    try:
        st = os.stat(root)
    except OSError as e:
        raise DatasetError(f"{key} {root} cannot be read: {e.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        names = sorted(e.name for e in os.scandir(root) if e.name.endswith(".parquet") and e.is_file()
                       and not e.name.startswith("."))
        if not names:
            raise DatasetError(f"{key} {root} holds no .parquet files")
        return root, names
    return os.path.dirname(root), [os.path.basename(root)]


def _class_names(schema, label_column: str) -> list[str] | None:
    """The ``ClassLabel`` names of ``label_column`` in a file's Hugging Face metadata, if any."""
    raw = (schema.metadata or {}).get(b"huggingface")
    try:
        feature = json.loads(raw)["info"]["features"][label_column]
        names = feature.get("names") if feature.get("_type") == "ClassLabel" else None
        return [str(n) for n in names] if names else None
    except (TypeError, ValueError, KeyError, AttributeError):
        return None


def _check_columns(schema, path: str, image_column: str, label_column: str) -> None:
    import pyarrow as pa

    names = schema.names
    for col, what in ((image_column, "image_column"), (label_column, "label_column")):
        if col not in names:
            raise DatasetError(f"{path} has no column {col!r} (its columns: {', '.join(names[:8])}): set "
                               f"dataset.{what} to the one that holds the {what.split('_')[0]}s")
    t = schema.field(image_column).type
    ok = pa.types.is_binary(t) or pa.types.is_large_binary(t) or (
        pa.types.is_struct(t) and t.get_field_index("bytes") >= 0
        and (pa.types.is_binary(t.field("bytes").type) or pa.types.is_large_binary(t.field("bytes").type)))
    if not ok:
        raise DatasetError(f"{path}: column {image_column!r} is {t}, not binary nor struct<bytes: binary, ...> "
                           "(Hugging Face's Image feature): set dataset.image_column to the image column")
    t = schema.field(label_column).type
    if not pa.types.is_integer(t):
        names = pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_dictionary(t)
        raise DatasetError(f"{path}: column {label_column!r} is {t}, not integer class indices: set "
                           "dataset.label_column to the column of class indices" + (
                               ", or write the labels as indices (datasets: ds.class_encode_column"
                               f"({label_column!r}), which keeps the names as a ClassLabel)" if names else ""))


def scan(root: str, image_column: str = "image", label_column: str = "label",
         key: str = "dataset.root") -> tuple[ParquetIndex, list]:
    """Index the Parquet files ``root`` names (see the module docstring). Returns the index and the
    stamps (each file's identity) that validate a cache of it."""
    base, files = files_of(root, key)
    index = collect(root, base, files, _opened_local, image_column, label_column, key)
    return index, [[os.path.join(base, n), *ident] for n, ident in zip(files, index.identity, strict=True)]


@contextlib.contextmanager
def _opened_local(path: str):
    """(a file object of ``path``, its identity taken before its footer is read), checked again after."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise DatasetError(f"the Parquet file {path} cannot be opened: {e.strerror}") from None
    try:
        ident = identity_of(os.fstat(fd))
        with os.fdopen(os.dup(fd), "rb") as f:
            yield f, ident
        if identity_of(os.fstat(fd)) != ident:
            raise DatasetError(f"{path} changed while it was being indexed: is a copy still writing it?")
    finally:
        os.close(fd)


def collect(root: str, base: str, files: list[str], opened, image_column: str, label_column: str,
            key: str) -> ParquetIndex:
    """The index of ``files`` (relative to ``base``), each read through ``opened(path)``: a context
    manager giving (a file object pyarrow reads, the file's identity), raising a DatasetError
    when the file changed while it was read (a local file's ``_opened_local``, a bucket's
    ``bucketparquet``)."""
    pq = pyarrow_parquet()
    import pyarrow as pa

    if len(files) > 65535:
        raise DatasetError(f"{key} {root} names {len(files)} files; at most 65535 are supported")
    rel, labels, fids, groups, rows, identity, skipped = [], [], [], [], [], [], []
    names: list[str] | None = None
    for a, name in enumerate(files):
        path = os.path.join(base, name)
        with opened(path) as (f, ident):
            try:
                pf = pq.ParquetFile(f)
                _check_columns(pf.schema_arrow, path, image_column, label_column)
                col = pf.read(columns=[label_column]).column(0)
            except StorageChanged:  # a bucket's object overwritten while it was read (its ETag moved)
                raise DatasetError(f"{path} changed while it was being indexed: is an upload still writing it? start "
                                   "again once it is complete") from None
            except OSError as e:
                if e.errno == errno.ETIMEDOUT:  # a bucket that did not answer through its retries: not the file
                    raise StorageUnavailable(f"{key} {path} cannot be read: the bucket did not answer "
                                             f"({e.strerror or e}); the daemon exits 75 to be started again") from None
                if "://" in path and e.errno in (errno.EACCES, errno.ENOENT):  # the key's refusal, a deleted object
                    from prefetchd.sources import objectstore

                    raise DatasetError(f"{key} {path} cannot be read: "
                                       f"{objectstore.words(e, path.split('://', 1)[0])}") from None
                raise DatasetError(f"{path} is not a readable Parquet file ({str(e).splitlines()[0]}): a cut or "
                                   "corrupt copy? write it again") from None
            except pa.ArrowException as e:
                raise DatasetError(f"{path} is not a readable Parquet file ({str(e).splitlines()[0]}): a cut or "
                                   "corrupt copy? write it again") from None
            own = _class_names(pf.schema_arrow, label_column)
            if names is not None and own is not None and own != names:  # label k is another class there
                raise DatasetError(f"{path}: its ClassLabel names ({', '.join(own[:4])} ...) are not those of "
                                   f"{files[0]} ({', '.join(names[:4])} ...), so one label would be two classes: "
                                   f"set {key} to the files of one data set")
            names = names or own
            sizes = [pf.metadata.row_group(g).num_rows for g in range(pf.metadata.num_row_groups)]
            pathonly = _without_bytes(pf, image_column)
        values = col.to_numpy(zero_copy_only=False)
        valid = np.asarray(col.is_valid())
        if pathonly is not None and sum(sizes) and pathonly.all():
            raise DatasetError(f"{path}: its column {image_column!r} holds no image bytes, only paths (what "
                               "datasets' to_parquet writes for images loaded from files): write it again with the "
                               "bytes in (ds.with_format('arrow').map(datasets.table.embed_table_storage, "
                               "batched=True), as push_to_hub does)")
        k = 0
        for g, n in enumerate(sizes):
            for r in range(n):
                lab = values[k]
                if pathonly is not None and pathonly[k]:
                    skipped.append(f"{path}: row {k} (no image bytes: its image is kept by path only)")
                elif not valid[k] or lab < 0:
                    skipped.append(f"{path}: row {k} (label {'null' if not valid[k] else int(lab)}: unlabelled)")
                else:
                    rel.append(os.fsencode(f"{name}#{k}"))
                    labels.append(int(lab))
                    fids.append(a)
                    groups.append(g)
                    rows.append(r)
                k += 1
        identity.append(ident)
    if not rel:
        raise DatasetError(f"{key} {root}: its {len(files)} file(s) hold no labelled rows")
    top = max(labels)
    if names is not None and top >= len(names):
        raise DatasetError(f"{key} {root}: labels go up to {top}, but the ClassLabel metadata names {len(names)} "
                           "classes")
    if names is None:
        names = numbered_classes(top, key, root, os.path.join(base, os.fsdecode(rel[labels.index(top)])))
    index = build_index(base, names, rel, labels)
    index = ParquetIndex(**{f: getattr(index, f) for f in ("root", "classes", "blob", "offsets", "labels",
                                                           "fingerprint")},
                         skipped=tuple(skipped[:1000]), kind="parquet", files=tuple(files),
                         file_ids=np.asarray(fids, np.uint16), group=np.asarray(groups, np.uint32),
                         row=np.asarray(rows, np.uint32), identity=tuple(identity), image_column=image_column)
    return index


def _without_bytes(pf, column: str) -> np.ndarray | None:
    """Which rows' image holds no bytes (null: ``datasets`` keeps an image loaded from a file by its
    path alone), from the footer's null counts; a row group with some such rows has its image
    column read to tell which. None: every row has bytes, or the footer does not say."""
    import pyarrow as pa

    md = pf.metadata
    struct = pa.types.is_struct(pf.schema_arrow.field(column).type)
    leaf = f"{column}.bytes" if struct else column
    out, start = None, 0
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        chunk = next((rg.column(c) for c in range(rg.num_columns) if rg.column(c).path_in_schema == leaf), None)
        stats = chunk.statistics if chunk is not None else None
        nulls = stats.null_count if stats is not None and stats.has_null_count else 0  # unknown: the read says
        if nulls:
            if out is None:
                out = np.zeros(md.num_rows, bool)
            if nulls >= rg.num_rows:
                out[start:start + rg.num_rows] = True
            else:
                got = pf.read_row_group(g, columns=[column]).column(0).combine_chunks()
                ok = np.asarray(got.is_valid(), bool)
                if struct:
                    ok &= np.asarray(got.field("bytes").is_valid(), bool)
                out[start:start + rg.num_rows] = ~ok
        start += rg.num_rows
    return out


@dataclass(frozen=True)
class ParquetIndex(Index):
    """An ``Index`` whose samples are rows of Parquet files."""

    layout: str = "parquet"
    files: tuple[str, ...] = ()  # relative to root
    file_ids: np.ndarray | None = None  # uint16 [n]
    group: np.ndarray | None = None  # uint32 [n]: the row group
    row: np.ndarray | None = None  # uint32 [n]: the row within its row group
    identity: tuple = ()  # each file's (dev, inode, size, mtime_ns, ctime_ns) when indexed
    image_column: str = "image"
    scan_s: float = 0.0
    skipped_what = ("row", "rows")
    skipped_rule = "a row whose label is null or negative is unlabelled"

    def file(self, i: int) -> str:
        return os.path.join(self.root, self.files[int(self.file_ids[i])])

    def path(self, i: int) -> str:
        return os.path.join(self.root, self.relpath(i))

    def read(self, i: int) -> bytes:
        """Row ``i``'s image bytes (its row group's image column read, or kept from a read before)."""
        column = self._column(i)
        value = column[int(self.row[i])].as_py()
        data = value.get("bytes") if isinstance(value, dict) else value
        if not data:
            raise OSError(errno.ENODATA, "the row holds no image bytes (an image kept by path only?)")
        return data

    def _column(self, i: int):
        """The image column of row ``i``'s row group."""
        a, g = int(self.file_ids[i]), int(self.group[i])
        return _group(self.file(i), a, g, self.identity[a], self.image_column)

    def content_stamp(self, i: int) -> str:
        a = int(self.file_ids[i])
        return ":".join(map(str, (*self.identity[a], int(self.group[i]), int(self.row[i]))))

    def sample_size(self, i: int) -> int:
        return 0  # not known without reading its row group

    def block_sizes(self) -> np.ndarray:
        """The row groups' row counts (the rows kept), in index order: a row group is the least a
        read of one row costs, and its rows are consecutive in the index."""
        key = np.asarray(self.file_ids, np.uint64) << np.uint64(32) | np.asarray(self.group, np.uint64)
        starts = np.flatnonzero(np.concatenate(([True], key[1:] != key[:-1])))
        return np.diff(np.append(starts, len(key))).astype(np.int64)

    def describe(self) -> str:
        groups = len(self.block_sizes())
        per = len(self) // max(groups, 1)
        return (f"{os.path.basename(self.root.rstrip('/')) or self.root}, {len(self.files)} Parquet file(s) "
                f"(indexed in {self.scan_s:.1f} s); {plural(groups, 'row group')} of ~{per} rows: a sample's read is its row "
                f"group's image column, so a full shuffle (loader.shuffle: true) reads ~{per} x the image bytes; "
                f"loader.shuffle: block reads each row group about once a window per worker")

    @property
    def nbytes(self) -> int:
        return super().nbytes + sum(a.nbytes for a in (self.file_ids, self.group, self.row) if a is not None)


_groups: OrderedDict = OrderedDict()  # (path, group) -> the image column of that row group
_groups_pid = 0
_read_bytes = [0]  # compressed bytes of the row groups read by this process (the amplification's numerator)


def _group(path: str, a: int, g: int, identity: tuple, column: str, read=None):
    """Row group ``g``'s ``column`` of the file ``path`` (identity as indexed: ``identity``), kept
    for the next samples of it; ``read(path, g, identity, column)`` reads it (``_read_group``: a
    local file; ``bucketparquet``'s: an object)."""
    global _groups_pid
    if _groups_pid != os.getpid():
        _groups.clear()
        _groups_pid = os.getpid()
    hit = _groups.get((path, g))
    if hit is not None:
        _groups.move_to_end((path, g))
        return hit
    got = (read or _read_group)(path, g, identity, column)
    _groups[(path, g)] = got
    kept = sum(c.nbytes for c in _groups.values())
    while len(_groups) > _GROUPS_KEPT or (kept > _BYTES_KEPT and len(_groups) > 1):
        kept -= _groups.popitem(last=False)[1].nbytes  # the oldest first, the group just read kept
    return got


def _read_group(path: str, g: int, identity: tuple, column: str):
    pq = pyarrow_parquet()
    fd = LOCAL.open(path)
    try:
        with os.fdopen(os.dup(fd), "rb") as f:
            pf = pq.ParquetFile(f)
            got = pf.read_row_group(g, columns=[column]).column(0)
            md = pf.metadata.row_group(g)
            _read_bytes[0] += sum(md.column(c).total_compressed_size for c in range(md.num_columns)
                                  if md.column(c).path_in_schema.split(".")[0] == column)
        now = LOCAL.identity(fd)
    except Exception as e:
        LOCAL.forget(path)
        if isinstance(e, OSError) and e.errno is not None or isinstance(e, MemoryError):
            raise  # the system's error (pyarrow's out of memory too): not the row group's damage
        # pyarrow's own (an OSError without errno, ArrowInvalid, ...): the file is not the one
        # indexed, or it is and this row group is damaged (bad blocks, a copy cut short and
        # patched): then its samples are quarantined as undecodable files are, not waited for
        said = (str(e).splitlines() or [type(e).__name__])[0]
        try:
            same = identity_of(os.stat(path))[1:] == tuple(identity)[1:]  # (the device number may move)
        except OSError:
            raise  # the file is gone: judged as above
        if not same:
            raise StorageChanged(errno.ESTALE, f"the archive {path}{StorageChanged.MARK} (its row group {g} cannot be "
                                 f"read: {said}): batches from it wait; restart the daemon") from None
        raise OSError(errno.EBADMSG, f"row group {g} of {path} cannot be read ({said}); the file is the one indexed, "
                      "so the row group is damaged") from None
    changed = [n for n, was, is_ in zip(("device", "inode", "size", "mtime_ns", "ctime_ns"), identity, now, strict=True)
               if was != is_ and n != "device"]
    if changed:
        LOCAL.forget(path)
        raise StorageChanged(errno.ESTALE, f"the archive {path}{StorageChanged.MARK} ({', '.join(changed)} moved): "
                             "its rows may be others now, so batches from it wait; restart the daemon to index it again")
    return got


# --- the cache -------------------------------------------------------------------------------------


def stamps_valid(stamps: list) -> bool:
    try:
        return all([s[0], *identity_of(os.stat(s[0]))] == s for s in stamps)
    except OSError:
        return False


def load_cached(cdir: str, validate: bool = True) -> ParquetIndex | None:
    def build(meta: dict, arrays: dict) -> ParquetIndex:
        return ParquetIndex(meta["root"], tuple(meta["classes"]), arrays["blob"], arrays["offsets"], arrays["labels"],
                            meta["fingerprint"], files_dir=cdir, skipped=tuple(meta.get("skipped", ())),
                            kind="parquet", files=tuple(meta["files_"]), file_ids=arrays["file_ids"],
                            group=arrays["group"], row=arrays["row"],
                            identity=tuple(tuple(x) for x in meta["identity"]), image_column=meta["image_column"],
                            scan_s=meta["scan_s"])

    return read_cache(cdir, META, _VERSION, build, stamps_valid if validate else None)


def open_files(files_dir: str) -> ParquetIndex | None:
    """The cached Parquet index in ``files_dir`` (what workers open), or None if it is not one."""
    return open_cached(files_dir, META, load_cached)


def load(root: str, image_column: str, label_column: str, cache_dir: str | None, use_cache: bool = True,
         key: str = "dataset.root") -> tuple[ParquetIndex, bool]:
    """As ``dataset.load_index`` for Parquet: (index, from_cache)."""
    cdir = cache_path(cache_dir, f"{root}|{image_column}|{label_column}", "parquet", ())
    if use_cache:
        cached = load_cached(cdir)
        # the stamps hold each indexed file's identity; a file added to the folder or the glob since
        # shows only in the listing
        if cached is not None and tuple(files_of(root, key)[1]) == tuple(cached.files):
            return cached, True
    t0 = time.monotonic()
    index, stamps = scan(root, image_column, label_column, key)
    index = replace(index, scan_s=round(time.monotonic() - t0, 3))
    if use_cache:
        try:
            write_cache(cdir, META, {k: getattr(index, k) for k in _ARRAYS},
                        {"version": _VERSION, "root": index.root, "classes": list(index.classes),
                         "fingerprint": index.fingerprint, "stamps": stamps, "count": len(index),
                         "skipped": list(index.skipped), "files_": list(index.files),
                         "identity": [list(x) for x in index.identity], "image_column": index.image_column,
                         "scan_s": index.scan_s})
            index = load_cached(cdir) or index
        except OSError as e:
            log.warning("cannot write the index cache in %s (%s); the next start scans again", cdir, e.strerror)
    return index, False
