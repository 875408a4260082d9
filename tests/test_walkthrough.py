"""Issue 34: a newcomer's first hour, walked as they walk it; issue 46: the README's first screen run as
written (``test_the_readme_as_written``), and the CLI reference of docs/commands.md. A wheel built from this tree, a fresh
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
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
import yaml
from conftest import wait_until
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
    # --no-compile: what it installs is the README's; pip only skips compiling every module to bytecode
    # (most never imported here), which was a third of this test's CPU
    pip = [os.path.join(venv, "bin", "python"), "-m", "pip", "install", "-q", "--no-compile"]
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
        # docs/commands.md: status --json, the probes, node-config
        r = _sh([prefetchd, "status", "--config", train, "--json"], env=env, cwd=str(tmp_path))
        assert r.returncode == 0 and isinstance(json.loads(r.stdout), dict), r.stdout
        for probe in ("--ready", "--live"):
            r = _sh([prefetchd, "status", "--config", train, probe], env=env, cwd=str(tmp_path))
            assert r.returncode == 0, (probe, r.stdout + r.stderr)
        node = str(tmp_path / "node.yaml")
        r = _sh([prefetchd, "node-config", "--config", train, "--nodes", "1", "--node", "0", "--per-node", "1",
                 "--out", node], env=env, cwd=str(tmp_path))
        assert r.returncode == 0 and yaml.safe_load(open(node))["loader"]["world_size"] == 1, r.stdout + r.stderr
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
    r = _sh([prefetchd, "clean", "--config", train], env=env, cwd=str(tmp_path))  # the stopped daemon's ring
    buf = tmp_path / "buffer"
    assert r.returncode == 0 and not (buf.exists() and [n for n in os.listdir(buf) if n.endswith(".batch")]), \
        r.stdout + r.stderr

    t0 = time.monotonic()
    r = _sh([prefetchd, "bench", "--root", data, "--epochs", "1", "--batch-size", "6", "--workers", "2", "-q"],
            env=env, timeout=300, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "decode-only limit: skipped 2 files Pillow cannot decode" in r.stdout, r.stdout
    assert bad["truncated"] in r.stdout and bad["empty"] in r.stdout, r.stdout
    assert "x the decode-only limit of" in r.stdout and time.monotonic() - t0 < 300



def _readme_blocks() -> list[tuple[str, str]]:
    """The README's fenced blocks, in order: (language, text)."""
    text = open(os.path.join(ROOT, "README.md")).read()
    return re.findall(r"```(\w*)\n(.*?)```", text, re.S)


def shell_commands(block: str) -> list[str]:
    """The commands of a ``sh`` block: comment and blank lines dropped, ``\\`` continuations joined,
    a heredoc kept whole with the command that opens it. Trailing ``# comments`` stay (bash drops them)."""
    out: list[str] = []
    lines = block.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        while line.rstrip().endswith("\\") and i < len(lines):
            line = line.rstrip()[:-1] + " " + lines[i].strip()
            i += 1
        m = re.search(r"<<-?\s*'?(\w+)'?", line)
        if m:
            body = [line]
            while i < len(lines):
                body.append(lines[i])
                i += 1
                if body[-1].strip() == m.group(1):
                    break
            line = "\n".join(body)
        out.append(line)
    return out


def test_shell_commands_reads_blocks_as_bash_does():
    block = "# a comment\n\nprefetchd check --config t.yaml   # says\nprintf a \\\n    b > f\ncat > x <<EOF\nk: 1\nEOF\nls\n"
    assert shell_commands(block) == ["prefetchd check --config t.yaml   # says", "printf a  b > f",
                                     "cat > x <<EOF\nk: 1\nEOF", "ls"]


def _status_while_launched(cmd: str, status_cmd: str, bash, work, env) -> tuple[str, str, str]:
    """Run the README's launch line; while it trains, its status line until that sees the daemon.
    Returns launch's stdout and stderr and what status printed; launch must exit 0."""
    with open(work / "launch.out", "w") as o, open(work / "launch.err", "w") as e:
        launch = subprocess.Popen(["bash", "-c", cmd], cwd=str(work), env=env, stdout=o, stderr=e)
    try:
        def seen():
            if launch.poll() is not None:
                raise AssertionError("launch ended before status saw the daemon: " + open(work / "launch.err").read())
            r = bash(status_cmd, timeout=60)
            return r.stdout if r.returncode == 0 and "prefetchd pid" in r.stdout else None  # past "starting?"
        printed = wait_until(seen, 240, "status while train.py trains")
        assert launch.wait(600) == 0, open(work / "launch.out").read() + open(work / "launch.err").read()
    finally:
        if launch.poll() is None:
            launch.kill()
            launch.wait(30)
    return open(work / "launch.out").read(), open(work / "launch.err").read(), printed


