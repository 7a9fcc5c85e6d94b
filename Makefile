PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.install-stamp

.PHONY: install run demo test bench lint check-floors

install: $(STAMP)

# Reinstall only when the dependencies or the native kernels' sources change.
$(STAMP): pyproject.toml $(wildcard kvchat/engine/cpu/*.c kvchat/engine/cpu/*.h)
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

# Style (ruff's lint rules and its formatter, as pyproject.toml sets them) and types (mypy:
# strict on the engine and the store, checked everywhere else; see [tool.mypy]).
lint: install
	$(BIN)/ruff check kvchat tests
	$(BIN)/ruff format --check kvchat tests
	$(BIN)/mypy

# The engine and store tests on the lowest versions pyproject.toml allows (.ci/floors.py
# pins each floor), in a venv of their own made afresh: the floors it declares stay true.
# One serve file and one TUI file hold the floors of starlette, uvicorn and textual.
FLOORS := .venv-floors
FLOOR_TESTS := tests/test_kinds.py tests/test_session.py tests/test_checkpoint_save.py \
	tests/test_architectures.py tests/test_store.py tests/test_store_save.py tests/test_schema.py \
	tests/test_serve.py tests/tui/test_kind_dialog.py
check-floors: install
	rm -rf $(FLOORS)
	$(PY) -m venv $(FLOORS)
	$(BIN)/python .ci/floors.py > $(FLOORS)/constraints.txt
	$(FLOORS)/bin/python -m pip install -q --constraint $(FLOORS)/constraints.txt -e . pytest pytest-timeout openai
	$(FLOORS)/bin/python -m pip list | grep -Ei '^(mlx|mlx-lm|mlx-cpu|textual|numpy|pydantic|starlette|uvicorn) '
	$(FLOORS)/bin/python -m pytest -q -p no:cacheprovider $(FLOOR_TESTS)
