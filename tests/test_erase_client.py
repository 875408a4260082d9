"""``augment.random_erasing.erase_on: client``: the real daemon leaves the boxes alone, its
meta.json tells the client how to erase, and the client erases the normalised batch with the
daemon path's boxes and normals. Checked against a reference built here from the un-erased
pixels of the same stream without erasing, normalised in float64, with timm's fills written from
its source; the erasing is a pure function of the sample's key (workers, a restart, a replaced
sample); fingerprints of erase_on: daemon configs are those they had; the refusals."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from statistics import NormalDist

import numpy as np
import pytest
import torch
from conftest import small_config
from prefetchd_client import ConfigError as ClientConfigError
from prefetchd_client import PrefetchClient
from test_daemon import read_across_a_restart, reference_batches
from test_hybrid_daemon import CountingDecoder, mixed_root  # noqa: F401 - a fixture
from test_hybrid_daemon import _reference as hybrid_reference

from prefetchd.core.augment import erasing, modes
from prefetchd.core.augment.seeds import sample_draws
from prefetchd.core.config import ConfigError, from_dict
from prefetchd.core.config import load as load_config
from prefetchd.core.policyspec import erasing_config
from prefetchd.format import status

MEAN = np.array([0.485, 0.456, 0.406])
STD = np.array([0.229, 0.224, 0.225])
_ERASING = {"p": 0.6, "count": [1, 2], "scale": [0.05, 0.3]}


def _cfg(tmp_path, root, mode, workers=2, **erasing_keys):
    aug = {"mode": "random_resized_crop", "random_erasing": {**_ERASING, "mode": mode, "erase_on": "client", **erasing_keys}}
    return small_config(tmp_path, root, workers={"count": workers}, augment=aug)


def _reference(tmp_path, root, mode, got_indices):
    """The expected normalised batches: the same stream without erasing (made here, in process),
    ``(x / 255 - mean) / std`` in float64, then timm's fill in each box of ``erasing.boxes``."""
    plain = tmp_path / "plain"
    plain.mkdir(exist_ok=True)
    pixels, _ = reference_batches(small_config(plain, root, augment={"mode": "random_resized_crop"}))
    return _expected(pixels, mode, got_indices) + (pixels,)


def _expected(pixels, mode, got_indices):
    """``pixels`` ({key: (uint8 NHWC, labels, indices)}) normalised and erased as timm would."""
    cfg = erasing_config({**_ERASING, "mode": mode})
    out, mask, n_boxes = {}, {}, 0
    for key, (images, _, used) in pixels.items():
        e = key[1]
        assert np.array_equal(used, got_indices[key]), key  # the samples the file says it holds
        x = (images.transpose(0, 3, 1, 2) / 255.0 - MEAN[:, None, None]) / STD[:, None, None]
        m = np.zeros(x.shape, dtype=bool)
        for k, i in enumerate(used):
            p = modes.draws(7, e, int(i)).p  # loader.seed 7 (small_config)
            rng = np.random.default_rng(int(p[255] * 2**53))  # timm's per-pixel normals, box after box
            for top, left, h, w, j in erasing.boxes(cfg, p, 64, 64):
                n_boxes += 1
                if mode == "const":
                    fill = 0.0
                elif mode == "rand":
                    z = [NormalDist().inv_cdf(u) for u in p[206 + 3 * j: 209 + 3 * j]]
                    fill = np.asarray(z, dtype=np.float32)[:, None, None]
                else:
                    fill = rng.standard_normal((h, w, 3), dtype=np.float32).transpose(2, 0, 1)
                x[k, :, top:top + h, left:left + w] = fill
                m[k, :, top:top + h, left:left + w] = True
        out[key], mask[key] = x, m
    assert n_boxes > 20  # p 0.6 over every sample: the test erases something
    return out, mask


