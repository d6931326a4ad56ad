# Every target sets itself up from a fresh clone: .venv, the pinned CPU torch, then smp-fx (editable, dev).
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.smp-fx-installed
# A second environment with a transformers 4.x and a numpy 1.x (the SMP containers'
# generation of the Hugging Face Trainer), where `make test` runs the Trainer, safe-loader
# and Hugging Face pipeline tests again, and the trace memo on its model outputs.
TF4_VENV ?= .venv-transformers4
TF4_SPEC ?= transformers==4.46.3 accelerate==1.1.1 "numpy<2"
TF4_PY := $(TF4_VENV)/bin/python
TF4_STAMP := $(TF4_VENV)/.smp-fx-installed

.PHONY: setup demo test test-transformers4 bytecode lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

$(TF4_STAMP): pyproject.toml Makefile
	test -x $(TF4_PY) || $(PYTHON) -m venv $(TF4_VENV)
	$(TF4_PY) -m pip install -q "$(TORCH_SPEC)"
	$(TF4_PY) -m pip install -q $(TF4_SPEC) pytest pytest-timeout pytest-xdist networkx "numpy<2"
	$(TF4_PY) -m pip install -q --no-deps -e .
	touch $(TF4_STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# The project's modules compiled once: every rank and launched script imports them, and
# where PYTHONDONTWRITEBYTECODE is set each process would compile them again.
bytecode: $(STAMP)
	$(PY) -m compileall -q -j 0 smp_fx passes cost_model examples benchmarks tests conftest.py > /dev/null

test: $(STAMP) $(TF4_STAMP) bytecode
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=25  # testpaths: tests/ and the packages' docstring examples; two workers, tests/conftest.py
	$(MAKE) --no-print-directory test-transformers4

test-transformers4: $(TF4_STAMP)  # the Hugging Face Trainer and zoo tests with transformers 4.x
	$(TF4_PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile tests/examples/test_hf_trainer.py \
		tests/examples/test_hf_trainer_fp16.py \
		tests/examples/test_hf_use_cache.py tests/smp_fx/ckpt/test_safe_load.py \
		tests/examples/test_hf_zoo_pipeline.py tests/smp_fx/nn/huggingface/test_gptneox_rope.py \
		tests/passes/test_trace_memo.py

lint: $(STAMP)
	$(PY) -m ruff check smp_fx passes cost_model tests examples benchmarks conftest.py
	$(PY) -m mypy

clean:
	rm -rf $(VENV) $(TF4_VENV) build *.egg-info
