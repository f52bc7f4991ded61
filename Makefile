# Each target creates .venv on first use and installs what it needs.
# torch is pinned first so pip takes the CPU wheel on disk and never a CUDA build.
PY := .venv/bin/python
STAMP := .venv/.installed

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

.PHONY: demo test bench sweep install
install: $(STAMP)

demo: $(STAMP)
	$(PY) -m shardprop.demo

test: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) bench/run_all.py

sweep: $(STAMP)
	$(PY) bench/op_sweep.py
