"""The client benchmarks run end to end (their figures go to BENCHMARKS.md, not into assertions)."""

from __future__ import annotations

import re
import subprocess
import sys


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


def test_train_bench_runs_the_tiny_model_on_the_cpu_fed_three_ways(tmp_path):
    out = _bench("--train", "tiny", "--device", "cpu", "--size", "32", "--batch-size", "8", "--steps", "4", "--warmup",
                 "2", "--images", "40", "--workers", "1", "--buffer-parent", str(tmp_path))
    feeds = [line.split()[0] for line in out.splitlines() if line.split()[:1] in (["on-device"], ["prefetchd"], ["dataloader"])]
    assert feeds == ["on-device", "prefetchd", "dataloader"], out
    assert "ring full" in out
