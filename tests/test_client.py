"""The trainer's side: tensors, pinned-memory fallback, rank from torchrun, light imports."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import small_config
from prefetchd_client import PrefetchClient, PrefetchError, normalize
from test_daemon import reference_batches

from prefetchd.core.config import ConfigError


def test_importing_the_client_loads_no_daemon_pillow_or_opencv():
    code = ("import sys, prefetchd_client; bad = [m for m in sys.modules if m.split('.')[0] in "
            "('PIL', 'cv2', 'simplejpeg', 'watchdog', 'psutil') or m.startswith(('prefetchd.daemon', "
            "'prefetchd.executors', 'prefetchd.tools', 'prefetchd.cli')) or m in ('prefetchd.core.augment.modes', 'prefetchd.core.augment.transform', "
            "'multiprocessing.pool')]; print(bad)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


@pytest.mark.parametrize("pin", [None, True])
def test_torch_tensors_channels_last_and_pinned_fallback(tmp_path, image_root, daemon_factory, pin):
    cfg = small_config(tmp_path, image_root, loader={"epochs": 1})
    d = daemon_factory(cfg)
    ref, _ = reference_batches(cfg, epochs=1)
    pinnable = bool(pin) and torch.cuda.is_available()  # without CUDA, pinning falls back cleanly
    kept = []
    with PrefetchClient(cfg, timeout=60, pin_memory=pin) as c:
        for b, (x, y) in enumerate(c.iter_epoch(0)):
            assert isinstance(x, torch.Tensor) and x.dtype == torch.uint8 and tuple(x.shape) == (6, 3, 64, 64)
            assert x.is_contiguous(memory_format=torch.channels_last) and x.is_pinned() == pinnable
            assert y.dtype == torch.int64 and tuple(y.shape) == (6,)
            assert np.array_equal(x.permute(0, 2, 3, 1).numpy(), ref[(0, 0, b)][0])
            kept.append((b, x))
        assert c.state_dict()["epoch"] == 1 and c.state_dict()["batch"] == 0
        assert c.pin_memory is pinnable
    for b, x in kept:  # batch b+1's pixels never land in batch b's tensor
        assert np.array_equal(x.permute(0, 2, 3, 1).numpy(), ref[(0, 0, b)][0])
    assert d.stop() == 0


def test_cuda_device_without_cuda_is_a_clear_error(tmp_path, image_root):
    if torch.cuda.is_available():  # pragma: no cover - the GPU path is exercised on a device machine
        pytest.skip("CUDA present")
    with pytest.raises(PrefetchError, match="CUDA is not available"):
        PrefetchClient(small_config(tmp_path, image_root), device="cuda")


def test_rank_comes_from_torchrun_and_mismatches_are_errors(tmp_path, image_root, monkeypatch):
    cfg = small_config(tmp_path, image_root, loader={"world_size": 4, "ranks": [2, 3]})
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert PrefetchClient(cfg).rank == 3
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ConfigError, match=r"loader.ranks \[2, 3\] does not include rank 1"):
        PrefetchClient(cfg)
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(ConfigError, match="WORLD_SIZE=8"):
        PrefetchClient(cfg, rank=2)


def test_normalize_on_tensors_and_arrays():
    x = torch.full((2, 3, 4, 4), 255, dtype=torch.uint8)
    out = normalize(x)
    assert out.dtype == torch.float32
    assert torch.allclose(out[0, :, 0, 0], torch.tensor([(1 - 0.485) / 0.229, (1 - 0.456) / 0.224, (1 - 0.406) / 0.225]))
    assert normalize(x, dtype=torch.float16).dtype == torch.float16
    a = normalize(np.zeros((1, 3, 2, 2), np.uint8))
    assert a.dtype == np.float32 and np.isclose(a[0, 0, 0, 0], -0.485 / 0.229)
    assert np.allclose(normalize(np.full((1, 3, 1, 1), 255, np.uint8), mean=[0.5] * 3, std=[0.5] * 3), 1.0)
    # mmcv's and detectron2's 0..255 constants: every pixel came out near -2.1, said nowhere
    with pytest.raises(ValueError, match=r"^mean= is in units of x / 255 .*divide it by 255"):
        normalize(x, mean=(123.675, 116.28, 103.53), std=(58.395, 57.12, 57.375))


def test_config_errors_are_prefetch_errors_and_exported(tmp_path, image_root, monkeypatch):
    """``except PrefetchError`` catches every error the client raises for its config: a missing
    file, a WORLD_SIZE the config does not have; still a ValueError naming the key, as it was."""
    import prefetchd_client as package

    assert "ConfigError" in package.__all__ and issubclass(package.ConfigError, PrefetchError)
    with pytest.raises(PrefetchError, match="cannot read config file") as e:
        PrefetchClient(str(tmp_path / "missing.yaml"))
    assert isinstance(e.value, package.ConfigError) and isinstance(e.value, ConfigError)  # still the ValueError it was
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(PrefetchError, match="WORLD_SIZE=3") as e:
        PrefetchClient(small_config(tmp_path, image_root))
    assert isinstance(e.value, ValueError) and e.value.key == "loader.world_size"
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("PREFETCHD_CONFIG", raising=False)
    with pytest.raises(package.ConfigError, match="no config given"):
        PrefetchClient()


def test_a_trainer_started_while_a_daemon_restarts_waits_for_the_new_daemons_meta(tmp_path, image_root,
                                                                                   daemon_factory):
    """A new daemon has taken the buffer's lock but not yet written its pid nor removed the last
    daemon's meta.json (a daemon of world size 4, dead now): a trainer of world size 2 starting
    in that moment must not judge the dead daemon's stream; it waits for the new one's meta.json."""
    import os
    import threading

    from conftest import wait_until

    from prefetchd.format import status

    def config(name: str, world: int) -> str:
        (tmp_path / name).mkdir()
        return small_config(tmp_path / name, image_root, loader={"world_size": world, "ranks": list(range(world))},
                            buffer={"dir": str(tmp_path / "buffer")}, dataset={"cache_dir": str(tmp_path / "cache")})

    four, two = config("four", 4), config("two", 2)
    buf = str(tmp_path / "buffer")
    old = daemon_factory(four)
    wait_until(lambda: (status.read_json(buf, status.META_NAME) or {}).get("pid") == old.pid, 60, "the old meta")
    assert old.stop() == 0
    assert status.lock_pid(buf) == old.pid and status.read_json(buf, status.META_NAME)["world_size"] == 4
    # the new daemon's first moment: the directory locked, daemon.lock and meta.json still the old one's
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY); "
                               "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); sys.stdin.read()", buf],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert status.daemon_alive(buf) is True and status.lock_pid(buf) == old.pid
        got: dict = {}

        def start_trainer():
            try:
                with PrefetchClient(two, rank=0, timeout=60, as_numpy=True) as c:
                    got["meta"] = c.meta()
            except Exception as e:  # noqa: BLE001 -- the test says what it was
                got["error"] = e

        t = threading.Thread(target=start_trainer, daemon=True)
        t.start()
        t.join(1.5)  # long enough to read the old meta.json many times over
        assert "error" not in got, f"the trainer judged the dead daemon's meta.json: {got['error']}"
        assert t.is_alive()
    finally:
        holder.stdin.close()
        holder.wait(10)
    new = daemon_factory(two)
    t.join(60)
    assert "error" not in got, got["error"]
    assert got["meta"]["pid"] == new.pid and got["meta"]["world_size"] == 2, got
    assert new.stop() == 0 and os.path.exists(os.path.join(buf, status.META_NAME))


def test_an_iteration_left_unfinished_past_the_with_block_ends_quietly_and_the_rank_stays_closed(
        tmp_path, image_root, daemon_factory):
    """``it = iter(...)``, two ``next()``, the ``with`` block ends, the script exits: the iteration is
    closed by the garbage collector at interpreter exit. Before, its clean-up ran on module globals
    already gone ("Exception ignored ... TypeError: catching classes that do not inherit from
    BaseException") and wrote the progress file again after close() had said the rank was done."""
    import json

    cfg = small_config(tmp_path, image_root)
    daemon_factory(cfg)
    code = ("import sys\nfrom prefetchd_client import PrefetchClient\n"
            "with PrefetchClient(sys.argv[1], timeout=60, as_numpy=True) as c:\n"
            "    it = c.iter_epoch(0)\n    next(it), next(it)\nprint('read', c.dir)\n")
    r = subprocess.run([sys.executable, "-c", code, cfg], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("read"), r.stdout + r.stderr
    assert "Exception ignored" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    progress = [os.path.join(dp, f) for dp, _, fs in os.walk(tmp_path) for f in fs if f.startswith("progress-r")]
    assert progress, list(os.walk(tmp_path))
    assert all(json.load(open(p))["closed"] is True for p in progress), [open(p).read() for p in progress]


def test_a_trainer_reading_numpy_arrays_never_imports_torch_and_one_reading_tensors_does(tmp_path, image_root,
                                                                                       daemon_factory):
    """torch costs a trainer process a second or more of CPU and hundreds of MB at import: a JAX or
    numpy trainer (``as_numpy=True``) never pays it; the default still yields torch tensors."""
    cfg = small_config(tmp_path, image_root)
    daemon_factory(cfg)
    code = ("import sys\nfrom prefetchd_client import PrefetchClient\n"
            "with PrefetchClient(sys.argv[1], timeout=60, as_numpy=sys.argv[2] == 'numpy') as c:\n"
            "    x, y = next(iter(c.iter_epoch(0)))\n"
            "print(type(x).__module__, type(y).__module__, 'torch' in sys.modules)\n")
    for kind, want in (("numpy", "numpy numpy False"), ("tensors", "torch torch True")):
        r = subprocess.run([sys.executable, "-c", code, cfg, kind], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.split() == want.split(), (kind, r.stdout + r.stderr[-2000:])


def test_normalize_of_numpy_arrays_imports_no_torch_and_of_a_tensor_gives_a_tensor():
    """``prefetchd_client.normalize`` on the numpy arrays of an ``as_numpy=True`` trainer costs no
    torch import either; a torch tensor, once the trainer has torch, is still normalised as one."""
    code = ("import sys, numpy as np\nimport prefetchd_client as p\n"
            "x = np.arange(2 * 3 * 4 * 4, dtype=np.uint8).reshape(2, 3, 4, 4)\n"
            "a = p.normalize(x)\n"
            "print(type(a).__module__, 'torch' in sys.modules)\n"
            "import torch\n"
            "t = p.normalize(torch.from_numpy(x))\n"
            "print(type(t).__module__, bool(abs(t.numpy() - a).max() < 1e-5))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["numpy", "False", "torch", "True"], r.stdout + r.stderr[-2000:]
