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

.PHONY: demo demo-torchrl test lint typecheck unit pytest bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_PIP_ARGS) "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/quickstart.py

# PPO on CartPole-v1 with torchrl's MultiSyncCollector synced by raysync (about 2 minutes on 2 cores).
demo-torchrl: $(STAMP)
	$(BIN)/python examples/torchrl_ppo.py --check

lint: $(STAMP)
	$(BIN)/ruff check raysync tests examples benchmarks .ci
	$(BIN)/python .ci/layers.py

typecheck: $(STAMP)
	$(BIN)/mypy raysync

# The unit tests only (seconds, no Ray cluster); `make test` runs every level.
unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

pytest: $(STAMP)
	$(BIN)/python -m pytest -q --durations=10

test: lint typecheck pytest

bench: $(STAMP)
	$(BIN)/python benchmarks/push_fanout.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
