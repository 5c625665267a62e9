# Ironflow in Python — developer entry points.
#
#   make run     start a --dev engine node on http://localhost:9123 (SQLite under .ironflow/)
#   make test    the whole test suite, then ruff and mypy
#   make bench   scripts/bench.py
#   make lint    ruff and mypy
#
# The first target that needs it creates .venv with a Python >= 3.11 and installs
# the package with its dev extras; the stamp file makes later runs skip that step
# until pyproject.toml changes.

VENV  := .venv
BIN   := $(VENV)/bin
STAMP := $(VENV)/.ironflow-installed

# The first interpreter on PATH that is >= 3.11 (override: make PYTHON=/path/to/python3.12).
PYTHON ?= $(shell for p in python3.13 python3.12 python3.11 python3; do \
	command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null \
	&& { echo $$p; break; }; done)

.PHONY: run test bench lint install clean

install: $(STAMP)

$(BIN)/python:
	@test -n "$(PYTHON)" || { echo "error: ironflow needs Python >= 3.11 (none found on PATH; set PYTHON=...)" >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	@touch $(STAMP)

run: $(STAMP)
	$(BIN)/ironflow serve --dev

# Two phases: the suite on two processes (most integration tests wait on real
# time, not on a core), then the tests marked `serial` (they assert wall-clock
# bounds) alone. PYTEST_WORKERS=0 runs the first phase in one process.
PYTEST_WORKERS ?= 2

test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) -m "not serial"
	$(BIN)/python -m pytest -q -m serial
	$(BIN)/ruff check .
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python scripts/bench.py

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

clean:
	rm -rf $(STAMP) .pytest_cache .ruff_cache .mypy_cache build *.egg-info
