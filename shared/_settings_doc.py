"""The configuration reference, docs/configuration.md, generated from the fields of ``Settings``.

``python -m runbrake.shared._settings_doc > docs/configuration.md`` (``make configuration``) writes it;
tests/test_docs.py checks that the committed page is what this prints.
"""

from __future__ import annotations

import dataclasses
import sys

from runbrake.shared.settings import Settings, check_of, descriptions

_PREAMBLE = """\
# Configuration

<!-- Generated from the fields of `Settings` in shared/settings.py by
     `python -m runbrake.shared._settings_doc > docs/configuration.md`; edit the fields, not this
     page (tests/test_docs.py checks that the two agree). -->

Every process (`runbrake worker`, `runbrake serve`, the other commands) reads these variables once, when it
starts. An unset variable keeps its default; so does an empty one, except for the two service URLs and the
namespace. A value that cannot be used stops the command with exit code 2 and a message that names the
variable (`RUNBRAKE_LEASE_S: must be from 5 to 1000000000, got 2`); nothing is written or sent.

| variable | default | accepts | meaning |
| --- | --- | --- | --- |
"""


def _default(value: object) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def configuration_markdown() -> str:
    """The configuration reference: one row per field of :class:`Settings`, in declaration order."""
    documented = descriptions()
    rows = [
        f"| `{Settings.variables[field.name]}` | {_default(field.default)} | {_cell(check_of(field.name).accepts)} "
        f"| {_cell(documented.get(field.name, ''))} |\n"
        for field in dataclasses.fields(Settings)
    ]
    return _PREAMBLE + "".join(rows)


if __name__ == "__main__":
    sys.stdout.write(configuration_markdown())
