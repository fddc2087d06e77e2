# make demo: set everything up and run the main job.   make test: set everything up and pass the tests.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python

.PHONY: setup services browser lint typecheck docs configuration test test-long fuzz demo bench bench-peers wheel-check lock manifests soak clean

# The package folders are mapped to runbrake.* (pyproject.toml), so the editable install is the
# strict kind: a tree of links under build/ that mypy can read. A module added or removed needs a
# new tree: the list of package files is kept in a file that changes only when the list does.
PACKAGE_FILES := $(sort $(wildcard shared/*.py shared/*/*.py broker/*.py worker/*.py broker/*/*.py worker/*/*.py broker/page/*))
PACKAGE_LIST := $(VENV)/.package-files
$(shell mkdir -p $(VENV) && (echo "$(PACKAGE_FILES)" | cmp -s - $(PACKAGE_LIST) || echo "$(PACKAGE_FILES)" > $(PACKAGE_LIST)))

# The venv gets the same pinned versions as the image (deploy/constraints.txt, written by `make lock`).
CONSTRAINTS := deploy/constraints.txt

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS) $(PACKAGE_LIST)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]" --constraint $(CONSTRAINTS) --config-settings editable_mode=strict
	touch $@

setup: $(VENV)/.installed

services:
	@bash deploy/ensure-services.sh

# The runs page's tests drive Debian's chromium headless through Playwright (never Playwright's own
# browser download). Installed here when missing; says exactly what is missing when it cannot be.
CHROMIUM := /usr/bin/chromium
browser:
	@test -x $(CHROMIUM) || { \
		echo "browser: $(CHROMIUM) is missing; installing Debian's chromium package (apt-get install -y chromium)"; \
		if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
			(apt-get install -y -q chromium || (apt-get update -q && apt-get install -y -q chromium)) >/dev/null \
			|| { echo "browser: apt-get could not install chromium; the runs page tests need $(CHROMIUM)" >&2; exit 1; }; \
		else \
			echo "browser: cannot install chromium here (needs root and apt-get); install Debian's chromium package so that $(CHROMIUM) exists" >&2; exit 1; \
		fi; }
	@test -x $(CHROMIUM) || { echo "browser: $(CHROMIUM) still missing after installing chromium" >&2; exit 1; }

# lint-imports: the layers of pyproject.toml's [tool.importlinter] (docs/architecture.md, "Layers").
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

typecheck: setup
	$(VENV)/bin/mypy

# The reference in docs/ as a MkDocs site (mkdocs.yml): --strict turns a broken link or anchor into a failure.
# NO_MKDOCS_2_WARNING: Material's end-of-life banner says nothing about this site.
DOCS_SITE := $(or $(TMPDIR),/tmp)/runbrake-docs-site
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet --site-dir $(DOCS_SITE)
	rm -rf $(DOCS_SITE)

# docs/configuration.md is generated from the fields of Settings (shared/settings.py); tests/test_docs.py
# checks that the committed page is current.
configuration: setup
	$(PY) -m runbrake.shared._settings_doc > docs/configuration.md

# The whole suite on TEST_WORKERS pytest-xdist processes (most tests wait on Redis, RabbitMQ, MCP servers and
# worker processes, so three share two cores well): the tests marked long go first, one after the other on one
# worker, while the others share out the rest test by test (tests/conftest.py; docs/development.md, "Tests").
TEST_WORKERS ?= 3
test: setup services browser lint typecheck docs
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

# The tests that take minutes of wall clock each alone (make test runs them too): the 3-minute soak
# (tests/test_soak.py), the three-node RabbitMQ cluster and the Redis Sentinel failover (tests/chaos/).
test-long: setup services
	$(PY) -m pytest -m long

# The property-based tests with many examples, at random (make test runs a bounded, derandomised few):
# every input (the spec, the envelopes and cancel requests on the real queues, the catalog and tokens files)
# and the HTTP API from its own /openapi.json, the answers of hostile model endpoints and MCP servers,
# dripped or not (tests/test_fuzz_*.py).
fuzz: setup services
	HYPOTHESIS_PROFILE=fuzz $(PY) -m pytest tests/test_fuzz_inputs.py tests/test_fuzz_queues.py tests/test_fuzz_api.py \
		tests/test_fuzz_endpoints.py \
		-q --timeout=7200 -p no:cacheprovider

demo: setup services
	$(VENV)/bin/runbrake demo

# The wheel alone in a fresh venv, run from a folder with nothing of the repository in it: its only
# top-level package is runbrake, `runbrake schema` prints the spec's schema, `runbrake demo` passes.
WHEEL_DIR := $(or $(TMPDIR),/tmp)/runbrake-wheel-check
wheel-check: setup services
	rm -rf $(WHEEL_DIR) && mkdir -p $(WHEEL_DIR)
	$(PY) -m pip wheel --quiet --no-deps --wheel-dir $(WHEEL_DIR)/dist .
	$(PY) -c "import glob, zipfile; w = zipfile.ZipFile(glob.glob('$(WHEEL_DIR)/dist/*.whl')[0]); \
		top = [w.read(n).decode().split() for n in w.namelist() if n.endswith('top_level.txt')]; \
		print('top_level.txt:', top); assert top == [['runbrake']], top"
	$(PYTHON) -m venv $(WHEEL_DIR)/venv
	$(WHEEL_DIR)/venv/bin/python -m pip install --quiet $(WHEEL_DIR)/dist/runbrake-*.whl
	cd $(WHEEL_DIR) && venv/bin/runbrake schema > schema.json && venv/bin/python -c \
		"import json; assert json.load(open('schema.json'))['\$$schema'].endswith('2020-12/schema')"
	cd $(WHEEL_DIR) && venv/bin/runbrake demo

# Pin runbrake's dependencies (and theirs) for the image and the venv: install the project alone into a
# scratch venv and freeze it. Run it after changing [project].dependencies in pyproject.toml, with the
# Python the image uses (deploy/Dockerfile); tests/test_image.py checks that the pins and pyproject agree.
LOCK_DIR := $(or $(TMPDIR),/tmp)/runbrake-lock
lock:
	rm -rf $(LOCK_DIR) && $(PYTHON) -m venv $(LOCK_DIR)
	$(LOCK_DIR)/bin/python -m pip install --quiet --upgrade pip
	$(LOCK_DIR)/bin/python -m pip install --quiet ".[otel]"
	{ printf '%s\n' \
		"# Pinned versions of runbrake's dependencies and theirs: the image (deploy/Dockerfile) and" \
		"# 'make setup' install with --constraint this file. Written by 'make lock' (pip install . and" \
		"# pip freeze in a scratch venv, runbrake itself left out); do not edit by hand." \
		"# python: $$($(LOCK_DIR)/bin/python -c 'import platform; print(platform.python_version(), platform.system().lower(), platform.machine())')"; \
	  $(LOCK_DIR)/bin/python -m pip freeze --exclude runbrake; } > $(CONSTRAINTS).new
	mv $(CONSTRAINTS).new $(CONSTRAINTS)
	rm -rf $(LOCK_DIR)
	@echo "wrote $(CONSTRAINTS); run 'make setup' to install the new pins"

# The image's lint and the Kubernetes manifests' checks alone (make test runs them too): kubectl kustomize
# renders deploy/k8s/base and deploy/k8s/overlays/production, every object is validated against the
# Kubernetes API's schemas or the vendored CRD schemas, and the manifests are checked against the code.
manifests: setup
	$(PY) -m pytest -q tests/test_image.py tests/test_manifests.py

bench: setup services
	$(PY) -m bench.throughput
	$(PY) -m bench.cancel_latency
	$(PY) -m bench.stream_cancel
	$(PY) -m bench.steer_latency
	$(PY) -m bench.idle_cancel
	$(PY) -m bench.overhead
	$(PY) -m bench.api
	$(PY) -m bench.model_overhead
	$(PY) -m bench.relay
	$(PY) -m bench.webhooks
	$(PY) -m bench.run_requests
	$(PY) -m bench.replica_ack
	$(MAKE) bench-peers

# runbrake against Dramatiq + dramatiq-abort, arq, Celery and DBOS (bench/peers.py), with the peers extra; arq
# without its dependencies: every arq release requires redis<6, runbrake pins redis 8 (docs/benchmarks.md).
bench-peers: setup services
	$(PY) -m pip install --quiet -e ".[dev,peers]" --constraint $(CONSTRAINTS) --config-settings editable_mode=strict
	$(PY) -m pip install --quiet --no-deps "arq==0.28.0"
	$(PY) -m bench.peers

# An hour of mixed load with its verdict and plot (bench/soak.py; three minutes of it run in make test).
soak: setup services
	$(PY) -m pip install --quiet -e ".[dev,bench]" --constraint $(CONSTRAINTS) --config-settings editable_mode=strict
	$(PY) -m bench.soak --minutes 60 --plot docs/soak.png

clean:
	rm -rf $(VENV) build dist .mypy_cache .ruff_cache .pytest_cache .import_linter_cache *.egg-info