def test_the_readme_as_written(fresh_venv, tmp_path, request):
    """The README's first screen, each command as written, on the CPU, by a user in a login session
    ($XDG_RUNTIME_DIR) whose images are in ~/my_images: the demo, the config, check, train.py under
    launch (status while it trains), and train.py again, resuming from its checkpoint. The install lines
    are the fixture's (torch's CPU build from the local wheels here, then the wheel with its torch extra)."""
    from prefetchd.tools.samples import make_image_folder

    bin_ = os.path.join(fresh_venv, "bin")
    home = tmp_path / "home"
    home.mkdir()
    run = pathlib.Path(tempfile.mkdtemp(prefix="run-user-", dir="/dev/shm"))  # a session's tmpfs, 0700 as logind's
    request.addfinalizer(lambda: shutil.rmtree(run, ignore_errors=True))
    make_image_folder(str(home / "my_images"), classes=4, per_class=24, seed=2, long_side=256)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "XDG_CACHE_HOME")}
    env.update(PATH=bin_ + os.pathsep + env.get("PATH", ""), HOME=str(home), USER="alice", XDG_RUNTIME_DIR=str(run))
    work = tmp_path / "work"
    work.mkdir()

    def bash(cmd: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return _sh(["bash", "-c", cmd], str(work), timeout=timeout, env=env)

    makefile = open(os.path.join(ROOT, "Makefile")).read()
    done: list[str] = []
    for lang, block in _readme_blocks():
        if lang == "python":
            assert block.startswith("# train.py\n"), block[:40]
            (work / "train.py").write_text(block)
            continue
        assert lang == "sh", lang
        for cmd in shell_commands(block):
            if cmd.startswith("pip install"):  # fresh_venv ran these, from the local wheels
                index = re.search(r"--index-url (\S+)", cmd)
                if index:  # the CPU line names the index the Makefile's set-up uses
                    assert f"TORCH_CPU_INDEX ?= {index.group(1)}" in makefile, cmd
                assert "pip install '.[torch]'" in cmd.split("#")[0], cmd
            elif cmd.startswith("prefetchd demo"):
                r = bash(cmd)
                assert r.returncode == 0 and "img/s through the client" in r.stdout, r.stdout + r.stderr
            elif cmd.startswith("cat > train.yaml"):
                assert bash(cmd).returncode == 0
                cfg = yaml.safe_load(open(work / "train.yaml"))
                assert len(cfg) == 4 and cfg["dataset"]["root"] == str(home / "my_images"), cfg
                assert cfg["buffer"]["dir"] == f"{run}/prefetchd-alice", cfg
            elif cmd.startswith("prefetchd check"):
                r = bash(cmd)
                assert r.returncode == 0 and "dataset: 96 samples, 4 classes" in r.stdout, r.stdout + r.stderr
                assert "warning:" not in r.stdout, r.stdout  # the README's choice draws no warning
            elif cmd.startswith("prefetchd launch"):
                status_cmd = next(c for lang2, b in _readme_blocks() if lang2 == "sh" for c in shell_commands(b)
                                  if c.startswith("prefetchd status"))
                out, err, seen = _status_while_launched(cmd, status_cmd, bash, work, env)
                assert "prefetchd pid" in seen, seen
                assert "epoch 0: loss" in out and "epoch 1: loss" in out, out + err
                assert "Traceback" not in err, err
                assert os.path.exists(work / "ckpt.pt") and not os.path.exists(f"{run}/prefetchd-alice"), \
                    "the checkpoint kept, the ring removed"
                r = bash(cmd, timeout=600)  # again: it resumes from ckpt.pt, after the last epoch
                assert r.returncode == 0 and "epoch" not in r.stdout, r.stdout + r.stderr
                done.append(status_cmd)
            elif cmd.startswith("prefetchd status"):
                assert cmd in done, "status is run while launch trains"
                r = bash(cmd)
                # after launch: its ring is gone, and status says no daemon runs there (exit 3), no traceback
                assert r.returncode == 3 and "the daemon has not run there" in r.stdout, r.stdout
            else:
                raise AssertionError(f"the README's command {cmd!r} is not run by this test")
            done.append(cmd)
    assert any(c.startswith("prefetchd launch") for c in done) and any(c.startswith("prefetchd demo") for c in done)
