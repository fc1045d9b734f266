"""magrpo_code: single-turn MAGRPO on HumanEval, an auxiliary coder and a main coder.

MAGRPO (Liu et al.; /work/shared/papers/magrpo.txt), "Coding Collaboration" (lines 197-215),
Algorithm 1 (lines 85-102) and eq. 1 (line 109) with H = 1, appendix C (line 544, settings;
lines 566-574, the reward) and appendix D (lines 612-643, the prompts).

The agents. `aux` writes a helper function named `aux`; `main` writes the task's entry point and
may call `aux` (lines 616-643). They act once, at the same time, each from the task alone: the
single-turn setting uses the naive-concatenation prompts (line 687), in which both "generate
code synchronously" and the main agent "lacks information about the specific functionality of
the auxiliary agent" (line 672; "without any direct communication", line 199). The episode runs
the two `Episode.act` calls concurrently and neither prompt holds the other's reply.

A round (DESIGN §4, `sampling = "joint"`) is G = `workflow.group_size` episodes of one task;
each agent's G actions at turn 0 form its group (Alg. 1 step 6, line 92: G responses per
agent). The two replies, with the prompt's imports and helpers, form one program; MAGRPO's
level-based joint reward scores it (magrpo_code_reward.py: structure, syntax, hidden-test pass
rate, cooperation; at most 4.0). The program runs on the task's hidden tests in the sandbox
(humaneval.run_jobs, `test_timeout_s` a test: 10 s, line 572) only when structure and syntax
passed, the levels that gate the tests.

Joint modes. The paper defines one: "the actions of individual agents are aggregated to form a
group of joint actions" (line 105), the g-th joint action being the g-th response of every agent
(Alg. 1 step 6, line 92), rewarded jointly (step 7, line 93), with eq. 1 over g = 1..G. That is
`aligned`. The words "aligned" and "cross" never name joint modes in the paper ("aligned
rewards", lines 18 and 227, means the shared objective; "cross-adaptation", lines 219 and 384,
is about a baseline).
Both modes come from the authors' released trainer (its `joint_mode` setting):
  aligned  joint action g = (aux_g, main_g): G joint rewards. Both rows of episode g carry
           R(aux_g, main_g). Train with `advantage: magrpo` (it checks that a joint action's
           rows agree) or `grpo`: with H = 1 the two give the same advantage, and grpo's
           group readiness keeps a round's G rows in one batch, which magrpo's per-episode
           readiness does not promise when several rounds are in flight.
  cross    every pairing: the G × G joint actions (aux_j, main_k), each rewarded. The released
           trainer credits a sample with the joint rewards of every joint action it is part of
           (their sum) and takes eq. 1 over each agent's G samples. Here a row's reward is their
           mean (the same advantage under eq. 1's std; the level scale, 0..4, is kept):
             aux row of episode j:  (1/G) Σ_k R(aux_j, main_k)
             main row of episode k: (1/G) Σ_j R(aux_j, main_k)
           Rows and groups are the aligned layout's (one row per agent per episode; an agent's
           G rows of the round form its group); only the rewards differ, so the two rows of an
           episode no longer share one joint reward: `advantage: magrpo` is a config error
           (`estimator_error`; its learner refuses such rows when one model trains both
           agents, and with one model per agent it would never see the two differ), and
           `advantage: grpo` trains them (eq. 1 per agent's group, group readiness). The G
           episodes of a round meet in `_CrossRound`: each posts its code, the last one
           scores the G² pairs (identical pairs once) and all read the matrix. A round of
           one (scripts/evaluate.py plays rounds of one) is aligned.

Rows: `reward` = `reward_team` = the row's joint reward (divided by 4.0 with
`normalize_reward`; off by default: eq. 1's std makes the advantage the same either way, and the
paper normalises only to report, Table 2 "normalized within the return scale"), `outcome` =
1{the episode's own program passes every hidden test}. Meta: the level breakdown of the
episode's own pair (structure, syntax, tests, cooperation, level_reward, stopped_at), pass_rate,
success, the pass vector, the static checks, and in cross mode `pair_rewards` (the G joint
rewards the row's reward averages). A sandbox failure (not the model's code) leaves a pair
unscored: aligned fails both rows (`sandbox`); cross averages over the scored pairs and fails a
row none of whose pairs was scored. Episode metrics: success, pass_rate, the levels and the
total of the episode's own pair, and behaviour (`behavior/<agent>/…`: response tokens,
truncated replies, aux/entry point defined, main calls aux, wraps it, discards its result).

Where the paper is silent (see also magrpo_code_reward.py):
  - G: the released HumanEval config's num_generations = 4 (configs carry it).
  - Prompt layout: the appendix's words, one instruction a line; "Problem:" on its own line
    with the task prompt under it (the released formatter does so); the format example as
    indented Python (the appendix shows `\\n` escapes and lost indentation); ```python for the
    appendix's ‘‘‘python. Sent as one user chat message (the model's chat template).
  - {params}: the entry point's parameters as the prompt's signature writes them (ast), not
    the first `def` of the prompt (the released regex), which for HumanEval/10, 32, 38 and 50
    is a helper the prompt defines first.
  - Reply length: `aux_tokens` / `main_tokens`, 256 in the released config.
  - Tasks: HumanEval split by a hash of task_id (`eval_fraction`, humaneval.py), as code_duo.

    python scripts/launch_async.py --config configs/magrpo_code_tiny.yaml
"""
from __future__ import annotations

