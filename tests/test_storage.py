"""Storage faults never stall training: a touched dataset, a storage hiccup, a full RAM disk.

Each process test runs the real daemon with a trainer reading through the real client, and
checks that the stream it reads stays byte for byte what was made in-process where the dataset
did not change.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import small_config, wait_until
from prefetchd_client import PrefetchClient
from test_daemon import digest, reference_batches

from prefetchd.executors import storage
from prefetchd.format import status
from prefetchd.tools.samples import make_image_folder


def _status(buf) -> dict:
    return status.read_json(str(buf), status.STATUS_NAME) or {}


def _read(c: PrefetchClient, epochs, got: dict, waits: list | None = None, between=None) -> None:
    for e in epochs:
        t = time.monotonic()
        for b, (x, y) in enumerate(c.iter_epoch(e)):
            if waits is not None:
                waits.append(time.monotonic() - t)
            got[(0, e, b)] = (np.ascontiguousarray(x.transpose(0, 2, 3, 1)), y.copy())
            if between is not None:
                between(e, b)
            t = time.monotonic()


def _expected(ref: dict) -> str:
    return digest({k: v[:2] for k, v in ref.items()})


# --- 1. a touched dataset: workers are born from the daemon's index ---------------------------------

def test_a_touched_class_folder_then_a_killed_worker_is_replaced_and_training_goes_on(tmp_path, image_root,
                                                                                     daemon_factory):
    root = tmp_path / "root"
    shutil.copytree(image_root, root)
    cfg = small_config(tmp_path, str(root), workers={"count": 1})
    buf = tmp_path / "buffer"
    ref, _ = reference_batches(cfg)  # the index the daemon starts with (and caches)
    d = daemon_factory(cfg)
    got: dict = {}

    def fault(e, b):
        if (e, b) != (0, 0):
            return
        cls = sorted(os.listdir(root))[1]
        os.utime(root / cls)  # `touch ROOT/<class>`: the cache's stamps no longer hold
        (root / cls / "added.JPEG").write_bytes((root / cls / sorted(os.listdir(root / cls))[0]).read_bytes())
        pids = wait_until(lambda: _status(buf).get("worker_pids"), 30, "worker pids")
        os.kill(pids[0], signal.SIGKILL)
        # the first death in a while is replaced at once (the back-off starts at 0)
        new = wait_until(lambda: (p := _status(buf).get("worker_pids")) and p != pids and p, 30, "a new worker")
        assert new[0] != pids[0]

    with PrefetchClient(cfg, timeout=60, as_numpy=True) as c:
        _read(c, (0,), got, between=fault)
        # a SIGHUP rescans: the change is said, the stream keeps the index it started with
        d.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: "dataset rescan (SIGHUP): the dataset changed" in d.log(), 30, "the rescan's verdict")
        _read(c, (1,), got)
    assert d.stop() == 0
    log = d.log()
    assert digest(got) == _expected(ref)
    assert "missing or stale" not in log and "exited with status 1" not in log
    assert "1 samples added, 0 gone" in log
    assert _status(buf)["worker_restarts"] == 1


def test_workers_start_when_the_index_cache_was_replaced_by_another_process(tmp_path, image_root, daemon_factory):
    root = tmp_path / "root"
    shutil.copytree(image_root, root)
    cfg = small_config(tmp_path, str(root), workers={"count": 1})
    buf = tmp_path / "buffer"
    ref, _ = reference_batches(cfg)
    d = daemon_factory(cfg)
    got: dict = {}

    def fault(e, b):
        if (e, b) != (0, 0):
            return
        cls = sorted(os.listdir(root))[2]
        victim = root / cls / sorted(os.listdir(root / cls))[0]
        shutil.copy(victim, root / cls / "zz-added.JPEG")
        # another process (prefetchd check, say) rescans the changed dataset and rewrites the cache
        subprocess.run([sys.executable, "-m", "prefetchd", "check", "--config", cfg], capture_output=True,
                       timeout=120, check=False)
        pids = wait_until(lambda: _status(buf).get("worker_pids"), 30, "worker pids")
        os.kill(pids[0], signal.SIGKILL)
        wait_until(lambda: (p := _status(buf).get("worker_pids")) and p != pids, 30, "a new worker")

    with PrefetchClient(cfg, timeout=60, as_numpy=True) as c:
        _read(c, (0, 1), got, between=fault)
    assert d.stop() == 0
    assert digest(got) == _expected(ref)
    assert "no longer holds this daemon's index" in d.log()


def test_a_sighup_rescan_scans_only_a_dataset_whose_cache_stamps_changed_and_compares_off_the_loop(
        tmp_path, caplog):
    """A SIGHUP for a tunable must not rescan 1.28 M samples: the cache's stamps vouch for an
    unchanged dataset (folders: their mtimes; tar files: one stat each). A changed one is scanned
    and compared on the rescan's thread; the loop only logs the verdict."""
    import logging

    from imagenet_archives import make_imagenet

    from prefetchd.daemon import rescan
    from prefetchd.sources.dataset import load_index, unchanged_since_scan

    root = tmp_path / "root"
    make_image_folder(str(root), classes=3, per_class=4, seed=5, long_side=64)
    exts, cache = (".jpeg", ".jpg"), str(tmp_path / "cache")
    index, _ = load_index(str(root), None, exts, cache)
    assert unchanged_since_scan(index.files_dir, index.fingerprint)
    assert not unchanged_since_scan(index.files_dir, "0" * 16)  # the cache holds another index: cannot tell
    assert not unchanged_since_scan(None, index.fingerprint)  # no cache: cannot tell
    scans, diffs = [], []

    def scan():
        scans.append(1)
        return load_index(str(root), None, exts, cache, use_cache=False)[0]

    real_diff = rescan.dataset_diff

    def diff(a, b):
        diffs.append(threading.current_thread().name)
        return real_diff(a, b)

    def run() -> str:
        woken = threading.Event()
        r = rescan.Rescan(index, lambda: unchanged_since_scan(index.files_dir, index.fingerprint), scan, woken.set)
        assert woken.wait(30)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="prefetchd"):
            r.report()
        return caplog.text

    rescan.dataset_diff = diff
    try:
        assert "unchanged, 12 samples (the index cache's stamps hold: not scanned again)" in run()
        assert scans == []
        cls = root / sorted(os.listdir(root))[1]
        shutil.copy(cls / sorted(os.listdir(cls))[0], cls / "added.JPEG")
        assert not unchanged_since_scan(index.files_dir, index.fingerprint)
        assert "the dataset changed since this daemon read it (1 samples added, 0 gone" in run()
        assert scans == [1] and diffs == ["prefetchd-rescan"]  # scanned and compared on the rescan's thread
    finally:
        rescan.dataset_diff = real_diff
    net = make_imagenet(str(tmp_path / "net"), classes=3, per_class=2, val=3, seed=4)
    tars, _ = load_index(net.train_tar, None, exts, cache)
    assert unchanged_since_scan(tars.files_dir, tars.fingerprint)
    os.utime(net.train_tar, ns=(1, 1))  # the archive rewritten: its stat no longer matches
    assert not unchanged_since_scan(tars.files_dir, tars.fingerprint)


