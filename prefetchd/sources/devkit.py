"""The ImageNet (ILSVRC2012) devkit: validation labels from ``data/meta.mat`` and the ground truth.

``ILSVRC2012_devkit_t12.tar.gz`` (or the folder it extracts to) holds two files we read:

* ``data/ILSVRC2012_validation_ground_truth.txt``: line *k* is the ILSVRC2012_ID of
  ``ILSVRC2012_val_{k:08d}.JPEG`` (k from 1);
* ``data/meta.mat``: a MATLAB v5 file whose variable ``synsets`` is a struct array with fields
  ``ILSVRC2012_ID``, ``WNID`` and ``num_children`` (among others). The 1,000 classes are the leaf
  synsets (``num_children == 0``); the others are inner WordNet nodes. The IDs are NOT in WNID
  order, so a label is never an ID minus one: it is the WNID, looked up among the train set's
  class names.

The MAT v5 reader here covers what ``meta.mat`` uses (and what MATLAB and ``scipy.io.savemat``
write for it): zlib-compressed elements, struct, cell, char and real numeric arrays, the small
element form and both byte orders. We keep it instead of depending on scipy (tens of MB) for one
2 MB file; a sparse, complex or object array is a one-line error.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import stat
import struct
import tarfile
import zlib

import numpy as np

META = "data/meta.mat"
GROUND_TRUTH = "data/ILSVRC2012_validation_ground_truth.txt"
VAL_NAME = re.compile(rb"ILSVRC2012_val_(\d{8})\.[A-Za-z]+$")

_MI_MATRIX, _MI_COMPRESSED = 14, 15
_MI_DTYPES = {1: "i1", 2: "u1", 3: "i2", 4: "u2", 5: "i4", 6: "u4", 7: "f4", 9: "f8", 12: "i8", 13: "u8",
              16: "u1", 17: "u2", 18: "u4"}
_CELL, _STRUCT, _CHAR = 1, 2, 4
_NUMERIC = set(range(6, 16))


class MatError(ValueError):
    pass


def loadmat(data: bytes) -> dict[str, object]:
    """The variables of a MAT v5 file: struct arrays become lists of dicts, cells lists, char
    arrays str (rows joined by newlines), numeric arrays flat numpy arrays (column-major order).
    A damaged file raises ``MatError`` (never another exception: a fuzz found IndexError)."""
    try:
        return _loadmat(data)
    except MatError:
        raise
    except (IndexError, ValueError, TypeError, KeyError, OverflowError, struct.error, RecursionError,
            MemoryError, zlib.error) as e:
        raise MatError(f"the file is damaged ({type(e).__name__}: {str(e)[:80]})") from None


def _loadmat(data: bytes) -> dict[str, object]:
    if len(data) < 128 or data[126:128] not in (b"IM", b"MI"):
        raise MatError("not a MATLAB v5 file (no MAT-file header)")
    bo = "<" if data[126:128] == b"IM" else ">"
    out: dict[str, object] = {}
    pos = 128
    while pos + 8 <= len(data):
        mtype, body, pos = _element(data, pos, bo)
        if mtype == _MI_COMPRESSED:
            try:
                inner = zlib.decompress(body)
            except zlib.error as e:
                raise MatError(f"a compressed element is corrupt ({e})") from None
            mtype, body, _ = _element(inner, 0, bo)
        if mtype == _MI_MATRIX:
            name, value = _matrix(body, bo)
            out[name] = value
    return out


def _element(buf: bytes, pos: int, bo: str) -> tuple[int, bytes, int]:
    """(type, body, position of the next element) of the data element at ``pos``."""
    if pos + 8 > len(buf):
        raise MatError("truncated element tag")
    word, nbytes = struct.unpack_from(bo + "II", buf, pos)
    if word >> 16:  # the small form: 2-byte size, 2-byte type, up to 4 bytes of data in the tag
        return word & 0xFFFF, buf[pos + 4: pos + 4 + (word >> 16)], pos + 8
    end = pos + 8 + nbytes
    if end > len(buf):
        raise MatError("an element runs past the end of the file")
    step = nbytes if word == _MI_COMPRESSED else (nbytes + 7) // 8 * 8  # compressed ones are not padded
    return word, buf[pos + 8: end], pos + 8 + step


def _numbers(mtype: int, body: bytes, bo: str) -> np.ndarray:
    if mtype not in _MI_DTYPES:
        raise MatError(f"unsupported data type {mtype}")
    return np.frombuffer(body, dtype=np.dtype(bo + _MI_DTYPES[mtype]))


def _matrix(body: bytes, bo: str) -> tuple[str, object]:
    if not body:  # MATLAB's empty matrix: a miMATRIX of zero bytes
        return "", np.zeros(0)
    t, flags, pos = _element(body, 0, bo)
    word = int(_numbers(t, flags, bo)[0])
    cls = word & 0xFF
    t, dims, pos = _element(body, pos, bo)
    shape = tuple(int(d) for d in _numbers(t, dims, bo))
    t, name, pos = _element(body, pos, bo)
    count = int(np.prod(shape, dtype=object)) if shape else 0
    if cls in (_STRUCT, _CELL) and count > len(body) // 8:  # each element takes 8 bytes at least
        raise MatError(f"variable {name!r}: {count} elements cannot fit in {len(body)} bytes")
    if cls == _STRUCT:
        t, flen, pos = _element(body, pos, bo)
        width = int(_numbers(t, flen, bo)[0])
        t, names, pos = _element(body, pos, bo)
        fields = [names[i: i + width].split(b"\0", 1)[0].decode() for i in range(0, len(names), width)] if width else []
        items = []
        for _ in range(count):
            item = {}
            for f in fields:
                t, sub, pos = _element(body, pos, bo)
                item[f] = _matrix(sub, bo)[1]
            items.append(item)
        return name.decode(), items
    if cls == _CELL:
        cells = []
        for _ in range(count):
            t, sub, pos = _element(body, pos, bo)
            cells.append(_matrix(sub, bo)[1])
        return name.decode(), cells
    if cls == _CHAR:
        if pos >= len(body):
            return name.decode(), ""
        t, chars, pos = _element(body, pos, bo)
        if t == 16:  # miUTF8
            codes = np.frombuffer(chars.decode("utf-8").encode("utf-32-le"), "<u4")
        else:
            codes = _numbers(t, chars, bo)
        grid = codes.reshape(shape, order="F") if count == len(codes) and len(shape) == 2 else codes.reshape(1, -1)
        return name.decode(), "\n".join("".join(map(chr, row)) for row in grid)
    if cls in _NUMERIC:
        if word & 0x800:
            raise MatError(f"variable {name.decode()!r}: complex arrays are not supported")
        if pos >= len(body):
            return name.decode(), np.zeros(0)
        t, real, pos = _element(body, pos, bo)
        return name.decode(), _numbers(t, real, bo)
    raise MatError(f"variable {name.decode()!r}: MATLAB class {cls} (sparse or object) is not supported")


# --- the devkit ----------------------------------------------------------------------------------------


class DevkitError(ValueError):
    pass


_MAX_BYTES = 64 << 20  # a devkit object larger than this is another file (ImageNet's is 2.5 MB)


def _read_files(devkit: str) -> tuple[bytes, bytes]:
    """(meta.mat, ground truth) from the devkit archive or its extracted folder."""
    want = {META: None, GROUND_TRUTH: None}
    if "://" in devkit:
        want.update(_read_url(devkit))
    elif os.path.isdir(devkit):
        for dirpath, dirnames, filenames in os.walk(devkit):
            dirnames.sort()
            for rel in want:
                if want[rel] is None and dirpath.endswith("data") and os.path.basename(rel) in filenames:
                    with open(os.path.join(dirpath, os.path.basename(rel)), "rb") as f:
                        want[rel] = f.read()
    else:
        try:
            if not stat.S_ISREG(os.stat(devkit).st_mode):  # a FIFO or a device would block or never end
                raise DevkitError(f"validation.devkit {devkit} is not a regular file or a folder; give "
                                  "ILSVRC2012_devkit_t12.tar.gz or the folder it extracts to")
            with tarfile.open(devkit, "r:*") as tf:  # read by name, in memory: nothing is extracted
                want.update(_from_tar(tf))
        except FileNotFoundError:
            raise DevkitError(f"validation.devkit {devkit} does not exist") from None
        except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
            raise DevkitError(f"validation.devkit {devkit} is not a readable tar or .tar.gz archive "
                              f"({_said(e)}); give ILSVRC2012_devkit_t12.tar.gz or the folder it extracts to") from None
    missing = [rel for rel, v in want.items() if v is None]
    if missing:
        raise DevkitError(f"validation.devkit {devkit} has no {' or '.join(missing)}; "
                          "give ILSVRC2012_devkit_t12.tar.gz or the folder it extracts to")
    return want[META], want[GROUND_TRUTH]


def _read_url(devkit: str) -> dict[str, bytes]:
    """{META: ..., GROUND_TRUTH: ...} of a devkit in a bucket: its archive (a ``.tar.gz``, ``.tgz`` or
    ``.tar`` object, one GET: 2.5 MB) or the prefix it was extracted to (the two files under a
    ``data/`` folder of it, one listing and two GETs)."""
    from prefetchd.sources import objectstore

    with _bucket_errors(devkit):
        store = objectstore.store_for(devkit, None, "validation.devkit")
        if devkit.lower().endswith((".tar.gz", ".tgz", ".tar")):
            size = store.head(devkit).size
            if size > _MAX_BYTES:  # the train tar given as the devkit: not 147 GB read into memory
                raise DevkitError(f"validation.devkit {devkit} is {size:,} bytes, not ImageNet's devkit (2.5 MB): "
                                  "give ILSVRC2012_devkit_t12.tar.gz")
            data = store.read(devkit)
            try:
                with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tf:
                    return _from_tar(tf)
            except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
                raise DevkitError(f"validation.devkit {devkit} is not a readable tar or .tar.gz archive "
                                  f"({_said(e)}); give ILSVRC2012_devkit_t12.tar.gz or the prefix it was "
                                  "extracted to") from None
        found, listed = {}, []
        for rel, _, _ in store.list(devkit):
            listed.append(rel)
            want = _which(devkit, rel)
            if want and want not in found:
                found[want] = rel
        if not listed:
            raise DevkitError(f"validation.devkit {devkit} lists no objects: give the URL of "
                              "ILSVRC2012_devkit_t12.tar.gz in the bucket, or the prefix it was extracted to")
        archives = [r for r in listed if "devkit" in r.lower() and r.lower().endswith((".tar.gz", ".tgz"))]
        if len(found) < 2 and archives:  # the folder holding the devkit's archive
            raise DevkitError(f"validation.devkit {devkit} is no extracted devkit, but holds "
                              f"{archives[0]}: set validation.devkit to {devkit.rstrip('/')}/{archives[0]}")
        return {want: store.read(f"{devkit.rstrip('/')}/{rel}") for want, rel in found.items()}


@contextlib.contextmanager
def _bucket_errors(url: str):
    """A devkit in a bucket that cannot be read, in one line: ``DevkitError``."""
    from prefetchd.sources import objectstore
    from prefetchd.sources.base import DatasetError

    try:
        yield
    except FileNotFoundError:
        raise DevkitError(f"validation.devkit {url} is not in the bucket (404): give the URL of "
                          "ILSVRC2012_devkit_t12.tar.gz there, or a local path") from None
    except OSError as e:
        raise DevkitError(f"validation.devkit {url} cannot be read: {objectstore.words(e)}") from None
    except DatasetError as e:
        raise DevkitError(str(e)) from None


def _which(devkit: str, rel: str) -> str | None:
    """META or GROUND_TRUTH when ``rel``, listed under the prefix ``devkit``, is that file: under a
    ``data/`` folder of it, or directly under it when it is that ``data/`` folder (as a local
    devkit folder may be ``.../data``)."""
    in_data = devkit.rstrip("/").rpartition("/")[2] == "data"
    for want in (META, GROUND_TRUTH):
        if rel == want or rel.endswith("/" + want) or (in_data and rel == want.rpartition("/")[2]):
            return want
    return None


def _said(e: Exception) -> str:
    """``tarfile``'s error in one line: ``r:*`` lists each compression it tried, a line each."""
    text = str(e)
    if "could not be opened successfully" in text:
        return "neither a tar nor a gzip, bzip2 or xz file"
    return " ".join(text.split())


