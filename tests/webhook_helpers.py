"""A webhook receiver the tests start (and bench/webhooks.py): a small HTTP server on loopback that checks
every delivery's signature with the PyPI ``standardwebhooks`` package (not runbrake's code) and records what
it accepted. It can be taken down (the port then refuses connections) and brought back on the same port."""

from __future__ import annotations

import base64
import http.server
import json
import secrets
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import standardwebhooks


def new_secret() -> str:
    """A signing secret as Standard Webhooks writes them: ``whsec_`` and 24 random bytes in base64."""
    return "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()


@dataclass
class Delivery:
    """One delivery the receiver accepted: its ``webhook-id`` and its body."""

    webhook_id: str
    body: dict[str, Any]


@dataclass
class Receiver:
    """Verifies and records deliveries; ``answer`` is the status it answers a verified one with."""

    secret: str
    port: int
    answer: int = 204
    accepted: list[Delivery] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    """Why deliveries were refused (a signature that did not verify)."""
    _server: http.server.ThreadingHTTPServer | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def start(self) -> None:
        receiver = self
        verifier = standardwebhooks.Webhook(self.secret)

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = min(int(self.headers.get("content-length", "0")), 1 << 20)
                body = self.rfile.read(length)
                try:
                    verifier.verify(body, dict(self.headers.items()))
                except standardwebhooks.webhooks.WebhookVerificationError as exc:
                    with receiver._lock:
                        receiver.refused.append(str(exc))
                    self.send_response(400)
                    self.end_headers()
                    return
                if receiver.answer < 300:
                    with receiver._lock:
                        receiver.accepted.append(Delivery(self.headers["webhook-id"], json.loads(body)))
                self.send_response(receiver.answer)
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"no")

            def log_message(self, format: str, *args: Any) -> None:
                pass

        http.server.ThreadingHTTPServer.allow_reuse_address = True
        server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        self._server = server
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def stop(self) -> None:
        """Take it down: the port refuses connections until :meth:`start`."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()

    def ids(self) -> list[str]:
        with self._lock:
            return [d.webhook_id for d in self.accepted]

    def of_run(self, run_id: str) -> list[Delivery]:
        """The run's deliveries in the order they arrived, each once (a repeat is at least once's right)."""
        seen: dict[str, Delivery] = {}
        with self._lock:
            for delivery in self.accepted:
                if delivery.body["run_id"] == run_id:
                    seen.setdefault(delivery.webhook_id, delivery)
        return list(seen.values())


@contextmanager
def cataloged_receiver(setenv: Callable[[str, str], None], secret_env: str,
                       **webhooks: list[str]) -> Iterator[Receiver]:
    """A receiver on a free port, signing with a new secret set in ``secret_env`` (through ``setenv``: a test's
    ``monkeypatch.setenv``), and each of ``webhooks`` (its name: the events it wants) in the test's catalog
    pointing at it; stopped on leaving."""
    from tests.catalog_helpers import catalog_path, to_toml
    from tests.ports import free_port

    secret = new_secret()
    setenv(secret_env, secret)
    hook = Receiver(secret, free_port())
    catalog_path().write_text(to_toml({"webhooks": {
        name: {"url": hook.url, "secret_env": secret_env, "events": events} for name, events in webhooks.items()}}))
    hook.start()
    try:
        yield hook
    finally:
        hook.stop()
