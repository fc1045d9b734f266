"""mathchat (MAPPA §3.1): tasks, rule scores, and whole episodes through the real sandbox.

The episodes are driven by a script of replies (the engine is the only part replaced: what a
model writes is the input under test); the code in them runs in the real sandbox, and the
coach requests are rendered with the real mathchat template.
"""
import asyncio
import itertools
import random

import numpy as np
import pytest

from actors.coach.config import CoachConfig
from actors.coach.prompts import PromptBook
from actors.episode import Action, CoachRequest
from actors.sandbox import SandboxConfig
from actors.workflows.base import Task
from actors.workflows.mathchat import MathChat, MathChatConfig

TASK = Task("t", "A shop has 6 boxes with 7 pencils in each box. It sells 5 pencils. "
                 "How many pencils does the shop have now?", "37")


class ScriptedEpisode:
    """The act/annotate/coach surface of actors.episode.Episode, answering from a script."""

    def __init__(self, replies: dict[str, list[str]], task: Task = TASK) -> None:
        self.replies = {agent: list(texts) for agent, texts in replies.items()}
        self.task = task
        self.turns, self.requests, self.meta, self.prompts = [], [], {}, {}
        self._ids = itertools.count()

    async def act(self, agent, messages, *, turn, max_new_tokens, n=1, prefix="", stop=None,
                  **_):
        assert self.replies.get(agent), f"{agent} asked for turn {turn} beyond its script"
        self.turns.append((agent, turn))
        step_id = f"s{next(self._ids)}"
        self.meta[step_id] = {}
        self.prompts[step_id] = messages
        text = prefix + self.replies[agent].pop(0)
        return [Action(step_id, agent, turn, 0, text, np.zeros(1, np.int32), "stop")]

    def annotate(self, step_id, **meta):
        self.meta[step_id].update(meta)

    def fail(self, step_id, reason):
        self.meta[step_id]["failed"] = reason

    async def coach(self, actions, *, input_text, context=None, truth=None):
        self.requests += [CoachRequest(
            step_id=a.step_id, model_id="policy", agent=a.agent, workflow="mathchat",
            task_id=self.task.task_id, input_text=input_text, output_text=a.text,
            finish_reason="stop", truth=self.task.truth if truth is None else truth,
            context=context or {}, problem=self.task.prompt, turn=a.turn) for a in actions]


def play(replies, **params) -> tuple[dict, ScriptedEpisode, MathChat]:
    workflow = MathChat(MathChatConfig(sandbox=SandboxConfig(timeout_s=5), **params))
    episode = ScriptedEpisode(replies)
    return asyncio.run(workflow.run(TASK, episode)), episode, workflow


def test_the_team_solves_it_with_code_and_the_coach_sees_the_output():
    result, episode, workflow = play({
        "solver": ["6 boxes of 7 is 42 pencils, minus 5 sold: 37."],
        "executor": ["```python\nprint(6 * 7 - 5)\n```", "The code gives 37."],
        "verifier": ["The final answer is \\boxed{37}"],
    })
    assert result["success"] == 1.0 and result["boxed"] == 1.0
    assert result["tool_call_rate"] == 0.5 and result["tool_ok_rate"] == 1.0
    assert episode.turns == [("solver", 0), ("executor", 1), ("executor", 2), ("verifier", 4)]
    first_run = episode.requests[1]
    assert first_run.context["tool_called"] and "37" in first_run.context["tool_observation"]
    assert episode.meta["s1"]["tool_ok"] is True and episode.meta["s2"]["tool_called"] is False
    # the verifier's input holds the executor's code output
    assert "37" in episode.prompts["s3"][0]["content"]
    # the real template, as the LLM coach renders it: tool output shown, truth for verifier only
    book = PromptBook(CoachConfig(truth_agents=["verifier"]), "mathchat")
    executor_prompt = book.score_prompt(first_run).messages[0][1]
    assert "37" in executor_prompt.split("Environment feedback")[1]
    assert "Ground truth answer (if applicable):\nN/A" in executor_prompt
    verifier = book.score_prompt(episode.requests[-1])
    assert verifier.require_answer and "Ground truth answer (if applicable):\n37" in \
        verifier.messages[0][1]
    scores = {r.agent + str(r.turn): workflow.rule_score(r.agent, TASK, r.output_text, "stop",
                                                         r.context) for r in episode.requests}
    assert scores == pytest.approx({"solver0": 1.0, "executor1": 1.0, "executor2": 0.2,
                                    "verifier4": 1.0})