# --- 2. a storage hiccup: nothing is quarantined, the batches are made once it is back -------------

def test_a_dataset_root_gone_for_2_s_stalls_the_trainer_no_longer_than_the_outage_and_quarantines_nothing(
        tmp_path, daemon_factory):
    root = tmp_path / "root"
    make_image_folder(str(root), classes=4, per_class=12, seed=3, long_side=160)
    cfg = small_config(tmp_path, str(root), workers={"count": 1}, buffer={"capacity": 2, "refill_at": 2})
    buf = tmp_path / "buffer"
    ref, _ = reference_batches(cfg)
    d = daemon_factory(cfg)
    outage_s = 2.0
    waits: list[float] = []
    got: dict = {}
    ended = threading.Event()

    def outage():
        os.rename(root, str(root) + ".away")
        time.sleep(outage_s)  # the fault itself: storage gone for this long
        os.rename(str(root) + ".away", root)
        ended.set()

    def fault(e, b):
        if (e, b) == (0, 1):
            threading.Thread(target=outage, daemon=True).start()

    try:
        with PrefetchClient(cfg, timeout=60, as_numpy=True) as c:
            _read(c, (0, 1), got, waits, between=fault)
    finally:
        if not root.exists():
            os.rename(str(root) + ".away", root)
    assert ended.is_set()
    assert max(waits) < outage_s + 5, waits
    assert digest(got) == _expected(ref)
    wait_until(lambda: _status(buf).get("produced_batches", 0) >= 16, 30, "status after the last batch")
    s = _status(buf)
    assert s["quarantined"] == 0 and s["dataset_unreadable"] is None
    assert d.stop() == 0
    log = d.log()
    assert not (buf / status.QUARANTINE_NAME).exists()
    assert "quarantined sample" not in log and "replacements for sample" not in log
    assert log.count(f"the dataset root {root} is unreadable") == 1, log  # said once, not per sample
    assert "the dataset root is readable again" in log


