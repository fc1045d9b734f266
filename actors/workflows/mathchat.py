"""mathchat: problem solver → code executor → verifier (MAPPA §3.1, appendix B).

The solver drafts a solution; the executor may write Python in ```python blocks, which runs in
the sandbox (actors/sandbox.py), and sees the output for up to `tool_turns` turns; the
verifier synthesises and answers in \\boxed{}. Each agent's prompt is appendix B's. The coach
scores every action (MAPPA §2.2) with the `mathchat` template (configs/coach_prompts/), seeing
the executor's tool observations; only the final agent is shown the ground truth
(`coach.truth_agents: [verifier]`). The outcome is the verifier's answer checked with
math-verify (actors/tasks.py).

Partial information (appendix A.2, `partial_information: true`): each agent sees only the
immediately preceding agent's output; the solver alone sees the problem.

Rounds are joint (G episodes of one task); with REINFORCE++ (MAPPA eq. 1, `reinforce_pp`)
the readiness unit is the episode. An executor that stops calling the tool ends its turns
early; the round then seals its groups at what it produced (DESIGN §14).

Tasks come from `workflow.tasks.path` (any JSONL/Parquet of problem/answer pairs, e.g. AIME or
AMC files a user brings) or from the procedural generator below: multi-step word and
arithmetic problems sized by `steps` and `max_number`.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from actors.sandbox import SandboxConfig
from actors.tasks import answers_match, extract_answer
from actors.workflows.base import Task
from actors.workflows.registry import register
from actors.workflows.tools import CodeTool

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass
class MathChatConfig:
    solver_tokens: int = 4096  # max new tokens per action (MAPPA §3.1: a 4K output limit)
    executor_tokens: int = 4096
    verifier_tokens: int = 4096
    tool_turns: int = 3  # T: executor turns, each may run one code block
    partial_information: bool = False  # appendix A.2: agents see only the previous output
    # opens every executor reply (prompt tokens, never trained); "```python\n" makes a small
    # model write code at once (the closing fence then ends the action)
    executor_prefix: str = ""
    verifier_prefix: str = ""  # opens the verifier's reply, e.g. "\\boxed{" for a small model
    observation_chars: int = 1500  # tool output shown to the next turn and the coach
    steps: int = 2  # generator: arithmetic operations per problem (1..4)
    max_number: int = 20  # generator: operands are drawn from 1..max_number
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)  # where the code runs

    def __post_init__(self) -> None:
        for name in ("solver_tokens", "executor_tokens", "verifier_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"workflow.params.{name}={getattr(self, name)}: must be >= 1")
        if self.tool_turns < 1:
            raise ValueError(f"workflow.params.tool_turns={self.tool_turns}: must be >= 1 "
                             "(the executor's turns)")
        if not 1 <= self.steps <= 4:
            raise ValueError(f"workflow.params.steps={self.steps}: use 1..4 operations")
        if self.max_number < 2:
            raise ValueError(f"workflow.params.max_number={self.max_number}: must be >= 2")


LIMIT = "You have a strict {limit} token limit. Anything beyond that will be truncated."
SOLVER_PROMPT = """You are Problem Solver in a 3-agent system:
Problem Solver (you) -> Code Executor -> Verifier.

The system succeeds only if the Verifier (final agent) outputs the correct answer. Your job is to draft a solution to the problem.

{limit}

## Problem
{problem}"""
EXECUTOR_PROMPT = """You are Code Executor in a 3-agent system:
Problem Solver -> Code Executor (you) -> Verifier.

The system succeeds only if the Verifier (final agent) outputs the correct answer. Your job is to compute/verify the solution using Python code.

You can execute Python code. Write code in ```python``` blocks and it will be automatically executed by the user on your behalf, based on which you can iterate further or output final answers.

{limit}
{problem_block}
## Input from Problem Solver
{solution}"""
VERIFIER_PROMPT = """You are Verifier, the final agent in a 3-agent system:
Problem Solver -> Code Executor -> Verifier (you).

You are the last agent. The system succeeds only if YOU output the correct answer. Evaluate the information below and provide the final answer.

