"""Differential tests against the implementations users already trust (issue 28).

* the tar reader (``tarheaders.members``) against Python's ``tarfile``: every regular member's
  name, data offset and size, for archives written by ``tarfile`` (GNU, PAX, ustar), by GNU ``tar``
  and ``bsdtar`` in each of their formats, and for hostile archives from a seeded generator (odd
  types, long and non-UTF-8 names, ``..``, truncations, flipped bytes): the same answer, or a clean
  refusal (``DatasetError``) where ``tarfile`` stops silently or fails;
* the ImageFolder order against torchvision's rule (torchvision does not import here; its
  ``find_classes`` and ``make_dataset`` are, in torchvision/datasets/folder.py:
  ``sorted(entry.name for entry in os.scandir(dir) if entry.is_dir())`` and
  ``for root, _, fnames in sorted(os.walk(class_dir, followlinks=True)): for fname in sorted(fnames)``),
  on seeded random trees with non-UTF-8 names and names that sort around ``/``; the class tars of the
  same tree index to the same order and fingerprint;
* the MAT reader (``devkit.loadmat``) against ``scipy.io.loadmat`` on generated files, and fuzzed
  ones: the same values, or ``MatError``, never another exception.
"""

from __future__ import annotations

import io
import os
import random
import subprocess
import tarfile

import aptools
import numpy as np
import pytest

from prefetchd.sources.dataset import DatasetError, load_index
from prefetchd.sources.tarheaders import members

EXTS = (".jpeg", ".jpg", ".png")


# --- tar: our reader against tarfile ---------------------------------------------------------------------


def ours(path: str) -> list[tuple[bytes, int, int]]:
    fd = os.open(path, os.O_RDONLY)
    try:
        return members(fd, 0, os.fstat(fd).st_size, path, [])
    finally:
        os.close(fd)


def reference(path: str) -> list[tuple[bytes, int, int]]:
    """tarfile's regular members, by the rule our reader documents: links, devices, sparse files
    skipped; absolute names and ``..`` skipped; ``.`` and empty components dropped."""
    out = []
    with tarfile.open(path, "r:") as tf:
        for m in tf.getmembers():
            if not m.isreg() or m.issparse():
                continue
            name = os.fsencode(m.name) if isinstance(m.name, str) else m.name
            parts = [p for p in name.split(b"/") if p and p != b"."]
            if name.startswith(b"/") or b".." in parts or not parts:
                continue
            out.append((b"/".join(parts), m.offset_data, m.size))
    return out


def agree(path: str) -> str:
    """'same' or 'refused' (ours raised DatasetError); fails on any other outcome."""
    try:
        got = ours(path)
    except DatasetError:
        return "refused"
    assert got == reference(path), path
    return "same"


def _tree(root: str, long: bool) -> None:
    """Files a real dataset has, and the odd ones: sizes around the block, nesting, spaces, links,
    a sparse file; with ``long``: names over 100 and 255 bytes, non-ASCII and non-UTF-8 names."""
    os.makedirs(os.path.join(root, "a", "b c"))
    for size in (0, 1, 511, 512, 513, 5000):
        with open(os.path.join(root, "a", f"f{size}.JPEG"), "wb") as f:
            f.write(os.urandom(size))
    with open(os.path.join(root, "a", "b c", "x.jpg"), "wb") as f:
        f.write(b"x" * 700)
    os.symlink("f1.JPEG", os.path.join(root, "a", "sym.JPEG"))
    os.link(os.path.join(root, "a", "f511.JPEG"), os.path.join(root, "a", "hard.JPEG"))
    with open(os.path.join(root, "sparse.bin"), "wb") as f:
        f.truncate(1 << 20)
        f.seek(1 << 19)
        f.write(b"s")
    if long:
        deep = os.path.join(root, "d" * 90, "e" * 90)
        os.makedirs(deep)
        with open(os.path.join(deep, "n" * 120 + ".JPEG"), "wb") as f:
            f.write(b"long" * 100)
        for name in (b"\xff\xfe.JPEG", "é.JPEG".encode(), "\ue000.JPEG".encode()):
            with open(os.path.join(os.fsencode(root), name), "wb") as f:
                f.write(name * 10)


