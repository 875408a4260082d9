"""Hybrid decode end to end without a GPU: the real daemon with ``augment.decode: hybrid`` and the
real client with a CPU JPEG decoder (simplejpeg) injected through ``PrefetchClient(decoder=...)``
in place of nvImageCodec. The unit tests of the format, the parameter path and the decode stage
are in test_hybrid.py; what needs a GPU (nvImageCodec, CUDA streams, rates) is not tested here."""

from __future__ import annotations

import io
import json
import os
import re
import sys

import numpy as np
import pytest
import simplejpeg
import torch
from conftest import small_config, wait_until
from PIL import Image
from prefetchd_client import PrefetchClient, PrefetchError
from prefetchd_client.gpudecode import DecodeStage

from prefetchd.core import hybrid
from prefetchd.core.config import load as load_config
from prefetchd.core.sampler import Sampler
from prefetchd.executors import builders
from prefetchd.executors.worker import BatchMaker, WorkerSetup
from prefetchd.format import jpegbatch, status
from prefetchd.format.batchfile import BatchMeta
from prefetchd.sources.dataset import load_index
from prefetchd.tools.samples import make_image_folder, photo_like

# test_hybrid.py's bounds against the CPU path's pixels, per sample: the mean difference, and the
# 99th percentile (the loose one, for samples the CPU path decodes at a reduced DCT scale)
MEAN_TOL = 2.0
P99_TOL = 20


class CountingDecoder:
    """The stand-in for nvImageCodec: RGB as stored, no EXIF orientation; counts what it decodes."""

    def __init__(self):
        self.decoded = 0

    def __call__(self, jpegs):
        self.decoded += len(jpegs)
        return [torch.from_numpy(simplejpeg.decode_jpeg(bytes(j), colorspace="RGB")) for j in jpegs]


