"""The client's decode stage for compact batches (``augment.decode: hybrid | gpu``).

``DecodeStage(device)`` turns a parsed ``prefetchd.format.jpegbatch.JpegBatch`` into the uint8
``[B, 3, H, W]`` channels-last tensor the CPU path yields: JPEG payloads are decoded on the device
in one batched call (nvImageCodec, which uses the GPU's hardware JPEG engines where it can), each
only over the region its crop needs; then the whole batch is turned upright (EXIF orientation),
reduced, resampled (2x area halving while the region is at least twice the output, then the
configured filter, as ``prefetchd.core.augment`` does, rounding after each step), jittered, lit and
flipped with the parameters the daemon drew, in a few batched launches (``resample_batch``: each
step is a pair of batched matrix products over the padded batch). PIXELS payloads (files the
daemon decoded on its CPU) are copied in unchanged. Crops, flips, jitter parameters and labels
equal the CPU path's; the pixels differ slightly (the IDCT, the resampling arithmetic, and
lanczos, which is done as bicubic).

The decoder is injectable: anything called as ``decoder(jpegs)`` with a list of uint8 numpy arrays
(the JPEG files) that returns, per file, a uint8 tensor ``[h, w, 3]`` (RGB, as stored: no EXIF
orientation applied) on the stage's device, or None where it failed. A decoder with
``supports_regions = True`` is called as ``decoder(jpegs, regions)`` with, per file, the box
``(x0, y0, x1, y1)`` of the stored image the stage needs, and returns just that box. Tests use a
CPU decoder on ``device="cpu"``; the default needs ``pip install 'prefetchd[gpu]'`` and CUDA.

A sample the decoder fails on (None, a wrong shape, or an exception out of the decoder) is decoded
on the CPU instead, and where that fails too, zeros stand in for it: no decoder failure ends a
batch. Each fallback is counted (``fallbacks``, which the client reports to the daemon); the
first is logged in one line, and after that one line per ``_WARN_EVERY`` more.

Imports only numpy, torch and the shared format module (nvImageCodec lazily, when the default
decoder is made).
"""

from __future__ import annotations

import logging
import re
import time
import warnings
from collections.abc import Callable, Sequence

import numpy as np
import torch

from prefetchd.format import jpegbatch

from .gpuops import (
    _to_device,
    apply_jitter,
    apply_lighting,
    coded_box,
    resample_batch,
)

_log = logging.getLogger(__name__)

GPU_EXTRA_HINT = "install the GPU extra: pip install 'prefetchd[gpu]' (nvImageCodec; see docs/hybrid-decode.md)"
_WARN_EVERY = 1000  # after the first fallback, one log line per this many more
# Every nvImageCodec name this module uses (tests/test_nvimgcodec_contract.py checks them against
# the installed wheel: ColorSpec.RGB, say, was renamed SRGB in nvImageCodec 0.7)
NVIMGCODEC_NAMES = ("CodeStream", "CodeStream.get_sub_code_stream", "Decoder", "Decoder.decode", "DecodeParams",
                    "ColorSpec.SRGB", "Region", "__version__")
NVIMGCODEC_MIN_VERSION = (0, 9)


class DecodeUnavailable(RuntimeError):
    """The default GPU decoder cannot run here; the message says what to install or change."""


class DecodeError(RuntimeError):
    """A JPEG of a compact batch could not be decoded on the device (the stage then decodes it
    on the CPU, and failing that puts a stand-in in its place: it never ends the iteration)."""


Decoder = Callable[..., Sequence["torch.Tensor | None"]]


def load_nvimgcodec():
    """nvImageCodec's module, once checked: it imports, has every name this module uses, and its
    nvJPEG back-end (the GPU decoders: hardware engines and CUDA) is registered. Raises
    DecodeUnavailable saying what to install otherwise. Makes no CUDA context."""
    try:
        from nvidia import nvimgcodec
    except ImportError as e:
        raise DecodeUnavailable(f"nvImageCodec is not installed ({e}); {GPU_EXTRA_HINT}") from None
    version = str(getattr(nvimgcodec, "__version__", "?"))
    missing = [name for name in NVIMGCODEC_NAMES if not _has_path(nvimgcodec, name)]
    try:
        too_old = tuple(int(x) for x in version.split(".")[:2]) < NVIMGCODEC_MIN_VERSION
    except ValueError:
        too_old = False
    if missing or too_old:
        raise DecodeUnavailable(f"nvImageCodec {version} is not a release this client works with (it lacks "
                                f"{', '.join(missing) or 'nothing, but is older than 0.9'}); {GPU_EXTRA_HINT}")
    if nvjpeg_registered() is False:
        raise DecodeUnavailable(f"nvImageCodec {version} is installed but its nvJPEG back-end is not registered "
                                "(it could not load libnvjpeg, and without it every JPEG would be decoded on the "
                                "CPU); install the nvJPEG runtime with it: pip install 'prefetchd[gpu]' "
                                "(nvidia-nvimgcodec-cu13[nvjpeg], or prefetchd[gpu-cu12] for CUDA 12 builds of torch)")
    return nvimgcodec


