"""Webhook delivery: the outbox's events POSTed, signed, to the webhooks a run's spec names (docs/webhooks.md).

The operator names each webhook in the catalog (``[webhooks.NAME]``: ``url``, ``secret_env``, ``events``); a
spec names them in ``notify`` and can never give a URL. One :class:`WebhookDispatcher` per worker process; of
all those of a namespace, the holder of a lease in Redis delivers (as the relay does: worker/relay.py). It

1. reads the outbox through a consumer group of its own (``webhooks``: a cursor beside the relay's, so
   RabbitMQ being down or a receiver being down holds up neither), and for each event that a webhook the
   run names wants, queues a delivery (shared/_scripts.py, ``WEBHOOK_QUEUE``) on the *line* of that webhook
   and run, then acknowledges the entries;
2. sends the head of every line that is due, up to ``RUNBRAKE_WEBHOOK_CONCURRENCY`` at once, signed as the
   Standard Webhooks specification says (``webhook-id`` = the event id, ``webhook-timestamp``,
   ``webhook-signature: v1,<base64 HMAC-SHA256>``, signed with the PyPI ``standardwebhooks`` package); a 2xx
   answer moves the line on to its next delivery, anything else makes the line wait (exponential backoff
   from ``RUNBRAKE_WEBHOOK_BACKOFF_S`` to ``RUNBRAKE_WEBHOOK_BACKOFF_MAX_S``, each wait jittered) until the
   event is ``RUNBRAKE_WEBHOOK_RETRY_S`` old, when the delivery is given up and recorded (``gave_up``) and
   the line moves on. So: at least once, in order per run and webhook.

``RUNBRAKE_WEBHOOK_TIMEOUT_S`` bounds each request as a whole (connect, send, the answer's last byte read),
not each read: the requests go out on one event loop of the dispatcher's own (an anyio blocking portal the
pool's threads call into), under an anyio deadline, so a receiver that drips its answer a byte at a time
holds a delivery slot no longer than that (docs/webhooks.md, "What a receiver gets").
"""

from __future__ import annotations

import binascii
import datetime
import json
import os
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Any, Final

import anyio
import anyio.from_thread
import httpx2
import standardwebhooks
import structlog

from runbrake.shared.catalog import Catalog, CatalogFile, WebhookSpec, open_to
from runbrake.shared.outcome import DeliveryStatus
from runbrake.shared.records import OutboxEntry
from runbrake.shared.redaction import remember, scrub
from runbrake.shared.settings import Settings
from runbrake.shared.store import RunStore
from runbrake.worker.outbox_reader import OutboxReader
from runbrake.worker.parts import Health
from runbrake.worker.relay import event_message

log = structlog.get_logger(__name__)

BATCH: Final = 500
"""Outbox entries read per round (per shard)."""
BLOCK_MS: Final = 100
"""How long one outbox read waits for a new entry when nothing is due (a single Redis)."""
EXCERPT_CHARS: Final = 200
"""How much of a receiver's answer (or an error) is kept with a delivery."""
MAX_ANSWER_BYTES: Final = 4096
"""A receiver's answer is read up to this much; the rest is never read."""
MAX_SPEC_CACHE: Final = 10_000
"""Runs whose ``notify`` is remembered between rounds."""
SWEEP_S: Final = 60.0
"""How often deliveries older than the retention are deleted."""
PACE_S: Final = 0.05
"""After a round that read less than a batch and started no delivery, the wait before the next: events then
come in batches, not one round of five Redis round trips each (a worker spent a tenth of a core on that:
docs/benchmarks.md, "Overhead against a hand-written peer (`bench/overhead.py`)"). A delivery waits up to
this much longer."""
IDLE_PACE_S: Final = 1.0
"""The same wait while the catalog names no webhook: the entries are only acknowledged, so the outbox can be
trimmed."""


def backoff_s(attempts: int, settings: Settings) -> float:
    """The wait after the ``attempts``-th failure: doubling from the first backoff up to the cap, jittered down
    by up to half (so that the lines of a receiver that was down do not all come back at one instant)."""
    full = min(settings.webhook_backoff_max_s, settings.webhook_backoff_s * 2.0 ** min(attempts - 1, 32))
    return float(full * random.uniform(0.5, 1.0))


def notify_of(request: str | None) -> tuple[str, ...]:
    """The webhook names a stored request (the spec's JSON) lists in ``notify``; () for anything else."""
    if not request:
        return ()
    try:
        spec = json.loads(request)
    except ValueError:
        return ()
    names = spec.get("notify") if isinstance(spec, dict) else None
    if not isinstance(names, list):
        return ()
    return tuple(dict.fromkeys(n for n in names if isinstance(n, str)))


