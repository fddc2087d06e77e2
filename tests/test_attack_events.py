"""The attacks on the events streams of issue 15 ("Closed to an outside attack", items 5 and 6), replayed
against a real ``runbrake serve`` on the real Redis (docs/http-api.md, "Events: limits"; docs/security.md,
"Tested attacks").

- One stream held a whole run in memory, however slowly its client read: ten clients that never read a
  20 MB run took ``serve`` from 118 to 726 MB, for as long as their sockets stayed open.
- One ``PUBLISH <ns>:events '{"event":"status","run_id":["x"]}'`` killed the live-event hub silently.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx2
import pytest

from runbrake.broker import Client
from runbrake.broker.events import QUEUE_SIZE, EventHub, Subscriber
from runbrake.shared import RunStep, RunStore, Settings, StepKind
from tests.api_helpers import TOKENS, ApiProcess, bearer
from tests.polling import poll_until, poll_until_async
from tests.test_cli import valid_spec

pytestmark = pytest.mark.integration

MiB = 1024 * 1024


def running_run(store: RunStore) -> str:
    run_id = store.create(valid_spec()).run_id
    store.claim(run_id, "w", lease_s=600)
    return run_id


def metric(api: ApiProcess, name: str) -> float:
    """The value of one unlabelled metric of ``serve``'s /metrics."""
    for line in httpx2.get(f"{api.url}/metrics").text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise AssertionError(f"{name} is not in /metrics")


def wait_for_metric(api: ApiProcess, name: str, wanted: Callable[[float], bool], *, timeout: float = 30) -> None:
    poll_until(lambda: wanted(metric(api, name)), timeout=timeout, interval=0.1,
               failure=lambda: f"{name} = {metric(api, name)}:\n{api.log()}")


def proc_status(pid: int, field: str) -> int:
    """A ``/proc/<pid>/status`` field in bytes (VmRSS, VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for process {pid}")


def stalled_client(api: ApiProcess, path: str) -> socket.socket:
    """A client that asks for a stream and never reads a byte of it (a small receive window)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
    sock.connect(("127.0.0.1", int(api.url.rsplit(":", 1)[1])))
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    return sock


def closed_by_server(sock: socket.socket, *, timeout: float = 30) -> bool:
    """Read what the server sent until it closed the connection (EOF) or reset it (True), bounded."""
    sock.settimeout(timeout)
    try:
        while sock.recv(1 << 20):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


# -- the hub survives whatever is published ----------------------------------------------------------


def poisoned_messages(run_id: str) -> list[bytes]:
    """Messages on ``<ns>:events`` the store's scripts never publish: wrong types, not JSON, not UTF-8,
    nested past the decoder's depth, huge, numbers no integer holds, unknown statuses; several name the
    watched run so that they get as far as the step and progress readers."""
    deep = "[" * 100_000 + "]" * 100_000
    return [m if isinstance(m, bytes) else m.encode() for m in (
        '{"event":"status","run_id":["x"]}',  # the message: a list where a string goes
        '{"event":"status","run_id":{"a":1}}',
        f'{{"event":"status","run_id":"{run_id}","status":["running"]}}',
        f'{{"event":"status","run_id":"{run_id}","status":"exploded"}}',
        f'{{"event":"status","run_id":"{run_id}","status":"unknown"}}',
        f'{{"event":"status","run_id":"{run_id}","status":"running","termination_reason":7}}',
        f'{{"event":["step"],"run_id":"{run_id}"}}',
        f'{{"event":"step","run_id":"{run_id}","step":[1,2,3]}}',
        f'{{"event":"step","run_id":"{run_id}","step":{{"sequence":1e999,"kind":"model"}}}}',
        f'{{"event":"step","run_id":"{run_id}","step":{{"sequence":"x","kind":"model"}}}}',
        f'{{"event":"step","run_id":"{run_id}","step":{{"sequence":-4,"kind":"model"}}}}',
        f'{{"event":"step","run_id":"{run_id}","step":{{"sequence":1,"round":1e999}}}}',
        f'{{"event":"step","run_id":"{run_id}","step":{{"sequence":1,"detail":[1]}}}}',
        f'{{"event":"progress","run_id":"{run_id}","progress":"half"}}',
        f'{{"event":"delta","run_id":"{run_id}","delta":"some text"}}',
        f'{{"event":"delta","run_id":"{run_id}","delta":{{"round":true,"text":"x"}}}}',
        f'{{"event":"delta","run_id":"{run_id}","delta":{{"round":0,"text":"x"}}}}',
        f'{{"event":"delta","run_id":"{run_id}","delta":{{"round":1,"text":["x"]}}}}',
        f'{{"event":"step","run_id":"{run_id}","step":{deep}}}',
        deep,
        "not json at all",
        b"\xff\xfe\x00 not utf-8",
        "[1, 2, 3]",
        '"a string"',
        "null",
        "",
        '{"event":"status","run_id":"' + "a" * 4 * MiB + '"}',  # huge (below Redis's pub/sub buffer limits)
    )]


