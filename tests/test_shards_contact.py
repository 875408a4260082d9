"""WebDataset shards as users have them, against webdataset's own writer and reader: a folder whose
first shard is empty, beside lost+found or a shard extracted next to its tar, a sample whose label
went to the next shard, keys with dots, compressed shards, a glob, a shard cut at any 512-byte
record. Each either reads as webdataset reads it (same samples, same labels) or is one line
saying what to change; never the class-tar layout, which labels each shard's samples with the
shard's number."""

from __future__ import annotations

import io
import os
import tarfile

import numpy as np
import pytest

from prefetchd.sources.base import DatasetError
from prefetchd.sources.dataset import load_index
from prefetchd.tools.samples import jpeg_bytes, photo_like

wds = pytest.importorskip("webdataset")  # the dev extra installs it: the writer and reader users trust

EXTS = (".jpeg", ".jpg", ".png")  # dataset.extensions' default


def _jpg(rng) -> bytes:
    return jpeg_bytes(photo_like(rng, 32, 24), rng)


def _tarwriter_shards(folder, shards: int = 3, per: int = 4, seed: int = 0, first: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    os.makedirs(folder, exist_ok=True)
    paths = []
    for s in range(first, first + shards):
        paths.append(os.path.join(folder, f"shard-{s:06d}.tar"))
        with wds.TarWriter(paths[-1]) as w:
            for k in range(per):
                w.write({"__key__": f"{s:03d}_{k:03d}", "jpg": _jpg(rng), "cls": int(rng.integers(0, 7))})
    return paths


def _theirs(paths: list[str]) -> list[tuple[str, bytes, int]]:
    """What webdataset's own reader yields, in its order: (key, image, label) of each sample that
    has an image and a label."""
    out = []
    for s in wds.WebDataset(paths, shardshuffle=False, empty_check=False):
        if "jpg" in s and "cls" in s:
            out.append((s["__key__"], s["jpg"], int(s["cls"])))
    return out


def _ours(root: str, **kw) -> list[tuple[str, bytes, int]]:
    index, _ = load_index(root, None, EXTS, None, use_cache=False, **kw)
    assert index.layout == "webdataset", index.layout
    return [(index.relpath(i).partition(".tar/")[2].rpartition(".")[0], index.read(i), int(index.labels[i]))
            for i in range(len(index))]


def _error(root: str, **kw) -> str:
    with pytest.raises(DatasetError) as e:
        load_index(root, None, EXTS, None, use_cache=False, **kw)
    assert "\n" not in str(e.value)
    return str(e.value)


def _empty_first(root):
    with wds.TarWriter(os.path.join(root, "shard-000000.tar")):
        pass  # a job that died before its first sample: a tar of no members


def _lost_and_found(root):
    os.mkdir(os.path.join(root, "lost+found"))  # a disk's root


def _extracted_beside(root):
    with tarfile.open(os.path.join(root, "shard-000001.tar")) as t:
        t.extractall(os.path.join(root, "shard-000001"), filter="data")  # to look inside one


def _label_in_the_next_shard(root):
    # the first shard's last sample has its .jpg there and its .cls at the next shard's start (a
    # writer that cut by bytes): half the first shard's keys have no second member
    rng = np.random.default_rng(9)
    with tarfile.open(os.path.join(root, "shard-000000.tar"), "w") as t:
        for name, data in [("a.jpg", _jpg(rng)), ("a.cls", b"3"), ("b.jpg", _jpg(rng))]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))


@pytest.mark.parametrize("odd", [_empty_first, _lost_and_found, _extracted_beside, _label_in_the_next_shard])
def test_shards_in_a_folder_as_users_leave_it_read_as_webdataset_reads_them(tmp_path, odd):
    root = str(tmp_path / "wds")
    _tarwriter_shards(root, first=1)
    odd(root)
    shards = sorted(os.path.join(root, n) for n in os.listdir(root) if n.endswith(".tar"))
    theirs = _theirs(shards)
    assert len(theirs) >= 12 and _ours(root) == theirs


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT])
def test_keys_over_100_bytes_read_as_webdataset_reads_them(tmp_path, fmt):
    # a member name over 100 bytes is in a PAX or GNU long-name header, or split into ustar's prefix:
    # auto must read it there, or it took these shards for class tars
    rng = np.random.default_rng(4)
    root = tmp_path / "wds"
    root.mkdir()
    for s in range(2):
        w = wds.TarWriter(str(root / f"shard-{s:06d}.tar"))
        w.tarstream.format = fmt  # TarWriter writes PAX (tarfile's default); GNU tar and others write these
        with w:
            for k in range(3):
                w.write({"__key__": f"{'a' * 60}/{'b' * 50}_{s}_{k}", "jpg": _jpg(rng), "cls": (3 * s + k) % 4})
    theirs = _theirs(sorted(str(p) for p in root.iterdir()))
    assert len(theirs) == 6 and _ours(str(root)) == theirs


