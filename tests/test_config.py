from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from prefetchd.core import config as C
from prefetchd.core.augment.viewspec import ViewGroup

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "config.example.yaml")


def load_text(tmp_path, text: str) -> C.Config:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return C.load(str(p))


def test_example_config_loads_and_documents_every_key():
    cfg = C.load(EXAMPLE)
    text = open(EXAMPLE).read()
    for section, cls in C._SECTIONS.items():
        for f in C.dataclasses.fields(cls):
            assert f"  {f.name}:" in text, f"config.example.yaml does not document {section}.{f.name}"
    assert cfg.loader.batch_size == 256
    views = text[text.index("# Several views without code"):text.index("  views: []")]  # a view group's keys
    for f in C.dataclasses.fields(ViewGroup):
        assert f.name in views, f"config.example.yaml does not document augment.views[i].{f.name}"


def test_defaults_and_sizes(tmp_path):
    cfg = load_text(tmp_path, "dataset: {root: data}\nbuffer: {max_bytes: 1.5GiB, min_free_bytes: 512MB}\n")
    assert cfg.dataset.root == str(tmp_path / "data")  # relative to the config file
    assert cfg.buffer.max_bytes == int(1.5 * 2**30)
    assert cfg.buffer.min_free_bytes == 512 * 10**6
    assert cfg.buffer.refill_at == 48 and cfg.buffer.capacity == 64
    assert cfg.loader.ranks == (0,)


@pytest.mark.parametrize("text, key, words", [
    ("dataset: {root: d}\nbuffer: {capacity: 0}", "buffer.capacity", "positive integer, got 0"),
    ("dataset: {root: d}\nbuffer: {capacity: 4, refill_at: 5}", "buffer.refill_at", "<= buffer.capacity"),
    ("dataset: {root: d}\nbuffer: {max_bytes: lots}", "buffer.max_bytes", "size such as 8GiB"),
    ("dataset: {root: d}\nbuffer: {max_bytes: -3}", "buffer.max_bytes", "positive size"),
    ("dataset: {root: d}\nloader: {batch_size: '32'}", "loader.batch_size", "must be an integer"),
    ("dataset: {root: d}\nloader: {shuffle: 1}", "loader.shuffle", "true, false or block"),
    ("dataset: {root: d}\nloader: {world_size: 2, ranks: [0, 2]}", "loader.ranks", "<= 1"),
    ("dataset: {root: d}\nloader: {world_size: 2, ranks: [1, 1]}", "loader.ranks", "must not repeat"),
    ("dataset: {root: d}\nloader: {epochs: 0}", "loader.epochs", "positive integer"),
    ("dataset: {root: d}\nworkers: {count: many}", "workers.count", "'auto'"),
    ("dataset: {root: d}\nworkers: {count: 0}", "workers.count", "positive integer"),
    ("dataset: {root: d}\naugment: {mode: crop}", "augment.mode", "one of scale"),
    ("dataset: {root: d}\naugment: {brightness: 2}", "augment.brightness", "<= 1.0"),
    ("dataset: {root: d}\naugment: {scale_min: 500, scale_max: 400}", "augment.scale_min", "<= augment.scale_max"),
    ("dataset: {root: d}\naugment: {scale_min: 100}", "augment.scale_min", "so the crop fits"),
    ("dataset: {root: d}\naugment: {rrc_scale: [0.5]}", "augment.rrc_scale", "two numbers"),
    ("dataset: {root: d}\naugment: {interpolation: cubic}", "augment.interpolation", "did you mean 'bicubic'"),
    ("dataset: {root: d}\nprogress: {poll_interval_s: 0}", "progress.poll_interval_s", ">= 0.01"),
    ("loader: {batch_size: 4}", "dataset.root", "is required"),
    ("dataset: {root: d, file_list: l.txt}", "dataset.file_list", "exclusive"),
    ("dataset: {root: d}\nbufer: {capacity: 3}", "bufer", "did you mean 'buffer'"),
    ("dataset: {root: d}\nbuffer: {capacty: 3}", "buffer.capacty", "did you mean 'buffer.capacity'"),
    ("dataset: {root: d}\nloader: [1, 2]", "loader", "must be a mapping"),
])
def test_bad_values_name_the_key(tmp_path, text, key, words):
    with pytest.raises(C.ConfigError) as ei:
        load_text(tmp_path, text)
    assert ei.value.key == key
    msg = str(ei.value)
    assert msg.startswith(key) and words in msg and "\n" not in msg


