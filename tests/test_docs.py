"""The docs a newcomer reads: the README stays a guide, the configuration reference is the settings
model's, and every citation of a page and heading in the repository names a heading that exists
(docs/development.md, "Development"; the MkDocs build itself, ``make docs``, checks links and anchors)."""

from __future__ import annotations

import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

from runbrake.shared._settings_doc import configuration_markdown

REPO = Path(__file__).resolve().parents[1]

README_LIMIT = 12 * 1024

# `README.md, "Heading"` or `docs/NAME.md, "Heading"` (or 'Heading'); the quote (possibly escaped, inside
# JSON) may start or go on on the next line of a comment (`#`, `//`).
CITATION = re.compile(
    r"""(README\.md|docs/[\w.-]+\.md),\s*(?:(?:#|//)\s*)?"""
    r"""(?:\\?"([^"\\\s][^"\\]{0,99})\\?"|'([^'\\\s][^'\\]{0,99})')"""
)
LINE_BREAK = re.compile(r"\s*\n\s*(?:#|//)?\s*")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$")

# History describes the pages as they were when it was written; this file's citations are examples.
NOT_CHECKED = {"CHANGELOG.md", "tests/test_docs.py"}


def test_the_readme_is_a_guide_of_at_most_12_kb() -> None:
    assert len((REPO / "README.md").read_bytes()) <= README_LIMIT


def test_the_readme_starts_with_the_two_commands() -> None:
    first_block = (REPO / "README.md").read_text(encoding="utf-8").split("```")[1]

    assert [line.split()[:2] for line in first_block.splitlines() if line.startswith("make")] == [
        ["make", "demo"],
        ["make", "test"],
    ]


def test_the_configuration_reference_is_generated_from_the_settings() -> None:
    committed = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")

    assert committed == configuration_markdown(), (
        "docs/configuration.md is out of date with shared/settings.py: run `make configuration`"
    )


def test_every_docs_page_is_in_the_mkdocs_nav() -> None:
    nav = (REPO / "mkdocs.yml").read_text(encoding="utf-8")
    pages = sorted(path.name for path in (REPO / "docs").glob("*.md"))

    assert [page for page in pages if f": {page}" not in nav] == []


@cache
def headings(page: str) -> frozenset[str]:
    """The headings of a Markdown file as text, outside fenced code blocks."""
    found: set[str] = set()
    fenced = False
    for line in (REPO / page).read_text(encoding="utf-8").splitlines():
        if line.startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced and (match := HEADING.match(line)):
            found.add(match.group(1))
    return frozenset(found)


def citations() -> list[tuple[str, str, str]]:
    """(file citing, page, heading) for every citation in the repository's tracked text files."""
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    found = []
    for name in tracked:
        if name in NOT_CHECKED:
            continue
        try:
            text = (REPO / name).read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError):
            continue  # a picture, or a file deleted but not yet committed
        found.extend(
            (name, page, LINE_BREAK.sub(" ", double or single).strip())
            for page, double, single in CITATION.findall(text)
        )
    return found


def test_the_repository_cites_pages_and_headings() -> None:
    """The pattern finds the citations this test is for (a broken pattern would pass everything)."""
    cited = {(page, heading) for _, page, heading in citations()}

    assert ("docs/leases.md", "Capacity: runs in flight") in cited
    assert len(cited) > 30


def test_every_cited_heading_exists() -> None:
    broken = [
        f"{source}: {page}, {heading!r}"
        for source, page, heading in citations()
        if not heading.startswith("<") and (not (REPO / page).is_file() or heading not in headings(page))
    ]

    assert broken == []


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('(docs/architecture.md, "Leases")', [("docs/architecture.md", "Leases")]),
        ('README.md,\n# "Using it"', [("README.md", "Using it")]),
        ('Metrics: README.md, \\"Operating\\".', [("README.md", "Operating")]),
        ('docs/a.md, "Two\n    # lines"', [("docs/a.md", "Two\n    # lines")]),
        ("(docs/m.md, 'Dead letters')", [("docs/m.md", "Dead letters")]),
        ('docs/a.md, "Pitfalls: Dramatiq\'s time limit"', [("docs/a.md", "Pitfalls: Dramatiq's time limit")]),
        ("docs/security.md has the whole of it", []),
    ],
)
def test_a_citation_is_found_in_each_form_the_repository_writes(text: str, expected: list[tuple[str, str]]) -> None:
    assert [(page, double or single) for page, double, single in CITATION.findall(text)] == expected
