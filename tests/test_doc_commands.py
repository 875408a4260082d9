"""Issue 46: every shell command in docs/ and CONTRIBUTING.md is run by a test, so the pages cannot rot.

Each command of a ``sh`` block (read as ``tests/test_walkthrough.py`` reads the README's) must match
one entry of ``RUN_BY``: the test that runs it, and a token that test's file holds to run it. A command
added to a page without a test, an entry whose test is gone, or an entry no page needs any more fails
here. The README's commands are run as written by ``test_walkthrough.py::test_the_readme_as_written``;
the service steps written inline in docs/systemd.md by ``tests/test_systemd.py`` (``readme_command``).
The commands no other test runs are run here.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile

import pytest
from test_walkthrough import shell_commands

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["CONTRIBUTING.md", *sorted(f"docs/{n}" for n in os.listdir(os.path.join(ROOT, "docs")) if n.endswith(".md"))]
HERE = "tests/test_doc_commands.py"

# (the command, as a regular expression; the test that runs it; a token of that test's file that runs it)
RUN_BY = [
    (r"make (venv|test)\b", ".ci/run", "make test"),
    (r"make lint\b", f"{HERE}::test_make_lint_passes", '"lint"'),
    (r"make (demo|bench)\b", f"{HERE}::test_the_make_targets_run_the_documented_commands", '"demo", "bench"'),
    (r"cp config\.example\.yaml train\.yaml", "tests/test_walkthrough.py::test_a_newcomers_first_hour",
     '"config.example.yaml"'),
    (r"prefetchd check --config train\.yaml", "tests/test_walkthrough.py::test_a_newcomers_first_hour", '"check"'),
    (r"prefetchd run --config train\.yaml ", "tests/test_walkthrough.py::test_a_newcomers_first_hour", '"run"'),
    (r"prefetchd status --config train\.yaml \[--json\]", "tests/test_walkthrough.py::test_a_newcomers_first_hour",
     '"--json"'),
    (r"prefetchd launch --config train\.yaml -- CMD", "tests/test_launch.py::"
     "test_launch_runs_the_command_against_a_ready_daemon_and_exits_with_its_status", '"launch"'),
    (r"prefetchd node-config ", "tests/test_walkthrough.py::test_a_newcomers_first_hour", '"node-config"'),
    (r"prefetchd clean ", "tests/test_walkthrough.py::test_a_newcomers_first_hour", '"clean"'),
    (r"prefetchd preview ", "tests/test_walkthrough.py::test_a_newcomers_first_hour", '"preview"'),
    (r"prefetchd demo ", "tests/test_walkthrough.py::test_the_readme_as_written", '"prefetchd demo"'),
    (r"prefetchd bench \[--root DIR\]", "tests/test_walkthrough.py::test_a_newcomers_first_hour", '"bench"'),
    (r"prefetchd bench --root DIR --root TAR", f"{HERE}::test_bench_a_folder_and_its_tar_side_by_side",
     '"--root", str(tar)'),
    (r"pip install (\.|'\.\[(torch|ray|gpu)\]')  ", f"{HERE}::test_the_install_lines_resolve", "--dry-run"),
    (r"pip install torch==\S+ --index-url ", "tests/test_install.py::test_the_cpu_torch_step_pulls_no_cuda_wheel",
     "print-torch-cpu"),
    (r"pip install '\.\[torch\]'$", "tests/test_walkthrough.py::test_a_newcomers_first_hour", "[torch]"),
    (r"prefetchd run --config train3\.yaml &", "tests/test_examples.py::"
     "test_imagenet_example_resumes_a_two_rank_checkpoint_on_three_ranks", "daemon_factory"),
    (r"torchrun --nproc-per-node 3 examples/imagenet/train\.py train3\.yaml --resume", "tests/test_examples.py::"
     "test_imagenet_example_resumes_a_two_rank_checkpoint_on_three_ranks", "--resume"),
    (r"(mkdir -p|printf '%s\\n'|systemctl daemon-reload && systemctl restart) ",
     "tests/test_systemd.py::test_metrics_through_the_documented_drop_in", 'readme_block("## Metrics under systemd")'),
]


def documented_commands() -> list[tuple[str, str]]:
    """(page, command) for every command of every ``sh`` block of docs/ and CONTRIBUTING.md."""
    out = []
    for page in PAGES:
        for lang, block in re.findall(r"```(\w*)\n(.*?)```", open(os.path.join(ROOT, page)).read(), re.S):
            if lang in ("sh", "bash", "console"):
                out += [(page, c) for c in shell_commands(block)]
    return out


def _runner(cmd: str) -> tuple[str, str, str]:
    found = [e for e in RUN_BY if re.match(e[0], cmd)]
    assert len(found) == 1, f"{cmd!r}: {len(found)} entries of RUN_BY match it (one test must run it)"
    return found[0]


def test_every_documented_command_is_run_by_a_test():
    cmds = documented_commands()
    assert len(cmds) > 20, cmds
    used = set()
    for page, cmd in cmds:
        pattern, where, token = _runner(cmd)
        used.add(pattern)
        path, _, name = where.partition("::")
        text = open(os.path.join(ROOT, path)).read()
        assert not name or f"def {name}(" in text, f"{page}: {cmd!r}: {where} is gone"
        assert token in text, f"{page}: {cmd!r}: {path} does not hold {token!r}"
    assert not [p for p, _, _ in RUN_BY if p not in used], "RUN_BY entries no page needs any more"


def test_a_command_no_test_runs_is_caught():
    with pytest.raises(AssertionError, match="0 entries"):
        _runner("prefetchd frobnicate --config train.yaml")


def test_make_lint_passes():
    r = subprocess.run(["make", "-s", "lint"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_make_targets_run_the_documented_commands():
    """``make demo`` and ``make bench`` are the set-up and then ``prefetchd demo`` (run as written by
    test_walkthrough.py's README test) and ``prefetchd bench`` (run there with --root)."""
    for target, want in (("demo", "-m prefetchd demo"), ("bench", "-m prefetchd bench")):
        # --no-print-directory: under `make test` (MAKELEVEL 1) make would end with "Leaving directory"
        r = subprocess.run(["make", "--no-print-directory", "-n", target], cwd=ROOT, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0 and r.stdout.strip().splitlines()[-1].endswith(want), r.stdout + r.stderr


def test_the_install_lines_resolve(tmp_path):
    """docs/install.md's and docs/hybrid-decode.md's pip lines, with pip's resolver (--dry-run) against
    the registry pip is set up with, in one resolve of their extras together: each extra's own package
    is among what it would install."""
    lines = {"pip install .": "prefetchd", "pip install '.[torch]'": "torch", "pip install '.[ray]'": "ray",
             "pip install '.[gpu]'": "nvidia-nvimgcodec-cu13"}
    for line in lines:
        assert any(c.startswith(line) for _, c in documented_commands()), line
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q", "--report",
                        str(tmp_path / "r.json"), ".[torch,ray,gpu]"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    names = {i["metadata"]["name"].lower() for i in json.load(open(tmp_path / "r.json"))["install"]}
    assert set(lines.values()) <= names, sorted(names)


def test_bench_a_folder_and_its_tar_side_by_side(tmp_path):
    """docs/commands.md: ``prefetchd bench --root DIR --root TAR``, the same corpus as a folder and a tar."""
    from prefetchd.tools.samples import make_image_folder

    data = tmp_path / "mine"
    make_image_folder(str(data), classes=2, per_class=12, seed=4, long_side=120)
    tar = tmp_path / "mine.tar"  # as ImageNet's train tar: a tar of class tars
    with tarfile.open(tar, "w") as t:
        for cls in sorted(os.listdir(data)):
            with tarfile.open(tmp_path / f"{cls}.tar", "w") as c:
                for name in sorted(os.listdir(data / cls)):
                    c.add(data / cls / name, arcname=name)
            t.add(tmp_path / f"{cls}.tar", arcname=f"{cls}.tar")
    r = subprocess.run([sys.executable, "-m", "prefetchd", "bench", "--root", str(data), "--root", str(tar),
                        "--epochs", "1", "--batch-size", "6", "--workers", "1", "-q"],
                       cwd=str(tmp_path), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert str(data) in r.stdout and str(tar) in r.stdout, r.stdout
