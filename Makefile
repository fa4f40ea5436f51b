# The two commands: `make run` and `make test`. Each creates .venv if missing and installs the project.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CONFIG ?= tiny_cpu
# pytest-xdist workers for `make test`: auto = one per core; TEST_WORKERS=0 runs in this process (for -s, --pdb).
TEST_WORKERS ?= auto

.PHONY: run test lint docs install install-test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Stamps are tied to pyproject.toml: editing dependencies reinstalls.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

run: $(VENV)/.installed
	$(BIN)/jaxagent train $(CONFIG)

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -n $(TEST_WORKERS) $(PYTEST_ARGS)

lint: $(VENV)/.installed-test
	$(BIN)/ruff check

# docs/config.md and docs/cli.md from the config tree and the CLI's parser (tests/test_reference_pages.py fails
# when either is stale).
docs: $(VENV)/.installed
	$(BIN)/python -m jaxagent.reference_pages docs

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
