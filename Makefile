PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.install-stamp

.PHONY: install run demo test bench lint

install: $(STAMP)

# Reinstall only when the dependencies change.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install -e '.[dev]'
	touch $(STAMP)

run: install
	$(BIN)/kvchat

demo: install
	$(BIN)/kvchat --model demo

# One worker per core; a test file stays on one worker (its module fixtures are built once).
test: install
	$(BIN)/python -m pytest -q -n auto --dist loadfile

bench: install
	$(BIN)/kvchat bench

lint: install
	$(BIN)/ruff check kvchat tests
