"""The second line of defence for secrets: known secret values, bearer tokens and URL passwords are cut out
of every log line and of everything the store writes (docs/security.md, "Where secrets live").

The first line is that secrets never travel: header values, stdio env values and API keys are
expanded from the worker's environment only when used (``shared/catalog.py`` :func:`expand`).
Each value expanded there is remembered here, and so is each value of a variable the catalog names
that is set where the catalog is loaded (``Catalog.load``), so a server or provider that echoes one
back in an error, a result or a progress message does not get it into Redis or the logs.

What is stored goes through :func:`scrub_value` (every string of a JSON value, keys included), called
from the one place that turns values into script arguments (``shared/_store_core.py``,
:class:`~runbrake.shared._store_core.ScriptCall`). Matching is exact: a secret spelled another way (cut
in two, encoded, one character changed) is not recognised.

What a run's submitter wrote is theirs (:class:`Submitted`): a remembered value that also occurs in the run's
own input, instructions, messages or steer is not cut from what that run writes, so a guess echoed back by a
model or a tool comes back the same whether it is right or not, and redaction is no oracle for guessed values.
A tool's result spares only what its call's arguments carried (:func:`sparing_only`). Log lines are scrubbed
in full (docs/security.md, "What redaction promises").

Streamed text (``delta`` events) is scrubbed over what was said so far by :class:`StreamScrub`, which holds
back a tail that could still become a secret: joining the deltas never rebuilds one.

Text a caller supplies as attribution (a cancel's reason and who asked, an approval's decider and
reason) is also stripped of Unicode bidirectional controls (:func:`strip_bidi`), which would let it
reorder the "by …" shown after it (docs/security.md, "Tested attacks").
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Final

REDACTED: Final = "[redacted]"
_MIN_SECRET_CHARS: Final = 6
"""Shorter values are not remembered: replacing every "abc" in every log line would hide more than it saves."""

_URL_PASSWORD: Final = re.compile(r"(?P<head>\b[a-z][a-z0-9+.-]*://[^:/@\s]*:)[^@\s/]+@")
_BEARER: Final = re.compile(r"(?P<head>\bbearer\s+)[A-Za-z0-9._~+/=-]{6,}", re.IGNORECASE)
"""An HTTP bearer credential (RFC 6750's b64token) wherever it appears: ``Authorization: Bearer …``,
``auth=Bearer …``. Six characters at least, as for remembered values: "bearer of" is prose."""

_URL_PASSWORD_OPEN: Final = re.compile(r"(?P<head>\b[a-z][a-z0-9+.-]*://[^:/@\s]*:)[^@\s/]*\Z")
"""A URL whose password may still be arriving (streamed text ends inside it)."""
_WHITESPACE: Final = re.compile(r"\s")
_BEARER_HEAD_OPEN: Final = re.compile(r"\bbearer\s+\Z", re.IGNORECASE)
"""Text ending where a bearer token would begin."""
_BEARER_OPEN: Final = re.compile(r"(?P<head>\bbearer\s+)[A-Za-z0-9._~+/=-]*\Z", re.IGNORECASE)
"""A bearer credential that may still be arriving."""

_BIDI_CONTROLS: Final = re.compile("[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
"""Unicode's bidirectional formatting characters (UAX #9): ALM, LRM, RLM, the embeddings and overrides
LRE RLE PDF LRO RLO, and the isolates LRI RLI FSI PDI."""

_lock = threading.Lock()
_secrets: tuple[str, ...] = ()
"""The remembered values, longest first: a value that contains another is cut whole."""
_spaced = False
"""Whether a remembered value has whitespace in it (streamed text then has no checkpoints: :class:`StreamScrub`)."""


def remember(*values: str) -> None:
    """Treat these values as secrets from now on in this process."""
    global _secrets, _spaced  # noqa: PLW0603 - one set per process, read without a lock (replaced, never mutated)
    fresh = {value for value in values if len(value) >= _MIN_SECRET_CHARS} - set(_secrets)
    if fresh:
        with _lock:
            _spaced = _spaced or any(_WHITESPACE.search(value) for value in fresh)
            _secrets = tuple(sorted(set(_secrets) | fresh, key=len, reverse=True))


class Submitted:
    """What a run's submitter wrote (input, instructions, messages, steers): a remembered value found in it is
    theirs already, so the run's own writes do not cut it (that would tell a guess from a wrong one)."""

    def __init__(self, *texts: str, within: Submitted | None = None) -> None:
        self._texts = [text for text in texts if text]
        self._within = within
        self._wrote: dict[str, bool] = {}

    @classmethod
    def of_json(cls, request: str) -> Submitted:
        """The submitter's text of a run request (JSON): every string in it, keys too, as written (unescaped)."""
        try:
            value = json.loads(request)
        except ValueError:
            return cls(request)
        return cls.of(value)

    @classmethod
    def of(cls, value: Any, *texts: str) -> Submitted:
        """Every string in a JSON ``value`` (a run's request as read back), keys too, and ``texts``."""
        strings = list(texts)
        pending = [value]
        while pending:
            item = pending.pop()
            if isinstance(item, str):
                strings.append(item)
            elif isinstance(item, Mapping):
                strings.extend(str(key) for key in item)
                pending.extend(item.values())
            elif isinstance(item, list | tuple):
                pending.extend(item)
        return cls("\0".join(strings))

    def add(self, *texts: str) -> None:
        """More of the submitter's text (a steer's)."""
        self._texts.extend(text for text in texts if text)
        self._wrote.clear()

    def wrote(self, secret: str) -> bool:
        """Whether ``secret`` occurs in what the submitter wrote (and, when narrowed, in ``within`` too)."""
        known = self._wrote.get(secret)
        if known is None:
            known = any(secret in text for text in self._texts)
            if known and self._within is not None:
                known = self._within.wrote(secret)
            self._wrote[secret] = known
        return known


_submitted: ContextVar[Submitted | None] = ContextVar("runbrake_submitted", default=None)
"""The submitter's text of the run whose task this is; None outside a run: every value is cut."""


@contextmanager
def submitted(spared: Submitted) -> Iterator[Submitted]:
    """Within the block (and the tasks it starts), :func:`scrub` spares the values ``spared`` says were written
    by the run's submitter."""
    token = _submitted.set(spared)
    try:
        yield spared
    finally:
        _submitted.reset(token)


def current_submitted() -> Submitted | None:
    """The submitter's text of the run being executed here, if any."""
    return _submitted.get()


def scrub(text: str, *, spare: bool = True) -> str:
    """``text`` without known secret values, bearer tokens, and the password of any URL in it; with ``spare``,
    a value the current run's submitter wrote (:class:`Submitted`) is kept."""
    return _without_patterns(_without_secrets(text, spare=spare))


def _without_secrets(text: str, *, spare: bool = True) -> str:
    spared = _submitted.get() if spare else None
    for secret in _secrets:
        if secret in text and (spared is None or not spared.wrote(secret)):
            text = text.replace(secret, REDACTED)
    return text


def _without_patterns(text: str) -> str:
    """The passwords of URLs and bearer tokens cut (after the secrets are: a ``[redacted]`` before ``bearer``
    makes a word boundary)."""
    if "://" in text:
        text = _URL_PASSWORD.sub(rf"\g<head>{REDACTED}@", text)
    return _BEARER.sub(rf"\g<head>{REDACTED}", text)


def scrub_value(value: Any, *, spare: bool = True) -> Any:
    """A JSON value (or a ``str``) safe to write anywhere: :func:`scrub` applied to every string in it,
    mapping keys included, and a non-finite number spelled as the string JSON has no token for (``"NaN"``,
    ``"Infinity"``, ``"-Infinity"``), so that no reader's JSON parser can choke on it.

    Tuples come back as lists, as JSON would have them; other values are returned as they are.
    """
    if isinstance(value, str):
        return scrub(value, spare=spare)
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, Mapping):
        return {scrub(str(key), spare=spare): scrub_value(item, spare=spare) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [scrub_value(item, spare=spare) for item in value]
    return value


@contextmanager
def sparing_only(given: str) -> Iterator[None]:
    """Within the block, :func:`scrub` spares only what the submitter wrote that also occurs in ``given``: what a
    server sends back is spared what it was sent (an echo), never a value it came by otherwise."""
    spared = _submitted.get()
    token = _submitted.set(None if spared is None else Submitted(given, within=spared))
    try:
        yield
    finally:
        _submitted.reset(token)


class StreamScrub:
    """Text that streams in, scrubbed over all of it so far rather than piece by piece: :meth:`advance` gives
    what may be published next, holding back a tail that could still become a secret (the start of a
    remembered value, a bearer token or a URL password still arriving). The pieces joined are always a prefix
    of the whole text scrubbed; never a secret, nor the start of one.

    Each call scrubs the text since a checkpoint, not all of it: a whitespace no match can reach across, whose
    text before it is published for good (so a long answer costs linear time, not quadratic)."""

    def __init__(self) -> None:
        self.published = ""
        """The pieces given so far, joined."""
        self._done = 0
        """The characters of the text before the checkpoint; their scrubbed form is ``published[:_done_out]``."""
        self._done_out = 0

    def advance(self, text: str) -> str:
        """The next piece to publish of ``text`` (all the text so far); "" when nothing more is safe yet."""
        tail = text[self._done:]
        # As scrub does it, in two passes: the remembered values, then the patterns over what that left (a
        # value cut out can make a word boundary before "bearer"); each pass holds back its open tail.
        settled = tail[:_settled_end(tail, _secret_tail)]
        cut = _without_secrets(settled)
        scrubbed = _without_patterns(cut[:_settled_end(cut, _pattern_tail)])
        known = self.published[self._done_out:]
        if len(scrubbed) <= len(known) or not scrubbed.startswith(known):
            return ""  # a match reached back into what was published: wait; the step carries the whole
        piece = scrubbed[len(known):]
        self.published += piece
        self._checkpoint(settled, scrubbed)
        return piece

    def _checkpoint(self, settled: str, scrubbed: str) -> None:
        """Move the checkpoint to the last whitespace of ``settled`` when nothing scrub cuts can span it: no
        remembered value has whitespace, a URL password has none, and no ``bearer`` waits for its token there."""
        if _spaced:
            return
        at = max(settled.rfind(space) for space in " \t\n\r\f\v") + 1
        if at == 0:
            return
        out = scrub(settled[:at])
        if scrubbed.startswith(out) and _BEARER_HEAD_OPEN.search(out) is None:
            self._done += at
            self._done_out += len(out)


def _settled_end(text: str, open_tail: Callable[[str], int]) -> int:
    """Where ``text``'s settled part ends: nothing ``open_tail`` looks for can begin before it and end after it,
    whatever comes next. Found again within what is kept until it stays put: a cut inside a whole secret
    (another one that overlaps it may be starting) leaves that secret's start open too."""
    end = len(text)
    while (kept := open_tail(text[:end])) < end:
        end = kept
    return end


def _secret_tail(text: str) -> int:
    """Where the tail of ``text`` that could still become a remembered value begins (``len(text)``: none)."""
    end = len(text)
    for secret in _secrets:
        window = len(text) - min(len(secret) - 1, len(text))
        at = text.find(secret[0], window)
        while at != -1:  # the first place in the window where the rest of the text begins the secret
            if secret.startswith(text[at:]):
                end = min(end, at)
                break
            at = text.find(secret[0], at + 1)
    return end


def _pattern_tail(text: str) -> int:
    """Where the tail of ``text`` that could still become a bearer token or a URL password begins."""
    # Neither has whitespace in it: only the last run of text without any can still be one.
    run = max(text.rfind(space) for space in " \t\n\r\f\v") + 1
    if len(text) - run > _MAX_OPEN_RUN:
        return run  # too long to search cheaply: held whole until whitespace ends it
    openings = [(_BEARER_OPEN, max(0, len(text[:run].rstrip()) - len("bearer") - 1))]
    if "://" in text[run:]:
        openings.append((_URL_PASSWORD_OPEN, run))
    end = len(text)
    for pattern, start in openings:
        found = pattern.search(text, start)
        if found is not None:
            end = min(end, found.end("head"))
    return end


_MAX_OPEN_RUN: Final = 1024
"""The longest unbroken tail searched for an opening bearer token or URL password (each search is linear in it)."""


def strip_bidi(text: str) -> str:
    """``text`` without Unicode bidirectional controls, for caller-supplied text shown as attribution."""
    return _BIDI_CONTROLS.sub("", text)


def processor(_logger: Any, _method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """A structlog processor: scrub every string in the event's values (nested ones too), sparing nothing: log
    lines are the operator's, not the submitter's."""
    for key, value in event.items():
        if isinstance(value, str | Mapping | list | tuple):
            event[key] = scrub_value(value, spare=False)
    return event