# the nvJPEG library under any name the dynamic loader gives it: libnvjpeg.so.13 (the nvidia-nvjpeg
# wheel, the CUDA toolkit), or a wheel's bundled copy renamed by auditwheel, libnvjpeg.36e11081.so.13
# (torchvision's: with torchvision imported first, nvImageCodec's dlopen of the soname finds that
# copy, and the back-end works on it). Not nvJPEG2000 (libnvjpeg2k) nor the extension itself.
_NVJPEG_LIB = re.compile(r"/libnvjpeg(\.[0-9a-f]{8})?\.so(\.\d+)*$")


def nvjpeg_registered(maps_path: str = "/proc/self/maps") -> bool | None:
    """Whether nvImageCodec's nvJPEG extension loaded the nvJPEG library, which it does as the
    module is imported (registering its decoders only if that works): the library is mapped in
    this process. None where that cannot be told (no /proc)."""
    try:
        with open(maps_path) as f:
            return any(_NVJPEG_LIB.search(line.rstrip("\n")) for line in f)
    except OSError:
        return None


def _has_path(obj, dotted: str) -> bool:
    for part in dotted.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def decode_params(nv):
    """What the stage asks nvImageCodec for: RGB as stored (the stage applies EXIF orientation
    itself, from the daemon's parameters), 8 bits."""
    return nv.DecodeParams(apply_exif_orientation=False, color_spec=nv.ColorSpec.SRGB, allow_any_depth=False)


def code_streams(nv, jpegs: Sequence[np.ndarray], regions=None) -> list:
    """Per file, its nvImageCodec CodeStream (restricted to ``regions[k]``, (x0, y0, x1, y1),
    when given), or the reason it cannot be had: nvImageCodec's parser refuses some files libjpeg
    takes (a TEM or RST marker before the scan, say), and one refusal must not fail the others."""
    out: list = []
    for k, j in enumerate(jpegs):
        try:
            cs = nv.CodeStream(np.ascontiguousarray(j, dtype=np.uint8))
            _ = cs.width  # the constructor parses nothing (0.9): reading the header does
            if regions is not None:
                x0, y0, x1, y1 = (int(v) for v in regions[k])
                cs = cs.get_sub_code_stream(region=nv.Region(y0, x0, y1, x1))
                _ = cs.width
            out.append(cs)
        except Exception as e:  # RuntimeError("Failed to get image info") in 0.9
            out.append(f"nvImageCodec cannot parse it ({type(e).__name__}: {e})")
    return out


