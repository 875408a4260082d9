"""Several views of one sample with the real daemon: a user transform returning a tuple and the
built-in ``augment.views`` give the same bytes whatever the workers and a restart mid-epoch; the
client yields ``(view_0, ..., view_k-1, labels)`` as numpy, CPU tensors, pinned and device
tensors (normalised each); a multi-crop stream trains a small model."""

from __future__ import annotations

import os
import textwrap

import numpy as np
import pytest
from conftest import small_config, wait_until
from prefetchd_client import PrefetchClient

from prefetchd.core.config import load as load_config
from prefetchd.core.sampler import Sampler
from prefetchd.executors.worker import BatchMaker, WorkerSetup
from prefetchd.format import batchfile, status
from prefetchd.sources.dataset import load_index

# 2 x 64 + 6 x 32: DINO's multi-crop (2 x 224 + 6 x 96) at a size the tests make quickly
# (with DINO's per-view ops, hue and jitter probability, a timm RandAugment on the global views and
# TrivialAugmentWide with per-pixel random erasing on the local ones: each a draw of its own)
VIEWS = [{"count": 2, "output_size": 64, "rrc_scale": [0.4, 1.0], "brightness": 0.4, "hue": 0.1, "jitter_p": 0.8,
          "ops": {"grayscale": 0.2, "blur": 0.5, "solarize": 0.2}, "policy": "rand-m9-mstd0.5-inc1"},
         {"count": 6, "output_size": 32, "rrc_scale": [0.05, 0.4], "saturation": 0.3, "ops": {"grayscale": 0.2},
          "policy": "trivialaugment", "random_erasing": {"p": 0.5, "mode": "pixel", "count": [1, 2]}}]
SHAPES = [(64, 64)] * 2 + [(32, 32)] * 6

# a trainer's own two-crop transform (SimCLR's pair, a global and a local crop each), numpy and PIL
# only: random.random and numpy's global generator, as torchvision's transforms draw
PAIR = textwrap.dedent('''
    import random

    import numpy as np
    from PIL import Image


    def make(big=48, small=24):
        def views(im):
            out = []
            w, h = im.size
            for k, size in enumerate((big, big, small)):
                side = int(min(w, h) * (0.3 + 0.7 * random.random()))
                x, y = int(random.random() * (w - side + 1)), int(random.random() * (h - side + 1))
                a = np.asarray(im.crop((x, y, x + side, y + side)).resize((size, size), Image.BILINEAR))
                if np.random.random() < 0.5:
                    a = a[:, ::-1]
                out.append(np.ascontiguousarray(a.transpose(2, 0, 1)) if k == 1 else a)  # CHW and HWC alike
            return tuple(out)
        return views
''')
PAIR_SHAPES = [(48, 48), (48, 48), (24, 24)]


def _transform(tmp_path, name: str) -> dict:
    d = tmp_path / "usermods"
    d.mkdir(exist_ok=True)
    (d / f"{name}.py").write_text(PAIR)
    return {"augment": {"output_size": 48, "transform": f"{name}:make", "transform_path": str(d)}}


def _views() -> dict:
    return {"augment": {"views": VIEWS}}


def reference(cfg_path: str, epochs: int = 2) -> dict:
    """Every batch made in-process, one sample after another: each view's [n, h, w, 3] and the labels."""
    cfg = load_config(cfg_path)
    index, _ = load_index(cfg.dataset.root, None, cfg.dataset.extensions, cfg.dataset.cache_dir)
    L = cfg.loader
    sampler = Sampler(len(index), L.batch_size, L.seed, L.shuffle, L.drop_last, L.world_size)
    maker = BatchMaker(WorkerSetup(cfg, index.files_dir, None, 0, cfg.buffer.dir))
    out = {}
    for e in range(epochs):
        for b in range(sampler.batches_per_epoch):
            images, _, labels, _, _ = maker.fill(e, sampler.batch_indices(e, 0, b))
            out[(0, e, b)] = tuple(v.copy() for v in images) + (labels.copy(),)
    return out


