"""Node clients of the tests (tests/clients/*.mjs), run with ``node`` beside an ``amqplib`` that npm installs
once into ``.venv/node``; a test that needs one is skipped, with npm's reason, where it cannot be installed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

CLIENTS = Path(__file__).parent / "clients"
NODE_MODULES = Path(__file__).resolve().parent.parent / ".venv" / "node"


def _amqplib() -> Path:
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
    """The client ``tests/clients/<name>`` copied beside node_modules (so that its import finds amqplib)."""
    script = _amqplib() / name
    shutil.copy(CLIENTS / name, script)
    return script
