"""A view group's own ``policy`` and ``random_erasing`` (``augment.views[i].policy``, ...): each view
of the group gets them where the single-view path does, from the view's own draws (a view equals
``augment.mode: random_resized_crop`` with the group's settings and the view's key); bad values
are one line naming the group's key; the section's keys beside views are refused; the stream's
fingerprint holds them, and configs without them keep theirs; ``erase_on: client`` erases each
view in the client from its own key; a changed view policy is refused on resume."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from conftest import small_config, wait_until
from prefetchd_client import ConfigError as ClientConfigError
from prefetchd_client import PrefetchClient, PrefetchError
from test_views_daemon import reference as views_reference

from prefetchd.core.augment import erasing, modes, views
from prefetchd.core.augment.seeds import sample_draws
from prefetchd.core.config import AugmentConfig, ConfigError, from_dict
from prefetchd.core.config import load as load_config
from prefetchd.core.policyspec import erasing_config
from prefetchd.format import status
from prefetchd.tools.samples import photo_like

PLAIN = [{"count": 2, "output_size": 64, "rrc_scale": [0.4, 1.0], "brightness": 0.4},
         {"count": 3, "output_size": 32, "rrc_scale": [0.1, 0.4], "ops": {"grayscale": 0.3}}]
ERASE = {"p": 0.7, "mode": "pixel", "count": [1, 2]}


def _png(seed: int = 0, w: int = 120, h: int = 96) -> bytes:
    """A PNG: decoded whole (no DCT reduction), so each view's source is the single-view path's."""
    buf = io.BytesIO()
    photo_like(np.random.default_rng(seed), w, h).save(buf, format="PNG")
    return buf.getvalue()


def _single(group: dict, **kw) -> AugmentConfig:
    """``augment.mode: random_resized_crop`` with a view group's settings: what the docs say a view is."""
    g = {k: v for k, v in group.items() if k != "count"}
    return AugmentConfig(mode="random_resized_crop", **{k: tuple(v) if isinstance(v, list) else v for k, v in g.items()},
                         **kw)


@pytest.mark.parametrize("policy", ["randaugment", "trivialaugment", "autoaugment", "rand-m9-mstd0.5-inc1"])
def test_a_view_groups_policy_and_erasing_are_the_single_view_paths_with_the_views_draws(policy):
    groups = [{**PLAIN[0], "policy": policy, "policy_args": {"fill": 128}}, {**PLAIN[1], "random_erasing": ERASE}]
    cfg = AugmentConfig(views=groups)
    cfgs = views.view_configs(cfg)
    ones = [_single(groups[0])] * 2 + [_single(groups[1])] * 3
    plain_cfgs = views.view_configs(AugmentConfig(views=PLAIN))
    changed = [0] * 5
    for i in range(8):
        data = _png(i)
        got = views.make_views(data, cfgs, 7, 2, i)
        plain = views.make_views(data, plain_cfgs, 7, 2, i)
        for v, one in enumerate(ones):
            alone = modes.make_sample(data, one, modes.draws(7, 2, i, v))
            assert np.array_equal(got[v], alone), (i, v)
            changed[v] += not np.array_equal(got[v], plain[v])
    # the policy changed the global views, erasing the local ones: the keys reach the pixels
    assert all(c >= 4 for c in changed), changed


def test_a_groups_erasing_boxes_are_drawn_from_each_views_own_key():
    const = {**ERASE, "mode": "const", "value": [255, 0, 255]}
    groups = [PLAIN[0], {**PLAIN[1], "flip": False, "rrc_scale": [0.5, 1.0], "random_erasing": const}]
    cfgs = views.view_configs(AugmentConfig(views=groups))
    e, boxes = erasing_config(const), 0
    for i in range(6):
        got = views.make_views(_png(i), cfgs, 3, 0, i)
        for v in (2, 3, 4):
            for top, left, h, w, _ in erasing.boxes(e, sample_draws(3, 0, i, v)[2], 32, 32):
                assert (got[v][top:top + h, left:left + w] == (255, 0, 255)).all(), (i, v)
                boxes += 1
        assert not (got[0] == (255, 0, 255)).all(axis=2).any()  # group 0 erases nothing
    assert boxes >= 5


