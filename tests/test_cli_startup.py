"""The CLI's start-up (issue 30, item 7): each command imports what it needs, so an ops script that runs
``runbrake --help``, ``show`` or ``cancel`` does not pay for the run spec's models, the catalog, the async
store or the HTTP API (broker/cli.py; the time it takes is measured by bench/cli_startup.py, never here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runbrake.shared import RunStatus, RunStore

# Runs the command as the console script does, then writes the names of the modules it imported.
_PROBE = """
import json, os, sys
from runbrake.broker.cli import main
try:
    main(sys.argv[1:], prog_name="runbrake")
except SystemExit:
    pass
with open(os.environ["RUNBRAKE_TEST_MODULES"], "w") as out:
    json.dump(sorted(sys.modules), out)
"""

NEVER = ("runbrake.shared.spec", "runbrake.shared.catalog", "runbrake.shared.async_store", "runbrake.broker.api",
         "runbrake.broker.client", "runbrake.worker", "jsonschema", "httpx2", "mcp", "starlette", "pydantic",
         "pydantic_settings", "pydantic_core", "dramatiq", "anyio")
"""What none of the three commands needs: the settings are a plain dataclass (shared/settings.py), a cancel
publishes no Dramatiq message."""


def _imported(tmp_path: Path, *args: str) -> tuple[set[str], subprocess.CompletedProcess[str]]:
    out = tmp_path / "modules.json"
    done = subprocess.run([sys.executable, "-c", _PROBE, *args], env={**os.environ, "RUNBRAKE_TEST_MODULES": str(out)},
                          capture_output=True, text=True, timeout=60, check=False)
    return set(json.loads(out.read_text())), done


def _loaded(modules: set[str], *names: str) -> list[str]:
    return sorted(m for m in modules if any(m == n or m.startswith(f"{n}.") for n in names))


def test_help_imports_click_and_the_error_classes_only(tmp_path: Path) -> None:
    modules, done = _imported(tmp_path, "--help")

    assert done.returncode == 0, done.stderr
    assert "enqueue" in done.stdout
    assert _loaded(modules, *NEVER, "redis", "structlog", "pika", "runbrake.shared.settings", "runbrake.shared.store",
                   "runbrake.shared.records") == []
    assert _loaded(modules, "runbrake") == ["runbrake", "runbrake.broker", "runbrake.broker.cli", "runbrake.shared",
                                            "runbrake.shared.errors", "runbrake.shared.status"]


@pytest.mark.integration
def test_show_and_cancel_import_the_store_but_not_pydantic_dramatiq_the_spec_the_catalog_or_the_async_store(
    store: RunStore, tmp_path: Path,
) -> None:
    run_id = store.create({"input": "shown, then cancelled"}).run_id

    shown, show = _imported(tmp_path, "show", run_id)
    cancelled, cancel = _imported(tmp_path, "cancel", run_id, "--reason", "start-up test")

    assert show.returncode == 0, show.stderr
    assert run_id in show.stdout
    assert cancel.returncode == 0, cancel.stderr
    assert store.status(run_id) is RunStatus.CANCELLED
    assert _loaded(shown, *NEVER, "pika") == []
    assert _loaded(cancelled, *NEVER) == []
    assert {"runbrake.shared.store", "runbrake.shared.settings", "redis"} <= shown & cancelled
    assert "pika" in cancelled
