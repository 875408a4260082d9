"""The one-pass shard scan against the scan it replaced (``wds_reference``, kept verbatim): on
seeded random shard sets with the odd members users' tools write (GNU long names, PAX headers and
a PAX global header, non-UTF-8 and folder keys, links, directories, ``..``, metadata members,
labels as ``.cls``, ``.txt`` and JSON, bad labels, members of 0 to 300 KB around every read's
edge) and odd shards (empty, no members, cut at a member boundary or inside one, a header
corrupted), the index is the same byte for byte (keys, offsets, sizes, labels, skipped with their
reasons, identities), or the error the same line; in this process and in several. The process
pool on its own: a dead process and a Ctrl-C each end it with nothing left behind."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tarfile

import numpy as np
import pytest
import wds_reference
from conftest import wait_until

from prefetchd.sources import scanpool, tarheaders, webdataset
from prefetchd.sources.base import DatasetError

EXTS = webdataset.DEFAULT_EXTENSIONS
_SIZES = (0, 1, 3, 100, 511, 512, 513, 1000, 3000, 4095, 5000, 9000, 70_000, 110_000, 300_000)


def _add(t: tarfile.TarFile, name: str, data: bytes, kind: bytes = tarfile.REGTYPE, mtime: float = 0) -> None:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mtime = mtime  # a float: a PAX header of its own in a PAX tar, as webdataset's TarWriter writes
    if kind == tarfile.SYMTYPE:
        info.linkname = "elsewhere.jpg"
    elif kind == tarfile.REGTYPE:
        info.size = len(data)
    t.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)


def _label_bytes(rng, how: str, value: int) -> tuple[str, bytes]:
    """A label member, now and then a bad one, as the set's ``dataset.label`` reads it or not."""
    bad = rng.random() < 0.1
    if how.startswith("json"):
        doc = {"label": value, "a": {"b": value}, "caption": "x" * int(rng.integers(0, 600))}
        return "json", (b"{not json" if bad else json.dumps(doc).encode())
    text = rng.choice([b"cat", b"-3", b"", b"99999999999", b"1.5"]) if bad else (
        str(value).encode() + rng.choice([b"", b"\n", b" "]))
    return ("txt" if rng.random() < 0.1 else "cls"), bytes(text)


def _key(rng, n: int) -> str:
    r = rng.random()
    if r < 0.08:
        return f"{'long' * 30}_{n}"  # over 100 bytes: a GNU long name or a PAX path
    if r < 0.14:
        return f"dir{int(rng.integers(0, 3))}/sub/k{n}"
    if r < 0.18:
        return f"k\u00e9{n}"  # not ASCII: a PAX path in a PAX tar
    return f"k{n:05d}"


def _shard(path: str, rng, how: str, first: int) -> None:
    fmt = (tarfile.GNU_FORMAT, tarfile.PAX_FORMAT)[int(rng.integers(0, 2))]
    glob = {"comment": "made by a test"} if fmt == tarfile.PAX_FORMAT and rng.random() < 0.2 else None
    with tarfile.open(path, "w", format=fmt, pax_headers=glob) as t:
        for n in range(first, first + int(rng.integers(0, 14))):
            key = _key(rng, n)
            r = rng.random()
            if r < 0.04:
                _add(t, key + ".jpg", b"", tarfile.SYMTYPE)
            elif r < 0.07:
                _add(t, key, b"", tarfile.DIRTYPE)
            elif r < 0.09:
                _add(t, rng.choice(["README", "__key__.txt", f"._{key}.jpg", f"../{key}.jpg", f"/{key}.jpg"]), b"abc")
            members = []
            images = rng.choice(["jpg", "png", "webp", "JPG", "seg.png", "jpeg"], size=int(rng.choice([0, 1, 1, 1, 1, 2])))
            for ext in images:
                members.append((f"{key}.{ext}", rng.bytes(int(rng.choice(_SIZES)))))
            if rng.random() < 0.9:
                ext, data = _label_bytes(rng, how, int(rng.integers(0, 40)))
                members.insert(int(rng.integers(0, len(members) + 1)), (f"{key}.{ext}", data))
            if rng.random() < 0.03 and members:
                members.append(members[-1])  # two members of one extension
            for name, data in members:
                _add(t, name, data, mtime=1795890484.25 if rng.random() < 0.4 else 0)


