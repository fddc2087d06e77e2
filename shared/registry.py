"""The registries of what grows: model providers and MCP transports (docs/pitfalls.md, "Adding a model
provider or transport").

An :class:`Entry` says everything runbrake needs to know about one provider or transport: its tag, its spec
model, the worker's implementation, whether a run may define it inline without ``RUNBRAKE_ALLOW_INLINE``,
whether an operator's catalog may define it, and how ``runbrake catalog check`` describes it. The spec's
tagged unions and their messages, the inline policy, the catalog, the JSON Schema and the worker's
construction all read :data:`PROVIDERS` and :data:`TRANSPORTS`; nothing else lists the members.

``shared`` never imports ``worker``: an entry names its implementation by a dotted path
(``"runbrake.worker.models:OpenAIProvider"``), imported by the worker the first time it is needed. A path that
does not import refuses the run's model or server (:class:`NotImplementedHere`), it never falls back to
another member.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from runbrake.shared.errors import RunbrakeError

__all__ = ["PROVIDERS", "TRANSPORTS", "Entry", "NotImplementedHere", "Registry", "Shown", "either"]


class Shown(Protocol):
    """How ``runbrake catalog check`` shows a value that may hold a secret (``Catalog.describe``)."""

    def secret(self, template: str, *, literal_is_secret: bool = True) -> dict[str, Any]:
        """A ``${VAR}`` template: its text (literal secrets masked) and whether each variable is set."""
        ...

    def url(self, value: str) -> str:
        """A URL without its password."""
        ...

    def is_set(self, variable: str) -> bool:
        """Whether the environment sets ``variable``."""
        ...

    def secret_name(self, name: str) -> bool:
        """Whether a name (an env entry's) says its value is a secret (``*TOKEN*``, ``*KEY*``, ...)."""
        ...


def _nothing(spec: Any, shown: Shown) -> dict[str, Any]:
    return {}


def _no_variables(spec: Any) -> Iterable[str]:
    return ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Entry:
    """One model provider or MCP transport."""

    tag: str
    """Its value of the union's tag field: ``model.provider`` or an MCP server's ``transport``."""
    spec: type
    """Its pydantic spec model; its tag field is ``Literal[tag]``."""
    implementation: str
    """``module:attribute`` of the worker's implementation: a provider class taking the spec, or a function
    from the server spec to the MCP SDK's transport."""
    title: str
    """How messages name it: ``streamable HTTP``, ``stdio``."""
    inline: bool = False
    """Whether a run may define it inline without ``RUNBRAKE_ALLOW_INLINE=true``. Left out: it may not (fail
    closed: an inline definition chooses what a worker reaches, docs/security.md)."""
    catalog: bool = True
    """Whether an operator's catalog may define it (``scripted`` reaches nothing: it needs no entry)."""
    implied_by: str | None = None
    """A key whose presence implies this tag when the tag field is left out (``url``: streamable HTTP)."""
    describe: Callable[[Any, Shown], dict[str, Any]] = _nothing
    """What ``runbrake catalog check`` shows of one of its specs, beside the tag (secrets masked)."""
    variables: Callable[[Any], Iterable[str]] = _no_variables
    """The environment variables one of its specs names (their values are secrets, shared/redaction.py)."""


class NotImplementedHere(RunbrakeError, LookupError):
    """Raised when a spec is of no registered member, or its member has no implementation this process can
    import."""


@dataclass(eq=False)
class Registry:
    """The entries of one tagged union, by tag, in the order they were registered."""

    kind: str
    """What its members are, for messages: ``model provider``, ``MCP transport``."""
    tag_field: str
    """The spec's tag field: ``provider``, ``transport``."""
    _entries: dict[str, Entry] = field(default_factory=dict, init=False)
    _listeners: list[Callable[[], None]] = field(default_factory=list, init=False)
    _implementations: dict[str, Any] = field(default_factory=dict, init=False)
    _specs: tuple[type, ...] = field(default=(), init=False)

    def register(self, entry: Entry) -> Entry:
        """Add ``entry``; the spec models that use this registry are rebuilt.

        Raises:
            ValueError: when its tag is taken.
        """
        if entry.tag in self._entries:
            raise ValueError(f"{self.kind} {entry.tag!r} is registered already")
        self._entries[entry.tag] = entry
        self._changed()
        return entry

    def unregister(self, tag: str) -> None:
        """Remove the entry of ``tag`` (a no-op for a tag not registered)."""
        if self._entries.pop(tag, None) is not None:
            self._implementations.pop(tag, None)
            self._changed()

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` after every change (the spec models rebuild their unions)."""
        self._listeners.append(listener)

    def __iter__(self) -> Iterator[Entry]:
        return iter(tuple(self._entries.values()))

    def tags(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def __getitem__(self, tag: str) -> Entry:
        return self._entries[tag]

    def of(self, spec: object) -> Entry:
        """The entry of a spec model's instance.

        Raises:
            NotImplementedHere: for an instance of no registered spec model.
        """
        for entry in self._entries.values():
            if type(spec) is entry.spec:
                return entry
        raise NotImplementedHere(f"{type(spec).__name__} is no registered {self.kind}'s spec")

    def implementation(self, spec: object) -> Any:
        """The worker's implementation of ``spec``'s member (imported once).

        Raises:
            NotImplementedHere: when the member is not registered, or its implementation does not import.
        """
        entry = self.of(spec)
        found = self._implementations.get(entry.tag)
        if found is None:
            module, _, name = entry.implementation.partition(":")
            try:
                found = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError) as exc:
                raise NotImplementedHere(
                    f"{self.kind} {entry.tag!r} has no implementation here ({entry.implementation}: {exc})") from exc
            self._implementations[entry.tag] = found
        return found

    def one_of(self, tags: Iterable[str] | None = None) -> str:
        """``'a' or 'b'``, ``'a', 'b' or 'c'``: the tags, for a message."""
        return either(repr(tag) for tag in (self.tags() if tags is None else tags))

    def specs(self) -> tuple[type, ...]:
        """The spec models of every member."""
        return self._specs

    def _changed(self) -> None:
        self._specs = tuple(entry.spec for entry in self._entries.values())
        for listener in self._listeners:
            listener()


def either(words: Iterable[str]) -> str:
    """``a or b``, ``a, b or c``."""
    listed = list(words)
    return listed[0] if len(listed) == 1 else f"{', '.join(listed[:-1])} or {listed[-1]}"


PROVIDERS: Final = Registry(kind="model provider", tag_field="provider")
"""The model providers (registered in shared/spec.py beside their spec models)."""
TRANSPORTS: Final = Registry(kind="MCP transport", tag_field="transport")
"""The MCP transports (registered in shared/spec.py beside their spec models)."""