{limit} Output your final answer as:
\\boxed{{answer}}
{problem_block}
## Input from Code Executor
{execution}"""
CONTINUE = ("Execution output:\n{observation}\n\nIterate further with another ```python block, "
            "or output your final answer.")


@register("mathchat", MathChatConfig)
class MathChat:
    name = "mathchat"
    agents = ("solver", "executor", "verifier")
    sampling = "joint"
    coach_prompt = "mathchat"  # configs/coach_prompts/mathchat.txt (MAPPA appendix B.4)

    def __init__(self, cfg: MathChatConfig) -> None:
        self.cfg = cfg
        self.tool = CodeTool(cfg.sandbox, cfg.observation_chars)

    # ------------------------------------------------------------------ tasks
    def make_task(self, rng: random.Random, index: int) -> Task:
        """A word or arithmetic problem of `steps` operations with an integer answer."""
        n = self.cfg.max_number
        a, b, c, d = (rng.randint(1, n) for _ in range(4))
        kind = rng.randrange(3)
        if self.cfg.steps == 1:
            prompt, truth = f"What is {a} + {b}?", a + b
        elif kind == 0:
            prompt = (f"A shop has {a} boxes with {b} pencils in each box. It sells {c} pencils"
                      + (f" and then receives {d} more" if self.cfg.steps >= 3 else "")
                      + ". How many pencils does the shop have now?")
            truth = a * b - c + (d if self.cfg.steps >= 3 else 0)
        elif kind == 1:
            prompt = (f"Sam reads {a} pages a day for {b} days, then {c} more pages"
                      + (f", and rereads {d} of them" if self.cfg.steps >= 3 else "")
                      + ". How many pages has he read in total?")
            truth = a * b + c + (d if self.cfg.steps >= 3 else 0)
        else:
            exprs = {2: (f"({a} + {b}) * {c}", (a + b) * c),
                     3: (f"({a} + {b}) * {c} - {d}", (a + b) * c - d),
                     4: (f"(({a} + {b}) * {c} - {d}) * {a}", ((a + b) * c - d) * a)}
            expr, truth = exprs[self.cfg.steps]
            prompt = f"Compute {expr}."
        return Task(task_id=f"mathchat-{index}", prompt=prompt, truth=str(truth))

    def groups_per_round(self, agent: str, group_size: int) -> int:
        return self.cfg.tool_turns if agent == "executor" else 1

    # ------------------------------------------------------------------ rewards
    def rule_score(self, agent, task, output_text, finish_reason, context) -> float:
        """The offline coach's score in [0, 1] (CPU runs; the LLM coach uses appendix B.4).

        solver: 0.7 if the true answer appears in the draft + 0.3 format (non-empty, ended).
        executor: 0.3 for a code block + 0.3 if it ran cleanly + 0.4 if the true answer is in
        its output; without code, 0.2 if the text states the true answer.
        verifier: 0.2 for a parseable \\boxed{} + 0.8 if it matches the truth (math-verify).
        """
        truth = task.truth
        if agent == "verifier":
            answer = extract_answer(output_text)
            if answer is None:
                return 0.0
            return 0.2 + 0.8 * float(answers_match(output_text, truth))
        if agent == "executor":
            if not context.get("tool_called"):
                return 0.2 * float(_mentions(output_text, truth))
            observation = str(context.get("tool_observation", ""))
            return (0.3 + 0.3 * float(bool(context.get("tool_ok")))
                    + 0.4 * float(_mentions(observation, truth)))
        well_formed = bool(output_text.strip()) and finish_reason == "stop"
        return 0.7 * float(_mentions(output_text, truth)) + 0.3 * float(well_formed)

    # ------------------------------------------------------------------ the episode
    async def run(self, task: Task, episode) -> dict[str, float]:
        cfg, partial = self.cfg, self.cfg.partial_information
        problem_block = "" if partial else f"\n## Problem\n{task.prompt}\n"

        solver_input = SOLVER_PROMPT.format(limit=LIMIT.format(limit=cfg.solver_tokens),
                                            problem=task.prompt)
        [draft] = await episode.act("solver", [{"role": "user", "content": solver_input}],
                                    turn=0, max_new_tokens=cfg.solver_tokens)
        await episode.coach([draft], input_text=solver_input)

        executor_input = EXECUTOR_PROMPT.format(
            limit=LIMIT.format(limit=cfg.executor_tokens), problem_block=problem_block,
            solution=draft.text.strip() or "(empty)")
        messages = [{"role": "user", "content": executor_input}]
        transcript, turns, calls, clean = [], 0, 0, 0
        with self.tool.workspace() as workspace:
            for turn in range(1, cfg.tool_turns + 1):
                [reply] = await episode.act(
                    "executor", messages, turn=turn, max_new_tokens=cfg.executor_tokens,
                    prefix=cfg.executor_prefix, stop=self.tool.stop_strings(cfg.executor_prefix))
                turns += 1
                result = await self.tool.call(episode, reply, workspace)
                await episode.coach([reply], input_text=messages[-1]["content"],
                                    context=result.context())
                transcript.append(reply.text.strip())
                if not result.called:
                    break  # no code: the executor gave its final output
                calls += 1
                clean += result.ok
                transcript.append(f"Execution output:\n{result.observation}")
                messages += [{"role": "assistant", "content": reply.text},
                             {"role": "user", "content": CONTINUE.format(
                                 observation=result.observation)}]

        verifier_input = VERIFIER_PROMPT.format(
            limit=LIMIT.format(limit=cfg.verifier_tokens), problem_block=problem_block,
            execution="\n\n".join(transcript))
        [final] = await episode.act("verifier", [{"role": "user", "content": verifier_input}],
                                    turn=cfg.tool_turns + 1, max_new_tokens=cfg.verifier_tokens,
                                    prefix=cfg.verifier_prefix)
        await episode.coach([final], input_text=verifier_input)
        return {
            "success": float(answers_match(final.text, task.truth)),
            "boxed": float(extract_answer(final.text) is not None),
            "tool_call_rate": calls / turns,
            "tool_ok_rate": clean / calls if calls else 0.0,
            "executor_turns": float(turns),
        }


def _mentions(text: str, truth: str) -> bool:
    """The true answer appears as a number in the text (the rule coach's usefulness test)."""
    try:
        value = float(truth)
    except ValueError:
        return truth.strip() != "" and truth.strip() in text
    return any(abs(float(n) - value) < 1e-6 for n in _NUMBER.findall(text))