import ast
import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from actors.episode import Action
from actors.sandbox import SandboxConfig, SandboxError
from actors.workflows.base import Task
from actors.workflows.humaneval import (HumanEvalTasks, Job, JobResult, Suite, hidden_suite,
                                        run_jobs)
from actors.workflows.magrpo_code_reward import (MAX_REWARD, CodeChecks, LevelReward, agent_code,
                                                 code_checks, level_reward)
from actors.workflows.registry import register
from actors.workflows.tools import CodeTool

log = logging.getLogger(__name__)

JOINT_MODES = ("aligned", "cross")
AGENTS = ("aux", "main")

AUX_PROMPT = """Create a helper function for this coding problem.
Problem:
{prompt}
Instructions:
- Output ONLY the function code, no explanations or examples
- Do NOT include markdown code blocks (```python)
- Do NOT include any text before or after the function
- Do NOT include test cases or example usage
- Create a helper function named aux that can assist the main function
- The function should return useful data for solving the problem
Your output should follow this format:
def aux(...):
    # your code here
    return result"""
MAIN_PROMPT = """Solve this coding problem by implementing the required function.
Problem:
{prompt}
You have access to a helper function: aux(...)
Instructions:
- Output ONLY the function code, no explanations or examples
- Do NOT include markdown code blocks (```python)
- Do NOT include any text before or after the function
- Do NOT include test cases or example usage
- Do NOT redefine the aux() function
- Implement ONLY the '{entry_point}' function as specified
- You can call aux() to assign a value to a variable within your function if helpful
Your output should follow this format:
def {entry_point}({params}):
    # your function code here
    return result"""


@dataclass
class MagrpoCodeConfig:
    joint_mode: str = "aligned"  # "aligned": pair g = (aux_g, main_g); "cross": all G² pairs
    aux_tokens: int = 256  # max new tokens of the helper's reply (released config: 256)
    main_tokens: int = 256  # max new tokens of the main agent's reply
    # opens every reply (prompt tokens, never trained); "{entry_point}" and "{params}" are
    # filled in, e.g. "def {entry_point}({params}):\n" for a small model
    aux_prefix: str = ""
    main_prefix: str = ""
    normalize_reward: bool = False  # rows carry the level total / 4.0 (in [0, 1]) instead
    test_timeout_s: float = 10.0  # wall clock per hidden test (line 572: 10 s)
    eval_fraction: float = 0.2  # HumanEval's eval split: blake2b(task_id) / 2**64 below this
    # where the joint program runs (one run per scored pair; the build may take 5 test limits)
    sandbox: SandboxConfig = field(
        default_factory=lambda: SandboxConfig(timeout_s=60.0, cpu_s=60))

    def __post_init__(self) -> None:
        if self.joint_mode not in JOINT_MODES:
            raise ValueError(f"workflow.params.joint_mode={self.joint_mode!r}: use one of "
                             f"{list(JOINT_MODES)} (aligned: the paper's G joint actions)")
        for name in ("aux_tokens", "main_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"workflow.params.{name}={getattr(self, name)}: must be >= 1 "
                                 "(the released config uses 256)")
        if not (math.isfinite(self.test_timeout_s) and self.test_timeout_s > 0):
            raise ValueError(f"workflow.params.test_timeout_s={self.test_timeout_s}: must be "
                             "> 0 (the paper's is 10 s a test)")
        if not 0 < self.eval_fraction < 1:
            raise ValueError(f"workflow.params.eval_fraction={self.eval_fraction}: use a value "
                             "in (0, 1) (0.2 puts 28 of HumanEval's 164 problems in eval)")
        if self.sandbox.timeout_s < 2 * self.test_timeout_s:
            raise ValueError(f"workflow.params.sandbox.timeout_s={self.sandbox.timeout_s} is "
                             f"below 2 x test_timeout_s={self.test_timeout_s}: one slow test "
                             "would end the run; raise sandbox.timeout_s")


