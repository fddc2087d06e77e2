"""What the deployment files are checked against: the settings the code reads, and the Dockerfile's instructions.

The code is the reference: a variable is a setting when it is a field of ``Settings`` (shared/settings.py),
whatever a manifest or a docs page says.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from runbrake.shared import Settings

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "deploy" / "Dockerfile"


def settings_variables() -> frozenset[str]:
    """Every ``RUNBRAKE_*`` name ``Settings.from_env`` reads: one per field of the settings model."""
    return frozenset(Settings.variables.values())


@dataclass(frozen=True, slots=True)
class Instruction:
    """One Dockerfile instruction: its keyword (upper case), its arguments as written, and its first line."""

    keyword: str
    args: str
    line: int

    def exec_form(self) -> list[str] | None:
        """The JSON array of an exec-form CMD/ENTRYPOINT/HEALTHCHECK CMD, or None for the shell form."""
        text = self.args
        if self.keyword == "HEALTHCHECK":
            text = re.sub(r"^(--\S+\s+)*CMD\s+", "", text)
        if not text.startswith("["):
            return None
        parsed: list[str] = json.loads(text)
        return parsed

    def flags(self) -> dict[str, str]:
        """Leading ``--name=value`` flags (COPY --from=…, RUN --mount=…, HEALTHCHECK --interval=…)."""
        found = {}
        for match in re.finditer(r"(?:^|\s)--([a-z-]+)=(\S+)", self.args):
            found[match.group(1)] = match.group(2)
        return found


def dockerfile_instructions(path: Path = DOCKERFILE) -> list[Instruction]:
    """The instructions of a Dockerfile: line continuations joined, comments and blank lines dropped (a
    comment line inside a continued instruction too, as BuildKit does)."""
    instructions: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        text = " ".join(part for part in pending if part)
        pending = []
        keyword, _, args = text.partition(" ")
        instructions.append(Instruction(keyword.upper(), args.strip(), start))
    assert not pending, f"{path}: the last instruction ends with a line continuation"
    return instructions


def dockerfile_stages(instructions: list[Instruction]) -> list[list[Instruction]]:
    """The instructions split into build stages, each starting with its FROM."""
    stages: list[list[Instruction]] = []
    for instruction in instructions:
        if instruction.keyword == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(instruction)
    return stages