_GNU = [("gnu", True), ("oldgnu", True), ("posix", True), ("ustar", False), ("v7", False)]
_BSD = [("pax", True), ("gnutar", True), ("ustar", False)]


@pytest.mark.parametrize("tool,fmt,long", [("tar", f, lg) for f, lg in _GNU] + [("bsdtar", f, lg) for f, lg in _BSD])
def test_archives_written_by_tar_tools_read_as_tarfile_reads_them(tmp_path, tool, fmt, long):
    aptools.ensure({tool: "libarchive-tools" if tool == "bsdtar" else "tar"})
    src = str(tmp_path / "src")
    _tree(src, long)
    out = str(tmp_path / "out.tar")
    if tool == "tar":
        cmd = ["tar", f"--format={fmt}", *(["--sparse"] if long else []), "-cf", out, "-C", src, "."]
    else:
        cmd = ["bsdtar", "--format", fmt, "-cf", out, "-C", src, "."]
    r = subprocess.run(cmd, capture_output=True)
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    got = ours(out)
    assert got == reference(out)
    names = {n.rpartition(b"/")[2] for n, _, _ in got}
    assert {b"f0.JPEG", b"f513.JPEG", b"x.jpg"} <= names and b"sym.JPEG" not in names
    if long:
        assert b"n" * 120 + b".JPEG" in names and b"\xff\xfe.JPEG" in names


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT])
def test_archives_written_by_tarfile_read_as_tarfile_reads_them(tmp_path, fmt):
    src = str(tmp_path / "src")
    _tree(src, long=fmt != tarfile.USTAR_FORMAT)
    out = str(tmp_path / "out.tar")
    with tarfile.open(out, "w", format=fmt) as tf:
        tf.add(src, arcname="src")
    assert agree(out) == "same"


_NAMES = ["a.JPEG", "b/c.jpg", "./d.png", "e//f.JPEG", "../up.JPEG", "/abs.JPEG", "g/../h.JPEG", "x" * 150 + ".JPEG",
          "y/" * 60 + "z.JPEG", "sp ace.JPEG", "-dash.JPEG", "é/ü.JPEG", "\udcff\udcfe.JPEG", "dup.JPEG", "dup.JPEG"]
_TYPES = [tarfile.REGTYPE] * 6 + [tarfile.AREGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE,
                                  tarfile.FIFOTYPE, tarfile.CHRTYPE, tarfile.CONTTYPE]


