"""Budgets that brake by themselves: a run that reaches its deadline or spends its tokens or cost is
stopped like an operator's cancel (docs/cancellation.md, "Budgets").

The tokens and the cost are counted at every model step (the only boundaries that change them), from what
the run used before this segment (the run's ``usage`` in the store sums every segment's model steps); the
deadline is watched by a timer on the worker's loop, from the run's ``created_at`` (its enqueue), so that
it fires in the middle of a call. Either way the run is stopped through the same fence (the cancel script,
``requested_by = "budget"``, the reason ``budget_exceeded`` or ``deadline_exceeded``) and the same local
interrupt (:meth:`ActiveRuns.interrupt`) as a cancel: the call in flight is cut off and recorded
cancelled, and a cancel that won first stays the operator's. A run with agents stops the runs below it in the
same moment, as a cancel of the tree does (``tree_brake``: worker/agents.py, ``ChildRuns.stop_below``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import replace

import anyio
import structlog

from runbrake.shared.async_store import AsyncRunStore
from runbrake.shared.budget import BUDGET_REQUESTER, Budget
from runbrake.shared.errors import CancelRequested, StoreError
from runbrake.shared.status import RunStatus, TerminationReason
from runbrake.shared.steps import RunStep, StepKind
from runbrake.worker.registry import ActiveRuns

log = structlog.get_logger(__name__)

_FENCE_RETRY_S = 1.0
"""How long the deadline's fence waits before it is tried again while Redis cannot be reached."""


TreeBrake = Callable[[str, str], Awaitable[None]]
"""``(run_id, reason)``: fence every run below a run its budget stopped, and wake their workers."""


