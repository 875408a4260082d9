"""The client benchmarks run end to end (their figures go to BENCHMARKS.md, not into assertions), and the
pure parts of ``bench --train``'s steady state and ring sizing."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time

import numpy as np
import pytest
from PIL import Image


def _bench(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "prefetchd", "bench", *args], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_client_cost_bench_reports_sync_and_thread_for_each_feed(tmp_path):
    out = _bench("--client", "--batches", "4", "--passes", "2", "--batch-size", "4", "--size", "32", "--step-ms", "5",
                 "--buffer-parent", str(tmp_path))
    for feed in ("numpy", "tensor"):
        assert re.search(rf"{feed} +sync/thread median ratio", out), out
        assert any(line.split()[:2] == [feed, "thread"] for line in out.splitlines()), out
    assert list(tmp_path.iterdir()) == []  # its ring is gone


def _rows(path) -> list[dict]:
    with open(path) as f:
        return json.load(f)["rows"]


def test_train_bench_runs_the_tiny_model_on_the_cpu_fed_three_ways(tmp_path):
    out = _bench("--train", "tiny", "--device", "cpu", "--size", "32", "--batch-size", "8", "--steps", "4", "--warmup",
                 "2", "--images", "40", "--workers", "1", "--capacity", "8", "--warmup-max-s", "120",
                 "--buffer-parent", str(tmp_path), "--json", str(tmp_path / "train.json"))
    rows = _rows(tmp_path / "train.json")
    assert [(r["feed"], r["state"]) for r in rows] == [
        ("on-device", "-"), ("prefetchd", "ring full"), ("prefetchd", "steady"), ("hybrid", "ring full"),
        ("hybrid", "steady"), ("gpu", "ring full"), ("gpu", "steady"), ("dataloader", "steady")], out
    for r in rows:
        assert r["img_s"] > 0 and re.search(rf"^{r['feed']} +{r['state']} ", out, re.M), out
        if r["state"] == "steady":
            # warmed up at least --warmup steps, then until the backlog stopped flattering the trainer
            assert r["warmup_steps"] >= 2, r
            allowed = ("drained", "held", "blind") if r["feed"] == "dataloader" else ("drained", "held")
            assert r["settled"] in allowed, r
            if r["feed"] != "dataloader":
                assert all(isinstance(b, int) for b in r["backlog"]), r
        else:
            assert r["warmup_steps"] == 2 and "settled" not in r, r
    assert "ring full (8 batches)" in out
    assert "steady: the feed produces while the model trains" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.json"]  # its rings are gone


def _noise_folder(root, classes: int, per_class: int) -> None:
    """JPEGs of noise: large files (about 0.8 MB) for their pixels, cheap to decode."""
    rng = np.random.default_rng(0)
    for c in range(classes):
        (root / f"n{c:08d}").mkdir(parents=True)
        for j in range(per_class):
            Image.fromarray(rng.integers(0, 256, (750, 1000, 3), dtype=np.uint8)).save(
                root / f"n{c:08d}" / f"{j}.JPEG", quality=95)


def test_train_bench_small_size_hybrid_never_stalls_on_max_bytes(tmp_path):
    # 16 JPEGs of about 0.8 MB make a compact batch of about 13 MB, six times a pixel batch at
    # --size 16: sized as twice a pixel batch, the ring-full row's ring (14 batches, every other
    # one compact) stopped at max_bytes and the bench waited 900 s
    data = tmp_path / "data"
    _noise_folder(data, 2, 16)
    (tmp_path / "ring").mkdir()
    out = _bench("--train", "tiny", "--device", "cpu", "--root", str(data), "--size", "16", "--batch-size", "16",
                 "--steps", "10", "--warmup", "2", "--workers", "1", "--decodes", "hybrid", "--capacity", "4",
                 "--warmup-max-s", "120", "--buffer-parent", str(tmp_path / "ring"), "--json", str(tmp_path / "t.json"))
    assert "hybrid: ring full (14 batches)" in out, out
    rows = _rows(tmp_path / "t.json")
    assert [(r["feed"], r["state"]) for r in rows] == [
        ("on-device", "-"), ("hybrid", "ring full"), ("hybrid", "steady"), ("dataloader", "steady")], out
    assert rows[2]["settled"] in ("drained", "held"), rows[2]
    assert list((tmp_path / "ring").iterdir()) == []


def test_ring_bytes_hold_capacity_batches_of_the_largest_files(tmp_path):
    from prefetchd.format import jpegbatch
    from prefetchd.tools.bench.train import _ring_bytes

    _noise_folder(tmp_path, 1, 3)
    paths = sorted(str(p) for p in tmp_path.rglob("*.JPEG"))
    largest = max(os.path.getsize(p) for p in paths)
    # a batch of 8 from 3 files repeats them: at worst 8 copies of the largest one
    worst = jpegbatch.HEADER_SIZE + 8 * (24 + jpegbatch.PARAM.itemsize + largest)
    assert _ring_bytes(paths, 8, 16, 40, "hybrid") >= 40 * worst
    assert _ring_bytes(paths, 8, 16, 40, "cpu") < 40 * worst  # pixel batches at --size 16 are small


def test_settled_drained_held_or_not_yet():
    from prefetchd.tools.bench.steady import settled

    assert settled([], 2, 4, 2) is None
    assert settled([30, 20, 10, 2], 2, 4, 2) == "drained"  # caught up with the feed
    assert settled([40, 30, 20, 10], 2, 4, 2) is None  # still eating the backlog
    assert settled([64, 63, 64, 62, 63], 2, 4, 2) == "held"  # a feed that keeps pace: the ring stays full
    assert settled([20, 25, 30, 35, 40], 2, 4, 2) == "held"  # growing: the feed is faster
    assert settled([64, 60, 56, 52, 48], 2, 4, 2) is None  # shrinking by 4 a step: not steady
    assert settled([64, 64, 64, 64], 2, 4, 2) is None  # not yet a whole window to judge by


def test_loader_backlog_counts_a_dataloaders_finished_batches():
    torch = pytest.importorskip("torch")
    from prefetchd.tools.bench.steady import loader_backlog

    dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(400)), batch_size=4, num_workers=1,
                                     prefetch_factor=3, persistent_workers=True)
    it = iter(dl)
    try:
        assert loader_backlog(dl) is None  # an epoch not begun: every worker is filling its queue
        next(it)
        deadline = time.monotonic() + 120
        seen = []
        while time.monotonic() < deadline:  # one worker finishes the three batches it was given
            seen.append(loader_backlog(dl))
            if seen[-1] == 3:
                break
            time.sleep(0.05)
        assert seen[-1] == 3, seen
        next(it)
        assert loader_backlog(dl) in (2, 3)
    finally:
        dl._iterator._shutdown_workers()


def test_the_dataloader_peer_runs_over_a_root_with_a_corrupt_file(tmp_path):
    """``bench --root ... --peer`` on a user's data with one file Pillow cannot decode: the daemon
    quarantines it and the decode-only limit skips it; the DataLoader peer took it down with a
    traceback. Its dataset now moves on to the next file, as a user's robust dataset would."""
    pytest.importorskip("torch")
    root = tmp_path / "data"
    for c in range(2):
        (root / f"c{c}").mkdir(parents=True)
        for k in range(12):
            Image.new("RGB", (64, 48), (40 * k, 20 * c, 90)).save(root / f"c{c}" / f"{k}.jpg", quality=90)
    (root / "c0" / "bad.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a jpeg at all")
    out = _bench("--root", str(root), "--peer", "--workers", "1", "--batch-size", "4", "--epochs", "1",
                 "--output-size", "32", "--buffer-parent", str(tmp_path))
    assert "DataLoader peer" in out and "daemon/peer" in out, out
    assert "skipped 1 file Pillow cannot decode" in out, out