def _hostile(rng: random.Random) -> bytes:
    fmt = rng.choice([tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT])
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt, errors="surrogateescape") as tf:
        for _ in range(rng.randrange(0, 8)):
            info = tarfile.TarInfo(rng.choice(_NAMES))
            info.type = rng.choice(_TYPES)
            data = b""
            if info.type in (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE):
                data = bytes(rng.randrange(256) for _ in range(rng.choice([0, 1, 511, 512, 513, 1500])))
            elif info.type in (tarfile.SYMTYPE, tarfile.LNKTYPE):
                info.linkname = rng.choice(_NAMES)
            info.size = len(data)
            if fmt == tarfile.PAX_FORMAT and rng.random() < 0.3:
                info.pax_headers = {"comment": "c" * rng.randrange(0, 300), "mtime": "1.5"}
            try:
                tf.addfile(info, io.BytesIO(data))
            except ValueError:  # a name ustar cannot hold
                continue
    data = bytearray(buf.getvalue())
    cut = rng.random()
    if cut < 0.25 and len(data) > 1024:  # cut short: anywhere, or at a block boundary
        data = data[: rng.randrange(512, len(data) - 1023)]
        if rng.random() < 0.5:
            data = data[: len(data) // 512 * 512]
    elif cut < 0.5 and data:
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    return bytes(data)


def test_hostile_archives_read_as_tarfile_reads_them_or_are_refused(tmp_path):
    rng = random.Random(2028)
    outcomes = {"same": 0, "refused": 0}
    path = str(tmp_path / "h.tar")
    for _ in range(400):
        with open(path, "wb") as f:
            f.write(_hostile(rng))
        outcomes[agree(path)] += 1
    assert outcomes["same"] > 150 and outcomes["refused"] > 40, outcomes


# --- the ImageFolder order against torchvision's rule ---------------------------------------------------


def torchvision_order(root: str) -> list[tuple[str, int]]:
    """torchvision's ``ImageFolder`` samples (torchvision/datasets/folder.py, as documented)."""
    classes = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
    out = []
    for label, cls in enumerate(classes):
        for dirpath, _, fnames in sorted(os.walk(os.path.join(root, cls), followlinks=True)):
            for fname in sorted(fnames):
                if fname.lower().endswith(EXTS):
                    out.append((os.path.relpath(os.path.join(dirpath, fname), root), label))
    return out


_PARTS = [b"a", b"a-b", b"a b", b"a.b", b"a0", b"b", b"\xff", b"\xe9", "é".encode(), "\ue000".encode(), b"Z", b"_"]


def _random_tree(root: str, rng: random.Random) -> None:
    """Classes and nested folders named to sort differently as bytes, as str and as whole paths;
    no hidden folders (prefetchd skips them, torchvision would not)."""
    broot = os.fsencode(root)
    for c in rng.sample(_PARTS, rng.randrange(2, 5)):
        dirs = [c]
        for _ in range(rng.randrange(0, 4)):
            dirs.append(rng.choice(dirs) + b"/" + rng.choice(_PARTS))
        for d in dirs:
            os.makedirs(os.path.join(broot, d), exist_ok=True)
        for _ in range(rng.randrange(1, 8)):
            name = rng.choice(_PARTS) + rng.choice([b".JPEG", b".jpg", b"x.png", b".txt"])
            with open(os.path.join(broot, rng.choice(dirs), name), "wb") as f:
                f.write(b"i")
        with open(os.path.join(broot, c, b"keep.JPEG"), "wb") as f:  # no class without images
            f.write(b"i")


def test_imagefolder_order_is_torchvisions_and_class_tars_agree(tmp_path):
    rng = random.Random(7)
    for t in range(25):
        root = str(tmp_path / f"tree{t}")
        _random_tree(root, rng)
        index, _ = load_index(root, None, EXTS, None, use_cache=False)
        got = [(os.fsdecode(index.blob[index.offsets[i]:index.offsets[i + 1]].tobytes()), int(index.labels[i]))
               for i in range(len(index))]
        assert got == torchvision_order(root), root
        tars = str(tmp_path / f"tars{t}")  # the same classes as tars: the same order, labels, fingerprint
        os.makedirs(tars)
        for cls in index.classes:
            with tarfile.open(os.path.join(tars, cls + ".tar"), "w", format=tarfile.GNU_FORMAT,
                              errors="surrogateescape") as tf:
                tf.add(os.path.join(root, cls), arcname=".")
        tindex, _ = load_index(tars, None, EXTS, None, use_cache=False)
        assert tindex.fingerprint == index.fingerprint, root


# --- the MAT reader against scipy ---------------------------------------------------------------------------


def _random_synsets(rng: np.random.Generator, n: int):
    dt = [("ILSVRC2012_ID", "O"), ("WNID", "O"), ("num_children", "O"), ("children", "O"), ("words", "O")]
    arr = np.zeros((n, 1), dtype=dt)
    for k in range(n):
        kids = rng.integers(1, 100, size=int(rng.integers(0, 4))).astype(float)
        arr[k, 0] = (np.array([[k + 1]], float), f"n{int(rng.integers(0, 10**8)):08d}", np.array([[len(kids)]], float),
                     kids.reshape(1, -1) if len(kids) else np.zeros((1, 0)), "w" * int(rng.integers(0, 30)))
    return arr


def _scipy_values(v):
    """scipy's loadmat value as ours gives it: struct -> list of dicts, char -> str, numbers flat (F order)."""
    if isinstance(v, np.ndarray) and v.dtype.names:
        return [{f: _scipy_values(item[f]) for f in v.dtype.names} for item in v.ravel(order="F")]
    if isinstance(v, np.ndarray) and v.dtype.kind == "U":
        return "".join(v.ravel().tolist())
    if isinstance(v, str):
        return v
    return np.asarray(v).ravel(order="F")


def _same(a, b) -> bool:
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, str):
        return a == b
    return np.array_equal(np.asarray(a, float).ravel(), np.asarray(b, float).ravel())


