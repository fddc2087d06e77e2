"""The layers written as import-linter contracts in pyproject.toml cover the code as it is: every domain module
of shared/ is held to knowing nothing of RabbitMQ, and a new one is not left out unnoticed."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RABBITMQ_SIDE = {"runbrake.shared.messaging", "runbrake.shared.operations"}
"""The parts of shared/ that may import pika and Dramatiq (docs/architecture.md, "Layers")."""


def contracts() -> list[dict[str, Any]]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["importlinter"]
    assert config["root_package"] == "runbrake"
    return list(config["contracts"])


def test_every_domain_module_of_shared_is_held_to_knowing_nothing_of_rabbitmq() -> None:
    domain = next(c for c in contracts() if c["type"] == "forbidden" and "pika" in c["forbidden_modules"])
    modules = {f"runbrake.shared.{path.stem}" for path in (REPO / "shared").glob("*.py") if path.stem != "__init__"}
    packages = {f"runbrake.shared.{path.parent.name}" for path in (REPO / "shared").glob("*/__init__.py")}

    assert set(domain["source_modules"]) == (modules | packages) - RABBITMQ_SIDE
    assert {"pika", "dramatiq", *RABBITMQ_SIDE} <= set(domain["forbidden_modules"])


def test_the_worker_and_the_entry_points_sit_on_shared_and_do_not_import_each_other() -> None:
    layers = next(c for c in contracts() if c["type"] == "layers")

    assert layers["layers"] == ["runbrake.broker | runbrake.worker", "runbrake.shared"]
    # The one exception: `runbrake worker` starts the supervisor (broker/cli.py, inside that command).
    assert layers.get("ignore_imports") == ["runbrake.broker.cli -> runbrake.worker.supervisor"]
