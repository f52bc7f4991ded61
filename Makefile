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

.PHONY: demo test test-release bench sweep install
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
	$(PYTEST) tests

bench: $(STAMP)
	$(PY) bench/run_all.py

sweep: $(STAMP)
	$(PY) bench/op_sweep.py --engine both --json sweep_results.json
