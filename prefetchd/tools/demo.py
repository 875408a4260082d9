"""``prefetchd demo``: the whole product on sample data, in under a minute.

Makes a small ImageFolder of photo-like JPEGs, writes a config, starts the real daemon
(``python -m prefetchd run``) in its own process group, trains two epochs through the client
(``for x, y in client`` with ``normalize=True``, as a DataLoader loop reads) with a progress bar
(tqdm's, on a terminal only), prints images/s and how long the trainer waited, stops the daemon
with SIGTERM and removes everything it made (unless ``--keep``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import yaml

from prefetchd.core.bars import bar
from prefetchd.core.words import plural
from prefetchd.tools.samples import make_image_folder


def _buffer_parent() -> str:
    # a RAM disk keeps the demo honest about what the daemon is for: the login session's own
    # ($XDG_RUNTIME_DIR, where a config without buffer.dir puts its ring), else /dev/shm, else /tmp
    for d in (os.environ.get("XDG_RUNTIME_DIR") or "", "/dev/shm"):
        if os.path.isabs(d) and os.path.isdir(d) and os.access(d, os.W_OK):
            return d
    return tempfile.gettempdir()


def write_config(path: str, data: str, buffer: str, cache: str, batch_size: int, epochs: int | None,
                 workers, capacity: int = 16, extra: dict | None = None) -> None:
    cfg = {
        "dataset": {"root": data, "cache_dir": cache},
        "loader": {"batch_size": batch_size, "seed": 0, "epochs": epochs},
        "workers": {"count": workers},
        "buffer": {"dir": buffer, "capacity": capacity, "max_bytes": "1GiB", "min_free_bytes": "64MiB"},
        "progress": {"poll_interval_s": 0.2},
    }
    for sec, body in (extra or {}).items():
        cfg.setdefault(sec, {}).update(body)
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(cfg, f, sort_keys=False)


_DAEMON_UP_TIMEOUT_S = 60.0


def _wait_for_lock(proc: subprocess.Popen, buffer: str) -> None:
    """Until the daemon started here holds its buffer (or has exited): a client made before that
    would warn that no daemon runs and tell the user to start one, which the demo is doing."""
    from prefetchd.format import status

    deadline = time.monotonic() + _DAEMON_UP_TIMEOUT_S
    while proc.poll() is None and time.monotonic() < deadline and status.daemon_alive(buffer) is not True:
        time.sleep(0.02)


def run_demo(images: int = 640, classes: int = 8, epochs: int = 2, batch_size: int = 32, workers="auto",
             keep: bool = False, quiet: bool = False) -> int:
    from prefetchd_client import PrefetchClient, PrefetchError

    work = tempfile.mkdtemp(prefix="prefetchd-demo-")
    buffer = tempfile.mkdtemp(prefix="prefetchd-demo-buffer-", dir=_buffer_parent())
    os.rmdir(buffer)  # the daemon creates it private
    data, cache, cfg_path, log_path = (os.path.join(work, n) for n in ("data", "cache", "demo.yaml", "daemon.log"))
    proc = None
    code = 1
    try:
        t0 = time.monotonic()
        per_class = max(1, images // classes)
        n = make_image_folder(data, classes=classes, per_class=per_class, seed=0)
        print(f"made {n} sample JPEGs in {plural(classes, 'class', 'classes')} in {time.monotonic() - t0:.1f} s ({data})")
        write_config(cfg_path, data, buffer, cache, batch_size, epochs,
                     workers if workers == "auto" else int(workers))
        with open(log_path, "wb") as logf:
            proc = subprocess.Popen([sys.executable, "-m", "prefetchd", "run", "--config", cfg_path],
                                    stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        print(f"daemon started (pid {proc.pid}), buffer {buffer}")
        _wait_for_lock(proc, buffer)
        seen = 0
        t_start = time.monotonic()
        # the DataLoader habits: one epoch per `for`, set_epoch, len(); normalize=True hands over
        # model-ready floats ((x/255 - mean)/std)
        with PrefetchClient(cfg_path, timeout=60, normalize=True) as client:
            total = len(client)
            for epoch in range(epochs):
                t_epoch = time.monotonic()
                client.set_epoch(epoch)
                with bar(client, quiet=quiet, total=total, desc=f"epoch {epoch}", unit="batch", leave=False) as batches:
                    for x, y in batches:
                        float(x.mean())  # the "training step": a reduction over the batch
                        seen += len(y)
                        rate = seen / max(time.monotonic() - t_start, 1e-9)
                        batches.set_postfix_str(f"{rate:,.0f} img/s, trainer waited {client.wait_s:.2f} s",
                                                refresh=False)
                print(f"  epoch {epoch}: {plural(total, 'batch', 'batches')} in {time.monotonic() - t_epoch:.1f} s")
            elapsed = time.monotonic() - t_start
            wait = client.wait_s
        print(f"done: {seen} images in {elapsed:.1f} s = {seen / elapsed:,.0f} img/s through the client; "
              f"the trainer waited {wait:.2f} s ({100 * wait / elapsed:.0f}% of the time; the first batches "
              f"include the daemon's start-up)")
        code = 0
    except PrefetchError as e:
        print(f"\ndemo failed: {e}", file=sys.stderr)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
    finally:
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    rc = proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    rc = proc.wait()
            else:
                rc = proc.returncode
            print(f"daemon stopped (exit status {rc})")
            if rc != 0 or code != 0:
                code = code or 1
                with open(log_path, errors="replace") as f:
                    print("daemon log (last lines):\n" + "".join(f.readlines()[-20:]), file=sys.stderr)
        if keep:
            print(f"kept: {work} and {buffer}")
        else:
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(buffer, ignore_errors=True)
    return code