def test_failing_code_is_an_observation_and_turns_are_bounded():
    result, episode, _ = play({
        "solver": ["no idea"],
        "executor": ["```python\n1/0\n```", "```python\nwhile True: pass\n```"],
        "verifier": ["\\boxed{12}"],
    }, tool_turns=2)
    assert result["success"] == 0.0 and result["tool_call_rate"] == 1.0
    assert result["tool_ok_rate"] == 0.0
    assert [t for a, t in episode.turns if a == "executor"] == [1, 2]  # T=2 turns, no more
    observations = [r.context["tool_observation"] for r in episode.requests
                    if r.agent == "executor"]
    assert "ZeroDivisionError" in observations[0]
    assert "timed out" in observations[1].lower()
    assert episode.meta["s2"]["tool_tripped"] == "timeout"


def test_partial_information_hides_the_problem_from_later_agents():
    _, episode, _ = play({"solver": ["42 - 5 = 37"], "executor": ["It is 37."],
                          "verifier": ["\\boxed{37}"]}, partial_information=True)
    prompts = [m[0]["content"] for m in episode.prompts.values()]
    assert "6 boxes" in prompts[0]
    assert all("6 boxes" not in p for p in prompts[1:])
    assert "42 - 5 = 37" in prompts[1] and "It is 37." in prompts[2]


@pytest.mark.parametrize("agent,text,context,score", [
    ("verifier", "\\boxed{37}", {}, 1.0),
    ("verifier", "\\boxed{\\frac{74}{2}}", {}, 1.0),  # math-verify, not string equality
    ("verifier", "\\boxed{36}", {}, 0.2),
    ("verifier", "37", {}, 0.0),
    ("executor", "```python\nprint(1)\n```", {"tool_called": True, "tool_ok": True,
                                             "tool_observation": "1"}, 0.6),
    ("executor", "```python\n1/0\n```", {"tool_called": True, "tool_ok": False,
                                        "tool_observation": "ZeroDivisionError"}, 0.3),
    ("executor", "I think 37", {"tool_called": False}, 0.2),
    ("solver", "", {}, 0.0),
])
def test_rule_scores(agent, text, context, score):
    assert MathChat(MathChatConfig()).rule_score(agent, TASK, text, "stop", context) == \
        pytest.approx(score)


@pytest.mark.parametrize("steps", [1, 2, 3, 4])
def test_generated_problems_have_integer_answers(steps):
    workflow = MathChat(MathChatConfig(steps=steps, max_number=9))
    tasks = [workflow.make_task(random.Random(i), i) for i in range(30)]
    assert all(t.truth.lstrip("-").isdigit() for t in tasks)
    assert len({t.prompt for t in tasks}) > 15
    assert tasks[0] == workflow.make_task(random.Random(0), 0)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match=r"workflow.params.tool_turns=0"):
        MathChatConfig(tool_turns=0)


def test_a_sandbox_failure_fails_the_row_not_the_round():
    """The workspace vanishes under the tool: the row is FAILED `sandbox`, the agent is told."""
    tool = MathChat(MathChatConfig(sandbox=SandboxConfig(timeout_s=5))).tool
    episode = ScriptedEpisode({"executor": ["```python\nprint(1)\n```"]})
    with tool.workspace() as workspace:
        [action] = asyncio.run(episode.act("executor", [{"content": ""}], turn=1,
                                           max_new_tokens=8))
        workspace.cleanup()
        result = asyncio.run(tool.call(episode, action, workspace))
    assert result.infra_error and not result.ok
    assert episode.meta[action.step_id]["failed"] == "sandbox"
    assert episode.meta[action.step_id]["tool_infra_error"]
    assert tool.infra_failures == 1
