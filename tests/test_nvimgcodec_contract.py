"""The client's use of nvImageCodec, checked against the real wheel without a GPU.

nvImageCodec (the ``dev`` extra installs it with its nvJPEG runtime) imports, registers its nvJPEG
back-end and parses code streams on a machine without CUDA; only decoding needs a GPU. So CI
checks here that every nvImageCodec name the client uses exists in the installed release (the
landed client used ``ColorSpec.RGB``, renamed ``SRGB`` in 0.7), that the start-up check finds the
back-end, and that the odd JPEGs of the tests reach the right path: what the daemon sends to the
GPU, nvImageCodec parses; what nvImageCodec cannot parse, the daemon keeps, and should one reach
the client anyway it falls back alone, on the CPU."""

from __future__ import annotations

import re

import numpy as np
import pytest
import simplejpeg
import torch
from prefetchd_client import gpudecode, gpuops
from prefetchd_client.gpudecode import DecodeStage, DecodeUnavailable
from test_hybrid import _BASE, _RST, CORRUPT_JPEGS, META, PHOTO, enc, with_orientation

from prefetchd.core import hybrid
from prefetchd.core.augment import modes as augment
from prefetchd.core.config import AugmentConfig
from prefetchd.executors import builders
from prefetchd.format import jpegbatch
from prefetchd.tools.samples import photo_like

nv = pytest.importorskip("nvidia.nvimgcodec", reason="nvImageCodec is in the dev extra: pip install -e '.[dev]'")


def test_every_nvimgcodec_name_the_client_uses_exists_in_the_installed_release():
    version = tuple(int(x) for x in nv.__version__.split(".")[:2])
    assert version >= gpudecode.NVIMGCODEC_MIN_VERSION, nv.__version__
    for name in gpudecode.NVIMGCODEC_NAMES:
        assert gpudecode._has_path(nv, name), f"nvImageCodec {nv.__version__} has no {name}"
    # every nv.X in the module is one of the names checked (a new use must be added to the list)
    source = open(gpudecode.__file__).read()
    used = set(re.findall(r"\bnv\.([A-Za-z_][\w.]*[A-Za-z_\d])", source))
    used |= set(re.findall(r"self\._nv\.([A-Za-z_][\w.]*[A-Za-z_\d])", source))
    assert used and used <= set(gpudecode.NVIMGCODEC_NAMES), used - set(gpudecode.NVIMGCODEC_NAMES)
    # the keywords the client passes
    p = gpudecode.decode_params(nv)
    assert p.color_spec == nv.ColorSpec.SRGB and p.apply_exif_orientation is False and p.allow_any_depth is False
    assert "device_id" in nv.Decoder.__init__.__doc__
    assert "cuda_stream" in nv.Decoder.decode.__doc__ and "params" in nv.Decoder.decode.__doc__
    assert "region" in nv.CodeStream.get_sub_code_stream.__doc__


def test_the_start_up_check_finds_the_nvjpeg_back_end_and_refuses_without_it(monkeypatch, tmp_path):
    assert gpudecode.nvjpeg_registered() is True  # the dev extra brings nvidia-nvjpeg
    assert gpudecode.load_nvimgcodec() is nv
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 00:00 0 /x/nvidia/nvimgcodec/extensions/libnvjpeg_ext.so.0.9.0\n")
    assert gpudecode.nvjpeg_registered(str(maps)) is False  # the extension alone registers nothing
    maps.write_text(maps.read_text() + "7f02-7f03 r-xp 0 00:00 0 /x/nvidia/cu13/lib/libnvjpeg.so.13\n")
    assert gpudecode.nvjpeg_registered(str(maps)) is True
    # torchvision imported first: its bundled copy (as an H100 machine's torchvision 0.26 maps it)
    # is the one nvImageCodec's dlopen of libnvjpeg.so.13 finds
    maps.write_text("7f00-7f01 r-xp 0 00:00 0 /x/nvidia/nvimgcodec/extensions/libnvjpeg_ext.so.0.9.0\n"
                    "7f02-7f03 r-xp 0 00:00 0 /v/site-packages/torchvision.libs/libnvjpeg.36e11081.so.13\n")
    assert gpudecode.nvjpeg_registered(str(maps)) is True
    for other in ("/x/nvidia/nvimgcodec/extensions/libnvjpeg2k_ext.so.0.9.0", "/x/lib/libnvjpeg2k.so.0",
                  "/x/nvidia/nvimgcodec/extensions/libnvjpeg_ext.so.0.9.0"):
        maps.write_text(f"7f00-7f01 r-xp 0 00:00 0 {other}\n")
        assert gpudecode.nvjpeg_registered(str(maps)) is False, other
    assert gpudecode.nvjpeg_registered(str(tmp_path / "none")) is None
    monkeypatch.setattr(gpudecode, "nvjpeg_registered", lambda: False)
    with pytest.raises(DecodeUnavailable, match=r"nvJPEG back-end is not registered.*pip install 'prefetchd\[gpu\]'"):
        gpudecode.load_nvimgcodec()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(DecodeUnavailable, match="nvJPEG back-end is not registered"):
        DecodeStage("cuda:0")  # at construction, before any CUDA work