def _hwc(batch) -> tuple:
    *vs, y = batch
    return tuple(np.ascontiguousarray(v.transpose(0, 2, 3, 1)) for v in vs) + (np.asarray(y).copy(),)


def _same(got: dict, ref: dict) -> None:
    assert sorted(got) == sorted(ref)
    for key in ref:
        assert len(got[key]) == len(ref[key]), key
        for g, r in zip(got[key], ref[key], strict=True):
            assert np.array_equal(g, r), key


def _read(cfg: str, epochs, state=None, stop_after=None) -> tuple[dict, dict | None]:
    got = {}
    with PrefetchClient(cfg, rank=0, timeout=60, as_numpy=True) as c:
        if state is not None:
            c.load_state_dict(state)
        for e in epochs:
            for b, batch in enumerate(c.iter_epoch(e), start=c.batch if e == c.epoch else 0):
                got[(0, e, b)] = _hwc(batch)
                if stop_after is not None and b == stop_after:
                    return got, c.state_dict()
    return got, None


@pytest.mark.parametrize("kind", ["transform", "views"])
def test_views_are_bit_identical_with_one_and_two_workers_and_across_a_restart_mid_epoch(
        tmp_path, image_root, daemon_factory, kind):
    runs = []
    for workers in (1, 2):
        run = tmp_path / f"w{workers}"
        run.mkdir()
        sections = _transform(tmp_path, f"uv_pair_{workers}") if kind == "transform" else _views()
        cfg = small_config(run, image_root, workers={"count": workers}, **sections)
        d = daemon_factory(cfg)
        if workers == 1:
            got, _ = _read(cfg, (0, 1))
            assert d.stop() == 0
        else:  # stopped after batch 2 of epoch 0, a new daemon, the rest from the loader's state
            got, state = _read(cfg, (0,), stop_after=2)
            assert d.stop() == 0
            d = daemon_factory(cfg)
            buf = load_config(cfg).buffer.dir
            wait_until(lambda: status.daemon_alive(buf), 60, "the second daemon")  # noqa: B023 - called here
            rest, _ = _read(cfg, (0, 1), state=state)
            got.update(rest)
            assert d.stop() == 0
        log = d.log()
        assert "Traceback" not in log
        if kind == "transform":
            assert "3 views (48x48, 48x48, 24x24) uint8" in log
        runs.append(got)
        want = PAIR_SHAPES if kind == "transform" else SHAPES
        assert [v.shape[1:3] for v in got[(0, 0, 0)][:-1]] == want
    _same(runs[0], runs[1])
    ref = reference(cfg)
    _same(runs[1], ref)
    # the views are drawn apart, and again each epoch
    first = ref[(0, 0, 0)]
    assert not np.array_equal(first[0], first[1]) and not np.array_equal(first[0], ref[(0, 1, 0)][0])


