"""Fixtures for the real services: each test gets its own namespace and cleans up after itself.

A service that cannot be reached fails the test under ``CI=true`` and skips it otherwise
(docs/development.md, "Development"). Nothing here stands in for Redis, RabbitMQ or MCP.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pika
import pytest
import redis
from hypothesis import settings as hypothesis_settings
from xdist.scheduler import LoadScopeScheduling

from runbrake.shared import RunStore, Settings
from runbrake.shared import logging as runbrake_logging
from runbrake.shared.messaging.cancel import CancelPublisher
from runbrake.shared.messaging.wire import delete_topology

# Fixtures for real MCP servers, real worker processes and the local OpenAI-compatible server.
# The property-based tests (tests/test_fuzz_*.py): `make test` runs the same bounded examples every time
# (a failure reproduces, it is never a flake); `make fuzz` (HYPOTHESIS_PROFILE=fuzz) many more, at random.
hypothesis_settings.register_profile("ci", max_examples=150, derandomize=True, deadline=None, database=None,
                                     print_blob=True)
hypothesis_settings.register_profile("fuzz", max_examples=20_000, deadline=None, print_blob=True)
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

pytest_plugins = ["tests.mcp_helpers", "tests.worker_helpers", "tests.openai_stub", "tests.llm_mock",
                  "tests.api_helpers", "tests.cluster_helpers"]


LONG_FILES = ("tests/test_soak.py", "tests/chaos/test_rabbitmq_cluster.py", "tests/chaos/test_redis_failover.py")
"""The files of the tests marked ``long`` (the soak, the RabbitMQ cluster, the Redis failover: minutes each)."""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests marked ``long`` go first (every xdist worker collects the same order)."""
    for item in items:
        if item.get_closest_marker("long") is not None and item.nodeid.split("::", maxsplit=1)[0] not in LONG_FILES:
            raise pytest.UsageError(f"{item.nodeid} is marked long: add its file to LONG_FILES (tests/conftest.py)")
    # Stable: the rest keep their order. Then the other chaos tests, one unit too (LongFirstScheduling).
    items.sort(key=lambda item: (item.get_closest_marker("long") is None, not _chaos(item.nodeid)))


def _chaos(nodeid: str) -> bool:
    return nodeid.startswith("tests/chaos/")


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """``make test`` (``-n 3 --dist loadgroup --no-loadscope-reorder``; docs/development.md, "Tests"): the long
    tests are one unit of work, sent first to one worker, where they run one after the other (each starts
    services of its own and loads the machine: never two at once); every other test is a unit of its own,
    shared out to the other workers as they free up. xdist's own ``xdist_group`` marks do not work with
    pytest 9 (xdist renames ``item._nodeid``, which pytest 9 no longer reads), hence this scheduler, which
    the controller makes from the test ids alone."""
    if config.getvalue("dist") != "loadgroup":
        return None
    return LongFirstScheduling(config, log)


class LongFirstScheduling(LoadScopeScheduling):
    """xdist's scope scheduling with one scope for the long tests, one for the other chaos tests (they kill,
    stop and time processes: two at once, beside the long ones, make each other's bounds a matter of luck),
    and one for each other test."""

    def _split_scope(self, nodeid: str) -> str:
        if nodeid.split("::", maxsplit=1)[0] in LONG_FILES:
            return "long"
        return "chaos" if _chaos(nodeid) else nodeid


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _unavailable(what: str, exc: BaseException) -> None:
    message = f"{what} is not reachable ({exc}); start it (docs/development.md, 'Services')"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture
def namespace(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """A fresh ``RUNBRAKE_NAMESPACE`` for this test, and a catalog of its own (``RUNBRAKE_CATALOG``, empty
    until the test adds servers: tests/catalog_helpers.py), both also set for subprocesses."""
    ns = f"test-{uuid.uuid4().hex[:12]}"
    monkeypatch.setenv("RUNBRAKE_NAMESPACE", ns)
    catalog = tmp_path / "catalog.toml"
    catalog.write_text("")
    monkeypatch.setenv("RUNBRAKE_CATALOG", str(catalog))
    monkeypatch.delenv("RUNBRAKE_ALLOW_INLINE", raising=False)
    # A worker stopped at a test's end hands its runs over after 2 s instead of draining for 30.
    monkeypatch.setenv("RUNBRAKE_DRAIN_S", "2")
    return ns


@pytest.fixture
def settings(namespace: str, request: pytest.FixtureRequest) -> Settings:
    """This test's settings; parametrized indirectly with ``"cluster"``, on a real three-master Redis Cluster
    (tests/cluster_helpers.py), so that ``store`` and the worker processes use it too."""
    if getattr(request, "param", "single") == "cluster":
        cluster: Settings = request.getfixturevalue("cluster_settings")
        return cluster
    return Settings.from_env()


@pytest.fixture
def store(settings: Settings) -> Iterator[RunStore]:
    """The real Redis run store under this test's namespace; every key it wrote is deleted afterwards."""
    run_store = RunStore.connect(settings)
    try:
        run_store.redis.ping()
    except redis.RedisError as exc:
        _unavailable(f"Redis at {settings.redis_url}", exc)
    yield run_store
    run_store.delete_namespace()
    run_store.close()


@pytest.fixture(name="publisher")
def publisher_fixture(rabbitmq: Settings) -> Iterator[CancelPublisher]:
    """A cancel publisher on the real RabbitMQ (a test module may define its own)."""
    publisher = CancelPublisher(rabbitmq)
    yield publisher
    publisher.close()


@pytest.fixture
def rabbitmq(settings: Settings) -> Iterator[Settings]:
    """The real RabbitMQ; the namespace's queues and exchanges are deleted afterwards."""
    try:
        connection = pika.BlockingConnection(pika.URLParameters(settings.rabbitmq_url))
    except pika.exceptions.AMQPError as exc:
        _unavailable(f"RabbitMQ at {settings.rabbitmq_url}", exc)
    connection.close()
    yield settings
    delete_broker_objects(settings)


def delete_broker_objects(settings: Settings) -> None:
    """Delete the namespace's queues (with Dramatiq's delay and dead-letter twins) and exchanges."""
    delete_topology(settings)


@pytest.fixture(scope="session", autouse=True)
def _logging_left_as_the_tests_have_it() -> Iterator[None]:
    """An in-process CLI call (click's CliRunner) must not configure structlog for the whole test process: the
    CLI filters at WARNING with loggers cached on first use (shared/logging.py), after which a later test's
    ``capture_logs()`` sees none of the INFO lines it waits for, in whichever test happens to run after it on
    the same xdist worker. The processes the tests start configure their own logging as always."""
    configured, runbrake_logging._configured = runbrake_logging._configured, True
    yield
    runbrake_logging._configured = configured