class WebhookDispatcher(OutboxReader):
    """Queues the outbox's events for the webhooks runs name, and delivers them, while it holds the lease."""

    role = "webhook_dispatcher"
    event = "webhooks"
    working = "delivering"
    unread = "unqueued"

    def __init__(self, settings: Settings, store: RunStore, catalog: Catalog | CatalogFile | None = None) -> None:
        super().__init__("runbrake-webhooks", store.webhook_cursor())
        self._settings = settings
        self._store = store
        self._catalog = catalog if catalog is not None else (
            CatalogFile(settings.catalog) if settings.catalog else Catalog.empty())
        self.delivered = 0
        """Deliveries this dispatcher got a 2xx for since it started."""
        self._notify: OrderedDict[str, tuple[str, ...]] = OrderedDict()
        self._in_flight: set[str] = set()
        self._lock = threading.Lock()
        self._next_sweep = 0.0
        self._client: httpx2.AsyncClient | None = None
        self._portal: anyio.from_thread.BlockingPortal | None = None
        self._portal_context: AbstractContextManager[anyio.from_thread.BlockingPortal] | None = None
        self._pool: ThreadPoolExecutor | None = None

    def health(self) -> Health:
        if not self.is_alive():
            return Health(False, "not running")
        return Health(True, "delivering" if self.leading else "standing by")

    def _open(self) -> None:
        self._portal_context = anyio.from_thread.start_blocking_portal(name="runbrake-webhook-http")
        self._portal = self._portal_context.__enter__()
        self._client = httpx2.AsyncClient(
            timeout=httpx2.Timeout(self._settings.webhook_timeout_s), follow_redirects=False, trust_env=False,
            limits=httpx2.Limits(max_connections=self._settings.webhook_concurrency))
        self._pool = ThreadPoolExecutor(self._settings.webhook_concurrency, thread_name_prefix="runbrake-webhook")

    def _close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self._portal is not None and self._client is not None:
            self._portal.call(self._client.aclose)
        if self._portal_context is not None:
            self._portal_context.__exit__(None, None, None)

    def _totals(self) -> dict[str, Any]:
        return {"delivered": self.delivered}

    # -- one round ----------------------------------------------------------------------------------

    def _work(self) -> None:
        assert self._pool is not None
        catalog = self._current_catalog()
        sent = self._send_due(self._pool, catalog)
        queued = self._queue_new(catalog, block=not sent)
        if not catalog.webhooks:
            self._stopping.wait(IDLE_PACE_S)
        elif not sent and queued < BATCH:
            self._stopping.wait(PACE_S if queued or not self._store.cluster else 0.1)
        if time.monotonic() > self._next_sweep:
            self._next_sweep = time.monotonic() + SWEEP_S
            self._sweep()

    def _current_catalog(self) -> Catalog:
        return self._catalog if isinstance(self._catalog, Catalog) else self._catalog.current()

    def _queue_new(self, catalog: Catalog, *, block: bool) -> int:
        """Queue the deliveries of the outbox's next events; answers how many entries were read."""
        entries = self._next_entries(count=BATCH, block_ms=BLOCK_MS if block and not self._store.cluster else None)
        if not entries:
            return 0
        if catalog.webhooks:
            self._learn_notify(entries)
            now = time.time()
            for entry in entries:
                self._queue_entry(entry, catalog, now)
        self.done += entries
        return len(entries)

    def _learn_notify(self, entries: Sequence[OutboxEntry]) -> None:
        unknown = list(dict.fromkeys(e.run_id for e in entries if e.run_id not in self._notify))
        if not unknown:
            return
        requests = self._store.run_requests(unknown)
        for run_id, request in zip(unknown, requests, strict=True):
            self._notify[run_id] = notify_of(request)
            if len(self._notify) > MAX_SPEC_CACHE:
                self._notify.popitem(last=False)

    def _queue_entry(self, entry: OutboxEntry, catalog: Catalog, now: float) -> None:
        # A webhook for some tenants gets only their runs' events, should the catalog have changed since the run was
        # admitted (docs/security.md, "Tenants").
        names = [n for n in self._notify.get(entry.run_id, ()) if n in catalog.webhooks
                 and open_to(catalog.webhooks[n].tenants, entry.tenant or None)]
        if not names:
            return
        message = event_message(entry, cluster=self._store.cluster)
        if message is None:
            return
        for name in names:
            if not catalog.webhooks[name].wants(message.routing_key):
                continue
            self._store.webhook_queue(name, entry.run_id, message.event_id, event_type=message.routing_key,
                                      body=message.body.decode(), occurred_at=message.occurred_at, now=now)

    def _send_due(self, pool: ThreadPoolExecutor, catalog: Catalog) -> int:
        """Start sending the head of each due line not in flight; answers how many were started."""
        with self._lock:
            room = self._settings.webhook_concurrency - len(self._in_flight)
            busy = set(self._in_flight)
        if room <= 0:
            self._stopping.wait(0.01)
            return 1  # busy: do not block on the outbox
        due = [m for m in self._store.webhooks_due(now=time.time(), count=room + len(busy)) if m not in busy][:room]
        if not due:
            return 0
        heads = self._store.webhook_heads(due)
        started = 0
        for member, head in zip(due, heads, strict=True):
            if not head.get("event_id"):
                continue
            with self._lock:
                self._in_flight.add(member)
            pool.submit(self._deliver, catalog, member, head)
            started += 1
        return started

    # -- one attempt (in the pool's threads) -----------------------------------------------------------

    def _deliver(self, catalog: Catalog, member: str, head: Mapping[str, str]) -> None:
        try:
            self._attempt(catalog, head)
        except Exception:
            log.exception("webhook_attempt_crashed", webhook=head.get("webhook"), event_id=head.get("event_id"))
        finally:
            with self._lock:
                self._in_flight.discard(member)

    def _attempt(self, catalog: Catalog, head: Mapping[str, str]) -> None:
        name, run_id, event_id = head["webhook"], head.get("run_id", ""), head["event_id"]
        attempts = int(head.get("attempts", "0") or 0) + 1
        hook = catalog.webhooks.get(name)
        code = 0
        if hook is None:
            ok, error = False, f"the webhook {name!r} is no longer in the catalog"
        else:
            ok, code, error = self._post(hook, event_id, head.get("body", ""))
        now = time.time()
        created = float(head.get("created_at", now) or now)
        if ok:
            outcome, next_at = DeliveryStatus.DELIVERED, now
            self.delivered += 1
        else:
            next_at = now + backoff_s(attempts, self._settings)
            late = hook is None or next_at - created > self._settings.webhook_retry_s
            outcome = DeliveryStatus.GAVE_UP if late else DeliveryStatus.RETRYING
            if outcome is DeliveryStatus.GAVE_UP:
                log.warning("webhook_gave_up", webhook=name, run_id=run_id, event_id=event_id, attempts=attempts,
                            error=error[:EXCERPT_CHARS])
        self._store.webhook_result(name, run_id, event_id, outcome=outcome, attempts=attempts, status_code=code,
                                   error=error[:EXCERPT_CHARS], now=now, next_at=next_at)

    def _post(self, hook: WebhookSpec, event_id: str, body: str) -> tuple[bool, int, str]:
        """POST one delivery; answers (2xx?, the status code or 0, what went wrong: a short excerpt)."""
        secret = os.environ.get(hook.secret_env, "")
        if not secret:
            return False, 0, f"{hook.secret_env} is not set on the worker"
        remember(secret)
        try:
            signer = standardwebhooks.Webhook(secret)
        except (ValueError, binascii.Error, standardwebhooks.webhooks.EmptyWebhookSecretError):
            return False, 0, f"{hook.secret_env} is not a whsec_<base64> secret"
        stamp = datetime.datetime.now(tz=datetime.UTC).replace(microsecond=0)
        headers = {
            "content-type": "application/json", "user-agent": "runbrake-webhooks",
            "webhook-id": event_id, "webhook-timestamp": str(int(stamp.timestamp())),
            "webhook-signature": signer.sign(event_id, stamp, body),
        }
        assert self._portal is not None
        timeout_s = self._settings.webhook_timeout_s
        try:
            status, excerpt = self._portal.call(self._request, hook.url, body.encode(), headers)
        except TimeoutError:
            return False, 0, f"no whole answer within {timeout_s:g} s (RUNBRAKE_WEBHOOK_TIMEOUT_S)"
        except httpx2.HTTPError as exc:
            return False, 0, scrub(f"{type(exc).__name__}: {exc}")
        if 200 <= status < 300:
            return True, status, ""
        text = excerpt[:EXCERPT_CHARS].decode(errors="replace")
        return False, status, scrub(f"HTTP {status}: {text}")

    async def _request(self, url: str, body: bytes, headers: Mapping[str, str]) -> tuple[int, bytes]:
        """POST on the portal's loop, the whole request within ``RUNBRAKE_WEBHOOK_TIMEOUT_S``; answers the status
        and the first :data:`MAX_ANSWER_BYTES` of the answer (the rest is never read).

        Raises:
            TimeoutError: the request, the answer's body included, took longer.
            httpx2.HTTPError: it could not be sent or the answer not read.
        """
        assert self._client is not None
        with anyio.fail_after(self._settings.webhook_timeout_s):
            async with self._client.stream("POST", url, content=body, headers=headers) as answer:
                excerpt = b""
                async for chunk in answer.aiter_bytes():
                    excerpt += chunk
                    if len(excerpt) >= MAX_ANSWER_BYTES:
                        break
        return answer.status_code, excerpt

    def _sweep(self) -> None:
        """Delete deliveries last touched longer than the retention ago (0 keeps them)."""
        if not self._settings.retention_s:
            return
        before = time.time() - self._settings.retention_s
        while not self._stopping.is_set() and self._store.webhook_sweep(before=before):
            pass

