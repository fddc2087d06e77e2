"""The ``anthropic`` model provider: Anthropic's Messages API through the official ``anthropic`` SDK
(docs/usage.md, "Anthropic").

The conversation is runbrake's (chat-completions shaped, worker/conversation.py); this module maps it to
the Messages API and back: the leading ``system`` messages become the request's ``system`` prompt, tools are
shown as ``<server>__<tool>``, an assistant turn's calls are ``tool_use`` blocks and the tool messages that
answer them ``tool_result`` blocks of the next user message. Like the OpenAI provider, it shares one client
among a segment's calls (``async with provider``; :class:`~worker.models.Connection`), is cancellable by an
enclosing anyio cancel scope (an interrupted call closes its client, shielded and bounded), makes one
request per call (retries are the :class:`~worker.models.RetryingProvider`'s) and reports every failure as
a :class:`~shared.errors.ProviderError`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Final

import anyio
from anthropic import AnthropicError, AsyncAnthropic, DefaultAsyncHttpxClient, omit
from anthropic.types import Message as AnthropicMessage
from anthropic.types import (
    MessageParam,
    TextBlockParam,
    ToolChoiceParam,
    ToolParam,
    ToolResultBlockParam,
    ToolUseBlockParam,
)
from anthropic.types.output_config_param import OutputConfigParam

from runbrake.shared.errors import ProviderError
from runbrake.shared.spec import AnthropicModel
from runbrake.worker.conversation import (
    NO_SETTINGS,
    TOOL_NAME_SEPARATOR,
    Message,
    ModelSettings,
    ModelTurn,
    ToolCall,
    ToolInfo,
    Usage,
)
from runbrake.worker.deltas import StreamedText
from runbrake.worker.model_stream import MessageAssembly, read_answer
from runbrake.worker.models import SDK_FAULTS, EndpointProvider, api_key, http_client, provider_error, timed_out

__all__ = ["DEFAULT_MAX_TOKENS", "AnthropicProvider"]

DEFAULT_MAX_TOKENS: Final = 4096
"""``max_tokens`` when the run's settings give no ``max_output_tokens``: the Messages API requires one."""
_TOOL_CHOICE: Final = {"auto": "auto", "none": "none", "required": "any"}
"""``tool_choice`` as the Messages API names it."""
_NAMES_SHOWN: Final = 20
"""Tool names a problem message lists at most (a run may have many)."""

_Block = TextBlockParam | ToolUseBlockParam | ToolResultBlockParam


class AnthropicProvider(EndpointProvider[AnthropicModel, AsyncAnthropic]):
    """Asks the Messages API for the next turn; tools are shown as ``<server>__<tool>``."""

    async def complete(self, messages: Sequence[Message], tools: Sequence[ToolInfo], *, round_index: int,
                       settings: ModelSettings = NO_SETTINGS, text: StreamedText | None = None) -> ModelTurn:
        """Send the conversation, tools and settings; map the answer back to runbrake's values. The answer is
        streamed (its text handed to ``text`` as it arrives, the events assembled into the message a whole
        answer gives) unless the catalog model says ``stream = false`` (docs/cancellation.md, "Streaming").

        ``temperature``, ``top_p`` and ``seed`` are not sent: the Messages API (as the SDK states it) has no
        such parameters. A ``tool_use`` naming a tool the run does not have, or input that is not an object,
        comes back as a call with a ``problem`` (the loop hands it back to the model), not as an error.

        Raises:
            ProviderError: when the API key variable is unset, on any ``anthropic`` error (status, connection,
                timeout), when the answer is not a message, or when a streamed answer broke off
                (:class:`~worker.model_stream.MidStream`, not retried).
        """
        system, conversation = _conversation(messages)
        where = f"{self._spec.base_url} ({self._spec.model})"
        timeout_s = settings.timeout_s or self._timeout_s
        request: dict[str, Any] = {
            "model": self._spec.model,
            "max_tokens": settings.max_output_tokens or DEFAULT_MAX_TOKENS,
            "messages": conversation,
            "system": system if system is not None else omit,
            "tools": [_tool_param(t) for t in tools] if tools else omit,
            "tool_choice": _tool_choice(settings) if tools else omit,
            "stop_sequences": list(settings.stop) if settings.stop else omit,
            "output_config": _output_config(settings),
            "timeout": timeout_s,
        }
        assembly = MessageAssembly(text)
        with anyio.move_on_after(timeout_s):
            async with self.connection.client() as client:
                try:
                    if self._spec.stream is False:
                        message: object = await client.messages.create(**request)
                    else:
                        async with client.messages.with_streaming_response.create(**request, stream=True) as response:
                            body = await read_answer(response, assembly, where=where)
                        message = AnthropicMessage.construct(**body)
                except (AnthropicError, *SDK_FAULTS) as exc:
                    # Only the SDK's own errors and what it lets through: anyio's cancellation is a BaseException
                    # and passes through.
                    raise provider_error(where, exc) from exc
            return _turn(message, tools)
        raise timed_out(where, timeout_s, began=assembly.began)

    def _client(self) -> AsyncAnthropic:
        return AsyncAnthropic(
            base_url=self._spec.base_url,
            # Always given, so the SDK reads no credential of its own (ANTHROPIC_API_KEY, a profile on disk).
            api_key=api_key(self._spec.api_key_env),
            # Retries are runbrake's decision (docs/leases.md, "Retries"), not the SDK's.
            max_retries=0,
            http_client=http_client(DefaultAsyncHttpxClient),
        )