def test_a_poisoned_publish_is_skipped_and_the_next_real_status_event_still_reaches_its_client(
    api: ApiProcess, store: RunStore, settings: Settings
) -> None:
    run_id = running_run(store)
    poison = poisoned_messages(run_id)
    with Client(api.url) as client, httpx2.stream("GET", f"{api.url}/v1/events",
                                                  timeout=httpx2.Timeout(30.0)) as everything:
        stream = client.events(run_id, read_timeout_s=30)
        assert next(stream).event == "status"  # the replay: no steps yet, the status; then live
        for message in poison:
            store.redis.publish(f"{settings.namespace}:events", message)
        wait_for_metric(api, "runbrake_api_events_unreadable_total", lambda v: v >= len(poison))
        store.append_step(run_id, RunStep(kind=StepKind.MODEL, round=1, content="after the poison"))
        store.cancel(run_id, reason="enough", requested_by="t")
        after = [next(stream) for _ in range(2)]
        page_list = next(e for e in _status_events(everything) if e["run_id"] == run_id)
        ready = httpx2.get(f"{api.url}/readyz")

    assert [(e.event, e.data.get("content") or e.data.get("status")) for e in after] == [
        ("step", "after the poison"), ("status", "cancelled")]
    assert page_list["status"] == "cancelled"  # the runs page's stream of every run's status, too
    assert (ready.status_code, ready.json()["events"]) == (200, "ok")
    assert metric(api, "runbrake_api_events_unreadable_total") == len(poison)  # each skipped, none dispatched
    assert metric(api, "runbrake_api_event_hub_restarts_total") == 0
    assert api.log().count("event_hub_subscribed") == 1  # the subscription never broke
    assert api.log().count("event_unreadable") == 1  # logged once for the burst, not once per message


def test_a_stale_status_event_a_repeat_or_one_after_the_terminal_status_never_reaches_the_client(
    api: ApiProcess, store: RunStore, settings: Settings
) -> None:
    """A status's PUBLISH can reach the API after the replay read the run (issue 16: the claim's
    ``running`` arrived twice), or after a later terminal status: the stream sends neither."""
    run_id = running_run(store)

    def status(value: str, reason: str = "") -> str:
        return json.dumps({"event": "status", "run_id": run_id, "status": value, "termination_reason": reason})

    with Client(api.url) as client:
        stream = client.events(run_id, read_timeout_s=30)
        assert (first := next(stream)).event == "status"
        assert first.data["status"] == "running"  # the replay
        store.redis.publish(f"{settings.namespace}:events", status("running"))  # a late repeat
        store.cancel(run_id, reason="enough", requested_by="t")
        store.redis.publish(f"{settings.namespace}:events", status("running"))  # older than the cancel
        store.append_step(run_id, RunStep(kind=StepKind.MODEL, round=1, content="recorded after the cancel"))
        rest = list(stream)

    # The step of what the cancel cut off comes before the terminal status, which ends the stream.
    assert [(e.event, e.data.get("status") or e.data.get("content")) for e in rest] == [
        ("step", "recorded after the cancel"), ("status", "cancelled"), ("end", None)]


def _status_events(response: httpx2.Response) -> Iterator[dict[str, object]]:
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = json.loads(line.removeprefix("data: "))
            if "status" in data:
                yield data


