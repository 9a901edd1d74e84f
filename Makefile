# One-command setup: a virtual environment in .venv with everything installed.
# torch is pinned and installed first: on this CPU machine pip takes the CPU build from
# local disk; an existing CUDA build on your machine can be kept with TORCH="" (no reinstall).
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.medusa-installed

.PHONY: setup chat test bench lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if [ -n "$(TORCH)" ]; then $(PY) -m pip install -q "$(TORCH)"; fi
	$(PY) -m pip install -q -e ".[all]"
	touch $(STAMP)

setup: $(STAMP)

chat: $(STAMP)
	$(PY) -m infer.chat $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

bench: $(STAMP)
	$(PY) -m infer.bench $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check medusa infer train scripts tests

clean:
	rm -rf $(VENV) .pytest_cache