def test_keys_with_a_dot_are_one_line_naming_the_dot_never_labels_by_shard(tmp_path):
    root = tmp_path / "wds"
    root.mkdir()
    rng = np.random.default_rng(1)
    with wds.TarWriter(str(root / "shard-000000.tar")) as w:
        for k in range(3):  # TarWriter writes img.000.jpg, img.000.cls: webdataset's key is "img"
            w.write({"__key__": f"img.{k:03d}", "jpg": _jpg(rng), "cls": k})
    assert "jpg" not in next(iter(wds.WebDataset([str(root / "shard-000000.tar")], shardshuffle=False)))
    msg = _error(str(root))
    assert "a key with a dot" in msg and "img.000.jpg is key img, extension 000.jpg" in msg, msg


def test_shards_beside_a_folder_that_is_no_leftover_are_one_line(tmp_path):
    root = tmp_path / "wds"
    _tarwriter_shards(str(root))
    (root / "logs").mkdir()
    msg = _error(str(root))
    assert "holds WebDataset shards (shard-000000.tar ...) and folders (logs)" in msg
    assert "set dataset.layout: webdataset" in msg
    assert len(_ours(str(root), layout="webdataset")) == 12  # doing what it says


def test_gzip_compressed_shards_are_one_line_saying_decompress(tmp_path):
    root = tmp_path / "wds"
    root.mkdir()
    rng = np.random.default_rng(2)
    for s in range(2):
        with wds.TarWriter(str(root / f"shard-{s:06d}.tar.gz")) as w:  # TarWriter gzips by the name
            w.write({"__key__": f"k{s}", "jpg": _jpg(rng), "cls": s})
    assert len(_theirs([str(root / "shard-000000.tar.gz")])) == 1  # webdataset reads them
    assert "holds compressed shards (shard-000000.tar.gz ...), not .tar ones" in _error(str(root))
    assert "gzip-compressed: decompress it first" in _error(str(root / "shard-{000000..000001}.tar.gz"))


def test_a_glob_of_shards_is_one_line_naming_the_forms_that_work(tmp_path):
    _tarwriter_shards(str(tmp_path / "wds"))
    for glob in ("shard-*.tar", "nothing-*.tar"):
        msg = _error(str(tmp_path / "wds" / glob))
        assert "is a glob, which is not expanded for shards" in msg and "{000000..000099}" in msg
    assert len(_ours(str(tmp_path / "wds" / "shard-{000000..000002}.tar"))) == 12


def test_a_tarwriter_shard_cut_at_any_record_boundary_is_an_error_or_whole(tmp_path):
    root = tmp_path / "wds"
    path = _tarwriter_shards(str(root), shards=1)[0]
    whole = _ours(str(root))
    data = open(path, "rb").read()
    for cut in range(0, len(data), 512):
        with open(path, "wb") as f:
            f.write(data[:cut])
        try:
            got = _ours(str(root), layout="webdataset")
        except DatasetError as e:
            assert "shard-000000.tar" in str(e) and "\n" not in str(e)
            continue
        assert got == whole, cut  # only a cut in the end-of-archive blocks


def test_non_utf8_keys_read_as_webdataset_reads_them_and_from_the_cache(tmp_path):
    root = tmp_path / "wds"
    root.mkdir()
    rng = np.random.default_rng(3)
    path = str(root / "shard-000000.tar")
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT, errors="surrogateescape") as t:
        for key in ("caf\udce9", "\udcff\udcfe", "plain"):  # Latin-1 and stray bytes in the names
            for ext, data in (("jpg", _jpg(rng)), ("cls", str(len(key)).encode())):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
    assert _ours(str(root)) == _theirs([path])
    load_index(str(root), None, EXTS, str(tmp_path / "c"))
    again, cached = load_index(str(root), None, EXTS, str(tmp_path / "c"))
    assert cached and [again.read(i) for i in range(3)] == [b for _, b, _ in _theirs([path])]


