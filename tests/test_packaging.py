"""The package: one import namespace (``runbrake``), every import declared, and a wheel that carries
what ``runbrake demo`` needs."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE_FOLDERS = ("shared", "broker", "worker")

# Import names that differ from the distribution that provides them.
_DISTRIBUTION_OF = {"mcp_types": "mcp-types", "prometheus_client": "prometheus-client", "dramatiq": "dramatiq"}


_OPTIONAL_MODULES = {"otel": {"shared/_otel.py", "worker/tracing.py"}}
"""The modules an extra's imports may appear in: each is imported only when its feature is on
(RUNBRAKE_OTEL=true; tests/test_tracing.py checks that nothing of it is imported when off)."""


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\[<>=!~ ;]", requirement, maxsplit=1)[0].lower() for requirement in requirements}


def _declared(path: str | None = None) -> set[str]:
    """The distributions declared for the package; for ``path``, also those of the extras it belongs to."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = _names(project["dependencies"])
    for extra, paths in _OPTIONAL_MODULES.items():
        if path in paths:
            names |= _names(project["optional-dependencies"][extra])
    return names


def _imported_third_party() -> dict[str, set[str]]:
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    found: dict[str, set[str]] = {}
    for folder in PACKAGE_FOLDERS:
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    modules = [node.module]
                else:
                    continue
                for module in modules:
                    top = module.split(".")[0]
                    if top not in stdlib and top != "runbrake":
                        found.setdefault(top, set()).add(str(path.relative_to(REPO)))
    return found


def test_every_third_party_module_the_package_imports_is_a_declared_dependency() -> None:
    undeclared = {
        module: undeclared_in for module, paths in _imported_third_party().items()
        if (undeclared_in := sorted(path for path in paths if not _provided(module, _declared(path))))
    }

    assert undeclared == {}


def _provided(module: str, declared: set[str]) -> bool:
    distribution = _DISTRIBUTION_OF.get(module, module).lower().replace("_", "-")
    # opentelemetry's packages are namespaced: opentelemetry-sdk, opentelemetry-exporter-otlp-proto-http, …
    return distribution in declared or (
        distribution == "opentelemetry" and any(name.startswith("opentelemetry-") for name in declared))


def test_the_package_imports_itself_only_under_the_runbrake_namespace() -> None:
    bare = []
    for folder in PACKAGE_FOLDERS:
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    if node.module.split(".")[0] in PACKAGE_FOLDERS:
                        bare.append(f"{path.relative_to(REPO)}:{node.lineno}")
                elif isinstance(node, ast.Import):
                    bare += [f"{path.relative_to(REPO)}:{node.lineno}" for alias in node.names
                             if alias.name.split(".")[0] in PACKAGE_FOLDERS]

    assert bare == []


@pytest.mark.integration
def test_the_wheel_has_one_top_level_package_and_ships_the_example_server(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(tmp_path), str(REPO)],
        check=True, capture_output=True, timeout=300,
    )
    [wheel] = tmp_path.glob("runbrake-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        [top_level] = [n for n in names if n.endswith(".dist-info/top_level.txt")]
        tops = archive.read(top_level).decode().split()
        entry_points = archive.read(top_level.replace("top_level.txt", "entry_points.txt")).decode()

    assert tops == ["runbrake"]
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"runbrake"}
    assert "runbrake/broker/toolbox_server.py" in names
    assert "runbrake/shared/messaging/wire.py" in names, "the RabbitMQ contract's subpackage is shipped"
    assert {"runbrake/shared/py.typed", "runbrake/broker/py.typed", "runbrake/worker/py.typed"} <= set(names)
    assert "runbrake = runbrake.broker.cli:main" in entry_points
