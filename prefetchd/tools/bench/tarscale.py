"""The index of a tar of class tars at ImageNet's scale: time and memory of the scan.

``python -m prefetchd.tools.bench.tarscale --dir D [--members 1281167 --classes 1000]`` writes a
synthetic train tar of that many members in ``D`` (tiny members, a few bytes each, so the archive
is ~1.3 GB instead of 138 GB: the scan reads headers only, and the header count is what it costs),
then indexes it in a fresh process, twice: with the archive in the page cache, and after
``posix_fadvise(DONTNEED)`` dropped its pages (read from the disk). It prints wall time and the
process's peak RSS (and its RSS before the scan: Python, numpy and prefetchd imported), and
deletes the archive.

``--pack FOLDER --out TAR`` instead packs an ImageFolder as ImageNet's train tar (a tar of
``<class>.tar``), for ``prefetchd bench --root FOLDER --root TAR``; ``--pack-shards FOLDER --out DIR``
as WebDataset shards (``DIR/train-000000.tar`` ...: ``<class>_<stem>.jpg`` and ``.cls``, the class's
index, ``--per-shard`` samples each, in a fixed shuffled order), for ``prefetchd bench --root FOLDER
--root 'DIR/train-{000000..N}.tar'``; ``--pack-parquet FOLDER --out FILE`` as one Parquet file in
Hugging Face's schema (``--per-shard`` rows a row group; HF's own default for images is 100), and
``--amplification FILE`` reads it in a random permutation in-process and prints the bytes read
per image byte. ``--wds-scale N --dir D`` writes N tiny samples (a 3-byte ``.jpg`` and a ``.cls``)
in ``--shards`` WebDataset shards in ``D`` and indexes them in a fresh process (then deletes them);
``--jpeg-bytes B`` makes each ``.jpg`` B bytes (a JPEG's 110,000, say), left as a hole (a sparse
file: 1.28 M such samples take ~6 GB of disk, not 140); ``--tarwriter`` writes them with
webdataset's ``TarWriter`` instead (the dev extra), as most shard sets are written; ``--keep`` keeps the shards for
``--index-shards DIR``, which indexes them again in a fresh process a run, ``--repeat`` times,
alternating the trees ``--tree`` names (a prefetchd checkout each, put on the child's
``PYTHONPATH``; this one if none): wall and CPU seconds (the scan processes' too), peak RSS, and
a digest of the whole index (equal digests: the same index, byte for byte); ``--cold`` drops the
shards' cached pages before each run (read from the disk).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time

_CHILD = r"""
import json, os, resource, sys, time
from prefetchd.sources import imagenet
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.monotonic()
index, _ = imagenet.load(sys.argv[1], None, (".jpeg", ".jpg", ".png"), sys.argv[2], use_cache=True)
dt = time.monotonic() - t
print(json.dumps({"samples": len(index), "classes": len(index.classes), "scan_s": dt,
                  "rss_before_mib": before / 1024,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "index_mib": index.nbytes / 2**20}))
