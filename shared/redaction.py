"""The second line of defence for secrets: known secret values and URL passwords are cut out of every
log line and every text the store writes (docs/security.md).

The first line is that secrets never travel: header values, stdio env values and API keys are
expanded from the worker's environment only when used (``shared/catalog.py`` :func:`expand`).
Each value expanded there is remembered here, so a server or provider that echoes it back in
an error or a result does not get it into Redis or the logs.
"""

from __future__ import annotations

import re
import threading
from collections.abc import MutableMapping
from typing import Any, Final

REDACTED: Final = "[redacted]"
_MIN_SECRET_CHARS: Final = 6
"""Shorter values are not remembered: replacing every "abc" in every log line would hide more than it saves."""

_URL_PASSWORD: Final = re.compile(r"(?P<head>\b[a-z][a-z0-9+.-]*://[^:/@\s]*:)[^@\s/]+@")

_lock = threading.Lock()
_secrets: frozenset[str] = frozenset()


def remember(*values: str) -> None:
    """Treat these values as secrets from now on in this process."""
    global _secrets  # noqa: PLW0603 - one set per process, read without a lock (replaced, never mutated)
    fresh = {value for value in values if len(value) >= _MIN_SECRET_CHARS} - _secrets
    if fresh:
        with _lock:
            _secrets = _secrets | fresh


def scrub(text: str) -> str:
    """``text`` without known secret values and without the password of any URL in it."""
    for secret in _secrets:
        if secret in text:
            text = text.replace(secret, REDACTED)
    if "://" in text:
        text = _URL_PASSWORD.sub(rf"\g<head>{REDACTED}@", text)
    return text


def processor(_logger: Any, _method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """A structlog processor: scrub every string value of the event."""
    for key, value in event.items():
        if isinstance(value, str):
            event[key] = scrub(value)
        elif isinstance(value, list | tuple):
            event[key] = [scrub(v) if isinstance(v, str) else v for v in value]
    return event