def _read(cfg, epochs=(0, 1), **kw):
    """Every batch of ``epochs`` through a normalising client: {(rank, epoch, batch): (float32 NCHW, indices)}."""
    got = {}
    with PrefetchClient(cfg, rank=0, timeout=60, normalize=True, **kw) as c:
        for e in epochs:
            for b, (x, _) in enumerate(c.iter_epoch(e)):
                arr = x if isinstance(x, np.ndarray) else x.float().numpy()
                got[(0, e, b)] = (np.array(arr, dtype=np.float32), c.last_batch.indices.copy())
    return got


def _check(got, ref, mask):
    assert sorted(got) == sorted(ref)
    for key, (x, _) in got.items():
        # the boxes hold exactly the normals (float32); elsewhere the normalisation, to float32's rounding
        np.testing.assert_array_equal(x[mask[key]], ref[key][mask[key]].astype(np.float32), err_msg=str(key))
        np.testing.assert_allclose(x, ref[key], rtol=0, atol=2e-6, err_msg=str(key))


@pytest.mark.parametrize("mode", ["const", "rand", "pixel"])
def test_the_client_erases_the_normalised_batch_as_timm_with_the_daemon_paths_boxes(tmp_path, image_root, daemon_factory, mode):
    cfg = _cfg(tmp_path, image_root, mode)
    d = daemon_factory(cfg)
    got = _read(cfg)  # torch CPU tensors
    got_np = _read(cfg, epochs=(0,), as_numpy=True)
    assert d.stop() == 0
    assert "Traceback" not in d.log()
    meta = status.read_json(load_config(cfg).buffer.dir, status.META_NAME)
    assert meta["erasing"] == {**_ERASING, "mode": mode, "ratio": [0.3, 1 / 0.3], "seed": 7}
    ref, mask, plain = _reference(tmp_path, image_root, mode, {k: v[1] for k, v in got.items()})
    _check(got, ref, mask)
    _check(got_np, {k: ref[k] for k in got_np}, mask)
    # the workers (a BatchMaker, in process) leave the uint8 samples as they are without erasing
    made, _ = reference_batches(cfg)
    assert all(np.array_equal(made[k][0], plain[k][0]) for k in plain)


def test_a_replaced_sample_is_erased_from_its_own_key(tmp_path, image_root, daemon_factory):
    """A broken file's stand-in is made from the stand-in's draws in the workers: the client
    erases it with the boxes of the index the batch file holds, not the broken one's."""
    root = tmp_path / "data"
    shutil.copytree(image_root, root)
    cls = sorted(os.listdir(root))[1]
    broken = root / cls / sorted(os.listdir(root / cls))[3]
    broken.write_bytes(b"not a jpeg" * 10)
    cfg = _cfg(tmp_path, str(root), "pixel")
    d = daemon_factory(cfg)
    replaced = []
    got = {}
    with PrefetchClient(cfg, rank=0, timeout=60, normalize=True) as c:
        for e in (0, 1):
            for b, (x, _) in enumerate(c.iter_epoch(e)):
                got[(0, e, b)] = (x.numpy().copy(), c.last_batch.indices.copy())
                replaced += [(e, b, int(k)) for k in np.flatnonzero(c.last_batch.replaced >= 0)]
    assert d.stop() == 0
    assert len(replaced) == 2  # once an epoch
    ref, mask, _ = _reference(tmp_path, str(root), "pixel", {k: v[1] for k, v in got.items()})
    _check(got, ref, mask)


