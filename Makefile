# The two entry points of the README: `make demo` (tiny CPU GSPO run) and `make test`.
# Both create .venv from requirements-cpu.txt on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install system-deps demo test test-fast clean

$(STAMP): requirements-cpu.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements-cpu.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

# System packages the test suite needs (a real local Slurm); needs root, idempotent.
system-deps:
	bash tools/slurm_local.sh install

demo: install
	$(PY) tools/make_tiny_assets.py runs/tiny_assets
	OMP_NUM_THREADS=2 $(VENV)/bin/gspo-train configs/tiny_cpu.yaml

test: install system-deps
	$(PY) -m pytest -q -ra

test-fast: install
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) runs .pytest_cache