def test_mat_reader_agrees_with_scipy_on_generated_and_fuzzed_files(tmp_path):
    from scipy.io import loadmat as scipy_loadmat
    from scipy.io import savemat

    from prefetchd.sources.devkit import MatError, loadmat

    rng = np.random.default_rng(8)
    path = str(tmp_path / "m.mat")
    files = []
    for t in range(30):
        savemat(path, {"synsets": _random_synsets(rng, int(rng.integers(1, 12))), "x": rng.random((2, 3))},
                do_compression=bool(t % 2))
        data = open(path, "rb").read()
        files.append(data)
        mine, ref = loadmat(data), scipy_loadmat(path, squeeze_me=False, chars_as_strings=True)
        for name in ("synsets", "x"):
            assert _same(mine[name], _scipy_values(ref[name])), (t, name)
    prng = random.Random(9)
    refused = 0
    for _ in range(1500):
        data = bytearray(prng.choice(files))
        for _ in range(prng.randrange(1, 4)):
            if prng.random() < 0.2 and data:
                data = data[: prng.randrange(len(data))]
            elif data:
                data[prng.randrange(len(data))] = prng.randrange(256)
        try:
            loadmat(bytes(data))
        except MatError:
            refused += 1
    assert refused > 100


def test_folders_sort_by_whole_path_as_torchvision_sorts_them(tmp_path):
    """"a-b" sorts before "a/x" as a path ('-' < '/'), after it as a walk would visit them."""
    root = str(tmp_path / "root")
    for d in ("c/a", "c/a/x", "c/a-b", "d"):  # d: a second class (one class alone is refused: core/classlike.py)
        os.makedirs(os.path.join(root, d), exist_ok=True)
        with open(os.path.join(root, d, "i.JPEG"), "wb") as f:
            f.write(b"i")
    index, _ = load_index(root, None, EXTS, None, use_cache=False)
    order = ["c/a/i.JPEG", "c/a-b/i.JPEG", "c/a/x/i.JPEG", "d/i.JPEG"]
    assert [index.relpath(i) for i in range(len(index))] == order
    assert [(p, int(p.startswith("d/"))) for p in order] == torchvision_order(root)


def test_non_utf8_member_names_sort_as_the_folder_scan_sorts_them(tmp_path):
    """b"\\xff" is U+DCFF as a surrogate, before U+E000 as str, after its 3 UTF-8 bytes as bytes."""
    names = [b"\xff.JPEG", "\ue000.JPEG".encode(), b"a.JPEG"]
    folder = tmp_path / "folder" / "c"
    folder.mkdir(parents=True)
    for n in names:
        with open(os.path.join(os.fsencode(str(folder)), n), "wb") as f:
            f.write(b"i")
    (tmp_path / "folder" / "d").mkdir()  # a second class (one class alone is refused: core/classlike.py)
    (tmp_path / "folder" / "d" / "z.JPEG").write_bytes(b"i")
    tars = tmp_path / "tars"
    tars.mkdir()
    for cls, inside in (("c", names), ("d", [b"z.JPEG"])):
        with tarfile.open(str(tars / f"{cls}.tar"), "w", format=tarfile.GNU_FORMAT, errors="surrogateescape") as tf:
            for n in inside:
                info = tarfile.TarInfo(os.fsdecode(n))
                info.size = 1
                tf.addfile(info, io.BytesIO(b"i"))
    a, _ = load_index(str(tmp_path / "folder"), None, EXTS, None, use_cache=False)
    b, _ = load_index(str(tars), None, EXTS, None, use_cache=False)
    order = [a.relpath(i) for i in range(len(a))]
    assert order == ["c/a.JPEG", "c/\udcff.JPEG", "c/\ue000.JPEG", "d/z.JPEG"] == [b.relpath(i) for i in range(len(b))]
    assert a.fingerprint == b.fingerprint


