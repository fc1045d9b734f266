"""math_duo: a reasoner and a Python tool agent take turns until their answers agree.

AT-GRPO appendix A.1.1 (rewards), A.2.2 "Math MAS Workflow" (prompts), §4.1 and Alg. 1 (tree
sampling, agent- and turn-wise groups). Runs with `advantage: at_grpo` and `team_lambda`.

A turn k = 1..T (T = `horizon`, 4 in the paper, §5.1) is two steps, the reasoner's then the
tool's; each step samples K = `workflow.group_size` candidates from one prompt:
  reasoner: answers in \\boxed{} (or after `####`): its answer ŷ.
  tool: writes a ```python block, run in the sandbox (CodeTool, one workspace per run); its
    answer ỹ is the last non-empty line the program printed.
Turn 1 shows each agent the problem alone (A.2.2: both start from the same problem); later
prompts add the history of earlier steps (the appendix's "mismatch history": solutions, boxed
answers, code, printed outputs), newest kept, oldest dropped past `history_chars`. The tool of
turn k sees the reasoner's answer of turn k in it.

Tree (Alg. 1 line 13): each step continues from its best candidate by the λ-mixed reward below,
ties to the first; `episode.keep(best)`, and the next step's `parent_branch` is the dotted path
of kept candidates ("2.0" = reasoner candidate 2, then tool candidate 0). The episode ends at the
first step whose kept answer agrees with the other agent's latest one, or after the tool's step
of turn T. The team's final answer is the reasoner's (§5.1: "Reasoner produces the final
answer"); `success` is that answer passing CheckFinal against the truth.

Rewards (A.1.1), for each candidate on the state its own step yields (the other agent's latest
kept answer unchanged), r = λ·r_team + (1−λ)·m·r_loc with λ = `team_lambda` = λ_math = 0.70:
  r_team = 1{this step ends the episode and the final answer passes CheckFinal}   (sparse)
  reasoner: r_loc = 0.20·s_fmt + 0.00·s_tool + 0.80·s_step, s_fmt = 1{an answer in \\boxed{}
    or after ####}, s_step = CheckFinal(ŷ, y*); m = 1{y* parses (math-verify)}.
  tool: r_loc = 0.10·s_fmt + 0.10·s_tool + 0.80·s_step, s_fmt = 1{a ```python block not cut
    at the token budget}, s_tool = 1{the run exited 0 within every limit}, s_step =
    CheckFinal(ỹ, y*); m = 1{y* parses and the code ran (logs exist)}, so a reply without code
    gets λ·r_team alone.
CheckFinal(a, b) is NumEq_δ (δ = 1e-6) when both are plain numbers, else math-verify's
equivalence (actors/tasks.py); agreement between the agents is the same check.
Where the paper is silent: "k = T" in r_team is read as "the episode's last step" (an episode
that agrees early could otherwise never earn it); the reasoner's step at turn 1, with no tool
answer yet, never ends the episode (r_team = 0 for all its K candidates); ỹ is the printed last
line; NumEq on non-numeric answers falls back to math-verify's equivalence.

Rows and the coach. Every candidate's row gets reward_team = r_team and reward_local = r_loc
(null where m = 0) and its meta the step's figures (env_reward, env_team, env_local, env_mask,
env_scores, answer, kept). `reward_source` decides who writes `reward` (which makes a row READY)
exactly once: "inline" (default) writes r, and the row never goes to the coach, so `coach.kind`
plays no part in training; "coach" sends every candidate to the coach with r in its context
(`step_reward`), and `rule_score` (coach.kind: rule) returns that r: the environment's reward,
never a second invention. A FAILED `sandbox` row gets no reward and is never kept; every row's
`outcome` is the episode's success.

Tasks: mathchat's procedural generator (`steps`, `max_number`), or any JSONL/Parquet of
problem/answer pairs (`workflow.tasks.path`).

    python scripts/launch_async.py --config configs/math_duo_cpu.yaml
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import math
import random
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from actors.envs import LocalReward, local_reward, mix_reward
from actors.episode import Action
from actors.sandbox import SandboxConfig, python_blocks
from actors.tasks import answers_match, extract_answer
from actors.workflows.arith_duo import num_eq
from actors.workflows.base import Task
from actors.workflows.mathchat import MathChat, MathChatConfig
from actors.workflows.registry import register
from actors.workflows.tools import CodeTool, ToolResult
from buffers.schema import tree_path

LAMBDA_MATH = 0.70  # A.1.1 λ_math
REASONER_COEFFICIENTS = {"fmt": 0.20, "tool": 0.00, "step": 0.80}  # A.1.1 c^Reasoner
TOOL_COEFFICIENTS = {"fmt": 0.10, "tool": 0.10, "step": 0.80}  # A.1.1 c^Tool
REWARD_SOURCES = ("inline", "coach")
_PLAIN_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_ANSWER_CHARS = 200  # the longest answer kept from a reply or a printout


@dataclass
class MathDuoConfig:
    horizon: int = 4  # T: turns, each a reasoner step then a tool step (§5.1: T = 4)
    reasoner_tokens: int = 4096  # max new tokens of a reasoner reply (A.2.1: 4096)
    tool_tokens: int = 4096  # max new tokens of a tool reply
    reasoner_prefix: str = ""  # opens every reasoner reply (prompt tokens, never trained)
    tool_prefix: str = ""  # opens every tool reply; "```python\n" makes a small model write code
    team_lambda: float = LAMBDA_MATH  # λ of the mix that picks the kept candidate (A.1.1)
    reward_source: str = "inline"  # "inline": rows carry r; "coach": the coach scores them
    observation_chars: int = 1500  # of a program's output shown in the history
    history_chars: int = 3000  # earlier steps shown in later prompts (oldest dropped first)
    steps: int = 2  # generator (mathchat's): arithmetic operations per problem (1..4)
    max_number: int = 20  # generator: operands are drawn from 1..max_number
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)  # where the tool's code runs

    def __post_init__(self) -> None:
        for name in ("horizon", "reasoner_tokens", "tool_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"workflow.params.{name}={getattr(self, name)}: must be >= 1")
        if not (math.isfinite(self.team_lambda) and 0 <= self.team_lambda <= 1):
            raise ValueError(f"workflow.params.team_lambda={self.team_lambda}: use a value in "
                             "[0, 1] (A.1.1: 0.70), the learner's team_lambda")
        if self.reward_source not in REWARD_SOURCES:
            raise ValueError(f"workflow.params.reward_source={self.reward_source!r}: use one of "
                             f"{list(REWARD_SOURCES)}")
        for name in ("observation_chars", "history_chars"):
            if getattr(self, name) < 40:
                raise ValueError(f"workflow.params.{name}={getattr(self, name)}: must be >= 40")
        MathChatConfig(steps=self.steps, max_number=self.max_number)  # names a bad field


# ------------------------------------------------------------------------------ answers

def final_answer(text: str) -> str | None:
    """The reasoner's answer: the last \\boxed{} content, else the line after the last ####."""
    boxed = extract_answer(text)
    if boxed is not None:
        return boxed[:_ANSWER_CHARS] or None
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip().splitlines()
        return (tail[0].strip()[:_ANSWER_CHARS] or None) if tail else None
    return None