class NvImageCodecDecoder:
    """Batched JPEG decoding with nvImageCodec on one CUDA device, on the current CUDA stream.

    Made at start-up, it only checks (``load_nvimgcodec``): raises DecodeUnavailable (naming the
    extra) where nvImageCodec or its nvJPEG back-end is missing or the device is not a CUDA
    device. nvImageCodec's decoder itself is made at the first call, on ``device`` (the client
    resolves ``cuda`` to the trainer's device first: under torchrun, after its ``set_device``).
    nvImageCodec picks the hardware JPEG engines where the GPU has them and the file allows, and
    its CUDA decoder otherwise. Decodes only each file's region."""

    supports_regions = True

    def __init__(self, device):
        self.device = torch.device(device)
        if self.device.type != "cuda" or not torch.cuda.is_available():
            raise DecodeUnavailable(f"augment.decode: hybrid | gpu needs a CUDA device, got {str(device)!r} "
                                    f"(torch.cuda.is_available() is {torch.cuda.is_available()}); "
                                    f"{GPU_EXTRA_HINT}, on a machine with CUDA, or set augment.decode: cpu")
        self._nv = load_nvimgcodec()
        self._decoder = None
        self._params = decode_params(self._nv)
        self.refused: list[str | None] = []  # per file of the last call: why it was not decoded, else None

    def _made(self):
        if self._decoder is None:
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            self._decoder = self._nv.Decoder(device_id=index)
        return self._decoder

    def __call__(self, jpegs: Sequence[np.ndarray], regions=None) -> list:
        if not len(jpegs):
            return []
        streams = code_streams(self._nv, jpegs, regions)
        ok = [k for k, s in enumerate(streams) if not isinstance(s, str)]
        self.refused = [s if isinstance(s, str) else None for s in streams]
        out: list = [None] * len(jpegs)
        if not ok:
            return out
        stream = torch.cuda.current_stream(self.device)
        # nvImageCodec allocates the images on this stream and frees them on it (stream-ordered),
        # so the copies the stage queues after this call read them before they are reused
        images = self._made().decode([streams[k] for k in ok], params=self._params, cuda_stream=stream.cuda_stream)
        for k, im in zip(ok, images, strict=True):
            if im is not None:
                out[k] = torch.as_tensor(im, device=self.device)
        return out


