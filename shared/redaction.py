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

Text a caller supplies as attribution (a cancel's reason and who asked, an approval's decider and
reason) is also stripped of Unicode bidirectional controls (:func:`strip_bidi`), which would let it
reorder the "by …" shown after it (docs/security.md, "Tested attacks").
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Mapping, MutableMapping
from typing import Any, Final

REDACTED: Final = "[redacted]"
_MIN_SECRET_CHARS: Final = 6
"""Shorter values are not remembered: replacing every "abc" in every log line would hide more than it saves."""

_URL_PASSWORD: Final = re.compile(r"(?P<head>\b[a-z][a-z0-9+.-]*://[^:/@\s]*:)[^@\s/]+@")
_BEARER: Final = re.compile(r"(?P<head>\bbearer\s+)[A-Za-z0-9._~+/=-]{6,}", re.IGNORECASE)
"""An HTTP bearer credential (RFC 6750's b64token) wherever it appears: ``Authorization: Bearer …``,
``auth=Bearer …``. Six characters at least, as for remembered values: "bearer of" is prose."""

_BIDI_CONTROLS: Final = re.compile("[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
"""Unicode's bidirectional formatting characters (UAX #9): ALM, LRM, RLM, the embeddings and overrides
LRE RLE PDF LRO RLO, and the isolates LRI RLI FSI PDI."""

_lock = threading.Lock()
_secrets: tuple[str, ...] = ()
"""The remembered values, longest first: a value that contains another is cut whole."""


def remember(*values: str) -> None:
    """Treat these values as secrets from now on in this process."""
    global _secrets  # noqa: PLW0603 - one set per process, read without a lock (replaced, never mutated)
    fresh = {value for value in values if len(value) >= _MIN_SECRET_CHARS} - set(_secrets)
    if fresh:
        with _lock:
            _secrets = tuple(sorted(set(_secrets) | fresh, key=len, reverse=True))


def scrub(text: str) -> str:
    """``text`` without known secret values, bearer tokens, and the password of any URL in it."""
    for secret in _secrets:
        if secret in text:
            text = text.replace(secret, REDACTED)
    if "://" in text:
        text = _URL_PASSWORD.sub(rf"\g<head>{REDACTED}@", text)
    return _BEARER.sub(rf"\g<head>{REDACTED}", text)


def scrub_value(value: Any) -> Any:
    """A JSON value (or a ``str``) safe to write anywhere: :func:`scrub` applied to every string in it,
    mapping keys included, and a non-finite number spelled as the string JSON has no token for (``"NaN"``,
    ``"Infinity"``, ``"-Infinity"``), so that no reader's JSON parser can choke on it.

    Tuples come back as lists, as JSON would have them; other values are returned as they are.
    """
    if isinstance(value, str):
        return scrub(value)
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, Mapping):
        return {scrub(str(key)): scrub_value(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [scrub_value(item) for item in value]
    return value


def strip_bidi(text: str) -> str:
    """``text`` without Unicode bidirectional controls, for caller-supplied text shown as attribution."""
    return _BIDI_CONTROLS.sub("", text)


def processor(_logger: Any, _method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """A structlog processor: scrub every string in the event's values (nested ones too)."""
    for key, value in event.items():
        if isinstance(value, str | Mapping | list | tuple):
            event[key] = scrub_value(value)
    return event