@pytest.mark.serial  # its workers run at SCHED_IDLE: tests beside it would starve them
def test_share_bench_runs_each_priority_with_ranks_bound_and_says_the_trainers_cpu_wait():
    """``bench --share`` end to end, small: each variant's line has the step ratio and the share of
    the trainer's time it waited for a CPU; ``--share-pin`` binds the ranks (two CPUs here)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("--share-pin needs two CPUs")
    out = _bench("--share", "--share-pin", "--share-priorities", "idle", "--repeats", "1", "--share-cycles", "1",
                 "--images", "64", "--image-side", "64", "--batches", "4", "--step-ms", "1", "-q")
    assert "the trainer bound to the first CPU, rank 1 to the second" in out, out
    for pr in ("normal", "idle"):
        assert re.search(rf"round 0: +{pr}: step [\d.]+ x daemon stopped \[[\d.]+-[\d.]+\] over 1 phase pair "
                         rf"\(median .* x; mean [\d.]+ x; \d+/\d+ steps; waiting for a CPU [\d.]+% / [\d.]+% of them",
                         out), out
        assert re.search(rf"^ +{pr}: step [\d.]+ x daemon stopped \[[\d.]+-[\d.]+\] over 1 phase pair \(median "
                         rf"step [\d.]+ x", out, re.M), out


@pytest.mark.serial  # its workers run at SCHED_IDLE: tests beside it would starve them
def test_share_bench_refill_reads_rank_1_paced_from_a_filled_ring_and_says_what_was_left():
    """``--share-refill``: rank 1 reads paced from a ring first filled that deep; its line gives
    its pace, its time in ``next()`` and the batches left (or that it ran dry)."""
    out = _bench("--share", "--share-only", "step", "--share-refill", "12", "--share-priorities", "idle",
                 "--repeats", "1", "--share-cycles", "1", "--images", "64", "--image-side", "64", "-q")
    for pr in ("normal", "idle"):
        assert re.search(rf"round 0: +{pr}: step .* rank 1 got \d+ img/s at [\d.]+ batches/s, in next\(\) "
                         rf"[\d.]+% of its time, \d+ left in its ring", out), out
    assert "GPU-like" not in out.split("summary")[0], out  # --share-only step


@pytest.mark.serial  # its workers run at SCHED_IDLE: tests beside it would starve them
def test_share_bench_gpu_only_gives_the_rounds_geometric_mean_and_its_interval():
    out = _bench("--share", "--share-only", "gpu", "--share-priorities", "idle", "--repeats", "2",
                 "--images", "64", "--image-side", "64", "--batches", "4", "--step-ms", "1", "-q")
    assert "daemon stopped" not in out, out
    assert re.search(r"^ +idle: GPU-like img/s [\d.]+ x normal \[.*\], geometric mean ([\d.]+) "
                     r"\[([\d.]+)-([\d.]+)\] over 2$", out, re.M), out


def test_the_paired_interval_is_the_geometric_mean_and_a_bootstrap_of_it():
    from prefetchd.tools.bench.share import paired_interval

    assert paired_interval([1.0, 1.0, 1.0]) == (1.0, 1.0, 1.0)
    g, lo, hi = paired_interval([0.9, 1.0, 1.1, 1.2])
    assert g == pytest.approx((0.9 * 1.0 * 1.1 * 1.2) ** 0.25)
    assert 0.9 < lo < g < hi < 1.2
    g2, lo2, hi2 = paired_interval([0.9, 1.0, 1.1, 1.2] * 4)  # more rounds alike: a narrower interval
    assert g2 == pytest.approx(g) and lo < lo2 < g2 < hi2 < hi


def test_share_bench_says_in_one_line_why_its_daemon_did_not_start():
    """A corpus too small for a batch a rank: the daemon exits 78 at once; the bench waited 300 s
    for it and then raised, and now says the daemon's own line and exits 1."""
    r = subprocess.run([sys.executable, "-m", "prefetchd", "bench", "--share", "--share-priorities", "idle",
                        "--repeats", "1", "--share-cycles", "1", "--images", "16", "--image-side", "64", "-q"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("prefetchd bench: the share bench's daemon did not start "
                                                        "(exit status 78): "), r.stderr
    assert "larger than a rank's share of the dataset" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_each_running_phase_is_paired_with_the_stopped_phases_either_side_of_it():
    from prefetchd.tools.bench.share import _paired_ratios

    # running, stopped, running, stopped, running (no whole step in it), stopped
    assert _paired_ratios([10.0, 8.0, 12.0, 4.0, None, 6.0]) == [10.0 / 8.0, 12.0 / 6.0]
    assert _paired_ratios([10.0, None, 9.0]) == []  # no stopped phase beside either
    assert _paired_ratios([]) == []


@pytest.mark.serial  # its workers run at SCHED_IDLE: tests beside it would starve them
def test_share_bench_gpu_paired_switches_the_workers_phase_by_phase_and_pools_the_pairs():
    if os.geteuid() != 0:
        pytest.skip("switching a thread out of SCHED_IDLE needs root")
    # one cycle a round (the serial pass's time): each round's pair, pooled over the two rounds
    out = _bench("--share", "--share-only", "gpu-paired", "--repeats", "2", "--share-cycles", "1", "--share-phase-s",
                 "1.5", "--images", "64", "--image-side", "64", "--step-ms", "1", "-q")
    assert len(re.findall(r"^round \d: GPU-like img/s, workers idle against normal phase by phase: [\d.]+ x "
                          r"\[[\d.]+-[\d.]+\] over 1 pair\b", out, re.M)) == 2, out
    assert re.search(r"^summary: GPU-like img/s, workers idle against normal: [\d.]+ x \[[\d.]+-[\d.]+\] \(geometric "
                     r"mean of 2 phase pairs", out, re.M), out


def test_the_workers_policy_reaches_every_thread_of_every_child_and_not_the_parent():
    if os.geteuid() != 0:
        pytest.skip("switching a thread out of SCHED_IDLE needs root")
    import subprocess
    import sys

    from prefetchd.tools.bench.share import _set_workers_policy

    # a parent whose child runs two threads, as a daemon and its worker
    code = ("import subprocess, sys; c = subprocess.Popen([sys.executable, '-c', "
            "'import threading, time; threading.Thread(target=time.sleep, args=(60,), daemon=True).start(); "
            "print(1, flush=True); time.sleep(60)'], stdout=subprocess.PIPE); c.stdout.readline(); "
            "print(c.pid, flush=True); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", "import time; " + code], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        tids = [int(t) for t in os.listdir(f"/proc/{child}/task")]
        assert len(tids) == 2
        for policy in (os.SCHED_IDLE, os.SCHED_OTHER, os.SCHED_IDLE):
            _set_workers_policy(parent.pid, policy)
            assert [os.sched_getscheduler(t) for t in tids] == [policy, policy]
            assert os.sched_getscheduler(parent.pid) == os.SCHED_OTHER
    finally:
        os.kill(child, 9)
        parent.kill()
        parent.wait(10)


def test_the_round_interval_takes_the_rounds_as_the_unit():
    import math

    from prefetchd.tools.bench.share import round_interval

    assert round_interval([1.02, 1.02, 1.02]) == pytest.approx((1.02, 1.02, 1.02))
    g, lo, hi = round_interval([0.96, 0.98, 1.0, 1.02])
    logs = [math.log(x) for x in (0.96, 0.98, 1.0, 1.02)]
    half = 3.182 * statistics.stdev(logs) / 2  # t(3 df) x the standard error of 4 rounds
    assert g == pytest.approx(math.exp(statistics.fmean(logs)))
    assert (lo, hi) == pytest.approx((g * math.exp(-half), g * math.exp(half)))
