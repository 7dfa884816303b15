# Set-up and everyday commands. Everything is installed into $(VENV); nothing is installed by hand.
#   make demo   install llmpar and run the main job (`llmpar train` on 2 CPU ranks)
#   make test   install llmpar with its test extras and run the test suite (every tier: unit, ranks, e2e, gpu)
#   make test-fast    the unit tier and a smoke of the other tiers: what to run while working (docs/contributing.md)
#   make golden       rewrite tests/golden/ (DeepSpeed's reference runs) with the installed DeepSpeed
#   make lint   ruff check (pycodestyle, pyflakes, bugbear, import order), ruff format --check, and mypy on the typed
#               floors (pyproject.toml); `ruff format .` writes the formatting
#   make docs   the documentation site (docs/, mkdocs --strict) into build/site/, the configuration reference regenerated
#   make bench-suite  the op micro-benchmarks (pytest-benchmark, bench/suites/; BENCH_ARGS=--benchmark-save=NAME)
#   make lock         refresh constraints.txt (the known-good versions every install here uses) from the newest releases
#   make test-latest  the suite against the newest releases (.venv-latest, no constraints): finds an upstream break
PYTHON ?= python3
VENV   ?= .venv
# torch 2.13.0: a CPU build on the team's machines (from local disk); pick another pin for a GPU machine
TORCH  ?= torch==2.13.0
# the triton that CPU build is tested with (the interpreter runs the kernels); a CUDA build of torch pins its own
TRITON ?= $(if $(filter torch==2.13.0,$(TORCH)),triton==3.9.0)
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip -q --disable-pip-version-check
# known-good versions of every dependency but torch and what its build pins (TORCH picks those); `make lock` writes it
CONSTRAINTS ?= constraints.txt
# pytest's own script, not `python -m pytest`: `-m` would put the working directory first on sys.path
PYTEST := $(VENV)/bin/pytest
# the durations budget (tests/suite_rules.py): a test over 20 s on a quiet 2-core machine must say why (the time other
# processes take of a busy machine is not counted); raise the scale on a slower machine (CI passes its own)
TEST_BUDGET_SCALE ?= 1

.PHONY: demo test test-fast golden test-latest lock docs lint install install-test install-docs install-lint cuda-ext gpu-wheelhouse bench bench-suite clean

$(VENV)/.llmpar-installed: pyproject.toml setup.py $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade "setuptools>=68" wheel
	$(PIP) install "$(TORCH)" $(TRITON)
	$(PIP) install -c $(CONSTRAINTS) -e .
	touch $@

$(VENV)/.llmpar-test-installed: $(VENV)/.llmpar-installed
	# deepspeed builds from source and imports torch while doing so: build it against the torch we have
	$(PIP) install -c $(CONSTRAINTS) --no-build-isolation "deepspeed>=0.14"
	$(PIP) install -c $(CONSTRAINTS) -e ".[test,bench]"
	touch $@

$(VENV)/.llmpar-docs-installed: $(VENV)/.llmpar-installed
	$(PIP) install -c $(CONSTRAINTS) -e ".[docs]"
	touch $@

$(VENV)/.llmpar-lint-installed: $(VENV)/.llmpar-installed
	$(PIP) install -c $(CONSTRAINTS) -e ".[lint]"
	touch $@

install: $(VENV)/.llmpar-installed
install-test: $(VENV)/.llmpar-test-installed
install-docs: $(VENV)/.llmpar-docs-installed
install-lint: $(VENV)/.llmpar-lint-installed

lint: install-lint
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

demo: install
	$(VENV)/bin/llmpar env
	$(VENV)/bin/llmpar train

test: install-test
	LLMPAR_TEST_BUDGET_SCALE=$(TEST_BUDGET_SCALE) $(PYTEST) -q -ra tests

# while working: the unit tier (one process, no job) and the smoke set of the ranks / e2e tiers (tests/suite_rules.py)
test-fast: install-test
	LLMPAR_TEST_BUDGET_SCALE=$(TEST_BUDGET_SCALE) $(PYTEST) -q -ra -m "(unit and not slow) or smoke" tests

# DeepSpeed's reference runs that the DeepSpeed comparisons read (tests/reference_runs.py): commit what it rewrites
golden: install-test
	$(PY) tests/reference_runs.py

# the configuration reference is generated from the code that reads the config (tests/test_docs.py checks it is current)
docs: install-docs
	$(PY) -m llmpar.runtime.reference > docs/configuration.md
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# the suite against the newest releases of every dependency (torch stays $(TORCH)), in a venv made afresh
test-latest:
	rm -rf .venv-latest
	$(MAKE) test VENV=.venv-latest CONSTRAINTS=/dev/null TRITON=triton

# constraints.txt from a fresh install of the newest releases (commit the refresh on its own, after `make test-latest`)
lock:
	rm -rf .venv-lock
	$(MAKE) install-test VENV=.venv-lock CONSTRAINTS=/dev/null TRITON=triton
	bash .ci/lock.sh .venv-lock/bin/python "$(TORCH)" > constraints.txt.new
	mv constraints.txt.new constraints.txt

# llmpar's ops vs torch, one pytest-benchmark group per op, size and device (CPU, and CUDA when present; ~1 min on CPU)
bench-suite: install-test
	$(PYTEST) bench/ --benchmark-only $(BENCH_ARGS)

# compile csrc/ against a CUDA build of torch in a separate venv and check the binary (no GPU needed)
cuda-ext:
	bash .ci/build_cuda_ext.sh

# the wheels bench/gpu_check.sh needs on an offline GPU machine (pytest-xdist, pytest-timeout, ninja, ...) into
# .gpu-wheelhouse/; carry that folder to the GPU machine (docs/gpu-check.md)
gpu-wheelhouse:
	bash bench/gpu_wheelhouse.sh

clean:
	rm -rf build dist wheelhouse *.egg-info .venv-lock .venv-latest
