"""arith_duo: a solver drafts, a verifier checks it and answers in \\boxed{}.

Procedurally generated arithmetic; both roles may map to one shared model (agent→model
mapping in config, UnityMAS-O §3). Tree sampling (AT-GRPO §4.1, Alg. 1): each role samples
K candidates from one prompt; the cheap selection reward (the same rules, inline) picks the
candidate the episode continues from, while the training reward of every candidate is the
coach's per-action process score (MAPPA §2.2), which arrives later. Any output — empty,
truncated, garbage, no \\boxed{} — gets a score, never an exception.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

from actors.workflows.base import Task
from actors.workflows.registry import register

_BOXED = re.compile(r"\\boxed\{\s*(-?\d+(?:\.\d+)?)\s*\}")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")

SOLVER_SYSTEM = ("You are a careful math solver. Work the problem out step by step in a few "
                 "short lines and end with the result.")
VERIFIER_SYSTEM = "You are a verifier. Check the solver's work and fix any mistake."
# The verifier's reply opens with this (prompt tokens, not trained): a 135M model almost never
# writes \\boxed{} unprompted (0 of 48 sampled replies), while after this opening it fills in a
# number most of the time, and the right one about 40 % of the time when the solver's draft
# holds it (3 % when it does not) — the team signal GRPO starts from.
VERIFIER_PREFIX = "The final answer is \\boxed{"


def num_eq(a: float, b: float, delta: float = 1e-6) -> bool:
    """AT-GRPO appendix NumEq_δ: absolute or relative difference within δ."""
    return abs(a - b) <= delta or abs(a - b) / max(1.0, abs(b)) <= delta


def boxed_answer(text: str) -> float | None:
    match = _BOXED.findall(text)
    return float(match[-1]) if match else None


def mentions(text: str, truth: float) -> bool:
    return any(num_eq(float(n), truth) for n in _NUMBER.findall(text))


@dataclass
class ArithDuoConfig:
    max_operand: int = 50  # operands are drawn from 1..max_operand
    operators: str = "+-*"  # operators the generator uses
    solver_tokens: int = 96  # max new tokens of the solver's draft
    verifier_tokens: int = 48  # max new tokens of the verifier's answer

    def __post_init__(self) -> None:
        if self.max_operand < 1:
            raise ValueError(f"workflow.params.max_operand={self.max_operand}: must be >= 1")
        bad = set(self.operators) - set("+-*")
        if bad or not self.operators:
            raise ValueError(
                f"workflow.params.operators={self.operators!r}: use a non-empty subset of '+-*'"
            )


@register("arith_duo", ArithDuoConfig)
class ArithDuo:
    name = "arith_duo"
    agents = ("solver", "verifier")
    sampling = "tree"
    coach_prompt = "arith_duo"  # configs/coach_prompts/arith_duo.txt (MAPPA B.4, two agents)

    def __init__(self, cfg: ArithDuoConfig) -> None:
        self.cfg = cfg

    def make_task(self, rng: random.Random, index: int) -> Task:
        a = rng.randint(1, self.cfg.max_operand)
        b = rng.randint(1, self.cfg.max_operand)
        op = rng.choice(self.cfg.operators)
        truth = {"+": a + b, "-": a - b, "*": a * b}[op]
        return Task(task_id=f"arith-{index}", prompt=f"What is {a} {op} {b}?", truth=str(truth))

    def groups_per_round(self, agent: str, group_size: int) -> int:
        return 1  # one K-candidate group per role per round

    def rule_score(self, agent, task, output_text, finish_reason, context) -> float:
        """Per-action rule score in [0, 1].

        verifier: 0.8 for a correct \\boxed{} answer + 0.2 format (a parseable \\boxed{});
        solver: 0.7 usefulness (the true result appears in the draft) + 0.3 format (non-empty,
        not truncated). A missing box, an empty or truncated output loses the format part.
        """
        truth = float(task.truth)
        if agent == "verifier":
            answer = boxed_answer(output_text)
            if answer is None:
                return 0.0
            return 0.2 + 0.8 * float(num_eq(answer, truth))
        useful = mentions(output_text, truth)
        well_formed = bool(output_text.strip()) and finish_reason == "stop"
        return 0.7 * float(useful) + 0.3 * float(well_formed)

    async def run(self, task: Task, episode) -> dict[str, float]:
        k = episode.group_size
        solver_prompt = f"{task.prompt} Show your reasoning briefly."
        drafts = await episode.act(
            "solver", [{"role": "system", "content": SOLVER_SYSTEM},
                       {"role": "user", "content": solver_prompt}],
            turn=0, n=k, max_new_tokens=self.cfg.solver_tokens)
        await episode.coach(drafts, input_text=solver_prompt)
        best = max(drafts, key=lambda d: self.rule_score("solver", task, d.text,
                                                          d.finish_reason, {}))
        episode.keep(best)
        verifier_prompt = f"Question: {task.prompt}\nSolver's work: {best.text.strip()}"
        answers = await episode.act(
            "verifier", [{"role": "system", "content": VERIFIER_SYSTEM},
                         {"role": "user", "content": verifier_prompt}],
            turn=1, n=k, max_new_tokens=self.cfg.verifier_tokens,
            parent_branch=str(best.candidate), prefix=VERIFIER_PREFIX)
        await episode.coach(answers, input_text=verifier_prompt)
        scores = [self.rule_score("verifier", task, a.text, a.finish_reason, {}) for a in answers]
        chosen = answers[max(range(k), key=scores.__getitem__)]
        episode.keep(chosen)
        correct = boxed_answer(chosen.text)
        success = float(correct is not None and num_eq(correct, float(task.truth)))
        boxed = sum(boxed_answer(a.text) is not None for a in answers) / k
        return {"success": success, "boxed_fraction": boxed,
                "solver_useful": float(mentions(best.text, float(task.truth)))}