def test_a_validation_root_gone_is_one_outage_while_the_train_batches_are_made(tmp_path, daemon_factory):
    """Outages are per root: train batches made while the validation root stays unreadable do not
    end its outage, so it is said once (not an ERROR and a 'readable again' every retry)."""
    root, val_root = tmp_path / "root", tmp_path / "val"
    make_image_folder(str(root), classes=4, per_class=12, seed=3, long_side=160)
    make_image_folder(str(val_root), classes=4, per_class=12, seed=5, long_side=160)  # held out: other images
    cfg = small_config(tmp_path, str(root), workers={"count": 1}, buffer={"capacity": 2, "refill_at": 2},
                       validation={"enabled": True, "root": str(val_root), "batch_size": 5})
    buf = tmp_path / "buffer"
    ref, _ = reference_batches(cfg)
    d = daemon_factory(cfg)
    wait_until(lambda: _status(buf).get("produced_batches", 0) >= 1, 60, "the first batch")
    os.rename(val_root, str(val_root) + ".away")
    val_got: list = []

    def read_val():
        with PrefetchClient(cfg, split="val", timeout=120, as_numpy=True) as v:
            val_got.extend(y.copy() for _, y in v)

    t = threading.Thread(target=read_val, daemon=True)
    try:
        t.start()
        said = f"the dataset root {val_root} is unreadable"
        wait_until(lambda: said in d.log(), 60, "the validation root's outage said")
        got: dict = {}
        with PrefetchClient(cfg, timeout=60, as_numpy=True) as c:  # train batches made meanwhile
            _read(c, (0, 1), got)
        assert digest(got) == _expected(ref)
        wait_until(lambda: said in (_status(buf).get("dataset_unreadable") or ""), 30, "the outage in the status")
        log = d.log()
        assert log.count(said) == 1 and "readable again" not in log, log
    finally:
        if not val_root.exists():
            os.rename(str(val_root) + ".away", val_root)
    t.join(120)
    assert not t.is_alive() and len(val_got) == 10  # 48 samples in batches of 5
    wait_until(lambda: _status(buf).get("dataset_unreadable") is None, 30, "the outage over in the status")
    assert d.stop() == 0
    log = d.log()
    assert log.count(said) == 1 and log.count(f"the dataset root is readable again: {val_root}") == 1, log


def test_a_transient_errno_is_tried_again_and_only_a_lasting_one_blames_the_sample(tmp_path, monkeypatch):
    (tmp_path / "a.jpg").write_bytes(b"data")
    calls = []
    real_read = os.read

    def flaky(path, fails):
        def read():
            calls.append(path)
            if len(calls) <= fails:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            fd = os.open(path, os.O_RDONLY)
            try:
                return real_read(fd, 100)
            finally:
                os.close(fd)
        return read

    assert storage.read_sample(flaky(str(tmp_path / "a.jpg"), 2), str(tmp_path), sleep=lambda s: None) == b"data"
    calls.clear()
    with pytest.raises(storage.SampleUnreadable, match="Input/output error .also when tried again"):
        storage.read_sample(flaky(str(tmp_path / "a.jpg"), 99), str(tmp_path), sleep=lambda s: None)
    assert len(calls) == 1 + len(storage.TRANSIENT_PAUSES_S)
    with pytest.raises(storage.SampleUnreadable, match="No such file"):  # missing while the root is there
        storage.read_sample(flaky(str(tmp_path / "gone.jpg"), 0), str(tmp_path))
    with pytest.raises(storage.StorageUnavailable, match="the dataset root .* is unreadable"):
        storage.read_sample(flaky(str(tmp_path / "x" / "a.jpg"), 0), str(tmp_path / "x"))


