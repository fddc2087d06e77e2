"""One tool call on an MCP server, as a :class:`~shared.tool_result.ToolResult` (docs/store.md, "Tool outcomes").

Never raises for what the call came to: a tool's own error, a dead server, a timeout
and a cancel all become results. Which outcome a transport error maps to is read from
its class alone (``ToolCallCancelled``). Every result is scrubbed of secrets (before the model sees it, not
only before it is stored: docs/security.md, "Where secrets live"), then bounded, before it leaves.
"""

from __future__ import annotations

import dataclasses
import json

import anyio
from mcp.shared.dispatcher import ProgressFnT
from mcp_types import CallToolResult, ContentBlock, EmbeddedResource, ResourceLink, TextContent, TextResourceContents

from runbrake.shared import redaction
from runbrake.shared.errors import ToolArgumentsRefused, ToolCallCancelled, ToolTransportError
from runbrake.shared.tool_result import Failure, ToolResult
from runbrake.worker.conversation import ToolCall
from runbrake.worker.mcp_transport import McpConnection, TaskStarted

__all__ = ["execute", "finished", "from_answer", "not_connected"]


async def execute(
    connection: McpConnection,
    call: ToolCall,
    *,
    timeout_s: float,
    interrupt: anyio.CancelScope,
    max_chars: int,
    progress: ProgressFnT | None = None,
) -> ToolResult:
    """Run ``call`` on ``connection`` and say what it came to: ok, failed or cancelled.

    Args:
        connection: the open connection to ``call.server``.
        call: the tool call the model asked for.
        timeout_s: how long the call may take, in seconds.
        interrupt: an unentered scope; cancelling it cuts the call off (outcome cancelled).
        max_chars: the bound on each content channel of the result.
        progress: called with each MCP progress notification of the call.

    Raises:
        ValueError: ``connection`` is not to ``call.server``.
    """
    if connection.server != call.server:
        raise ValueError(f"call {call.id} is for server {call.server!r}, not {connection.server!r}")
    try:
        answer = await connection.call(call.tool, call.arguments, timeout_s=timeout_s, interrupt=interrupt,
                                       progress=progress)
    except ToolCallCancelled as exc:
        result = ToolResult.cancelled(str(exc), sent=exc.sent)
    except ToolArgumentsRefused as exc:
        result = ToolResult.error(str(exc), failure=Failure.ARGUMENTS)
    except ToolTransportError as exc:
        result = ToolResult.error(str(exc))
    else:
        result = from_answer(answer) if isinstance(answer, CallToolResult) else _unwaited(call, answer)
    return finished(result, call, max_chars)


def _unwaited(call: ToolCall, started: TaskStarted) -> ToolResult:
    """A task the server made of a call that was not made to be waited on as one (worker/toolbox.py decides which
    are): failed, saying so; the task is not followed."""
    return ToolResult.error(f"MCP server {call.server!r} answered {call.tool} with an MCP task "
                            f"({started.task.get('taskId')}) where this run waits for no task")


def finished(result: ToolResult, call: ToolCall, max_chars: int) -> ToolResult:
    """``result`` as it leaves: scrubbed of secrets, then each channel bounded to ``max_chars``."""
    return _scrubbed(result, call).with_bounded_channels(max_chars)


def _scrubbed(result: ToolResult, call: ToolCall) -> ToolResult:
    """``result`` without secrets, before the model sees it and before it is cut (a cut secret would no longer be
    recognised). A value the submitter wrote is spared only where the call's arguments carried it: an echo, not
    a server's own leak (shared/redaction.py, :func:`~runbrake.shared.redaction.sparing_only`)."""
    with redaction.sparing_only(json.dumps(call.arguments, ensure_ascii=False)):
        content = redaction.scrub(result.content)
        # The structured channel is JSON text: scrubbed value by value, so that no JSON escape hides a secret.
        structured = None if result.structured is None else json.dumps(
            redaction.scrub_value(json.loads(result.structured)))
    return dataclasses.replace(result, content=content, structured=structured)


def not_connected(call: ToolCall, *, max_chars: int, reason: str | None = None) -> ToolResult:
    """The failed result of a call to a server that is not connected (unknown, or it did not start);
    ``reason`` says why, when it is known."""
    message = f"MCP server {call.server!r} is not connected; {call.tool} was not called"
    if reason:
        message = f"{message}: {reason}"
    return ToolResult.error(message).with_bounded_channels(max_chars)


def from_answer(answer: CallToolResult) -> ToolResult:
    """What a server's tool result came to: ok, or failed when it says ``isError``."""
    text = "\n".join(_describe(block) for block in answer.content)
    if answer.is_error:
        return ToolResult.error(text or "the tool reported an error without a message")
    structured = None if answer.structured_content is None else json.dumps(answer.structured_content)
    return ToolResult.ok(text, structured=structured)


def _describe(block: ContentBlock) -> str:
    """A text block's text; any other block in brackets, so the model knows something was there."""
    if isinstance(block, TextContent):
        return block.text
    if isinstance(block, EmbeddedResource):
        if isinstance(block.resource, TextResourceContents):
            return block.resource.text
        return f"[resource {block.resource.uri}]"
    if isinstance(block, ResourceLink):
        return f"[resource link {block.uri}]"
    return f"[{block.mime_type}]"