@pytest.mark.parametrize("groups, key, words", [
    ([PLAIN[0], {**PLAIN[1], "policy": "randaugmnet"}], "augment.views[1].policy", "did you mean 'randaugment'"),
    ([PLAIN[0], {**PLAIN[1], "policy": "rand-m9-x"}], "augment.views[1].policy", "section 'x'"),
    ([{**PLAIN[0], "policy": "randaugment", "policy_args": {"magnitude": 40}}, PLAIN[1]],
     "augment.views[0].policy_args.magnitude", "must be an integer"),
    ([{**PLAIN[0], "policy_args": {"magnitude": 5}}, PLAIN[1]], "augment.views[0].policy_args",
     "is set but augment.views[0].policy is none"),
    ([PLAIN[0], {**PLAIN[1], "random_erasing": {"p": 1.5}}], "augment.views[1].random_erasing.p", "must be a number"),
    ([PLAIN[0], {**PLAIN[1], "random_erasing": {"mode": "pixel"}}], "augment.views[1].random_erasing.p", "is required"),
    ([PLAIN[0], {**PLAIN[1], "random_erasing": {"p": 0.5, "mode": "noise"}}], "augment.views[1].random_erasing.mode", ""),
    ([{**PLAIN[0], "random_erasing": {"p": 0.5, "erase_on": "client", "value": 3}}, PLAIN[1]],
     "augment.views[0].random_erasing.value", "erase_on: client"),
    ([{**PLAIN[0], "polcy": "randaugment"}, PLAIN[1]], "augment.views[0].polcy", "did you mean"),
])
def test_bad_view_policies_and_erasing_are_one_line_errors_naming_the_groups_key(groups, key, words):
    with pytest.raises(ConfigError) as e:
        AugmentConfig(views=groups)
    said = str(e.value)
    assert said.startswith(key + " ") and words in said and "\n" not in said, said


@pytest.mark.parametrize("section, key", [({"policy": "randaugment"}, "policy"),
                                          ({"policy": "rand-m9", "policy_args": {"fill": 3}}, "policy"),
                                          ({"random_erasing": {"p": 0.25}}, "random_erasing"),
                                          ({"random_erasing": {"p": 0.25, "erase_on": "client"}}, "random_erasing"),
                                          ({"ops": {"vflip": 0.5}}, "ops")])
def test_the_sections_policy_erasing_and_ops_beside_views_are_refused_naming_the_key(section, key):
    with pytest.raises(ConfigError) as e:
        AugmentConfig(views=PLAIN, **section)
    said = str(e.value)
    assert said.startswith(f"augment.{key} is not applied to augment.views") and f"augment.views[i].{key}" in said
    assert "\n" not in said


_BASE = {"dataset": {"root": "/data"}, "loader": {"batch_size": 6, "seed": 7}, "augment": {"output_size": 64}}
_DINO = [{"count": 2, "output_size": 64, "rrc_scale": [0.4, 1.0], "brightness": 0.4, "hue": 0.1, "jitter_p": 0.8,
          "ops": {"grayscale": 0.2, "blur": 0.5, "solarize": 0.2}},
         {"count": 6, "output_size": 32, "rrc_scale": [0.05, 0.4], "saturation": 0.3}]


def _fp(groups) -> str:
    return from_dict({**_BASE, "augment": {**_BASE["augment"], "views": groups}}).stream_fingerprint()


@pytest.mark.parametrize("groups, before", [
    # printed by the commit before view groups had a policy or erasing (4283a04)
    (_DINO, "988639392743849c"),
    ([{"count": 2, "output_size": 48}], "38d29d51185f5429"),
])
def test_views_without_policy_or_erasing_keep_their_fingerprint_and_each_setting_moves_it(groups, before):
    assert _fp(groups) == before
    assert _fp([{**groups[0], "policy": "none", "random_erasing": None}] + groups[1:]) == before
    fps = {before}
    for extra in ({"policy": "randaugment"}, {"policy": "randaugment", "policy_args": {"magnitude": 5}},
                  {"policy": "rand-m9-mstd0.5-inc1"}, {"random_erasing": {"p": 0.25}},
                  {"random_erasing": {"p": 0.25, "mode": "pixel"}}, {"random_erasing": {"p": 0.25, "erase_on": "client"}}):
        fps.add(_fp([{**groups[0], **extra}] + groups[1:]))
    assert len(fps) == 7
    if len(groups) > 1:  # the same policy in another group is another stream
        assert _fp([{**groups[0], "policy": "randaugment"}, groups[1]]) != _fp([groups[0], {**groups[1],
                                                                                            "policy": "randaugment"}])


def test_only_client_erasing_groups_are_in_meta_and_each_view_says_its_own():
    groups = [PLAIN[0], {**PLAIN[1], "random_erasing": {**ERASE, "erase_on": "client"}}]
    assert AugmentConfig(views=PLAIN).client_erasing(7) is None
    assert AugmentConfig(views=[{**PLAIN[0], "random_erasing": ERASE}, PLAIN[1]]).client_erasing(7) is None
    spec = AugmentConfig(views=groups).client_erasing(7)
    assert spec["seed"] == 7 and spec["views"][:2] == [None, None]
    assert spec["views"][2:] == [{"p": 0.7, "scale": [0.02, 1 / 3], "ratio": [0.3, 1 / 0.3], "mode": "pixel",
                                  "count": [1, 2], "seed": 7}] * 3


# --- with the daemon ----------------------------------------------------------------------------------

MEAN = np.array([0.485, 0.456, 0.406])
STD = np.array([0.229, 0.224, 0.225])
CLIENT_ERASE = {"p": 0.8, "mode": "rand", "count": [1, 2], "scale": [0.05, 0.3], "erase_on": "client"}


