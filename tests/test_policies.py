"""Policies' settings, plans and draws: torchvision's magnitude tables, the op frequencies and
magnitude histograms of many seeded samples against the distributions written from
torchvision's and timm's source, timm's string parse, erasing boxes, and make_sample's use."""

from __future__ import annotations

import math
from collections import Counter
from statistics import NormalDist

import numpy as np
import pytest
from conftest import small_config

from prefetchd.core.augment import erasing, modes, policies
from prefetchd.core.config import ConfigError
from prefetchd.core.config import load as load_config
from prefetchd.core.configsections import AugmentConfig
from prefetchd.core.policyspec import ErasingConfig, erasing_config, parse_timm, policy_spec

N_SAMPLES = 6000


def _chi2_limit(df: int, alpha: float = 1e-4) -> float:
    """Wilson-Hilferty's chi-square quantile: a true distribution fails 1 run in 10,000."""
    z = NormalDist().inv_cdf(1 - alpha)
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi2(counts: Counter, expected: dict) -> tuple[float, int]:
    total = sum(counts.values())
    assert set(counts) <= set(expected), set(counts) - set(expected)
    stat = sum((counts.get(k, 0) - total * p) ** 2 / (total * p) for k, p in expected.items() if p > 0)
    return stat, len([p for p in expected.values() if p > 0]) - 1


def _plans(policy: str, args=None, h=224, w=224):
    spec = policy_spec(policy, args or {})
    return [policies.policy_plan(spec, modes.draws(11, 3, i).p, h, w) for i in range(N_SAMPLES)]


def test_magnitude_tables_are_torch_linspace_to_the_bit():
    torch = pytest.importorskip("torch")
    for start, end, n in ((0.0, 0.3, 31), (0.0, 150.0 / 331.0 * 224, 31), (0.0, 30.0, 10), (255.0, 0.0, 31),
                          (0.0, 0.99, 31), (0.0, 135.0, 31), (0.0, 0.9, 10), (0.0, 150.0 / 331.0 * 177, 31),
                          (0.0, 150.0 / 331.0 * 384, 31), (0.0, 150.0 / 331.0 * 333, 10), (0.0, 32.0, 31), (0.0, 0.3, 200), (0.0, 7.3, 1000)):
        want = torch.linspace(start, end, n).numpy()
        np.testing.assert_array_equal(policies.linspace_f32(start, end, n), want, err_msg=f"{start}, {end}, {n}")
    for bins, div in ((31, 4), (10, 4), (31, 6)):
        want = (8 - (torch.arange(bins) / ((bins - 1) / div)).round().int()).numpy()
        kind = "trivialaugment" if div == 6 else "randaugment"
        np.testing.assert_array_equal(policies.magnitude_table(kind, bins, 224, 224)["Posterize"][0], want)


def test_randaugment_ops_are_uniform_with_fair_signs_and_the_fixed_bin():
    plans = _plans("randaugment", {"num_ops": 2, "magnitude": 9})
    assert all(len(p) == 2 for p in plans)
    ops = Counter(name for p in plans for name, _ in p)
    stat, df = _chi2(ops, {k: 1 / 14 for k in policies.RANDAUGMENT_OPS})
    assert stat < _chi2_limit(df), ops
    table = policies.magnitude_table("randaugment", 31, 224, 224)
    rot = [m for p in plans for name, m in p if name == "Rotate"]
    assert set(rot) == {float(table["Rotate"][0][9]), -float(table["Rotate"][0][9])}
    neg = sum(m < 0 for m in rot)
    assert abs(neg - len(rot) / 2) < 4 * math.sqrt(len(rot) / 4)  # a fair coin, within 4 sigma
    assert {m for p in plans for name, m in p if name == "TranslateX"} == {float(int(table["TranslateX"][0][9])) * s for s in (1, -1)}
    assert {m for p in plans for name, m in p if name == "Posterize"} == {float(table["Posterize"][0][9])}