@pytest.mark.anyio
async def test_a_hub_that_fails_on_something_unexpected_is_not_ready_restarts_counted_and_delivers_again(
    store: RunStore, settings: Settings
) -> None:
    """The hub's own code failing (here: the drop callback it was given raises once) ends its
    subscription; readiness says so at once, the failure is counted, and the hub subscribes again."""
    failures: list[bool] = []  # hub.ready as each restart was counted
    raised: list[str] = []

    def drop_fails_once() -> None:
        if not raised:
            raised.append("drop")
            raise RuntimeError("a bug in the hub")

    hub = EventHub(settings, on_drop=drop_fails_once, on_restart=lambda: failures.append(hub.ready))
    await hub.start()
    try:
        run_id = running_run(store)
        slow = hub.subscribe(run_id)  # never read: its queue fills, the drop callback raises
        for index in range(QUEUE_SIZE + 1):
            store.append_step(run_id, RunStep(kind=StepKind.MODEL, round=index, content=str(index)))
        await poll_until_async(lambda: failures, timeout=20, failure=lambda: "the hub did not fail")
        assert await hub.wait_ready(20)
        watcher = hub.subscribe(run_id)
        store.append_step(run_id, RunStep(kind=StepKind.MODEL, round=999, content="after the restart"))
        delivered = await _next_step(watcher)
    finally:
        await hub.stop()

    assert failures == [False]  # counted once, and not ready while it was down
    assert slow.dropped
    assert b"after the restart" in delivered
    assert not hub.ready  # stopped: its task is over


async def _next_step(subscriber: Subscriber) -> bytes:
    while True:
        event = await asyncio.wait_for(subscriber.queue.get(), 20)
        if event.kind == "step":
            return event.frame


def test_a_last_event_id_of_any_shape_is_422_or_a_position_and_never_breaks_the_stream(
    api: ApiProcess, store: RunStore
) -> None:
    run_id = running_run(store)
    store.append_step(run_id, RunStep(kind=StepKind.MODEL, round=1, content="one"))
    bad = [v.encode() for v in ("-1", "abc", "1e5", "0x10", "١٢", "1_0", "9" * 19, "9" * 5000, "1, 2", "\u00a0")]
    bad.append(b"\xff\xfe")  # not UTF-8: Starlette reads headers as latin-1
    with httpx2.Client(base_url=api.url) as http:
        refused = [http.get(f"/v1/runs/{run_id}/events", headers={"Last-Event-ID": value}) for value in bad]
    with Client(api.url) as client:
        far = client.events(run_id, last_event_id=10**17, read_timeout_s=30)
        beyond = next(far)  # past every step: nothing replayed, the status
        store.append_step(run_id, RunStep(kind=StepKind.MODEL, round=2, content="two"))
        store.cancel(run_id, reason="done", requested_by="t")
        rest = list(far)
        fresh = [(e.event, e.id) for e in client.events(run_id, read_timeout_s=30)]

    for value, response in zip(bad, refused, strict=True):
        assert response.status_code == 422, (value, response.text)
        assert response.json()["errors"][0]["loc"] == ["header", "last-event-id"]
    assert beyond.event == "status"
    assert [e.event for e in rest] == ["status", "end"]  # steps 2 is not after 10**17
    assert fresh == [("step", "1"), ("step", "2"), ("status", None), ("end", None)]


# -- clients that do not read ------------------------------------------------------------------------


STALLED = 12
STEPS, STEP_CHARS = 200, 100_000  # a 20 MB run, as in the issue


def test_clients_that_never_read_a_big_run_hold_no_more_than_a_page_each_and_are_dropped_after_the_timeout(
    start_api: Callable[..., ApiProcess], store: RunStore
) -> None:
    api = start_api(RUNBRAKE_API_SEND_TIMEOUT_S="2")
    run_id = running_run(store)
    for index in range(STEPS):
        store.append_step(run_id, RunStep(kind=StepKind.MODEL, round=index, content=f"{index:08d}" + "x" * STEP_CHARS))
    with Client(api.url) as client:  # one reader first: the replay arrives whole, in order, pieces joined
        replayed = []
        for event in client.events(run_id, read_timeout_s=30):
            replayed.append(event)
            if event.event == "step" and event.id == str(STEPS):
                break
    assert [int(e.id or 0) for e in replayed] == list(range(1, STEPS + 1))
    assert all(len(e.data["content"]) == 8 + STEP_CHARS for e in replayed)
    wait_for_metric(api, "runbrake_api_event_clients", lambda v: v == 0)

    pid = api.process.pid
    baseline = proc_status(pid, "VmRSS")
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS: the peak from here on
    clients = [stalled_client(api, f"/v1/runs/{run_id}/events") for _ in range(STALLED)]
    try:
        wait_for_metric(api, "runbrake_api_event_clients_stalled_total", lambda v: v == STALLED)
        peak = proc_status(pid, "VmHWM")
        closed = [closed_by_server(sock) for sock in clients]
    finally:
        for sock in clients:
            sock.close()
    wait_for_metric(api, "runbrake_api_event_clients", lambda v: v == 0)  # the subscribers are gone

    # Before: each such client held the whole run's frames (60 MB here), 720 MB for twelve.
    assert peak - baseline < 120 * MiB, f"peak {peak / MiB:.0f} MiB, baseline {baseline / MiB:.0f} MiB"
    assert all(closed)
    assert api.log().count("event_client_stalled") == STALLED
    assert '"aborted": true' in api.log()  # the connection went at once, with what the server buffered for it
    assert "ASGI" not in api.log()  # uvicorn saw a closed connection, not a response the app left unfinished
    with Client(api.url) as client:  # and the server serves the run as before
        assert next(client.events(run_id, last_event_id=STEPS - 1, read_timeout_s=30)).id == str(STEPS)


