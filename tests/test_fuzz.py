"""Fuzzing the progress file, the one input any member of the buffer group can write.

10,000 generated bad files (random JSON, huge, negative, float, NaN and infinite numbers, wrong
types, deep nesting, huge strings, binary, truncated), each checked by the parser alone and then
fed to the real daemon one by one: the test waits, through its own inotify watch, until the
daemon has read each file (IN_CLOSE_NOWRITE) before writing the next, and writes a good file
between two bad ones, so each bad file starts a bad spell and must give exactly one warning.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import select
import struct

import pytest
from conftest import small_config, wait_until

from prefetchd.format import progress, status

N_FILES = 10_000
_IN_CLOSE_NOWRITE = 0x10


class _Inotify:
    """Just enough inotify to learn when someone else has read a file of a directory."""

    def __init__(self, directory: str):
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        assert self.fd >= 0
        assert self.libc.inotify_add_watch(self.fd, directory.encode(), _IN_CLOSE_NOWRITE) >= 0
        self.buf = b""

    def wait_read(self, name: str, timeout: float = 10.0) -> None:
        want = name.encode()
        while True:
            while len(self.buf) >= 16:
                _, mask, _, n = struct.unpack_from("iIII", self.buf)
                got = self.buf[16:16 + n].rstrip(b"\0")
                self.buf = self.buf[16 + n:]
                if got == want:
                    return
            if not select.select([self.fd], [], [], timeout)[0]:
                raise AssertionError(f"the daemon did not read {name} within {timeout:.0f} s")
            self.buf += os.read(self.fd, 65536)

    def close(self) -> None:
        os.close(self.fd)


_BAD_FLOATS = ["9" * 5000, "-1", "-1e-300", str(10 ** 301), "1e400", "-1e400", "NaN", "Infinity", "-Infinity",
               "true", "null", '"1"', "[]"]


def _num(rnd: random.Random, for_float: bool = False) -> str:
    """A JSON number token (or a non-standard one Python's json accepts) that the field refuses."""
    if for_float:
        return rnd.choice(_BAD_FLOATS)
    return rnd.choice([
        "9" * rnd.randint(20, 6000), "-" + "9" * rnd.randint(1, 500), str(-rnd.randint(1, 1 << 40)),
        str(1 << 63), str(10 ** rnd.randint(19, 400)), "1e400", "-1e400", "NaN", "Infinity",
        "-Infinity", "1.5", "-0.5", "1e-320", "4294967296.0", "true", "null",
    ])


def _value(rnd: random.Random, depth: int = 0) -> str:
    k = rnd.randrange(8 if depth < 4 else 4)
    if k == 0:
        return _num(rnd)
    if k == 1:
        return json.dumps("".join(chr(rnd.randrange(32, 0x2FFF)) for _ in range(rnd.randint(0, 40))))
    if k == 2:
        return rnd.choice(["true", "false", "null", "0", "1", '""'])
    if k == 3:
        return json.dumps("x" * rnd.randint(129, 60000))
    if k in (4, 5):
        return "[" + ",".join(_value(rnd, depth + 1) for _ in range(rnd.randint(0, 4))) + "]"
    return "{" + ",".join(f'{json.dumps(str(rnd.random()))}:{_value(rnd, depth + 1)}'
                          for _ in range(rnd.randint(0, 4))) + "}"


_GOOD = {"format": "prefetchd-progress", "version": 1, "rank": 0, "epoch": 0, "batch": 5, "fingerprint": "",
         "pid": 1, "time": 1.0, "wait_s": 0.0, "batches": 5, "session": "s", "echoed": 0, "waiting_since": 0.0,
         "closed": False}


def bad_file(rnd: random.Random) -> bytes:
    kind = rnd.randrange(7)
    if kind == 0:  # a good file with one field hostile
        fields = {k: json.dumps(v) for k, v in _GOOD.items()}
        key = rnd.choice([k for k in fields if k not in ("format", "version")])
        fields[key] = str(1 << 32) if key in ("rank", "epoch", "batch") and rnd.random() < 0.2 else \
            rnd.choice(["1", "0", '"true"', "null", "[]"]) if key == "closed" else \
            _num(rnd, key in ("time", "wait_s", "waiting_since")) if key not in ("fingerprint", "session") else rnd.choice(
            [_num(rnd), json.dumps("s" * rnd.randint(129, 5000)), "[]", "{}"])
        return ("{" + ",".join(f'"{k}":{v}' for k, v in fields.items()) + "}").encode()
    if kind == 1:  # wrong types in the required fields
        d = dict(_GOOD)
        d[rnd.choice(["rank", "epoch", "batch", "version", "format"])] = rnd.choice(["0", [0], {"a": 1}, None, True, 0.0])
        return json.dumps(d).encode()
    if kind == 2:  # a required field missing
        d = dict(_GOOD)
        del d[rnd.choice(["rank", "epoch", "batch", "version", "format"])]
        return json.dumps(d).encode()
    if kind == 3:  # random JSON
        return _value(rnd).encode()
    if kind == 4:  # deep nesting
        n = rnd.randint(1000, 30000)
        return (rnd.choice("[{") * n if rnd.random() < 0.5 else "[" * n + "]" * n).encode()
    if kind == 5:  # binary, or text that is not UTF-8
        return rnd.randbytes(rnd.randint(1, 3000)) + b"\xff"
    good = json.dumps(_GOOD).encode()  # truncated
    return good[:rnd.randrange(len(good))]


def generate(n: int, seed: int = 1234) -> list[bytes]:
    rnd = random.Random(seed)
    return [bad_file(rnd) for _ in range(n)]


def test_the_parser_rejects_every_generated_file_with_a_progress_error():
    for data in generate(N_FILES):
        with pytest.raises(progress.ProgressError) as e:
            progress.decode(data)
        assert "\n" not in str(e.value) and len(str(e.value)) < 300


def _write(pdir: str, data: bytes) -> None:
    tmp = os.path.join(pdir, ".fuzz.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, progress.progress_path(pdir, 0))


def test_the_daemon_survives_10000_bad_progress_files_with_one_warning_each(tmp_path, image_root, daemon_factory):
    cfg = small_config(tmp_path, image_root, loader={"epochs": None}, progress={"poll_interval_s": 5.0})
    buf = str(tmp_path / "buffer")
    pdir = os.path.join(buf, "progress")
    os.makedirs(pdir)
    files = generate(N_FILES)
    _write(pdir, files[0])  # one there at start-up
    name = progress.progress_name(0)
    watch = _Inotify(pdir)
    try:
        d = daemon_factory(cfg)
        watch.wait_read(name, 30)
        good = json.dumps(_GOOD).encode()
        _write(pdir, good)
        watch.wait_read(name)
        for i, data in enumerate(files[1:], 1):
            _write(pdir, data)
            watch.wait_read(name)
            _write(pdir, good)  # ends the bad spell: the next bad file is warned about again
            watch.wait_read(name)
            if i % 1000 == 0:
                assert d.proc.poll() is None, f"the daemon died after file {i}"
    finally:
        watch.close()

    def position():
        return (status.read_json(buf, status.STATUS_NAME) or {}).get("ranks", {}).get("0", {}).get("position")

    assert d.proc.poll() is None
    wait_until(lambda: position() == [0, 5], 10, "position 0/5 in status.json")
    assert d.stop() == 0
    log = d.log()
    warnings = [line for line in log.splitlines() if "ignoring" in line]
    assert len(warnings) == N_FILES
    assert "keeping the last good position none" in warnings[0]
    assert all("keeping the last good position (0, 5)" in w for w in warnings[1:])
    assert "Traceback" not in log and max(len(w) for w in warnings) < 600