def test_trivialaugment_bins_are_uniform_over_31():
    plans = _plans("trivialaugment")
    assert all(len(p) == 1 for p in plans)
    ops = Counter(p[0][0] for p in plans)
    stat, df = _chi2(ops, {k: 1 / 14 for k in policies.RANDAUGMENT_OPS})
    assert stat < _chi2_limit(df), ops
    table = policies.magnitude_table("trivialaugment", 31, 224, 224)
    # the magnitude histogram of the enhance ops (one table, 31 bins, signed): |m| -> its bin
    bins = {float(v): i for i, v in enumerate(table["Brightness"][0])}
    hist = Counter(bins[abs(m)] for p in plans for name, m in p if name in ("Brightness", "Color", "Contrast", "Sharpness"))
    stat, df = _chi2(hist, {i: 1 / 31 for i in range(31)})
    assert stat < _chi2_limit(df), hist
    assert any(m == 90.0 for p in plans for name, m in p if name == "Rotate")  # 135 / 30 * 20: a transpose


def test_trivialaugment_takes_torchvisions_num_magnitude_bins():
    # seen: TrivialAugmentWide(num_magnitude_bins=...) written as policy_args was refused with
    # "is a randaugment parameter; trivialaugment has none" (torchvision's has it, default 31)
    assert policy_spec("trivialaugment", {"num_magnitude_bins": 31}) == policy_spec("trivialaugment", {})
    plans = _plans("trivialaugment", {"num_magnitude_bins": 5})
    table = policies.magnitude_table("trivialaugment", 5, 224, 224)
    bins = {float(v): i for i, v in enumerate(table["Brightness"][0])}
    hist = Counter(bins[abs(m)] for p in plans for name, m in p if name in ("Brightness", "Color", "Contrast", "Sharpness"))
    stat, df = _chi2(hist, {i: 1 / 5 for i in range(5)})
    assert stat < _chi2_limit(df), hist
    with pytest.raises(ConfigError, match=r"^augment.policy_args.num_magnitude_bins is a randaugment parameter"):
        policy_spec("autoaugment", {"num_magnitude_bins": 10})  # torchvision's AutoAugment has none


@pytest.mark.parametrize("key, aug", [
    ("augment.policy_args.fill", {"policy": "randaugment", "policy_args": {"fill": [0.5, 0.5, 0.5]}}),
    ("augment.policy_args.fill", {"policy": "rand-m9", "policy_args": {"fill": 127.5}}),
    ("augment.random_erasing.value", {"random_erasing": {"p": 0.25, "value": [0.485, 0.456, 0.406]}}),
])
def test_a_fractional_fill_is_refused_not_truncated_to_black(key, aug):
    # seen: fill [0.5, 0.5, 0.5] (a normalised-space grey) accepted and filled with 0
    with pytest.raises(ConfigError) as e:
        AugmentConfig(**aug)
    assert str(e.value).startswith(key + " must be whole uint8 levels") and "\n" not in str(e.value)
    assert policy_spec("randaugment", {"fill": [128.0, 0, 255]}).fill == (128, 0, 255)  # whole floats are levels


def test_autoaugment_applies_each_op_as_often_as_imagenets_table_says():
    plans = _plans("autoaugment")
    expected = Counter()
    for sub in policies.IMAGENET_POLICY:
        for name, prob, _ in sub:
            expected[name] += prob / len(policies.IMAGENET_POLICY)
    expected["(skipped)"] = 2 - sum(expected.values())
    got = Counter(name for p in plans for name, _ in p)
    got["(skipped)"] = 2 * len(plans) - sum(got.values())
    stat, df = _chi2(got, {k: v / 2 for k, v in expected.items()})
    assert stat < _chi2_limit(df), got
    assert {m for p in plans for name, m in p if name == "Color"} <= {float(v) * s for v in
                                                                     policies.magnitude_table("autoaugment", 10, 1, 1)["Color"][0][[0, 2, 4, 8]] for s in (1, -1)}


