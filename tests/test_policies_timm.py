"""timm RandAugment strings against timm's own parser, ``rand_augment_transform``, on generated
strings (hypothesis): what prefetchd accepts, timm accepts with the same magnitude, op count,
probability, magnitude std and max and op set; what timm would skip silently or take another way
(a repeated section: timm keeps the first mstd/mmax, the last m/n/p) prefetchd refuses in one line.

timm's ``timm/data/auto_augment.py`` imports only Pillow and numpy, so it is loaded from its file
without importing timm (which needs torchvision); `make venv` installs timm without its dependencies,
and the tests are skipped where timm is not installed (``pip install --no-deps timm`` is enough).
"""

from __future__ import annotations

import importlib.util
import math
import os

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from prefetchd.core.configvalues import ConfigError  # noqa: E402
from prefetchd.core.policyspec import policy_spec  # noqa: E402


def _timm_auto_augment():
    spec = importlib.util.find_spec("timm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("timm is not installed (pip install --no-deps timm)")
    path = os.path.join(list(spec.submodule_search_locations)[0], "data", "auto_augment.py")
    s = importlib.util.spec_from_file_location("_timm_auto_augment", path)
    mod = importlib.util.module_from_spec(s)
    s.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def timm_aa():
    return _timm_auto_augment()


def _timm(aa, s: str):
    """timm's parse as create_transform calls it (its aa_params), or None where timm raises."""
    try:
        ra = aa.rand_augment_transform(s, {"translate_const": 100, "img_mean": (124, 116, 104)})
    except (AssertionError, ValueError):
        return None
    op = ra.ops[0]
    return {"num_ops": ra.num_layers, "magnitude": float(op.magnitude), "prob": float(op.prob),
            "magnitude_std": float(op.magnitude_std), "magnitude_max": op.magnitude_max,
            "increasing": [o.name for o in ra.ops] == list(aa._RAND_INCREASING_TRANSFORMS)}


_SECTIONS = st.one_of(
    st.builds(lambda v: f"m{v}", st.sampled_from(["0", "5", "9", "10", "15", "30", "9.5", "x"])),
    st.builds(lambda v: f"n{v}", st.sampled_from(["0", "1", "2", "3", "8", "9"])),
    st.builds(lambda v: f"mstd{v}", st.sampled_from(["0", "0.5", "1", "100", "101", "inf", "200"])),
    st.builds(lambda v: f"mmax{v}", st.sampled_from(["0", "10", "20", "10.5"])),
    st.builds(lambda v: f"inc{v}", st.sampled_from(["0", "1", "2"])),
    st.builds(lambda v: f"p{v}", st.sampled_from(["0", "0.5", "1", "1.0", "1.5"])),
    st.sampled_from(["tweights", "w0", "", "q3", "M9"]),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(_SECTIONS, max_size=5))
def test_a_timm_string_prefetchd_takes_is_timms_parse(timm_aa, sections):
    s = "-".join(["rand"] + sections)
    theirs = _timm(timm_aa, s)
    try:
        ours = policy_spec(s, {})
    except ConfigError as e:
        said = str(e)
        assert said.startswith("augment.policy") and "\n" not in said
        return
    assert theirs is not None, f"{s!r}: taken here, refused by timm"
    assert ours.kind == "timm"
    got = {"num_ops": ours.num_ops, "magnitude": ours.magnitude, "prob": ours.prob,
           "magnitude_std": ours.magnitude_std,
           "magnitude_max": ours.magnitude_max if ours.magnitude_max != 10.0 else theirs["magnitude_max"],
           "increasing": ours.increasing}
    if theirs["magnitude_max"] is None:  # timm's None is its _LEVEL_DENOM, 10
        assert ours.magnitude_max == 10.0
    assert got == theirs, s
    # what timm clips the magnitude to, as prefetchd does
    assert (ours.magnitude_max or 10.0) == (theirs["magnitude_max"] or 10.0)


@pytest.mark.parametrize("s, words", [
    ("rand-m9-mstd0.5-mstd1", "twice"),  # timm keeps the first mstd, and the last m
    ("rand-m9-m7", "twice"),
    ("rand-m9-mstdinf", "not a name and a number"),  # timm skips it: mstd 0, not uniform
    ("rand-m9-tweights", "transform-set section"),
    ("rand-m9-n10", "augment.policy (n)"),
    # timm's other strings and other spellings say what they are
    ("augmix-m5-w4-d2", "timm's AugMix strings are not supported"),
    ("original", "timm's AutoAugment policy 'original' is not built; autoaugment is torchvision's"),
    ("v0r", "timm's AutoAugment policy 'v0r'"),
    ("RandAugment", "did you mean 'randaugment'?"),
    ("trivial_augment", "did you mean 'trivialaugment'?"),
])
def test_timm_strings_timm_reads_otherwise_are_refused_in_one_line(s, words):
    with pytest.raises(ConfigError) as e:
        policy_spec(s, {})
    assert str(e.value).startswith("augment.policy") and words in str(e.value) and "\n" not in str(e.value)


def test_timms_uniform_magnitudes_are_mstd_above_100(timm_aa):
    assert math.isinf(policy_spec("rand-m9-mstd101", {}).magnitude_std)
    assert math.isinf(_timm(timm_aa, "rand-m9-mstd101")["magnitude_std"])
    assert _timm(timm_aa, "rand-m9-mstdinf")["magnitude_std"] == 0.0  # timm's silent skip


def test_autoaugment_has_the_sub_policies_of_timms_original(timm_aa):
    from prefetchd.core.augment.policies import IMAGENET_POLICY

    theirs = [[(op.name.replace("PosterizeOriginal", "Posterize"), op.prob) for op in sp]
              for sp in timm_aa.auto_augment_policy_original({})]
    assert [[(name, prob) for name, prob, _ in sp] for sp in IMAGENET_POLICY] == theirs


@pytest.mark.parametrize("increasing", [False, True])
def test_each_timm_op_at_each_level_is_timms_own_op_on_pil(timm_aa, increasing):
    """Every op of timm's RandAugment sets at levels 0..10 (and 0.5 steps), either sign: timm's
    level function and op (``NAME_TO_OP``, ``LEVEL_TO_ARG``) on a PIL image, nearest and fill
    img_mean, against the plan's op and magnitude carried out by ``ops.apply_op``."""
    import random

    import numpy as np
    from PIL import Image

    from prefetchd.core.augment import ops, policies

    rng = np.random.default_rng(5)
    img = rng.integers(0, 256, (48, 56, 3), dtype=np.uint8)
    yy, xx = np.mgrid[0:48, 0:56]
    img[..., 0] = np.clip(xx * 4 + rng.integers(0, 20, xx.shape), 0, 255)
    fill = (124, 116, 104)
    hp = {"translate_const": 100, "img_mean": fill, "interpolation": Image.NEAREST}
    names = policies.TIMM_INCREASING_OPS if increasing else policies.TIMM_OPS
    bad = []
    for name in names:
        for level in [x / 2 for x in range(21)]:
            for neg in (False, True):
                op = timm_aa.AugmentOp(name, prob=1.0, magnitude=level, hparams=hp)
                random.seed(0)
                # timm's _randomly_negate: negative when random.random() > 0.5; find a seed for neg
                s = next(s for s in range(100) if (random.seed(s) or random.random() > 0.5) == neg)
                random.seed(s)
                tv_name, m = policies._timm_op(name, level, neg, img.shape[0], img.shape[1])
                try:
                    theirs = np.asarray(op(Image.fromarray(img, "RGB")))
                except ValueError:  # Pillow >= 10 refuses posterize to 0 bits, which timm asks below level 2.5
                    assert tv_name == "Posterize" and m == 0.0, (name, level)
                    theirs = np.zeros_like(img)  # what Pillow made of 0 bits before (mask ~255: black)
                ours = ops.apply_op(img.copy(), tv_name, m, "nearest", fill)
                if not np.array_equal(ours, theirs):
                    diff = np.abs(ours.astype(int) - theirs.astype(int))
                    bad.append((name, level, neg, tv_name, round(m, 4), int(diff.max()), float((diff > 0).mean())))
    assert not bad, bad[:20]