def printed_answer(stdout: str) -> str | None:
    """The tool's answer: the last non-empty line its program printed."""
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    return lines[-1][:_ANSWER_CHARS] if lines else None


def _number(text: str) -> float | None:
    plain = text.strip().replace(",", "")
    return float(plain) if _PLAIN_NUMBER.fullmatch(plain) else None


def check_final(answer: str | None, reference: str) -> bool:
    """CheckFinal (A.1.1): NumEq_δ for two plain numbers, else math-verify's equivalence."""
    if answer is None:
        return False
    a, b = _number(answer), _number(reference)
    if a is not None and b is not None:
        return num_eq(a, b)
    return answers_match(f"\\boxed{{{answer}}}", reference)


@functools.lru_cache(maxsize=4096)
def truth_available(truth: str) -> bool:
    """m^Reasoner (A.1.1): whether math-verify can read the ground truth y*."""
    return _number(truth) is not None or answers_match(f"\\boxed{{{truth}}}", truth)


# ------------------------------------------------------------------------------ rewards

@dataclass(frozen=True)
class StepReward:
    """One candidate's reward: r = λ·r_team + (1−λ)·m·r_loc (AT-GRPO A.1.1)."""

    team: float
    local: LocalReward
    lam: float

    @property
    def value(self) -> float:
        return mix_reward(self.lam, self.team, self.local)

    def row_rewards(self) -> dict[str, float | None]:
        """The row's components; the mask m = 0 is a null local reward (learners/advantages)."""
        return {"reward_team": self.team,
                "reward_local": self.local.value if self.local.mask else None}

    def figures(self) -> dict:
        """What the row's meta records (and a coach request's context carries)."""
        return {"env_reward": self.value, "env_team": self.team,
                "env_local": self.local.value, "env_mask": self.local.mask,
                "env_scores": dict(self.local.scores)}


