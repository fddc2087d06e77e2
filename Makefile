# make demo: set everything up and run the main job.   make test: set everything up and pass the tests.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python

.PHONY: setup services lint typecheck test demo bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
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
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache *.egg-info
