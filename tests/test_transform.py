"""A user's transform in the workers (``augment.transform``, ``core.augment.transform``): unit tests of the
per-sample seeding and the output rules, then the real daemon with transforms written in Pillow,
numpy and torch (torchvision does not install in the test venv: its wheel pulls CUDA torch)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import small_config, wait_until
from PIL import Image
from prefetchd_client import PrefetchClient, PrefetchError
from test_daemon import collect, published, read_across_a_restart, reference_batches, same_batches

from prefetchd.core.augment import transform
from prefetchd.core.augment.seeds import sample_key
from prefetchd.core.config import ConfigError
from prefetchd.core.config import load as load_config
from prefetchd.executors.worker import BatchMaker, WorkerSetup
from prefetchd.format import status
from prefetchd.sources.dataset import load_index
from prefetchd.tools.samples import jpeg_bytes, photo_like

# A trainer's own module: random.random() and numpy's global RNG, as torchvision's and timm's
# transforms use them; each factory a way a transform can be written (or go wrong).
USER_MODULE = textwrap.dedent('''
    import random

    import numpy as np
    from PIL import Image


    class RandomCropFlipJitter:
        """Random square crop (random.random), flip and brightness (numpy's global RNG), CHW out."""

        def __init__(self, size, raise_on_width=None, other_size_on_width=None):
            self.size, self.raise_on_width, self.other_size_on_width = size, raise_on_width, other_size_on_width

        def __call__(self, im):
            w, h = im.size
            if w == self.raise_on_width:
                raise ValueError(f"cannot take an image {w} wide\\nsecond line")
            side = int(min(w, h) * (0.5 + 0.5 * random.random()))
            x, y = int(random.random() * (w - side + 1)), int(random.random() * (h - side + 1))
            size = self.size // 2 if w == self.other_size_on_width else self.size
            a = np.asarray(im.crop((x, y, x + side, y + side)).resize((size, size), Image.BILINEAR)).copy()
            if np.random.random() < 0.5:
                a = a[:, ::-1]
            a = np.clip(a.astype(np.int16) + np.random.randint(-30, 31), 0, 255).astype(np.uint8)
            return np.ascontiguousarray(a.transpose(2, 0, 1))


    def make(size=64, raise_on_width=None, other_size_on_width=None):
        return RandomCropFlipJitter(size, raise_on_width, other_size_on_width)


    def make_rng(size=64):
        def with_rng(im, rng):  # HWC in (transform_input: numpy), HWC out
            assert isinstance(im, np.ndarray) and im.dtype == np.uint8 and im.flags.writeable
            h, w = im.shape[:2]
            y, x = int(rng.integers(0, h - size + 1)), int(rng.integers(0, w - size + 1))
            return im[y:y + size, x:x + size]
        return with_rng


    def make_torch(size=64):
        import torch

        def noisy(im):
            t = torch.from_numpy(np.array(im.resize((size, size)))).permute(2, 0, 1).to(torch.int16)
            return (t + (torch.rand(1, size, size) * 40).to(torch.int16)).clamp(0, 255).to(torch.uint8)
        return noisy


    def make_float(size=64):
        def to_float(im):
            return np.asarray(im.resize((size, size)), dtype=np.float32).transpose(2, 0, 1) / 255.0
        return to_float


    def make_lazy_torch(size=64):
        def lazy(im):  # imports torch in its first call, as a transform may
            import torch

            a = np.array(im.resize((size, size)))
            return (a // 2 + (torch.rand(size, size, 1) * 100).to(torch.uint8).numpy()).astype(np.uint8)
        return lazy


    def make_own_generator(size=64):
        rng = np.random.default_rng()  # its own generator, as albumentations' Compose keeps one

        def jitter(im):
            a = np.asarray(im.resize((size, size))).astype(np.int16) + rng.integers(-30, 31)
            return np.clip(a, 0, 255).astype(np.uint8)
        return jitter


    def make_flaky(size=64):
        def flaky(im):  # fails with some draws: a failure of (epoch, sample), not of the file
            if random.random() < 0.3:
                raise ValueError("an unlucky draw")
            return np.asarray(im.resize((size, size)))
        return flaky


    not_callable = 3
''')


def _module(tmp_path, name: str) -> str:
    """The user's module written as ``name`` (one name per test: sys.modules caches a name), in
    a directory of its own; returns that directory."""
    d = tmp_path / "usermods"
    d.mkdir(exist_ok=True)
    (d / f"{name}.py").write_text(USER_MODULE)
    return str(d)


def _aug(tmp_path, name: str, factory: str = "make", **extra) -> dict:
    return {"augment": {"output_size": 64, "transform": f"{name}:{factory}", "transform_path": _module(tmp_path, name),
                        "transform_args": {"size": 64}, **extra}}


def _image(w: int, h: int, seed: int = 0) -> bytes:
    return jpeg_bytes(photo_like(np.random.default_rng(seed), w, h), np.random.default_rng(seed))


def _cfg(tmp_path, **augment):
    from prefetchd.core.configsections import AugmentConfig

    return AugmentConfig(**{"output_size": 64, **augment})


# --- unit: seeding, inputs and outputs ---------------------------------------------------------------


def test_a_sample_is_the_same_whatever_the_worker_made_before(tmp_path):
    t = transform.load(_cfg(tmp_path, transform="ux_order:make", transform_path=_module(tmp_path, "ux_order"),
                            transform_args={"size": 64}))
    files = [_image(160, 120, s) for s in range(4)]
    forward = [t.make(f, 7, 1, i) for i, f in enumerate(files)]
    backward = [t.make(f, 7, 1, i) for i, f in reversed(list(enumerate(files)))][::-1]
    for a, b in zip(forward, backward, strict=True):
        assert a.shape == (64, 64, 3) and a.dtype == np.uint8 and np.array_equal(a, b)
    # the randomness is the sample's: another epoch, seed or index gives other pixels
    assert not np.array_equal(forward[0], t.make(files[0], 7, 2, 0))
    assert not np.array_equal(forward[0], t.make(files[0], 8, 1, 0))
    assert not np.array_equal(forward[0], t.make(files[0], 7, 1, 5))


def test_a_callable_taking_rng_gets_a_generator_from_the_samples_key(tmp_path):
    t = transform.load(_cfg(tmp_path, transform="ux_rng:make_rng", transform_path=_module(tmp_path, "ux_rng"),
                            transform_args={"size": 64}, transform_input="numpy"))
    assert t.takes_rng
    data = _image(200, 150)
    got = t.make(data, 3, 0, 11)
    rng = np.random.Generator(np.random.PCG64(sample_key(3, 0, 11)))  # the built-in draws' generator
    y, x = int(rng.integers(0, 150 - 64 + 1)), int(rng.integers(0, 200 - 64 + 1))
    whole = np.asarray(Image.open(__import__("io").BytesIO(data)).convert("RGB"))
    assert np.array_equal(got, whole[y:y + 64, x:x + 64])


def test_torchs_generator_is_seeded_per_sample(tmp_path):
    pytest.importorskip("torch")
    t = transform.load(_cfg(tmp_path, transform="ux_torch:make_torch", transform_path=_module(tmp_path, "ux_torch"),
                            transform_args={"size": 64}))
    files = [_image(100, 100, s) for s in range(3)]
    first = [t.make(f, 0, 0, i) for i, f in enumerate(files)]
    again = [t.make(f, 0, 0, i) for i, f in reversed(list(enumerate(files)))][::-1]
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert not np.array_equal(t.make(files[0], 0, 1, 0), first[0])


def test_torch_is_not_imported_for_a_transform_that_does_not_use_it(tmp_path):
    d = _module(tmp_path, "ux_notorch")
    code = textwrap.dedent(f"""
        import sys
        from prefetchd.core.configsections import AugmentConfig
        from prefetchd.executors.worker import BatchMaker  # what a worker imports
        from prefetchd.core.augment import transform
        from prefetchd.tools.samples import jpeg_bytes, photo_like
        import numpy as np
        t = transform.load(AugmentConfig(output_size=64, transform="ux_notorch:make", transform_path={d!r}), worker=True)
        t.make(jpeg_bytes(photo_like(np.random.default_rng(0), 90, 90), np.random.default_rng(0)), 0, 0, 0)
        print("torch" in sys.modules)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stdout + r.stderr


def test_a_transform_that_imports_torch_in_its_first_call_is_seeded_as_in_later_ones(tmp_path):
    pytest.importorskip("torch")
    d = _module(tmp_path, "ux_lazy")
    code = textwrap.dedent(f"""
        import sys
        import numpy as np
        from prefetchd.core.configsections import AugmentConfig
        from prefetchd.core.augment import transform
        from prefetchd.tools.samples import jpeg_bytes, photo_like
        assert "torch" not in sys.modules
        t = transform.load(AugmentConfig(output_size=64, transform="ux_lazy:make_lazy_torch", transform_path={d!r}),
                           worker=True)
        files = [jpeg_bytes(photo_like(np.random.default_rng(s), 90, 90), np.random.default_rng(s)) for s in (0, 1)]
        order = [int(a) for a in sys.argv[1:]]
        out = {{i: t.make(files[i], 0, 0, i) for i in order}}
        sys.stdout.write(np.concatenate([out[0], out[1]]).tobytes().hex())
    """)
    runs = [subprocess.run([sys.executable, "-c", code, *order], capture_output=True, text=True, timeout=120)
            for order in (["0", "1"], ["1", "0"])]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr + runs[1].stderr
    assert runs[0].stdout == runs[1].stdout  # sample 0 alike whether it loaded torch or came after


def test_a_worker_started_after_the_module_file_changed_refuses_to_make_batches(tmp_path, image_root):
    cfg = load_config(small_config(tmp_path, image_root, **_aug(tmp_path, "ux_guard")))
    index, _ = load_index(cfg.dataset.root, None, cfg.dataset.extensions, cfg.dataset.cache_dir)
    good = transform.load(cfg.augment).code
    BatchMaker(WorkerSetup(cfg, index.files_dir, None, 0, cfg.buffer.dir, transform_code=good))
    with pytest.raises(RuntimeError) as e:
        BatchMaker(WorkerSetup(cfg, index.files_dir, None, 0, cfg.buffer.dir, transform_code="0" * 16))
    assert f"ux_guard.py changed since the daemon started (sha256 {'0' * 16}, now {good})" in str(e.value)


@pytest.mark.parametrize("output, words", [
    (np.zeros((3, 64, 64), np.float32), "returns float32 pixels (a Normalize or ToDtype(float) left in?): end the "
                                        "pipeline in uint8; normalise in the trainer with normalize=True"),
    (np.zeros((64, 64, 3), np.int64), "returns int64 pixels: end the pipeline in uint8"),
    ((np.zeros((64, 64, 3), np.uint8),) * 2, "returns a tuple inside its output: return one image, or a flat tuple"),
    (np.zeros((64, 64), np.uint8), "returns one channel (shape [64, 64])"),
    ("a string", "returns a builtins.str: return a uint8 array or tensor (HWC or CHW) or an RGB PIL image"),
    (np.zeros((3, 48, 48), np.uint8), "returned a 48x48 image where the batch holds 64x64 (augment.output_size)"),
])
def test_outputs_the_batch_cannot_hold_say_what_to_change(output, words):
    with pytest.raises(transform.OutputError) as e:
        transform.to_hwc(output, 64)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_hwc_chw_tensors_and_pil_images_become_the_batchs_hwc():
    a = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    assert np.array_equal(transform.to_hwc(a, 64), a)
    assert np.array_equal(transform.to_hwc(np.ascontiguousarray(a.transpose(2, 0, 1)), 64), a)
    assert np.array_equal(transform.to_hwc(Image.fromarray(a), 64), a)
    torch = pytest.importorskip("torch")
    assert np.array_equal(transform.to_hwc(torch.from_numpy(a).permute(2, 0, 1), 64), a)
    with pytest.raises(transform.OutputError, match="returns float32 pixels .* normalize=True"):
        transform.to_hwc(torch.zeros(3, 64, 64), 64)


def test_a_sample_whose_output_has_another_size_is_quarantined_with_the_reason(tmp_path, image_root):
    root = tmp_path / "root"
    shutil.copytree(image_root, root)
    odd = sorted(root.rglob("*.JPEG"))[5]
    odd.write_bytes(_image(91, 120))
    cfg = load_config(small_config(tmp_path, str(root), **_aug(tmp_path, "ux_size", transform_args={
        "size": 64, "other_size_on_width": 91})))
    index, _ = load_index(cfg.dataset.root, None, cfg.dataset.extensions, cfg.dataset.cache_dir)
    maker = BatchMaker(WorkerSetup(cfg, index.files_dir, None, 0, cfg.buffer.dir))
    victim = next(i for i in range(len(index)) if index.path(i) == str(odd))
    images, used, _, replaced, quarantined = maker.fill(0, np.array([victim, 0, 1]))
    assert [q.index for q in quarantined] == [victim] and replaced[0] == victim and used[0] != victim
    assert quarantined[0].reason == "augment.transform returned a 32x32 image where the batch holds 64x64 (augment.output_size)"
    assert quarantined[0].per_draw and victim not in maker.bad  # this draw's failure, not the file's for good
    assert images.shape == (3, 64, 64, 3)


# --- configuration: one line at load or check --------------------------------------------------------


@pytest.mark.parametrize("augment, words", [
    ({"transform": "mytransforms.make"}, "augment.transform must be \"package.module:factory\""),
    ({"transform": "m:f", "transform_args": [1, 2]}, "augment.transform_args must be a mapping of the factory's keyword"),
    ({"transform": "m:f", "transform_args": "size=224"}, "augment.transform_args must be a mapping"),
    ({"transform": "m:f", "transform_input": "tensor"}, "augment.transform_input must be one of pil, numpy"),
    ({"transform": "m:f", "decode": "hybrid"}, "augment.decode must be cpu with augment.transform"),
    ({"transform_args": {"size": 3}}, "augment.transform_args is set but augment.transform is not"),
])
def test_bad_transform_keys_are_one_line_errors_at_load(tmp_path, augment, words):
    path = small_config(tmp_path, "/nonexistent", augment=augment)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value).startswith(words) and "\n" not in str(e.value)


@pytest.mark.parametrize("factory, args, words", [
    ("ux_nomod_{}:make", {}, "augment.transform names module 'ux_nomod_{}', which is not found in augment.transform_path"),
    ("{}:nothing_here", {}, "augment.transform names 'nothing_here', which module '{}'"),
    ("{}:not_callable", {}, "augment.transform names {}:not_callable, a int, which is not callable"),
    ("{}:make", {"sizes": 3}, "augment.transform {}:make(**augment.transform_args) raised TypeError: make() got an "
                              "unexpected keyword argument 'sizes'"),
    ("{}:make_float", {}, "augment.transform {}:make_float: augment.transform returns float32 pixels (a Normalize or "
                          "ToDtype(float) left in?): end the pipeline in uint8; normalise in the trainer with normalize=True"),
    ("{}:make", {"size": 48}, "augment.output_size is 64 but augment.transform returns 48x48 images: set "
                              "augment.output_size: 48, or end the transform with a 64x64 crop"),
    ("{}:make", {"raise_on_width": 120}, "augment.transform {}:make failed on each of the first"),
    ("{}:make_own_generator", {}, "augment.transform {}:make_own_generator made sample 0 twice from one seed and got "
                                  "other pixels: it draws from a generator of its own"),
])
def test_prefetchd_check_runs_the_transform_and_says_what_is_wrong_in_one_line(tmp_path, factory, args, words):
    name = f"ux_check_{abs(hash((factory, json.dumps(args)))) % 10**8}"
    root = tmp_path / "root"
    os.makedirs(root / "a")
    for j in range(3):  # every image 120 wide: a transform raising on that width fails on all of them
        (root / "a" / f"{j}.jpg").write_bytes(_image(120, 90, j))
    aug = _aug(tmp_path, name, factory.format(name).split(":")[1], transform_args=args)
    aug["augment"]["transform"] = factory.format(name)
    cfg = small_config(tmp_path, str(root), dataset={"one_class": True}, loader={"batch_size": 2}, **aug)
    r = subprocess.run([sys.executable, "-m", "prefetchd", "check", "--config", cfg], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 78, r.stdout + r.stderr
    line = r.stderr.strip()
    assert "\n" not in line and "Traceback" not in line, line
    assert line.startswith("prefetchd: configuration error: " + words.format(name)), line


def test_prefetchd_check_says_what_the_transform_makes(tmp_path, image_root):
    cfg = small_config(tmp_path, image_root, **_aug(tmp_path, "ux_checkok"))
    r = subprocess.run([sys.executable, "-m", "prefetchd", "check", "--config", cfg], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "augment transform -> 64x64" in r.stdout
    assert "transform: ux_checkok:make (" in r.stdout and "made 2 of the first 2 samples, 64x64 uint8" in r.stdout


def test_transform_path_is_relative_to_the_config_file(tmp_path):
    (tmp_path / "c.yaml").write_text("dataset: {root: d}\naugment: {transform: 'm:f', transform_path: mods}\n")
    assert load_config(str(tmp_path / "c.yaml")).augment.transform_path == str(tmp_path / "mods")


def test_the_fingerprint_covers_the_factory_and_its_arguments_and_not_the_unused_modes(tmp_path):
    base = load_config(small_config(tmp_path, "/data"))
    assert not any("transform" in k for k in base.augment.stream_dict())  # configs without one: as before
    fps = set()
    for aug in ({"transform": "m:f"}, {"transform": "m:g"}, {"transform": "m:f", "transform_args": {"size": 3}},
                {"transform": "m:f", "transform_args": {"size": 4}}, {"transform": "m:f", "transform_input": "numpy"}):
        fps.add(load_config(small_config(tmp_path, "/data", augment=aug)).stream_fingerprint())
    assert len(fps) == 5 and base.stream_fingerprint() not in fps
    a = load_config(small_config(tmp_path, "/data", augment={"transform": "m:f", "flip": True}))
    b = load_config(small_config(tmp_path, "/data", augment={"transform": "m:f", "flip": False, "mode": "eval"}))
    assert a.stream_fingerprint() == b.stream_fingerprint()  # the built-in modes' keys do nothing with a transform
    # ...nor are they checked against output_size (small_config's scale_min 72 < 96 is refused without one)
    with pytest.raises(ConfigError, match="augment.scale_min must be >= augment.output_size"):
        load_config(small_config(tmp_path, "/data", augment={"output_size": 96}))
    assert load_config(small_config(tmp_path, "/data", augment={"transform": "m:f", "output_size": 96})).augment.output_size == 96
    # the validation stream keeps the eval mode
    assert a.val_augment().transform is None and a.val_augment().mode == "eval"


# --- the real daemon ----------------------------------------------------------------------------------


def test_a_user_transform_gives_the_same_batches_with_one_and_two_workers(tmp_path, image_root, daemon_factory):
    digests = []
    for workers in (1, 2):
        run = tmp_path / f"w{workers}"
        run.mkdir()
        cfg = small_config(run, image_root, workers={"count": workers}, **_aug(tmp_path, "ux_workers"))
        d = daemon_factory(cfg)
        got = collect(cfg)
        assert d.stop() == 0
        assert "augment.transform: ux_workers:make (" in d.log() and "Traceback" not in d.log()
        digests.append(got)
    same_batches(digests[0], digests[1])
    ref, _ = reference_batches(cfg)  # made in this process, one sample after another
    same_batches(digests[1], ref)
    # the transform's randomness is in the batches: two epochs of the same images differ
    assert not np.array_equal(ref[(0, 0, 0)][0], ref[(0, 1, 0)][0])


def test_a_daemon_restart_mid_epoch_with_a_user_transform_is_bit_identical(tmp_path, image_root, daemon_factory):
    pytest.importorskip("torch")
    cfg = small_config(tmp_path, image_root, **_aug(tmp_path, "ux_restart", "make_torch"))
    same_batches(read_across_a_restart(cfg, daemon_factory), reference_batches(cfg)[0])


def test_a_resume_across_an_edited_transform_is_refused_naming_the_module_file(tmp_path, image_root, daemon_factory):
    aug = _aug(tmp_path, "ux_edited")
    cfg = small_config(tmp_path, image_root, **aug)
    buf = load_config(cfg).buffer.dir
    d = daemon_factory(cfg)
    with PrefetchClient(cfg, rank=0, timeout=60, as_numpy=True) as c:
        next(iter(c.iter_epoch(0)))
        state = c.state_dict()
    wait_until(lambda: len(published(buf)) >= 2, 30, "batches ahead in the ring")
    assert d.stop() == 0
    path = os.path.join(aug["augment"]["transform_path"], "ux_edited.py")
    with open(path, "a") as f:
        f.write("\n# tuned the jitter\n")
    d2 = daemon_factory(cfg)
    wait_until(lambda: status.daemon_alive(buf), 60, "the second daemon")
    with PrefetchClient(cfg, rank=0, timeout=60, as_numpy=True) as c:
        with pytest.raises(PrefetchError) as e:
            c.load_state_dict(state)
    msg = str(e.value)
    assert "\n" not in msg and "augment.transform's module file" in msg and path in msg and "the file changed" in msg
    # the batches the first daemon left in the ring were made by the old file: not served as this stream's
    assert re.search(r"buffer recovered: kept 0 batches; .* [1-9]\d* from another stream", d2.log()), d2.log()
    assert d2.stop() == 0


def test_a_failed_draw_leaves_later_epochs_as_a_worker_that_never_saw_it_makes_them(tmp_path, image_root):
    """A worker that met a transform's failure in epochs 0-2 makes epoch 3's batch byte for byte as a
    fresh worker does: the failure was the draw's, so no sample is left out of later epochs."""
    cfg = load_config(small_config(tmp_path, image_root, **_aug(tmp_path, "ux_flaky", "make_flaky")))
    index, _ = load_index(cfg.dataset.root, None, cfg.dataset.extensions, cfg.dataset.cache_dir)
    setup = WorkerSetup(cfg, index.files_dir, None, 0, cfg.buffer.dir)
    seen, batches = BatchMaker(setup), np.arange(len(index)).reshape(-1, 6)  # batches of 6
    failed = [q for e in range(3) for b in batches for q in seen.fill(e, b)[4]]
    assert failed and all(q.per_draw for q in failed) and not seen.bad
    fresh = BatchMaker(setup)
    for b in batches:
        ours = [x.copy() for x in seen.fill(3, b)[:4]]
        assert all(np.array_equal(x, y) for x, y in zip(ours, fresh.fill(3, b)[:4], strict=True))


def test_a_transform_raising_on_one_sample_is_replaced_in_each_draw_and_training_goes_on(tmp_path, image_root,
                                                                                         daemon_factory):
    """A transform's failure belongs to its draw (epoch, sample): the sample is replaced in that
    batch and said with the exception's line, never quarantined for good: a later epoch's draw may
    succeed, and a worker that never saw the failure must make the same bytes."""
    root = tmp_path / "root"
    shutil.copytree(image_root, root)
    victim = sorted(root.rglob("*.JPEG"))[7]
    victim.write_bytes(_image(77, 100))  # the only image 77 wide: the transform raises on it
    cfg = small_config(tmp_path, str(root), **_aug(tmp_path, "ux_raise", transform_args={"size": 64, "raise_on_width": 77}))
    d = daemon_factory(cfg)
    got = collect(cfg)
    assert len(got) == 16 and all(x.shape == (6, 64, 64, 3) for x, _ in got.values())
    buf = str(tmp_path / "buffer")
    reason = "augment.transform raised ValueError: cannot take an image 77 wide second line"
    wait_until(lambda: sum(str(victim) in s for s in d.log().splitlines()) >= 2, 10, "the failure said in both epochs")
    assert (status.read_json(buf, status.STATUS_NAME) or {}).get("quarantined") == 0
    assert d.stop() == 0
    assert not (tmp_path / "buffer" / status.QUARANTINE_NAME).exists()
    said = [s for s in d.log().splitlines() if str(victim) in s]
    assert [s.split(" WARNING prefetchd: ", 1)[1] for s in said] == [
        f"sample {i} ({victim}), epoch {e}: {reason}; a deterministic replacement stands in for it"
        for i, e in [(int(said[0].split("sample ")[1].split()[0]), 0), (int(said[0].split("sample ")[1].split()[0]), 1)]]
    ref, _ = reference_batches(cfg)  # the replacement is deterministic: as made in this process
    same_batches(got, ref)


def test_a_float_output_transform_stops_the_daemon_at_start_with_exit_78_and_one_line(tmp_path, image_root,
                                                                                        daemon_factory):
    cfg = small_config(tmp_path, image_root, **_aug(tmp_path, "ux_float", "make_float"))
    d = daemon_factory(cfg)
    assert d.proc.wait(timeout=60) == 78
    errors = [s for s in d.log().splitlines() if "configuration error" in s]
    assert len(errors) == 1 and "Traceback" not in d.log(), d.log()
    assert errors[0].endswith("augment.transform ux_float:make_float: augment.transform returns float32 pixels "
                              "(a Normalize or ToDtype(float) left in?): end the pipeline in uint8; normalise in the "
                              "trainer with normalize=True (sample 0)"), errors[0]
    assert not [n for n in os.listdir(tmp_path / "buffer") if n.endswith(".batch")]