def _conversation(messages: Sequence[Message]) -> tuple[str | None, list[MessageParam]]:
    """The system prompt (the leading ``system`` messages) and the conversation as Messages API turns.

    Consecutive messages of one role become one turn (the tool results answering a turn's calls go back
    together, in one user message).

    Raises:
        ProviderError: for a ``system`` message after the conversation began, or a tool message without the
            id of the call it answers.
    """
    leading = 0
    while leading < len(messages) and messages[leading].role == "system":
        leading += 1
    system = "\n\n".join(m.content or "" for m in messages[:leading]) if leading else None
    turns: list[tuple[str, list[_Block]]] = []
    for message in messages[leading:]:
        role, blocks = _blocks(message)
        if turns and turns[-1][0] == role:
            turns[-1][1].extend(blocks)
        else:
            turns.append((role, blocks))
    conversation: list[MessageParam] = [
        {"role": "user", "content": blocks} if role == "user" else {"role": "assistant", "content": blocks}
        for role, blocks in turns
    ]
    return system, conversation


def _blocks(message: Message) -> tuple[str, list[_Block]]:
    content = message.content or ""
    match message.role:
        case "system":
            raise ProviderError("the Messages API takes system instructions only before the conversation")
        case "user":
            return "user", [{"type": "text", "text": content}]
        case "tool":
            if message.tool_call_id is None:
                raise ProviderError("a tool message needs the tool_call_id it answers")
            return "user", [{"type": "tool_result", "tool_use_id": message.tool_call_id, "content": content}]
        case "assistant":
            # The API refuses an empty text block: a turn of calls only carries none.
            blocks: list[_Block] = [{"type": "text", "text": content}] if content or not message.tool_calls else []
            blocks += [{"type": "tool_use", "id": call.id, "name": call.model_name, "input": dict(call.arguments)}
                       for call in message.tool_calls]
            return "assistant", blocks


def _tool_param(tool: ToolInfo) -> ToolParam:
    return {"name": tool.model_name, "description": tool.description, "input_schema": dict(tool.input_schema)}


def _tool_choice(settings: ModelSettings) -> ToolChoiceParam | Any:
    if settings.tool_choice is None and settings.parallel_tool_calls is None:
        return omit  # the API's own default
    kind = _TOOL_CHOICE[settings.tool_choice or "auto"]
    if kind == "none":
        return {"type": "none"}
    # parallel_tool_calls=False: one tool_use per turn at most.
    disable = settings.parallel_tool_calls is False
    if kind == "any":
        return {"type": "any", "disable_parallel_tool_use": disable}
    return {"type": "auto", "disable_parallel_tool_use": disable}


def _output_config(settings: ModelSettings) -> OutputConfigParam | Any:
    if settings.output_schema is None:
        return omit
    config: OutputConfigParam = {"format": {"type": "json_schema", "schema": dict(settings.output_schema)}}
    return config


def _turn(message: object, tools: Sequence[ToolInfo]) -> ModelTurn:
    # The SDK builds its response models without validation (so compatible servers work): whatever the
    # endpoint sent arrives here, so the few fields used are checked.
    content = getattr(message, "content", None)
    if not isinstance(content, list):
        raise ProviderError(f"the model answered without content blocks: {message!r:.200}")
    texts: list[str] = []
    calls: list[ToolCall] = []
    known = {t.model_name for t in tools}
    for block in content:
        kind = getattr(block, "type", None)
        if kind == "text":
            text = getattr(block, "text", None)
            if not isinstance(text, str):
                raise ProviderError(f"the model answered with a malformed text block: {block!r:.200}")
            texts.append(text)
        elif kind == "tool_use":
            calls.append(_tool_call(block, known))
        # Any other block (thinking, a server tool's) is the provider's own business: not part of the turn.
    text = "".join(texts)
    # A turn of calls says nothing more with an empty text block than without one.
    return ModelTurn(content=text if text or not calls else None, tool_calls=tuple(calls),
                     usage=_usage(getattr(message, "usage", None)))


def _tool_call(block: object, known: set[str]) -> ToolCall:
    call_id, name, arguments = getattr(block, "id", None), getattr(block, "name", None), getattr(block, "input", None)
    if not isinstance(call_id, str) or not call_id or not isinstance(name, str):
        raise ProviderError(f"the model answered with a malformed tool_use block: {block!r:.200}")
    server, _, tool = name.partition(TOOL_NAME_SEPARATOR)
    if name not in known:
        return ToolCall(id=call_id, server=server, tool=tool or name, arguments={},
                        problem=f"there is no tool named {name!r}; the tools are: {_listed(sorted(known))}")
    if not isinstance(arguments, dict):
        return ToolCall(id=call_id, server=server, tool=tool, arguments={},
                        problem=f"the input of {name!r} must be a JSON object, not {type(arguments).__name__}")
    return ToolCall(id=call_id, server=server, tool=tool, arguments=arguments)


def _listed(names: Iterable[str]) -> str:
    listed = list(names)
    if not listed:
        return "none"
    shown = ", ".join(listed[:_NAMES_SHOWN])
    return shown if len(listed) <= _NAMES_SHOWN else f"{shown} and {len(listed) - _NAMES_SHOWN} more"


def _usage(usage: object) -> Usage | None:
    # Unvalidated model (see _turn). Cached prompt tokens are counted apart from input_tokens: all are input.
    counts = [getattr(usage, name, None) for name in
              ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens", "output_tokens")]
    if not all(c is None or (isinstance(c, int) and not isinstance(c, bool) and c >= 0) for c in counts):
        return None
    fresh, created, read, output = counts
    if fresh is None or output is None:
        return None
    return Usage.reported(fresh + (created or 0) + (read or 0), output)
