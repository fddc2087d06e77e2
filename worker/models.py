"""Model providers: what the tool loop calls to get the next model turn (docs/usage.md, "Using it").

``ScriptedProvider`` plays a spec's deterministic turns; ``OpenAIProvider`` talks to any
OpenAI-compatible chat-completions endpoint through the official ``openai`` SDK. Both are
cancellable by an enclosing anyio cancel scope, and both report failures as
:class:`~shared.errors.ProviderError`; cancellation is never turned into an error
(docs/architecture.md, "Cancellation").
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Protocol

import anyio
from openai import AsyncOpenAI, OpenAIError, omit
from openai.types.chat import (
    ChatCompletionFunctionToolParam,
    ChatCompletionMessageFunctionToolCall,
    ChatCompletionMessageFunctionToolCallParam,
    ChatCompletionMessageParam,
)

from runbrake.shared import redaction
from runbrake.shared.errors import ProviderError
from runbrake.shared.registry import PROVIDERS, NotImplementedHere
from runbrake.shared.spec import ModelSpec, OpenAIModel, ScriptedModel
from runbrake.worker.conversation import (
    NO_SETTINGS,
    Message,
    ModelSettings,
    ModelTurn,
    ToolCall,
    ToolInfo,
    Usage,
    model_tool_call,
)

__all__ = ["ModelProvider", "OpenAIProvider", "ScriptedProvider", "provider_for"]

DEFAULT_TIMEOUT_S = 120.0
_PLACEHOLDER_API_KEY = "unused"
# Closing the HTTP client runs shielded so a cancelled scope cannot leak the connection;
# the bound keeps a wedged close from holding a cancel up indefinitely.
_CLOSE_TIMEOUT_S = 5.0


class ModelProvider(Protocol):
    """Something that answers a conversation with the next model turn."""

    async def complete(self, messages: Sequence[Message], tools: Sequence[ToolInfo], *, round_index: int,
                       settings: ModelSettings = NO_SETTINGS) -> ModelTurn:
        """Ask the model for its next turn.

        Args:
            messages: the conversation so far; ``system`` messages (the run's instructions) come first.
            tools: the tools the model may call in this turn.
            round_index: the 0-based index of this model call within the whole run; it
                continues across segments (e.g. after an approval resume).
            settings: how to ask (temperature, output schema, …): each passed where the provider has the notion.

        Raises:
            ProviderError: when the provider fails to produce a turn.
        """
        ...


class ScriptedProvider:
    """Plays the turns of a ``scripted`` model spec, one per round, statelessly."""

    def __init__(self, spec: ScriptedModel) -> None:
        self._spec = spec

    async def complete(self, messages: Sequence[Message], tools: Sequence[ToolInfo], *, round_index: int,
                       settings: ModelSettings = NO_SETTINGS) -> ModelTurn:
        """Return ``turns[round_index]`` after its ``delay_ms`` (``settings`` has nothing to change here).

        Raises:
            ProviderError: for a turn with ``fail``, or when no turn exists for ``round_index``.
        """
        turns = self._spec.turns
        if not 0 <= round_index < len(turns):
            raise ProviderError(f"scripted model has no turn for round {round_index} ({len(turns)} turns)")
        turn = turns[round_index]
        if turn.delay_ms:
            # Stands for model latency; anyio.sleep is a checkpoint, so a cancel scope interrupts it.
            await anyio.sleep(turn.delay_ms / 1000)
        if turn.fail is not None:
            raise ProviderError(turn.fail)
        calls = tuple(
            ToolCall(id=f"call_{round_index}_{n}", server=c.server, tool=c.tool, arguments=dict(c.arguments))
            for n, c in enumerate(turn.tool_calls)
        )
        return ModelTurn(content=turn.content, tool_calls=calls)


class OpenAIProvider:
    """Asks an OpenAI-compatible chat-completions endpoint; tools are shown as ``<server>__<tool>``.

    Args:
        spec: the ``openai`` model spec (endpoint, model name, API key variable).
        timeout_s: the per-request HTTP timeout in seconds.
    """

    def __init__(self, spec: OpenAIModel, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self._spec = spec
        self._timeout_s = timeout_s

    async def complete(self, messages: Sequence[Message], tools: Sequence[ToolInfo], *, round_index: int,
                       settings: ModelSettings = NO_SETTINGS) -> ModelTurn:
        """Send the conversation and tools; map the answer back to runbrake's values.

        Raises:
            ProviderError: when the API key variable is unset, on any ``openai`` error (status,
                connection, timeout), or when the answer is not a chat completion. A call to a tool the
                run does not have, or with arguments that are not a JSON object, is no error: it comes
                back as a :class:`ToolCall` with a ``problem``, for the loop to hand back to the model.
        """
        # A new client per call: a run's model calls are seconds apart, so pooling buys little,
        # and nothing outlives the call that could leak when a worker thread is torn down.
        client = AsyncOpenAI(
            base_url=self._spec.base_url,
            api_key=self._api_key(),
            timeout=settings.timeout_s or self._timeout_s,
            # Retries are runbrake's decision (docs/architecture.md, "Retries"), not the SDK's.
            max_retries=0,
        )
        try:
            completion = await client.chat.completions.create(
                model=self._spec.model,
                messages=[_message_param(m) for m in messages],
                tools=[_tool_param(t) for t in tools] if tools else omit,
                **_settings_params(settings, has_tools=bool(tools)),
            )
        except OpenAIError as exc:
            # Only the SDK's own errors: anyio's cancellation is a BaseException and passes through.
            # The message may carry the endpoint's error body: a short excerpt only (docs/security.md).
            raise provider_error(f"{self._spec.base_url} ({self._spec.model})", exc) from exc
        finally:
            with anyio.move_on_after(_CLOSE_TIMEOUT_S, shield=True):
                await client.close()
        return _turn(completion, {t.server for t in tools})

    def _api_key(self) -> str:
        name = self._spec.api_key_env
        if name is None:
            # The SDK refuses an empty key; a local endpoint without auth takes any.
            return _PLACEHOLDER_API_KEY
        value = os.environ.get(name)
        if not value:
            raise ProviderError(f"API key variable {name} is not set")
        redaction.remember(value)
        return value


_ERROR_EXCERPT_CHARS = 300
_MAX_RETRY_AFTER_S = 3600.0


def provider_error(where: str, exc: Exception) -> ProviderError:
    """A provider SDK's error as a :class:`ProviderError`: its HTTP status and ``Retry-After`` when it
    answered, ``transient`` for a timeout or a connection error, a short excerpt of its message.

    The ``openai`` and ``anthropic`` SDKs share these shapes (``status_code``, ``response.headers``, and
    ``APIConnectionError``/``APITimeoutError`` without a response), so both map through here.
    """
    status = getattr(exc, "status_code", None)
    response = getattr(exc, "response", None)
    headers = getattr(response, "headers", None)
    retry_after = retry_after_s(headers.get("retry-after") if headers is not None else None)
    return ProviderError(f"{where}: {_excerpt(str(exc))}", status=status if isinstance(status, int) else None,
                         retry_after_s=retry_after, transient=not isinstance(status, int) and response is None)


def retry_after_s(value: object) -> float | None:
    """Seconds a ``Retry-After`` header asks for (delta-seconds only; an HTTP date or garbage is ignored),
    bounded to an hour: an endpoint cannot park a run for ever."""
    if not isinstance(value, str):
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        return None
    if not math.isfinite(seconds) or seconds < 0:
        return None
    return min(seconds, _MAX_RETRY_AFTER_S)


def _excerpt(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _ERROR_EXCERPT_CHARS else text[:_ERROR_EXCERPT_CHARS] + "…"


def provider_for(spec: ModelSpec) -> ModelProvider:
    """The provider for a run spec's ``model``: the implementation its registry entry names.

    Raises:
        ProviderError: when the provider has no implementation in this worker (it never falls back to another).
    """
    try:
        implementation: Callable[[ModelSpec], ModelProvider] = PROVIDERS.implementation(spec)
    except NotImplementedHere as exc:
        raise ProviderError(str(exc)) from exc
    return implementation(spec)


def _message_param(message: Message) -> ChatCompletionMessageParam:
    content = message.content or ""
    match message.role:
        case "system":
            return {"role": "system", "content": content}
        case "user":
            return {"role": "user", "content": content}
        case "tool":
            if message.tool_call_id is None:
                raise ProviderError("a tool message needs the tool_call_id it answers")
            return {"role": "tool", "content": content, "tool_call_id": message.tool_call_id}
        case "assistant":
            if not message.tool_calls:
                return {"role": "assistant", "content": content}
            calls: list[ChatCompletionMessageFunctionToolCallParam] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.model_name, "arguments": json.dumps(dict(call.arguments))},
                }
                for call in message.tool_calls
            ]
            # Chat completions accepts null content beside tool calls; "" would read as an empty reply.
            return {"role": "assistant", "content": message.content, "tool_calls": calls}


def _settings_params(settings: ModelSettings, *, has_tools: bool) -> dict[str, Any]:
    """The chat-completions parameters of the settings that are set (the others stay out of the request).

    ``max_output_tokens`` goes as ``max_tokens``: every OpenAI-compatible server accepts that one (vLLM,
    llama.cpp, Ollama, LM Studio, TGI, LiteLLM), while several ignore the newer ``max_completion_tokens``,
    and OpenAI itself still takes ``max_tokens`` for its chat models (docs/usage.md, "Model settings").
    ``tool_choice`` and ``parallel_tool_calls`` mean something only beside tools, and some servers refuse
    them without: sent only when the turn offers tools. ``output_schema`` goes as a ``json_schema``
    response format, not strict: the answer is validated here anyway (worker/structured.py), and strict mode
    refuses schemas outside OpenAI's subset."""
    params: dict[str, Any] = {}
    if settings.temperature is not None:
        params["temperature"] = settings.temperature
    if settings.top_p is not None:
        params["top_p"] = settings.top_p
    if settings.max_output_tokens is not None:
        params["max_tokens"] = settings.max_output_tokens
    if settings.stop is not None:
        params["stop"] = list(settings.stop)
    if settings.seed is not None:
        params["seed"] = settings.seed
    if has_tools and settings.tool_choice is not None:
        params["tool_choice"] = settings.tool_choice
    if has_tools and settings.parallel_tool_calls is not None:
        params["parallel_tool_calls"] = settings.parallel_tool_calls
    if settings.output_schema is not None:
        params["response_format"] = {"type": "json_schema",
                                     "json_schema": {"name": "output", "schema": dict(settings.output_schema)}}
    return params


def _tool_param(tool: ToolInfo) -> ChatCompletionFunctionToolParam:
    return {
        "type": "function",
        "function": {
            "name": tool.model_name,
            "description": tool.description,
            "parameters": dict(tool.input_schema),
        },
    }


def _turn(completion: object, servers: set[str]) -> ModelTurn:
    # The SDK builds its response models without validation (so lenient compatible servers
    # work), hence whatever the endpoint sent arrives here: check the few fields used.
    choices = getattr(completion, "choices", None)
    if not isinstance(choices, list) or not choices:
        raise ProviderError(f"the model answered without a choice: {completion!r:.200}")
    message = getattr(choices[0], "message", None)
    content = getattr(message, "content", None)
    calls = getattr(message, "tool_calls", None) or []
    if message is None or not isinstance(content, str | None) or not isinstance(calls, list):
        raise ProviderError(f"the model answered with a malformed message: {message!r:.200}")
    return ModelTurn(content=content, tool_calls=tuple(_tool_call(call, servers) for call in calls),
                     usage=_usage(getattr(completion, "usage", None)))


def _usage(usage: object) -> Usage | None:
    # Unvalidated model (see _turn): a compatible server may omit usage or send other types.
    prompt, completion = getattr(usage, "prompt_tokens", None), getattr(usage, "completion_tokens", None)
    if not isinstance(prompt, int) or not isinstance(completion, int) or prompt < 0 or completion < 0:
        return None
    return Usage(input_tokens=prompt, output_tokens=completion)


def _tool_call(call: object, servers: set[str]) -> ToolCall:
    # Only function calls: runbrake offers no custom tools, so anything else is a protocol error.
    if not isinstance(call, ChatCompletionMessageFunctionToolCall):
        raise ProviderError(f"the model answered with an unsupported tool call: {call!r:.200}")
    # Unvalidated model (see _turn): the fields may be missing or of another type.
    name, raw = getattr(call.function, "name", None), getattr(call.function, "arguments", None)
    if not isinstance(call.id, str) or not isinstance(name, str) or not isinstance(raw, str | None):
        raise ProviderError(f"the model answered with a malformed tool call: {call!r:.200}")
    # A call the run cannot make is the model's mistake: handed back to it (a ToolCall with a problem).
    raw = raw or ""
    try:
        # Some compatible servers send "" for a call without arguments. NaN, Infinity and numbers too large
        # for a float are not JSON (RFC 8259), though Python reads them: refused like any arguments that are
        # not JSON, before they reach the tool or the store (docs/security.md).
        arguments = json.loads(raw, parse_constant=_not_a_number, parse_float=_finite) if raw.strip() else {}
    except ValueError:  # a JSONDecodeError, or a number refused below
        called = model_tool_call(call.id, name, {}, servers)
        if called.problem is not None:
            return called
        return replace(called, problem=f"the arguments of {name} are not JSON: {raw[:200]!r}")
    return model_tool_call(call.id, name, arguments, servers)


def _not_a_number(token: str) -> float:
    raise ValueError(f"{token} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is too large for a number")
    return value