def test_the_client_yields_each_view_as_numpy_cpu_pinned_and_device_tensors(tmp_path, image_root, daemon_factory):
    torch = pytest.importorskip("torch")
    from prefetchd_client import _normalize_numpy
    from test_client_memory import DeferredCopies, EagerCopies

    cfg = small_config(tmp_path, image_root, loader={"epochs": 4}, **_views())
    d = daemon_factory(cfg)
    ref = reference(cfg, epochs=4)

    def check(e, kw, convert, transfer=None):
        with PrefetchClient(cfg, rank=0, timeout=60, transfer=transfer, **kw) as c:
            assert c.meta()["views"] == [list(s) for s in SHAPES]
            n = 0
            for b, batch in enumerate(c.iter_epoch(e)):
                assert len(batch) == 9, f"{kw}: {len(batch)} items, not 8 views and the labels"
                want = ref[(0, e, b)]
                for v, (got, w) in enumerate(zip(batch[:-1], want[:-1], strict=True)):
                    assert tuple(got.shape) == (len(w), 3) + SHAPES[v], (kw, v)
                    assert np.allclose(convert(got), w.transpose(0, 3, 1, 2), atol=1e-5), (kw, e, b, v)
                assert np.array_equal(np.asarray(batch[-1]), want[-1])
                if transfer is not None:  # the trainer's stream waited for every view and the labels
                    assert len(transfer.waited[-1]) == 9 and all(x is y for x, y in zip(transfer.waited[-1], batch,
                                                                                       strict=True))
                n += 1
            assert n == c.batches_per_epoch and n > 0

    check(0, {"as_numpy": True}, np.asarray)
    check(1, {}, lambda t: t.numpy())  # CPU tensors
    check(2, {"device": "cpu", "pin_memory": True}, lambda t: t.numpy(), DeferredCopies(seed=1))  # pinned pool + copies
    def inv(t):  # normalised back to uint8 levels
        return (t.numpy() * np.array([0.229, 0.224, 0.225]).reshape(1, 3, 1, 1) * 255
                + np.array([0.485, 0.456, 0.406]).reshape(1, 3, 1, 1) * 255)

    check(3, {"device": "cpu", "pin_memory": True, "normalize": True}, lambda t: np.rint(inv(t)), EagerCopies())
    with PrefetchClient(cfg, rank=0, timeout=60, as_numpy=True, normalize=True) as c:  # numpy, normalised per view
        batch = next(iter(c.iter_epoch(3)))
        assert batch[0].dtype == np.float32
        assert np.allclose(batch[7], _normalize_numpy(ref[(0, 3, 0)][7].transpose(0, 3, 1, 2)), atol=1e-5)
    assert torch is not None and d.stop() == 0


def test_a_single_view_stream_still_yields_images_and_labels(tmp_path, image_root, daemon_factory):
    cfg = small_config(tmp_path, image_root, loader={"epochs": 1})
    d = daemon_factory(cfg)
    buf = load_config(cfg).buffer.dir
    with PrefetchClient(cfg, rank=0, timeout=60, as_numpy=True) as c:
        batch = next(iter(c))
        # a batch this trainer has not consumed stays while it stays here (one it has could be
        # evicted between listing and opening it): its file is version 1, a single-view file
        ahead = wait_until(lambda: sorted(n for n in os.listdir(buf) if n.endswith(".batch")
                                          and not n.endswith("-b00000000.batch")), 30, "batch 1's file")
        with open(os.path.join(buf, ahead[0]), "rb") as f:
            assert int.from_bytes(f.read(10)[8:10], "little") == batchfile.VERSION
    assert len(batch) == 2 and batch[0].shape == (6, 3, 64, 64)
    assert d.stop() == 0


def test_a_multi_crop_stream_trains_a_small_model_on_the_cpu(tmp_path, image_root, daemon_factory):
    torch = pytest.importorskip("torch")
    cfg = small_config(tmp_path, image_root, loader={"epochs": 1}, **_views())
    d = daemon_factory(cfg)
    torch.manual_seed(0)
    net = torch.nn.Sequential(  # takes any crop size: the global and the local views alike
        torch.nn.Conv2d(3, 8, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 16, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    before = [p.detach().clone() for p in net.parameters()]
    losses = []
    with PrefetchClient(cfg, rank=0, timeout=60, normalize=True) as c:
        for *crops, labels in c:
            # DINO's shape of loss, small: each local view's prediction against each global view's
            # (the "teacher", without gradient), plus the labels on the global views
            out = [net(x) for x in crops]
            teacher = [o.detach().softmax(-1) for o in out[:2]]
            loss = sum(torch.nn.functional.cross_entropy(o, labels) for o in out[:2])
            loss = loss + sum(-(t * o.log_softmax(-1)).sum(-1).mean() for t in teacher for o in out[2:]) / 12
            opt.zero_grad()
            loss.backward()
            assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in net.parameters())
            opt.step()
            losses.append(loss.item())
    assert len(losses) == 8 and all(np.isfinite(losses))
    assert all(not torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))
    assert d.stop() == 0


