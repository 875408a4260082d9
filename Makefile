# Each target does its own set-up: a fresh clone needs nothing but python3 (>= 3.10) and make.
VENV      ?= .venv
PY        := $(VENV)/bin/python
# Without an NVIDIA GPU, install torch's CPU build first so the `torch` extra's range accepts it
# instead of pulling the multi-GB CUDA build. Elsewhere, override, e.g.
#   make test TORCH_CPU="torch --index-url https://download.pytorch.org/whl/cpu"
TORCH_CPU ?= torch==2.13.0

.PHONY: venv demo test lint bench clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q $(TORCH_CPU); fi
	$(PY) -m pip install -q -e '.[torch,dev,ray]'
	touch $@

demo: venv
	$(PY) -m prefetchd demo

test: venv
	$(PY) -m pytest -q

lint: venv
	$(VENV)/bin/ruff check prefetchd client tests examples

bench: venv
	$(PY) -m prefetchd bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
