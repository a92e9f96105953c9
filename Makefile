# Shortcuts for the scripts the README shows (the scripts need no make).
.PHONY: install train test test-slow bench
install:
	bash scripts/install.sh
train:
	bash scripts/train.sh $(ARGS)
test:
	bash scripts/test.sh $(PYTEST_ARGS)
test-slow:
	bash scripts/test.sh -m slow $(PYTEST_ARGS)
bench: install
	.venv/bin/python bench/env_throughput.py