def test_erase_on_client_combines_with_hybrid_decode(tmp_path, mixed_root, daemon_factory):  # noqa: F811
    """The client erases the batches it decodes itself (compact batches, here with a CPU JPEG
    decoder standing in for nvImageCodec) as those the workers made: the odd files of the set
    (CMYK, PNG, a truncated one, replaced) included."""
    hyb = {"decode": "hybrid", "gpu_share": 0.5}
    cfg = small_config(tmp_path, mixed_root, buffer={"max_bytes": "16MiB"}, augment={
        **hyb, "random_erasing": {**_ERASING, "mode": "pixel", "erase_on": "client"}})
    d = daemon_factory(cfg)
    dec = CountingDecoder()
    got = _read(cfg, decoder=dec)
    assert d.stop() == 0
    assert dec.decoded > 0  # compact batches were decoded (and erased) by the client
    plain = tmp_path / "plain"
    plain.mkdir()
    pixels = hybrid_reference(small_config(plain, mixed_root, buffer={"max_bytes": "16MiB"}, augment=hyb))
    ref, mask = _expected({(0, *k): v for k, v in pixels.items()}, "pixel", {k: v[1] for k, v in got.items()})
    _check(got, ref, mask)


def test_client_erasing_is_the_same_with_one_or_two_workers_and_across_a_restart(tmp_path, image_root, daemon_factory):
    one = tmp_path / "one"
    one.mkdir()
    cfg1 = _cfg(one, image_root, "pixel", workers=1)
    d = daemon_factory(cfg1)
    straight = _read(cfg1)
    assert d.stop() == 0
    two = tmp_path / "two"
    two.mkdir()
    cfg2 = _cfg(two, image_root, "pixel", workers=2)
    resumed = read_across_a_restart(cfg2, daemon_factory, take=lambda x, y: x.numpy().copy(), as_numpy=False,
                                    normalize=True)
    assert sorted(resumed) == sorted(straight)
    for key, (x, _) in straight.items():
        assert x.tobytes() == resumed[key].tobytes(), key


# --- pure parts --------------------------------------------------------------------------------


def test_the_clients_draws_are_the_workers_draws():
    for key in ((7, 0, 0), (7, 3, 41), (123, 1, 10**6)):
        d, (u, z, p) = modes.draws(*key), sample_draws(*key)
        assert np.array_equal(d.u, u) and np.array_equal(d.z, z) and np.array_equal(d.p, p)


def test_the_clients_erasing_imports_no_opencv_pillow_or_daemon():
    code = ("import sys; from prefetchd_client import PrefetchClient; import prefetchd_client.erasing; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('PIL', 'cv2', 'simplejpeg') or m in "
            "('prefetchd.core.augment.modes', 'prefetchd.core.augment.policies', 'prefetchd.core.augment.ops') "
            "or m.startswith(('prefetchd.daemon', 'prefetchd.executors'))]; print(bad)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_erasing_on_torch_cpu_equals_numpy_and_keeps_low_precision_dtypes():
    from prefetchd_client.erasing import ClientErasing

    er = ClientErasing({**_ERASING, "p": 1.0, "ratio": [0.3, 3.3], "mode": "pixel", "seed": 7})
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 3, 32, 32)).astype(np.float32)
    idx = np.arange(100, 116)
    a = er(x.copy(), 2, idx)
    t = torch.from_numpy(x.copy()).contiguous(memory_format=torch.channels_last)
    b = er(t, 2, idx)
    assert np.array_equal(a, b.numpy()) and not np.array_equal(a, x)
    h = er(torch.from_numpy(x.copy()).to(torch.bfloat16), 2, idx)
    assert h.dtype == torch.bfloat16 and torch.equal(h, torch.from_numpy(a).to(torch.bfloat16))


_BASE = {"dataset": {"root": "/data"}, "loader": {"batch_size": 6, "seed": 7},
         "augment": {"output_size": 64, "scale_min": 72, "scale_max": 120}}


