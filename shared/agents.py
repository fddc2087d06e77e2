"""Agents of the operator's catalog, and the trees of runs their calls make (docs/usage.md, "Agent trees").

An agent is a named run template (``[agents.NAME]``): what the calling model is told of it, its instructions,
model, servers, settings, output schema, budget and the agents it may call in turn. A run whose spec names
agents (``"agents": ["researcher"]``) offers each to its model as the tool ``agent__<name>`` taking
``{"input": string}``; a call of it is a child run built here (:func:`child_request`) and executed by any
worker (worker/agents.py). Only the catalog defines agents; its check refuses a name it does not define and
a loop of agents calling each other (:func:`check_agents`), and admission bounds a tree's depth
(:func:`height`, ``RUNBRAKE_MAX_AGENT_DEPTH``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Final

from pydantic import Field

from runbrake.shared.spec import (
    DEFAULT_MAX_ROUNDS,
    BudgetSpec,
    ModelSettingsSpec,
    SpecModel,
)

__all__ = ["AGENT_INPUT_SCHEMA", "AgentSpec", "check_agents", "child_request", "height"]

AGENT_INPUT_SCHEMA: Final[Mapping[str, Any]] = {
    "type": "object",
    "properties": {"input": {"type": "string", "description": "What the agent is asked to do."}},
    "required": ["input"],
    "additionalProperties": False,
}
"""The arguments of every agent's tool: one string, the child run's ``input``."""

_Names = Annotated[tuple[Annotated[str, Field(min_length=1, max_length=64)], ...], Field(strict=False, max_length=64)]


class AgentSpec(SpecModel):
    """An agent (``[agents.NAME]``): the template of the child run each call of it starts."""

    description: Annotated[str, Field(min_length=1, max_length=4_000)]
    """What the calling model is told the agent does (its tool's description)."""
    model: Annotated[str, Field(min_length=1, max_length=64)]
    """The model of the catalog its runs use (``[models.NAME]``)."""
    instructions: Annotated[str, Field(min_length=1)] | None = None
    """Its runs' system prompt."""
    mcp_servers: _Names = ()
    """The servers of the catalog its runs may call."""
    agents: _Names = ()
    """The agents its runs may call in turn (never itself, directly or through others)."""
    model_settings: ModelSettingsSpec | None = None
    """How its model is asked (over the catalog model's defaults)."""
    output_schema: dict[str, Any] | None = None
    """A JSON Schema its answer must match: the caller's tool result is then the parsed answer."""
    budget: BudgetSpec | None = None
    """What each of its runs may spend; a child's ``deadline_s`` is also at most what its caller has left."""
    max_rounds: Annotated[int, Field(ge=1, le=1000)] = DEFAULT_MAX_ROUNDS
    """Model calls each of its runs may make."""
    approval_required: _Names = ()
    """Tools (``<server>.<tool>``) whose calls in its runs wait for ``runbrake approve``; the tree's first run
    shows which of its runs waits (docs/usage.md, "Agent trees")."""


def check_agents(agents: Mapping[str, AgentSpec], *, models: Mapping[str, object],
                 servers: Mapping[str, object]) -> list[str]:
    """What is wrong with the catalog's agents: names it does not define (models, servers, agents), and each
    loop of agents calling each other, as ``agents.NAME.field: problem`` lines."""
    problems: list[str] = []
    for name, agent in agents.items():
        if agent.model not in models:
            problems.append(f"agents.{name}.model: {agent.model!r} is not a model of the catalog")
        problems += [f"agents.{name}.mcp_servers: {s!r} is not a server of the catalog"
                     for s in agent.mcp_servers if s not in servers]
        problems += [f"agents.{name}.agents: {a!r} is not an agent of the catalog" for a in agent.agents
                     if a not in agents]
    problems += [f"agents.{loop[0]}.agents: a loop of agents calling each other ({' -> '.join(loop)})"
                 for loop in _loops(agents)]
    return problems


def _loops(agents: Mapping[str, AgentSpec]) -> list[list[str]]:
    """Each loop of calls among ``agents`` once, found by a depth-first walk (iterative: a catalog is small, but
    nothing here recurses on what a file says)."""
    done: set[str] = set()
    loops: list[list[str]] = []
    for start in agents:
        if start in done:
            continue
        path: list[str] = [start]
        on_path = {start}
        pending = [iter(agents[start].agents)]
        while pending:
            step = next(pending[-1], None)
            if step is None:
                pending.pop()
                done.add(path[-1])
                on_path.discard(path.pop())
                continue
            if step in on_path:
                loops.append([*path[path.index(step):], step])
            elif step in agents and step not in done:
                path.append(step)
                on_path.add(step)
                pending.append(iter(agents[step].agents))
    return loops


def height(names: tuple[str, ...], agents: Mapping[str, AgentSpec]) -> int:
    """How many levels of child runs calling ``names`` can make below the caller: 0 without agents, 1 when none
    of them calls another. The catalog has no loop (:func:`check_agents`) and unknown names count as leaves."""
    memo: dict[str, int] = {}

    def of(name: str) -> int:
        if name not in memo:
            agent = agents.get(name)
            memo[name] = 1 + (max((of(a) for a in agent.agents), default=0) if agent is not None else 0)
        return memo[name]

    return max((of(name) for name in names), default=0)


def child_request(agent: AgentSpec, text: str, *, key: str, deadline_s: float | None) -> dict[str, Any]:
    """The spec (JSON-shaped) of the child run a call of ``agent`` with ``text`` starts: the agent's template,
    the idempotency ``key`` that makes the call start one run however often it is made, and the deadline left
    to it (its own ``budget.deadline_s``, at most ``deadline_s``, what its caller has left)."""
    spec: dict[str, Any] = {"input": text, "model": agent.model, "max_rounds": agent.max_rounds,
                            "idempotency_key": key}
    if agent.mcp_servers:
        spec["mcp_servers"] = list(agent.mcp_servers)
    if agent.agents:
        spec["agents"] = list(agent.agents)
    if agent.instructions is not None:
        spec["instructions"] = agent.instructions
    if agent.model_settings is not None:
        spec["model_settings"] = agent.model_settings.model_dump(mode="json", exclude_none=True)
    if agent.output_schema is not None:
        spec["output_schema"] = agent.output_schema
    if agent.approval_required:
        spec["approval_required"] = list(agent.approval_required)
    budget = {} if agent.budget is None else agent.budget.model_dump(mode="json", exclude_none=True)
    if deadline_s is not None:
        budget["deadline_s"] = min(deadline_s, budget.get("deadline_s", deadline_s))
    if budget:
        spec["budget"] = budget
    return spec
