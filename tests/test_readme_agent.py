"""The README's agent run ("An agent run") is reproducible by copy and paste (issue 30, item 5): its shell
block, run as it stands in the repository's root with the files in examples/, against the tour's example
MCP server and worker, ends as its ``runbrake show`` says.

Only the ports differ: the README's 8765 (the example MCP server) and 8766 (llm-mock-api) become free ports,
because the machine that runs the tests is shared (tests/ports.py).
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import urllib.parse
from collections.abc import Callable
from pathlib import Path

import pytest

from runbrake.shared import RunStatus, RunStore
from runbrake.shared.spec import HttpServerSpec
from tests.mcp_helpers import Toolbox
from tests.polling import poll_until
from tests.ports import free_port
from tests.worker_helpers import WorkerProcess, wait_for_run

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent
SECTION = REPO.joinpath("README.md").read_text(encoding="utf-8").split("## An agent run", 1)[1].split("\n## ", 1)[0]


def _block(language: str) -> str:
    """The section's first fenced block in ``language``."""
    return SECTION.split(f"```{language}\n", 1)[1].split("```", 1)[0]


def test_the_readme_shows_the_example_spec_as_it_is_in_examples() -> None:
    assert json.loads(_block("json")) == json.loads((REPO / "examples" / "agent.json").read_text(encoding="utf-8"))


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.timeout(120)
def test_the_readme_agent_run_completes_with_the_answer_the_example_rules_give(
    toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], store: RunStore, tmp_path: Path,
) -> None:
    start_worker(RUNBRAKE_ALLOW_INLINE="true")  # the tour's terminal 2; toolbox_http is its terminal 1
    assert isinstance(toolbox_http.spec, HttpServerSpec)
    mcp_port, mock_port = urllib.parse.urlsplit(toolbox_http.spec.url).port, free_port()
    # The files as they are, but for the ports: a copy of examples/ (the README's paths are relative).
    examples = tmp_path / "examples"
    examples.mkdir()
    for name in ("agent.json", "llm-mock-rules.json5"):
        text = (REPO / "examples" / name).read_text(encoding="utf-8")
        (examples / name).write_text(text.replace(":8766/", f":{mock_port}/").replace(":8765/", f":{mcp_port}/"))
    lines = [line.split("  #", 1)[0].strip() for line in _block("sh").splitlines() if line.strip()]
    assert lines == ["llm-mock-api start -p 8766 -r examples/llm-mock-rules.json5 &",
                     "RUN=$(runbrake enqueue examples/agent.json)"]
    mock_command = shlex.split(lines[0].removesuffix("&").replace("8766", str(mock_port)))
    environment = {**os.environ, "RUNBRAKE_ALLOW_INLINE": "true",  # exported in the tour's terminal 3
                   "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}  # the venv's commands
    mock = subprocess.Popen(mock_command, cwd=tmp_path, env=environment, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        poll_until(lambda: _listening(mock_port), timeout=30, failure=lambda: "llm-mock-api did not listen",
                   give_up=lambda: mock.poll() is not None)
        enqueued = subprocess.run(["bash", "-c", f"set -e; {lines[1]}; echo $RUN"], cwd=tmp_path, env=environment,
                                  capture_output=True, text=True, timeout=60, check=False)
        assert enqueued.returncode == 0, enqueued.stderr
        run_id = enqueued.stdout.strip()
        record = wait_for_run(store, run_id, timeout=60)
        shown = subprocess.run(["bash", "-c", "runbrake show $RUN"], cwd=tmp_path, env={**environment, "RUN": run_id},
                               capture_output=True, text=True, timeout=60, check=False)
    finally:
        mock.terminate()
        try:
            mock.wait(10)
        except subprocess.TimeoutExpired:
            mock.kill()
            mock.wait()

    assert (record.status, record.output) == (RunStatus.COMPLETED, "Sunny and 21 °C in Berlin."), record.error
    assert [(s.kind.value, s.tool_name) for s in record.steps] == [("model", None), ("tool", "echo"), ("model", None)]
    assert record.steps[1].content == "sunny, 21 °C"
    assert record.usage.model_calls == 2
    assert record.labels == {"team": "acme", "user": "u-7"}
    assert shown.returncode == 0, shown.stderr
    # What the README shows of it is what it prints.
    for line in ("Status: completed   Reason: completed", "Tokens: 30 (20 in, 10 out, 2 model calls)",
                 "Labels: team=acme, user=u-7", "Sunny and 21 °C in Berlin."):
        assert line in shown.stdout
        assert line in _block("console")