"""


def write_archive(path: str, members: int, classes: int) -> None:
    per, extra = divmod(members, classes)
    with open(path, "wb") as f, tarfile.open(fileobj=f, mode="w", format=tarfile.GNU_FORMAT) as outer:
        for c in range(classes):
            wnid = f"n{c:08d}"
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as inner:
                for j in range(per + (c < extra)):
                    info = tarfile.TarInfo(f"{wnid}_{j}.JPEG")
                    info.size = 3
                    inner.addfile(info, io.BytesIO(b"jpg"))
            info = tarfile.TarInfo(wnid + ".tar")
            info.size = buf.tell()
            buf.seek(0)
            outer.addfile(info, buf)


def pack_train_tar(folder: str, out: str) -> int:
    """Write ``out``, a tar of per-class tars of the ImageFolder ``folder``; returns the image count."""
    n = 0
    with open(out, "wb") as f, tarfile.open(fileobj=f, mode="w", format=tarfile.GNU_FORMAT) as outer:
        for cls in sorted(os.listdir(folder)):
            if not os.path.isdir(os.path.join(folder, cls)):
                continue
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as inner:
                for name in sorted(os.listdir(os.path.join(folder, cls))):
                    inner.add(os.path.join(folder, cls, name), arcname=name)
                    n += 1
            info = tarfile.TarInfo(cls + ".tar")
            info.size = buf.tell()
            buf.seek(0)
            outer.addfile(info, buf)
    return n


def pack_shards(folder: str, out: str, per_shard: int = 256) -> tuple[int, int]:
    """Write the ImageFolder ``folder`` as WebDataset shards in ``out``; returns (images, shards)."""
    import random

    classes = sorted(c for c in os.listdir(folder) if os.path.isdir(os.path.join(folder, c)))
    files = [(label, cls, name) for label, cls in enumerate(classes)
             for name in sorted(os.listdir(os.path.join(folder, cls)))]
    random.Random(0).shuffle(files)  # shards are written shuffled, as webdataset users write them
    os.makedirs(out, exist_ok=True)
    shards = 0
    for s in range(0, len(files), per_shard):
        with tarfile.open(os.path.join(out, f"train-{shards:06d}.tar"), "w", format=tarfile.GNU_FORMAT) as t:
            for label, cls, name in files[s:s + per_shard]:
                key = f"{cls}_{os.path.splitext(name)[0]}"
                t.add(os.path.join(folder, cls, name), arcname=key + ".jpg")
                info = tarfile.TarInfo(key + ".cls")
                data = str(label).encode()
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
        shards += 1
    return len(files), shards


def pack_parquet(folder: str, out: str, row_group: int = 100) -> int:
    """Write the ImageFolder ``folder`` as one Parquet file in the HF schema; returns the row count."""
    import json as json_

    import pyarrow as pa
    import pyarrow.parquet as pq

    classes = sorted(c for c in os.listdir(folder) if os.path.isdir(os.path.join(folder, c)))
    rows = [(label, os.path.join(folder, cls, name)) for label, cls in enumerate(classes)
            for name in sorted(os.listdir(os.path.join(folder, cls)))]
    import random

    random.Random(0).shuffle(rows)
    images = []
    for _, path in rows:
        with open(path, "rb") as f:
            images.append({"bytes": f.read(), "path": os.path.basename(path)})
    features = {"image": {"_type": "Image"}, "label": {"names": classes, "_type": "ClassLabel"}}
    table = pa.table({"image": pa.array(images, pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
                      "label": pa.array([lab for lab, _ in rows], pa.int64())})
    table = table.replace_schema_metadata({b"huggingface": json_.dumps({"info": {"features": features}}).encode()})
    pq.write_table(table, out, row_group_size=row_group)
    return len(rows)


def amplification(path: str) -> dict:
    """Read every row of the Parquet ``path`` in a random permutation in-process: bytes read per
    image byte, and the time per sample."""
    import numpy as np

    from prefetchd.sources import parquet

    index, _ = parquet.load(path, "image", "label", None, use_cache=False)
    order = np.random.default_rng(0).permutation(len(index))
    parquet._read_bytes[0] = 0
    t = time.monotonic()
    image_bytes = sum(len(index.read(int(i))) for i in order)
    dt = time.monotonic() - t
    return {"rows": len(index), "image_bytes": image_bytes, "read_bytes": parquet._read_bytes[0],
            "amplification": parquet._read_bytes[0] / image_bytes, "ms_per_sample": 1000 * dt / len(index)}


_WDS_CHILD = r"""
import hashlib, json, resource, sys, time
from prefetchd.sources import webdataset
def cpu(who):
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t, c = time.monotonic(), cpu(resource.RUSAGE_SELF)
index, _ = webdataset.load(sys.argv[1], webdataset.DEFAULT_EXTENSIONS, "cls", sys.argv[2])
wall, mine, theirs = time.monotonic() - t, cpu(resource.RUSAGE_SELF) - c, cpu(resource.RUSAGE_CHILDREN)
h = hashlib.sha256(json.dumps([index.root, list(index.classes), index.fingerprint, list(index.archives),
                               [list(x) for x in index.identity], list(index.skipped)]).encode())
for a in (index.blob, index.offsets, index.labels, index.archive_ids, index.block, index.size):
    h.update(b"-" if a is None else a.tobytes())
import os
tree = os.path.dirname(os.path.dirname(os.path.dirname(webdataset.__file__)))  # above prefetchd/sources/
print(json.dumps({"tree": tree, "samples": len(index), "scan_s": wall, "cpu_s": mine + theirs, "children_cpu_s": theirs,
                  "index_mib": index.nbytes / 2**20, "digest": h.hexdigest()[:16],
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "children_peak_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
                  "rss_before_mib": before / 1024}))
