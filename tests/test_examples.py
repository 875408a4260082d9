"""The examples/ scripts, run as a user runs them, for a few steps on CPU against the real daemon:
the ImageNet script alone and under torchrun with two ranks (with a checkpoint and resume whose
batches equal a straight run's), and the Lightning DataModule."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import small_config

from prefetchd.format import batchfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMAGENET = os.path.join(REPO, "examples", "imagenet", "train.py")
LIGHTNING = os.path.join(REPO, "examples", "lightning", "train.py")
_RUN_TIMEOUT_S = 300
# one thread per process: two ranks and the daemon's workers share two cores
_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _run(cmd: list[str], cwd: str) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, cwd=cwd, env=_ENV, capture_output=True, text=True, timeout=_RUN_TIMEOUT_S)
    if r.returncode != 0:
        log = os.path.join(cwd, f"failed-{os.getpid()}-{len(os.listdir(cwd))}.log")
        with open(log, "w") as f:
            f.write(f"{cmd}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}")
        raise AssertionError(f"{cmd} exited {r.returncode} (whole output in {log}):\n{r.stdout[-3000:]}\n"
                             f"{r.stderr[-6000:]}")
    return r


def _torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]


def _digests(path: str) -> dict[int, list[tuple[int, int, str]]]:
    by_rank: dict[int, list] = {}
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            by_rank.setdefault(rec["rank"], []).append((rec["epoch"], rec["step"], rec["digest"]))
    return by_rank


def _stream(tmp_path, name: str, root: str, **sections) -> str:
    """Its own config, buffer and cache: one daemon per run, making the same stream."""
    d = tmp_path / name
    d.mkdir()
    return small_config(d, root, **sections)


def test_imagenet_example_trains_a_few_steps_on_cpu(tmp_path, image_root, daemon_factory):
    cfg = _stream(tmp_path, "one", image_root, loader={"epochs": 1})
    daemon = daemon_factory(cfg)
    ckpt = tmp_path / "ckpt.pt"
    r = _run([sys.executable, IMAGENET, cfg, "--arch", "tiny", "--epochs", "1", "--max-steps", "3",
              "--print-freq", "1", "--checkpoint", str(ckpt)], cwd=str(tmp_path))
    assert "tiny for 4 classes on cpu, world size 1, batch 6 per rank, 8 steps per epoch" in r.stdout
    assert r.stdout.count("Epoch: [0][") == 3, r.stdout
    saved = torch.load(ckpt, weights_only=True)
    assert saved["epoch"] == 0 and saved["steps"] == 3 and saved["world_size"] == 1
    assert saved["loader"][0]["epoch"] == 0 and saved["loader"][0]["batch"] == 3
    assert daemon.stop() == 0


# the daemon's half of --recipe randaugment, without torchvision (which does not import beside this
# venv's torch): a random crop and flip in numpy, uint8 CHW out, as recipes.randaugment ends
_RECIPE = """
import random

import numpy as np


def make(size=64):
    def crop_flip(im):
        a = np.asarray(im)
        h, w = a.shape[:2]
        y, x = random.randrange(h - size + 1), random.randrange(w - size + 1)
        a = a[y:y + size, x:x + size]
        return np.ascontiguousarray((a[:, ::-1] if random.random() < 0.5 else a).transpose(2, 0, 1))
    return crop_flip
