"""The set-up's installs, dry-run with pip's own resolver: on a machine without a GPU, `make venv`
must never pull torch's CUDA build (multi-GB, and 19 nvidia/cuda/triton wheels with it)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# CUDA runtime wheels and what only the CUDA build of torch pulls; nvImageCodec and its nvJPEG
# (the dev extra's, 25 MB + 4 MB, no CUDA runtime) are the project's own choice, so allowed
_CUDA = re.compile(r"^(nvidia-(?!nvimgcodec|nvjpeg$)|cuda-|triton$)", re.I)


def _dry_run(args: list[str], tmp_path, name: str) -> tuple[int, list[tuple[str, str]], str]:
    report = tmp_path / f"{name}.json"
    p = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--report", str(report), *args],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    if p.returncode:
        return p.returncode, [], p.stderr[-2000:]
    got = json.loads(report.read_text())
    return 0, [(i["metadata"]["name"], i["metadata"]["version"]) for i in got["install"]], p.stderr


def _torch_cpu_args() -> list[str]:
    line = subprocess.run(["make", "-s", "print-torch-cpu"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.split()
    assert line[:3] == ["-m", "pip", "install"], line
    return [a for a in line[3:] if a != "-q"]


def test_the_cpu_torch_step_pulls_no_cuda_wheel(tmp_path):
    args = _torch_cpu_args()
    assert "--index-url" in args and args[args.index("--index-url") + 1].endswith("/whl/cpu"), args
    rc, wheels, err = _dry_run(["--ignore-installed", *args], tmp_path, "cpu-index")
    if rc:  # the CPU index cannot be reached: the Makefile falls back to the registry pip is set up with
        torch = [a for a in args if a.startswith("torch")]
        rc, wheels, err = _dry_run(["--ignore-installed", *torch], tmp_path, "fallback")
    assert rc == 0, err
    names = [n for n, _ in wheels]
    assert "torch" in names, wheels
    assert not [n for n in names if _CUDA.match(n)], f"the CPU step would pull CUDA wheels: {wheels}"


def test_the_projects_extras_accept_the_cpu_torch_installed(tmp_path):
    """After the CPU torch, `pip install -e '.[torch,dev,ray]'` keeps it: no extra asks for a torch
    (or anything) that only the CUDA build satisfies."""
    try:
        import torch
    except ImportError:
        pytest.skip("torch is not installed in this environment")
    assert not torch.version.cuda or os.path.exists("/dev/nvidiactl"), "a CUDA torch on a machine without a GPU"
    rc, wheels, err = _dry_run(["-e", ".[torch,dev,ray]"], tmp_path, "extras")
    assert rc == 0, err
    names = [n.lower() for n, _ in wheels]
    assert "torch" not in names, f"the extras would replace the installed torch: {wheels}"
    assert not [n for n in names if _CUDA.match(n)], f"the extras would pull CUDA wheels: {wheels}"


def test_the_cuda_pattern_knows_what_the_cuda_build_pulls():
    for n in ("nvidia-cublas-cu12", "nvidia-cuda-runtime-cu13", "triton", "cuda-bindings", "nvidia-nccl-cu12"):
        assert _CUDA.match(n), n
    for n in ("nvidia-nvimgcodec-cu13", "nvidia-nvjpeg", "torch", "numpy"):
        assert not _CUDA.match(n), n


# installed packages the set-up's warm-up leaves out, each with why: nvImageCodec's import prints
# nvTIFF's "[ERROR] Failed to load nvTIFF library" on a machine without it, for a few small modules
_NOT_WARMED = {"nvidia"}


def _imported_tops() -> set[str]:
    """The top-level names tests/, examples/ and the project import (``importorskip`` too)."""
    import ast
    import glob

    names = set()
    for f in [p for d in ("tests", "examples", "prefetchd", "client") for p in glob.glob(f"{ROOT}/{d}/**/*.py", recursive=True)]:
        for node in ast.walk(ast.parse(open(f, encoding="utf-8").read())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "importorskip" and node.args
                  and isinstance(node.args[0], ast.Constant)):
                names.add(node.args[0].value.split(".")[0])
    return names


def test_the_set_up_compiles_every_installed_package_the_suite_imports():
    """`make venv` installs without compiling (pip's --no-compile) and then imports WARM_TORCH and WARM_REST once
    to compile what the suite runs: a package left out is compiled afresh by every process that
    imports it where PYTHONDONTWRITEBYTECODE is set (lightning: each trainer of test_examples.py)."""
    import importlib.util

    line = subprocess.run(["make", "-s", "print-warm-imports"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout
    warmed = {m.strip().split(".")[0] for m in line.strip().removeprefix("import ").split(",")}
    installed = set()
    for name in _imported_tops():
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        where = (spec.origin or next(iter(spec.submodule_search_locations or []), "")) if spec else ""
        if "site-packages" in (where or ""):
            installed.add(name)
    assert "torch" in installed and "numpy" in installed, installed  # the scan sees the venv's packages
    assert not installed - warmed - _NOT_WARMED, f"the Makefile's warm-up (WARM_TORCH, WARM_REST) leaves out {sorted(installed - warmed - _NOT_WARMED)}"