"""


def write_wds(work: str, n: int, shards: int, jpeg_bytes: int = 3, tarwriter: bool = False) -> None:
    """``n`` samples (``n%08d.jpg`` of ``jpeg_bytes``, a hole after its first 3, and a ``.cls``) in
    ``shards`` shards under ``work``, as ``tarfile`` writes them (GNU headers, records of 10240);
    ``tarwriter``: as webdataset's ``TarWriter`` does (a PAX header of its mtime before every
    member; the JPEGs written whole)."""
    per = -(-n // shards)
    if tarwriter:
        import webdataset as wds

        for s in range(shards):
            with wds.TarWriter(os.path.join(work, f"train-{s:06d}.tar")) as w:
                for k in range(s * per, min(n, (s + 1) * per)):
                    w.write({"__key__": f"n{k:08d}", "jpg": b"\xff\xd8\xff".ljust(jpeg_bytes, b"\0"), "cls": k % 1000})
        return
    for s in range(shards):
        with open(os.path.join(work, f"train-{s:06d}.tar"), "wb") as f:
            for k in range(s * per, min(n, (s + 1) * per)):
                for ext, size, data in (("jpg", jpeg_bytes, b"\xff\xd8\xff"), ("cls", None, str(k % 1000).encode())):
                    info = tarfile.TarInfo(f"n{k:08d}.{ext}")
                    info.size = len(data) if size is None else size
                    f.write(info.tobuf(tarfile.GNU_FORMAT) + data)
                    f.seek(-(-info.size // 512) * 512 - len(data), os.SEEK_CUR)
            f.write(bytes(1024))
            f.truncate(-(-f.tell() // tarfile.RECORDSIZE) * tarfile.RECORDSIZE)


def index_once(work: str, tree: str | None = None) -> dict:
    """Index the shards in ``work`` in a fresh process (with ``tree`` first on its ``PYTHONPATH``)."""
    tree = os.path.abspath(tree or os.path.join(os.path.dirname(__file__), "..", "..", ".."))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (tree, os.environ.get("PYTHONPATH")) if p))
    work = os.path.abspath(work)
    cache = tempfile.mkdtemp(prefix="cache-", dir=os.path.dirname(work))
    try:  # run in the cache folder: ``-c`` puts the working folder first on the path, before the tree
        r = json.loads(subprocess.run([sys.executable, "-c", _WDS_CHILD, work, cache], check=True, cwd=cache,
                                      capture_output=True, text=True, env=env).stdout)
        if os.path.realpath(r["tree"]) != os.path.realpath(tree):
            raise RuntimeError(f"the scan imported prefetchd from {r['tree']}, not {tree}")
        return r
    finally:
        import shutil

        shutil.rmtree(cache, ignore_errors=True)


def _said(r: dict) -> str:
    return (f"{r['samples']:,} samples indexed in {r['scan_s']:.1f} s, CPU {r['cpu_s']:.1f} s (scan processes "
            f"{r['children_cpu_s']:.1f} s); peak RSS {r['peak_rss_mib']:.0f} MiB (before the scan "
            f"{r['rss_before_mib']:.0f} MiB; a scan process {r['children_peak_rss_mib']:.0f} MiB); index arrays "
            f"{r['index_mib']:.1f} MiB; digest {r['digest']}")


def _drop_cached_pages(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", help="where to write the archive (local disk; deleted afterwards)")
    ap.add_argument("--pack", metavar="FOLDER", help="pack this ImageFolder as a tar of class tars (--out)")
    ap.add_argument("--pack-shards", metavar="FOLDER", help="pack this ImageFolder as WebDataset shards (--out: a folder)")
    ap.add_argument("--pack-parquet", metavar="FOLDER", help="pack this ImageFolder as one Parquet file (--out)")
    ap.add_argument("--amplification", metavar="PARQUET", help="read this Parquet file in a random order: bytes read")
    ap.add_argument("--per-shard", type=int, default=256, help="samples per shard, or rows per row group")
    ap.add_argument("--out", help="the tar --pack writes, or the folder of shards --pack-shards writes")
    ap.add_argument("--wds-scale", type=int, metavar="N", help="index N tiny samples in --shards shards (--dir)")
    ap.add_argument("--jpeg-bytes", type=int, default=3, help="--wds-scale: each .jpg's size (a hole: sparse files)")
    ap.add_argument("--tarwriter", action="store_true", help="--wds-scale: write with webdataset's TarWriter")
    ap.add_argument("--keep", action="store_true", help="--wds-scale: keep the shards (their folder is printed)")
    ap.add_argument("--index-shards", metavar="DIR", help="index these shards again (--tree, --repeat)")
    ap.add_argument("--tree", action="append", default=[], help="--index-shards: a prefetchd checkout (repeatable)")
    ap.add_argument("--repeat", type=int, default=1, help="--index-shards: runs of each tree, alternated")
    ap.add_argument("--cold", action="store_true", help="--index-shards: drop the shards' cached pages before each run")
    ap.add_argument("--shards", type=int, default=1024)
    ap.add_argument("--members", type=int, default=1_281_167)
    ap.add_argument("--classes", type=int, default=1000)
    args = ap.parse_args(argv)
    if args.pack_parquet:
        if not args.out:
            ap.error("--pack-parquet needs --out")
        print(f"packed {pack_parquet(args.pack_parquet, args.out, args.per_shard)} images into {args.out}")
        return 0
    if args.amplification:
        r = amplification(args.amplification)
        print(f"{r['rows']} rows read in a random permutation: {r['read_bytes'] / 2**20:.1f} MiB read for "
              f"{r['image_bytes'] / 2**20:.1f} MiB of images ({r['amplification']:.1f} x), "
              f"{r['ms_per_sample']:.2f} ms a sample")
        return 0
    if args.index_shards:
        for k in range(args.repeat):
            for tree in args.tree or [None]:
                if args.cold:
                    for e in os.scandir(args.index_shards):
                        if e.name.endswith(".tar"):
                            _drop_cached_pages(e.path)
                print(f"[{k + 1}/{args.repeat}] {tree or 'this tree'}: {_said(index_once(args.index_shards, tree))}",
                      flush=True)
        return 0
    if args.wds_scale:
        if not args.dir:
            ap.error("--wds-scale needs --dir")
        work = tempfile.mkdtemp(prefix="wdsscale-", dir=args.dir)
        try:
            t = time.monotonic()
            write_wds(work, args.wds_scale, args.shards, args.jpeg_bytes, args.tarwriter)
            print(f"wrote {args.wds_scale:,} samples in {args.shards} shards in {time.monotonic() - t:.0f} s", flush=True)
            print(f"{args.shards} shards: {_said(index_once(work))}")
        finally:
            if args.keep:
                print(f"kept: {work}")
            else:
                import shutil

                shutil.rmtree(work, ignore_errors=True)
        return 0
    if args.pack_shards:
        if not args.out:
            ap.error("--pack-shards needs --out")
        n, shards = pack_shards(args.pack_shards, args.out, args.per_shard)
        print(f"packed {n} images into {shards} shards: {args.out}/train-{{000000..{shards - 1:06d}}}.tar")
        return 0
    if args.pack:
        if not args.out:
            ap.error("--pack needs --out")
        print(f"packed {pack_train_tar(args.pack, args.out)} images into {args.out}")
        return 0
    if not args.dir:
        ap.error("--dir is required")
    work = tempfile.mkdtemp(prefix="tarscale-", dir=args.dir)
    path = os.path.join(work, "train.tar")
    try:
        t = time.monotonic()
        write_archive(path, args.members, args.classes)
        print(f"wrote {args.members:,} members in {args.classes} class tars: {os.path.getsize(path) / 2**30:.2f} GiB "
              f"in {time.monotonic() - t:.0f} s", flush=True)
        for cold in (False, True):
            if cold:
                _drop_cached_pages(path)
            cache = tempfile.mkdtemp(prefix="cache-", dir=work)
            r = json.loads(subprocess.run([sys.executable, "-c", _CHILD, path, cache], check=True,
                                          capture_output=True, text=True).stdout)
            print(f"{'cold (pages dropped)' if cold else 'warm page cache'}: {r['samples']:,} samples, {r['classes']} "
                  f"classes indexed in {r['scan_s']:.1f} s; peak RSS {r['peak_rss_mib']:.0f} MiB (before the scan "
                  f"{r['rss_before_mib']:.0f} MiB); index arrays {r['index_mib']:.0f} MiB", flush=True)
    finally:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
