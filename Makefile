# Each target creates its virtualenv on first use and installs what it needs.
# Default: torch 2.13.0 in .venv, pinned first so pip takes the CPU wheel on disk and never a
# CUDA build. TORCH=X.Y.Z picks another release of the supported range (2.11 to 2.15) in its own
# .venv-torchX.Y.Z (those releases pull about 5 GB of CUDA libraries from the registry):
#   make test TORCH=2.15.0         the whole suite on torch 2.15.0
#   make test-release TORCH=2.11.0 the release tier: demo (eager and compiled) + the suite
TORCH ?= 2.13.0
ifeq ($(TORCH),2.13.0)
VENV := .venv
else
VENV := .venv-torch$(TORCH)
endif
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST := $(PY) -m pytest -q -p no:cacheprovider

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==$(TORCH)
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

.PHONY: demo test test-release bench sweep install test-gpu bench-gpu test-clients docs
install: $(STAMP)

demo: $(STAMP)
	$(PY) -m shardprop.demo

test: $(STAMP)
	$(PYTEST) tests

# What CI runs on the oldest and newest releases: the demo eager and compiled, then the suite.
test-release: $(STAMP)
	$(PY) -c "import torch; print('torch', torch.__version__)"
	$(PY) -m shardprop.demo --steps 5
	$(PY) -m shardprop.demo --steps 3 --compile
	SHARDPROP_RELEASE=1 $(PYTEST) tests

bench: $(STAMP)
	$(PY) bench/run_all.py

sweep: $(STAMP)
	$(PY) bench/op_sweep.py --engine both --json sweep_results.json

# The docs site (mkdocs.yml, docs/): the docs extra joins the venv on first use (its own stamp, so `make test`
# never pays for it), then a strict build into site/: any warning (a broken link or anchor, a missing API
# reference, a docstring mkdocstrings cannot read) fails. The docstring examples and docs/examples/ run in
# `make test` (tests/test_docs.py).
DOCS_STAMP := $(VENV)/.installed-docs

$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install -q -e '.[docs]'
	touch $@

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --clean

# The CUDA tier (tests marked cuda: one GPU; gpu: two or more), skipped where torch sees no GPU;
# CPU CI never runs it. Its venv (.venv-gpu) takes torch's default build from the registry, the
# CUDA one on Linux x86-64, never the CPU wheel on disk; it refuses a CPU build. GPU_PY=python
# uses an interpreter that already has a CUDA torch (and shardprop importable) instead:
#   make test-gpu                      the whole tier (about 10-20 minutes on one GPU)
#   make test-gpu GPU_PY=.venv/bin/python   on a CPU machine: every test skips
#   make bench-gpu                     the CUDA benchmarks (dispatch hot path, TP step)
GPU_TORCH ?= 2.15.0
# Extra pytest arguments for the tier, e.g. GPU_PYTEST_ARGS="-n 6" (pytest-xdist) to fit a short lease.
GPU_PYTEST_ARGS ?=
GPU_VENV := .venv-gpu
GPU_PY ?= $(GPU_VENV)/bin/python
GPU_STAMP := $(if $(filter $(GPU_VENV)/bin/python,$(GPU_PY)),$(GPU_VENV)/.installed)

$(GPU_VENV)/.installed: pyproject.toml
	test -x $(GPU_VENV)/bin/python || python3 -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/python -m pip install -q "torch==$(GPU_TORCH)"
	$(GPU_VENV)/bin/python -m pip install -q -e '.[test]'
	$(GPU_VENV)/bin/python -c "import torch; assert torch.version.cuda, 'torch ' + torch.__version__ + ' is a CPU build: the GPU tier needs the CUDA build'; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"
	touch $@

test-gpu: $(GPU_STAMP)
	$(GPU_PY) -c "import torch; print('torch', torch.__version__, 'CUDA devices:', torch.cuda.device_count() if torch.cuda.is_available() else 0)"
	SHARDPROP_TEST_COLLECTIVE_TIMEOUT=300 $(GPU_PY) -m pytest -q -p no:cacheprovider -rs -m "cuda or gpu" $(GPU_PYTEST_ARGS) tests

bench-gpu: $(GPU_STAMP)
	$(GPU_PY) bench/dispatch.py --device cuda
	$(GPU_PY) bench/tp_cuda.py

# The clients tier: torchtitan's own trainer (debug llama3, fp32, 4 CPU gloo ranks under torchrun) on torch's
# stack and through `python -m shardprop.launch`, the losses compared step by step (tests/clients/). Its own
# venv (.venv-clients): torch 2.13.0 (CPU wheel), torchtitan 0.3.0, triton, shardprop editable. Minutes per
# configuration; CLIENTS_PYTEST_ARGS="-k fsdp4" picks configurations, CLIENTS_WORKDIR=dir keeps the runs' logs.
CLIENTS_VENV := .venv-clients
CLIENTS_PY := $(CLIENTS_VENV)/bin/python
CLIENTS_PYTEST_ARGS ?=

$(CLIENTS_VENV)/.installed: pyproject.toml
	test -x $(CLIENTS_PY) || python3 -m venv $(CLIENTS_VENV)
	$(CLIENTS_PY) -m pip install -q torch==2.13.0
	$(CLIENTS_PY) -m pip install -q torch==2.13.0 torchtitan==0.3.0 triton
	$(CLIENTS_PY) -m pip install -q -e '.[test]'
	touch $@

test-clients: $(CLIENTS_VENV)/.installed
	$(CLIENTS_PY) -c "import torch, torchtitan; print('torch', torch.__version__, 'torchtitan', torchtitan.__version__)"
	$(CLIENTS_PY) -m pytest -q -p no:cacheprovider tests/test_fsdp_spmd_types.py  # needs spmd_types (this venv has it)
	SHARDPROP_CLIENTS=1 $(CLIENTS_PY) -m pytest -q -p no:cacheprovider -rs -s -m clients $(CLIENTS_PYTEST_ARGS) tests/clients
