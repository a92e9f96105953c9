# Two targets do all set-up on a fresh Debian 12 machine (as root):
#   make train   installs everything, then trains the default job (PushCube-v1, PPO, MLP)
#   make test    installs everything, then runs the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
export RAY_USAGE_STATS_ENABLED := 0
export PYTHONUNBUFFERED := 1

.PHONY: install train test test-slow bench

install:
	bash scripts/install.sh

train: install
	$(VENV)/bin/m2flow-train $(ARGS)

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

test-slow: install
	$(PY) -m pytest -m slow $(PYTEST_ARGS)

bench: install
	$(PY) bench/env_throughput.py
