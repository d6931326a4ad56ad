# Every target sets itself up from a fresh clone: .venv, the pinned CPU torch, then smp-fx (editable, dev).
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.smp-fx-installed

.PHONY: setup demo test lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -q  # testpaths: tests/ and the packages' docstring examples

lint: $(STAMP)
	$(PY) -m ruff check smp_fx passes cost_model tests examples benchmarks conftest.py
	$(PY) -m mypy

clean:
	rm -rf $(VENV) build *.egg-info
