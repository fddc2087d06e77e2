"""Model providers: what the tool loop calls to get the next model turn (docs/usage.md, "Using it").

``ScriptedProvider`` plays a spec's deterministic turns; ``OpenAIProvider`` talks to any
OpenAI-compatible chat-completions endpoint through the official ``openai`` SDK. Both are
cancellable by an enclosing anyio cancel scope, and both report failures as
:class:`~shared.errors.ProviderError`; cancellation is never turned into an error
(docs/cancellation.md, "Cancellation"). Every provider is built behind a :class:`RetryingProvider`
(:func:`provider_for`), which tries a failed call again where that may help (docs/leases.md, "Retries").
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import random
import ssl
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final, Generic, Protocol, Self, TypeVar

import anyio
import httpx2
import structlog
from openai import AsyncOpenAI, DefaultAsyncHttpxClient, OpenAIError, omit
from openai.types.chat import (
    ChatCompletion,
    ChatCompletionFunctionToolParam,
    ChatCompletionMessageFunctionToolCall,
    ChatCompletionMessageFunctionToolCallParam,
    ChatCompletionMessageParam,
)

from runbrake.shared import redaction
from runbrake.shared.errors import ProviderError, RetriedAttempt
from runbrake.shared.registry import PROVIDERS, NotImplementedHere
from runbrake.shared.settings import Settings
from runbrake.shared.spec import ModelSpec, OpenAIModel, ScriptedModel
from runbrake.worker.bounded_bodies import ResponseTooLarge, bound_bodies
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
from runbrake.worker.deltas import StreamedText
from runbrake.worker.model_stream import MAX_STREAM_BYTES, ChatCompletionAssembly, MidStream, read_answer

__all__ = [
    "SDK_FAULTS",
    "Connection",
    "EndpointProvider",
    "ModelProvider",
    "OpenAIProvider",
    "RetryPolicy",
    "RetryingProvider",
    "ScriptedProvider",
    "api_key",
    "close_client",
    "http_client",
    "provider_error",
    "provider_for",
    "timed_out",
    "tls_context",
]

log = structlog.get_logger(__name__)

_DEFAULTS: Final = Settings()
_BACKOFF_BASE_S: Final = 0.5
"""The first retry waits up to this, each next one up to twice the last (docs/leases.md, "Retries")."""

DEFAULT_TIMEOUT_S = 120.0
_PLACEHOLDER_API_KEY = "unused"
_C = TypeVar("_C", bound="_Closable")
_S = TypeVar("_S")
# Closing the HTTP client runs shielded so a cancelled scope cannot leak the connection;
# the bound keeps a wedged close from holding a cancel up indefinitely.
_CLOSE_TIMEOUT_S = 5.0


class ModelProvider(Protocol):
    """Something that answers a conversation with the next model turn."""

    async def complete(self, messages: Sequence[Message], tools: Sequence[ToolInfo], *, round_index: int,
                       settings: ModelSettings = NO_SETTINGS, text: StreamedText | None = None) -> ModelTurn:
        """Ask the model for its next turn.

        Args:
            messages: the conversation so far; ``system`` messages (the run's instructions) come first.
            tools: the tools the model may call in this turn.
            round_index: the 0-based index of this model call within the whole run; it
                continues across segments (e.g. after an approval resume).
            settings: how to ask (temperature, output schema, …): each passed where the provider has the notion.
            text: where a provider that streams puts the answer's text as it arrives (worker/deltas.py): read
                by the loop when the call is cut off.

        Raises:
            ProviderError: when the provider fails to produce a turn.
        """
        ...


class ScriptedProvider:
    """Plays the turns of a ``scripted`` model spec, one per round, statelessly; it does not stream."""

    def __init__(self, spec: ScriptedModel) -> None:
        self._spec = spec

    async def complete(self, messages: Sequence[Message], tools: Sequence[ToolInfo], *, round_index: int,
                       settings: ModelSettings = NO_SETTINGS, text: StreamedText | None = None) -> ModelTurn:
        """Return ``turns[round_index]`` after its ``delay_ms`` (``settings`` and ``text`` have nothing to do
        here).

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


class EndpointProvider(Generic[_S, _C]):
    """What the providers that ask an HTTP endpoint through an SDK share: their spec, the request timeout,
    and the SDK's client (:class:`Connection`): inside ``async with provider`` (a segment of a run,
    worker/runtime.py) its calls share one client and its connection; outside, each call makes its own.

    Args:
        spec: the model spec (endpoint, model name, API key variable).
        timeout_s: the per-request HTTP timeout in seconds, when the settings give none.
    """

    def __init__(self, spec: _S, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self._spec = spec
        self._timeout_s = timeout_s
        self.connection: Connection[_C] = Connection(self._client)

    async def __aenter__(self) -> Self:
        self.connection.hold()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.connection.release()

    def _client(self) -> _C:
        """A new SDK client for this provider's endpoint."""
        raise NotImplementedError


class OpenAIProvider(EndpointProvider[OpenAIModel, AsyncOpenAI]):
    """Asks an OpenAI-compatible chat-completions endpoint; tools are shown as ``<server>__<tool>``. The answer
    is streamed unless the catalog model says ``stream = false`` (docs/cancellation.md, "Streaming")."""

    async def complete(self, messages: Sequence[Message], tools: Sequence[ToolInfo], *, round_index: int,
                       settings: ModelSettings = NO_SETTINGS, text: StreamedText | None = None) -> ModelTurn:
        """Send the conversation and tools; map the answer back to runbrake's values (streamed: assembled
        into the completion a whole answer gives, its text handed to ``text`` as it arrives).

        Raises:
            ProviderError: when the API key variable is unset, on any ``openai`` error (status,
                connection, timeout), when the answer is not a chat completion, or when a streamed answer
                broke off (:class:`~worker.model_stream.MidStream`, not retried). A call to a tool the
                run does not have, or with arguments that are not a JSON object, is no error: it comes
                back as a :class:`ToolCall` with a ``problem``, for the loop to hand back to the model.
        """
        where = f"{self._spec.base_url} ({self._spec.model})"
        timeout_s = settings.timeout_s or self._timeout_s
        request: dict[str, Any] = {
            "model": self._spec.model,
            "messages": [_message_param(m) for m in messages],
            "tools": [_tool_param(t) for t in tools] if tools else omit,
            "timeout": timeout_s,
            **_settings_params(settings, has_tools=bool(tools)),
        }
        assembly = ChatCompletionAssembly(text)
        with anyio.move_on_after(timeout_s):
            async with self.connection.client() as client:
                try:
                    if self._spec.stream is False:
                        completion: object = await client.chat.completions.create(**request)
                    else:
                        # include_usage: the last chunk carries the usage a whole answer has.
                        async with client.chat.completions.with_streaming_response.create(
                            **request, stream=True, stream_options={"include_usage": True},
                        ) as response:
                            body = await read_answer(response, assembly, where=where)
                        completion = ChatCompletion.construct(**body)
                except (OpenAIError, *SDK_FAULTS) as exc:
                    # Only the SDK's own errors and what it lets through: anyio's cancellation is a BaseException
                    # and passes through. The message may carry the endpoint's error body: a short excerpt only
                    # (docs/security.md).
                    raise provider_error(where, exc) from exc
            return _turn(completion, {t.server for t in tools})
        raise timed_out(where, timeout_s, began=assembly.began)

    def _client(self) -> AsyncOpenAI:
        return AsyncOpenAI(
            base_url=self._spec.base_url,
            api_key=api_key(self._spec.api_key_env),
            # Retries are runbrake's decision (docs/leases.md, "Retries"), not the SDK's.
            max_retries=0,
            http_client=http_client(DefaultAsyncHttpxClient),
        )


class _Closable(Protocol):
    async def close(self) -> None: ...


class Connection(Generic[_C]):
    """A provider's SDK client: one per call, or, while held (a segment of a run), one for all its calls,
    so that they share a connection (docs/benchmarks.md, "Model call overhead").

    A call that raises closes the client, whatever it was (shielded and bounded, :func:`close_client`): an
    interrupted call is closed, not left running, and the next call makes a new client.
    """

    def __init__(self, make: Callable[[], _C]) -> None:
        self._make = make
        self._held = False
        self._client: _C | None = None

    def hold(self) -> None:
        """Keep the client between calls until :meth:`release`."""
        self._held = True

    async def release(self) -> None:
        """Close the kept client, if any; calls make their own again."""
        self._held = False
        await self._close()

    @property
    def open(self) -> bool:
        """Whether a client is kept open between calls."""
        return self._client is not None

    @contextlib.asynccontextmanager
    async def client(self) -> AsyncIterator[_C]:
        """The client for one call (made lazily: a missing API key is the call's error)."""
        client = self._client if self._client is not None else self._make()
        if self._held:
            self._client = client
        try:
            yield client
        except BaseException:
            if client is self._client:
                self._client = None
            await close_client(client)
            raise
        if client is not self._client:
            await close_client(client)

    async def _close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await close_client(client)


async def close_client(client: _Closable) -> None:
    """Close a provider SDK's client, shielded so that a cancelled call cannot leak its connection, and
    bounded so that a wedged close cannot hold a cancel up."""
    with anyio.move_on_after(_CLOSE_TIMEOUT_S, shield=True):
        await client.close()


def api_key(name: str | None) -> str:
    """The API key in the worker's environment variable ``name`` (remembered as a secret to redact).

    Raises:
        ProviderError: when the variable is unset or empty.
    """
    if name is None:
        # The SDKs refuse an empty key (or look for one elsewhere); a local endpoint without auth takes any.
        return _PLACEHOLDER_API_KEY
    value = os.environ.get(name)
    if not value:
        raise ProviderError(f"API key variable {name} is not set")
    redaction.remember(value)
    return value


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The TLS context every model client of this process uses, the SDKs' default one made once: building
    it loads the CA bundle, some 30 ms of CPU, which a client per segment would pay every time
    (docs/benchmarks.md, "Model call overhead")."""
    return httpx2.create_ssl_context()


def http_client(kind: Callable[..., httpx2.AsyncClient]) -> httpx2.AsyncClient:
    """The HTTP client of a provider SDK's client (``kind``: the SDK's ``DefaultAsyncHttpxClient``, with its
    limits and timeouts): this process's TLS context, no redirect followed (a model endpoint's redirect is an
    error, as an MCP server's and a webhook receiver's are: docs/security.md), every answer's body, an
    error's too, read within :data:`~worker.model_stream.MAX_STREAM_BYTES` (worker/bounded_bodies.py)."""
    client: httpx2.AsyncClient = kind(verify=tls_context(), follow_redirects=False,
                                      event_hooks={"response": [_BOUNDED]})
    return client


