"""The tree drawn at the top of shared/errors.py is the tree the code has: every exception class defined in a
runbrake module is drawn, under its real parent, and every public one is a RunbrakeError or a control-flow
signal (a BaseException that is not an Exception)."""

from __future__ import annotations

import builtins
import importlib
import inspect
import pkgutil
import re
from types import ModuleType

import pytest

import runbrake.shared.errors
from runbrake.shared.errors import RunbrakeError, ToolArgumentsRefused, ToolCallCancelled, ToolTransportError

PACKAGES = ("runbrake.shared", "runbrake.broker", "runbrake.worker")
NODE = re.compile(r"^(?P<indent>[ │├└─]*)(?P<name>[A-Z_][A-Za-z0-9_]*)\b")
"""A line of the drawing: the box-drawing prefix (its length is the depth) and the class's name (a line that
goes on with lowercase words is the previous one's description)."""


def modules() -> list[ModuleType]:
    found = []
    for name in PACKAGES:
        package = importlib.import_module(name)
        found.append(package)
        for info in pkgutil.walk_packages(package.__path__, prefix=f"{name}."):
            if info.name.endswith(".__main__"):
                continue  # python -m runbrake.worker: an entry point, not a module with classes
            found.append(importlib.import_module(info.name))
    return found


def defined_exceptions() -> dict[str, type[BaseException]]:
    """Every exception class defined (not imported) at the top level of a runbrake module, by name."""
    classes: dict[str, type[BaseException]] = {}
    for module in modules():
        for name, value in vars(module).items():
            if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == module.__name__:
                assert name not in classes or classes[name] is value, f"two exception classes named {name}"
                classes[name] = value
    return classes


def drawn_tree() -> dict[str, str | None]:
    """The drawing in shared/errors.py's docstring: each drawn name and the name drawn as its parent (None
    for a root)."""
    doc = runbrake.shared.errors.__doc__ or ""
    drawing = doc.split("\n\n")[1:]
    parents: dict[str, str | None] = {}
    for block in drawing:
        lines = [line[4:] for line in block.splitlines() if line.startswith("    ")]
        if not lines or not lines[0][:1].isalpha():
            continue  # prose, not a drawn block
        stack: list[tuple[int, str]] = []
        for line in lines:
            match = NODE.match(line)
            if match is None or not match["name"]:
                continue
            depth = len(match["indent"])
            while stack and stack[-1][0] >= depth:
                stack.pop()
            name = match["name"]
            assert name not in parents, f"{name} is drawn twice"
            parents[name] = stack[-1][1] if stack else None
            stack.append((depth, name))
    return parents


def test_the_drawing_has_the_roots_it_is_meant_to_have() -> None:
    roots = {name for name, parent in drawn_tree().items() if parent is None}

    assert roots == {"RunbrakeError", "BaseException", "Exception"}


@pytest.mark.parametrize("name", sorted(defined_exceptions()))
def test_every_exception_class_of_runbrake_is_drawn_under_its_parent(name: str) -> None:
    cls = defined_exceptions()[name]
    tree = drawn_tree()

    assert name in tree, f"{name} ({cls.__module__}) is missing from the tree in shared/errors.py"
    if cls is RunbrakeError:
        assert tree[name] is None, "RunbrakeError is the root of the tree"
        return
    # The first base is the one the tree shows; a second (ValueError) is said in the line's words.
    assert tree[name] == cls.__bases__[0].__name__, f"{name} is drawn under {tree[name]}, derives from " \
                                                   f"{cls.__bases__[0].__name__}"


def test_every_drawn_name_is_a_class_of_runbrake_or_a_builtin_one() -> None:
    classes = defined_exceptions()
    tree = drawn_tree()

    stale = [name for name in tree if name not in classes and not hasattr(builtins, name)]

    assert stale == [], f"drawn in shared/errors.py but defined nowhere: {stale}"


@pytest.mark.parametrize("name", sorted(n for n in defined_exceptions() if not n.startswith("_")))
def test_every_public_exception_is_a_runbrake_error_or_a_control_flow_signal(name: str) -> None:
    cls = defined_exceptions()[name]

    signal = not issubclass(cls, Exception)  # like Dramatiq's Interrupt: no `except Exception` swallows it
    assert issubclass(cls, RunbrakeError) or signal, f"{name} escapes RunbrakeError"


def test_there_is_one_api_error_for_the_api_and_its_client() -> None:
    from runbrake.broker import api, client
    from runbrake.shared.errors import ApiError

    assert client.ApiError is ApiError
    assert api.ApiError is ApiError
    assert [n for n, cls in defined_exceptions().items() if n == "ApiError"] == ["ApiError"]


def test_the_transport_errors_kind_is_its_type_and_the_flags_derive_from_it() -> None:
    """DESIGN's ``for_cancelled_call`` / ``is_cancellation`` still read true, now derived from the subclass."""
    cancelled = ToolTransportError.for_cancelled_call(server="calc", tool="slow")
    refused = ToolArgumentsRefused("bad arguments", server="calc", tool="get-sum")
    failed = ToolTransportError("server went away", server="calc", tool="get-sum")

    assert isinstance(cancelled, ToolCallCancelled)
    assert (cancelled.is_cancellation, cancelled.is_invalid_arguments) == (True, False)
    assert (refused.is_cancellation, refused.is_invalid_arguments) == (False, True)
    assert (failed.is_cancellation, failed.is_invalid_arguments) == (False, False)