def test_timm_rand_string_ops_probability_and_magnitude_distribution():
    plans = _plans("rand-m9-mstd0.5-inc1")
    spec = policy_spec("rand-m9-mstd0.5-inc1", {})
    assert (spec.kind, spec.magnitude, spec.magnitude_std, spec.num_ops, spec.increasing, spec.prob) == (
        "timm", 9.0, 0.5, 2, True, 0.5)
    n_ops = Counter(len(p) for p in plans)  # two ops, each kept with probability 0.5: binomial(2, 0.5)
    stat, df = _chi2(n_ops, {0: 0.25, 1: 0.5, 2: 0.25})
    assert stat < _chi2_limit(df), n_ops
    # timm's rotate level: |degrees| = clip(N(9, 0.5), 0, 10) / 10 * 30, in 8 equiprobable bins of N(9, 0.5)
    lv = [abs(m) / 3.0 for p in plans for name, m in p if name == "Rotate"]
    nd = NormalDist(9, 0.5)
    edges = [nd.inv_cdf(k / 8) for k in range(1, 8)]
    hist = Counter(sum(v > e for e in edges) for v in lv)
    probs = {k: 1 / 8 for k in range(8)}
    stat, df = _chi2(hist, probs)
    assert stat < _chi2_limit(df), hist
    assert max(lv) <= 10.0 + 1e-9
    # the increasing set: PosterizeIncreasing keeps 4 - int(level * 0.4) bits; no plain Posterize levels
    assert {m for p in plans for name, m in p if name == "Posterize"} <= {0.0, 1.0, 2.0}


def test_timm_strings_parse_as_timm_parses_them():
    assert parse_timm("rand-m9-mstd0.5-inc1")["magnitude"] == 9.0
    d = parse_timm("rand-n3-m15-mmax20-mstd101-p0.7")
    assert (d["num_ops"], d["magnitude"], d["magnitude_max"], d["magnitude_std"], d["prob"]) == (3, 15.0, 20.0, math.inf, 0.7)
    assert parse_timm("rand")["magnitude"] == 10.0 and parse_timm("rand-inc0")["increasing"] is False
    for bad, words in (("rand-w0", "op weights"), ("rand-q3", "unknown section"), ("augmix-m5", "timm string"),
                       ("rand-mx", "name and a number"), ("rand-mstdinf", "name and a number")):
        with pytest.raises(ConfigError, match=words):
            policy_spec(bad, {})


@pytest.mark.parametrize("aug, key, words", [
    ({"policy": "randomaug"}, "augment.policy", "one of none, randaugment"),
    ({"policy": "randaugment", "policy_args": {"magnitude": 31}}, "augment.policy_args.magnitude", r"in \[0, 30\]"),
    ({"policy": "randaugment", "policy_args": {"num_op": 2}}, "augment.policy_args.num_op", "known: num_ops"),
    ({"policy": "trivialaugment", "policy_args": {"magnitude": 5}}, "augment.policy_args.magnitude", "randaugment parameter"),
    ({"policy": "rand-m9", "policy_args": {"num_ops": 3}}, "augment.policy_args.num_ops", "timm string"),
    ({"policy": "none", "policy_args": {"fill": 3}}, "augment.policy_args", "augment.policy is none"),
    ({"policy": "randaugment", "policy_args": {"fill": [1, 2]}}, "augment.policy_args.fill", r"\[r, g, b\]"),
    ({"random_erasing": {"p": 1.5}}, "augment.random_erasing.p", r"\[0, 1\]"),
    ({"random_erasing": {"p": 0.5, "mode": "noise"}}, "augment.random_erasing.mode", "const, rand, pixel"),
    ({"random_erasing": {"p": 0.5, "count": [2, 1]}}, "augment.random_erasing.count", "min <= max"),
    ({"random_erasing": {"prob": 0.5}}, "augment.random_erasing.prob", "known: p"),
    ({"ops": {"blur": 0.5, "blur_kernel": 4}}, "augment.ops.blur_kernel", "odd"),
    ({"ops": {"hflip": 0.5}}, "augment.ops.hflip", "known: vflip"),
    # timm's train.py names: the closest spelling misled (remode -> augment.mode, scale -> scale_min)
    ({"remode": "pixel"}, "augment.remode", "timm's remode is augment.random_erasing.mode"),
    ({"scale": [0.08, 1.0]}, "augment.scale", "timm's scale is augment.rrc_scale"),
    ({"aa": "rand-m9-mstd0.5-inc1"}, "augment.aa", "timm's aa is augment.policy"),
    ({"reprob": 0.25}, "augment.reprob", "augment.random_erasing.p"),
    ({"hflip": 0.5}, "augment.hflip", "augment.flip"),
    # accepted and did nothing before: settings of an erasing mode or an op that is off
    ({"random_erasing": {"scale": [0.02, 0.33], "ratio": [0.3, 3.3]}}, "augment.random_erasing.p", "is required"),
    ({"random_erasing": {"mode": "pixel"}}, "augment.random_erasing.p", "default 0.5"),
    ({"random_erasing": {"p": 0.25, "mode": "pixel", "value": [124, 116, 104]}}, "augment.random_erasing.value",
     "mode is pixel"),
    ({"random_erasing": {"p": 0.25, "std": [0.5, 0.5, 0.5]}}, "augment.random_erasing.std", "mode is const"),
    ({"ops": {"blur_kernel": 5, "blur_sigma": [0.1, 1.0]}}, "augment.ops.blur_sigma", "augment.ops.blur is 0"),
    ({"ops": {"solarize_threshold": 100}}, "augment.ops.solarize_threshold", "augment.ops.solarize is 0"),
    ({"ops": {"posterize_bits": 2}}, "augment.ops.posterize_bits", "augment.ops.posterize is 0"),
    ({"policy": "randaugment", "decode": "gpu"}, "augment.decode", "must be cpu with augment.policy"),
    ({"policy": "randaugment", "transform": "m:f"}, "augment.policy", "put them in your transform"),
])
def test_bad_policy_settings_say_the_key_and_what_is_accepted(tmp_path, aug, key, words):
    with pytest.raises(ConfigError, match=words) as e:
        load_config(small_config(tmp_path, "/data", augment=aug))
    assert str(e.value).startswith(key + " ")