def _break(path: str, rng) -> None:
    """Make one shard odd: empty, no members, cut at a member boundary or inside one, a header corrupted."""
    how = rng.choice(["empty", "none", "boundary", "inside", "corrupt"])
    if how == "empty":
        open(path, "wb").close()
        return
    if how == "none":
        tarfile.open(path, "w").close()
        return
    try:
        with tarfile.open(path) as t:
            infos = t.getmembers()
    except tarfile.ReadError:  # a PAX global header and no member: tarfile reads no further (we do)
        return
    data = open(path, "rb").read()
    if not infos:
        return
    m = infos[int(rng.integers(0, len(infos)))]
    if how == "boundary":
        data = data[:m.offset_data + -(-m.size // 512) * 512]
    elif how == "inside":
        data = data[:m.offset_data + max(m.size // 2, 1) - 1]
    else:
        data = data[:m.offset + 20] + bytes([data[m.offset + 20] ^ 0x41]) + data[m.offset + 21:]
    open(path, "wb").write(data)


def random_set(root, seed: int) -> str:
    rng = np.random.default_rng(seed)
    how = str(rng.choice(["cls", "cls", "json:label", "json:a.b", "none"]))
    os.makedirs(root, exist_ok=True)
    shards = int(rng.integers(1, 6))
    for s in range(shards):
        _shard(os.path.join(root, f"s-{s:04d}.tar"), rng, how, 100 * s)
    if rng.random() < 0.3:
        _break(os.path.join(root, f"s-{int(rng.integers(0, shards)):04d}.tar"), rng)
    return how


def _outcome(scan, root: str, label: str, **kw):
    """The whole index (every array's bytes and every field) and the stamps, or the error's text."""
    try:
        index, stamps = scan(root, EXTS, label, **kw)
    except DatasetError as e:
        return "error", str(e)
    arrays = tuple(None if a is None else (a.dtype.str, a.tobytes()) for a in (
        index.blob, index.offsets, index.labels, index.archive_ids, index.block, index.size))
    return arrays, index.root, index.classes, index.fingerprint, index.layout, index.archives, index.identity, \
        index.skipped, index.kind, stamps


@pytest.mark.parametrize("seed", range(40))
def test_the_scan_gives_the_index_the_scan_before_it_gave(tmp_path, seed, monkeypatch):
    root = str(tmp_path / "wds")
    label = random_set(root, seed)
    if seed % 2:  # reads of a block or four: every header and label across a read's edge somewhere
        monkeypatch.setattr(tarheaders, "_WINDOW_MIN", 512)
        monkeypatch.setattr(tarheaders, "_WINDOW_MAX", 2048)
    want = _outcome(wds_reference.scan, root, label)
    assert _outcome(webdataset.scan, root, label, procs=1) == want
    if want[0] == "error":
        assert "\n" not in want[1]


@pytest.mark.parametrize("seed", [3, 7, 12, 21])
def test_one_process_and_several_give_the_same_index(tmp_path, seed):
    root = str(tmp_path / "wds")
    for s in range(seed, seed + 100):  # a set of several shards, not broken
        label = random_set(root, s)
        if len(os.listdir(root)) >= 3 and _outcome(wds_reference.scan, root, label)[0] != "error":
            break
        for name in os.listdir(root):
            os.unlink(os.path.join(root, name))
    one = _outcome(webdataset.scan, root, label, procs=1)
    assert one[0] != "error" and one == _outcome(webdataset.scan, root, label, procs=3)


def _tiny_shards(root, shards: int, per: int = 5) -> list[str]:
    os.makedirs(root, exist_ok=True)
    paths = []
    for s in range(shards):
        paths.append(os.path.join(root, f"t-{s:04d}.tar"))
        with tarfile.open(paths[-1], "w", format=tarfile.GNU_FORMAT) as t:
            for k in range(per):
                _add(t, f"s{s}_{k}.jpg", b"\xff\xd8\xff" * (k + 1))
                _add(t, f"s{s}_{k}.cls", str(k).encode())
    return paths


def test_a_corrupt_shard_is_its_one_line_in_several_processes_too(tmp_path):
    paths = _tiny_shards(tmp_path / "wds", 7)
    data = bytearray(open(paths[3], "rb").read())
    data[1024 + 30] ^= 0x41  # the second member's header
    open(paths[3], "wb").write(bytes(data))
    open(paths[5], "wb").write(open(paths[5], "rb").read()[:1536])  # cut at a member boundary: a later error
    msgs = []
    for procs in (1, 4):
        with pytest.raises(DatasetError) as e:
            webdataset.scan(str(tmp_path / "wds"), EXTS, procs=procs)
        msgs.append(str(e.value))
    assert msgs[0] == msgs[1] == f"{paths[3]}: no valid tar header at offset 1024 (after member s3_0.jpg); the archive " \
                                 "is corrupt, compressed or not a tar"


def test_one_shard_is_scanned_here_and_many_in_processes_alike(tmp_path):
    _tiny_shards(tmp_path / "one", 1)
    assert _outcome(webdataset.scan, str(tmp_path / "one"), "cls", procs=8)[0] != "error"
    _tiny_shards(tmp_path / "many", 9)
    assert _outcome(webdataset.scan, str(tmp_path / "many"), "cls", procs=8) == _outcome(
        wds_reference.scan, str(tmp_path / "many"), "cls")


def test_a_scan_process_that_dies_is_one_line_naming_what_it_indexed():
    with pytest.raises(DatasetError) as e:
        list(scanpool.ordered(signal.raise_signal, [(signal.SIGKILL,)], 1, lambda i: "the shard /x/y.tar"))
    assert str(e.value) == ("the process indexing the shard /x/y.tar was killed by SIGKILL, perhaps out of memory?; "
                            "index again (dataset.root)")
    with pytest.raises(DatasetError, match="^the process indexing item 0 exited with status 3; index again"):
        list(scanpool.ordered(os._exit, [(3,)], 1, lambda i: f"item {i}"))


def _scan_children(pid: int) -> list[int]:
    out = []
    for p in os.listdir("/proc"):
        try:
            with open(f"/proc/{p}/stat") as f:
                stat = f.read()
        except (OSError, NotADirectoryError):
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[3]) == pid and fields[0] != "Z":  # its session: it leads one
            out.append(int(p))
    return out


def _in_their_item(pid: int) -> int:
    """Scan processes of session ``pid`` inside their item (``time.sleep``): started, past the check
    that their caller is alive, and past setting the signal they die with it by."""
    n = 0
    for child in _scan_children(pid):
        try:
            with open(f"/proc/{child}/wchan") as f:
                n += "nanosleep" in f.read()
        except OSError:
            pass
    return n


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_a_stop_mid_scan_leaves_no_scan_process_behind(sig):
    """Ctrl-C (a KeyboardInterrupt in the caller), a SIGTERM the caller exits on, and the caller
    killed: every scan process is gone when the caller is (mid-item: each sleeps a minute)."""
    code = ("import signal, sys, time; from prefetchd.sources import scanpool\n"
            "signal.signal(signal.SIGTERM, lambda *a: sys.exit(1))\n"
            "print('go', flush=True); list(scanpool.ordered(time.sleep, [(60,)] * 6, 3, str))")
    p = subprocess.Popen([sys.executable, "-c", code], start_new_session=True, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "go\n"
        wait_until(lambda: _in_their_item(p.pid) == 3, 30, "3 scan processes in their items")
        p.send_signal(sig)
        p.wait(timeout=20)
        assert p.returncode != 0 and ("KeyboardInterrupt" in p.stderr.read() if sig == signal.SIGINT else True)
        wait_until(lambda: _scan_children(p.pid) == [], 10, "no scan process left")
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def test_the_benchmark_writes_its_shards_as_tarfile_writes_them(tmp_path):
    """``tarscale --wds-scale`` (BENCHMARKS.md's shards) writes headers itself, to leave holes for
    JPEG-sized members: with 3-byte members, the bytes ``tarfile`` writes."""
    from prefetchd.tools.bench.tarscale import write_wds

    os.makedirs(tmp_path / "ours")
    write_wds(str(tmp_path / "ours"), 7, 2)
    for s, keys in enumerate((range(0, 4), range(4, 7))):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as t:
            for k in keys:
                _add(t, f"n{k:08d}.jpg", b"\xff\xd8\xff")
                _add(t, f"n{k:08d}.cls", str(k).encode())
        assert (tmp_path / "ours" / f"train-{s:06d}.tar").read_bytes() == buf.getvalue()
    write_wds(str(tmp_path / "ours"), 3, 1, jpeg_bytes=110_000)
    with tarfile.open(tmp_path / "ours" / "train-000000.tar") as t:
        assert [(m.name, m.size) for m in t.getmembers()][:3] == [("n00000000.jpg", 110_000), ("n00000000.cls", 1),
                                                                 ("n00000001.jpg", 110_000)]


def test_scan_processes_are_bounded_by_the_cpu_quota_not_the_cpus_shown(tmp_path, monkeypatch):
    """A container shown every CPU of the node under a quota of 1.5 cores scans in 1 process; a
    scan the first shard says is short stays in this one whatever the cores."""
    from test_limits import _fake

    proc = _fake(tmp_path, "0::/pod/ctr\n", [("/", "/cg", "cgroup2", "rw")], {"/cg/pod/cpu.max": "150000 100000\n",
                                                                      "/cg/pod/ctr/cpu.max": "max 100000\n"})
    monkeypatch.setenv("PREFETCHD_PROC", proc)
    assert webdataset._procs(10.0, 1000) == (1, "the CPU quota of 1.5 cores")
    assert webdataset._procs(0.0001, 1000) == (1, "a short scan")
    monkeypatch.delenv("PREFETCHD_PROC")
    n, why = webdataset._procs(10.0, 1000)
    assert 1 <= n <= min(len(os.sched_getaffinity(0)), webdataset._MAX_PROCS) and why


@pytest.mark.parametrize("python", ["/bin/false", "/nonexistent/python3"])
def test_scan_processes_that_cannot_start_leave_the_scan_to_this_process(tmp_path, monkeypatch, caplog, python):
    """An interpreter that exits at once, or none to run (a frozen app; a pids limit fails the
    same fork): the shards are indexed here, the same index, and the log says why."""
    _tiny_shards(tmp_path / "wds", 6)
    want = _outcome(webdataset.scan, str(tmp_path / "wds"), "cls", procs=1)
    monkeypatch.setattr(sys, "executable", python)
    assert _outcome(webdataset.scan, str(tmp_path / "wds"), "cls", procs=3) == want
    assert f"cannot index shards in other processes ({python} " in caplog.text
    assert "indexing the other 5 here" in caplog.text


def test_a_header_reads_as_the_scan_before_read_it_on_fuzzed_blocks():
    """``tarheaders._header`` (its checksum, name and size fields read faster) against the one the
    scan before had, on tarfile's headers with bytes of the checksum, size and name fields
    replaced at random (spaces, NULs, digits, signs, high bytes): the same answer or the same error."""
    rng = np.random.default_rng(5)
    alphabet = np.frombuffer(b" \0\t\n\x0b01234567789+-_/.\x80\xffa", np.uint8)
    for n in range(3000):
        info = tarfile.TarInfo(f"d{n % 3}/k{n}.jpg" if n % 4 else "x" * int(rng.integers(95, 101)))
        info.size = int(rng.choice([0, 3, 511, 4096, 1 << 33]))
        gnu = n % 2 or info.size >= 8**11  # base-256 sizes: GNU's
        hdr = bytearray(info.tobuf(tarfile.GNU_FORMAT if gnu else tarfile.USTAR_FORMAT)[:512])
        for _ in range(int(rng.integers(0, 3))):
            hdr[int(rng.choice([*range(148, 156), *range(124, 136), *range(90, 100)]))] = int(rng.choice(alphabet))
        if rng.random() < 0.5:  # the checksum made right again for the fields as they now are
            hdr[148:156] = b" " * 8
            hdr[148:156] = (b"%06o\0 " % sum(hdr))
        outcomes = []
        for header in (wds_reference._header, tarheaders._header):
            try:
                outcomes.append(header(bytes(hdr), "s.tar", 0, b"prev"))
            except DatasetError as e:
                outcomes.append(str(e))
        assert outcomes[0] == outcomes[1], bytes(hdr)


def test_a_pax_header_reads_as_the_scan_before_read_it_on_fuzzed_records(tmp_path):
    """``tarheaders._extension``'s short way for TarWriter's one-mtime header against the one the
    scan before had, on records near it: lengths off by one, signs, spaces, no newline, more
    records, a path, a size, sparse keys, global headers."""
    rng = np.random.default_rng(6)
    pieces = [b"27 mtime=1795890484.2507131\n", b"28 mtime=1795890484.25071315\n", b"12 path=a.b\n",
              b"11 size=42\n", b"20 GNU.sparse.map=1\n", b"9 mtime=\n", b"10 atime=1\n"]
    path = tmp_path / "body"
    for n in range(3000):
        body = b"".join(pieces[int(k)] for k in rng.integers(0, len(pieces), size=int(rng.integers(1, 3))))
        body = bytearray(body)
        for _ in range(int(rng.integers(0, 3))):
            body[int(rng.integers(0, len(body)))] = int(rng.choice(np.frombuffer(b" +-0123456789=\n\0m", np.uint8)))
        body = bytes(body[:len(body) - int(rng.integers(0, 2))])
        kind = b"x" if n % 5 else b"g"
        path.write_bytes(body)
        outcomes = []
        for new in (True, False):
            ext, skipped = {}, []
            try:
                if new:
                    tarheaders._extension(body, kind, b"h", len(body), ext, skipped, "s.tar", 512)
                else:
                    fd = os.open(path, os.O_RDONLY)
                    try:
                        wds_reference._extension(fd, kind, b"h", 0, len(body), ext, skipped,
                                                 f"s.tar: the {tarheaders._EXTENSIONS[kind]} at offset 512")
                    finally:
                        os.close(fd)
                outcomes.append((ext, skipped))
            except DatasetError as e:
                outcomes.append(str(e))
        assert outcomes[0] == outcomes[1], body


def test_a_caller_that_returns_mid_scan_from_another_thread_leaves_no_scan_process_behind():
    """The daemon scans on a thread it does not wait for: stopped mid-scan, its main thread
    returns and the interpreter exits; the scan processes go with it (atexit), not after their item."""
    code = ("import threading, time; from prefetchd.sources import scanpool\n"
            "threading.Thread(target=lambda: list(scanpool.ordered(time.sleep, [(60,)] * 6, 3, str)), daemon=True).start()\n"
            "print('go', flush=True); input()")
    p = subprocess.Popen([sys.executable, "-c", code], start_new_session=True, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "go\n"
        wait_until(lambda: _in_their_item(p.pid) == 3, 30, "3 scan processes in their items")
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.wait(timeout=20) == 0
        wait_until(lambda: _scan_children(p.pid) == [], 10, "no scan process left")
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