def _odd_files() -> dict:
    rng = np.random.default_rng(9)
    files = {
        "plain": enc(photo_like(rng, 300, 200), quality=90),
        "progressive": enc(photo_like(rng, 260, 300), quality=90, progressive=True),
        "cmyk": enc(photo_like(rng, 280, 210).convert("CMYK"), quality=90),
        "png": enc(photo_like(rng, 240, 320), "PNG"),
        "grey": enc(photo_like(rng, 310, 230).convert("L"), quality=90),
        "truncated": enc(photo_like(rng, 300, 300), quality=90)[:3000],
        "s444": enc(photo_like(rng, 200, 260), quality=90, subsampling=0),
        "s422": enc(PHOTO, quality=90, subsampling=1),
        "restart markers": _RST,
        "base": _BASE,
        **{f"exif{o}": with_orientation(photo_like(rng, 330, 220), o, quality=90) for o in range(2, 9)},
    }
    return {**files, **{name: data for name, data, _ in CORRUPT_JPEGS}}


def test_every_jpeg_the_daemon_sends_to_the_gpu_parses_in_nvimgcodec_and_what_does_not_parse_stays():
    files = _odd_files()
    names = list(files)
    streams = gpudecode.code_streams(nv, [np.frombuffer(files[k], np.uint8) for k in names])
    sent = 0
    for name, cs in zip(names, streams, strict=True):
        info = hybrid.scan_jpeg(files[name])
        refusal = hybrid.hw_refusal(info)
        if refusal is None:
            sent += 1
            assert not isinstance(cs, str), (name, cs)
            assert cs.codec_name == "jpeg" and (cs.width, cs.height) == (info.width, info.height), name
            assert cs.num_channels == len(info.components), name
            box = gpuops.coded_box((3, 5, 40, 50), 1, info.width, info.height)
            sub = gpudecode.code_streams(nv, [np.frombuffer(files[name], np.uint8)], [box])[0]
            assert not isinstance(sub, str), (name, sub)
        elif isinstance(cs, str):  # nvImageCodec cannot parse it: the daemon keeps it, whatever its reason
            assert "cannot parse" in cs, name
    assert sent >= 10
    unparsed = {n for n, cs in zip(names, streams, strict=True) if isinstance(cs, str)}
    assert {"TEM before the scan", "RST before the scan"} <= unparsed, unparsed


class ParsingDecoder:
    """nvImageCodec's parsing, per sample, in front of a CPU decode: what NvImageCodecDecoder does
    up to the GPU decode."""

    supports_regions = True

    def __init__(self):
        self.refused = []

    def __call__(self, jpegs, regions):
        streams = gpudecode.code_streams(nv, jpegs, regions)
        self.refused = [s if isinstance(s, str) else None for s in streams]
        out = []
        for j, s in zip(jpegs, streams, strict=True):
            if isinstance(s, str):
                out.append(None)
                continue
            out.append(torch.from_numpy(simplejpeg.decode_jpeg(bytes(j), colorspace="RGB")))
        return [None if o is None else o[b[1]:b[3], b[0]:b[2]] for o, b in zip(out, regions, strict=True)]


def test_a_jpeg_nvimgcodec_cannot_parse_that_reaches_the_client_falls_back_alone(monkeypatch, caplog):
    """The daemon keeps a JPEG with an RST marker before its scan (Pillow and libjpeg take it,
    nvImageCodec's parser does not; Pillow refuses a TEM there, so such a file is quarantined on
    either path); one that gets through anyway (an older daemon, say) is decoded on the CPU, and
    the rest of its batch on the "GPU"."""
    builder = builders.CompactBuilder(AugmentConfig(output_size=32, scale_min=40, scale_max=60, decode="gpu"))
    images = np.zeros((3, 32, 32, 3), np.uint8)
    builder.reset(images)
    tem = CORRUPT_JPEGS[1][1]
    assert CORRUPT_JPEGS[1][0] == "RST before the scan"
    with monkeypatch.context() as m:
        m.setattr(hybrid, "hw_refusal", lambda info: None)
        for k, data in enumerate((_BASE, tem, _BASE)):
            builder.add(data, augment.draws(0, 0, k), images[k])
    b = jpegbatch.parse(builder.pack(META, np.array([11, 12, 13]), np.zeros(3), np.full(3, -1)))
    assert (b.params["kind"] == jpegbatch.KIND_JPEG).all()
    stage = DecodeStage("cpu", decoder=ParsingDecoder())
    with caplog.at_level("WARNING", logger="prefetchd_client.gpudecode"):
        x = stage(b)
    assert stage.fallbacks == 1 and stage.replaced == 0
    [msg] = [r.getMessage() for r in caplog.records]
    assert "dataset sample 12" in msg and "nvImageCodec cannot parse it" in msg and "on the CPU instead" in msg
    # libjpeg takes the RST marker: the same pixels as the plain file with the same draws would give
    ref = DecodeStage("cpu", decoder=lambda jpegs: [torch.from_numpy(simplejpeg.decode_jpeg(bytes(j), colorspace="RGB"))
                                                     for j in jpegs])(b)
    assert torch.equal(x, ref)
