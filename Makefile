# The two entry points (README): `make run` (the main job) and `make test` (the suite).
# Everything else is installed by the project itself: this file makes the tool's own
# virtualenv; `hmastack` makes the pinned CPU environment for vLLM under build/.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: run test unit lint lines clean

$(BIN)/hmastack: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check --progress-bar off -e '.[dev]'
	@touch $@

run: $(BIN)/hmastack
	$(BIN)/hmastack run $(if $(FULL),--full)

test: $(BIN)/hmastack
	$(BIN)/pytest

# The fast loop while changing the tool: tests/unit without TLC, mkdocs, vLLM trees
# or valgrind (pyproject.toml's `unit` marker), in seconds.
unit: $(BIN)/hmastack
	$(BIN)/pytest -m unit

# ruff also on the stages' tests (patches/*/tests); `hmastack refs`: every
# reference to a commit of the series holds (patches/README.md).
lint: $(BIN)/hmastack
	$(BIN)/ruff check src tests bench support/testkit patches \
		&& $(BIN)/ruff format --check src tests bench support/testkit patches \
		&& $(BIN)/vulture \
		&& $(BIN)/mypy \
		&& $(BIN)/hmastack refs

# Lines of tooling per line of product source (.ci/lines says what each counts).
lines:
	.ci/lines

# The build folder (build/, or HMASTACK_BUILD), unless a workspace holds commits or
# edits that patches/ does not: `hmastack clean` then names them and deletes nothing.
clean: $(BIN)/hmastack
	$(BIN)/hmastack clean