def test_a_list_file_saved_by_notepad_names_its_first_shard(tmp_path):
    paths = _tarwriter_shards(str(tmp_path / "wds"))
    listed = tmp_path / "shards.txt"  # UTF-8 with a byte order mark and CRLF line ends
    listed.write_text("".join(f"wds/{os.path.basename(p)}\n" for p in paths), encoding="utf-8-sig", newline="\r\n")
    assert _ours(str(listed)) == _theirs(paths)


def test_a_label_that_is_an_id_is_one_line_not_gigabytes_of_class_names(tmp_path):
    root = tmp_path / "wds"
    root.mkdir()
    rng = np.random.default_rng(5)
    with wds.TarWriter(str(root / "shard-000000.tar")) as w:
        w.write({"__key__": "a", "jpg": _jpg(rng), "cls": 3})
        w.write({"__key__": "b", "jpg": _jpg(rng), "cls": 2_000_000_000})  # a .cls of an id: 2e9 names, ~300 GB
    msg = _error(str(root))
    assert "labels go up to 2000000000 (e.g. " + str(root / "shard-000000.tar" / "b.jpg") + ")" in msg, msg


def test_a_folder_of_train_and_validation_shards_is_one_line_and_its_pattern_reads_train(tmp_path):
    # as timm/imagenet-1k-wds is downloaded: imagenet1k-train-NNNN.tar beside imagenet1k-validation-NN.tar
    root = tmp_path / "imagenet-1k-wds"
    rng = np.random.default_rng(6)
    root.mkdir()
    for name, n in [("imagenet1k-train-0000.tar", 3), ("imagenet1k-train-0001.tar", 3),
                    ("imagenet1k-validation-00.tar", 2)]:
        with wds.TarWriter(str(root / name)) as w:
            for k in range(n):
                w.write({"__key__": f"{name[:-4]}_{k}", "jpg": _jpg(rng), "cls": k})
    msg = _error(str(root))
    pattern = str(root / "imagenet1k-train-{0000..0001}.tar")
    assert "holds the shards of 2 splits (train, validation; e.g. imagenet1k-train-0000.tar)" in msg, msg
    assert msg.endswith(pattern) and _ours(pattern) == _theirs(sorted(str(p) for p in root.glob("*-train-*")))
    assert _error(str(root), section="validation").endswith(str(root / "imagenet1k-validation-{00..00}.tar"))


_IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")


def _random_shards(root, rng) -> list[str]:
    """Shards as TarWriter writes them, at random: keys in folders, the four image extensions, a
    sample now and then without a label, with two images, with only a caption, PAX or GNU headers."""
    jpg = _jpg(rng)  # the bytes need not decode: both readers pass them through
    paths, n = [], 0
    for s in range(int(rng.integers(1, 5))):
        paths.append(os.path.join(root, f"r-{s:06d}.tar"))
        w = wds.TarWriter(paths[-1])
        w.tarstream.format = (tarfile.PAX_FORMAT, tarfile.GNU_FORMAT)[int(rng.integers(0, 2))]
        with w:
            for _ in range(int(rng.integers(0, 12))):
                n += 1
                key = "/".join(f"d{int(rng.integers(0, 3))}" for _ in range(int(rng.integers(0, 3))))
                sample = {"__key__": f"{key}/k{n:04d}".lstrip("/"), "txt": b"a caption"}
                for ext in rng.choice(_IMAGE_EXTS, size=int(rng.choice([0, 1, 1, 1, 2])), replace=False):
                    sample[str(ext)] = jpg + bytes([n % 256])
                if rng.random() < 0.85:
                    sample["cls"] = int(rng.integers(0, 50))
                w.write(sample)
    return paths


