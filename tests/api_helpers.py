"""A real ``runbrake serve`` process for integration tests, and a tokens file for it.

    api = start_api(tokens=tokens_file)    # waits until /healthz answers
    api.url                                # http://127.0.0.1:<port>

The server runs in the test's namespace (``RUNBRAKE_NAMESPACE`` is in the environment) on a free
loopback port, with its log in a file the failure messages quote.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx2
import pytest

from runbrake.broker.auth import digest
from runbrake.shared import RunStore, Settings
from tests.polling import poll_until
from tests.ports import free_port

_CONSOLE_SCRIPT = Path(sys.executable).parent / "runbrake"
STARTUP_TIMEOUT_S = 30.0

TOKENS = {
    "reader": ("read-token-1", ["read"]),
    "submitter": ("submit-token-1", ["read", "submit"]),
    "ops-alice": ("operate-token-1", ["read", "submit", "operate"]),
}
"""The tokens of :func:`write_tokens`: name → (token, roles)."""


def write_tokens(path: Path, tokens: dict[str, tuple[str, list[str]]] | None = None) -> Path:
    """A tokens file (docs/http-api.md, "Tokens") with these entries (default :data:`TOKENS`)."""
    lines = []
    for name, (token, roles) in (tokens or TOKENS).items():
        quoted = ", ".join(f'"{role}"' for role in roles)
        lines += [f"[tokens.{name}]", f'sha256 = "{digest(token)}"', f"roles = [{quoted}]", ""]
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


@dataclass
class ApiProcess:
    process: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()


def serve_command(*args: str) -> list[str]:
    return [str(_CONSOLE_SCRIPT), "serve", *args]


def launch_api(log_path: Path, *, tokens: Path | None = None, **env: str) -> ApiProcess:
    """Start ``runbrake serve`` on a free loopback port and wait until /healthz answers."""
    environment = {**os.environ, **env}
    environment.pop("RUNBRAKE_API_TOKENS", None)
    if tokens is not None:
        environment["RUNBRAKE_API_TOKENS"] = str(tokens)
    port = free_port()
    with log_path.open("wb") as log:
        process = subprocess.Popen(serve_command("--host", "127.0.0.1", "--port", str(port)), env=environment,
                                   stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    api = ApiProcess(process, f"http://127.0.0.1:{port}", log_path)

    def healthy() -> bool:
        try:
            return httpx2.get(f"{api.url}/healthz", timeout=1.0).status_code == 200
        except httpx2.TransportError:
            return False

    try:
        poll_until(healthy, timeout=STARTUP_TIMEOUT_S, interval=0.05,
                   failure=lambda: f"runbrake serve did not answer /healthz:\n{api.log()}",
                   give_up=lambda: process.poll() is not None)
    except BaseException:
        api.stop()  # a server that never answered is not left running (nor its Popen to warn at exit)
        raise
    return api


@pytest.fixture(name="start_api")
def start_api_fixture(store: RunStore, rabbitmq: Settings, tmp_path: Path) -> Iterator[Callable[..., ApiProcess]]:
    """A factory: ``start_api(tokens=None, **env)`` starts ``runbrake serve``; all are stopped at teardown."""
    started: list[ApiProcess] = []

    def start(*, tokens: Path | None = None, **env: str) -> ApiProcess:
        api = launch_api(tmp_path / f"api-{len(started)}.log", tokens=tokens, **env)
        started.append(api)
        return api

    yield start
    for api in started:
        api.stop()


@pytest.fixture(name="api")
def api_fixture(start_api: Callable[..., ApiProcess]) -> ApiProcess:
    """One ``runbrake serve`` without tokens (loopback)."""
    return start_api()


@pytest.fixture(name="tokens_file")
def tokens_file_fixture(tmp_path: Path) -> Path:
    return write_tokens(tmp_path / "tokens.toml")


def bearer(name: str) -> dict[str, str]:
    """The Authorization header of the :data:`TOKENS` entry ``name``."""
    return {"Authorization": f"Bearer {TOKENS[name][0]}"}