"""


def test_imagenet_example_recipe_randaugment_mixes_batches_of_a_daemon_transform(tmp_path, image_root,
                                                                                  daemon_factory):
    plain = _stream(tmp_path, "plain", image_root, loader={"epochs": 1})
    r = subprocess.run([sys.executable, IMAGENET, plain, "--arch", "tiny", "--recipe", "randaugment"], cwd=str(tmp_path),
                       env=_ENV, capture_output=True, text=True, timeout=_RUN_TIMEOUT_S)
    assert r.returncode != 0 and "--recipe randaugment runs RandAugment in the daemon: set augment.transform" in r.stderr
    (tmp_path / "ex_recipe.py").write_text(_RECIPE)
    cfg = _stream(tmp_path, "recipe", image_root, loader={"epochs": 1},
                  augment={"transform": "ex_recipe:make", "transform_path": str(tmp_path)})
    daemon = daemon_factory(cfg)
    r = _run([sys.executable, IMAGENET, cfg, "--arch", "tiny", "--epochs", "1", "--max-steps", "3", "--print-freq", "1",
              "--recipe", "randaugment", "--checkpoint", str(tmp_path / "ckpt.pt")], cwd=str(tmp_path))
    assert "=> recipe randaugment: ex_recipe:make in the daemon, mixup/CutMix in plain torch" in r.stdout, r.stdout
    assert r.stdout.count("Epoch: [0][") == 3 and "loss nan" not in r.stdout, r.stdout
    assert daemon.stop() == 0


def test_the_recipes_mixup_and_cutmix_keep_shapes_and_soft_targets_that_sum_to_one():
    sys.path.insert(0, os.path.dirname(IMAGENET))
    try:
        import recipes
    finally:
        sys.path.remove(os.path.dirname(IMAGENET))
    torch.manual_seed(0)
    x = torch.rand(6, 3, 16, 16)
    y = torch.tensor([0, 1, 2, 3, 0, 1])
    kinds = set()
    for _ in range(20):
        mx, my = recipes.mix_batch(x, y, 4)
        assert mx.shape == x.shape and my.shape == (6, 4) and torch.allclose(my.sum(1), torch.ones(6))
        mixed = ~torch.isclose(mx, x)
        kinds.add("cutmix" if mixed.any() and torch.equal(mx[mixed], x.roll(1, 0)[mixed]) else "mixup")
        lam = my[0, 0].item()  # sample 0 is class 0 mixed with sample 5 (class 1): lam is sample 0's share
        assert 0.0 <= lam <= 1.0 and abs(my[0, 1].item() - (1 - lam)) < 1e-6
    assert kinds == {"cutmix", "mixup"}


def test_imagenet_example_validates_each_epoch_under_torchrun(tmp_path, image_root, val_image_root, daemon_factory):
    # a held-out set of the train set's class folders: 48 samples over 2 ranks in
    # batches of 5, so each rank's last val batch is partial; the sums count each sample once.
    # buffer.max_bytes is 1.5 train windows (6 batches of 6 x 64 x 64): less than the two ranks'
    # windows (2 x capacity 4), so train fills it and each validation pass lives on the room
    # train gives back while it is read (issue 23)
    window = 4 * batchfile.max_file_size(6, 64, 64)
    cfg = _stream(tmp_path, "val", image_root, loader={"epochs": 2, "world_size": 2, "ranks": [0, 1]},
                  buffer={"max_bytes": window * 3 // 2},
                  validation={"enabled": True, "root": val_image_root, "batch_size": 5})
    daemon = daemon_factory(cfg)
    r = _run(_torchrun(2) + [IMAGENET, cfg, "--arch", "tiny", "--epochs", "2", "--val", "--checkpoint",
                             str(tmp_path / "val.pt")], cwd=str(tmp_path))
    assert r.stdout.count(" * validation: 48 samples") == 2, r.stdout  # after each epoch
    assert daemon.stop() == 0


def test_imagenet_example_under_torchrun_resumes_with_the_straight_runs_batches(tmp_path, image_root,
                                                                               daemon_factory):
    # 48 images, 2 ranks, batches of 6: 4 steps per epoch and rank; 2 epochs. The stopped run ends
    # mid-epoch 0 at step 3, so the resumed run starts inside an epoch and crosses into the next.
    loader = {"epochs": 2, "world_size": 2, "ranks": [0, 1]}
    common = ["--arch", "tiny", "--epochs", "2", "--print-freq", "1"]

    straight_cfg = _stream(tmp_path, "straight", image_root, loader=loader)
    d1 = daemon_factory(straight_cfg)
    straight_log = tmp_path / "straight.jsonl"
    _run(_torchrun(2) + [IMAGENET, straight_cfg, *common, "--checkpoint", str(tmp_path / "straight.pt"),
                         "--log-batches", str(straight_log)], cwd=str(tmp_path))
    assert d1.stop() == 0

    resumed_cfg = _stream(tmp_path, "resumed", image_root, loader=loader)
    d2 = daemon_factory(resumed_cfg)
    resumed_log = tmp_path / "resumed.jsonl"
    ckpt = tmp_path / "resumed.pt"
    _run(_torchrun(2) + [IMAGENET, resumed_cfg, *common, "--checkpoint", str(ckpt), "--max-steps", "3",
                         "--log-batches", str(resumed_log)], cwd=str(tmp_path))
    stopped = torch.load(ckpt, weights_only=True)
    assert [s["rank"] for s in stopped["loader"]] == [0]  # rank 0's state, which every rank loads
    assert all((s["epoch"], s["batch"]) == (0, 3) for s in stopped["loader"])
    r = _run(_torchrun(2) + [IMAGENET, resumed_cfg, *common, "--checkpoint", str(ckpt), "--resume", str(ckpt),
                             "--log-batches", str(resumed_log)], cwd=str(tmp_path))
    assert "resumed from" in r.stdout
    assert d2.stop() == 0

    straight, resumed = _digests(str(straight_log)), _digests(str(resumed_log))
    assert sorted(straight) == [0, 1]
    assert [len(straight[r]) for r in (0, 1)] == [8, 8]
    assert straight[0] != straight[1]  # each rank has its own share of the stream
    for rank in (0, 1):
        assert resumed[rank] == straight[rank], f"rank {rank}: resumed batches differ from the straight run's"
    # and the model ends where the straight run's ended (same batches, same steps, same arithmetic)
    a = torch.load(tmp_path / "straight.pt", weights_only=True)["model"]
    b = torch.load(ckpt, weights_only=True)["model"]
    for k in a:
        assert torch.allclose(a[k].float(), b[k].float(), rtol=1e-4, atol=1e-5), k


def test_lightning_datamodule_trains_a_few_steps_on_cpu(tmp_path, image_root, daemon_factory):
    pytest.importorskip("lightning", reason="the dev extra installs lightning")
    cfg = _stream(tmp_path, "lightning", image_root, loader={"epochs": 2})
    daemon = daemon_factory(cfg)
    # 8 batches per epoch: 10 steps finish epoch 0 and go into epoch 1 (the loader moves on by itself)
    r = _run([sys.executable, LIGHTNING, cfg, "--max-steps", "10", "--accelerator", "cpu", "--devices", "1",
              "--default-root-dir", str(tmp_path / "lightning")], cwd=str(tmp_path))
    assert "trained 10 steps; the loader stopped at epoch 1 batch 2" in r.stdout, r.stdout + r.stderr[-2000:]
    assert daemon.stop() == 0


def test_lightning_ddp_validates_on_the_validation_stream(tmp_path, image_root, val_image_root, daemon_factory):
    pytest.importorskip("lightning", reason="the dev extra installs lightning")
    # 2 ranks, a held-out set of 48 in batches of 5: each rank's last val batch is
    # partial; Lightning's sanity check reads 2 batches and abandons its pass, then one full pass
    cfg = _stream(tmp_path, "lval", image_root, loader={"epochs": 1, "world_size": 2, "ranks": [0, 1]},
                  validation={"enabled": True, "root": val_image_root, "batch_size": 5})
    daemon = daemon_factory(cfg)
    r = _run([sys.executable, LIGHTNING, cfg, "--max-epochs", "1", "--accelerator", "cpu", "--devices", "2",
              "--strategy", "ddp", "--default-root-dir", str(tmp_path / "lval-root")], cwd=str(tmp_path))
    assert r.stdout.count("validation: 48 samples") == 1, r.stdout + r.stderr[-3000:]
    assert daemon.stop() == 0


def test_lightning_ddp_resume_sees_the_straight_runs_batches(tmp_path, image_root, daemon_factory):
    pytest.importorskip("lightning", reason="the dev extra installs lightning")
    # 2 ranks on CPU (gloo), 4 steps per epoch and rank: a checkpoint at step 2 (mid-epoch 0),
    # resumed to step 6 (into epoch 1), against a straight run to step 6
    loader = {"epochs": 2, "world_size": 2, "ranks": [0, 1]}
    common = ["--max-epochs", "2", "--accelerator", "cpu", "--devices", "2", "--strategy", "ddp"]

    straight_cfg = _stream(tmp_path, "straight", image_root, loader=loader)
    d1 = daemon_factory(straight_cfg)
    _run([sys.executable, LIGHTNING, straight_cfg, *common, "--max-steps", "6", "--default-root-dir",
          str(tmp_path / "l-straight"), "--log-batches", str(tmp_path / "straight.jsonl")], cwd=str(tmp_path))
    assert d1.stop() == 0

    cfg = _stream(tmp_path, "resumed", image_root, loader=loader)
    d2 = daemon_factory(cfg)
    _run([sys.executable, LIGHTNING, cfg, *common, "--max-steps", "3", "--save-every-n-steps", "2",
          "--default-root-dir", str(tmp_path / "l-stopped"), "--log-batches", str(tmp_path / "stopped.jsonl")],
         cwd=str(tmp_path))
    ckpt = tmp_path / "l-stopped" / "checkpoints" / "step=2.ckpt"
    r = _run([sys.executable, LIGHTNING, cfg, *common, "--max-steps", "6", "--ckpt-path", str(ckpt),
              "--default-root-dir", str(tmp_path / "l-resumed"), "--log-batches", str(tmp_path / "resumed.jsonl")],
             cwd=str(tmp_path))
    assert "trained 6 steps; the loader stopped at epoch 1 batch 2" in r.stdout, r.stdout
    assert d2.stop() == 0

    straight = _digests(str(tmp_path / "straight.jsonl"))
    stopped = _digests(str(tmp_path / "stopped.jsonl"))
    resumed = _digests(str(tmp_path / "resumed.jsonl"))
    assert sorted(straight) == [0, 1] and [len(straight[r]) for r in (0, 1)] == [6, 6]
    assert straight[0] != straight[1]
    for rank in (0, 1):
        assert stopped[rank][:2] + resumed[rank] == straight[rank], f"rank {rank}"
    a = torch.load(next((tmp_path / "l-straight" / "checkpoints").glob("*.ckpt")), weights_only=False)["state_dict"]
    b = torch.load(next((tmp_path / "l-resumed" / "checkpoints").glob("*.ckpt")), weights_only=False)["state_dict"]
    for k in a:
        assert torch.allclose(a[k].float(), b[k].float(), rtol=1e-4, atol=1e-5), k


def test_imagenet_example_resumes_a_two_rank_checkpoint_on_three_ranks(tmp_path, image_root, daemon_factory):
    # 48 images. Two ranks, batches of 6, stopped after 2 steps: 24 samples of epoch 0 read. The
    # job goes on with three ranks and batches of 4 (the config says so): the other 24 samples of
    # epoch 0 (2 steps of 3 x 4), then epoch 1 whole at world size 3 (4 steps).
    buffer = {"dir": str(tmp_path / "buffer")}
    two = _stream(tmp_path, "two", image_root, loader={"epochs": 2, "world_size": 2, "ranks": [0, 1]}, buffer=buffer)
    three = _stream(tmp_path, "three", image_root, loader={"epochs": 2, "world_size": 3, "ranks": [0, 1, 2],
                                                           "batch_size": 4}, buffer=buffer)
    common = ["--arch", "tiny", "--epochs", "2", "--print-freq", "1"]
    ckpt, log = tmp_path / "ckpt.pt", tmp_path / "batches.jsonl"

    d1 = daemon_factory(two)
    _run(_torchrun(2) + [IMAGENET, two, *common, "--checkpoint", str(ckpt), "--max-steps", "2",
                         "--log-batches", str(log)], cwd=str(tmp_path))
    assert d1.stop() == 0
    assert all((s["epoch"], s["batch"], s["world_size"]) == (0, 2, 2) for s in torch.load(ckpt, weights_only=True)["loader"])

    d2 = daemon_factory(three)
    r = _run(_torchrun(3) + [IMAGENET, three, *common, "--checkpoint", str(ckpt), "--resume", str(ckpt),
                             "--log-batches", str(log)], cwd=str(tmp_path))
    assert "resumed from" in r.stdout and "(saved by 2 ranks, continued on 3)" in r.stdout, r.stdout
    assert r.stderr.count("resuming epoch 0 at sample 24 of 48 with world size 3 (saved at 2)") == 3, r.stderr
    assert d2.stop() == 0

    recs = [json.loads(line) for line in open(log)]
    first, rest = recs[:4], recs[4:]
    assert sorted((x["rank"], len(x["indices"])) for x in first) == [(0, 6), (0, 6), (1, 6), (1, 6)]
    assert sorted(x["rank"] for x in rest if x["epoch"] == 0) == [0, 0, 1, 1, 2, 2]
    assert sorted(x["rank"] for x in rest if x["epoch"] == 1) == [r for r in (0, 1, 2) for _ in range(4)]
    epoch0 = [i for x in first + rest if x["epoch"] == 0 for i in x["indices"]]
    assert sorted(epoch0) == list(range(48))  # every sample of epoch 0 once, none twice, across both jobs
    epoch1 = [i for x in rest if x["epoch"] == 1 for i in x["indices"]]
    assert sorted(epoch1) == list(range(48))  # then a whole epoch at the new world size
    assert torch.load(ckpt, weights_only=True)["steps"] == 2 + 2 + 4


@pytest.mark.parametrize("devices, batch", [(3, 4), (1, 6)], ids=["grow-2-to-3", "shrink-2-to-1"])
def test_lightning_resumes_a_two_rank_checkpoint_on_another_number_of_devices(tmp_path, image_root, daemon_factory,
                                                                              devices, batch):
    pytest.importorskip("lightning", reason="the dev extra installs lightning")
    # two ranks x batches of 6, a checkpoint after 2 steps: 24 samples of epoch 0 read; the job goes
    # on with `devices` ranks (the config says so), every rank loading rank 0's state (the rule)
    two = _stream(tmp_path, "two", image_root, loader={"epochs": 1, "world_size": 2, "ranks": [0, 1]})
    other = _stream(tmp_path, "other", image_root, loader={"epochs": 1, "world_size": devices,
                                                           "ranks": list(range(devices)), "batch_size": batch})
    log = tmp_path / "batches.jsonl"
    ddp = ["--accelerator", "cpu", "--max-epochs", "1"]
    d1 = daemon_factory(two)
    _run([sys.executable, LIGHTNING, two, *ddp, "--devices", "2", "--strategy", "ddp", "--max-steps", "3",
          "--save-every-n-steps", "2", "--default-root-dir", str(tmp_path / "l-two"), "--log-batches", str(log)],
         cwd=str(tmp_path))
    assert d1.stop() == 0
    first = [json.loads(line) for line in open(log) if json.loads(line)["step"] < 2]
    log.unlink()
    d2 = daemon_factory(other)
    r = _run([sys.executable, LIGHTNING, other, *ddp, "--devices", str(devices),
              *(["--strategy", "ddp"] if devices > 1 else []),
              "--ckpt-path", str(tmp_path / "l-two" / "checkpoints" / "step=2.ckpt"),
              "--default-root-dir", str(tmp_path / "l-other"), "--log-batches", str(log)], cwd=str(tmp_path))
    assert d2.stop() == 0
    assert "the loader stopped at epoch 1 batch 0" in r.stdout, r.stdout
    rest = [json.loads(line) for line in open(log)]
    assert sorted({x["rank"] for x in rest}) == list(range(devices))
    epoch0 = [i for x in first + rest for i in x["indices"]]
    assert sorted(epoch0) == list(range(48))  # every sample of epoch 0 once across both jobs


def test_imagenet_example_stopped_on_an_epochs_last_batch_resumes_with_the_next_epoch(tmp_path, image_root,
                                                                                      daemon_factory):
    # one rank, 8 steps per epoch: --max-steps 8 stops on epoch 0's last batch. The epoch is done
    # (its scheduler step taken, the checkpoint says epoch 1): the resumed run reads epoch 1 only
    cfg = _stream(tmp_path, "one", image_root, loader={"epochs": 2})
    ckpt, log = tmp_path / "ckpt.pt", tmp_path / "batches.jsonl"
    common = [IMAGENET, cfg, "--arch", "tiny", "--epochs", "2", "--checkpoint", str(ckpt), "--log-batches", str(log)]
    d = daemon_factory(cfg)
    _run([sys.executable, *common, "--max-steps", "8"], cwd=str(tmp_path))
    saved = torch.load(ckpt, weights_only=True)
    assert (saved["epoch"], saved["loader"][0]["epoch"], saved["loader"][0]["batch"]) == (1, 1, 0)
    assert saved["scheduler"]["last_epoch"] == 1
    r = _run([sys.executable, *common, "--resume", str(ckpt)], cwd=str(tmp_path))
    assert d.stop() == 0
    assert "resumed from" in r.stdout and "at epoch 1" in r.stdout, r.stdout
    recs = [json.loads(line) for line in open(log)]
    assert [x["epoch"] for x in recs] == [0] * 8 + [1] * 8  # epoch 0 not replayed
    assert torch.load(ckpt, weights_only=True)["steps"] == 16


def test_imagenet_example_resumes_a_two_rank_checkpoint_on_one_rank(tmp_path, image_root, daemon_factory):
    # two ranks x batches of 6 stopped after 2 steps (24 samples of epoch 0); one rank goes on with
    # rank 0's state: the other 24 samples (4 steps of 6), then epoch 1 whole (8 steps)
    buffer = {"dir": str(tmp_path / "buffer")}
    two = _stream(tmp_path, "two", image_root, loader={"epochs": 2, "world_size": 2, "ranks": [0, 1]}, buffer=buffer)
    one = _stream(tmp_path, "one", image_root, loader={"epochs": 2}, buffer=buffer)
    common = ["--arch", "tiny", "--epochs", "2"]
    ckpt, log = tmp_path / "ckpt.pt", tmp_path / "batches.jsonl"
    d1 = daemon_factory(two)
    _run(_torchrun(2) + [IMAGENET, two, *common, "--checkpoint", str(ckpt), "--max-steps", "2",
                         "--log-batches", str(log)], cwd=str(tmp_path))
    assert d1.stop() == 0
    d2 = daemon_factory(one)
    r = _run([sys.executable, IMAGENET, one, *common, "--checkpoint", str(ckpt), "--resume", str(ckpt),
              "--log-batches", str(log)], cwd=str(tmp_path))
    assert d2.stop() == 0
    assert "(saved by 2 ranks, continued on 1)" in r.stdout, r.stdout
    recs = [json.loads(line) for line in open(log)]
    assert sorted(i for x in recs if x["epoch"] == 0 for i in x["indices"]) == list(range(48))
    assert sorted(i for x in recs if x["epoch"] == 1 for i in x["indices"]) == list(range(48))
    assert [x["epoch"] for x in recs[4:]] == [0] * 4 + [1] * 8
