"""A user's JSON Schema, and an answer against it, checked in a child process within a bound of wall clock.

jsonschema is pure Python and ``re`` holds the GIL for a whole match: ``{"pattern": "^(a+)+$"}`` against a
31-character answer held a worker's whole process 116 s, ``uniqueItems`` over 4,000 objects 33 s, and
``check_schema`` of a 450 KB ``allOf`` held ``serve`` 50 s (issue 27). So no such check runs in a process that
serves others: each goes over a pipe to a child (``python shared/_schema_child.py``), one check at a
time per child, and a child that has not answered within ``RUNBRAKE_SCHEMA_CHECK_S`` is killed and its check
answered with a problem that says so (docs/security.md, "Bounds"). The caller waits on a pipe, never on the
GIL; :meth:`SchemaChecks.answer_problem_async` waits on a thread of its own, off the event loop.

Children start on first use (their start is bounded apart, ``START_S``, and not counted in the check's bound)
and :data:`IDLE_CHILDREN` of them are kept for the next checks; a busy pool starts another, so as many checks run
at once as their callers make (the API's thread pool, the run-request consumer, a worker's runs in flight).
"""

from __future__ import annotations

import asyncio
import atexit
import hashlib
import json
import math
import os
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypeVar

__all__ = ["IDLE_CHILDREN", "SCHEMA_CHECKS", "START_S", "SchemaChecks"]

START_S: Final = 30.0
"""How long a child may take to start (import jsonschema) on a loaded machine before the check is given up."""
IDLE_CHILDREN: Final = 2
"""Children kept waiting for the next check."""
_WAITING_THREADS: Final = 32
"""Threads :meth:`SchemaChecks.off_loop` waits on (each on a child's pipe)."""
_POLL_S: Final = 0.1
"""How often a wait on a child looks whether its caller gave up (:meth:`SchemaChecks.answer_problem_async`)."""
_COMMAND: Final = (sys.executable, "-P", str(Path(__file__).with_name("_schema_child.py")))
"""The child's file run as a script, not as ``-m runbrake.shared._schema_child``: that would import the package
(pydantic, redis…; 57 MB and seconds of start where jsonschema alone takes a fraction). ``-P``: neither the
working directory nor the script's is put on the child's import path."""
_VERDICTS_KEPT: Final = 256
"""Schema verdicts remembered, by the schema's SHA-256 and the bound: ``serve`` checks a spec's schema on the
pool's threads first, and its admission, on a thread that publishes, finds the verdict (broker/api.py)."""
_LATE_KEPT_S: Final = 60.0
"""How long a schema's "too costly" verdict is remembered; a verdict on its validity is kept as long as there is
room (the check is deterministic); a checking process that failed is not remembered at all."""

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class _Verdict:
    problem: str | None
    until: float
    """The monotonic time it holds until."""


class _ChildFailed(Exception):
    """Raised when a child did not start, died, or closed its pipe."""


class _Late(Exception):
    """Raised when a child has not answered within the check's bound."""


class _Child:
    """One child process and the unread part of its answers."""

    def __init__(self) -> None:
        self.pid = os.getpid()  # the process that started it: a forked copy of the pool must not use it
        self._process = subprocess.Popen(
            _COMMAND, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True)
        self._buffer = b""
        try:
            ready = self._line(time.monotonic() + START_S, threading.Event())
        except _ChildFailed:
            ready = None  # it exited at once (an interpreter that cannot import jsonschema)
        if ready != b'"ready"':
            self.kill()
            raise _ChildFailed(f"did not start within {START_S:g} s")

    @property
    def alive(self) -> bool:
        return self._process.poll() is None

    def ask(self, request: Mapping[str, Any], within_s: float, abandoned: threading.Event) -> str | None:
        """The child's problem for ``request`` (None: none).

        Raises:
            _Late: no answer within ``within_s``, or ``abandoned`` was set first.
            _ChildFailed: the child died or closed its pipe.
        """
        assert self._process.stdin is not None
        try:
            self._process.stdin.write(json.dumps({**request, "within_s": within_s}).encode() + b"\n")
            self._process.stdin.flush()
        except OSError as exc:
            raise _ChildFailed(f"could not be written to ({exc})") from exc
        line = self._line(time.monotonic() + within_s, abandoned)
        if line is None:
            raise _Late
        problem = json.loads(line)["problem"]
        return None if problem is None else str(problem)

    def _line(self, deadline: float, abandoned: threading.Event) -> bytes | None:
        """The child's next line, or None when it has not written one by ``deadline`` or ``abandoned`` is set."""
        assert self._process.stdout is not None
        fd = self._process.stdout.fileno()
        poller = select.poll()  # not select.select: a worker's descriptors may number past FD_SETSIZE
        poller.register(fd, select.POLLIN)
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or abandoned.is_set():
                return None
            if not poller.poll(min(left, _POLL_S) * 1000):
                continue
            chunk = os.read(fd, 65_536)
            if not chunk:
                raise _ChildFailed(f"exited ({self._process.poll()})")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def kill(self) -> None:
        """End the child now and reap it."""
        self._process.kill()
        self._process.wait()
        for pipe in (self._process.stdin, self._process.stdout):
            if pipe is not None:
                pipe.close()