def _from_tar(tf: tarfile.TarFile) -> dict[str, bytes]:
    """The devkit's two files from its archive, read by name in memory: nothing is extracted."""
    want: dict[str, bytes] = {}
    for m in tf:
        for rel in (META, GROUND_TRUTH):
            if rel not in want and m.isreg() and (m.name == rel or m.name.endswith("/" + rel)):
                f = tf.extractfile(m)
                if f is not None:
                    want[rel] = f.read()
    return want


def url_stamp(url: str) -> list:
    """A devkit object's cache stamp: its URL, size and ETag now (one HEAD); a prefix's: its
    listing's names, sizes and ETags (one listing)."""
    from prefetchd.sources import objectstore

    with _bucket_errors(url):
        store = objectstore.store_for(url, None, "validation.devkit")
        if url.lower().endswith((".tar.gz", ".tgz", ".tar")):
            h = store.head(url)
            return [url, h.size, h.etag]
        return [url, *sorted(f"{rel}:{size}:{etag}" for rel, size, etag in store.list(url) if _which(url, rel))]


def _scalar(v: object) -> int:
    a = np.asarray(v).ravel()
    if a.size != 1:
        raise ValueError(f"expected one number, got {a.size}")
    return int(a[0])


def read_devkit(devkit: str) -> tuple[list[str], list[int | None]]:
    """``(wnids, labels)``: the leaf synsets' WNIDs, sorted, and for validation image number *k*
    (``labels[k - 1]``) the index of its WNID in that list."""
    meta, truth = _read_files(devkit)
    try:
        synsets = loadmat(meta).get("synsets")
        if not isinstance(synsets, list) or not synsets:
            raise MatError("no struct array 'synsets'")
        leaves = {_scalar(s["ILSVRC2012_ID"]): str(s["WNID"]).strip()
                  for s in synsets if _scalar(s["num_children"]) == 0}
    except (MatError, KeyError, ValueError, TypeError, IndexError, OverflowError, AttributeError) as e:
        raise DevkitError(f"validation.devkit {devkit}: {META} is not the ImageNet devkit's ({e}); download "
                          "ILSVRC2012_devkit_t12.tar.gz again") from None
    wnids = sorted(set(leaves.values()))
    where = {w: i for i, w in enumerate(wnids)}
    labels: list[int | None] = []
    for lineno, line in enumerate(truth.split(), 1):
        ident = int(line) if line.isdigit() else -1
        if ident not in leaves:
            raise DevkitError(f"validation.devkit {devkit}: {GROUND_TRUTH} line {lineno} has {line[:20]!r}, "
                              "not the ILSVRC2012_ID of a leaf synset in meta.mat")
        labels.append(where[leaves[ident]])
    return wnids, labels