def test_fingerprints_move_with_the_policy_and_stay_without_one(tmp_path):
    base = load_config(small_config(tmp_path, "/data"))
    assert not any(k in base.augment.stream_dict() for k in ("policy", "random_erasing", "ops"))  # as before
    fps = {base.stream_fingerprint()}
    for aug in ({"policy": "randaugment"}, {"policy": "randaugment", "policy_args": {"magnitude": 5}},
                {"policy": "rand-m9-mstd0.5-inc1"}, {"random_erasing": {"p": 0.25}}, {"ops": {"vflip": 0.5}}):
        fps.add(load_config(small_config(tmp_path, "/data", augment=aug)).stream_fingerprint())
    assert len(fps) == 6
    va = load_config(small_config(tmp_path, "/data", augment={"policy": "autoaugment", "random_erasing": {"p": 1}})).val_augment()
    assert va.policy == "none" and va.random_erasing.p == 0 and not va.extras_set()


def test_the_crop_and_lighting_draws_are_unchanged_by_the_policy_block():
    rng = np.random.Generator(np.random.PCG64(modes.sample_key(5, 1, 42)))
    d = modes.draws(5, 1, 42)
    np.testing.assert_array_equal(d.u, rng.random(modes._N_UNIFORM))
    np.testing.assert_array_equal(d.z, rng.standard_normal(3))
    assert d.p.shape == (policies.N_POLICY_DRAWS,)