def signature_params(prompt: str, entry_point: str) -> str:
    """The entry point's parameters as the prompt's `def` writes them ("..." if not found)."""
    try:
        body = ast.parse(prompt).body
    except SyntaxError:
        return "..."
    found = [node for node in body
             if isinstance(node, ast.FunctionDef) and node.name == entry_point]
    return ast.unparse(found[-1].args) if found else "..."


def prompts(task: Task) -> dict[str, str]:
    """Appendix D's two prompts for a task (module docstring, "Prompt layout")."""
    entry_point = task.extra["entry_point"]
    problem = task.prompt.strip("\n")
    return {"aux": AUX_PROMPT.format(prompt=problem),
            "main": MAIN_PROMPT.format(prompt=problem, entry_point=entry_point,
                                       params=signature_params(task.prompt, entry_point))}


@dataclass(frozen=True)
class PairScore:
    """One (aux code, main code) pair: its checks, its hidden-test run and its reward.

    `run` is None when the tests did not run (a gating level failed, or the sandbox did);
    `level` is None only when the sandbox itself failed (the pair is unscored).
    """

    checks: CodeChecks
    run: JobResult | None
    level: LevelReward | None

    @property
    def success(self) -> bool:
        return self.run is not None and self.run.all_passed

    def meta(self) -> dict:
        """The row annotations of an episode's own pair."""
        out = {"aux_defined": self.checks.aux_defined, "main_defined": self.checks.main_defined,
               "compiles": self.checks.compiles, "calls_aux": self.checks.calls_aux,
               "wraps_aux": self.checks.wraps_aux,
               "discards_aux_result": self.checks.discards_aux_result,
               "tests_passed": self.run.to_json() if self.run else None,
               "pass_rate": self.run.pass_rate if self.run else 0.0,
               "success": self.success, "scored": self.level is not None}
        if self.level is not None:
            out.update(structure=self.level.structure, syntax=self.level.syntax,
                       tests=self.level.tests, cooperation=self.level.cooperation,
                       level_reward=self.level.total, stopped_at=self.level.stopped_at)
        return out


ScoreAll = Callable[[list[tuple[str, str]]], Awaitable[list[list[PairScore]]]]


class _CrossRound:
    """The meeting point of one cross-mode round's G episodes (they run in one rollout actor).

    Each episode posts its (aux code, main code); the last to post scores every pairing and
    resolves `matrix` (matrix[j][k] = the pair (aux_j, main_k)) for all. An episode that fails
    aborts the round, so its siblings raise instead of waiting forever.
    """

    def __init__(self, round_id: str, size: int) -> None:
        self.round_id, self.size = round_id, size
        self.codes: dict[int, tuple[str, str]] = {}
        self.matrix: asyncio.Future = asyncio.get_running_loop().create_future()
        self.left = 0  # episodes done with the round (it is forgotten when all G are)

    def abort(self, exc: BaseException) -> None:
        if not self.matrix.done():
            self.matrix.set_exception(RuntimeError(
                f"cross-mode round {self.round_id}: a sibling episode failed ({exc!r})"))
            self.matrix.exception()  # retrieved: a round whose every episode failed is quiet

    async def post(self, index: int, codes: tuple[str, str],
                   score_all: ScoreAll) -> list[list[PairScore]]:
        self.codes[index] = codes
        if len(self.codes) == self.size and not self.matrix.done():
            self.matrix.set_result(await score_all([self.codes[i] for i in range(self.size)]))
        return await self.matrix