def _reference_normalized(x_nhwc: np.ndarray, mean, std) -> np.ndarray:
    """(x / 255 - mean) / std per channel in float64, [N, C, H, W]: written here, not the client's."""
    x = x_nhwc.astype(np.float64).transpose(0, 3, 1, 2) / 255.0
    return (x - np.asarray(mean, np.float64)[None, :, None, None]) / np.asarray(std, np.float64)[None, :, None, None]


def test_normalized_views_equal_numpy_reference_normalisation_per_view(tmp_path, image_root, daemon_factory):
    """Every view of every batch read with normalize=True, as numpy and as CPU tensors, with
    ImageNet's and a model's own mean/std, against the formula in float64."""
    cfg = small_config(tmp_path, image_root, loader={"epochs": 3}, **_views())
    d = daemon_factory(cfg)
    ref = reference(cfg, epochs=3)
    clip = ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))  # CLIP's, as open_clip's
    imagenet = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    runs = [(0, {"as_numpy": True}, imagenet, np.asarray),
            (1, {"as_numpy": True, "mean": clip[0], "std": clip[1]}, clip, np.asarray),
            (2, {"mean": clip[0], "std": clip[1]}, clip, lambda t: t.numpy())]
    if pytest.importorskip("torch") is None:  # pragma: no cover
        runs = runs[:2]
    for e, kw, (mean, std), convert in runs:
        with PrefetchClient(cfg, rank=0, timeout=60, normalize=True, **kw) as c:
            n = 0
            for b, batch in enumerate(c.iter_epoch(e)):
                want = ref[(0, e, b)]
                assert len(batch) == len(want) == len(SHAPES) + 1
                for v, (got, w) in enumerate(zip(batch[:-1], want[:-1], strict=True)):
                    g = convert(got)
                    assert g.dtype == np.float32 and g.shape == (len(w), 3) + SHAPES[v], (kw, v)
                    r = _reference_normalized(w, mean, std)
                    assert np.abs(g - r).max() < 1e-5, (kw, e, b, v, float(np.abs(g - r).max()))
                assert np.array_equal(np.asarray(batch[-1]), want[-1])
                n += 1
            assert n == c.batches_per_epoch > 0
    assert d.stop() == 0


def test_preview_shows_each_samples_views_side_by_side(tmp_path, image_root):
    """``prefetchd preview`` on a multi-crop stream: a row per sample, its 8 views at their own
    sizes (2 x 64 then 6 x 32), the pixels those of the batch the workers make."""
    import subprocess
    import sys

    from PIL import Image

    cfg = small_config(tmp_path, image_root, **_views())
    out = tmp_path / "grid.png"
    r = subprocess.run([sys.executable, "-m", "prefetchd", "preview", "--config", cfg, "--out", str(out), "--count", "3"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "8 views a row (64x64 64x64 32x32 32x32 32x32 32x32 32x32 32x32)" in r.stdout, r.stdout
    grid = np.asarray(Image.open(out).convert("RGB"))
    pad, row_h = 4, 64 + 14 + 4
    assert grid.shape == (pad + 3 * row_h, pad + 2 * (64 + pad) + 6 * (32 + pad), 3)
    c = load_config(cfg)
    index, _ = load_index(c.dataset.root, None, c.dataset.extensions, c.dataset.cache_dir)
    maker = BatchMaker(WorkerSetup(c, None, index, 0, str(tmp_path / "buffer")))
    L = c.loader
    views, *_ = maker.fill(0, Sampler(len(index), L.batch_size, L.seed, L.shuffle, L.drop_last, L.world_size)
                           .batch_indices(0, 0, 0))
    for i in range(3):
        x, y = pad, pad + i * row_h
        for v in views:
            h, w = v.shape[1:3]
            assert np.array_equal(grid[y:y + h, x:x + w], v[i]), (i, h)
            x += w + pad