def test_erasing_boxes_follow_timms_algorithm_and_fill_modes():
    cfg = erasing_config({"p": 1.0, "count": [1, 3], "mode": "rand"})
    counts, fracs = Counter(), []
    for i in range(2000):
        bs = erasing.boxes(cfg, modes.draws(1, 0, i).p, 224, 224)
        counts[len(bs)] += 1
        for top, left, h, w, _ in bs:
            assert 0 <= top <= 224 - h and 0 <= left <= 224 - w and h < 224 and w < 224
            fracs.append(h * w * len(bs) / 224 ** 2)
    stat, df = _chi2(counts, {1: 1 / 3, 2: 1 / 3, 3: 1 / 3})
    assert stat < _chi2_limit(df), counts
    assert 0.015 < min(fracs) and max(fracs) < 0.36 and abs(np.mean(fracs) - (0.02 + 1 / 3) / 2) < 0.02
    assert sum(bool(erasing.boxes(erasing_config({"p": 0.25}), modes.draws(1, 0, i).p, 64, 64)) for i in range(2000)) in range(430, 571)
    img = np.full((64, 64, 3), 9, np.uint8)
    p = np.full(256, 0.5)
    p[40] = 0.0
    const = erasing.erase(img.copy(), ErasingConfig(p=1.0, value=(1, 2, 3)), p)
    top, left, h, w, _ = erasing.boxes(ErasingConfig(p=1.0), p, 64, 64)[0]
    assert (const[top:top + h, left:left + w] == (1, 2, 3)).all() and (const == 9).all(axis=2).sum() == 64 * 64 - h * w
    pix = erasing.erase(img.copy(), ErasingConfig(p=1.0, mode="pixel"), p)[top:top + h, left:left + w].astype(float)
    # timm's N(0, 1) in normalised space: per channel mean 255 * mean, std 255 * std
    assert abs(pix[..., 0].mean() - 255 * 0.485) < 6 and abs(pix[..., 0].std() - 255 * 0.229) < 6
    np.testing.assert_array_equal(pix, erasing.erase(img.copy(), ErasingConfig(p=1.0, mode="pixel"), p)[top:top + h, left:left + w])


def test_make_sample_with_a_policy_is_a_function_of_the_key(tmp_path):
    from prefetchd.tools.samples import jpeg_bytes, photo_like
    rng = np.random.default_rng(4)
    data = jpeg_bytes(photo_like(rng, 200, 150), rng)
    cfg = AugmentConfig(mode="random_resized_crop", output_size=64, policy="trivialaugment",
                        random_erasing={"p": 0.5, "mode": "pixel"}, ops={"vflip": 0.5})
    plain = AugmentConfig(mode="random_resized_crop", output_size=64)
    a = [modes.make_sample(data, cfg, modes.draws(7, 0, i)) for i in range(40)]
    b = [modes.make_sample(data, cfg, modes.draws(7, 0, i)) for i in range(40)]
    c = [modes.make_sample(data, plain, modes.draws(7, 0, i)) for i in range(40)]
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert sum(not np.array_equal(x, y) for x, y in zip(a, c, strict=True)) > 25
    assert all(x.shape == (64, 64, 3) and x.dtype == np.uint8 for x in a)


def test_single_ops_fire_on_their_draws_in_order():
    from prefetchd.core.augment import ops
    img = np.random.default_rng(2).integers(0, 256, (40, 48, 3), dtype=np.uint8)
    cfg = AugmentConfig(ops={"vflip": 0.5, "grayscale": 0.5, "blur": 0.5, "blur_sigma": [1.0, 1.0], "blur_kernel": 5,
                             "solarize": 0.5, "solarize_threshold": 100, "posterize": 0.5, "posterize_bits": 3})
    off = np.full(256, 0.9)
    np.testing.assert_array_equal(policies.apply_extras(img, cfg, off), img)
    on = off.copy()
    on[32:38] = 0.1
    want = ops.grayscale(img)
    want = ops.gaussian_blur(want, 5, 1.0)
    want = ops.solarize(want, 100)
    want = ops.posterize(want, 3)
    np.testing.assert_array_equal(policies.apply_extras(img, cfg, on), want[::-1])
    only_flip = off.copy()
    only_flip[32] = 0.1
    np.testing.assert_array_equal(policies.apply_extras(img, cfg, only_flip), img[::-1])


def test_hue_turns_the_hue_circle_as_colorsys_does_within_pillows_8_bit_rounding():
    """``augment.hue``'s op against an independent reference: the standard library's colorsys on
    float RGB, the hue turned by the shift, within the 8-bit HSV round trip Pillow (and so
    torchvision's PIL path) makes; tests/test_policies_torchvision.py compares it with
    torchvision's ``adjust_hue`` bit for bit where torchvision imports."""
    import colorsys

    from prefetchd.core.augment import modes

    rng = np.random.default_rng(5)
    img = rng.integers(0, 256, (24, 32, 3), dtype=np.uint8)
    for shift in (-0.4, -0.1, 0.1, 0.25, 0.5):
        got = modes.adjust_hue(img, shift).astype(int)
        want = np.empty_like(got)
        for (y, x), _ in np.ndenumerate(img[..., 0]):
            h, s, v = colorsys.rgb_to_hsv(*(img[y, x] / 255.0))
            want[y, x] = np.rint(np.array(colorsys.hsv_to_rgb((h + shift) % 1.0, s, v)) * 255)
        diff = np.abs(got - want)
        # measured: 99th percentile 4 to 10 levels, mean 0.4 to 1.6 (the hue in 256 steps, the
        # shift truncated to them); a turn the wrong way or by the wrong amount is off by tens
        assert np.percentile(diff, 99) <= 12 and diff.mean() < 2.0, (shift, diff.mean(), diff.max())
        assert np.abs(got - img.astype(int)).mean() > 10  # it did turn