def _enc(im: Image.Image, fmt: str = "JPEG", **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


@pytest.fixture(scope="module")
def mixed_root(tmp_path_factory) -> str:
    """Two classes of plain photo-like JPEGs with odd files among them, all named .JPEG."""
    root = tmp_path_factory.mktemp("mixed")
    make_image_folder(str(root), classes=2, per_class=10, seed=5, long_side=160)
    rng = np.random.default_rng(11)
    exif = Image.Exif()
    exif[0x0112] = 6
    odd = {
        "progressive": _enc(photo_like(rng, 150, 120), quality=90, progressive=True),
        "cmyk": _enc(photo_like(rng, 140, 110).convert("CMYK"), quality=90),
        "png": _enc(photo_like(rng, 120, 160), "PNG"),
        "grey": _enc(photo_like(rng, 160, 120).convert("L"), quality=90),
        "truncated": _enc(photo_like(rng, 160, 160), quality=90)[:2000],
        "exif6": _enc(photo_like(rng, 150, 110), quality=90, exif=exif),
    }
    for c in sorted(os.listdir(root)):
        for name, data in odd.items():
            (root / c / f"zz-{name}.JPEG").write_bytes(data)
    return str(root)


def _config(tmp_path, root: str, decode: str, sub: str) -> str:
    d = tmp_path / sub
    d.mkdir()
    return small_config(d, root, augment={"decode": decode, "gpu_share": 0.5, "brightness": 0.3},
                        buffer={"max_bytes": "16MiB"})


def _reference(cfg_path: str, epochs: int = 2) -> dict:
    """Every batch made in-process by the worker's code and, where compact, decoded by the stage
    with the same stand-in: what the daemon and the client must deliver, byte for byte."""
    cfg = load_config(cfg_path)
    index, _ = load_index(cfg.dataset.root, None, cfg.dataset.extensions, cfg.dataset.cache_dir)
    L = cfg.loader
    sampler = Sampler(len(index), L.batch_size, L.seed, L.shuffle, L.drop_last, L.world_size)
    maker = BatchMaker(WorkerSetup(cfg, index.files_dir, None, 0, cfg.buffer.dir))
    stage = DecodeStage("cpu", CountingDecoder())
    out = {}
    for e in range(epochs):
        for b in range(sampler.batches_per_epoch):
            compact = hybrid.on_gpu(cfg.augment, e, b)
            images, used, labels, replaced, _ = maker.fill(e, sampler.batch_indices(e, 0, b), maker.builder_for(e, b))
            if compact:  # within the daemon's bound, as the worker keeps it
                maker.compact.fit(builders.compact_bound(index.sample_size, sampler.batch_indices(e, 0, b),
                                                         cfg.augment.output_size))
                raw = maker.compact.pack(BatchMeta(0, e, b, sampler.batches_per_epoch, 0), used, labels, replaced)
                images = stage(jpegbatch.parse(raw)).permute(0, 2, 3, 1).numpy()
            out[(e, b)] = (images.copy(), labels.copy(), used.copy())
    return out


def _collect(client: PrefetchClient, epochs=(0, 1), stop_after: int | None = None, first: list | None = None) -> dict:
    got = {}
    for e in epochs:
        for b, (x, y) in enumerate(client.iter_epoch(e), start=client.batch if e == client.epoch else 0):
            if first is not None and not first:
                first += [x, y]  # as the trainer gets them
            x = x if isinstance(x, np.ndarray) else x.numpy()
            y = y if isinstance(y, np.ndarray) else y.numpy()
            got[(e, b)] = (np.ascontiguousarray(x.transpose(0, 2, 3, 1)), y.copy(),
                           client.last_batch.indices.copy())
            if stop_after is not None and len(got) == stop_after:
                return got
    return got


def test_hybrid_daemon_with_a_stand_in_decoder_matches_the_cpu_daemon(tmp_path, mixed_root, daemon_factory):
    cpu_cfg = _config(tmp_path, mixed_root, "cpu", "cpu")
    hyb_cfg = _config(tmp_path, mixed_root, "hybrid", "hybrid")
    d_cpu, d_hyb = daemon_factory(cpu_cfg), daemon_factory(hyb_cfg)
    with PrefetchClient(cpu_cfg, rank=0, timeout=60) as c:
        cpu = _collect(c, first=(seen_cpu := []))
    dec = CountingDecoder()
    with PrefetchClient(hyb_cfg, rank=0, timeout=60, decoder=dec) as c:
        assert c.meta()["decode"] == "hybrid"
        got = _collect(c, first=(seen_hyb := []))
    (x_cpu, y_cpu), (x_hyb, y_hyb) = seen_cpu, seen_hyb
    # what the trainer sees is unchanged: the same types, shapes, dtypes and strides
    assert type(x_hyb) is type(x_cpu) and x_hyb.dtype == x_cpu.dtype == torch.uint8
    assert x_hyb.shape == x_cpu.shape and x_hyb.stride() == x_cpu.stride() and y_hyb.dtype == y_cpu.dtype
    assert x_hyb.is_contiguous(memory_format=torch.channels_last)
    assert dec.decoded > 0  # the compact batches were decoded by the client, through the injected decoder
    assert sorted(got) == sorted(cpu) and len(got) == 10  # 5 batches x 2 epochs
    aug = load_config(hyb_cfg).augment
    for key, (images, labels, indices) in got.items():
        ref_images, ref_labels, ref_indices = cpu[key]
        assert labels.tolist() == ref_labels.tolist() and indices.tolist() == ref_indices.tolist(), key
        if not hybrid.on_gpu(aug, *key):
            assert np.array_equal(images, ref_images), key  # a batch the daemon decoded: the same bytes
            continue
        for k in range(len(images)):
            diff = np.abs(images[k].astype(int) - ref_images[k].astype(int))
            assert diff.mean() < MEAN_TOL and np.percentile(diff, 99) <= P99_TOL, (key, k, diff.mean())
    # the same stand-in in-process gives the very same bytes: nothing in the ring or the client adds noise
    ref = _reference(hyb_cfg)
    for key, (images, _, indices) in got.items():
        assert np.array_equal(images, ref[key][0]) and np.array_equal(indices, ref[key][2]), key
    # the odd files went the CPU way or were quarantined (the truncated one), as with decode: cpu
    quarantined = [json.loads(line)["path"] for line in
                   open(os.path.join(load_config(hyb_cfg).buffer.dir, "quarantine.jsonl"))]
    assert quarantined and all(p.endswith("zz-truncated.JPEG") for p in quarantined)
    for d in (d_cpu, d_hyb):
        assert d.stop() == 0
        assert "Traceback" not in d.log()


def _is_compact(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return jpegbatch.is_compact(f.read(8))
    except FileNotFoundError:  # consumed meanwhile
        return False


def test_hybrid_restart_mid_run_is_bit_identical(tmp_path, mixed_root, daemon_factory):
    cfg = _config(tmp_path, mixed_root, "hybrid", "run")
    buf = load_config(cfg).buffer.dir
    d = daemon_factory(cfg)
    with PrefetchClient(cfg, rank=0, timeout=60, as_numpy=True, decoder=CountingDecoder()) as c:
        first = _collect(c, stop_after=3)
        state = c.state_dict()
    # batches ahead of the trainer are in the ring, compact ones among them, when the daemon stops.
    # Looked for once the client is closed: before, its reader could still read the batch seen here
    # (the daemon deletes a batch once it is read), leaving the ring empty at the stop (a CI run did)
    wait_until(lambda: any(_is_compact(os.path.join(buf, n)) for n in os.listdir(buf) if n.endswith(".batch")),
               what="a compact batch in the ring")
    assert d.stop() == 0
    d2 = daemon_factory(cfg)
    wait_until(lambda: status.daemon_alive(buf), what="the second daemon")
    with PrefetchClient(cfg, rank=0, timeout=60, as_numpy=True, decoder=CountingDecoder()) as c:
        c.load_state_dict(state)
        rest = _collect(c)
    # the batches left in the ring, compact ones among them, were adopted, none thrown away as corrupt
    assert re.search(r"buffer recovered: kept [1-9]\d* batches; removed \d+ temp, 0 torn", d2.log()), d2.log()
    got = {**first, **rest}
    ref = _reference(cfg)
    assert sorted(got) == sorted(ref)
    for key in ref:
        assert np.array_equal(got[key][0], ref[key][0]) and np.array_equal(got[key][1], ref[key][1]), key
    assert d2.stop() == 0
    assert "Traceback" not in d.log() + d2.log()


def test_without_the_gpu_extra_the_client_fails_at_start_naming_it(tmp_path, mixed_root, monkeypatch):
    cfg = _config(tmp_path, mixed_root, "hybrid", "noextra")
    with pytest.raises(PrefetchError) as e:
        PrefetchClient(cfg, rank=0, timeout=5)  # no device, no decoder; no daemon needed: the check comes first
    msg = str(e.value)
    assert "\n" not in msg and "prefetchd[gpu]" in msg and msg.startswith("augment.decode: hybrid")
    # a machine with CUDA but without the extra
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", None)  # import fails as if not installed
    monkeypatch.setitem(sys.modules, "nvidia", None)
    with pytest.raises(PrefetchError) as e:
        PrefetchClient(cfg, rank=0, timeout=5, device="cuda:0")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("augment.decode: hybrid: nvImageCodec is not installed")
    assert "pip install 'prefetchd[gpu]'" in msg
    PrefetchClient(_config(tmp_path, mixed_root, "cpu", "cpuok"), rank=0, timeout=5).close()  # cpu needs nothing


def test_compact_batches_through_the_pinned_pool_and_side_stream(tmp_path, mixed_root, daemon_factory):
    """The device path (pinned buffers from the pool, decode and copies on the side stream, the
    trainer waiting on the event) with the stand-in copy engine of test_client_memory on "cpu"."""
    from test_client_memory import DeferredCopies

    cfg = _config(tmp_path, mixed_root, "gpu", "pinned")
    d = daemon_factory(cfg)
    copies = DeferredCopies(seed=3)
    kept = []
    with PrefetchClient(cfg, device="cpu", transfer=copies, prefetch=2, timeout=60, decoder=CountingDecoder()) as c:
        assert c.pin_memory
        for e in (0, 1):
            for b, (x, y) in enumerate(c):
                assert x.is_contiguous(memory_format=torch.channels_last) and y.dtype == torch.int64
                kept.append(((e, b), x, y))
        # never more than prefetch + 1 pinned buffers alive, reused across batches; every batch waited
        # for. Compact batches differ in size, so a free buffer too small for the next one is replaced:
        # how often depends on which buffer's copy finished first, so allocations are not a fixed 3.
        assert c._pool.peak <= 3 and copies.blocks < 10 and copies.waits == 10
    ref = _reference(cfg)
    assert [k for k, _, _ in kept] == sorted(ref)
    for key, x, y in kept:  # compared after the whole run: no pinned buffer reuse changed a yielded batch
        assert np.array_equal(x.permute(0, 2, 3, 1).numpy(), ref[key][0]), key
        assert np.array_equal(y.numpy(), ref[key][1]), key
    assert d.stop() == 0


def test_the_estimate_bounds_every_compact_batch_before_any_is_published(tmp_path, mixed_root):
    """Output 16x16 and whole JPEGs: compact batches are far above pixel batches. The bound the
    planner uses comes from the batch's own files (no batch published yet, none adopted), and
    the worker keeps a batch with a quarantined sample's larger stand-in within it."""
    from prefetchd.daemon.loop import Daemon
    from prefetchd.executors.worker import Task

    cfg = load_config(small_config(tmp_path, mixed_root, augment={"decode": "gpu", "output_size": 16}))
    d = Daemon(cfg)
    d.index, _ = load_index(cfg.dataset.root, None, cfg.dataset.extensions, cfg.dataset.cache_dir)
    L = cfg.loader
    d.sampler = Sampler(len(d.index), L.batch_size, L.seed, L.shuffle, L.drop_last, L.world_size)
    maker = BatchMaker(WorkerSetup(cfg, d.index.files_dir, None, 0, str(tmp_path)))
    for e in range(3):
        for b in range(d.sampler.batches_per_epoch):
            est = d._estimate((0, e, b))
            task = Task(0, e, b, d.sampler.batches_per_epoch, d.sampler.batch_indices(e, 0, b), budget=est)
            res = maker.make(task)
            assert res.error is None and res.size <= est, (e, b, res.size, est)
            os.unlink(res.tmp_path)
    assert est > 5 * (16 * 16 * 3 * 6)  # compact batches, far above a pixel batch
    # a budget below what the JPEGs need: the largest become pixels until the batch fits
    idx = d.sampler.batch_indices(0, 0, 0)
    tight = builders.compact_bound(lambda i: 0, idx, 16)  # every sample at pixel size
    res = maker.make(Task(0, 0, 0, d.sampler.batches_per_epoch, idx, budget=tight))
    assert res.error is None and res.size <= tight
    assert (jpegbatch.read_file(res.tmp_path).params["kind"] == jpegbatch.KIND_PIXELS).all()


@pytest.mark.parametrize("layout", ["train_tar", "train_tars"])
def test_the_estimate_of_a_tar_dataset_counts_its_members_sizes_as_the_folder_s(tmp_path, layout):
    """A sample in an archive has no file to stat: the bound takes its size from the index, so a
    compact batch from the tar keeps as many JPEGs for the GPU as the same batch from the folder."""
    from imagenet_archives import make_imagenet

    from prefetchd.daemon.loop import Daemon
    from prefetchd.executors.worker import Task

    net = make_imagenet(str(tmp_path / "net"), classes=3, per_class=8, val=2, side=96)
    made = {}
    for root in (net.train_folder, getattr(net, layout)):
        sub = tmp_path / os.path.basename(root)
        sub.mkdir()
        cfg = load_config(small_config(sub, root, augment={"decode": "gpu", "output_size": 16}))
        d = Daemon(cfg)
        d.index, _ = load_index(cfg.dataset.root, None, cfg.dataset.extensions, cfg.dataset.cache_dir)
        L = cfg.loader
        d.sampler = Sampler(len(d.index), L.batch_size, L.seed, L.shuffle, L.drop_last, L.world_size)
        maker = BatchMaker(WorkerSetup(cfg, d.index.files_dir, None, 0, str(tmp_path)))
        made[root] = []
        for b in range(d.sampler.batches_per_epoch):
            est = d._estimate((0, 0, b))
            res = maker.make(Task(0, 0, b, d.sampler.batches_per_epoch, d.sampler.batch_indices(0, 0, b), budget=est))
            kinds = jpegbatch.read_file(res.tmp_path).params["kind"]
            os.unlink(res.tmp_path)
            made[root].append((est, int((kinds == jpegbatch.KIND_PIXELS).sum())))
    folder, tar = made[net.train_folder], made[getattr(net, layout)]
    assert tar == folder, (tar, folder)
    assert sum(p for _, p in tar) < len(d.index) // 2  # most JPEGs went to the GPU


def test_compact_batches_larger_than_pixel_batches_keep_max_bytes(tmp_path, mixed_root, daemon_factory):
    """Small outputs of whole JPEGs: a compact batch is many times a pixel batch's size, so the
    pixel-batch estimate would let the ring run past buffer.max_bytes; each compact batch's
    bound, from its files' sizes, keeps it within, at every moment (temp files included)."""
    d_ = tmp_path / "tight"
    d_.mkdir()
    max_bytes = 170_000  # a few compact batches of this corpus, fewer than capacity
    cfg = small_config(d_, mixed_root, augment={"decode": "gpu", "output_size": 16},
                       workers={"count": 2, "max_tasks_in_flight": 2},
                       buffer={"capacity": 8, "refill_at": 8, "max_bytes": max_bytes})
    buf = load_config(cfg).buffer.dir
    d = daemon_factory(cfg)

    def ring_bytes() -> int:
        n = 0
        for name in os.listdir(buf) if os.path.isdir(buf) else ():
            if name.endswith(".batch") or name.startswith(".tmp-"):
                try:
                    n += os.path.getsize(os.path.join(buf, name))
                except FileNotFoundError:
                    pass
        return n

    def blocked():
        assert ring_bytes() <= max_bytes
        s = status.read_json(buf, status.STATUS_NAME)
        return s and s.get("blocked") and s

    st = wait_until(blocked, 60, "the daemon to stop at buffer.max_bytes")
    sizes = [os.path.getsize(os.path.join(buf, n)) for n in sorted(os.listdir(buf)) if n.endswith(".batch")]
    assert len(sizes) >= 2 and min(sizes) > 5 * (16 * 16 * 3 * 6)  # compact batches, far above pixels
    assert "max_bytes" in st["blocked"] and st["bytes_used"] == sum(sizes) <= max_bytes, (st, sizes)
    assert d.stop() == 0


def test_a_sample_neither_the_gpu_nor_the_cpu_can_decode_is_replaced_and_training_goes_on(
        tmp_path, mixed_root, daemon_factory, monkeypatch, caplog):
    from prefetchd_client import gpudecode

    def refuse_first(jpegs):  # the "GPU" decoder fails on the first JPEG of every batch
        return [None] + CountingDecoder()(jpegs[1:])

    def cpu_fails(jpeg, device):
        raise ValueError("Corrupt JPEG data: premature end of data segment")

    monkeypatch.setattr(gpudecode, "_cpu_decode", cpu_fails)
    cfg = _config(tmp_path, mixed_root, "gpu", "corrupt")
    d = daemon_factory(cfg)
    ref = _reference(cfg, epochs=1)
    seen = []
    with caplog.at_level("WARNING", logger="prefetchd_client.gpudecode"):
        with PrefetchClient(cfg, prefetch=2, timeout=60, decoder=refuse_first) as c:
            for b, (x, y) in enumerate(c.iter_epoch(0)):
                seen.append(b)
                info = c.last_batch
                # the daemon's replacements name the sample they stood in for (another index);
                # the client's stand-ins for a sample it could not decode name the sample itself
                stood_in = np.flatnonzero(info.replaced == info.indices)
                assert len(stood_in) <= 1
                for k in range(len(y)):
                    want = np.zeros_like(ref[(0, b)][0][k]) if k in stood_in else ref[(0, b)][0][k]
                    assert np.array_equal(x[k].permute(1, 2, 0).numpy(), want), (b, k)
                assert np.array_equal(y.numpy(), ref[(0, b)][1])
    assert seen == sorted(b for e, b in ref if e == 0)
    # the decoder's own lines (the loader may say at once that it waits for a daemon still starting)
    warned = [r.getMessage() for r in caplog.records if r.name == "prefetchd_client.gpudecode"]
    assert warned and all("zeros stand in" in m and "dataset sample" in m for m in warned)
    # the fallbacks are counted where an operator looks: status.json, `prefetchd status`, /metrics
    buf = load_config(cfg).buffer.dir
    st = wait_until(lambda: (s := status.read_json(buf, status.STATUS_NAME)) and
                    s["ranks"]["0"].get("gpu_fallbacks", 0) >= len(seen) - 1 and s, 30, "the fallbacks in status.json")
    assert "samples its GPU could not decode" in status.format_status(st, True)
    from prefetchd.daemon.metrics import families
    fam = {f.name: f for f in families(st)}["prefetchd_trainer_gpu_decode_fallbacks"]
    assert [(s.labels, s.value) for s in fam.samples if s.name.endswith("_total")] == \
        [({"rank": "0"}, st["ranks"]["0"]["gpu_fallbacks"])]
    assert d.stop() == 0


def test_pin_memory_without_a_device_yields_compact_batches_in_fresh_pinned_blocks(tmp_path, mixed_root,
                                                                                  daemon_factory):
    """As for pixel batches (test_client_memory.py): ``pin_memory=True`` and no device yields
    tensors in pinned memory, each batch in a block of its own, with the stand-in for pinning."""
    from test_client_memory import DeferredCopies

    class Blocks(DeferredCopies):
        def __init__(self):
            super().__init__()
            self.ptrs = set()

        def empty(self, nbytes):
            t = super().empty(nbytes)
            self.ptrs.add(t.untyped_storage().data_ptr())
            return t

    cfg = _config(tmp_path, mixed_root, "gpu", "pinnedcpu")
    d = daemon_factory(cfg)
    ref = _reference(cfg, epochs=1)
    blocks = Blocks()
    with PrefetchClient(cfg, pin_memory=True, transfer=blocks, prefetch=2, timeout=60, decoder=CountingDecoder()) as c:
        assert c.pin_memory and c.device is None
        kept = [(b, x, y) for b, (x, y) in enumerate(c.iter_epoch(0))]
    storages = set()
    for b, x, y in kept:
        ptr = x.untyped_storage().data_ptr()
        assert ptr in blocks.ptrs and y.untyped_storage().data_ptr() == ptr, b  # in a pinned block, both
        storages.add(ptr)
        assert x.is_contiguous(memory_format=torch.channels_last) and y.dtype == torch.int64
        assert np.array_equal(x.permute(0, 2, 3, 1).numpy(), ref[(0, b)][0]), b  # unchanged after it was yielded
        assert np.array_equal(y.numpy(), ref[(0, b)][1]), b
    assert len(storages) == len(kept) == 5
    assert d.stop() == 0
