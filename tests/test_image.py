"""The image (deploy/Dockerfile), its pins (deploy/constraints.txt), .dockerignore and deploy/compose.yaml.

No Docker engine runs where the tests run, so the Dockerfile is checked by construction: its stages,
user, health check, what it copies and installs; hadolint lints it where hadolint is installed; and its
HEALTHCHECK command is run against a real worker's health endpoint.
"""

from __future__ import annotations

import fnmatch
import importlib.metadata
import platform
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable

import pytest
import yaml
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.deploy_helpers import (
    DOCKERFILE,
    REPO,
    Instruction,
    dockerfile_instructions,
    dockerfile_stages,
    settings_variables,
)
from tests.polling import poll_until
from tests.ports import free_port
from tests.worker_helpers import WorkerProcess

CONSTRAINTS = REPO / "deploy" / "constraints.txt"
DOCKERIGNORE = REPO / ".dockerignore"
COMPOSE = REPO / "deploy" / "compose.yaml"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)$")
_MAKE_LOCK = "run `make lock` (then `make setup`)"


def _stages() -> list[list[Instruction]]:
    return dockerfile_stages(dockerfile_instructions())


def _runtime() -> list[Instruction]:
    return _stages()[-1]


def _one(stage: list[Instruction], keyword: str) -> Instruction:
    found = [instruction for instruction in stage if instruction.keyword == keyword]
    assert found, f"no {keyword} in the stage starting at line {stage[0].line}"
    return found[-1]  # the last one is the one that counts


def _env(stage: list[Instruction]) -> dict[str, str]:
    values: dict[str, str] = {}
    for instruction in stage:
        if instruction.keyword == "ENV":
            values.update(dict(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=(\S+)", instruction.args)))
    return values


# -- the Dockerfile -------------------------------------------------------------------------------


def test_the_image_is_built_in_two_stages_from_the_same_base() -> None:
    stages = _stages()

    froms = [stage[0].args for stage in stages]
    assert froms == ["${PYTHON_IMAGE} AS build", "${PYTHON_IMAGE} AS runtime"]
    argument = next(i for i in dockerfile_instructions() if i.keyword == "ARG")
    assert re.fullmatch(r"PYTHON_IMAGE=python:3\.\d+-slim(-\w+)?", argument.args), argument


def test_the_build_stage_copies_everything_the_wheel_is_built_from() -> None:
    build = _stages()[0]
    copied = {source for i in build if i.keyword == "COPY" for source in i.args.split()[:-1]}
    setuptools = PYPROJECT["tool"]["setuptools"]

    needed = {"pyproject.toml", PYPROJECT["project"]["readme"], *setuptools["package-dir"].values()}
    missing = {path for path in needed if not any(path == c or path.startswith(f"{c}/") for c in copied)}
    assert not missing, f"the build stage does not copy {sorted(missing)}"  # a folder brings its subfolders
    assert any(i.keyword == "RUN" and "pip wheel" in i.args and "--no-deps" in i.args for i in build)


def test_the_runtime_stage_installs_the_wheel_with_the_pins_from_binary_wheels_only() -> None:
    runtime = _runtime()
    copies = [i.args.split() for i in runtime if i.keyword == "COPY"]
    assert copies == [["deploy/constraints.txt", "/opt/runbrake-constraints.txt"]], "the context gives only the pins"
    install = next(i for i in runtime if i.keyword == "RUN" and "pip install" in i.args)

    assert install.flags()["mount"] == "type=bind,from=build,source=/dist,target=/dist"
    assert "--constraint /opt/runbrake-constraints.txt" in install.args
    assert "--only-binary=:all:" in install.args
    assert "/dist/runbrake-*.whl" in install.args
    assert "python -m venv /opt/runbrake" in install.args
    assert _env(runtime)["PATH"].startswith("/opt/runbrake/bin:")


def test_the_runtime_stage_runs_as_a_numeric_non_root_user_it_creates() -> None:
    runtime = _runtime()
    user = _one(runtime, "USER").args

    uid, _, gid = user.partition(":")
    assert uid.isdigit(), "numeric, so that Kubernetes' runAsNonRoot can verify it"
    assert int(uid) != 0
    assert gid.isdigit()
    assert int(gid) != 0
    creates = " ".join(i.args for i in runtime if i.keyword == "RUN")
    assert f"--uid {uid}" in creates
    assert f"--gid {gid}" in creates
    assert runtime.index(_one(runtime, "USER")) > max(
        runtime.index(i) for i in runtime if i.keyword == "RUN"), "nothing runs as root after USER"


def test_the_health_check_asks_the_health_port_with_python_not_curl() -> None:
    runtime = _runtime()
    command = _one(runtime, "HEALTHCHECK").exec_form()

    assert command is not None
    assert command[:2] == ["python", "-c"]
    compile(command[2], "HEALTHCHECK", "exec")
    assert "RUNBRAKE_HEALTH_PORT" in command[2]
    assert "/healthz" in command[2]
    assert not any(tool in i.args for i in dockerfile_instructions() for tool in ("curl", "wget"))


def test_the_default_command_is_the_worker_and_its_ports_are_exposed() -> None:
    runtime = _runtime()
    env = _env(runtime)

    assert _one(runtime, "CMD").exec_form() == ["runbrake", "worker"]
    assert _one(runtime, "STOPSIGNAL").args == "SIGTERM"
    exposed = set(_one(runtime, "EXPOSE").args.split())
    assert {env["RUNBRAKE_HEALTH_PORT"], env["RUNBRAKE_METRICS_PORT"], "8080"} <= exposed
    assert {name for name in env if name.startswith("RUNBRAKE_")} <= settings_variables()


def test_hadolint_finds_nothing_in_the_dockerfile() -> None:
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(REPO / ".venv" / "bin"))
    if hadolint is None:
        pytest.skip("hadolint is not installed here (the dev extra installs it on Linux x86_64 only)")

    linted = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60, check=False)

    assert linted.returncode == 0, linted.stdout + linted.stderr