def test_jitter_p_applies_the_jitter_to_its_share_of_samples_and_hue_keeps_old_streams():
    from prefetchd.tools.samples import jpeg_bytes, photo_like

    data = jpeg_bytes(photo_like(np.random.default_rng(4), 96, 80), np.random.default_rng(4))
    base = dict(mode="random_resized_crop", output_size=48, brightness=0.4, contrast=0.4, saturation=0.4)
    always = AugmentConfig(**base)
    half = AugmentConfig(**base, jitter_p=0.5)
    never = AugmentConfig(**{**base, "brightness": 0.0, "contrast": 0.0, "saturation": 0.0})
    n, jittered = 200, 0
    for i in range(n):
        d = modes.draws(7, 0, i)
        a, h, z = (modes.make_sample(data, c, d) for c in (always, half, never))
        assert np.array_equal(h, a) or np.array_equal(h, z), i  # the same factors, or none at all
        jittered += not np.array_equal(h, z)
    assert 70 <= jittered <= 130, jittered  # binomial(200, 0.5): outside this about once in 10^5
    # configs without hue or jitter_p draw and fingerprint as before they existed
    assert "hue" not in always.stream_dict() and "jitter_p" not in always.stream_dict()
    assert AugmentConfig(**base, hue=0.1).stream_dict()["hue"] == 0.1
    assert modes.jitter_ops(always, modes.draws(7, 0, 3)) == [
        (k, f) for k, f in modes.jitter_ops(AugmentConfig(**base, hue=0.1), modes.draws(7, 0, 3)) if k != modes.HUE]


@pytest.mark.parametrize("kw, words", [
    ({"hue": 0.6}, "augment.hue must be"),
    ({"jitter_p": 1.5}, "augment.jitter_p must be"),
    ({"hue": 0.1, "decode": "hybrid"}, "augment.decode must be cpu with augment.hue"),
    ({"hue": 0.1, "views": [{"count": 2, "output_size": 64}]}, "augment.hue is set in each view group"),
    ({"views": [{"count": 2, "output_size": 64, "jitter_p": -1}]}, "augment.views[0].jitter_p must be"),
])
def test_bad_hue_and_jitter_p_are_one_line_errors(kw, words):
    with pytest.raises(ConfigError) as e:
        AugmentConfig(**kw)
    assert str(e.value).startswith(words) and "\n" not in str(e.value), str(e.value)


def test_two_order_sensitive_single_ops_name_the_order_in_the_fingerprint():
    """grayscale, blur, solarize and posterize run in that order since blur went before solarize:
    a config with two or more of them makes other pixels than before, so its stream says so; a
    config with one of them (or none) keeps the fingerprint it had."""
    one = AugmentConfig(ops={"solarize": 0.5, "vflip": 0.5}).stream_dict()
    two = AugmentConfig(ops={"solarize": 0.5, "blur": 0.5}).stream_dict()
    assert "ops_order" not in one and two["ops_order"] == 2


