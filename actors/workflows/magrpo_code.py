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

Multi-turn (`turns` = H > 1; the paper's setting is H = 2 with external feedback, line 215,
Figure 5, and γ = 1.0, line 544). One episode a task holds the whole joint tree (Algorithm 1
steps 5-8, the released trainer's tree expansion): at a node both agents draw G replies from
their prompts (`Episode.act(n=G)`, so an agent's G rows at a node are its group, and each
row's `branch` is the node's tree path), the g-th replies form joint action g, scored by the
level reward like a single-turn pair. Then, unless t = H - 1 or the node terminates early
(`termination_threshold`: the mean of its G joint rewards above it, the released trainer's
rule), every scored joint action g is shown to the advisor (`Episode.consult`, DESIGN §14:
the coach pool's endpoints, limits, retries and breaker) with appendix D's external-agent
prompt (lines 647-656: problem, example tests, the joint program) and expands into its own
child node on branch `tree_path(branch, g)`, whose prompts are each agent's first-turn prompt,
its previous reply and the advisor's words for it (line 687; `split_feedback` takes the
reply's `aux`/`main` JSON fields, else the whole reply). A full tree has 1 + G + ... + G^(H-1)
nodes and G^H leaves. The advisor's reply is an observation, never a row; when the pool gives
up on it (`AdvisorFailure`, counted) the child is still played, its prompt saying that no
feedback came (the released code also goes on without edits). Train with `advantage: magrpo`
and `buffer.readiness: episode`: a joint action's return is its reward plus γ times the mean
return of its child node's G joint actions (learners/advantages.py `joint_returns`), and eq. 1
runs within each node's G joint actions; the whole tree is one episode, so it reaches the
learner in one piece. Only the latest turn's reply and feedback enter a prompt (H > 2 keeps
prompts bounded); cross mode is single-turn only (a node would have G² children).

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
import json
import logging
import math
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from actors.episode import Action, AdvisorFailure
from actors.sandbox import SandboxConfig, SandboxError
from actors.workflows.base import Task
from actors.workflows.humaneval import (HumanEvalTasks, Job, JobResult, Suite, hidden_suite,
                                        run_jobs)
from actors.workflows.magrpo_code_reward import (MAX_REWARD, CodeChecks, LevelReward, agent_code,
                                                 code_checks, level_reward)
from actors.workflows.registry import register
from actors.workflows.tools import CodeTool
from buffers.schema import tree_path

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

# Appendix D, "External Agent" (lines 647-656), one instruction a line; the JSON line shows the
# form the reply is parsed in (`split_feedback`), the appendix's `{ "aux": {{...}}, ...}`.
ADVISOR_PROMPT = """You are an advisor helping 2 agents (an auxiliary agent and a main agent) \
solve the following problem. The auxiliary agent provides a helper function (aux), while the \
main agent defines the task-specific logic.
Problem:
{prompt}
Example tests:
{test}
Show your feedback and edits for the following code:
{combined_code}
Instructions:
- If you identify a missing element, such as an undefined aux or missing entry point (main \
function), you should write one for it.
- If both are not missing, point out and make changes to any critical syntax or logic errors \
that would prevent the code from passing the given unit tests.
- You should focus only on clear errors on the given unit tests, be conservative and lenient, \
ignoring issues like redundancy, inefficiency, lack of edge case handling, or type annotations.
- Return "Perfect! No edits needed!" if the logic is sound.
Your response MUST contain the JSON format specified below. Always include both aux and main \
fields, even if no edits are needed.
{{"aux": "...", "main": "..."}}"""
# A later turn's prompt (line 687: "the suggestions, as well as the prior information and their
# previous response, are incorporated into the prompt for the subsequent round"): the agent's
# first-turn prompt, its reply of the turn before and the advisor's words for it.
FOLLOWUP = """{first}

Your previous response:
{previous}

Here is the feedback from an advisor:
{feedback}"""
NO_FEEDBACK = "(no feedback: the advisor did not answer)"


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
    # H, the turns of the joint tree (1: single-turn; the paper's multi-turn setting is 2,
    # Figure 5); between turns the advisor (coach.advisor) comments on every joint action
    turns: int = 1
    # a node whose G joint rewards average above this is not expanded (the released trainer's
    # early termination); null: every node expands to the horizon (Algorithm 1)
    termination_threshold: float | None = None
    feedback_chars: int = 2000  # at most this much of the advisor's feedback enters a prompt
    # each of the advisor prompt's {prompt}, {test} and {combined_code} cut to this many
    # characters (0: whole); a small advisor model's context is short
    advisor_field_chars: int = 0
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
        if self.turns < 1:
            raise ValueError(f"workflow.params.turns={self.turns}: must be >= 1 (1: single-turn; "
                             "the paper's multi-turn setting uses 2)")
        if self.turns > 1 and self.joint_mode != "aligned":
            raise ValueError(f"workflow.params.joint_mode={self.joint_mode!r} with turns="
                             f"{self.turns}: the multi-turn joint tree expands aligned joint "
                             "actions only (cross would give G^2 children a node); use "
                             "joint_mode=aligned, or turns=1 for cross")
        if self.termination_threshold is not None and not math.isfinite(
                self.termination_threshold):
            raise ValueError(f"workflow.params.termination_threshold="
                             f"{self.termination_threshold}: give a finite reward (the level "
                             "scale, 0..4, or 0..1 with normalize_reward), or null")
        for name in ("feedback_chars", "advisor_field_chars"):
            if getattr(self, name) < 0:
                raise ValueError(f"workflow.params.{name}={getattr(self, name)}: must be >= 0")
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


def _cut(text: str, limit: int) -> str:
    return text if not limit or len(text) <= limit else text[:limit] + "\n..."


def advisor_messages(task: Task, program: str, field_chars: int = 0) -> list[dict[str, str]]:
    """The advisor's chat for one joint action: appendix D's external-agent prompt with the
    task, its tests and the joint program (each cut to `field_chars` when > 0)."""
    return [{"role": "user", "content": ADVISOR_PROMPT.format(
        prompt=_cut(task.prompt.strip("\n"), field_chars),
        test=_cut(task.extra["test"].strip("\n"), field_chars),
        combined_code=_cut(program, field_chars))}]


_JSON_OBJECT = re.compile(r"\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\}", re.S)


def split_feedback(reply: str) -> dict[str, str]:
    """Each agent's part of the advisor's reply: the `aux` and `main` fields of its last JSON
    object that has either (the prompt asks for both); without one, both get the whole reply.
    A missing or empty field falls back to the whole reply too: the agent still sees what the
    advisor said."""
    for candidate in reversed(_JSON_OBJECT.findall(reply)):
        try:
            parsed = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(parsed, dict) and ("aux" in parsed or "main" in parsed):
            return {agent: _field_text(parsed.get(agent)) or reply.strip() for agent in AGENTS}
    return {agent: reply.strip() for agent in AGENTS}


def _field_text(value) -> str:
    if value is None:
        return ""
    return value.strip() if isinstance(value, str) else json.dumps(value)


def followup_prompt(first: str, previous: str, feedback: str | None, limit: int) -> str:
    """A later turn's prompt for one agent (FOLLOWUP); `feedback` None: the advisor failed."""
    return FOLLOWUP.format(first=first, previous=previous.strip("\n"),
                           feedback=_cut(feedback, limit) if feedback is not None
                           else NO_FEEDBACK)


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


@dataclass
class _Tree:
    """What one multi-turn episode's joint tree did, for its metrics."""

    joint: list[tuple[int, Action, Action, PairScore]] = field(default_factory=list)
    leaves: list[PairScore] = field(default_factory=list)  # joint actions nothing expanded
    nodes: int = 0
    terminated: int = 0  # nodes stopped by termination_threshold before the horizon
    unexpanded: int = 0  # unscored joint actions (sandbox failure) not expanded

    def add(self, turn: int, auxes: list[Action], mains: list[Action],
            scores: list[PairScore], leaves: bool, terminated: bool) -> None:
        self.nodes += 1
        self.terminated += terminated
        self.joint.extend(zip([turn] * len(scores), auxes, mains, scores))
        if leaves:
            self.leaves.extend(scores)
        else:
            self.leaves.extend(p for p in scores if p.level is None)

    def metrics(self, turns: int) -> dict[str, float]:
        """`success`, `pass_rate`, `reward`: means over the final joint actions (the leaves;
        a greedy evaluation's single path ends in one); `turn<t>/…`: over turn t's joint
        actions (Figure 5's per-turn curves); the tree's shape; per-agent behaviour."""
        def mean(values: list[float]) -> float:
            return sum(values) / len(values) if values else 0.0

        out = {"success": mean([float(p.success) for p in self.leaves]),
               "pass_rate": mean([p.run.pass_rate if p.run else 0.0 for p in self.leaves]),
               "nodes": float(self.nodes), "terminated_nodes": float(self.terminated),
               "joint_actions": float(len(self.joint))}
        scored_leaves = [p.level.total for p in self.leaves if p.level is not None]
        if scored_leaves:
            out["reward"] = mean(scored_leaves)
        for t in range(turns):
            at = [p for turn, _, _, p in self.joint if turn == t]
            scored = [p.level.total for p in at if p.level is not None]
            if scored:
                out[f"turn{t}/reward"] = mean(scored)
                out[f"turn{t}/success"] = mean([float(p.success) for p in at])
        failures = sum(p.level is None for _, _, _, p in self.joint)
        if failures:
            out["sandbox_failures"] = float(failures)
        actions = [a for _, aux, main, _ in self.joint for a in (aux, main)]
        for agent in AGENTS:
            mine = [a for a in actions if a.agent == agent]
            out[f"behavior/{agent}/response_tokens"] = mean([len(a.response_ids) for a in mine])
            out[f"behavior/{agent}/truncated"] = mean([a.finish_reason == "length" for a in mine])
        checks = [p.checks for _, _, _, p in self.joint]
        out.update({"behavior/aux/defines_aux": mean([c.aux_defined for c in checks]),
                    "behavior/main/defines_entry_point": mean([c.main_defined for c in checks]),
                    "behavior/main/calls_aux": mean([c.calls_aux for c in checks]),
                    "behavior/main/wraps_aux": mean([c.wraps_aux for c in checks]),
                    "behavior/main/discards_aux_result":
                        mean([c.discards_aux_result for c in checks])})
        return out


@register("magrpo_code", MagrpoCodeConfig)
class MagrpoCode:
    name = "magrpo_code"
    agents = AGENTS
    sampling = "joint"
    coach_prompt = ""  # no LLM-coach template: the joint reward is set inline

    def __init__(self, cfg: MagrpoCodeConfig) -> None:
        self.cfg = cfg
        # single-turn: a round of G parallel episodes (n = 1 each); multi-turn: one episode a
        # task that draws the G joint actions of every node of its tree (n = G)
        self.sampling = "joint" if cfg.turns == 1 else "tree"
        self.tool = CodeTool(cfg.sandbox)
        # HumanEval split by task id (an actors.tasks.TaskSplits, as code_duo's)
        self.make_task = HumanEvalTasks(cfg.eval_fraction)
        self._rounds: dict[str, _CrossRound] = {}  # cross mode: round_id -> its meeting point

    def groups_per_round(self, agent: str, group_size: int) -> int:
        # single-turn: the agent's G actions across the round; multi-turn: one group a node of
        # the full tree (1 + G + ... + G^(H-1)), fewer when nodes terminate early
        return sum(group_size ** t for t in range(self.cfg.turns))

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
        if self.cfg.turns > 1:
            return await self._run_tree(task, episode, hidden)
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

    # ------------------------------------------------------------------ multi-turn
    async def _run_tree(self, task: Task, episode, hidden: Suite) -> dict[str, float]:
        """The joint tree of one task (module docstring, "Multi-turn"); returns its metrics."""
        first = prompts(task)
        entry_point = task.extra["entry_point"]
        params = signature_params(task.prompt, entry_point)
        prefixes = {"aux": self.cfg.aux_prefix, "main": self.cfg.main_prefix}
        prefixes = {a: p.replace("{entry_point}", entry_point).replace("{params}", params)
                    for a, p in prefixes.items()}
        tree = _Tree()
        await self._node(task, episode, hidden, tree, 0, "", dict(first), first, prefixes)
        return tree.metrics(self.cfg.turns)

    async def _node(self, task: Task, episode, hidden: Suite, tree: "_Tree", turn: int,
                    branch: str, texts: dict[str, str], first: dict[str, str],
                    prefixes: dict[str, str]) -> None:
        """One node: both agents draw G replies from their prompts (Alg. 1 step 6), the g-th
        replies form joint action g with one joint reward (step 7), and unless this is the
        last turn or the node terminates early, each scored joint action gets the advisor's
        feedback and expands into its own child node (step 8, a branch of its own)."""
        cfg, size = self.cfg, episode.group_size
        tokens = {"aux": cfg.aux_tokens, "main": cfg.main_tokens}

        async def act(agent: str) -> list[Action]:
            return await episode.act(agent, [{"role": "user", "content": texts[agent]}],
                                     turn=turn, n=size, max_new_tokens=tokens[agent],
                                     parent_branch=branch, prefix=prefixes[agent])

        auxes, mains = await asyncio.gather(act("aux"), act("main"))
        scores = await asyncio.gather(*(
            self.score_pair(task, hidden, agent_code(a.text), agent_code(m.text))
            for a, m in zip(auxes, mains)))
        for aux, main, own in zip(auxes, mains, scores):
            for action in (aux, main):
                self._record(episode, action, own, [own], cross=False)
        values = [self._value(p.level) for p in scores if p.level is not None]
        stop = (cfg.termination_threshold is not None and bool(values)
                and sum(values) / len(values) > cfg.termination_threshold)
        expand = turn + 1 < cfg.turns and not stop
        tree.add(turn, auxes, mains, scores, leaves=not expand, terminated=stop)
        if not expand:
            return
        children = []
        for g, (aux, main, own) in enumerate(zip(auxes, mains, scores)):
            if own.level is None:  # unscored (sandbox failure): no reward to build on
                tree.unexpanded += 1
                continue
            children.append(self._child(task, episode, hidden, tree, turn, branch, g,
                                        (aux, main), own, first, prefixes))
        await asyncio.gather(*children)

    async def _child(self, task: Task, episode, hidden: Suite, tree: "_Tree", turn: int,
                     branch: str, g: int, pair: tuple[Action, Action], own: PairScore,
                     first: dict[str, str], prefixes: dict[str, str]) -> None:
        """Joint action g's feedback, then its child node at turn + 1 on branch `branch.g`."""
        try:
            advice = await episode.consult(
                advisor_messages(task, own.checks.program, self.cfg.advisor_field_chars),
                purpose="feedback")
            feedback: dict[str, str | None] = split_feedback(advice.text or "")
        except AdvisorFailure:  # counted by the episode and the pool; go on without words
            feedback = {agent: None for agent in AGENTS}
        texts = {action.agent: followup_prompt(first[action.agent], action.text,
                                               feedback[action.agent], self.cfg.feedback_chars)
                 for action in pair}
        await self._node(task, episode, hidden, tree, turn + 1, tree_path(branch, g), texts,
                         first, prefixes)

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