class SchemaChecks:
    """The pool of children this process checks schemas and answers in (:data:`SCHEMA_CHECKS`)."""

    def __init__(self) -> None:
        self._idle: list[_Child] = []
        self._live: set[_Child] = set()
        self._verdicts: OrderedDict[bytes, _Verdict] = OrderedDict()
        self._lock = threading.Lock()
        self._threads: ThreadPoolExecutor | None = None

    def schema_problem(self, schema: Mapping[str, Any], *, within_s: float) -> str | None:
        """What makes ``schema`` not a Draft 2020-12 JSON Schema, in words after the field's name (None: nothing).
        Blocks up to ``within_s`` (and a child's start) unless the verdict is remembered: never call it on an
        event loop."""
        text = json.dumps(schema, sort_keys=True)
        key = hashlib.sha256(f"{within_s!r}\n{text}".encode()).digest()
        with self._lock:
            known = self._verdicts.get(key)
            if known is not None and known.until > time.monotonic():
                self._verdicts.move_to_end(key)
                return known.problem
        problem, kept_s = self._ask({"kind": "schema", "schema": text}, within_s,
                                    late="could not be checked as a JSON Schema within {within_s:g} s "
                                         "(RUNBRAKE_SCHEMA_CHECK_S): it is too costly to check")
        if kept_s > 0:
            with self._lock:
                self._verdicts[key] = _Verdict(problem, time.monotonic() + kept_s)
                self._verdicts.move_to_end(key)
                while len(self._verdicts) > _VERDICTS_KEPT:
                    self._verdicts.popitem(last=False)
        return problem

    def answer_problem(self, schema: Mapping[str, Any], answer: str, *, within_s: float,
                       abandoned: threading.Event | None = None) -> str | None:
        """What makes the JSON text ``answer`` not match ``schema``, in words for the model (None: it matches).
        Blocks up to ``within_s`` (and a child's start), or until ``abandoned`` is set (the check's child is then
        killed): never call it on an event loop."""
        problem, _ = self._ask({"kind": "answer", "schema": json.dumps(schema, sort_keys=True), "answer": answer},
                               within_s, late="the answer could not be validated against the output schema within "
                                              "{within_s:g} s (RUNBRAKE_SCHEMA_CHECK_S)",
                               abandoned=abandoned or threading.Event())
        return problem

    async def answer_problem_async(self, schema: Mapping[str, Any], answer: str, *, within_s: float) -> str | None:
        """:meth:`answer_problem`, waited for on a thread of the pool's own: the event loop goes on meanwhile. A
        cancelled wait (a run stopped, a worker draining) kills the check's child within ``_POLL_S``."""
        abandoned = threading.Event()
        try:
            return await self.off_loop(
                lambda: self.answer_problem(schema, answer, within_s=within_s, abandoned=abandoned))
        finally:
            abandoned.set()

    async def off_loop(self, call: Callable[[], T]) -> T:
        """``call()`` (a check, or what waits for one), on a thread of the pool's own, awaited: neither the event
        loop nor the caller's other threads (those that publish, in ``serve``) wait for it."""
        with self._lock:
            if self._threads is None:
                self._threads = ThreadPoolExecutor(_WAITING_THREADS, thread_name_prefix="schema-check")
            threads = self._threads
        return await asyncio.wrap_future(threads.submit(call))

    def close(self) -> None:
        """End every child, a busy one too (its check answers that the checking process exited)."""
        with self._lock:
            live, self._live, self._idle = list(self._live), set(), []
        for child in live:
            child.kill()

    def _ask(self, request: Mapping[str, Any], within_s: float, *, late: str,
             abandoned: threading.Event | None = None) -> tuple[str | None, float]:
        """The child's problem for ``request``, and how many seconds the verdict may be remembered."""
        try:
            child = self._take()
        except (_ChildFailed, OSError) as exc:
            return f"could not be checked: the checking process {exc}", 0.0
        try:
            answer = child.ask(request, within_s, abandoned or threading.Event())
        except _Late:
            self._end(child)  # it may be in a match that takes hours: only its end frees the CPU
            return late.format(within_s=within_s), _LATE_KEPT_S
        except _ChildFailed as exc:
            self._end(child)
            return f"could not be checked: the checking process {exc}", 0.0
        self._give_back(child)
        return answer, math.inf

    def _take(self) -> _Child:
        with self._lock:
            while self._idle:
                child = self._idle.pop()
                if child.alive and child.pid == os.getpid():
                    return child
                self._live.discard(child)
                child.kill()  # reaps one that died idle
        child = _Child()
        with self._lock:
            self._live.add(child)
        return child

    def _give_back(self, child: _Child) -> None:
        with self._lock:
            if len(self._idle) < IDLE_CHILDREN:
                self._idle.append(child)
                return
        self._end(child)

    def _end(self, child: _Child) -> None:
        with self._lock:
            self._live.discard(child)
        child.kill()

    def _forget(self) -> None:
        """In a forked process: the children are the parent's (their pipes too), never this one's."""
        self._idle = []
        self._live = set()
        self._verdicts = OrderedDict()
        self._lock = threading.Lock()
        self._threads = None


SCHEMA_CHECKS: Final = SchemaChecks()
"""This process's pool: children start on the first check."""
atexit.register(SCHEMA_CHECKS.close)
os.register_at_fork(after_in_child=SCHEMA_CHECKS._forget)