def team_outcome(reasoner: str | None, tool: str | None, truth: str,
                 last_step: bool) -> tuple[bool, float]:
    """(the step ends the episode, r_team): it ends when both answers exist and agree, or on
    the last step; r_team = 1 when it ends with the reasoner's answer right."""
    ended = last_step or (reasoner is not None and tool is not None
                          and check_final(reasoner, tool))
    return ended, float(ended and check_final(reasoner, truth))


def reasoner_reward(answer: str | None, truth: str, tool_answer: str | None,
                    lam: float) -> tuple[StepReward, bool]:
    """A reasoner candidate's reward and whether it ends the episode (the tool still follows
    it within a turn, so only agreement ends it)."""
    ended, team = team_outcome(answer, tool_answer, truth, last_step=False)
    scores = None
    if truth_available(truth):
        scores = {"fmt": float(answer is not None), "tool": 0.0,
                  "step": float(check_final(answer, truth))}
    return StepReward(team, local_reward(REASONER_COEFFICIENTS, scores), lam), ended


def tool_reward(ran: bool, ok: bool, answer: str | None, finish_reason: str, truth: str,
                reasoner_answer: str | None, last_step: bool,
                lam: float) -> tuple[StepReward, bool]:
    """A tool candidate's reward and whether it ends the episode; `ran`: its code block ran
    (False without one: no logs, m = 0)."""
    ended, team = team_outcome(reasoner_answer, answer, truth, last_step)
    scores = None
    if ran and truth_available(truth):
        scores = {"fmt": float(finish_reason != "length"), "tool": float(ok),
                  "step": float(check_final(answer, truth))}
    return StepReward(team, local_reward(TOOL_COEFFICIENTS, scores), lam), ended


# ------------------------------------------------------------------------------ prompts

REASONER_FIRST = """You are a helpful assistant that solves math problems via careful reasoning.

Problem:
{problem}

First, outline the key reasoning steps. Then carry out the full solution. After solving, present the final answer in a LaTeX box.
Before giving the full reasoning, summarize the steps clearly in:
**Reasoning Steps:**
<reasoning steps here>
Then provide your complete solution concisely. Put your final answer in \\boxed{{<answer>}}.
Rules:
* The boxed value must be a single number or expression (simplified if possible).
* Do not add words after the box.
* If multiple answers exist, list them in a single \\boxed{{}} separated by commas."""
REASONER_REFINE = """You are a helpful assistant that refines mathematical solutions through reasoning.

Problem:
{problem}

History (previous attempts and outputs):
{history}

First, compare your previous boxed answer with the Python Tool Agent's printed output.
* If the code output corrects a computational slip in your reasoning, adopt the corrected value.
* If the code likely has a bug (e.g., mishandled edge cases, precision, domains), keep the mathematically correct answer and explain briefly.
Then solve the problem again, more robustly. Before giving the full reasoning, summarize the key steps clearly:
**Reasoning Steps:**
<reasoning steps here>
Finish with the final answer in \\boxed{{<answer>}}; nothing may follow the box."""
TOOL_FIRST = """You are a helpful programming assistant that writes Python to solve the math problem.

Problem:
{problem}

Requirements:
Write correct, readable Python that computes the final answer. Think step by step in comments if helpful. Use only the standard library and deterministic math (no internet, no randomness). At the end, PRINT ONLY the final numeric or symbolic answer (nothing else).
Respond with the program in one ```python block."""
TOOL_REFINE = """You are a helpful programming assistant that refines Python solutions for math problems.

Problem:
{problem}

History (reasoning vs. execution mismatches):
{history}

Tasks:
1. Judge whether the Reasoning Agent's boxed answer or your previous printed result is more likely correct (consider numerical stability, edge cases, exact vs. float).
2. Fix or rewrite the code so it reliably computes the correct final answer.
* Prefer exact arithmetic (fractions, integers, rational simplification) when possible.
* Add minimal checks for domain/edge cases.
* Keep outputs deterministic.
Respond in the format:
**Code:**
```python
# corrected code here
# print ONLY the final answer on the last line
```"""


