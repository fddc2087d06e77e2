"""Bearer tokens of the HTTP API (docs/http-api.md, "Tokens").

``RUNBRAKE_API_TOKENS`` names a TOML file of tokens. Each entry stores the SHA-256 of a token,
never the token, and the roles it grants::

    [tokens.ci-deploy]
    sha256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    roles = ["read", "submit"]

``read`` allows the GET endpoints, ``submit`` POST /v1/runs, ``operate`` cancel, approve and deny.
A presented token is hashed and compared with every entry in constant time
(``hmac.compare_digest``); the entry's name is who the API records as having cancelled or decided.

An entry with ``tenant = "NAME"`` is a tenant's token (docs/http-api.md, "Tenants and quotas"): the runs it
enqueues carry the label ``tenant=NAME``, and it reaches only those; any other run is answered as missing.
An entry without one is an operator's, which reaches every run.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from runbrake.shared.errors import RunbrakeError
from runbrake.shared.spec import LABEL_KEY

ROLES: Final = ("read", "submit", "operate")
_HEX64: Final = re.compile(r"[0-9a-f]{64}")
_NAME: Final = re.compile(r"[A-Za-z0-9_.@-]{1,64}")


class TokensFileError(RunbrakeError):
    """Raised when the tokens file cannot be read or says something unusable; the message names it."""


@dataclass(frozen=True, slots=True)
class Token:
    """One entry of the tokens file: who (``name``), the token's SHA-256 (hex) and its roles."""

    name: str
    sha256: str
    roles: frozenset[str]
    tenant: str | None = None
    """The tenant whose runs alone this token reaches; None: an operator's token, every run."""


def digest(token: str) -> str:
    """The SHA-256 of a token, as the tokens file stores it (lowercase hex)."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


class Tokens:
    """The API's tokens, looked up by the token a request presents."""

    def __init__(self, tokens: tuple[Token, ...]) -> None:
        if not tokens:
            raise TokensFileError("the tokens file has no [tokens.NAME] entry")
        self._tokens = tokens

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(token.name for token in self._tokens)

    def identify(self, presented: str) -> Token | None:
        """The entry whose hash matches ``presented``, compared with every entry in constant time."""
        candidate = digest(presented)
        found: Token | None = None
        for token in self._tokens:  # no early exit: each comparison costs the same, match or not
            if hmac.compare_digest(candidate, token.sha256):
                found = token
        return found

    @classmethod
    def load(cls, path: str | Path) -> Tokens:
        """Read a tokens file.

        Raises:
            TokensFileError: naming the file and what is wrong (unreadable, not TOML, no entries, an entry
                without a 64-hex-character sha256, an unknown role, an unusable name).
        """
        where = str(path)
        try:
            data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise TokensFileError(f"{where}: cannot read it: {exc.strerror or exc}") from exc
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise TokensFileError(f"{where}: not valid TOML: {exc}") from exc
        unknown = sorted(set(data) - {"tokens"})
        if unknown:
            raise TokensFileError(f"{where}: unknown top-level key(s) {', '.join(unknown)}; use [tokens.NAME]")
        table = data.get("tokens")
        if not isinstance(table, dict) or not table:
            raise TokensFileError(f"{where}: no [tokens.NAME] entry")
        tokens: list[Token] = []
        for name, entry in table.items():
            at = f"{where}: [tokens.{name}]"
            if not _NAME.fullmatch(name):
                raise TokensFileError(f"{at}: a name is 1 to 64 letters, digits, '.', '_', '@' or '-'")
            if not isinstance(entry, dict):
                raise TokensFileError(f"{at}: must be a table with sha256 and roles")
            extra = sorted(set(entry) - {"sha256", "roles", "tenant"})
            if extra:
                raise TokensFileError(f"{at}: unknown key(s) {', '.join(extra)}")
            sha = entry.get("sha256")
            if not isinstance(sha, str) or not _HEX64.fullmatch(sha.lower()):
                raise TokensFileError(f"{at}: sha256 must be the token's SHA-256 as 64 hex characters")
            roles = entry.get("roles")
            if not isinstance(roles, list) or not roles or not all(isinstance(r, str) for r in roles):
                raise TokensFileError(f"{at}: roles must be a non-empty list of {', '.join(ROLES)}")
            wrong = sorted(set(roles) - set(ROLES))
            if wrong:
                raise TokensFileError(f"{at}: unknown role(s) {', '.join(wrong)}; roles are {', '.join(ROLES)}")
            if any(token.sha256 == sha.lower() for token in tokens):
                raise TokensFileError(f"{at}: another entry has the same sha256 (one token, one name)")
            tenant = entry.get("tenant")
            if tenant is not None and (not isinstance(tenant, str) or not LABEL_KEY.fullmatch(tenant)):
                raise TokensFileError(f"{at}: tenant is 1 to 63 of a-z, 0-9, '_', '.', '-' (a label's rules)")
            tokens.append(Token(name=name, sha256=sha.lower(), roles=frozenset(roles), tenant=tenant))
        return cls(tuple(tokens))