@pytest.mark.parametrize("augment, words", [
    # an op one level up, a jitter key one level down: named where it goes, not "did you mean rrc_scale?"
    ("views: [{count: 2, output_size: 32, grayscale: 0.2}]",
     "augment.views[0].grayscale is an op: write it under augment.views[0].ops"),
    ("{grayscale: 0.2}", "augment.grayscale is an op: write it under augment.ops"),
    ("views: [{count: 2, output_size: 32, grayscal: 0.2}]", "augment.views[0].grayscal is not a known key (did you "
                                                            "mean the op augment.views[0].ops.grayscale?)"),
    ("views: [{count: 2, output_size: 32, ops: {hue: 0.1}}]",
     "augment.views[0].ops.hue is the colour jitter's, not an op: write it beside ops, as augment.views[0].hue"),
    ("{ops: {jitter_p: 0.8}}", "augment.ops.jitter_p is the colour jitter's, not an op: write it beside ops, as "
                               "augment.jitter_p"),
    # a jitter_p with nothing to jitter, a jitter beside a transform: accepted, they did nothing
    ("{jitter_p: 0.8}", "augment.jitter_p (0.8) is the colour jitter's probability, but augment.brightness"),
    ("views: [{count: 2, output_size: 32, jitter_p: 0.8}]", "augment.views[0].jitter_p (0.8) is the colour jitter's"),
    ("{transform: 'tmod:make', hue: 0.1}", "augment.hue is not applied with augment.transform"),
    ("{transform: 'tmod:make', brightness: 0.4, jitter_p: 0.8}", "augment.brightness is not applied with augment.transform"),
    # YAML 1.1 reads 1e-1 (no dot) and quoted numbers as text
    ("{hue: 1e-1}", "augment.hue must be a number, got '1e-1' (YAML reads an exponent without a dot as text: write 0.1)"),
    ("views: [{count: 2, output_size: 32, hue: '0.1'}]",
     "augment.views[0].hue must be a number, got '0.1' (YAML read it as text: write 0.1 unquoted)"),
])
def test_jitter_and_op_keys_in_the_wrong_place_are_one_line_errors_saying_where(tmp_path, augment, words):
    from prefetchd.core import config as C

    text = f"dataset: {{root: /d}}\naugment: {augment}\n" if augment.startswith("{") else \
        f"dataset: {{root: /d}}\naugment:\n  {augment}\n"
    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(ConfigError) as e:
        C.load(str(tmp_path / "c.yaml"))
    assert str(e.value) == words or str(e.value).startswith(words), str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("augment, words", [
    ("{hue: [-0.1, 0.1]}", "augment.hue must be one number x, for [-x, x]: [-0.1, 0.1] is torchvision's (min, max) "
                           "form of hue: 0.1; write that"),
    ("{brightness: [0.6, 1.4]}", "augment.brightness must be one number x, for [1-x, 1+x]: [0.6, 1.4] is "
                                 "torchvision's (min, max) form of brightness: 0.4; write that"),
    ("{hue: [0.0, 0.2]}", "augment.hue must be one number x, for [-x, x] (centred on 0); [0.0, 0.2] is off centre"),
    ("{brightness: [1.4, 0.6]}", "augment.brightness must be one number x, for [1-x, 1+x]: [1.4, 0.6] is a (min, "
                                 "max) range written backwards; as one number: 0.4"),  # (it said off centre)
    ("{hue: [-0.6, 0.6]}", "augment.hue must be one number x, for [-x, x], at most 0.5: [-0.6, 0.6] is "
                           "torchvision's (min, max) form of hue: 0.6, past what it allows"),  # (it said write 0.6)
    ("views: [{count: 2, output_size: 32, saturation: [0.8, 1.2]}]",
     "augment.views[0].saturation must be one number x, for [1-x, 1+x]: [0.8, 1.2] is torchvision's (min, max) form "
     "of saturation: 0.2"),
])
def test_torchvisions_min_max_jitter_ranges_are_said_as_the_number_they_stand_for(tmp_path, augment, words):
    """ColorJitter(hue=(-0.1, 0.1)) written as a list: said as hue: 0.1 (it said "must be a
    number, got [-0.1, 0.1]"), or refused as off centre, never taken as another range."""
    from prefetchd.core import config as C

    text = f"dataset: {{root: /d}}\naugment: {augment}\n" if augment.startswith("{") else \
        f"dataset: {{root: /d}}\naugment:\n  {augment}\n"
    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(ConfigError) as e:
        C.load(str(tmp_path / "c.yaml"))
    assert str(e.value).startswith(words) and "\n" not in str(e.value), str(e.value)