def test_erase_on_client_erases_each_view_from_its_own_key_in_the_client(tmp_path, image_root, daemon_factory):
    """Group 1 erases in the client (timm's normalised fills), group 0 is left alone; expected:
    the un-erased views of the same stream, normalised, with each box of ``erasing.boxes`` of the
    view's draws filled with ``erasing.noise``."""
    groups = [{**PLAIN[0], "policy": "trivialaugment"}, {**PLAIN[1], "random_erasing": CLIENT_ERASE}]
    (tmp_path / "run").mkdir()
    cfg = small_config(tmp_path / "run", image_root, augment={"views": groups})
    with pytest.raises(ClientConfigError) as e:  # uint8 views cannot be erased as timm does
        PrefetchClient(cfg, rank=0, timeout=5)
    assert str(e.value).startswith("augment.views[1].random_erasing.erase_on is client in ") and "\n" not in str(e.value)
    d = daemon_factory(cfg)
    runs = []
    for as_numpy in (True, False):  # numpy arrays, then torch CPU tensors (the device path's code)
        got = {}
        with PrefetchClient(cfg, rank=0, timeout=60, normalize=True, as_numpy=as_numpy) as c:
            for b, (*vs, _) in enumerate(c.iter_epoch(0)):
                got[(0, 0, b)] = ([np.array(v if as_numpy else v.numpy(), dtype=np.float32) for v in vs],
                                  c.last_batch.indices.copy())
        runs.append(got)
    assert d.stop() == 0 and "Traceback" not in d.log()
    meta = status.read_json(load_config(cfg).buffer.dir, status.META_NAME)
    assert meta["erasing"]["views"][:2] == [None, None] and meta["erasing"]["views"][2]["mode"] == "rand"
    (tmp_path / "plain").mkdir()
    plain = views_reference(small_config(tmp_path / "plain", image_root, augment={"views": [groups[0], PLAIN[1]]}), 1)
    ecfg = erasing_config({k: v for k, v in CLIENT_ERASE.items() if k != "erase_on"})
    boxes = 0
    for key, (vs, used) in [kv for got in runs for kv in got.items()]:
        ref = plain[key]
        for v, x in enumerate(vs):
            want = (ref[v].transpose(0, 3, 1, 2) / 255.0 - MEAN[:, None, None]) / STD[:, None, None]
            if v >= 2:
                for k, i in enumerate(used):
                    p = sample_draws(7, 0, int(i), v)[2]
                    bs = erasing.boxes(ecfg, p, 32, 32)
                    for (top, left, h, w, _), z in zip(bs, erasing.noise(ecfg, p, bs), strict=True):
                        want[k, :, top:top + h, left:left + w] = np.asarray(z, np.float32)[:, None, None]
                        boxes += 1
            np.testing.assert_allclose(x, want, rtol=0, atol=2e-6, err_msg=str((key, v)))
    assert boxes > 20


def test_a_changed_view_policy_is_refused_on_resume(tmp_path, image_root, daemon_factory):
    def config(name: str, policy: str) -> str:
        (tmp_path / name).mkdir()
        return small_config(tmp_path / name, image_root, augment={"views": [{**PLAIN[0], "policy": policy}, PLAIN[1]]},
                            buffer={"dir": str(tmp_path / "buffer")}, dataset={"cache_dir": str(tmp_path / "cache")})

    old, new = config("old", "randaugment"), config("new", "trivialaugment")
    d = daemon_factory(old)
    with PrefetchClient(old, rank=0, timeout=60, as_numpy=True) as loader:
        next(iter(loader))
        state = loader.state_dict()
    assert d.stop() == 0
    d = daemon_factory(new)
    wait_until(lambda: status.daemon_alive(str(tmp_path / "buffer")), 60, "the second daemon")
    with PrefetchClient(new, rank=0, timeout=60, as_numpy=True) as loader:
        with pytest.raises(PrefetchError, match="resuming would not continue the same stream"):
            loader.load_state_dict(state)
        assert (loader.epoch, loader.batch) == (0, 0)
    assert d.stop() == 0


def test_a_config_with_view_policies_written_back_whole_loads_again():
    groups = [{**PLAIN[0], "policy": "randaugment", "policy_args": {"magnitude": 5, "fill": [1, 2, 3]}},
              {**PLAIN[1], "random_erasing": {**ERASE, "erase_on": "client"}}]
    cfg = from_dict({**_BASE, "augment": {"views": groups}})
    again = from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again.augment.views == cfg.augment.views and again.stream_fingerprint() == cfg.stream_fingerprint()


def test_the_worked_recipe_of_docs_views_loads_and_makes_its_views():
    import os

    import yaml

    text = open(os.path.join(os.path.dirname(__file__), "..", "docs", "views.md")).read()
    block = text[text.index("```yaml", text.index("A worked recipe")) + 7:]
    aug = yaml.safe_load(block[:block.index("```")])["augment"]
    cfg = from_dict({**_BASE, "augment": aug}).augment
    assert [(g.count, g.policy, g.random_erasing.p) for g in cfg.views] == [(2, "rand-m9-mstd0.5-inc1", 0.25),
                                                                            (4, "trivialaugment", 0.0)]
    made = views.make_views(_png(1, 320, 256), views.view_configs(cfg), 0, 0, 3)
    assert [v.shape for v in made] == [(224, 224, 3)] * 2 + [(96, 96, 3)] * 4
