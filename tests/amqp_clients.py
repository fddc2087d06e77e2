"""What the tests of the RabbitMQ-only doors (cancel requests, run requests) share: Node's amqplib for the
clients in tests/clients/, and the types RabbitMQ gives the queues."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

CLIENTS = Path(__file__).parent / "clients"
NODE_MODULES = Path(__file__).resolve().parent.parent / ".venv" / "node"


def amqplib() -> Path:
    """Install amqplib once into .venv/node (npm); skip the test with npm's reason when it cannot."""
    if (NODE_MODULES / "node_modules" / "amqplib").is_dir():
        return NODE_MODULES
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        pytest.skip("node and npm are not installed; the Node client test needs them")
    NODE_MODULES.mkdir(parents=True, exist_ok=True)
    installed = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--silent", "--prefix", str(NODE_MODULES),
                                "amqplib@0"], capture_output=True, text=True, timeout=300, check=False)
    if installed.returncode != 0:
        pytest.skip(f"npm could not install amqplib here: {installed.stderr.strip()[-500:]}")
    return NODE_MODULES


def node_client(name: str) -> Path:
    """The Node client ``tests/clients/<name>``, copied beside node_modules so that its import finds amqplib."""
    script = amqplib() / name
    shutil.copy(CLIENTS / name, script)
    return script


def queue_types() -> dict[str, str]:
    """Every queue's type (classic, quorum) as ``rabbitmqctl`` lists them; skips the test where it cannot."""
    listed = subprocess.run(["rabbitmqctl", "-q", "list_queues", "name", "type"], capture_output=True, text=True,
                            timeout=60, check=False)
    if listed.returncode != 0:
        pytest.skip(f"rabbitmqctl cannot list queues here: {listed.stderr.strip()}")
    return dict(line.split("\t")[:2] for line in listed.stdout.splitlines() if "\t" in line)
