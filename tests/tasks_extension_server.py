"""An MCP server of the 2026-07-28 tasks extension (SEP-2663), on PyPI's ``fastmcp-tasks`` (FastMCP's server side of
the extension, which nobody here wrote), for tests/test_mcp_tasks_extension.py::

    .venv/fastmcp-tasks/bin/python tests/tasks_extension_server.py PORT

It runs in a venv of its own (bench/_harness.py ``python_package``): the package's pins exclude the project's.
Tools: ``research`` always runs as a task (it sleeps ``seconds``, then reports), ``echo`` never does, ``confirm``
runs as a task that asks the client for input (an elicitation: the task goes ``input_required``).
"""

from __future__ import annotations

import sys
from datetime import timedelta

import anyio
import mcp_types
from fastmcp import Context, FastMCP
from fastmcp.utilities.tasks import TaskConfig
from fastmcp_tasks import TasksExtension

server = FastMCP("tasks-extension")
server.add_extension(TasksExtension(url="memory://"))
POLL = timedelta(milliseconds=200)


@server.tool(task=TaskConfig(mode="required", poll_interval=POLL))
async def research(topic: str, seconds: float = 3.0) -> str:
    """Research the topic for the given seconds, then report."""
    await anyio.sleep(seconds)
    return f"Research Report: {topic}"


@server.tool(task=TaskConfig(mode="forbidden"))
async def echo(text: str) -> str:
    """Return the text unchanged, at once."""
    return text


@server.tool(task=TaskConfig(mode="required", poll_interval=POLL))
async def confirm(question: str, ctx: Context) -> str | mcp_types.InputRequiredResult:
    """Ask the client to confirm (an elicitation the task carries: ``input_required``), then say what it answered."""
    if ctx.input_responses:
        return f"answered {ctx.input_responses}"
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    ask = mcp_types.ElicitRequest(params=mcp_types.ElicitRequestFormParams(message=question, requested_schema=schema))
    return mcp_types.InputRequiredResult(input_requests={"confirm": ask})


if __name__ == "__main__":
    server.run("http", host="127.0.0.1", port=int(sys.argv[1]), show_banner=False)
