# make demo: set everything up and run the main job.   make test: set everything up and pass the tests.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python

.PHONY: setup services lint typecheck test demo bench clean

# The package folders are mapped to runbrake.* (pyproject.toml), so the editable install is the
# strict kind: a tree of links under build/ that mypy can read. A module added or removed needs a
# new tree: the list of package files is kept in a file that changes only when the list does.
PACKAGE_FILES := $(sort $(wildcard shared/*.py broker/*.py worker/*.py broker/*/*.py worker/*/*.py))
PACKAGE_LIST := $(VENV)/.package-files
$(shell mkdir -p $(VENV) && (echo "$(PACKAGE_FILES)" | cmp -s - $(PACKAGE_LIST) || echo "$(PACKAGE_FILES)" > $(PACKAGE_LIST)))

$(VENV)/.installed: pyproject.toml $(PACKAGE_LIST)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]" --config-settings editable_mode=strict
	touch $@

setup: $(VENV)/.installed

services:
	@bash deploy/ensure-services.sh

lint: setup
	$(VENV)/bin/ruff check .

typecheck: setup
	$(VENV)/bin/mypy

test: setup services lint typecheck
	$(PY) -m pytest

demo: setup services
	$(VENV)/bin/runbrake demo

bench: setup services
	$(PY) -m bench.throughput
	$(PY) -m bench.cancel_latency

clean:
	rm -rf $(VENV) build dist .mypy_cache .ruff_cache .pytest_cache *.egg-info