@pytest.mark.integration
def test_the_health_check_command_passes_against_a_live_worker_and_fails_without_one(
    start_worker: Callable[..., WorkerProcess],
) -> None:
    code = _one(_runtime(), "HEALTHCHECK").exec_form()[2]  # type: ignore[index]
    port = free_port()
    worker = start_worker(RUNBRAKE_HEALTH_PORT=str(port))
    worker.wait_for_log("health_serving", port=port)

    def check(health_port: int) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", code], env={"RUNBRAKE_HEALTH_PORT": str(health_port)},
                              capture_output=True, text=True, timeout=30, check=False)

    healthy = poll_until(lambda: (done := check(port)).returncode == 0 and done, timeout=20,
                         failure=lambda: f"the HEALTHCHECK command never passed: {check(port).stderr[-500:]}")
    unhealthy = check(free_port())

    assert healthy.returncode == 0
    assert unhealthy.returncode != 0
    assert "Connection refused" in unhealthy.stderr


# -- the pins -------------------------------------------------------------------------------------


def _pins() -> dict[str, tuple[str, str]]:
    """Canonical name → (name as written, version), from deploy/constraints.txt."""
    pins: dict[str, tuple[str, str]] = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        match = _PIN.match(line.strip())
        assert match, f"{CONSTRAINTS.name}: not a name==version pin: {line!r}"
        pins[canonicalize_name(match.group(1))] = (match.group(1), match.group(2))
    return pins


def _runtime_closure() -> dict[str, str]:
    """Canonical name → installed version of every distribution runbrake needs at run time (its
    [project].dependencies and its ``otel`` extra, which the image installs too, their extras, and theirs),
    read from the installed metadata."""
    closure: dict[str, str] = {}
    pending: list[tuple[str, frozenset[str]]] = [("runbrake", frozenset({"otel"}))]
    seen: set[tuple[str, frozenset[str]]] = set()
    while pending:
        name, extras = pending.pop()
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        for text in importlib.metadata.requires(name) or []:
            requirement = Requirement(text)
            if requirement.marker is not None and not any(
                requirement.marker.evaluate({**default_environment(), "extra": extra}) for extra in extras | {""}
            ):
                continue
            dependency = canonicalize_name(requirement.name)
            closure[dependency] = importlib.metadata.version(dependency)
            pending.append((dependency, frozenset(requirement.extras)))
    return closure


def test_every_dependency_in_pyproject_is_pinned_to_a_version_it_allows() -> None:
    pins = _pins()

    problems = []
    for text in PYPROJECT["project"]["dependencies"]:
        requirement = Requirement(text)
        pin = pins.get(canonicalize_name(requirement.name))
        if pin is None:
            problems.append(f"{requirement.name}: not pinned")
        elif not requirement.specifier.contains(pin[1], prereleases=True):
            problems.append(f"{requirement.name}: pinned {pin[1]}, pyproject asks {requirement.specifier}")

    assert problems == [], f"deploy/constraints.txt is out of date with pyproject.toml; {_MAKE_LOCK}: {problems}"