class BudgetGuard:
    """Holds one segment of a run to its budget: prices its model steps, counts them, watches its deadline."""

    def __init__(self, store: AsyncRunStore, registry: ActiveRuns, run_id: str, budget: Budget, *,
                 created_at: float = 0.0, tokens: int = 0, cost_usd: float = 0.0,
                 clock: Callable[[], float] = time.time, tree_brake: TreeBrake | None = None) -> None:
        self._store = store
        self._tree_brake = tree_brake
        self._registry = registry
        self._run_id = run_id
        self._budget = budget
        self._created_at = created_at
        self.tokens = tokens
        """Tokens the run used so far, all segments together."""
        self.cost_usd = cost_usd
        """What the run cost so far, all segments together (0 when the model has no prices)."""
        self._clock = clock
        self.stopped: TerminationReason | None = None
        """Why this guard stopped the run, once its fence won (``deadline_exceeded``, ``budget_exceeded``);
        None while it has not (a cancel that won first stays the operator's)."""
        self._timer: asyncio.TimerHandle | None = None
        self._fence: asyncio.Task[None] | None = None
        self._below: tuple[int, float] = (0, 0.0)
        """What the runs below this one in its agent tree had used when last seen (tokens, cost)."""

    @classmethod
    async def open(cls, store: AsyncRunStore, registry: ActiveRuns, run_id: str, budget: Budget, *,
                   tree_brake: TreeBrake | None = None) -> BudgetGuard | None:
        """The guard of a run's segment; None when the run has no budget and no prices (nothing read). The use
        so far is read only when there is a bound to count it against. ``tree_brake``: the run may have runs
        below it in an agent tree, stopped with it."""
        if budget.is_empty:
            return None
        if budget.deadline_s is None and not budget.bounds_spending:
            return cls(store, registry, run_id, budget, tree_brake=tree_brake)
        use = await store.budget_use(run_id)
        if use is None:
            return cls(store, registry, run_id, budget, created_at=time.time(), tree_brake=tree_brake)
        guard = cls(store, registry, run_id, budget, created_at=use.created_at,
                    tokens=use.tokens + use.below_tokens, cost_usd=(use.cost_usd or 0.0) + use.below_cost_usd,
                    tree_brake=tree_brake)
        guard._below = (use.below_tokens, use.below_cost_usd)
        return guard

    @property
    def deadline_at(self) -> float | None:
        """When the deadline passes (epoch seconds), or None without one."""
        return None if self._budget.deadline_s is None else self._created_at + self._budget.deadline_s

    def priced(self, step: RunStep) -> RunStep:
        """A model step with its cost in ``detail.usage.cost_usd``, where the model has prices."""
        prices = self._budget.prices
        usage = step.detail.get("usage")
        if prices is None or step.kind is not StepKind.MODEL or not isinstance(usage, dict):
            return step
        cost = prices.cost_usd(_count(usage.get("input_tokens")), _count(usage.get("output_tokens")))
        return replace(step, detail={**step.detail, "usage": {**usage, "cost_usd": round(cost, 9)}})

    async def counted(self, step: RunStep) -> None:
        """Count a recorded step's usage; stop the run when it reached its budget.

        Raises:
            CancelRequested: when this stopped the run (or a cancel already had).
        """
        usage = step.detail.get("usage")
        if step.kind is not StepKind.MODEL or step.error or step.interrupted or not isinstance(usage, dict):
            return
        self.tokens += _count(usage.get("input_tokens")) + _count(usage.get("output_tokens"))
        cost = usage.get("cost_usd")
        if isinstance(cost, int | float) and not isinstance(cost, bool):
            self.cost_usd += float(cost)
        await self._check_spending()

    async def count_below(self, tokens: int, cost_usd: float) -> None:
        """The runs below this one in its agent tree used ``tokens`` and ``cost_usd`` in all (its hash's
        ``below_tokens`` and ``below_cost_usd``, which their workers add to: worker/agents.py): what grew since
        last seen counts against this run's budget. A stop interrupts the calls in flight (the waits for the
        children among them) and raises nothing here: the cut-off call's boundary does."""
        grown_tokens, grown_cost = tokens - self._below[0], cost_usd - self._below[1]
        if grown_tokens <= 0 and grown_cost <= 0:
            return
        self._below = (max(tokens, self._below[0]), max(cost_usd, self._below[1]))
        self.tokens += max(0, grown_tokens)
        self.cost_usd += max(0.0, grown_cost)
        with contextlib.suppress(CancelRequested):
            await self._check_spending()

    @asynccontextmanager
    async def watching(self) -> AsyncIterator[None]:
        """While the block runs, the deadline's timer is set. A run past its deadline (a queued run, one that
        waited for approval) or past its spending bounds is stopped before the block runs.

        Raises:
            CancelRequested: when the run was stopped before the block.
        """
        deadline_at = self.deadline_at
        if deadline_at is not None:
            left = deadline_at - self._clock()
            if left <= 0:
                if await self._stop(TerminationReason.DEADLINE_EXCEEDED, self._deadline_text()):
                    raise CancelRequested(self._run_id)
            else:
                self._timer = asyncio.get_running_loop().call_later(left, self._deadline_passed)
        try:
            await self._check_spending()
            yield
        finally:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if self._fence is not None and not self._fence.done():
                self._fence.cancel()

    async def _check_spending(self) -> None:
        if not self._budget.bounds_spending:
            return
        prices = self._budget.prices
        reason = self._budget.exceeded(self.tokens, None if prices is None else self.cost_usd)
        if reason is not None and await self._stop(TerminationReason.BUDGET_EXCEEDED, reason):
            raise CancelRequested(self._run_id)

    def _deadline_passed(self) -> None:
        """The timer fired (on the loop): the fence is a round trip, so it runs as a task of its own. The loop's
        clock is monotonic and may fire a timer a little early by the wall clock the deadline is set on: then
        the timer is set again for what is left, so the fence never comes before the deadline."""
        loop = asyncio.get_running_loop()
        left = (self.deadline_at or 0.0) - self._clock()
        if left > 0:
            self._timer = loop.call_later(left, self._deadline_passed)
            return
        self._timer = None
        self._fence = loop.create_task(self._stop_at_deadline())

    async def _stop_at_deadline(self) -> None:
        while True:
            try:
                await self._stop(TerminationReason.DEADLINE_EXCEEDED, self._deadline_text())
            except StoreError as exc:
                # Kept trying while the segment runs: a call in flight is cut off as soon as Redis is back.
                log.warning("budget_fence_retrying", run_id=self._run_id, error=str(exc), retry_in_s=_FENCE_RETRY_S)
                await asyncio.sleep(_FENCE_RETRY_S)
                continue
            return

    def _deadline_text(self) -> str:
        return f"the run's deadline passed: {self._budget.deadline_s:g} s from enqueue (budget.deadline_s)"

    async def _stop(self, termination: TerminationReason, reason: str) -> bool:
        """Win the fence as the budget, then interrupt the run's calls in flight here (the run is this
        worker's: no message is needed to reach it). True when the run is cancelled now, by this or by a
        cancel that won first (which stays the operator's)."""
        transition = await self._store.cancel(self._run_id, reason=reason, requested_by=BUDGET_REQUESTER,
                                              termination=termination)
        if not transition.won and transition.found is not RunStatus.CANCELLED:
            return False
        if transition.won:
            self.stopped = termination
            log.info("run_budget_reached", run_id=self._run_id, reason=termination.value, detail=reason)
        self._registry.interrupt(self._run_id)
        if transition.won and self._tree_brake is not None:
            # Shielded: the interrupt above may cut off the very call (a wait for a child) this runs in.
            with anyio.CancelScope(shield=True):
                await self._tree_brake(self._run_id, reason)
        return True


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0
