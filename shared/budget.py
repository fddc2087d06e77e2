"""A run's budget as admission leaves it, and what model calls cost (docs/usage.md, "Budgets").

The spec's ``budget`` says what a run may spend; the catalog model adds its prices and its default and
cap of ``max_total_tokens`` (shared/catalog.py, :class:`~runbrake.shared.catalog.Admission`). The worker
holds the run to the result (worker/budget.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from runbrake.shared.status import TerminationReason

BUDGET_REQUESTER = "budget"
"""``cancel.requested_by`` of a run its budget stopped."""


@dataclass(frozen=True, slots=True)
class Prices:
    """What a catalog model's tokens cost, in US dollars per million tokens."""

    input_usd_per_mtok: float
    output_usd_per_mtok: float

    def cost_usd(self, input_tokens: int, output_tokens: int) -> float:
        """What these tokens cost, in US dollars."""
        return (input_tokens * self.input_usd_per_mtok + output_tokens * self.output_usd_per_mtok) / 1_000_000


@dataclass(frozen=True, slots=True)
class Budget:
    """The bounds a run is held to: the spec's, with the catalog model's default or cap of
    ``max_total_tokens`` where the spec gives none; None: no bound."""

    deadline_s: float | None = None
    max_total_tokens: int | None = None
    max_cost_usd: float | None = None
    prices: Prices | None = None
    """The model's prices (shared by the step's ``detail.usage.cost_usd`` whether or not a cost is bounded)."""

    @property
    def bounds_spending(self) -> bool:
        """Whether the worker counts the run's tokens or cost against a bound."""
        return self.max_total_tokens is not None or self.max_cost_usd is not None

    @property
    def is_empty(self) -> bool:
        """Nothing to watch and nothing to price."""
        return not self.bounds_spending and self.deadline_s is None and self.prices is None

    def exceeded(self, total_tokens: int, cost_usd: float | None) -> str | None:
        """Why a run that used this much is stopped (the cancel's ``reason`` text), or None."""
        if self.max_total_tokens is not None and total_tokens >= self.max_total_tokens:
            return (f"the run used {total_tokens} tokens; its budget is {self.max_total_tokens} "
                    "(budget.max_total_tokens)")
        if self.max_cost_usd is not None and cost_usd is not None and cost_usd >= self.max_cost_usd:
            return (f"the run cost {cost_usd:.6f} USD; its budget is {self.max_cost_usd} USD "
                    "(budget.max_cost_usd)")
        return None


NO_BUDGET = Budget()

DEADLINE_REASON = TerminationReason.DEADLINE_EXCEEDED
SPENDING_REASON = TerminationReason.BUDGET_EXCEEDED


def budget_use(request: Mapping[str, Any], created_at: float, total_tokens: int,
               cost_usd: float | None) -> dict[str, Any] | None:
    """A run record's ``budget_use``: what the run used of the budget its spec gave (None without one)."""
    budget = request.get("budget")
    if not isinstance(budget, Mapping):
        return None
    deadline_s = budget.get("deadline_s")
    deadline_at = created_at + deadline_s if isinstance(deadline_s, int | float) and created_at else None
    return {"tokens": total_tokens, "cost_usd": cost_usd, "deadline_at": deadline_at}