@register("magrpo_code", MagrpoCodeConfig)
class MagrpoCode:
    name = "magrpo_code"
    agents = AGENTS
    sampling = "joint"
    coach_prompt = ""  # no LLM-coach template: the joint reward is set inline

    def __init__(self, cfg: MagrpoCodeConfig) -> None:
        self.cfg = cfg
        self.tool = CodeTool(cfg.sandbox)
        # HumanEval split by task id (an actors.tasks.TaskSplits, as code_duo's)
        self.make_task = HumanEvalTasks(cfg.eval_fraction)
        self._rounds: dict[str, _CrossRound] = {}  # cross mode: round_id -> its meeting point

    def groups_per_round(self, agent: str, group_size: int) -> int:
        return 1  # the agent's G actions at turn 0 across the round

    def estimator_error(self, advantage: str) -> str:
        """Why a learner with `advantage` cannot train this workflow's rows ("" if it can);
        runtime.config turns it into a config error."""
        if self.cfg.joint_mode == "cross" and advantage == "magrpo":
            return ("workflow.params.joint_mode=cross gives each row the mean joint reward of "
                    "its G pairings, so the two rows of an episode differ, while magrpo takes "
                    "one joint reward per joint action (and refuses such rows when one model "
                    "trains both agents); use advantage=grpo (eq. 1 over each agent's G rows), "
                    "or joint_mode=aligned")
        return ""

    def rule_score(self, agent, task, output_text, finish_reason, context) -> float:
        # The joint reward is set inline; raising (the pool marks the row FAILED) beats
        # inventing a per-action score for a reward that only a pair has.
        raise ValueError("magrpo_code has no per-action coach rule: the joint reward is inline")

    # ------------------------------------------------------------------ scoring
    def _value(self, level: LevelReward) -> float:
        return level.total / MAX_REWARD if self.cfg.normalize_reward else level.total

    async def score_pair(self, task: Task, hidden: Suite, aux_code: str,
                         main_code: str) -> PairScore:
        """The level reward of one pair; the hidden tests run only past structure and syntax."""
        entry_point = task.extra["entry_point"]
        checks = code_checks(task.prompt, entry_point, aux_code, main_code)
        if not checks.needs_tests:
            return PairScore(checks, None, level_reward(checks, ()))
        try:
            with self.tool.workspace() as workspace:
                [run] = await run_jobs(self.tool.sandbox, workspace, [Job(checks.program, hidden)],
                                       entry_point, self.cfg.test_timeout_s)
        except SandboxError as exc:  # counted: the pair is unscored, its rows may FAIL
            self.tool.infra_failures += 1
            log.warning("sandbox failure (%d so far): %s", self.tool.infra_failures, exc)
            return PairScore(checks, None, None)
        return PairScore(checks, run, level_reward(checks, run.passed))

    async def score_all(self, task: Task, hidden: Suite,
                        codes: list[tuple[str, str]]) -> list[list[PairScore]]:
        """matrix[j][k]: the pair (aux code of episode j, main code of episode k)."""
        pairs = [(a, m) for a, _ in codes for _, m in codes]
        unique = list(dict.fromkeys(pairs))  # identical pairs are scored once
        scored = dict(zip(unique, await asyncio.gather(
            *(self.score_pair(task, hidden, a, m) for a, m in unique))))
        size = len(codes)
        return [[scored[pairs[j * size + k]] for k in range(size)] for j in range(size)]

    # ------------------------------------------------------------------ the episode
    async def _act(self, episode, task: Task) -> tuple[Action, Action]:
        """Both agents at once, each from the task alone (decentralised, line 672)."""
        texts = prompts(task)
        entry_point = task.extra["entry_point"]
        params = signature_params(task.prompt, entry_point)

        async def act(agent: str, tokens: int, prefix: str) -> Action:
            prefix = prefix.replace("{entry_point}", entry_point).replace("{params}", params)
            (action,) = await episode.act(agent, [{"role": "user", "content": texts[agent]}],
                                          turn=0, max_new_tokens=tokens, prefix=prefix)
            return action

        cfg = self.cfg
        aux, main = await asyncio.gather(act("aux", cfg.aux_tokens, cfg.aux_prefix),
                                         act("main", cfg.main_tokens, cfg.main_prefix))
        return aux, main

    async def _play_cross(self, episode, task: Task,
                          hidden: Suite) -> tuple[Action, Action, list[list[PairScore]]]:
        """Act, then meet the round's siblings and read the G × G matrix of pair scores."""
        meeting = self._rounds.get(episode.round_id)
        if meeting is None:
            meeting = self._rounds[episode.round_id] = _CrossRound(episode.round_id,
                                                                   episode.round_size)
        try:
            aux, main = await self._act(episode, task)
            matrix = await meeting.post(
                episode.round_index, (agent_code(aux.text), agent_code(main.text)),
                lambda codes: self.score_all(task, hidden, codes))
        except BaseException as exc:  # re-raised; the siblings must not wait for this one
            meeting.abort(exc)
            raise
        finally:
            meeting.left += 1
            if meeting.left == meeting.size:
                del self._rounds[episode.round_id]
        return aux, main, matrix

    async def run(self, task: Task, episode) -> dict[str, float]:
        hidden = hidden_suite(task.extra["test"], task.extra["entry_point"])
        cross = self.cfg.joint_mode == "cross" and episode.round_size > 1
        if cross:
            aux, main, matrix = await self._play_cross(episode, task, hidden)
            g = episode.round_index
            own, aux_pairs, main_pairs = matrix[g][g], matrix[g], [row[g] for row in matrix]
        else:
            aux, main = await self._act(episode, task)
            own = await self.score_pair(task, hidden, agent_code(aux.text),
                                        agent_code(main.text))
            aux_pairs = main_pairs = [own]
        for action, pairs in ((aux, aux_pairs), (main, main_pairs)):
            self._record(episode, action, own, pairs, cross)
        return self._metrics(aux, main, own)

    def _record(self, episode, action: Action, own: PairScore, pairs: list[PairScore],
                cross: bool) -> None:
        """The row's reward: its joint reward (aligned), or the mean over its pairings."""
        values = [self._value(p.level) for p in pairs if p.level is not None]
        meta = {"joint_mode": "cross" if cross else "aligned", **own.meta()}
        if cross:
            meta["pair_rewards"] = [None if p.level is None else p.level.total for p in pairs]
        episode.annotate(action.step_id, **meta)
        if not values:
            episode.fail(action.step_id, "sandbox")
            return
        reward = values[0] if not cross else sum(values) / len(values)
        episode.reward(action.step_id, reward=reward, reward_team=reward,
                       outcome=float(own.success))

    @staticmethod
    def _metrics(aux: Action, main: Action, own: PairScore) -> dict[str, float]:
        checks = own.checks
        out = {f"behavior/{a.agent}/{key}": value for a in (aux, main) for key, value in (
            ("response_tokens", float(len(a.response_ids))),
            ("truncated", float(a.finish_reason == "length")))}
        out.update({"behavior/aux/defines_aux": float(checks.aux_defined),
                    "behavior/main/defines_entry_point": float(checks.main_defined),
                    "behavior/main/calls_aux": float(checks.calls_aux),
                    "behavior/main/wraps_aux": float(checks.wraps_aux),
                    "behavior/main/discards_aux_result": float(checks.discards_aux_result)})
        if own.level is None:
            return {**out, "sandbox_failures": 1.0}
        level = own.level
        return {**out, "success": float(own.success),
                "pass_rate": own.run.pass_rate if own.run else 0.0,
                "reward": level.total, "structure": level.structure, "syntax": level.syntax,
                "tests": level.tests, "cooperation": level.cooperation}