class DecodeStage:
    """Decodes compact batches on ``device``; ``decoder`` defaults to nvImageCodec (CUDA only).

    ``fallbacks`` counts the samples the decoder failed on (decoded on the CPU instead, or
    replaced by zeros where that failed too), ``replaced`` the latter; ``host_s`` and ``batches``
    are the host time spent in calls and their number (the device work runs on after a call)."""

    def __init__(self, device="cuda", decoder: Decoder | None = None):
        self.device = torch.device(device)
        self.decoder = decoder if decoder is not None else NvImageCodecDecoder(self.device)
        self.fallbacks = 0
        self.replaced = 0
        self.host_s = 0.0
        self.batches = 0

    def __call__(self, b: jpegbatch.JpegBatch, source: torch.Tensor | None = None,
                 replaced: np.ndarray | None = None, transfer=None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The batch's images, uint8 ``[n, 3, H, W]`` with channels-last strides, on the device.

        ``source``, if given, is a uint8 tensor over the same memory ``b`` was parsed from (e.g.
        the client's pinned buffer): PIXELS payloads are copied from views of it, asynchronously
        when it is pinned, through ``transfer.copy_(dst, src)`` when a transfer is given. ``out``,
        if given, is a uint8 tensor on the device of at least ``n * H * W * 3`` bytes to hold the
        images (a pinned block, say); the result is a view of it.

        A JPEG the decoder fails on (None, the wrong shape, an exception) is decoded on the CPU
        (simplejpeg) instead; if that fails too, zeros stand in for it and ``replaced[k]`` (when
        given) is set to its dataset index, with a warning naming the sample: a corrupt image
        never ends training."""
        t0 = time.perf_counter()
        n, hh, ww = len(b), b.height, b.width
        if out is None:
            out = torch.empty((n, hh, ww, 3), dtype=torch.uint8, device=self.device)
        else:
            out = out.view(-1)[: n * hh * ww * 3].view(n, hh, ww, 3)
        kinds = b.params["kind"]
        for k in np.flatnonzero(kinds == jpegbatch.KIND_PIXELS):
            p = b.params[k]
            if source is not None:
                src = source[int(p["offset"]): int(p["offset"]) + int(p["nbytes"])].view(hh, ww, 3)
            else:
                with warnings.catch_warnings():  # a read-only buffer: torch only reads it here
                    warnings.simplefilter("ignore", UserWarning)
                    src = torch.from_numpy(b.payload(k))
            if transfer is not None:
                transfer.copy_(out[k], src)
            else:
                out[k].copy_(src, non_blocking=True)
        jk = np.flatnonzero(kinds == jpegbatch.KIND_JPEG)
        if len(jk):
            p = b.params[jk]
            crops = resample_batch(self._regions(b, jk, replaced), p["orientation"], p["reduce"], hh, ww,
                                   b.interpolation, self.device)
            crops = apply_jitter(crops, p["n_ops"], p["ops"], p["factors"])
            if b.lighting:
                crops = apply_lighting(crops, p["lighting"])
            flip = _to_device(p["flip"].astype(bool), self.device)
            crops = torch.where(flip[:, None, None, None], crops.flip(-1), crops)
            out[_to_device(jk, self.device)] = crops.permute(0, 2, 3, 1)
        self.host_s += time.perf_counter() - t0
        self.batches += 1
        return out.permute(0, 3, 1, 2)

    def _regions(self, b: jpegbatch.JpegBatch, jk: np.ndarray, replaced: np.ndarray | None) -> list:
        """Per JPEG sample, the part of its stored image the crop needs (``[h, w, c]`` on the
        device, a view where it can be), or None where neither decoder could make it."""
        boxes = [stored_box(b.params[k]) for k in jk]
        payloads = [b.payload(k) for k in jk]
        regional = bool(getattr(self.decoder, "supports_regions", False))
        try:
            got = list(self.decoder(payloads, boxes) if regional else self.decoder(payloads))
            if len(got) != len(jk):
                raise DecodeError(f"the decoder returned {len(got)} images for {len(jk)} files")
            why = list(getattr(self.decoder, "refused", None) or [None] * len(jk))
        except Exception as e:  # whatever the decoder raises, each sample falls back on its own
            got, why = [None] * len(jk), [f"the decoder raised {type(e).__name__}: {e}"] * len(jk)
        out = []
        for j, k in enumerate(jk):
            p, box = b.params[k], boxes[j]
            x0, y0, x1, y1 = box
            want = (y1 - y0, x1 - x0) if regional else (int(p["coded_height"]), int(p["coded_width"]))
            img, problem = got[j], why[j] if j < len(why) else None
            if img is not None and (img.ndim != 3 or tuple(img.shape[:2]) != want or img.shape[2] not in (1, 3)):
                problem, img = f"it decoded to {tuple(img.shape)}, not {want[0]}x{want[1]}", None
            if img is not None:
                out.append(img if regional else img[y0:y1, x0:x1])
                continue
            out.append(self._on_the_cpu(b, int(k), box, problem or "the GPU decoder could not decode it", replaced))
        return out

    def _on_the_cpu(self, b: jpegbatch.JpegBatch, k: int, box, problem: str, replaced: np.ndarray | None):
        p, index = b.params[k], int(b.indices[k])
        cw, ch = int(p["coded_width"]), int(p["coded_height"])
        what = f"dataset sample {index} ({cw}x{ch} baseline JPEG)"
        self.fallbacks += 1
        try:
            img = _cpu_decode(b.payload(k), self.device)
            if tuple(img.shape[:2]) != (ch, cw):
                raise DecodeError(f"it decoded to {tuple(img.shape)}, its header says {ch}x{cw}x3")
        except Exception as e:  # a corrupt image must not stop training: zeros stand in for it
            self.replaced += 1
            _log.warning("prefetchd: %s: %s; the CPU decode failed too (%s): zeros stand in for it (replaced)",
                         what, problem, e)
            if replaced is not None:
                replaced[k] = index
            return None
        if self.fallbacks == 1 or self.fallbacks % _WARN_EVERY == 0:
            _log.warning("prefetchd: %s: %s; decoded it on the CPU instead (%d such sample%s so far, counted as "
                         "gpu_fallbacks in the daemon's status; logged once per %d)", what, problem, self.fallbacks,
                         "" if self.fallbacks == 1 else "s", _WARN_EVERY)
        x0, y0, x1, y1 = box
        return img[y0:y1, x0:x1]


def stored_box(p) -> tuple[int, int, int, int]:
    """The box (x0, y0, x1, y1) of a JPEG sample's stored image that its crop needs: the crop in
    stored coordinates, and with a reduction ``r`` the whole r x r blocks it covers."""
    cw, ch = int(p["coded_width"]), int(p["coded_height"])
    r = int(p["reduce"])
    if r > 1:  # orientation 1 (checked at parse)
        x0, y0, x1, y1 = (int(v) for v in p["roi"])
        return x0 * r, y0 * r, min(x1 * r, cw), min(y1 * r, ch)
    return coded_box(p["roi"], int(p["orientation"]), cw, ch)


def _cpu_decode(jpeg: np.ndarray, device) -> torch.Tensor:
    """The fallback for one file: RGB as stored (no EXIF orientation), as the GPU decoder gives it."""
    import simplejpeg  # a core dependency of prefetchd; only needed here, on a failure

    return _to_device(simplejpeg.decode_jpeg(bytes(jpeg), colorspace="RGB"), device)
