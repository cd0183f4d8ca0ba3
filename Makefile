# The two commands a newcomer needs: `make demo` and `make test`. Both build their own environment.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test lint bench env env-test e2e-kind clean

env:
	@bash scripts/bootstrap.sh

env-test:
	@bash scripts/bootstrap.sh --for-tests

demo: env
	@$(VENV)/bin/kvpool demo

lint: env
	@$(VENV)/bin/ruff check .
	@$(VENV)/bin/ruff format --check .

test: env-test
	@bash scripts/test.sh

bench: env
	@$(PY) -m bench

e2e-kind: env
	@bash tests/e2e/run-kind.sh

clean:
	rm -rf $(VENV) .venv-vllm-latest .tools