def test_yaml_python_tags_are_refused(tmp_path):
    with pytest.raises(C.ConfigError, match="invalid YAML"):
        load_text(tmp_path, "dataset: !!python/object/apply:os.system ['echo pwned']\n")


def test_broken_yaml_says_where(tmp_path):
    with pytest.raises(C.ConfigError, match=r"invalid YAML at line \d+, column \d+"):
        load_text(tmp_path, "dataset:\n  root: [unclosed\n")


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(C.ConfigError, match="cannot read config file"):
        C.load(str(tmp_path / "nope.yaml"))


def test_stream_fingerprint_ignores_tunables(tmp_path):
    a = load_text(tmp_path, "dataset: {root: d}\nworkers: {count: 1}\nbuffer: {capacity: 8}")
    b = load_text(tmp_path, "dataset: {root: d}\nworkers: {count: 3}\nbuffer: {capacity: 80}")
    c = load_text(tmp_path, "dataset: {root: d}\nloader: {seed: 1}")
    assert a.stream_fingerprint() == b.stream_fingerprint() != c.stream_fingerprint()


@pytest.mark.parametrize("cmd", ["check", "run"])
def test_cli_bad_config_exits_78_with_one_line(tmp_path, cmd):
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({"dataset": {"root": str(tmp_path)}, "buffer": {"capacity": -1,
                                 "dir": str(tmp_path / "buf")}}))
    r = subprocess.run([sys.executable, "-m", "prefetchd", cmd, "--config", str(p)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 78
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "buffer.capacity" in lines[0]
    assert not (tmp_path / "buf").exists()  # nothing started


def test_cli_check_reports_missing_dataset_root(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({"dataset": {"root": str(tmp_path / "missing"), "cache_dir": str(tmp_path / "c")}}))
    r = subprocess.run([sys.executable, "-m", "prefetchd", "check", "--config", str(p)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 78 and "dataset.root" in r.stderr and "does not exist" in r.stderr


def test_cli_check_summarises_a_good_config(tmp_path, image_root):
    from conftest import small_config

    r = subprocess.run([sys.executable, "-m", "prefetchd", "check", "--config", small_config(tmp_path, image_root)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "48 samples, 4 classes" in r.stdout and "8 batches of 6 per epoch" in r.stdout


def test_validation_section_defaults_and_errors(tmp_path):
    cfg = C.from_dict({"dataset": {"root": "/d"}, "loader": {"batch_size": 8}, "augment": {"output_size": 112},
                       "validation": {"enabled": True, "root": "/v"}})
    v = cfg.validation
    assert (v.batch_size, v.resize, v.capacity) == (8, 128, cfg.buffer.capacity)
    assert cfg.val_stream_fingerprint() != cfg.stream_fingerprint()
    # validation does not change the train stream's fingerprint
    assert cfg.stream_fingerprint() == C.from_dict({"dataset": {"root": "/d"}, "loader": {"batch_size": 8},
                                                    "augment": {"output_size": 112}}).stream_fingerprint()
    bad = {
        "validation.root": {"enabled": True},
        "validation.enabled": {"enabled": "yes", "root": "/v"},
        "validation.batch_size": {"batch_size": 0},
        "validation.resize": {"resize": 100},
        "validation.capacity": {"capacity": -1},
        "validation.file_list": {"root": "/v", "file_list": "/l"},
    }
    for key, body in bad.items():
        with pytest.raises(C.ConfigError) as e:
            C.from_dict({"dataset": {"root": "/d"}, "validation": body})
        assert str(e.value).startswith(key) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(C.ConfigError, match="capacity"):
        C.from_dict({"dataset": {"root": "/d"}, "validation": {"capcity": 3}})


def test_reload_takes_validation_capacity_but_refuses_other_validation_changes():
    from prefetchd.core.config import reload_blockers

    base = {"dataset": {"root": "/d"}, "validation": {"enabled": True, "root": "/v"}}
    old = C.from_dict(base)
    assert reload_blockers(old, C.from_dict({**base, "validation": {**base["validation"], "capacity": 3}})) is None
    assert reload_blockers(old, C.from_dict({**base, "buffer": {"capacity": 5}})) is None  # a defaulted capacity
    for change in ({"root": "/w"}, {"batch_size": 7}, {"resize": 300}, {"enabled": False}):
        new = C.from_dict({**base, "validation": {**base["validation"], **change}})
        assert reload_blockers(old, new) == "validation.enabled/root/file_list/devkit/batch_size/resize", change


def test_validation_is_decoded_on_the_cpu_under_hybrid_decode():
    from prefetchd.core import hybrid

    cfg = C.from_dict({"dataset": {"root": "/d"}, "augment": {"decode": "hybrid", "gpu_share": 1.0},
                       "validation": {"enabled": True, "root": "/v"}})
    assert hybrid.on_gpu(cfg.augment, 0, 0)  # train batches go to the GPU
    v = cfg.val_augment()
    assert v.decode == "cpu" and not any(hybrid.on_gpu(v, 0, b) for b in range(8))


def test_reload_refuses_what_only_a_start_applies_to_the_workers():
    """workers.priority is set by each worker as it starts and the executor picks the pool: a SIGHUP
    that changed them said "reloaded" while the workers kept the old ones."""
    from prefetchd.core.config import reload_blockers

    base = {"dataset": {"root": "/d"}}
    old = C.from_dict(base)
    assert reload_blockers(old, C.from_dict({**base, "workers": {"count": 3, "task_timeout_s": 9}})) is None
    for change in ({"priority": "normal"}, {"executor": "mixed"}, {"ray": {"workers": 5}}):
        new = C.from_dict({**base, "workers": change})
        assert reload_blockers(old, new) == "workers.priority/executor/ray", change


@pytest.mark.parametrize("daemon, client, said", [
    ({}, {"augment": {"random_erasing": {"p": 1.0, "erase_on": "client"}}},
     "augment.random_erasing.erase_on client here, daemon in the daemon's config; augment.random_erasing.p 1.0 here, "
     "0.0 in the daemon's config"),
    ({"augment": {"random_erasing": {"p": 1.0, "erase_on": "client"}}},
     {"augment": {"random_erasing": {"p": 1.0, "erase_on": "client", "mode": "pixel"}}},
     "augment.random_erasing.mode pixel here, const in the daemon's config"),
    ({"loader": {"shuffle": "block"}}, {"loader": {"shuffle": "block", "shuffle_window": 2}},
     "loader.shuffle_window 2 here, 8 in the daemon's config"),
])
def test_a_client_of_another_stream_is_told_the_keys_that_differ_and_no_others(daemon, client, said):
    """The daemon's meta.json ``stream`` (read back from JSON: lists, not tuples) against the
    client's config: only the keys that changed are named, a mapping's by its inner key; not
    augment.ops and augment.policy beside them (equal, or left out of a config without extras),
    and a block shuffle's window is named (it was "loader or augment settings differ")."""
    import json

    from prefetchd.core.streamkeys import differences, stream_settings

    def cfg(body):
        return C.from_dict({"dataset": {"root": "/d"}, **body})

    theirs = json.loads(json.dumps(stream_settings(cfg(daemon))))
    assert differences(stream_settings(cfg(client)), theirs) == said
