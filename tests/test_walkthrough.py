"""Issue 34: a newcomer's first hour, walked as they walk it. A wheel built from this tree, a fresh
venv (no site packages) with the README's install lines (torch's CPU build first, then the wheel
with its ``torch`` extra), ``config.example.yaml`` with dataset.root and buffer.dir set, a small
dataset of one's own with a JPEG cut short, an empty file and a PNG named ``.JPEG``; then
``check``, ``run``, two epochs of the README's training loop, a stop and a resume (the batches
after the checkpoint are those of the straight run), ``status``, ``preview`` and ``bench --root``.
None of it may end in a traceback.

It takes a few minutes (most of them installing torch from the local CPU wheel); it is part of
``make test``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import yaml
from test_newcomer import make_bad_folder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the README's first install line names torch's CPU index; here the same CPU build comes from the local
# wheels, as the Makefile's TORCH_CPU installs it (override as for make)
TORCH_CPU = os.environ.get("TORCH_CPU", "torch==2.13.0")

# The README's training loop ("The trainer"), on the CPU: a tiny model, a checkpoint every 3 steps.
# --stop-at N: the run ends right after the checkpoint of step N (as a job killed there would
# have left it); --resume: starts from that checkpoint. Each batch's labels and an image digest
# are written to --log, by (epoch, batch).
TRAIN = r'''
import argparse, hashlib, json, sys
import torch
from prefetchd_client import PrefetchClient

a = argparse.ArgumentParser()
a.add_argument("config"); a.add_argument("--log"); a.add_argument("--ckpt")
a.add_argument("--stop-at", type=int); a.add_argument("--resume", action="store_true")
args = a.parse_args()
num_epochs = 2
model = torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(4), torch.nn.Flatten(), torch.nn.Linear(48, 3))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
criterion = torch.nn.CrossEntropyLoss()
seen, step = {}, 0
loader = PrefetchClient(args.config, normalize=True, timeout=120)  # rank from $RANK
if args.resume:
    ckpt = torch.load(args.ckpt, weights_only=False)
    model.load_state_dict(ckpt["model"])
    loader.load_state_dict(ckpt["loader"])                 # exactly where the checkpoint was
    step = ckpt["step"]
for epoch in range(loader.epoch, num_epochs):
    loader.set_epoch(epoch)
    for images, labels in loader:
        key = f"{loader.last_batch.epoch}/{loader.last_batch.batch}"
        seen[key] = [labels.tolist(), hashlib.sha256(images.numpy().tobytes()).hexdigest()]
        loss = criterion(model(images), labels)
        opt.zero_grad(); loss.backward(); opt.step()
        step += 1
        if step % 3 == 0:
            torch.save({"model": model.state_dict(), "loader": loader.state_dict(), "step": step}, args.ckpt)
            if step == args.stop_at:
                json.dump(seen, open(args.log, "w")); loader.close(); sys.exit(0)
loader.close()
json.dump(seen, open(args.log, "w"))
print(f"trained {step} steps")
'''


def _sh(cmd: list[str], cwd: str, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    """Run ``cmd`` in ``cwd`` (not this tree: ``python -c`` would import its copy); no traceback."""
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, **kw)
    assert "Traceback" not in r.stderr, f"{cmd}: {r.stderr}"
    return r


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory) -> str:
    """A venv with nothing in it but what the README's install lines put there, from a wheel of this tree."""
    work = tmp_path_factory.mktemp("walkthrough")
    src = work / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv", ".git", "build", "dist", "*.egg-info",
                                                           "__pycache__", ".pytest_cache", ".ruff_cache", ".whl"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "-q", "-w", str(work / "dist")],
                       cwd=src, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    wheel = next(str(p) for p in (work / "dist").iterdir() if p.name.endswith(".whl"))
    venv = str(work / "venv")
    r = subprocess.run([sys.executable, "-m", "venv", venv], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    pip = [os.path.join(venv, "bin", "python"), "-m", "pip", "install", "-q"]
    r = subprocess.run(pip + [TORCH_CPU], capture_output=True, text=True, timeout=600)  # the README: CPU build first
    assert r.returncode == 0, r.stderr
    r = subprocess.run(pip + [f"{wheel}[torch]"], capture_output=True, text=True, timeout=600)  # pip install '.[torch]'
    assert r.returncode == 0, r.stderr
    return venv


def test_a_newcomers_first_hour(fresh_venv, tmp_path):
    bin_ = os.path.join(fresh_venv, "bin")
    prefetchd, python = os.path.join(bin_, "prefetchd"), os.path.join(bin_, "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = bin_ + os.pathsep + env.get("PATH", "")
    r = _sh([python, "-c", "import prefetchd as p, prefetchd_client, torch; print(p.__file__, torch.__version__)"],
            env=env, cwd=str(tmp_path))
    assert r.returncode == 0 and r.stdout.startswith(fresh_venv), r.stdout + r.stderr  # not this tree's copy
    assert "+cpu" in r.stdout or "TORCH_CPU" in os.environ, r.stdout  # not the multi-GB CUDA build

    data = str(tmp_path / "mydata")
    bad = make_bad_folder(data)
    cfg = yaml.safe_load(open(os.path.join(ROOT, "config.example.yaml")))  # cp config.example.yaml train.yaml
    cfg["dataset"].update(root=data, cache_dir=str(tmp_path / "cache"))
    cfg["buffer"].update(dir=str(tmp_path / "buffer"), capacity=4, max_bytes="64MiB", min_free_bytes="1MiB")
    cfg["loader"]["batch_size"] = 6
    cfg["workers"]["count"] = 2
    cfg["augment"].update(output_size=32, scale_min=36, scale_max=48)
    train = str(tmp_path / "train.yaml")
    with open(train, "w") as f:
        yaml.safe_dump(cfg, f)

    r = _sh([prefetchd, "check", "--config", train], env=env, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "dataset: 27 samples, 3 classes" in r.stdout and "classes: 3 classes: n00000000, n00000001, " \
        "n00000002; smallest n00000000 (9 images), largest n00000000 (9 images)" in r.stdout, r.stdout

    log = open(tmp_path / "daemon.log", "wb")
    daemon = subprocess.Popen([prefetchd, "run", "--config", train], stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True, env=env, cwd=str(tmp_path))
    try:
        script = tmp_path / "train.py"
        script.write_text(TRAIN)
        ckpt = str(tmp_path / "ckpt.pt")

        def trainer(name: str, *extra: str) -> dict:
            out = str(tmp_path / f"{name}.json")
            r = _sh([python, str(script), train, "--log", out, "--ckpt", ckpt, *extra], str(tmp_path), env=env)
            assert r.returncode == 0, r.stdout + r.stderr
            return json.load(open(out))

        straight = trainer("straight")
        assert sorted(straight) == [f"{e}/{b}" for e in range(2) for b in range(4)], sorted(straight)
        first = trainer("first", "--stop-at", "3")
        assert sorted(first) == ["0/0", "0/1", "0/2"]
        rest = trainer("rest", "--resume")
        assert sorted(rest) == sorted(k for k in straight if k not in first), sorted(rest)
        assert {**first, **rest} == straight  # the resume went on where the checkpoint was, byte for byte

        r = _sh([prefetchd, "status", "--config", train], env=env, cwd=str(tmp_path))
        assert r.returncode == 0 and "prefetchd pid" in r.stdout and "quarantined samples" in r.stdout, r.stdout
        grid = str(tmp_path / "grid.png")
        r = _sh([prefetchd, "preview", "--config", train, "--out", grid], env=env, cwd=str(tmp_path))
        assert r.returncode == 0 and os.path.getsize(grid) > 0, r.stdout + r.stderr
    finally:
        daemon.terminate()
        assert daemon.wait(60) == 0, open(tmp_path / "daemon.log").read()
        log.close()
    assert "Traceback" not in open(tmp_path / "daemon.log").read()
    r = _sh([prefetchd, "status", "--config", train], env=env, cwd=str(tmp_path))
    assert r.returncode == 3 and "not running" in r.stdout and "next worker starts" not in r.stdout, r.stdout

    t0 = time.monotonic()
    r = _sh([prefetchd, "bench", "--root", data, "--epochs", "1", "--batch-size", "6", "--workers", "2", "-q"],
            env=env, timeout=300, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "decode-only limit: skipped 2 files Pillow cannot decode" in r.stdout, r.stdout
    assert bad["truncated"] in r.stdout and bad["empty"] in r.stdout, r.stdout
    assert "x the decode-only limit of" in r.stdout and time.monotonic() - t0 < 300