_BOUNDED: Final = bound_bodies(MAX_STREAM_BYTES, what="the model's answer")


SDK_FAULTS: Final = (ResponseTooLarge, httpx2.HTTPError, ValueError)
"""What a provider SDK's call lets through besides its own errors when an endpoint answers with hostile bytes
(tests/test_fuzz_endpoints.py): a body past its bound (worker/bounded_bodies.py), a read of the body that
broke (the SDKs translate only the request's errors), a whole answer that is not JSON (the openai SDK reads it
with ``json.loads``). :func:`provider_error` maps them with the SDK's own."""


def timed_out(where: str, timeout_s: float, *, began: bool) -> ProviderError:
    """A call cut off at its deadline (``timeout_s``: the whole request, its answer's last byte included, not
    each read): retried like any timeout, unless a streamed answer had begun (:class:`MidStream`: its text may
    have been shown)."""
    message = f"{where}: the model call timed out after {timeout_s:g} s"
    if began:
        return MidStream(f"{message}, its streamed answer unfinished")
    return ProviderError(message, transient=True)


_ERROR_EXCERPT_CHARS = 300
_MAX_RETRY_AFTER_S = 3600.0


def provider_error(where: str, exc: Exception) -> ProviderError:
    """A provider SDK's error (or one of :data:`SDK_FAULTS`) as a :class:`ProviderError`: its HTTP status and
    ``Retry-After`` when it answered, ``transient`` for a timeout or a connection error, a short excerpt of its
    message; an answer past its bound or not JSON is not transient.

    The ``openai`` and ``anthropic`` SDKs share these shapes (``status_code``, ``response.headers``, and
    ``APIConnectionError``/``APITimeoutError`` without a response), so both map through here.
    """
    # The anthropic SDK wraps whatever a read raised as a connection error: the bound is found as its cause.
    too_large = exc if isinstance(exc, ResponseTooLarge) else exc.__cause__
    if isinstance(too_large, ResponseTooLarge):  # not retried: the next answer would be as large
        return ProviderError(f"{where}: {too_large}")
    if isinstance(exc, ValueError):
        return ProviderError(f"{where}: the model's answer is not JSON: {_excerpt(str(exc))}")
    if isinstance(exc, httpx2.HTTPError):
        return ProviderError(f"{where}: {type(exc).__name__}: {_excerpt(str(exc))}", transient=True)
    status = getattr(exc, "status_code", None)
    response = getattr(exc, "response", None)
    headers = getattr(response, "headers", None)
    retry_after = retry_after_s(headers.get("retry-after") if headers is not None else None)
    location = headers.get("location") if headers is not None else None
    if isinstance(status, int) and 300 <= status < 400:
        # Not followed (http_client): said as such, never taken for the endpoint's answer.
        return ProviderError(f"{where}: answered {status}, a redirect to {_excerpt(str(location))}; model calls "
                             "follow no redirects", status=status)
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


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often and how long a model call is tried again (docs/leases.md, "Retries")."""

    retries: int = _DEFAULTS.model_retries
    """Retries after the first attempt (``RUNBRAKE_MODEL_RETRIES``; a catalog model's ``max_retries``)."""
    max_wait_s: float = _DEFAULTS.model_retry_max_s
    """Most seconds one call waits between its attempts, all waits together (``RUNBRAKE_MODEL_RETRY_MAX_S``)."""
    timeout_s: float | None = None
    """Seconds one request may take (a catalog model's ``timeout_s``); ``None``: the provider's default."""

    @classmethod
    def from_settings(cls, settings: Settings) -> RetryPolicy:
        return cls(retries=settings.model_retries, max_wait_s=settings.model_retry_max_s)

    def for_model(self, spec: ModelSpec) -> RetryPolicy:
        """This policy with the overrides a catalog model sets (``max_retries``, ``timeout_s``)."""
        retries, timeout_s = getattr(spec, "max_retries", None), getattr(spec, "timeout_s", None)
        return replace(self, retries=self.retries if retries is None else retries,
                       timeout_s=self.timeout_s if timeout_s is None else timeout_s)

    def wait_s(self, error: ProviderError, retried: Sequence[RetriedAttempt], *, draw: float) -> float | None:
        """Seconds to wait before trying again after ``error``, or ``None`` to give up.

        Full jitter (a wait drawn evenly from 0 to ``base · 2^n``, ``draw`` the 0..1 draw), at least what the
        endpoint's ``Retry-After`` asked for; given up once the retries are spent, for an error not worth
        another attempt, or when the wait would take the call past ``max_wait_s``.
        """
        if not error.retryable or len(retried) >= self.retries:
            return None
        wait = max(draw * _BACKOFF_BASE_S * 2.0 ** len(retried), error.retry_after_s or 0.0)
        if sum(r.wait_s for r in retried) + wait > self.max_wait_s:
            return None
        return math.ceil(wait * 1000) / 1000  # whole milliseconds, never below what Retry-After asked


class RetryingProvider:
    """Tries a provider's call again on an error worth it (:attr:`ProviderError.retryable`), as a policy says.

    Every provider is built behind one (:func:`provider_for`). The wait is an anyio sleep inside the call's
    in-flight scope, so a cancel (or a hand-over) interrupts it at once, like a request in flight; a tool call
    is never retried (docs/leases.md, "Retries").
    """

    def __init__(self, provider: ModelProvider, policy: RetryPolicy) -> None:
        self._provider = provider
        self._policy = policy

    @property
    def provider(self) -> ModelProvider:
        """The provider it asks."""
        return self._provider

    @property
    def policy(self) -> RetryPolicy:
        return self._policy

    async def __aenter__(self) -> Self:
        """Hold the provider's client for the calls of the block (a provider with one: its ``Connection``)."""
        connection = getattr(self._provider, "connection", None)
        if isinstance(connection, Connection):
            connection.hold()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        connection = getattr(self._provider, "connection", None)
        if isinstance(connection, Connection):
            await connection.release()

    async def complete(self, messages: Sequence[Message], tools: Sequence[ToolInfo], *, round_index: int,
                       settings: ModelSettings = NO_SETTINGS, text: StreamedText | None = None) -> ModelTurn:
        """The provider's turn, with ``attempts`` and the attempts ``retried`` before it (a streamed answer
        that broke after it began is not retried: ``MidStream`` is not retryable).

        Raises:
            ProviderError: the last attempt's error, with ``attempts`` and ``retried``.
        """
        if settings.timeout_s is None and self._policy.timeout_s is not None:
            settings = replace(settings, timeout_s=self._policy.timeout_s)
        retried: list[RetriedAttempt] = []
        while True:
            try:
                turn = await self._provider.complete(messages, tools, round_index=round_index, settings=settings,
                                                     text=text)
            except ProviderError as exc:
                wait_s = self._policy.wait_s(exc, retried, draw=random.random())
                if wait_s is None:
                    raise exc.after(tuple(retried)) from exc
                log.info("model_call_retrying", attempt=len(retried) + 1, status=exc.status, wait_s=wait_s)
                retried.append(RetriedAttempt(error=str(exc), status=exc.status, wait_s=wait_s))
                await anyio.sleep(wait_s)
                continue
            return replace(turn, attempts=len(retried) + 1, retried=tuple(retried))


def provider_for(spec: ModelSpec, policy: RetryPolicy | None = None) -> RetryingProvider:
    """The provider for a run spec's ``model``: the implementation its registry entry names, behind a
    :class:`RetryingProvider` with ``policy`` (the defaults when left out) and the model's overrides.

    Raises:
        ProviderError: when the provider has no implementation in this worker (it never falls back to another).
    """
    try:
        implementation: Callable[[ModelSpec], ModelProvider] = PROVIDERS.implementation(spec)
    except NotImplementedHere as exc:
        raise ProviderError(str(exc)) from exc
    return RetryingProvider(implementation(spec), (policy or RetryPolicy()).for_model(spec))


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
    return Usage.reported(prompt, completion)


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
