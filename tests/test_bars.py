"""Progress bars (tqdm) on a terminal only: logs, journald and tests reading output get none."""

from __future__ import annotations

import io
import subprocess
import sys

from prefetchd.sources.dataset import scan_image_folder


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_index_scan_draws_a_bar_on_a_terminal_only(image_root, monkeypatch):
    tty = _Terminal()
    monkeypatch.setattr(sys, "stderr", tty)
    index, _ = scan_image_folder(image_root, (".jpeg",))
    assert len(index) == 48
    drawn = tty.getvalue()
    assert f"scanning {image_root}:" in drawn and "/4 [" in drawn, drawn  # a bar over the 4 class folders

    plain = io.StringIO()  # isatty() is False: a log file, a pipe
    monkeypatch.setattr(sys, "stderr", plain)
    scan_image_folder(image_root, (".jpeg",))
    assert plain.getvalue() == ""


def test_index_scan_bar_off_when_tqdm_is_disabled(image_root, monkeypatch):
    tty = _Terminal()
    monkeypatch.setattr(sys, "stderr", tty)
    monkeypatch.setenv("TQDM_DISABLE", "1")  # what `bench --quiet` sets
    scan_image_folder(image_root, (".jpeg",))
    assert tty.getvalue() == ""


def test_demo_output_off_a_terminal_is_one_line_per_result():
    r = subprocess.run([sys.executable, "-m", "prefetchd", "demo", "--images", "48", "--classes", "4", "--epochs", "2",
                        "--batch-size", "8", "--workers", "1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout + r.stderr
    assert "\r" not in out and "batch/s" not in out and "it/s" not in out, out
    assert "epoch 0: 6 batches in" in r.stdout and "epoch 1: 6 batches in" in r.stdout, r.stdout
    assert "done: 96 images" in r.stdout
    # the demo starts its daemon itself: its trainer never tells the user to run one
    assert "no daemon holds" not in out and "WARNING" not in out, out