DOWNLOAD = re.compile(r"ILSVRC\d{4}_")  # ImageNet's own files (ILSVRC2012_img_test_v10102019.tar): no class
_TEST_NAME = re.compile(rb"ILSVRC\d{4}_test_\d+\.[A-Za-z]+$")


def not_a_class(cls: str, members, images: list[bytes]) -> str | None:
    """Why a would-be class (``cls``: a class tar's or folder's name; its member or file names;
    its image names) is one of ImageNet's own files rather than a class, or None. Read as a
    class, it would shift every label after it."""
    if not images and any(n.lower().endswith(b".tar") for n in members):
        return "a tar of tars (ImageNet's train tar?)"
    if DOWNLOAD.match(cls):
        return unlabelled(images) or "named as one of ImageNet's download files, not as a class"
    return None


def unlabelled(images: list[bytes]) -> str | None:
    """Why a would-be class whose images are all ImageNet validation or test images may be the
    validation or test set left among the classes, or None. Judged against its siblings: where
    every class is so, they are a validation set in class folders (ImageNet's val after
    ``valprep.sh``: ``val/<wnid>/ILSVRC2012_val_*.JPEG``), not strays."""
    if images and all(val_number(n) is not None for n in images):
        return "a flat set of validation images (ImageNet's validation tar?)"
    if images and all(_TEST_NAME.search(n) for n in images):
        return "a set of unlabelled test images (ImageNet's test tar?)"
    return None


def is_devkit(path: str) -> bool:
    """Is ``path`` ImageNet's devkit (``ILSVRC2012_devkit_t12.tar.gz``, or the folder it extracts
    to: ``data/meta.mat`` in it, or in its only entry), a wrong value for a dataset's root? (The
    download folder, which holds the extracted devkit beside the tars, is not.)"""
    if os.path.isdir(path):
        entries = [e.name for e in os.scandir(path) if not e.name.startswith(".")]
        return any(os.path.isfile(os.path.join(path, *sub, META)) for sub in [()] + [(e,) for e in entries[:1]
                                                                                     if len(entries) == 1])
    name = os.path.basename(path).lower()
    return "devkit" in name and name.endswith((".tar.gz", ".tgz", ".tar"))


def val_number(name: bytes) -> int | None:
    """k of ``.../ILSVRC2012_val_{k:08d}.JPEG``, or None."""
    m = VAL_NAME.search(name)
    return int(m.group(1)) if m else None