# --- 3. a full RAM disk: the trainer reads on from the ring ----------------------------------------

@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MiB tmpfs of its own (tests run as root); unmounted afterwards whatever happens."""
    mnt = tmp_path / "ramdisk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root; CI runs as root): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(path) -> None:
    """Fill the filesystem of ``path`` with one file, as another program would (growing the file
    if it is there already: what was freed since is taken too)."""
    with open(path, "ab", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC


def test_a_full_ram_disk_does_not_stop_the_trainer_and_status_says_its_figures_are_stale(
        tmp_path, image_root, daemon_factory, small_tmpfs):
    buf = small_tmpfs / "buffer"
    # the daemon's own bytes (at most 5 batches of 76 KiB) stay well inside the 1 MiB tmpfs: what
    # fills it is another program's file
    cfg = small_config(tmp_path, image_root, buffer={"dir": str(buf), "min_free_bytes": 1, "max_bytes": "400KiB"})
    ref, _ = reference_batches(cfg)
    d = daemon_factory(cfg)
    filler = small_tmpfs / "filler"
    got: dict = {}
    during: list = []

    def fault(e, b):
        if (e, b) == (0, 0):
            # the ring settled: the daemon filled it to its refill mark and makes nothing more (the
            # reader reads ahead, so the window's 4th batch may or may not be made: refill_at is 3)
            wait_until(lambda: (r := _status(buf).get("ranks", {}).get("0", {})).get("ready", 0) >= 3
                       and not r.get("filling") and not r.get("in_flight"), 30, "a settled ring")
            _fill(filler)
            t = time.monotonic()
            threading.Timer(5.0, filler.unlink).start()  # the disk stays full for 5 s
            during.append(t)
        elif during and filler.exists():
            during.append((e, b))  # read from the ring while the disk is full

    with PrefetchClient(cfg, timeout=60, as_numpy=True) as c:
        _read(c, (0, 1), got, between=fault)
    assert len(during) >= 3, during  # the batches already in the ring were read during the fill
    assert digest(got) == _expected(ref)
    # the disk full again, no trainer: `prefetchd status` says its figures are stale. The daemon
    # evicts the last batches read once it reads their progress, which frees room its status file
    # then takes: the filler grows into whatever is freed, before each look
    _fill(filler)
    try:
        def stale():
            _fill(filler)
            r = subprocess.run([sys.executable, "-m", "prefetchd", "status", "--config", cfg],
                               capture_output=True, text=True, timeout=60)
            return "STALE" in r.stdout and r.stdout
        out = wait_until(stale, 30, "`prefetchd status` saying its figures are stale", interval=0.5)
        assert "is the buffer's filesystem full?" in out
    finally:
        filler.unlink()
    assert d.stop() == 0
    assert not [n for n in os.listdir(buf) if n.startswith(".tmp-")]


def test_check_notes_when_the_progress_files_share_the_batches_filesystem(tmp_path, image_root, small_tmpfs):
    """The default layout: a note with its consequence, not a warning on every default install."""
    def check(cfg):
        r = subprocess.run([sys.executable, "-m", "prefetchd", "check", "--config", cfg], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout

    out = check(small_config(tmp_path, image_root, buffer={"dir": str(small_tmpfs / "buffer")}))
    assert "note: progress.dir" in out and "shares a filesystem with buffer.dir" in out, out
    assert "progress reports are delayed (the client retries" in out, out
    assert "warning: progress.dir" not in out, out
    n = out.count(chr(10) + "warning: ")
    assert f"no problems, {n} warning{'s' if n != 1 else ''}" in out, out  # the note is not counted
    out = check(small_config(tmp_path, image_root, buffer={"dir": str(small_tmpfs / "buffer")},
                             progress={"dir": str(tmp_path / "progress")}))
    assert "shares a filesystem" not in out, out


# --- 4. a directory symlink to an ancestor ----------------------------------------------------------

def test_a_symlink_to_an_ancestor_serves_every_image_once_with_its_own_label(tmp_path, image_root, daemon_factory):
    plain = tmp_path / "plain"  # the same images, no symlink: what the stream must be
    (plain_dir := tmp_path / "p").mkdir()
    shutil.copytree(image_root, plain)
    ref, index = reference_batches(small_config(plain_dir, str(plain)))
    root = tmp_path / "root"
    shutil.copytree(image_root, root)
    first = sorted(os.listdir(root))[0]
    os.symlink("..", root / first / "up")
    cfg = small_config(tmp_path, str(root))
    r = subprocess.run([sys.executable, "-m", "prefetchd", "check", "--config", cfg], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and f"dataset: {len(index)} samples" in r.stdout, r.stdout + r.stderr
    assert f"skipped {first}/up -> .. (a directory symlink into dataset.root" in r.stdout, r.stdout
    d = daemon_factory(cfg)
    got: dict = {}
    with PrefetchClient(cfg, timeout=60, as_numpy=True) as c:
        assert len(c.dataset) == len(index) == 48
        _read(c, (0, 1), got)
    assert d.stop() == 0
    assert digest(got) == _expected(ref)  # same images, same labels: each image once, under its own class


def test_a_tar_root_is_storage_that_can_vanish_and_return(tmp_path):
    """``dataset.root`` naming an archive: readable while the file is there, an outage (no sample
    blamed) while it is renamed away, and a member's read error the sample's fault once it is back."""
    root = tmp_path / "train.tar"
    root.write_bytes(b"\0" * 1024)
    assert storage.root_unreadable(str(root)) is None

    def read():
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    with pytest.raises(storage.SampleUnreadable):
        storage.read_sample(read, str(root), sleep=lambda s: None)
    root.rename(tmp_path / "away.tar")
    with pytest.raises(storage.StorageUnavailable, match="is unreadable"):
        storage.read_sample(read, str(root), sleep=lambda s: None)
    (tmp_path / "folder").mkdir()
    assert storage.root_unreadable(str(tmp_path / "folder")) is None


@pytest.mark.parametrize("code, outcome", [(errno.ENOENT, "sample"), (errno.EACCES, "sample"), (errno.EIO, "bucket")])
def test_a_bucket_roots_read_faults_are_the_samples_or_the_buckets_never_a_stat_of_the_url(code, outcome,
                                                                                           monkeypatch):
    """A bucket URL cannot be stat'ed: an object gone since the listing or refused (404, 403) is that
    sample's fault (quarantined, training goes on); what the store already retried for minutes is
    the bucket's (the batch waits). Before, every fault read as 'the root is unreadable' and a
    missing object held its batch back for good. (A 403 is the sample's only while the bucket still
    lists, which there is no bucket here to ask: tests/test_bucket_imagenet_contact.py asks a real one.)"""
    monkeypatch.setattr(storage, "_bucket_refuses", lambda root: None)

    def read():
        raise OSError(code, os.strerror(code), "s3://bucket/train/n01/x.jpg")

    if outcome == "sample":
        with pytest.raises(storage.SampleUnreadable):
            storage.read_sample(read, "s3://bucket/train", sleep=lambda s: None)
    else:
        with pytest.raises(storage.StorageUnavailable, match="cannot be read now"):
            storage.read_sample(read, "s3://bucket/train", sleep=lambda s: None)


def test_a_bucket_outage_past_the_retries_is_said_as_what_came_back_not_obstores_text(monkeypatch):
    # the batch's line carried obstore's text: the endpoint's URL and query, the retries' count, the XML
    pytest.importorskip("obstore", reason="the s3 extra (obstore) is not installed")
    monkeypatch.setattr(storage, "_bucket_refuses", lambda root: None)
    raw = ("Generic S3 error: Error performing GET http://10.0.0.7:8333/b/train/n01/x.jpg in 120.4s, after 10 "
           "retries, max_retries: 10, retry_timeout: 120s - Server returned non-2xx status code: 503 Service "
           "Unavailable: <Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>")

    def read():
        raise OSError(errno.ETIMEDOUT, raw, "s3://b/train/n01/x.jpg")

    with pytest.raises(storage.StorageUnavailable) as e:
        storage.read_sample(read, "s3://b/train", sleep=lambda s: None)
    assert str(e.value) == "the dataset root s3://b/train cannot be read now (it answered 503 SlowDown)", e.value