# -- streams per token -------------------------------------------------------------------------------


def test_a_token_holds_at_most_its_streams_the_next_is_429_and_a_closed_one_frees_its_slot(
    start_api: Callable[..., ApiProcess], store: RunStore, tokens_file: Path
) -> None:
    api = start_api(tokens=tokens_file, RUNBRAKE_API_MAX_STREAMS_PER_TOKEN="2")
    run_id = running_run(store)
    with httpx2.Client(base_url=api.url, timeout=httpx2.Timeout(30.0)) as http:
        opened = [http.stream("GET", path, headers=bearer("reader")) for path in
                  (f"/v1/runs/{run_id}/events", "/v1/events")]  # both endpoints count
        lines = []  # each stream's one line iterator: a dropped iterator closes its stream
        for stream in opened:
            response = stream.__enter__()
            assert response.status_code == 200
            lines.append(response.iter_lines())
            assert next(lines[-1]) == "retry: 1000"  # the stream is open on the server
        refused = [http.get(path, headers=bearer("reader")) for path in (f"/v1/runs/{run_id}/events", "/v1/events")]
        with Client(api.url, token=TOKENS["ops-alice"][0]) as alice:
            assert next(alice.events(run_id, read_timeout_s=30)).event == "status"  # another token's slots

        opened[0].__exit__(None, None, None)  # the client goes away: its slot is given back

        def admitted() -> bool:
            with http.stream("GET", f"/v1/runs/{run_id}/events", headers=bearer("reader")) as response:
                return response.status_code == 200
        poll_until(admitted, timeout=20, failure=lambda: f"the closed stream's slot was not given back:\n{api.log()}")
        opened[1].__exit__(None, None, None)

    for response in refused:
        assert response.status_code == 429, response.text
        assert response.json() == {"error": response.json()["error"], "limit": 2}
        assert "RUNBRAKE_API_MAX_STREAMS_PER_TOKEN" in response.json()["error"]
        assert int(response.headers["retry-after"]) > 0
    assert metric(api, "runbrake_api_event_streams_refused_total") >= 2


def test_the_stream_settings_are_checked_naming_the_variable() -> None:
    from runbrake.shared.errors import ConfigError

    assert Settings.from_env({}).api_send_timeout_s == 30.0
    assert Settings.from_env({}).api_max_streams_per_token == 16
    assert Settings.from_env({"RUNBRAKE_API_SEND_TIMEOUT_S": "2.5"}).api_send_timeout_s == 2.5
    assert Settings.from_env({"RUNBRAKE_API_MAX_STREAMS_PER_TOKEN": "3"}).api_max_streams_per_token == 3
    for name, value in (("RUNBRAKE_API_SEND_TIMEOUT_S", "soon"), ("RUNBRAKE_API_SEND_TIMEOUT_S", "0"),
                        ("RUNBRAKE_API_SEND_TIMEOUT_S", "nan"), ("RUNBRAKE_API_MAX_STREAMS_PER_TOKEN", "0"),
                        ("RUNBRAKE_API_MAX_STREAMS_PER_TOKEN", "2.5")):
        with pytest.raises(ConfigError, match=name):
            Settings.from_env({name: value})
