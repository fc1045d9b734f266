"""What a workflow is: a coroutine that plays one episode through `Episode.act`.

A workflow owns its prompts, its task generator and its rule rewards; it never talks to an
engine, a buffer or the coach directly. Rounds (DESIGN §4): a task launch runs
`rounds_episodes` episodes that share a `round_id` — G joint rollouts (MAGRPO) — or one
episode that branches K candidates per action (AT-GRPO tree sampling).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Protocol

from actors.tasks import TaskConfig


@dataclass
class WorkflowConfig:
    name: str = "signal_game"  # a registered workflow (actors/workflows/registry.py)
    # agent name -> model id (a key of `models`); several agents may share one model
    agents: dict[str, str] = field(default_factory=dict)
    group_size: int = 4  # K candidates per action (tree) or G joint rollouts per round
    # the workflow's own settings, validated by its config dataclass (e.g. MathChatConfig)
    params: dict[str, Any] = field(default_factory=dict)
    tasks: TaskConfig = field(default_factory=TaskConfig)  # task file or generator, splits

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise ValueError(f"workflow.group_size={self.group_size}: must be >= 1")


@dataclass(frozen=True)
class Task:
    """One task instance; `truth` is the ground truth the rule rewards compare against."""

    task_id: str
    prompt: str
    truth: str
    extra: dict[str, Any] = field(default_factory=dict)


def units_per_round(workflow: "Workflow", agent_models: dict[str, str], group_size: int,
                    readiness: dict[str, str]) -> dict[str, int]:
    """Readiness units one round produces for each model (what the clock admits).

    A model that trains on groups gets the groups of every agent mapped to it; one that trains
    on episodes gets one unit per episode of the round (G for joint sampling, 1 for a tree).
    """
    episodes = group_size if workflow.sampling == "joint" else 1
    units: dict[str, int] = {}
    for agent, model_id in agent_models.items():
        if readiness[model_id] == "episode":
            units[model_id] = episodes
        else:
            units[model_id] = (units.get(model_id, 0)
                               + workflow.groups_per_round(agent, group_size))
    return units


class Workflow(Protocol):
    """The protocol every workflow implements (registered with actors.workflows.registry)."""

    name: str
    agents: tuple[str, ...]  # the roles the workflow plays, mapped to models by config
    sampling: str  # "joint": G episodes per round, n=1 per act; "tree": one episode, n=K
    coach_prompt: str  # template under configs/coach_prompts for coach.kind=http ("" = none)

    def make_task(self, rng: random.Random, index: int) -> Task:
        """The procedural generator (used when workflow.tasks.path is empty)."""
        ...

    def groups_per_round(self, agent: str, group_size: int) -> int:
        """At most how many groups (of group_size rows) one round gives this agent.

        An upper bound: the round is admitted for it, and what the round did not produce is
        released when it ends (DESIGN §14).
        """
        ...

    async def run(self, task: Task, episode: "Any") -> dict[str, float]:
        """Play one episode; returns episode-level metrics (e.g. {"success": 1.0})."""
        ...

    def rule_score(self, agent: str, task: Task, output_text: str, finish_reason: str,
                   context: dict[str, Any]) -> float:
        """The rule coach's per-action score in [0, 1] (used by RuleCoach)."""
        ...