def test_the_pins_cover_what_runbrake_needs_and_the_venv_has_exactly_the_pinned_versions() -> None:
    pins = _pins()
    closure = _runtime_closure()

    unpinned = sorted(set(closure) - set(pins))
    assert unpinned == [], f"needed at run time but not pinned; {_MAKE_LOCK}: {unpinned}"
    differing = {name: (version, pins[name][1]) for name, version in closure.items() if version != pins[name][1]}
    assert differing == {}, f"installed ≠ pinned (the venv is older than the pins? run `make setup`): {differing}"
    assert "runbrake" not in pins


def test_the_pins_were_made_by_make_lock_with_the_image_python_and_nothing_else_is_pinned() -> None:
    header = next(line for line in CONSTRAINTS.read_text().splitlines() if line.startswith("# python: "))
    version, system, _machine = header.removeprefix("# python: ").split()
    image_python = re.search(r"python:(\d+\.\d+)", _one(_stages()[0], "FROM").args + DOCKERFILE.read_text())

    assert image_python is not None
    assert Version(version).release[:2] == Version(image_python.group(1)).release[:2], (
        f"the pins were made with Python {version}, the image runs {image_python.group(1)}")
    assert SpecifierSet(PYPROJECT["project"]["requires-python"]).contains(version)
    assert system == "linux"
    same_platform = sys.platform == "linux" and platform.python_version_tuple()[:2] == tuple(version.split(".")[:2])
    if not same_platform:
        pytest.skip("stale pins are looked for on Linux with the pins' Python only (markers differ elsewhere)")
    stale = sorted(set(_pins()) - set(_runtime_closure()))
    assert stale == [], f"pinned but no longer needed; {_MAKE_LOCK}: {stale}"


# -- .dockerignore --------------------------------------------------------------------------------


def _ignore_patterns() -> list[str]:
    return [line.strip() for line in DOCKERIGNORE.read_text().splitlines() if line.strip() and not line.startswith("#")]


def _ignored(path: str, patterns: list[str]) -> bool:
    """Whether the build context leaves ``path`` out (Docker's rules for the patterns used here: a
    pattern matches the path or one of its parent folders; ``**/`` matches at any depth)."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    result = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        bare = pattern.removeprefix("!").rstrip("/")
        candidates = [bare, bare.removeprefix("**/")] if bare.startswith("**/") else [bare]
        hit = any(
            fnmatch.fnmatchcase(prefix, candidate) or fnmatch.fnmatchcase(prefix.split("/")[-1], candidate)
            if candidate != bare else fnmatch.fnmatchcase(prefix, candidate)
            for prefix in prefixes for candidate in candidates
        )
        if hit:
            result = not negate
    return result


def test_the_dockerignore_leaves_out_local_state_and_keeps_what_the_build_copies() -> None:
    patterns = _ignore_patterns()
    copied = [
        source for i in dockerfile_instructions() if i.keyword == "COPY" and "--from" not in i.args
        for source in i.args.split()[:-1]
    ]

    for path in (".venv/bin/python", "build/lib/x.py", ".git/HEAD", "tests/artifacts/a.json", "bench/results/r.json",
                 ".mypy_cache/x", ".ruff_cache/x", ".pytest_cache/x", "worker/__pycache__/health.cpython-311.pyc",
                 "dist/runbrake-0.1.0.whl", "runbrake.egg-info/PKG-INFO"):
        assert _ignored(path, patterns), f".dockerignore does not leave out {path}"
    kept = {source: _ignored(source, patterns) for source in copied}
    assert not any(kept.values()), f"the Dockerfile copies what .dockerignore leaves out: {kept}"


# -- deploy/compose.yaml --------------------------------------------------------------------------


def test_compose_runs_redis_with_an_append_only_file_on_a_volume() -> None:
    redis = yaml.safe_load(COMPOSE.read_text())["services"]["redis"]
    command = " ".join(redis["command"])

    assert "--appendonly yes" in command
    assert "--appendfsync everysec" in command
    directory = re.search(r"--dir (\S+)", command)
    assert directory is not None
    assert any(volume.split(":")[1] == directory.group(1) for volume in redis["volumes"])


def test_compose_health_checks_ask_the_ports_the_settings_name_and_outlast_the_drain() -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    worker, api = services["worker"], services["api"]

    health_port = worker["environment"]["RUNBRAKE_HEALTH_PORT"]
    assert f"127.0.0.1:{health_port}/healthz" in " ".join(worker["healthcheck"]["test"])
    assert int(worker["stop_grace_period"].removesuffix("s")) > int(worker["environment"]["RUNBRAKE_DRAIN_S"])
    api_port = api["command"][api["command"].index("--port") + 1]
    assert f"127.0.0.1:{api_port}/healthz" in " ".join(api["healthcheck"]["test"])
    used = {name for service in services.values() for name in service.get("environment", {})}
    assert {name for name in used if name.startswith("RUNBRAKE_")} <= settings_variables()
