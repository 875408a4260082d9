"""Live operation: reload, metrics, preview, journal-friendly logs."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import urllib.request

import yaml
from conftest import small_config, wait_until
from PIL import Image
from test_daemon import published

from prefetchd.format import status


def _status(buf: str) -> dict:
    return status.read_json(buf, status.STATUS_NAME) or {}


def _edit(cfg: str, section: str, **values) -> None:
    data = yaml.safe_load(open(cfg))
    data.setdefault(section, {}).update(values)
    open(cfg, "w").write(yaml.safe_dump(data))


def test_sighup_applies_tunables_keeps_batches_and_refuses_stream_changes(tmp_path, image_root, daemon_factory):
    cfg = small_config(tmp_path, image_root, loader={"epochs": None})
    buf = str(tmp_path / "buffer")
    d = daemon_factory(cfg)
    wait_until(lambda: len(published(buf)) == 4, 30, "a full buffer of 4")
    before = set(published(buf))
    _edit(cfg, "buffer", capacity=7, refill_at=7)
    _edit(cfg, "workers", count=1)
    d.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: len(published(buf)) == 7, 30, "a buffer of 7 after the reload")
    # the dataset did not change: its cache's stamps say so, nothing is scanned again
    wait_until(lambda: "dataset rescan (SIGHUP): unchanged, 48 samples (the index cache's stamps hold: not "
               "scanned again)" in d.log(), 30, "the rescan's verdict")
    assert before <= set(published(buf))  # nothing buffered was lost
    wait_until(lambda: _status(buf).get("capacity") == 7 and _status(buf).get("workers") == 1, 10, "new tunables")
    _edit(cfg, "loader", seed=8)
    d.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "reload refused: loader.seed would change the batch stream" in d.log(), 10, "a refusal")
    _edit(cfg, "loader", seed=7)
    _edit(cfg, "buffer", capacity=0)
    d.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "reload refused: buffer.capacity must be a positive integer" in d.log(), 10, "a bad value refused")
    assert d.proc.poll() is None and len(published(buf)) == 7
    assert d.stop() == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_prometheus_metrics_on_loopback(tmp_path, image_root, daemon_factory):
    port = _free_port()
    cfg = small_config(tmp_path, image_root, metrics={"enabled": True, "port": port})
    buf = str(tmp_path / "buffer")
    d = daemon_factory(cfg)
    wait_until(lambda: _status(buf).get("ranks", {}).get("0", {}).get("ready") == 4, 30, "a full buffer")

    def scrape():
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        except OSError:
            return ""

    text = wait_until(lambda: (t := scrape()) and 'prefetchd_rank_ready_batches{rank="0"} 4.0' in t and t, 15,
                      "metrics with a full buffer")
    for name in ("prefetchd_produced_images_total", "prefetchd_buffer_used_bytes", "prefetchd_workers_alive",
                 'prefetchd_trainer_wait_seconds_total{rank="0"}', "prefetchd_quarantined_samples",
                 "prefetchd_resident_memory_bytes", "prefetchd_worker_restarts_total"):
        assert name in text, name
    assert re.search(r"^prefetchd_produced_batches_total (\d+)", text, re.M)
    # the planner rewrite's counters: worker timeouts, failed batches (retried after a back-off), and
    # the main process's own CPU time, which is more than nothing once it has filled the buffer
    assert re.search(r"^prefetchd_worker_timeouts_total 0\.0$", text, re.M), text
    assert re.search(r"^prefetchd_forkserver_restarts_total 0\.0$", text, re.M), text
    assert re.search(r"^prefetchd_resource_tracker_restarts_total 0\.0$", text, re.M), text
    assert re.search(r"^prefetchd_failed_batches_total 0\.0$", text, re.M), text
    cpu = re.search(r"^prefetchd_main_cpu_seconds_total (\S+)$", text, re.M)
    assert cpu and float(cpu.group(1)) > 0, text
    # and the back-offs: a missing worker's respawn, failed batches of a rank waiting to be tried again
    assert re.search(r"^prefetchd_worker_respawn_wait_seconds 0\.0$", text, re.M), text
    assert 'prefetchd_rank_retrying_batches{rank="0"} 0.0' in text, text
    assert d.stop() == 0


def test_metrics_port_taken_is_a_clear_error(tmp_path, image_root, daemon_factory):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        cfg = small_config(tmp_path, image_root, metrics={"enabled": True, "port": port})
        d = daemon_factory(cfg)
        assert d.proc.wait(30) == 1
    assert "cannot run" in d.log() and "Address already in use" in d.log()
    assert f"metrics.port {port} on metrics.address 127.0.0.1" in d.log()  # the key to change


def test_metrics_enabled_by_sighup_listens_and_a_taken_port_is_said(tmp_path, image_root, daemon_factory):
    cfg = small_config(tmp_path, image_root)
    buf = str(tmp_path / "buffer")
    d = daemon_factory(cfg)
    wait_until(lambda: _status(buf).get("ranks", {}).get("0", {}).get("ready") == 4, 30, "a full buffer")
    port = _free_port()
    _edit(cfg, "metrics", enabled=True, port=port)
    d.proc.send_signal(signal.SIGHUP)

    def scrape():
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        except OSError:
            return ""

    text = wait_until(lambda: "prefetchd_rank_ready_batches" in (t := scrape()) and t, 30, "metrics after SIGHUP")
    assert "prefetchd_produced_batches_total" in text
    with socket.socket() as taken:  # moved to a taken port: said, naming the key; the daemon goes on
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        _edit(cfg, "metrics", port=taken.getsockname()[1])
        d.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: "reload: cannot serve metrics: metrics.port" in d.log(), 30, "the refusal")
    assert scrape() == "" and d.proc.poll() is None
    assert d.stop() == 0


def test_preview_writes_a_grid_of_labelled_samples(tmp_path, image_root, daemon_factory):
    cfg = small_config(tmp_path, image_root)
    out = tmp_path / "grid.png"
    r = subprocess.run([sys.executable, "-m", "prefetchd", "preview", "--config", cfg, "--out", str(out), "--count", "6"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "made in-process" in r.stdout
    im = Image.open(out)
    assert im.size[0] > 3 * 64 and im.size[1] > 2 * 64
    d = daemon_factory(cfg)
    wait_until(lambda: published(str(tmp_path / "buffer")), 30, "a batch")
    r = subprocess.run([sys.executable, "-m", "prefetchd", "preview", "--config", cfg, "--out", str(out)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "from the buffer" in r.stdout, r.stdout + r.stderr
    assert d.stop() == 0


def test_logs_under_journald_carry_priorities_and_no_timestamps(tmp_path, image_root, daemon_factory):
    cfg = small_config(tmp_path, image_root)
    d = daemon_factory(cfg, env={"JOURNAL_STREAM": "8:1234"})
    wait_until(lambda: "first batch published" in d.log(), 30, "the first batch")
    assert d.stop() == 0, d.log()
    lines = [line for line in d.log().splitlines() if line.strip()]
    assert lines and all(re.match(r"^<[0-7]>[\w.]+: ", line) for line in lines), lines
    assert not [line for line in lines if line.startswith("<3>")], lines  # no errors in a clean run
    assert not [line for line in lines if re.search(r"\d\d:\d\d:\d\d", line)]


def test_status_json_is_machine_readable_without_a_daemon(tmp_path, image_root):
    cfg = small_config(tmp_path, image_root)
    r = subprocess.run([sys.executable, "-m", "prefetchd", "status", "--config", cfg, "--json"], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 3 and json.loads(r.stdout) == {"alive": False, "status": None}


def test_status_watch_redraws_until_interrupted(tmp_path, image_root, daemon_factory):
    cfg = small_config(tmp_path, image_root)
    d = daemon_factory(cfg)
    wait_until(lambda: _status(str(tmp_path / "buffer")).get("pid"), 30, "a status")
    # SIGINT as a terminal delivers it, also where the suite runs as a background job (which ignores it)
    p = subprocess.Popen([sys.executable, "-m", "prefetchd", "status", "--config", cfg, "--watch", "--interval", "0.2"],
                         stdout=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    first = p.stdout.read(200)
    p.send_signal(signal.SIGINT)
    out, _ = p.communicate(timeout=10)
    assert p.returncode == 0 and "\x1b[2J" in first and "prefetchd pid" in first + out
    assert d.stop() == 0


def test_status_stops_saying_blocked_once_a_worker_bound_daemon_has_room_again(tmp_path, image_root,
                                                                                daemon_factory):
    """After a spell on max_bytes, a daemon whose every plan uses every worker slot (one worker,
    a long window to fill) must not go on reporting the spell: the status follows every plan."""
    from prefetchd.format import batchfile

    per_batch = batchfile.max_file_size(6, 32, 32)
    port = _free_port()
    cfg = small_config(tmp_path, image_root, loader={"epochs": None},
                       augment={"output_size": 32, "scale_min": 36, "scale_max": 60},
                       workers={"count": 1, "max_tasks_in_flight": 1},
                       buffer={"capacity": 2000, "refill_at": 2000, "max_bytes": 3 * per_batch},
                       metrics={"enabled": True, "port": port})
    buf = str(tmp_path / "buffer")
    d = daemon_factory(cfg)
    wait_until(lambda: "buffer.max_bytes" in (_status(buf).get("blocked") or ""), 60, "the max_bytes spell")

    def scrape():
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        except OSError:
            return ""

    wait_until(lambda: re.search(r"^prefetchd_blocked 1\.0$", scrape(), re.M), 15, "prefetchd_blocked 1")
    _edit(cfg, "buffer", max_bytes="1GiB")
    d.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "reloaded:" in d.log(), 30, "the reload")
    made = _status(buf)["produced_batches"]
    wait_until(lambda: _status(buf).get("produced_batches", 0) >= made + 3, 30, "batches made after the reload")
    # one worker, 2000 batches to make: every plan from now on uses the one slot
    rec = wait_until(lambda: (s := _status(buf)) and s["blocked"] is None and s, 10, "the status to say it no longer waits")
    assert rec["ranks"]["0"]["ready"] < 2000 and rec["train_bytes"] < (1 << 30)  # still filling, not full
    wait_until(lambda: re.search(r"^prefetchd_blocked 0\.0$", scrape(), re.M), 10, "prefetchd_blocked 0")
    assert d.stop() == 0