@pytest.mark.parametrize("seed", range(12))
def test_random_tarwriter_shards_read_as_webdataset_reads_them(tmp_path, seed):
    rng = np.random.default_rng(seed)
    root = tmp_path / "wds"
    root.mkdir()
    paths = _random_shards(str(root), rng)
    theirs = []
    for s in wds.WebDataset(paths, shardshuffle=False, empty_check=False):
        images = [e for e in _IMAGE_EXTS if e in s]
        if len(images) == 1 and "cls" in s:  # one image and a label: a sample either reader can use
            theirs.append((s["__key__"], s[images[0]], int(s["cls"])))
    try:
        index, _ = load_index(str(root), None, EXTS, None, use_cache=False)  # auto
    except DatasetError as e:
        assert not theirs and "hold no samples" in str(e)
        return
    ours = [(index.relpath(i).partition(".tar/")[2].rpartition(".")[0], index.read(i), int(index.labels[i]))
            for i in range(len(index))]
    assert ours == theirs


def test_a_folder_whose_copy_is_still_running_is_one_line_not_part_of_the_set(tmp_path):
    root = tmp_path / "wds"
    paths = _tarwriter_shards(str(root), shards=4)
    os.rename(paths[2], root / ".shard-000002.tar.Xy12Ab")  # rsync writes a shard under a hidden name until whole
    msg = _error(str(root))
    assert "1 shard(s) numbered between its first and last are not there (shard-000002.tar)" in msg, msg
    listed = tmp_path / "present.txt"  # what it says: name the shards present
    listed.write_text("".join(f"wds/{os.path.basename(p)}\n" for p in paths if p != paths[2]))
    assert _ours(str(listed)) == _theirs([p for p in paths if p != paths[2]])


def test_an_index_cached_before_the_split_check_is_not_trusted(tmp_path, monkeypatch):
    import prefetchd.sources.shardnames as shardnames
    import prefetchd.sources.webdataset as webdataset

    root = tmp_path / "wds"
    _tarwriter_shards(str(root), shards=2)
    for s in range(2):
        os.rename(root / f"shard-{s:06d}.tar", root / f"in1k-{('train', 'validation')[s]}-{s:04d}.tar")
    with monkeypatch.context() as m:
        m.setattr(shardnames, "_one_split", lambda *a: None)  # the version before the check: it cached both
        index, stamps = webdataset.scan(str(root), webdataset.DEFAULT_EXTENSIONS)
    cdir = webdataset.cache_path(str(tmp_path / "c"), f"{root}|label=cls", webdataset.LAYOUT,
                                 webdataset.DEFAULT_EXTENSIONS)
    webdataset.save(cdir, index, stamps)
    with pytest.raises(DatasetError, match="holds the shards of 2 splits"):
        load_index(str(root), None, EXTS, str(tmp_path / "c"))


def test_numbered_shards_of_images_alone_are_one_line_never_labelled_by_shard_number(tmp_path):
    root = tmp_path / "wds"
    root.mkdir()
    rng = np.random.default_rng(4)
    for s in range(3):  # unlabelled shards, as img2dataset or a captionless export writes them
        with wds.TarWriter(str(root / f"shard-{s:06d}.tar")) as w:
            for k in range(4):
                w.write({"__key__": f"{s:03d}_{k:03d}", "jpg": _jpg(rng)})
    msg = _error(str(root))
    assert "numbered tars of images alone (shard-000000.tar ... shard-000002.tar)" in msg, msg
    assert "set dataset.layout: webdataset (with dataset.label: none) or imagenet_tars" in msg
    read = _ours(str(root), layout="webdataset", label="none")  # doing what it says
    assert len(read) == 12 and {lab for _, _, lab in read} == {-1}


def test_numbered_class_tars_naming_their_images_after_the_tar_stay_class_tars(tmp_path):
    root = tmp_path / "tars"
    root.mkdir()
    rng = np.random.default_rng(5)
    for c in range(3):  # ImageNet's own shape: n01440764.tar holds n01440764_10026.JPEG
        with tarfile.open(root / f"class_{c:03d}.tar", "w") as t:
            for k in range(2):
                data = _jpg(rng)
                info = tarfile.TarInfo(f"class_{c:03d}_{k}.JPEG")
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
    index, _ = load_index(str(root), None, EXTS, None, use_cache=False)
    assert index.layout != "webdataset" and sorted(int(x) for x in index.labels) == [0, 0, 1, 1, 2, 2]