@pytest.mark.parametrize("erasing_keys, before", [
    # stream fingerprints printed by the commit before erase_on existed (9045ca8)
    ({"p": 0.25}, "e7cd02adea9f3375"),
    # (value beside mode pixel is refused now, as a key that did nothing: std is pixel mode's own)
    ({"p": 0.5, "mode": "pixel", "count": [1, 2], "std": [0.2, 0.3, 0.25]}, "2cd2faf20629e9c7"),
])
def test_erase_on_daemon_keeps_the_fingerprint_configs_had(erasing_keys, before):
    def fp(keys):
        return from_dict({**_BASE, "augment": {**_BASE["augment"], "random_erasing": keys}}).stream_fingerprint()

    assert fp(erasing_keys) == before
    assert fp({**erasing_keys, "erase_on": "daemon"}) == before
    assert "erase_on" not in str(from_dict({**_BASE, "augment": {**_BASE["augment"], "random_erasing": erasing_keys}}).augment.stream_dict())
    keys = {k: v for k, v in erasing_keys.items() if k not in ("value", "mean", "std")}
    assert fp({**keys, "erase_on": "client"}) not in (before, fp(keys))


# --- refusals ---------------------------------------------------------------------------------


def test_erase_on_client_without_normalize_is_refused_naming_the_key(tmp_path, image_root):
    cfg = _cfg(tmp_path, image_root, "pixel")
    with pytest.raises(ClientConfigError, match="normalize=True.*erase_on: daemon") as e:
        PrefetchClient(cfg, rank=0, timeout=5)
    assert str(e.value).startswith("augment.random_erasing.erase_on is client in ")
    assert "\n" not in str(e.value)


def test_the_validation_stream_is_never_erased_so_its_client_may_read_uint8(tmp_path, image_root, val_image_root):
    cfg = small_config(tmp_path, image_root, validation={"enabled": True, "root": val_image_root}, augment={
        "random_erasing": {"p": 0.5, "erase_on": "client"}})
    c = PrefetchClient(cfg, rank=0, timeout=5, split="val")
    c.close()


@pytest.mark.parametrize("aug, key, words", [
    ({"random_erasing": {"p": 0.5, "erase_on": "gpu"}}, "augment.random_erasing.erase_on", "daemon, client"),
    ({"random_erasing": {"p": 0.5, "erase_on": "client", "value": [124, 116, 104]}}, "augment.random_erasing.value",
     "const: 0.*erase_on: daemon"),
    ({"random_erasing": {"p": 0.5, "erase_on": "client", "mode": "pixel", "std": [0.2, 0.2, 0.2]}},
     "augment.random_erasing.std", "erase_on: daemon"),
    ({"random_erasing": {"p": 0.5, "erase_on": "client"}, "views": [{"count": 2, "output_size": 32}]},
     "augment.random_erasing", r"not applied to augment.views.*augment.views\[i\].random_erasing"),
    ({"random_erasing": {"p": 0.5}, "decode": "hybrid"}, "augment.decode", "erase_on: client does not"),
    ({"random_erasing": {"p": 0.5, "erase_on": "client"}, "ops": {"vflip": 0.5}, "decode": "gpu"}, "augment.decode",
     "must be cpu"),
])
def test_bad_erase_on_settings_say_the_key(tmp_path, aug, key, words):
    with pytest.raises(ConfigError, match=words) as e:
        load_config(small_config(tmp_path, "/data", augment=aug))
    assert str(e.value).startswith(key + " ")


def test_an_erase_on_client_config_written_back_whole_loads_again(tmp_path):
    """``to_dict`` writes every key, the daemon-only ones at their defaults: not refused."""
    from prefetchd.core.config import from_dict

    cfg = load_config(small_config(tmp_path, "/data", augment={"random_erasing": {"p": 0.5, "erase_on": "client"}}))
    d = cfg.to_dict()
    d["augment"]["random_erasing"] = dict(vars(cfg.augment.random_erasing))
    assert from_dict(d).augment.random_erasing == cfg.augment.random_erasing