def clip(text: str, limit: int) -> str:
    """`text` cut to `limit` characters, keeping head and tail (answers sit at the end)."""
    if len(text) <= limit:
        return text
    keep = max(limit - 7, 2)
    return text[:keep - keep // 2] + " [...] " + text[len(text) - keep // 2:]


def recent(entries: list[str], limit: int) -> str:
    """The newest history entries that fit in `limit` characters, oldest first."""
    kept, used = [], 0
    for entry in reversed(entries):
        if kept and used + len(entry) + 2 > limit:
            break
        kept.append(clip(entry, limit))
        used += len(kept[-1]) + 2
    return "\n\n".join(reversed(kept))


# ------------------------------------------------------------------------------ the workflow

@dataclass
class Candidate:
    """One of a step's K candidates: its reward, whether it ends the episode, what the
    workflow keeps of it (`detail`), its row annotations (`meta`); `failed`: its sandbox run
    failed (the row is FAILED, never rewarded nor kept)."""

    action: Action
    reward: StepReward
    ends: bool
    detail: Any = None
    meta: dict[str, Any] = field(default_factory=dict)
    failed: bool = False


def select(candidates: list[Candidate]) -> Candidate:
    """The candidate with the highest λ-mixed reward, ties to the first (Alg. 1 line 13)."""
    usable = [c for c in candidates if not c.failed]
    if not usable:
        raise RuntimeError("every candidate's sandbox run failed (the sandbox itself): the "
                           "round is lost")
    return max(usable, key=lambda c: c.reward.value)  # max keeps the first of equal values


@dataclass
class Trace:
    """The episode's candidates as the behaviour metrics count them (every candidate)."""

    tokens: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    actions: Counter = field(default_factory=Counter)  # agent -> candidates that may use a tool
    calls: Counter = field(default_factory=Counter)  # agent -> candidates that used it
    clean: Counter = field(default_factory=Counter)  # agent -> of those, runs that went well
    step_ids: list[str] = field(default_factory=list)  # rows that were not FAILED

    def tool(self, agent: str, called: bool, clean: bool) -> None:
        self.actions[agent] += 1
        self.calls[agent] += called
        self.clean[agent] += called and clean

    def metrics(self, solved: bool, turns: int) -> dict[str, float]:
        """success, turns, turns_to_solve (solved episodes only) and behavior/<agent>/…"""
        out = {"success": float(solved), "turns": float(turns)}
        if solved:
            out["turns_to_solve"] = float(turns)  # averaged over solved episodes only
        for agent, tokens in self.tokens.items():
            out[f"behavior/{agent}/response_tokens"] = sum(tokens) / len(tokens)
        for agent, actions in self.actions.items():
            out[f"behavior/{agent}/tool_call_rate"] = self.calls[agent] / actions
            if self.calls[agent]:
                out[f"behavior/{agent}/tool_success"] = self.clean[agent] / self.calls[agent]
        return out


async def settle(episode, candidates: list[Candidate], prompt: str, reward_source: str,
                 trace: Trace) -> Candidate:
    """Record every candidate's rewards and figures on its row, keep the best, return it.

    reward_source "inline": the row's `reward` is r (READY on arrival, never coached);
    "coach": only the components, and the coach is asked with r in the context.
    """
    best = select(candidates)
    episode.keep(best.action)
    for candidate in candidates:
        action, reward = candidate.action, candidate.reward
        trace.tokens[action.agent].append(len(action.response_ids))
        episode.annotate(action.step_id, **reward.figures(), **candidate.meta,
                         ends=candidate.ends, kept=candidate is best)
        if candidate.failed:
            continue  # FAILED `sandbox`: neither rewarded nor coached
        trace.step_ids.append(action.step_id)
        if reward_source == "inline":
            episode.reward(action.step_id, reward=reward.value, **reward.row_rewards())
        else:
            episode.reward(action.step_id, **reward.row_rewards())
            await episode.coach([action], input_text=prompt,
                                context={"step_reward": reward.value, **reward.figures()})
    return best


@register("math_duo", MathDuoConfig)
class MathDuo:
    name = "math_duo"
    agents = ("reasoner", "tool")
    sampling = "tree"
    coach_prompt = ""  # no LLM-coach template: rewards come from the environment

    def __init__(self, cfg: MathDuoConfig) -> None:
        self.cfg = cfg
        self.tool = CodeTool(cfg.sandbox, cfg.observation_chars)
        self._problems = MathChat(MathChatConfig(steps=cfg.steps, max_number=cfg.max_number))

    @property
    def team_lambda(self) -> float:
        """λ of the rows' rewards and of the kept candidates; runtime.config checks that a
        model trained with `at_grpo` mixes with the same."""
        return self.cfg.team_lambda

    def make_task(self, rng: random.Random, index: int) -> Task:
        """mathchat's generated problem (word or arithmetic, integer answer)."""
        return dataclasses.replace(self._problems.make_task(rng, index),
                                   task_id=f"math_duo-{index}")

    def groups_per_round(self, agent: str, group_size: int) -> int:
        return self.cfg.horizon  # one K-candidate group per agent per turn, at most T turns

    def rule_score(self, agent, task, output_text, finish_reason, context) -> float:
        """The rule coach's score: the r this workflow's environment gave the action, sent in
        the request's context (`reward_source: coach`); nothing is made up without it."""
        if "step_reward" not in context:
            raise ValueError("math_duo: no step_reward in the coach request's context; "
                             "rewards come from the environment step (reward_source)")
        return float(context["step_reward"])

    # ------------------------------------------------------------------ steps
    async def _reasoner_step(self, episode, task: Task, turn: int, path: str,
                             history: list[str], tool_answer: str | None,
                             trace: Trace) -> Candidate:
        cfg = self.cfg
        template = REASONER_FIRST if turn == 1 else REASONER_REFINE
        prompt = template.format(problem=task.prompt,
                                 history=recent(history, cfg.history_chars))
        actions = await episode.act(
            "reasoner", [{"role": "user", "content": prompt}], turn=turn,
            n=episode.group_size, max_new_tokens=cfg.reasoner_tokens, parent_branch=path,
            prefix=cfg.reasoner_prefix)
        candidates = []
        for action in actions:
            answer = final_answer(action.text)
            reward, ends = reasoner_reward(answer, task.truth, tool_answer, cfg.team_lambda)
            candidates.append(Candidate(action, reward, ends, answer, {"answer": answer}))
        return await settle(episode, candidates, prompt, cfg.reward_source, trace)

    async def _run_code(self, episode, action: Action) -> ToolResult:
        with self.tool.workspace() as workspace:  # one per run: candidates never share files
            return await self.tool.call(episode, action, workspace)

    async def _tool_step(self, episode, task: Task, turn: int, path: str, history: list[str],
                         reasoner_answer: str | None, trace: Trace) -> Candidate:
        cfg = self.cfg
        template = TOOL_FIRST if turn == 1 else TOOL_REFINE
        prompt = template.format(problem=task.prompt,
                                 history=recent(history, cfg.history_chars))
        actions = await episode.act(
            "tool", [{"role": "user", "content": prompt}], turn=turn, n=episode.group_size,
            max_new_tokens=cfg.tool_tokens, parent_branch=path, prefix=cfg.tool_prefix,
            stop=self.tool.stop_strings(cfg.tool_prefix))
        runs = await asyncio.gather(*(self._run_code(episode, a) for a in actions))
        candidates = []
        for action, run in zip(actions, runs):
            ran = run.called and not run.infra_error
            trace.tool("tool", ran, run.ok)
            answer = printed_answer(run.stdout) if ran else None
            reward, ends = tool_reward(ran, run.ok, answer, action.finish_reason, task.truth,
                                       reasoner_answer, turn == cfg.horizon, cfg.team_lambda)
            candidates.append(Candidate(action, reward, ends, (answer, run), {"answer": answer},
                                        failed=bool(run.infra_error)))
        return await settle(episode, candidates, prompt, cfg.reward_source, trace)

    # ------------------------------------------------------------------ the episode
    async def run(self, task: Task, episode) -> dict[str, float]:
        cfg, trace = self.cfg, Trace()
        history: list[str] = []
        path, reasoner_answer, tool_answer = "", None, None
        turn, ended = 0, False
        while not ended and turn < cfg.horizon:
            turn += 1
            kept = await self._reasoner_step(episode, task, turn, path, history, tool_answer,
                                             trace)
            path, reasoner_answer, ended = tree_path(path, kept.action.candidate), \
                kept.detail, kept.ends
            history.append(f"Turn {turn}, Reasoning Agent's solution:\n"
                           f"{clip(kept.action.text.strip(), cfg.history_chars // 2)}\n"
                           f"Its boxed answer: {reasoner_answer or '(none)'}")
            if ended:
                break
            kept = await self._tool_step(episode, task, turn, path, history, reasoner_answer,
                                         trace)
            (tool_answer, run), ended = kept.detail, kept.ends
            path = tree_path(path, kept.action.candidate)
            code = "\n\n".join(python_blocks(kept.action.text)) or "(no code block)"
            output = run.observation if run.called else "(no code ran)"
            history.append(f"Turn {turn}, Python Tool Agent's code:\n```python\n{code}\n```\n"
                           f"Printed output:\n{clip(output, cfg.observation_chars)}")
        solved = check_final(reasoner_answer, task.truth)
        for step_id in trace.step_ids:
            episode.reward(step_id, outcome=float(solved))
        agreed = tool_answer is not None and check_final(reasoner_answer, tool_answer)
        return {**trace.metrics(solved, turn), "agreed": float(agreed)}
