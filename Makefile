# Set-up and everyday commands. Everything is installed into $(VENV); nothing is installed by hand.
#   make demo   install llmpar and run the main job (`llmpar train` on 2 CPU ranks)
#   make test   install llmpar with its test extras and run the test suite
#   make bench-suite  the op micro-benchmarks (pytest-benchmark, bench/suites/; BENCH_ARGS=--benchmark-save=NAME)
PYTHON ?= python3
VENV   ?= .venv
# torch 2.13.0: a CPU build on the team's machines (from local disk); pick another pin for a GPU machine
TORCH  ?= torch==2.13.0
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip -q --disable-pip-version-check

.PHONY: demo test install install-test cuda-ext gpu-wheelhouse bench bench-suite clean

$(VENV)/.llmpar-installed: pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade "setuptools>=68" wheel
	$(PIP) install "$(TORCH)"
	$(PIP) install -e .
	touch $@

$(VENV)/.llmpar-test-installed: $(VENV)/.llmpar-installed
	# deepspeed builds from source and imports torch while doing so: build it against the torch we have
	$(PIP) install --no-build-isolation "deepspeed>=0.14"
	$(PIP) install -e ".[test,bench]"
	touch $@

install: $(VENV)/.llmpar-installed
install-test: $(VENV)/.llmpar-test-installed

demo: install
	$(VENV)/bin/llmpar env
	$(VENV)/bin/llmpar train

test: install-test
	$(PY) -m pytest -q -ra tests

# llmpar's ops vs torch, one pytest-benchmark group per op, size and device (CPU, and CUDA when present; ~1 min on CPU)
bench-suite: install-test
	$(PY) -m pytest bench/ --benchmark-only $(BENCH_ARGS)

# compile csrc/ against a CUDA build of torch in a separate venv and check the binary (no GPU needed)
cuda-ext:
	bash .ci/build_cuda_ext.sh

# the wheels bench/gpu_check.sh needs on an offline GPU machine (pytest-xdist, pytest-timeout, ninja, ...) into
# .gpu-wheelhouse/; carry that folder to the GPU machine (README: GPU check)
gpu-wheelhouse:
	bash bench/gpu_wheelhouse.sh

clean:
	rm -rf build dist wheelhouse *.egg-info
