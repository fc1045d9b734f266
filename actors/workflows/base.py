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


@dataclass
class SignalGameConfig:
    num_targets: int = 4  # V: how many targets the sender can see (chance success = 1/V)
    message_tokens: int = 1  # tokens the sender may emit
    answer_tokens: int = 1  # tokens the receiver may emit
    # receiver's local reward for naming any target (AT-GRPO eq. 4 r_local); 0 by default:
    # it pulls every message toward whichever target the receiver happens to name first
    valid_answer_bonus: float = 0.0

    def __post_init__(self) -> None:
        if not 2 <= self.num_targets <= 10:
            raise ValueError(
                f"workflow.signal_game.num_targets={self.num_targets}: use 2..10 "
                "(targets are the digits 0..V-1)"
            )


@dataclass
class ArithDuoConfig:
    max_operand: int = 50  # operands are drawn from 1..max_operand
    operators: str = "+-*"  # operators the generator uses
    solver_tokens: int = 96  # max new tokens of the solver's draft
    verifier_tokens: int = 48  # max new tokens of the verifier's answer

    def __post_init__(self) -> None:
        if self.max_operand < 1:
            raise ValueError(f"workflow.arith_duo.max_operand={self.max_operand}: must be >= 1")
        bad = set(self.operators) - set("+-*")
        if bad or not self.operators:
            raise ValueError(
                f"workflow.arith_duo.operators={self.operators!r}: use a non-empty subset of '+-*'"
            )


@dataclass
class WorkflowConfig:
    name: str = "signal_game"  # a key of actors.workflows.WORKFLOWS
    # agent name -> model id (a key of `models`); several agents may share one model
    agents: dict[str, str] = field(default_factory=dict)
    group_size: int = 4  # K candidates per action (tree) or G joint rollouts per round
    signal_game: SignalGameConfig = field(default_factory=SignalGameConfig)
    arith_duo: ArithDuoConfig = field(default_factory=ArithDuoConfig)

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
    """The protocol every workflow implements (registered in actors.workflows.WORKFLOWS)."""

    name: str
    agents: tuple[str, ...]  # the roles the workflow plays, mapped to models by config
    sampling: str  # "joint": G episodes per round, n=1 per act; "tree": one episode, n=K

    def make_task(self, rng: random.Random, index: int) -> Task: ...

    def groups_per_round(self, agent: str, group_size: int) -> int:
        """How many groups (of group_size rows) one round gives this agent."""
        ...

    async def run(self, task: Task, episode: "Any") -> dict[str, float]:
        """Play one episode; returns episode-level metrics (e.g. {"success": 1.0})."""
        ...

    def rule_score(self, agent: str, task: Task, output_text: str, finish_reason: str,
                   context: dict[str, Any]) -> float:
        """The rule coach's per-action score in [0, 1] (used by RuleCoach)."""
        ...