# --- tar: the ctime recheck (tarrecheck) finds every member tarfile finds, by its whole name ----------------


class _Members:
    """An index (``tarrecheck.misplaced``'s view: a flat tar) of the given (name, offset, size)."""

    layout, archive_ids = "flat-tar", None

    def __init__(self, found):
        self.names = [n for n, _, _ in found]
        self.block = np.array([off // 512 for _, off, _ in found], dtype=np.uint32)
        self.size = np.array([s for _, _, s in found], dtype=np.uint32)

    def __len__(self):
        return len(self.names)

    def relpath(self, i):
        return os.fsdecode(self.names[i])


def _recheck(path: str, found) -> str | None:
    from prefetchd.sources import tarrecheck

    fd = os.open(path, os.O_RDONLY)
    try:
        return tarrecheck.misplaced(fd, _Members(found), 0)
    finally:
        os.close(fd)


@pytest.mark.parametrize("writer", [("tarfile", tarfile.GNU_FORMAT), ("tarfile", tarfile.PAX_FORMAT),
                                    ("tarfile", tarfile.USTAR_FORMAT), ("tar", "gnu"), ("tar", "oldgnu"),
                                    ("tar", "posix"), ("bsdtar", "pax"), ("bsdtar", "gnutar")])
def test_the_ctime_recheck_vouches_for_every_member_tarfile_reads_and_no_swapped_name(tmp_path, writer):
    """Every regular member tarfile lists (long, non-ASCII and non-UTF-8 names included) is found
    by the recheck with its whole name at its offset; names swapped between two members of one
    size are not, however alike (long names alike in their first 100 bytes). On the tree before,
    a PAX tar's non-ASCII names were refused, and the swapped long names vouched for."""
    tool, fmt = writer
    src = str(tmp_path / "src")
    long = fmt not in (tarfile.USTAR_FORMAT,)
    _tree(src, long)
    if long:
        for k in (1, 2):
            with open(os.path.join(src, "d" * 90, "e" * 90, "n" * 120 + f"_{k}.JPEG"), "wb") as f:
                f.write(bytes([k]) * 900)
    out = str(tmp_path / "out.tar")
    if tool == "tarfile":
        with tarfile.open(out, "w", format=fmt) as tf:
            tf.add(src, arcname="src")
    else:
        aptools.ensure({tool: "libarchive-tools" if tool == "bsdtar" else "tar"})
        flag = ["--format", fmt] if tool == "bsdtar" else [f"--format={fmt}"]
        r = subprocess.run([tool, *flag, "-cf", out, "-C", src, "."], capture_output=True)
        assert r.returncode == 0, r.stderr.decode(errors="replace")
    found = reference(out)
    assert _recheck(out, found) is None
    if long:
        k1, k2 = (next(i for i, (n, _, _) in enumerate(found) if n.endswith(b"_%d.JPEG" % k)) for k in (1, 2))
        swapped = list(found)
        swapped[k1], swapped[k2] = (found[k2][0], *found[k1][1:]), (found[k1][0], *found[k2][1:])
        assert "names" in (_recheck(out, swapped) or ""), found
