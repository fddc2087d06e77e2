"""The runs this worker process executes, and the calls each has in flight
(docs/cancellation.md, "Cancellation: the interrupt").

Two threads meet here: the event loop thread, which runs the runs, and the cancel
listener's or backstop's thread, which asks for an interrupt. anyio/asyncio objects
are not thread-safe, so :meth:`ActiveRuns.interrupt` never touches a scope itself: it
hops onto the run's loop with ``call_soon_threadsafe`` and cancels the scope there.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import anyio
import structlog

from runbrake.shared.records import SteerRequest

log = structlog.get_logger(__name__)


@dataclass(eq=False)
class RunHandle:
    """One active run: its loop, the scopes of its calls in flight, and whether a cancel reached it.

    Mutated on the loop thread only.
    """

    run_id: str
    owner: str
    """The identity this worker claimed the run with (its lease is renewed under it)."""
    loop: asyncio.AbstractEventLoop
    above: tuple[str, ...] = ()
    """The runs above it in its agent tree, its caller first (none for a first run): a cancel wake-up of any of
    them reaches it too (worker/cancel_listener.py)."""
    scopes: set[anyio.CancelScope] = field(default_factory=set)
    """The scopes of the calls in flight: one model call, or the tool calls of a turn running at once."""
    graces: dict[anyio.CancelScope, float] = field(default_factory=dict)
    """The scopes in flight of calls whose tool says ``on_cancel = "finish"``: how long a cancel lets each go on."""
    timers: dict[anyio.CancelScope, asyncio.TimerHandle] = field(default_factory=dict)
    """The grace timers running: a ``finish`` call a cancel reached, cut off when its grace runs out."""
    cancel_seen: bool = False
    """A verified cancel reached this run on the loop (anyio's *cancel requested*, not *interrupted*)."""
    lost: bool = False
    """The run is no longer this worker's: its lease was not renewed (reaped, or taken over)."""
    interrupt_requested: bool = False
    """An interrupt was asked for (set under the registry's lock, so only one asker acts)."""
    handing_over: bool = False
    """The worker is shutting down and its drain ran out: the run goes back to the queue at its next
    boundary, its call in flight cut off (docs/leases.md, "Drain and hand-over"). Not a cancel: a
    cancel that comes after still interrupts, and still wins."""

    steer: SteerRequest | None = None
    """A steer that reached the run and is not applied yet (docs/cancellation.md, "Steer"): calls in flight were
    cut off, a call that starts meanwhile is cut off on entry, and the hooks raise ``SteerRequested`` at the next
    boundary. Not a cancel: ``cancel_seen`` stays False, and a cancel that comes after still interrupts."""
    applied_steers: set[str] = field(default_factory=set)
    """The ids of the steers applied in this segment: a late wake-up of one of them interrupts nothing."""

    @contextmanager
    def in_flight(self, grace_s: float | None = None) -> Iterator[anyio.CancelScope]:
        """A fresh scope for the next call, in flight beside any other; cancelled at once when a cancel (or
        the loss of the run) already reached it. ``grace_s``: the call's tool says ``on_cancel = "finish"``,
        a cancel lets it go on that long (docs/cancellation.md, "Cancel policies: finish")."""
        scope = anyio.CancelScope()
        if self.cancel_seen or self.lost or self.handing_over or self.steer is not None:
            scope.cancel()
        self.scopes.add(scope)
        if grace_s is not None:
            self.graces[scope] = grace_s
        try:
            yield scope
        finally:
            self.scopes.discard(scope)
            self.graces.pop(scope, None)
            timer = self.timers.pop(scope, None)
            if timer is not None:
                timer.cancel()

    def _interrupt_on_loop(self, lost: bool) -> None:
        if lost:
            self.lost = True
        else:
            self.cancel_seen = True
        self._cut_off("lease_lost" if lost else "cancelled", graceful=not lost)

    def steer_reached(self, steer: SteerRequest) -> None:
        """A steer reached the run (on the loop): cut off its calls in flight, as a cancel does (a ``finish``
        call goes on for its grace), unless that steer was applied already or is the one pending."""
        if steer.id in self.applied_steers or self.steer is not None:
            return
        self.steer = steer
        self._cut_off("steered", graceful=True)

    def steer_applied(self) -> None:
        """The pending steer was applied (its step recorded): the run's calls run again."""
        if self.steer is not None:
            self.applied_steers.add(self.steer.id)
        self.steer = None

    def _hand_over_on_loop(self) -> None:
        self.handing_over = True
        self._cut_off("worker_shutdown")

    def _cut_off(self, reason: str, *, graceful: bool = False) -> None:
        """Cancel every call in flight, all at once (the flag just set cancels any later one on entry). A
        cancel (``graceful``) lets each ``finish`` call go on for its grace instead; a lost lease or a
        hand-over cuts off those too."""
        cut = [scope for scope in self.scopes if not scope.cancel_called
               and not (graceful and (scope in self.graces or scope in self.timers))]
        for scope in cut:
            scope.cancel()
        finishing = [scope for scope in self.graces if graceful and scope not in self.timers]
        for scope in finishing:
            self.timers[scope] = cut_off_after(scope, self.graces[scope])
        if cut or finishing:
            # Logged once the runs cut off with it ran to their steps' appends: a tree's cancel cuts off dozens of
            # runs in one callback, and rendering their lines first would delay every step (bench/agent_tree.py).
            self.loop.call_soon(functools.partial(log.info, "call_interrupted", run_id=self.run_id, reason=reason,
                                                  calls=len(cut), finishing=len(finishing)))


class ActiveRuns:
    """The registry: thread-safe to read and to interrupt from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: dict[str, RunHandle] = {}
        self._handing_over = False
        """Set by :meth:`hand_over_all`: a run that registers after it is handed over at once."""

    def register(self, run_id: str, owner: str, *, above: tuple[str, ...] = ()) -> RunHandle:
        """Called on the loop thread when a run's segment starts; ``above``: the runs above it in its agent tree."""
        handle = RunHandle(run_id=run_id, owner=owner, loop=asyncio.get_running_loop(), above=above)
        with self._lock:
            self._runs[run_id] = handle
            handle.handing_over = self._handing_over
        return handle

    def unregister(self, handle: RunHandle) -> None:
        with self._lock:
            if self._runs.get(handle.run_id) is handle:
                del self._runs[handle.run_id]

    def run_ids(self) -> list[str]:
        with self._lock:
            return list(self._runs)

    def with_below(self, run_id: str) -> list[str]:
        """``run_id`` (when this process executes it) and every run below it in its agent tree that this process
        executes: what a cancel wake-up of ``run_id`` may reach (docs/usage.md, "Agent trees")."""
        with self._lock:
            return [i for i, handle in self._runs.items() if i == run_id or run_id in handle.above]

    def owners(self) -> dict[str, str]:
        """Run id → the owner it was claimed under, for lease renewal."""
        with self._lock:
            return {run_id: handle.owner for run_id, handle in self._runs.items()}

    def __contains__(self, run_id: object) -> bool:
        with self._lock:
            return run_id in self._runs

    def __len__(self) -> int:
        with self._lock:
            return len(self._runs)

    def cancel_seen(self, run_id: str) -> bool:
        """Whether this process executes the run and a verified cancel reached it (its fence is written)."""
        with self._lock:
            handle = self._runs.get(run_id)
            return handle is not None and handle.cancel_seen

    def interrupt(self, run_id: str, *, lost: bool = False, owner: str | None = None) -> bool:
        """Ask the run's loop to cancel its calls in flight (and any it starts later). From any thread.

        ``lost``: not a cancel, but the run is no longer this worker's (its lease was not renewed); the
        run then stops with :class:`OwnershipLost` rather than as cancelled. ``owner``: only the segment
        claimed under this owner (a run taken from this process may have been claimed by it again since,
        under a new owner: that segment is not interrupted).

        Returns False when this process does not execute the run, or an interrupt already reached it
        (a scope started after that is cancelled on entry). The caller has checked the cancel key
        (or the lease) first: this registry trusts it.
        """
        with self._lock:
            handle = self._runs.get(run_id)
            if handle is None or handle.interrupt_requested or (owner is not None and handle.owner != owner):
                return False
            handle.interrupt_requested = True
        return _on_loop(handle, handle._interrupt_on_loop, lost)

    def interrupt_tree(self, run_ids: list[str]) -> list[str]:
        """:meth:`interrupt` for the runs of one cancel wake-up (a run and the runs below it, each verified):
        one hop onto each loop for them all, not one each (worker/cancel_listener.py). From any thread; the runs
        interrupted, in ``run_ids``' order."""
        with self._lock:
            handles = [h for i in run_ids if (h := self._runs.get(i)) is not None and not h.interrupt_requested]
            for handle in handles:
                handle.interrupt_requested = True
        by_loop: dict[asyncio.AbstractEventLoop, list[RunHandle]] = {}
        for handle in handles:
            by_loop.setdefault(handle.loop, []).append(handle)
        reached: set[str] = set()
        for loop, on_loop in by_loop.items():
            try:
                loop.call_soon_threadsafe(_interrupt_each, on_loop)
            except RuntimeError:
                continue  # the loop closed, and its runs with it
            reached.update(h.run_id for h in on_loop)
        return [i for i in run_ids if i in reached]

    def steer(self, run_id: str, steer: SteerRequest) -> bool:
        """Deliver a steer read from Redis to the run's loop (:meth:`RunHandle.steer_reached`). From any thread;
        False when this process does not execute the run. Unlike :meth:`interrupt`, not once per run: a run may
        be steered many times, and the steer's id makes a repeated delivery a no-op."""
        with self._lock:
            handle = self._runs.get(run_id)
        return handle is not None and _on_loop(handle, handle.steer_reached, steer)

    def hand_over_all(self) -> int:
        """Ask every run of this process to go back to the queue at its next boundary, cutting off its
        call in flight. From any thread; answers how many runs were asked. A cancel's interrupt is not
        blocked by this one: a run cancelled while handing over ends cancelled."""
        with self._lock:
            self._handing_over = True
            handles = list(self._runs.values())
        return sum(_on_loop(handle, handle._hand_over_on_loop) for handle in handles)


def _interrupt_each(handles: list[RunHandle]) -> None:
    for handle in handles:
        handle._interrupt_on_loop(False)


def cut_off_after(scope: anyio.CancelScope, grace_s: float) -> asyncio.TimerHandle:
    """Cancel ``scope`` once ``grace_s`` seconds have passed (a ``finish`` call a cancel reached); on the
    running loop, whose thread alone touches the scope."""
    return asyncio.get_running_loop().call_later(grace_s, scope.cancel)


def _on_loop(handle: RunHandle, action: Callable[..., None], *args: object) -> bool:
    """Run ``action`` on the run's loop (its handle is touched there only); False when the loop closed,
    and the run with it."""
    try:
        handle.loop.call_soon_threadsafe(action, *args)
    except RuntimeError:
        return False
    return True