def _timm_random_erasing():
    """timm's ``timm/data/random_erasing.py`` (it imports only random, math and torch), loaded from
    its file without importing timm (which needs torchvision); skipped where timm is not installed."""
    import importlib.util

    spec = importlib.util.find_spec("timm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("timm is not installed (pip install --no-deps timm)")
    s = importlib.util.spec_from_file_location("_timm_random_erasing", os.path.join(
        list(spec.submodule_search_locations)[0], "data", "random_erasing.py"))
    mod = importlib.util.module_from_spec(s)
    s.loader.exec_module(mod)
    return mod


class _TimmRandom:
    """timm's calls of ``random`` answered from each sample's draws, in timm's order: whether,
    how many (only when min < max), then per box up to ten tries of (area, aspect), and the
    place of the try kept; so timm's own loop decides what the draws make."""

    def __init__(self, draws):
        self.draws = iter(draws)

    def _u(self) -> float:
        return self.p[42 + 40 * self.j + 4 * self.a + self.stage]

    def random(self):
        self.p, self.j, self.a, self.stage = next(self.draws), 0, 0, 0
        return self.p[40]

    def randint(self, lo, hi):
        if self.stage == 0:  # the box count
            return erasing._randint(self.p[41], lo, hi)
        u = self._u()
        self.stage += 1
        if self.stage == 4:  # placed: the next box
            self.j, self.a, self.stage = self.j + 1, 0, 0
        return erasing._randint(u, lo, hi)

    def uniform(self, lo, hi):
        if self.stage == 2:  # the last try did not fit
            self.a, self.stage = self.a + 1, 0
        if self.a == 10:  # ten tries: the next box
            self.j, self.a = self.j + 1, 0
        u = self._u()
        self.stage += 1
        return lo + u * (hi - lo)


def test_the_clients_erasing_is_timms_own_random_erasing_given_the_same_draws():
    """timm's own ``RandomErasing`` on a CPU tensor, its ``random`` calls answered from the
    samples' draws and its fills taken from ``erasing.noise`` in its call order, against the
    client's erasing of the same normalised batch: the same tensor, bit for bit, over generated
    configs (modes, counts, areas, aspects, p 0 and 1, images down to 2 x 2 where tries fail)."""
    from prefetchd_client.erasing import ClientErasing

    timm_re = _timm_random_erasing()
    rng = np.random.default_rng(0)
    erased = 0
    for trial in range(240):
        mode = ("const", "rand", "pixel")[trial % 3]
        c0 = int(rng.integers(1, 5))
        c1 = int(rng.integers(c0, 5))
        lo = float(rng.uniform(0.01, 0.5))
        hi = float(rng.uniform(lo, 1.0))
        r0 = float(rng.uniform(0.1, 1.0))
        r1 = float(rng.uniform(r0, 10.0))
        p = float(rng.choice([0.0, 0.4, 1.0]))
        h, w = int(rng.integers(2, 40)), int(rng.integers(2, 40))
        mine = ClientErasing({"p": p, "scale": [lo, hi], "ratio": [r0, r1], "mode": mode, "count": [c0, c1], "seed": 11})
        indices = rng.integers(0, 1000, 6)
        x = torch.randn(6, 3, h, w, generator=torch.Generator().manual_seed(trial))
        got = mine(x.numpy().copy(), 2, indices)
        draws = [sample_draws(11, 2, int(i))[2] for i in indices]
        fills = iter([(b, z) for d in draws for bs in [erasing.boxes(mine.cfg, d, h, w)]
                      for b, z in zip(bs, erasing.noise(mine.cfg, d, bs), strict=True)])

        def pixels(per_pixel, rand_color, patch_size, dtype=torch.float32, device="cpu", fills=fills):
            (_, _, eh, ew, _), z = next(fills)
            assert tuple(patch_size[1:]) == (eh, ew)  # timm's box is the client's
            if z is None:
                return torch.zeros((patch_size[0], 1, 1), dtype=dtype)
            z = np.asarray(z, np.float32)
            return torch.from_numpy(z[:, None, None] if z.ndim == 1 else np.ascontiguousarray(z.transpose(2, 0, 1)))

        timm_re._get_pixels, timm_re.random = pixels, _TimmRandom(draws)
        want = timm_re.RandomErasing(probability=p, min_area=lo, max_area=hi, min_aspect=r0, max_aspect=r1, mode=mode,
                                     min_count=c0, max_count=c1, device="cpu")(x.clone()).numpy()
        np.testing.assert_array_equal(got, want, err_msg=f"trial {trial}")
        assert next(fills, None) is None  # timm made every box the client made
        erased += not np.array_equal(got, x.numpy())
    assert erased > 60, erased


# --- the GPU path (skipped where no CUDA device is present, as on this project's CI) -----------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


@needs_cuda
@pytest.mark.parametrize("mode", ["rand", "pixel"])
def test_erasing_a_cuda_batch_equals_the_cpu_path(mode):
    from prefetchd_client.erasing import ClientErasing

    er = ClientErasing({**_ERASING, "p": 0.5, "ratio": [0.3, 3.3], "mode": mode, "seed": 7})
    x = torch.randn(256, 3, 224, 224).contiguous(memory_format=torch.channels_last)
    idx = np.arange(256) + 5000
    want = er(x.clone(), 1, idx)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        g = er(x.cuda(non_blocking=False), 1, idx)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(g.cpu(), want)


@needs_cuda
def test_a_daemon_stream_erased_on_the_gpu_is_the_cpu_clients(tmp_path, image_root, daemon_factory):
    from prefetchd_client.erasing import ClientErasing

    cfg = _cfg(tmp_path, image_root, "pixel")
    d = daemon_factory(cfg)
    cpu = _read(cfg, epochs=(0,))
    gpu = {}
    with PrefetchClient(cfg, rank=0, timeout=60, normalize=True, device="cuda") as c:
        for b, (x, _) in enumerate(c.iter_epoch(0)):
            gpu[(0, 0, b)] = x.cpu().numpy()
    assert d.stop() == 0
    er = ClientErasing(status.read_json(load_config(cfg).buffer.dir, status.META_NAME)["erasing"])
    for key, (x, idx) in cpu.items():
        np.testing.assert_allclose(gpu[key], x, rtol=0, atol=2e-6, err_msg=str(key))
        for k, top, left, h, w, _ in er.plan(0, idx, 64, 64):  # the normals themselves, to the bit
            box = np.s_[k, :, top:top + h, left:left + w]
            assert np.array_equal(gpu[key][box], x[box]), key


@pytest.mark.parametrize("aug, words", [
    ({"random_erasing": {"probability": 0.5}}, "augment.random_erasing.probability is not a random_erasing key; timm's "
                                               "RandomErasing(probability=) is augment.random_erasing.p here"),
    ({"random_erasing": {"p": 0.5, "max_count": 3}}, "augment.random_erasing.max_count is not a random_erasing key; "
                                                     "timm's RandomErasing(max_count=) is augment.random_erasing.count"),
    ({"random_erasing": {"p": 0.5, "device": "cuda"}}, "augment.random_erasing.device is not a random_erasing key; "
                                                       "timm's RandomErasing(device=) is augment.random_erasing.erase_on"),
    ({"re_prob": 0.25}, "augment.re_prob is not a known key; timm's re_prob is augment.random_erasing.p here"),
    ({"color_jitter_prob": 0.8}, "augment.color_jitter_prob is not a known key; timm's color_jitter_prob is "
                                 "augment.jitter_p here"),
])
def test_timms_erasing_and_jitter_argument_names_say_the_key_here(tmp_path, aug, words):
    """A config written from timm's RandomErasing(...) or create_transform(...) arguments: each
    name is said as this config's key, not "known: p, scale, ..." (a list to guess from)."""
    with pytest.raises(ConfigError) as e:
        load_config(small_config(tmp_path, "/data", augment=aug))
    assert str(e.value).startswith(words) and "\n" not in str(e.value), str(e.value)
