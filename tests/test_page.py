"""The runs page in a real browser: Debian's chromium, headless, driven by Playwright (docs/http-api.md,
"The runs page").

Everything behind the page is real: ``runbrake serve``, a worker, the example MCP server. The tests
enqueue through the API and watch the page change without a reload (a marker set on ``window``
survives). Screenshots go to tests/artifacts/.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from runbrake.shared import RunStatus, RunStore, StepKind
from tests.api_helpers import TOKENS, ApiProcess, bearer
from tests.catalog_helpers import add_to_catalog
from tests.llm_mock import LlmMock, reply
from tests.mcp_helpers import Toolbox, wait_for_event
from tests.polling import poll_until
from tests.worker_helpers import WorkerProcess, call, spec, wait_for_run

pytestmark = pytest.mark.integration

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
ARTIFACTS = Path(__file__).parent / "artifacts"
TIMEOUT_MS = 30_000
ELAPSED = re.compile(r"^\d+\.\d s$")


@pytest.fixture(name="browser")
def browser_fixture() -> Iterator[Any]:
    """Headless chromium (Debian's package; Playwright's own browser download is never used)."""
    if not CHROMIUM.exists():
        message = f"{CHROMIUM} is missing: install Debian's chromium package (make browser does)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def open_page(browser: Any, url: str, *, locale: str,
              routes: dict[str | re.Pattern[str], Callable[[Any], None]] | None = None,
              timezone_id: str | None = None) -> tuple[Any, list[str]]:
    """A page at ``url`` in ``locale`` (and ``timezone_id``, else the machine's); the list collects the page's
    script errors. ``routes``: Playwright route handlers by URL pattern, in place before the page loads."""
    page = browser.new_page(locale=locale, viewport={"width": 1200, "height": 720}, timezone_id=timezone_id)
    page.set_default_timeout(TIMEOUT_MS)
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    for pattern, handler in (routes or {}).items():
        page.route(pattern, handler)
    page.goto(url)
    page.evaluate("window.__notReloaded = true")
    return page, errors


def screenshot(page: Any, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    page.screenshot(path=str(path), full_page=True)
    return path


def test_the_page_shows_a_run_live_with_progress_and_cancels_it_in_german(
    browser: Any, start_api: Callable[..., ApiProcess], tokens_file: Path, worker: WorkerProcess,
    toolbox_http: Toolbox, store: RunStore,
) -> None:
    from playwright.sync_api import expect

    api = start_api(tokens=tokens_file)
    # The page's first listing goes out before there is a token. Its 401, held here until the token was given,
    # must neither open the token form again nor start the event stream of a list no longer shown.
    tokenless: list[Any] = []
    streams: list[str] = []

    def hold_tokenless(route: Any) -> None:
        if "authorization" in route.request.headers:
            route.continue_()
        else:
            tokenless.append(route)

    def count_stream(route: Any) -> None:
        streams.append(route.request.headers.get("authorization", ""))
        route.continue_()

    page, errors = open_page(browser, f"{api.url}/", locale="de-DE", routes={
        re.compile(r"/v1/runs\?limit=100$"): hold_tokenless, "**/v1/events": count_stream})
    # With tokens, the page asks for one once and keeps it in sessionStorage.
    expect(page.get_by_test_id("token-form")).to_be_visible()
    poll_until(lambda: page.evaluate("1") and tokenless, timeout=10, failure=lambda: "no tokenless listing")
    page.get_by_test_id("token-input").fill(TOKENS["ops-alice"][0])
    page.get_by_test_id("token-submit").click()
    expect(page.locator("h1")).to_have_text("Läufe")
    with page.expect_response(lambda response: response.status == 401 and "/v1/runs" in response.url):
        tokenless[0].continue_()

    slow = spec({"toolbox": toolbox_http.spec}, [{"tool_calls": [call("slow", seconds=30)]}, {"content": "x"}])
    created = httpx2.post(f"{api.url}/v1/runs", json=slow.raw, headers=bearer("ops-alice"))
    assert created.status_code == 201, created.text
    run_id = created.json()["run_id"]

    # The list learns of the run from the live status events; open it from there.
    row = page.locator(f"[data-run-id='{run_id}']")
    expect(row.get_by_test_id("run-status")).to_have_text("läuft")
    row.click()
    expect(page.get_by_test_id("run-status")).to_have_text("läuft")
    expect(page.get_by_test_id("in-flight")).to_contain_text("toolbox.slow")
    expect(page.get_by_test_id("progress")).to_contain_text("/30")
    expect(page.get_by_test_id("elapsed")).to_have_text(ELAPSED)
    wait_for_event(toolbox_http.events, "started", tool="slow")
    screenshot(page, "runs-page-running-de.png")

    page.get_by_test_id("cancel").click()
    page.get_by_test_id("reason").fill("Test: zu langsam")
    # The page is drawn again at each progress event; the open form stays the same nodes, the focus where it was.
    page.get_by_test_id("confirm").evaluate("button => { button.dataset.mark = 'drawn once'; }")
    expect(page.get_by_test_id("progress")).not_to_have_text(page.get_by_test_id("progress").inner_text())
    expect(page.locator("[data-testid=confirm][data-mark]")).to_have_count(1)
    assert page.evaluate("document.activeElement.dataset.testid") == "reason"
    page.get_by_test_id("confirm").click()

    expect(page.get_by_test_id("run-status")).to_have_text("abgebrochen")
    tool_row = page.locator("[data-testid=step-row][data-kind=tool]")
    expect(tool_row.get_by_test_id("outcome")).to_have_text("abgebrochen")
    expect(tool_row.get_by_test_id("step-note")).to_have_text("(gesendet, Nebenwirkungen unbekannt)")  # as show says
    expect(page.get_by_test_id("in-flight")).to_have_count(0)
    expect(page.get_by_test_id("run-cancel")).to_contain_text("Test: zu langsam (von ops-alice)")
    expect(page.locator("th").nth(4)).to_have_text("Ergebnis")
    assert page.evaluate("window.__notReloaded") is True
    expect(page.get_by_test_id("token-form")).to_be_hidden()
    assert streams == [bearer("ops-alice")["Authorization"]]  # the list's, once
    screenshot(page, "runs-page-cancelled-de.png")
    record = wait_for_run(store, run_id, lambda r: any(s.kind is StepKind.TOOL for s in r.steps))
    assert record.status is RunStatus.CANCELLED
    assert record.cancel is not None
    assert record.cancel.requested_by == "ops-alice"
    wait_for_event(toolbox_http.events, "cancelled", tool="slow")
    assert errors == []


def test_the_page_shows_what_a_waiting_run_asks_for_and_approves_it(
    browser: Any, api: ApiProcess, worker: WorkerProcess, toolbox_http: Toolbox, store: RunStore
) -> None:
    from playwright.sync_api import expect

    gated = spec({"toolbox": toolbox_http.spec}, [{"tool_calls": [call("get-sum", a=2, b=3)]}, {"content": "5"}],
                 approval_required=["toolbox.get-sum"])
    run_id = httpx2.post(f"{api.url}/v1/runs", json=gated.raw).json()["run_id"]
    wait_for_run(store, run_id, lambda r: r.status is RunStatus.WAITING_FOR_APPROVAL)
    page, errors = open_page(browser, f"{api.url}/#/runs/{run_id}", locale="en-US")

    expect(page.get_by_test_id("run-status")).to_have_text("waiting for approval")
    expect(page.get_by_test_id("pending-tool")).to_have_text("toolbox.get-sum")
    expect(page.get_by_test_id("pending-arguments")).to_have_text('{"a": 2, "b": 3}')
    screenshot(page, "runs-page-waiting-en.png")
    page.get_by_test_id("approve").click()
    page.get_by_test_id("reason").fill("sums are harmless")
    page.get_by_test_id("confirm").click()

    expect(page.get_by_test_id("run-status")).to_have_text("completed")
    approval = page.locator("[data-testid=step-row][data-kind=approval]")
    expect(approval).to_contain_text("approved: sums are harmless (by anonymous)")
    expect(page.locator("[data-testid=step-row][data-kind=tool]").get_by_test_id("outcome")).to_have_text("ok")
    expect(page.get_by_test_id("pending-call")).to_have_count(0)
    # The timeline draws the wait for approval, from the call that asked to the decision, on its own lane.
    wait = page.locator("[data-testid=lane][data-lane=wait] [data-testid=bar][data-kind=wait]")
    expect(wait).to_have_count(1)
    expect(wait).to_have_attribute("title", re.compile(r"waiting for approval"))
    assert page.evaluate("window.__notReloaded") is True
    screenshot(page, "runs-page-approved-en.png")
    # The switch turns the same page German without a reload.
    page.locator("[data-lang=de]").click()
    expect(page.get_by_test_id("run-status")).to_have_text("abgeschlossen")
    assert wait_for_run(store, run_id).status is RunStatus.COMPLETED
    assert errors == []


def test_the_page_steers_a_running_run_with_a_new_message_and_shows_the_steer_in_its_timeline(
    browser: Any, api: ApiProcess, worker: WorkerProcess, toolbox_http: Toolbox, store: RunStore
) -> None:
    from playwright.sync_api import expect

    slow = spec({"toolbox": toolbox_http.spec}, [{"tool_calls": [call("slow", seconds=60)]},
                                                 {"content": "on the new course"}])
    run_id = httpx2.post(f"{api.url}/v1/runs", json=slow.raw).json()["run_id"]
    wait_for_event(toolbox_http.events, "started", tool="slow")
    page, errors = open_page(browser, f"{api.url}/#/runs/{run_id}", locale="de-DE")
    expect(page.get_by_test_id("run-status")).to_have_text("läuft")

    page.get_by_test_id("steer").click()
    page.get_by_test_id("steer-input").fill("Nimm lieber den Zug")
    page.get_by_test_id("reason").fill("Flug ausgebucht")
    # The page draws the run again at each of its events (the call reports progress every second): what was
    # typed stays (it was lost, and the steer sent empty and refused, before the form kept a draft).
    reported = page.get_by_test_id("progress").inner_text()
    expect(page.get_by_test_id("progress")).not_to_have_text(reported, timeout=TIMEOUT_MS)
    expect(page.get_by_test_id("steer-input")).to_have_value("Nimm lieber den Zug")
    expect(page.get_by_test_id("reason")).to_have_value("Flug ausgebucht")
    page.get_by_test_id("confirm").click()

    # The worker's part (the cut-off, the steer, the next model call) on a loaded machine: the page's own bound.
    expect(page.get_by_test_id("run-status")).to_have_text("abgeschlossen", timeout=TIMEOUT_MS)
    steered = page.locator("[data-testid=step-row][data-kind=steer]")
    expect(steered).to_contain_text("Umlenkung")
    expect(steered).to_contain_text("Nimm lieber den Zug (von anonymous)")
    expect(page.locator("[data-testid=step-row][data-kind=tool]").get_by_test_id("outcome")).to_have_text(
        "abgebrochen")
    assert page.evaluate("window.__notReloaded") is True
    screenshot(page, "runs-page-steered-de.png")
    record = wait_for_run(store, run_id)
    assert (record.status, record.steps[-1].content) == (RunStatus.COMPLETED, "on the new course")
    steer_step = next(s for s in record.steps if s.kind is StepKind.STEER)
    assert (steer_step.detail["input"], steer_step.detail["reason"]) == ("Nimm lieber den Zug", "Flug ausgebucht")
    assert errors == []


def test_a_run_that_reached_its_step_limit_shows_the_reasons_label_never_its_key(
    browser: Any, api: ApiProcess, worker: WorkerProcess, toolbox_http: Toolbox, store: RunStore
) -> None:
    from playwright.sync_api import expect

    looping = spec({"toolbox": toolbox_http.spec}, [{"tool_calls": [call("get-sum", a=1, b=1)]}] * 3, max_steps=2)
    run_id = httpx2.post(f"{api.url}/v1/runs", json=looping.raw).json()["run_id"]
    assert wait_for_run(store, run_id).termination_reason.value == "max_steps"

    page, errors = open_page(browser, f"{api.url}/#/runs/{run_id}", locale="en-US")
    expect(page.get_by_test_id("run-reason")).to_have_text("step limit reached")
    page.locator("[data-lang=de]").click()
    expect(page.get_by_test_id("run-reason")).to_have_text("Schrittlimit erreicht")
    page.goto(f"{api.url}/#/")
    expect(page.get_by_test_id("run-row").first).to_contain_text("Schrittlimit erreicht")
    assert "reason." not in page.locator("main").inner_text()
    assert errors == []


def test_the_page_shows_what_a_run_is_asked_what_it_answers_and_what_it_cost_and_filters_by_label(
    browser: Any, api: ApiProcess, worker: WorkerProcess, llm_mock: LlmMock, toolbox_http: Toolbox, store: RunStore,
) -> None:
    from playwright.sync_api import expect

    llm_mock.server.when("sum").reply(reply('{"sum": 5}', usage=(200, 30)))
    add_to_catalog({"toolbox": toolbox_http.spec}, models={"mock": {
        "provider": "openai", "base_url": llm_mock.openai_url, "model": "gpt-mock"}})
    asked = {"input": "What is the sum of 2 and 3?", "model": "mock", "mcp_servers": ["toolbox"],
             "instructions": "Answer as JSON.", "labels": {"team": "acme"},
             "output_schema": {"type": "object", "required": ["sum"], "properties": {"sum": {"type": "integer"}}}}
    acme = httpx2.post(f"{api.url}/v1/runs", json=asked).json()["run_id"]
    other = httpx2.post(f"{api.url}/v1/runs", json={**asked, "labels": {"team": "globex"}}).json()["run_id"]
    for run_id in (acme, other):
        assert wait_for_run(store, run_id).status is RunStatus.COMPLETED

    page, errors = open_page(browser, f"{api.url}/", locale="en-US")
    row = page.locator(f"[data-run-id='{acme}']")
    expect(row.get_by_test_id("run-input")).to_have_text("What is the sum of 2 and 3?")
    expect(row.get_by_test_id("run-labels")).to_have_text("team=acme")
    expect(row.get_by_test_id("run-tokens")).to_have_text("230")
    expect(row.get_by_test_id("run-duration")).to_have_text(ELAPSED)

    # A new run draws the list again: a filter being typed keeps its text and focus, an unchanged row its node.
    page.get_by_test_id("filter-label").fill("team:ac")
    row.evaluate("tr => { tr.dataset.mark = 'drawn once'; }")
    third = httpx2.post(f"{api.url}/v1/runs", json={**asked, "labels": {"team": "initech"}}).json()["run_id"]
    expect(page.locator(f"[data-run-id='{third}']")).to_have_count(1)
    expect(page.locator(f"[data-run-id='{acme}'][data-mark]")).to_have_count(1)
    expect(page.get_by_test_id("filter-label")).to_have_value("team:ac")
    expect(page.get_by_test_id("filter-label")).to_be_focused()
    page.get_by_test_id("filter-label").fill("team:acme")
    page.get_by_test_id("filter-apply").click()
    expect(page.locator(f"[data-run-id='{other}']")).to_have_count(0)
    expect(page.get_by_test_id("run-row")).to_have_count(1)
    page.get_by_test_id("filter-status").select_option("failed")
    page.get_by_test_id("filter-apply").click()
    expect(page.get_by_test_id("run-row")).to_have_count(0)

    page.goto(f"{api.url}/#/runs/{acme}")
    expect(page.get_by_test_id("run-instructions")).to_have_text("Answer as JSON.")
    expect(page.get_by_test_id("run-input")).to_have_text("What is the sum of 2 and 3?")
    expect(page.get_by_test_id("run-output")).to_have_text('{\n  "sum": 5\n}')  # pretty-printed
    expect(page.get_by_test_id("run-usage")).to_have_text("200 in + 30 out = 230 tokens, 1 model call")
    page.locator("[data-lang=de]").click()
    expect(page.get_by_test_id("run-usage")).to_have_text("200 ein + 30 aus = 230 Tokens, 1 Modellaufruf")
    screenshot(page, "runs-page-answer-de.png")
    assert errors == []


def test_the_page_shows_the_answer_as_it_streams_in_and_keeps_what_a_cancel_cut_off(
    browser: Any, api: ApiProcess, worker: WorkerProcess, llm_mock: LlmMock, store: RunStore,
) -> None:
    from llm_mock_api.types.reply import ReplyOptions
    from playwright.sync_api import expect

    # Some 40 s of streaming, a word every 100 ms: the page sees it grow, then the cancel stops it.
    llm_mock.server.when("story").reply(reply("word " * 400), ReplyOptions(latency=100, chunk_size=5))
    add_to_catalog(models={"mock": {"provider": "openai", "base_url": llm_mock.openai_url, "model": "gpt-mock"}})
    run_id = httpx2.post(f"{api.url}/v1/runs", json={"input": "Tell a story.", "model": "mock"}).json()["run_id"]

    page, errors = open_page(browser, f"{api.url}/#/runs/{run_id}", locale="de-DE")
    forming = page.get_by_test_id("forming")
    expect(forming).to_contain_text("antwortet…")
    expect(page.get_by_test_id("forming-text")).to_contain_text("word word")
    screenshot(page, "runs-page-streaming-de.png")
    # Ten deltas a second: the cancel button stays the node it was (one drawn anew between a click's press and
    # release lost that click, CI of 2026-12-05), and the answer grows in its cell.
    page.get_by_test_id("cancel").evaluate("button => { button.dataset.mark = 'drawn once'; }")
    length = "document.querySelector('[data-testid=forming-text]').textContent.length"
    page.wait_for_function(f"n => {length} > n", arg=page.evaluate(length))
    expect(page.locator("[data-testid=cancel][data-mark]")).to_have_count(1)
    page.get_by_test_id("cancel").click()
    page.get_by_test_id("confirm").click()

    expect(page.get_by_test_id("run-status")).to_have_text("abgebrochen")
    expect(forming).to_have_count(0)
    model_row = page.locator("[data-testid=step-row][data-kind=model]")
    expect(model_row.get_by_test_id("outcome")).to_have_text("abgebrochen")
    expect(model_row).to_contain_text("word word")
    record = wait_for_run(store, run_id, lambda r: bool(r.steps))
    assert record.status is RunStatus.CANCELLED
    assert record.steps[0].content.startswith("word word")
    assert page.evaluate("window.__notReloaded") is True
    assert errors == []


def test_the_page_shows_a_budgets_use_tokens_cost_and_time_left_in_english_and_german(
    browser: Any, api: ApiProcess, worker: WorkerProcess, llm_mock: LlmMock, toolbox_http: Toolbox, store: RunStore,
) -> None:
    from playwright.sync_api import expect

    llm_mock.server.when("sum").reply(reply(tools=[("toolbox__get-sum", {"a": 2, "b": 3}, "call_1")],
                                            usage=(150, 60)))
    add_to_catalog({"toolbox": toolbox_http.spec}, models={"priced": {
        "provider": "openai", "base_url": llm_mock.openai_url, "model": "gpt-mock", "input_usd_per_mtok": 2.0,
        "output_usd_per_mtok": 8.0}})
    spent = httpx2.post(f"{api.url}/v1/runs", json={
        "input": "What is the sum of 2 and 3?", "model": "priced", "mcp_servers": ["toolbox"],
        "budget": {"max_total_tokens": 200, "max_cost_usd": 1}}).json()["run_id"]
    assert wait_for_run(store, spent).termination_reason.value == "budget_exceeded"
    slow = spec({"toolbox": toolbox_http.spec}, [{"tool_calls": [call("slow", seconds=120)]}, {"content": "x"}],
                budget={"deadline_s": 600})
    waiting = httpx2.post(f"{api.url}/v1/runs", json=slow.raw).json()["run_id"]
    wait_for_event(toolbox_http.events, "started", tool="slow")

    page, errors = open_page(browser, f"{api.url}/#/runs/{spent}", locale="en-US")
    expect(page.get_by_test_id("run-reason")).to_have_text("budget exceeded")
    expect(page.get_by_test_id("budget-tokens")).to_have_text("tokens 210/200")
    expect(page.get_by_test_id("budget-cost")).to_have_text("cost 0.000780/1 USD")  # 150 × 2 + 60 × 8 per million
    expect(page.get_by_test_id("run-usage")).to_have_text("150 in + 60 out = 210 tokens, 1 model call, 0.000780 USD")
    page.locator("[data-lang=de]").click()
    expect(page.get_by_test_id("run-reason")).to_have_text("Budget überschritten")
    expect(page.get_by_test_id("budget-cost")).to_have_text("Kosten 0.000780/1 USD")

    page.goto(f"{api.url}/#/runs/{waiting}")
    expect(page.get_by_test_id("run-status")).to_have_text("läuft")
    expect(page.get_by_test_id("budget-left")).to_have_text(re.compile(r"^\d+ s übrig$"))
    expect(page.get_by_test_id("budget-deadline")).to_contain_text("Frist")
    screenshot(page, "runs-page-budget-de.png")
    assert httpx2.post(f"{api.url}/v1/runs/{waiting}/cancel", json={"reason": "done looking"}).status_code == 202
    expect(page.get_by_test_id("budget-left")).to_have_count(0)
    assert errors == []


def test_a_finished_run_is_continued_from_its_page_which_links_its_parent_and_lists_its_thread(
    browser: Any, api: ApiProcess, worker: WorkerProcess, store: RunStore
) -> None:
    from playwright.sync_api import expect

    first = {"input": "hello", "model": {"provider": "scripted", "turns": [{"content": "hi"}]}}
    root = httpx2.post(f"{api.url}/v1/runs", json=first).json()["run_id"]
    assert wait_for_run(store, root).status is RunStatus.COMPLETED
    page, errors = open_page(browser, f"{api.url}/#/runs/{root}", locale="de-DE")
    expect(page.get_by_test_id("run-status")).to_have_text("abgeschlossen")
    expect(page.get_by_test_id("thread")).to_have_count(0)  # a run alone is no thread

    page.get_by_test_id("continue").click()
    page.get_by_test_id("continue-input").fill("Und weiter?")
    page.get_by_test_id("continue-send").click()

    expect(page.get_by_test_id("run-parent")).to_have_text(root)
    child = page.url.rsplit("/", 1)[-1]
    assert child != root
    expect(page.get_by_test_id("run-input")).to_have_text("Und weiter?")
    expect(page.get_by_test_id("run-status")).to_have_text("abgeschlossen")
    expect(page.get_by_test_id("thread-run")).to_have_count(2)
    expect(page.get_by_test_id("thread")).to_contain_text("Verlauf")
    screenshot(page, "runs-page-thread-de.png")
    page.get_by_test_id("run-parent").click()
    expect(page.locator("h1 code")).to_have_text(root)
    expect(page.get_by_test_id("thread-run")).to_have_count(2)
    assert store.get(child).parent_run_id == root
    assert page.evaluate("window.__notReloaded") is True
    assert errors == []


def test_the_first_screen_without_a_token_says_only_that_a_token_is_needed(
    browser: Any, start_api: Callable[..., ApiProcess], tokens_file: Path,
) -> None:
    from playwright.sync_api import expect

    api = start_api(tokens=tokens_file)
    page, errors = open_page(browser, f"{api.url}/", locale="en-US")
    expect(page.get_by_test_id("token-form")).to_be_visible()
    expect(page.get_by_test_id("error")).to_contain_text("a valid bearer token is required")
    # Nothing was read, so nothing says there are no runs (the old page said both at once).
    expect(page.get_by_test_id("empty")).to_have_count(0)
    assert "No runs yet." not in page.locator("main").inner_text()
    # Every word of the page's own table in both languages (docs/labels.md says so in its opening).
    assert page.evaluate("Object.keys(UI.en).sort()") == page.evaluate("Object.keys(UI.de).sort()")
    assert errors == []


ISO_LOCAL = re.compile(r"^\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2} UTC\+01:00$")
"""A time as the page writes it in Berlin in December: year-month-day, the zone's offset stated."""


def test_each_step_expands_to_what_it_saw_and_did_and_the_timeline_draws_the_steps_to_scale(
    browser: Any, api: ApiProcess, worker: WorkerProcess, llm_mock: LlmMock, toolbox_http: Toolbox, store: RunStore,
) -> None:
    from playwright.sync_api import expect

    # One turn asks for two calls at once (one takes 2.5 s), the next answers: two tool lanes side by side.
    llm_mock.server.when("sum").reply(reply(tools=[("toolbox__slow", {"seconds": 2.5}, "call_1"),
                                                   ("toolbox__get-sum", {"a": 2, "b": 3}, "call_2")],
                                            usage=(120, 20))).times(1)
    llm_mock.server.when_tool_result("call_2").reply(reply("It is 5.", usage=(160, 5)))
    add_to_catalog({"toolbox": toolbox_http.spec}, models={"mock": {
        "provider": "openai", "base_url": llm_mock.openai_url, "model": "gpt-mock"}})
    run_id = httpx2.post(f"{api.url}/v1/runs", json={
        "input": "What is the sum of 2 and 3?", "model": "mock", "mcp_servers": ["toolbox"],
        "instructions": "Use the tools.", "model_settings": {"temperature": 0.2}}).json()["run_id"]
    record = wait_for_run(store, run_id)
    assert record.status is RunStatus.COMPLETED, record.error
    steps = {(s.kind, s.tool_name): s for s in record.steps}
    first_model = next(s for s in record.steps if s.kind is StepKind.MODEL)
    second_model = [s for s in record.steps if s.kind is StepKind.MODEL][1]
    slow, summed = steps[(StepKind.TOOL, "slow")], steps[(StepKind.TOOL, "get-sum")]

    page, errors = open_page(browser, f"{api.url}/#/runs/{run_id}", locale="en-US", timezone_id="Europe/Berlin")
    expect(page.get_by_test_id("run-status")).to_have_text("completed")
    used = record.usage
    expect(page.get_by_test_id("run-usage")).to_have_text(
        f"{used.input_tokens} in + {used.output_tokens} out = {used.total_tokens} tokens, 2 model calls")
    # Item 7: the three times labelled alike, written year-month-day with the reader's zone, and the page says so.
    expect(page.locator(".facts dt").nth(2)).to_have_text("Created")
    expect(page.locator(".facts dt").nth(3)).to_have_text("Started")
    expect(page.locator(".facts dt").nth(4)).to_have_text("Finished")
    for testid in ("run-created", "run-started", "run-finished"):
        expect(page.get_by_test_id(testid)).to_have_text(ISO_LOCAL)
    expect(page.get_by_test_id("when-note")).to_contain_text("UTC+01:00")

    # The second model call: what it was sent, rebuilt from the record, its usage and attempts.
    model_row = page.locator(f"[data-testid=step-row][data-seq='{second_model.sequence}']")
    model_row.get_by_test_id("expand").click()
    detail = page.locator(f"[data-testid=step-detail][data-seq='{second_model.sequence}']")
    expect(detail.get_by_test_id("received-message")).to_have_count(5)
    roles = detail.get_by_test_id("received-message").evaluate_all("items => items.map(i => i.dataset.role)")
    assert roles == ["system", "user", "assistant", "tool", "tool"]
    expect(detail.get_by_test_id("received-message").first).to_contain_text("Use the tools.")
    expect(detail.get_by_test_id("received-message").nth(2)).to_contain_text("toolbox.get-sum")
    expect(detail.get_by_test_id("received-message").nth(4)).to_contain_text("5")
    expect(detail.get_by_test_id("received-settings")).to_have_text("Model settings: temperature = 0.2")
    usage = second_model.detail["usage"]
    expect(detail.get_by_test_id("step-usage")).to_have_text(
        f"{usage['input_tokens']} in + {usage['output_tokens']} out = {usage['total_tokens']} tokens")
    expect(detail.get_by_test_id("step-attempts")).to_have_text("1")
    expect(detail.get_by_test_id("step-answer")).to_have_text("It is 5.")
    # The tool call: its arguments (stored once, on the model step), its whole result, its duration.
    page.locator(f"[data-testid=step-row][data-seq='{summed.sequence}']").get_by_test_id("expand").click()
    tool = page.locator(f"[data-testid=step-detail][data-seq='{summed.sequence}']")
    expect(tool.get_by_test_id("step-arguments")).to_have_text('{\n  "a": 2,\n  "b": 3\n}')
    expect(tool.get_by_test_id("step-result")).to_have_text("5")
    expect(tool.get_by_test_id("step-duration")).to_have_text(  # milliseconds below a second
        f"{summed.duration_ms} ms" if summed.duration_ms < 1000 else ELAPSED)
    # The slow call's step keeps the progress it reported (at 1 and 2 s), shown though the page never saw it live.
    page.locator(f"[data-testid=step-row][data-seq='{slow.sequence}']").get_by_test_id("expand").click()
    reported = page.locator(f"[data-testid=step-detail][data-seq='{slow.sequence}']").get_by_test_id("step-progress")
    expect(reported.locator("li")).to_have_count(len(slow.detail["progress_history"]))
    expect(reported.locator("li").last).to_contain_text("2/2.5")
    # The first model call was sent the opening only; its row keeps its node across the redraws.
    page.locator(f"[data-testid=step-row][data-seq='{first_model.sequence}']").get_by_test_id("expand").click()
    first = page.locator(f"[data-testid=step-detail][data-seq='{first_model.sequence}']")
    expect(first.get_by_test_id("received-message")).to_have_count(2)
    expect(first.get_by_test_id("step-asked")).to_contain_text("toolbox.slow")

    # The timeline: one bar a step, the two calls on two lanes at once, each placed and sized by its times.
    chart = page.get_by_test_id("chart")
    expect(chart.get_by_test_id("bar")).to_have_count(len(record.steps))
    expect(chart.get_by_test_id("lane")).to_have_count(3)  # the model's, and one for each call at once
    bars = {int(b["seq"]): (float(b["left"]), float(b["width"])) for b in chart.get_by_test_id("bar").evaluate_all(
        "bars => bars.map(b => ({seq: b.dataset.seq, left: b.dataset.left, width: b.dataset.width}))")}
    start = min(s.recorded_at - s.duration_ms / 1000 for s in record.steps)
    span = max(s.recorded_at for s in record.steps) - start
    for step in record.steps:
        left, width = bars[step.sequence]
        assert abs(left - (step.recorded_at - step.duration_ms / 1000 - start) / span * 100) < 0.5, step
        assert abs(width - step.duration_ms / 1000 / span * 100) < 0.5, step
    assert bars[slow.sequence][1] > 2 * bars[summed.sequence][1]  # 2.5 s against a sum
    drawn = chart.get_by_test_id("bar").evaluate_all("bars => bars.map(b => b.getBoundingClientRect().width)")
    assert max(drawn) > 100  # drawn to the sizes, not left at the stylesheet's minimum
    screenshot(page, "runs-page-debug-en.png")
    page.locator("[data-lang=de]").click()
    expect(detail.get_by_test_id("received-settings")).to_have_text("Modelleinstellungen: temperature = 0.2")
    expect(page.locator(".facts dt").nth(3)).to_have_text("Gestartet")
    expect(page.get_by_test_id("run-usage")).to_contain_text("2 Modellaufrufe")
    expect(chart).to_contain_text("Zeitleiste")
    assert errors == []


def test_the_list_is_searched_by_text_and_by_creation_time_on_the_server(
    browser: Any, api: ApiProcess, store: RunStore,
) -> None:
    from playwright.sync_api import expect

    weather = httpx2.post(f"{api.url}/v1/runs", json={"input": "What is the weather in Oslo?",
                                                      "model": {"provider": "scripted", "turns": [{"content": "x"}]}})
    invoice = httpx2.post(f"{api.url}/v1/runs", json={"input": "Summarise invoice 4711",
                                                      "model": {"provider": "scripted", "turns": [{"content": "x"}]}})
    weather_id, invoice_id = weather.json()["run_id"], invoice.json()["run_id"]
    for _ in range(100):  # newer than both: the page's first listing (100 runs) ends before them
        store.create({"input": "filler", "model": {"provider": "scripted", "turns": [{"content": "x"}]}})
    searched: list[str] = []
    page, errors = open_page(browser, f"{api.url}/", locale="en-US", timezone_id="Europe/Berlin", routes={
        re.compile(r"/v1/runs\?"): lambda route: (searched.append(route.request.url), route.continue_())})
    expect(page.get_by_test_id("run-row")).to_have_count(100)
    expect(page.locator(f"[data-run-id='{weather_id}']")).to_have_count(0)
    page.get_by_test_id("more").click()  # what lies past the first listing is one click away, never left out
    expect(page.get_by_test_id("run-row")).to_have_count(102)
    expect(page.get_by_test_id("more")).to_have_count(0)
    expect(page.locator(f"[data-run-id='{weather_id}']").get_by_test_id("run-created")).to_have_text(ISO_LOCAL)

    page.get_by_test_id("filter-q").fill("INVOICE")
    page.get_by_test_id("filter-apply").click()
    expect(page.get_by_test_id("run-row")).to_have_count(1)
    expect(page.locator(f"[data-run-id='{invoice_id}']")).to_have_count(1)
    assert "q=INVOICE" in searched[-1]  # the server searched, not the page
    screenshot(page, "runs-page-search-en.png")

    # A window that ends before the runs were created holds none of them; one around them holds both.
    created = store.get(weather_id).created_at
    page.get_by_test_id("filter-q").fill("")
    page.get_by_test_id("filter-until").fill(page.evaluate(
        "t => { const d = new Date((t - 120) * 1000); d.setMinutes(d.getMinutes() - d.getTimezoneOffset());"
        " return d.toISOString().slice(0, 16); }", created))
    page.get_by_test_id("filter-apply").click()
    expect(page.get_by_test_id("run-row")).to_have_count(0)
    expect(page.get_by_test_id("empty")).to_have_text("No run matches this filter.")
    assert "until=" in searched[-1]
    page.get_by_test_id("filter-until").fill("")
    page.get_by_test_id("filter-since").fill(page.evaluate(
        "t => { const d = new Date((t - 120) * 1000); d.setMinutes(d.getMinutes() - d.getTimezoneOffset());"
        " return d.toISOString().slice(0, 16); }", created))
    page.get_by_test_id("filter-apply").click()
    expect(page.get_by_test_id("run-row")).to_have_count(100)
    expect(page.get_by_test_id("filter-since")).not_to_have_value("")  # kept in the address, shown again
    page.locator("[data-lang=de]").click()
    expect(page.get_by_test_id("filter-q")).to_have_attribute("placeholder", "Text suchen")
    assert errors == []


def test_the_page_draws_an_agent_tree_with_each_runs_status_live_in_german(
    browser: Any, api: ApiProcess, worker: WorkerProcess, store: RunStore, llm_mock: LlmMock, toolbox_http: Toolbox,
) -> None:
    """The tree of an agent call (docs/usage.md, "Agent trees"): the first run's page lists the runs below it,
    each with its status, and shows the cancel of the tree reaching each without a reload."""
    from playwright.sync_api import expect

    add_to_catalog({"toolbox": toolbox_http.spec}, models={"mock": {
        "provider": "openai", "base_url": llm_mock.openai_url, "model": "gpt-mock"}},
        agents={"researcher": {"description": "Finds things out", "model": "mock", "mcp_servers": ["toolbox"]}})
    llm_mock.server.when("research slowly").reply(reply(tools=[("toolbox__slow", {"seconds": 120}, "call_r")]))
    caller = {"input": "delegate", "agents": ["researcher"], "model": {"provider": "scripted", "turns": [
        {"tool_calls": [call("researcher", server="agent", input="research slowly"),
                        call("researcher", server="agent", input="research slowly too")]}, {"content": "never"}]}}
    root = httpx2.post(f"{api.url}/v1/runs", json=caller).json()["run_id"]
    wait_for_event(toolbox_http.events, "started", tool="slow", count=2)
    children = poll_until(lambda: len(found := store.get(root).children) == 2 and sorted(found.values()),
                          timeout=30, failure=lambda: f"run {root} has not two children")

    page, errors = open_page(browser, f"{api.url}/#/runs/{root}", locale="de-DE")
    expect(page.get_by_test_id("tree")).to_contain_text("Baum")
    nodes = page.get_by_test_id("tree-run")
    expect(nodes).to_have_count(3)
    for child in children:
        node = page.locator(f"[data-testid=tree-run][data-run-id='{child}']")
        expect(node).to_have_attribute("data-depth", "1")
        expect(node.get_by_test_id("tree-status")).to_have_text("läuft")
    screenshot(page, "runs-page-tree-de.png")

    assert httpx2.post(f"{api.url}/v1/runs/{root}/cancel", json={"reason": "genug"}).status_code == 202

    for run_id in (root, *children):
        expect(page.locator(f"[data-testid=tree-run][data-run-id='{run_id}'] >> nth=0 >> "
                            "[data-testid=tree-status] >> nth=0")).to_have_text("abgebrochen")
    page.locator(f"[data-testid=tree-run][data-run-id='{children[0]}'] a").click()
    expect(page.locator("h1 code")).to_have_text(children[0])
    expect(page.get_by_test_id("tree-run")).to_have_count(3)  # a child's page draws the same tree
    assert page.evaluate("window.__notReloaded") is True
    assert errors == []
