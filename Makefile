# Everything installs into .venv on first use; torch is pinned by constraints.txt so that no
# dependency swaps the CPU build for a CUDA one.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test test-fast lint bench run clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest

test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow" -x -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The FP8 benchmark (README: "Benchmarks"); BENCH_ARGS="--shapes quick" for a short run.
bench: $(STAMP)
	$(VENV)/bin/fp8rl bench fp8 $(BENCH_ARGS)

# The main job on the embedded default. Until the RL loop lands this is the FP8 benchmark.
run: bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
