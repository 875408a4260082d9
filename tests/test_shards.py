"""WebDataset tar shards read in place: shards written by Python's tarfile, GNU tar and webdataset's
own TarWriter, read back by prefetchd and by webdataset itself; the odd inputs, one line each;
a shard rewritten in place; the daemon's batches from shards are those of the same images as an
ImageFolder's sampler would pick them from the shard index."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import tarfile

import numpy as np
import pytest
from conftest import small_config

from prefetchd.sources.base import DatasetError, StorageChanged
from prefetchd.sources.dataset import load_index
from prefetchd.sources.shardnames import expand
from prefetchd.sources.webdataset import split_name
from prefetchd.tools.samples import jpeg_bytes, photo_like

EXTS = (".jpeg", ".jpg", ".png")  # dataset.extensions' default: shards then take .jpg .jpeg .png .webp


def _samples(n: int, seed: int = 0, classes: int = 3) -> list[tuple[str, bytes, int]]:
    rng = np.random.default_rng(seed)
    return [(f"s{k:05d}", jpeg_bytes(photo_like(rng, 48, 40), rng), int(rng.integers(0, classes))) for k in range(n)]


def _add(t: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    t.addfile(info, io.BytesIO(data))


def write_shards(folder, samples, per_shard: int = 4, fmt=tarfile.GNU_FORMAT, label="cls") -> list[str]:
    os.makedirs(folder, exist_ok=True)
    paths = []
    for s in range(0, len(samples), per_shard):
        path = os.path.join(folder, f"train-{s // per_shard:06d}.tar")
        with tarfile.open(path, "w", format=fmt) as t:
            for key, jpg, lab in samples[s:s + per_shard]:
                _add(t, key + ".jpg", jpg)
                if label == "cls":
                    _add(t, key + ".cls", str(lab).encode())
                else:
                    _add(t, key + ".json", json.dumps({"label": lab, "caption": "x"}).encode())
        paths.append(path)
    return paths


def _read_all(index) -> dict[str, tuple[bytes, int]]:
    return {index.relpath(i).rpartition("/")[2].partition(".")[0]: (index.read(i), int(index.labels[i]))
            for i in range(len(index))}


def test_shards_by_tarfile_read_back_with_their_bytes_and_labels(tmp_path):
    samples = _samples(10)
    write_shards(tmp_path / "wds", samples)
    index, cached = load_index(str(tmp_path / "wds"), None, EXTS, str(tmp_path / "c"))
    assert not cached and index.layout == "webdataset" and "WebDataset shards" in index.describe()
    assert _read_all(index) == {k: (b, lab) for k, b, lab in samples}
    assert index.classes == tuple(str(i) for i in range(max(lab for _, _, lab in samples) + 1))
    again, cached = load_index(str(tmp_path / "wds"), None, EXTS, str(tmp_path / "c"))
    assert cached and again.fingerprint == index.fingerprint and _read_all(again) == _read_all(index)


def test_a_brace_pattern_and_a_list_file_name_the_same_shards_as_the_folder(tmp_path):
    samples = _samples(10, seed=1)
    paths = write_shards(tmp_path / "wds", samples)
    folder, _ = load_index(str(tmp_path / "wds"), None, EXTS, None, use_cache=False)
    pattern, _ = load_index(str(tmp_path / "wds" / "train-{000000..000002}.tar"), None, EXTS, None, use_cache=False)
    (tmp_path / "shards.txt").write_text("# the shards\n" + "".join(f"wds/{os.path.basename(p)}\n" for p in paths))
    listed, _ = load_index(str(tmp_path / "shards.txt"), None, EXTS, None, use_cache=False)
    assert _read_all(folder) == _read_all(pattern) == _read_all(listed)
    assert list(folder.labels) == list(pattern.labels) == list(listed.labels)


def test_brace_expansion_is_webdatasets():
    assert expand("/d/train-{000000..000002}.tar") == [f"/d/train-00000{k}.tar" for k in range(3)]
    assert expand("/x/{a,b}/s-{8..10}.tar") == ["/x/a/s-8.tar", "/x/a/s-9.tar", "/x/a/s-10.tar",
                                                "/x/b/s-8.tar", "/x/b/s-9.tar", "/x/b/s-10.tar"]
    assert expand("s-{a..c}.tar") == ["s-a.tar", "s-b.tar", "s-c.tar"]  # the forms braceexpand reads and ours did not
    assert expand("s-{0..6..3}-{x,{y,z}}.tar") == [f"s-{n}-{c}.tar" for n in (0, 3, 6) for c in "xyz"]
    assert expand("s-{-05..-03}.tar") == ["s--05.tar", "s--04.tar", "s--03.tar"]


def test_shards_named_by_a_letter_range_are_read_and_a_bad_pattern_is_one_line(tmp_path):
    samples = _samples(9, seed=3)
    for k, letter in enumerate("abc"):
        os.rename(write_shards(tmp_path / "wds", samples[3 * k:3 * k + 3], per_shard=3)[0], tmp_path / "wds" / f"s-{letter}.tar")
    index, _ = load_index(str(tmp_path / "wds" / "s-{a..c}.tar"), None, EXTS, None, use_cache=False)
    assert _read_all(index) == {k: (b, lab) for k, b, lab in samples}
    with pytest.raises(DatasetError, match=r"the brace pattern .*s-\{a..c\}\{x\.tar has unbalanced braces$"):
        load_index(str(tmp_path / "wds" / "s-{a..c}{x.tar"), None, EXTS, None, use_cache=False)
    with pytest.raises(DatasetError, match=r"names more than 1048576 shards$"):
        expand("s-{0..2000000}.tar")
    import tracemalloc
    tracemalloc.start()
    try:  # a bound with a digit too many: refused before braceexpand builds the range whole (~800 MB here)
        with pytest.raises(DatasetError, match=r"names more than 1048576 shards$"):
            expand("train-{0000000..9999999}.tar")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 10_000_000, peak
    with pytest.raises(DatasetError, match=r"names more than 1048576 shards$"):
        expand("s-{0..2000}-{0..2000}.tar")  # each range small, the names they multiply out to not


def test_shards_by_gnu_tar_from_a_folder_of_key_files(tmp_path):
    if shutil.which("tar") is None:
        pytest.skip("no tar command")
    samples = _samples(6, seed=2)
    src = tmp_path / "src"
    src.mkdir()
    for key, jpg, lab in samples:
        (src / f"{key}.jpg").write_bytes(jpg)
        (src / f"{key}.cls").write_text(f"{lab}\n")
    (tmp_path / "wds").mkdir()
    names = sorted(os.listdir(src))  # key.cls before key.jpg: one key's members together
    subprocess.run(["tar", "cf", str(tmp_path / "wds" / "a.tar"), "-C", str(src), *names], check=True)
    index, _ = load_index(str(tmp_path / "wds"), None, EXTS, None, use_cache=False)
    assert _read_all(index) == {k: (b, lab) for k, b, lab in samples}


def _webdataset_reads(urls: list[str]) -> dict[str, tuple[bytes, int]]:
    wds = pytest.importorskip("webdataset")
    out = {}
    for s in wds.WebDataset(urls, shardshuffle=False, empty_check=False):
        out[s["__key__"]] = (s["jpg"], int(s["cls"]))
    return out


def test_shards_by_webdatasets_tarwriter_read_alike_by_prefetchd_and_webdataset(tmp_path):
    wds = pytest.importorskip("webdataset")
    samples = _samples(9, seed=4)
    os.makedirs(tmp_path / "wds")
    for s in range(3):
        with wds.TarWriter(str(tmp_path / "wds" / f"shard-{s:04d}.tar")) as w:
            for key, jpg, lab in samples[3 * s:3 * s + 3]:
                w.write({"__key__": key, "jpg": jpg, "cls": lab})
    index, _ = load_index(str(tmp_path / "wds" / "shard-{0000..0002}.tar"), None, EXTS, None, use_cache=False)
    ours = _read_all(index)
    theirs = _webdataset_reads([str(tmp_path / "wds" / f"shard-{s:04d}.tar") for s in range(3)])
    assert ours == theirs == {k: (b, lab) for k, b, lab in samples}


def test_webdataset_reads_our_tarfile_shards_as_we_do(tmp_path):
    pytest.importorskip("webdataset")
    samples = _samples(8, seed=5)
    paths = write_shards(tmp_path / "wds", samples, fmt=tarfile.PAX_FORMAT)
    index, _ = load_index(str(tmp_path / "wds"), None, EXTS, None, use_cache=False)
    assert _read_all(index) == _webdataset_reads(paths)


def test_keys_split_as_webdataset_splits_them():
    assert split_name(b"a/b/n0144_10026.jpg") == (b"a/b/n0144_10026", b"jpg")
    assert split_name(b"x.seg.PNG") == (b"x", b"seg.png")
    assert split_name(b"README") is None and split_name(b"._x.jpg") is None and split_name(b"__info__/x.jpg") is None
    assert split_name(b"__key__.txt") == (b"__key__", b"txt")  # webdataset keeps it too


def test_json_labels_and_unlabelled_sets(tmp_path):
    samples = _samples(5, seed=6)
    write_shards(tmp_path / "wds", samples, label="json")
    index, _ = load_index(str(tmp_path / "wds"), None, EXTS, None, use_cache=False, label="json:label")
    assert _read_all(index) == {k: (b, lab) for k, b, lab in samples}
    none, _ = load_index(str(tmp_path / "wds"), None, EXTS, None, use_cache=False, label="none")
    assert list(none.labels) == [-1] * 5 and none.classes == ()
    with pytest.raises(DatasetError, match="hold no samples .*no .cls or .txt member"):
        load_index(str(tmp_path / "wds"), None, EXTS, None, use_cache=False, label="cls")


def test_a_sample_without_image_with_two_or_with_a_bad_label_is_skipped_with_its_reason(tmp_path):
    (tmp_path / "wds").mkdir()
    jpg = _samples(1)[0][1]
    with tarfile.open(tmp_path / "wds" / "s.tar", "w") as t:
        for name, data in [("good.jpg", jpg), ("good.cls", b"2"), ("noimg.cls", b"1"), ("two.jpg", jpg),
                           ("two.png", jpg), ("two.cls", b"0"), ("bad.jpg", jpg), ("bad.cls", b"cat"),
                           ("neg.jpg", jpg), ("neg.cls", b"-3"), ("nolabel.jpg", jpg), ("dup.jpg", jpg),
                           ("dup.jpg", jpg), ("dup.cls", b"1")]:
            _add(t, name, data)
    index, _ = load_index(str(tmp_path / "wds"), None, EXTS, None, use_cache=False)
    assert [index.relpath(i) for i in range(len(index))] == ["s.tar/good.jpg"] and list(index.labels) == [2]
    why = "\n".join(index.skipped)
    for key, reason in [("noimg", "no image member"), ("two", "2 image members"), ("bad", "not an integer"),
                        ("neg", "not an integer in"), ("nolabel", "no .cls or .txt member"),
                        ("dup", "two members of extension .jpg")]:
        assert f"s.tar: {key} (" in why and reason in why, (key, why)


def _error(root, **kw) -> str:
    with pytest.raises(DatasetError) as e:
        load_index(str(root), None, EXTS, None, use_cache=False, **kw)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_odd_shard_sets_each_get_one_line(tmp_path):
    samples = _samples(8, seed=7)
    paths = write_shards(tmp_path / "wds", samples)
    pattern = tmp_path / "wds" / "train-{000000..000004}.tar"
    assert "3 of the 5 shards the pattern names are missing (train-000002.tar, train-000003.tar, train-000004.tar)" in _error(pattern)
    assert "none of the 3 shard(s) the pattern names exists" in _error(tmp_path / "wds" / "x-{0..2}.tar")
    open(tmp_path / "wds" / "train-000002.tar", "wb").close()  # an empty file beside them
    assert "train-000002.tar is empty (0 bytes)" in _error(tmp_path / "wds")
    with tarfile.open(tmp_path / "wds" / "train-000002.tar", "w"):
        pass  # a tar of no members: noted, the others read
    index, _ = load_index(str(tmp_path / "wds"), None, EXTS, None, use_cache=False)
    assert len(index) == 8 and any("1 shard(s) hold no samples: train-000002.tar" in s for s in index.skipped)
    data = open(paths[1], "rb").read()
    with open(paths[1], "wb") as f:  # cut inside the first member's data
        f.write(data[:512 + len(samples[4][1]) // 2])
    assert "train-000001.tar: member s00004.jpg needs" in _error(tmp_path / "wds", layout="webdataset")
    with tarfile.open(paths[1], "w") as t:  # cut at a member boundary: no end-of-archive block
        _add(t, "a.jpg", b"x" * 512)
    data = open(paths[1], "rb").read()
    with open(paths[1], "wb") as f:
        f.write(data[:1024])
    assert "train-000001.tar is truncated: it ends after member a.jpg without the end-of-archive blocks" in _error(
        tmp_path / "wds", layout="webdataset")


def test_a_shard_rewritten_in_place_is_never_read_at_its_old_offsets(tmp_path):
    samples = _samples(8, seed=8)
    paths = write_shards(tmp_path / "wds", samples)
    index, _ = load_index(str(tmp_path / "wds"), None, EXTS, str(tmp_path / "c"))
    assert index.read(0) == samples[0][1]
    st = os.stat(paths[0])
    swapped = samples[:4][::-1]  # the same members in another order, same size, same inode
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as t:
        for key, jpg, lab in swapped:
            _add(t, key + ".jpg", jpg)
            _add(t, key + ".cls", str(lab).encode())
    with open(paths[0], "r+b") as f:
        f.write(buf.getvalue())
    os.utime(paths[0], ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime put back: the ctime still moved
    first = [i for i in range(len(index)) if index.relpath(i).startswith("train-000000.tar/")]
    for i in first:  # every one either read where it now is, or refused: never another's bytes
        try:
            got = index.read(i)
        except StorageChanged:
            continue
        assert got == dict((k, b) for k, b, _ in samples)[index.relpath(i).rpartition("/")[2][:-4]]
    with pytest.raises(StorageChanged):
        index.read(first[0])
    again, cached = load_index(str(tmp_path / "wds"), None, EXTS, str(tmp_path / "c"))
    assert not cached and _read_all(again) == {k: (b, lab) for k, b, lab in samples}


def test_check_says_it_found_shards(tmp_path):
    import sys

    write_shards(tmp_path / "wds", _samples(12, seed=9))
    with tarfile.open(tmp_path / "wds" / "train-000002.tar", "a") as t:
        _add(t, "orphan.cls", b"1")  # a sample with no image: said by check
    cfg = small_config(tmp_path, str(tmp_path / "wds" / "train-{000000..000002}.tar"))
    r = subprocess.run([sys.executable, "-m", "prefetchd", "check", "--config", cfg], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "WebDataset shards" in r.stdout and "dataset: 12 samples" in r.stdout
    assert "dataset: 1 sample or member not indexed (a sample needs one image and a readable label" in r.stdout
    assert "skipped " + str(tmp_path / "wds" / "train-000002.tar") + ": orphan (no image member" in r.stdout
