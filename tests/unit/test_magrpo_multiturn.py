"""magrpo_code multi-turn (MAGRPO's joint tree with the advisor's feedback), worked by hand.

The real `Episode` draws every node's G candidates from scripted engines that answer by what
the prompt holds (children of one node play concurrently, so call order is no key); the
advisor is an `AdviceFn` that records what it was asked; joint programs run the real hidden
suite in the real sandbox. Level rewards as in test_magrpo_code.py: structure 0.4 + 0.6,
syntax 0.5, tests 1.0 x rate, cooperation 0.5 + 1.0.
"""
import asyncio

import numpy as np
import pytest

from actors.engines.client import Generation
from actors.episode import Advice, Episode, SamplingParams
from actors.sandbox import SandboxConfig
from actors.workflows.base import units_per_round
from actors.workflows.magrpo_code import (NO_FEEDBACK, MagrpoCode, MagrpoCodeConfig,
                                          advisor_messages, split_feedback)
from learners.advantages import magrpo
from test_magrpo_code import ADD_TASK as TASK  # the hand-worked task and replies
from test_magrpo_code import ADD_TEST, AUX_RIGHT, AUX_TIMES, MAIN_OWN, MAIN_USES

MAIN_BROKEN = "def add(a, b):\n    return a +\n"


class Engine:
    """One agent's scripted engine: `answer(prompt)` gives the n replies of a call."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.prompts: list[str] = []
        self.texts: list[str] = []
        self._last = ""

    def next_client(self):
        return self

    def encode(self, messages, prefix: str = "") -> list[int]:
        self._last = messages[-1]["content"]
        self.prompts.append(self._last)
        return [1, 2, 3]

    def decode(self, ids) -> str:
        return self.texts[int(ids[0])]

    async def generate(self, prompt_ids, n, max_new_tokens, temperature=1.0, top_p=1.0,
                       stop_token_ids=None, stop=None):
        prompt = self._last  # encode and generate run back to back in Episode.act
        await asyncio.sleep(0)
        out = []
        for text in self.answer(prompt, n)[:n]:
            self.texts.append(text)
            out.append(Generation(np.array([len(self.texts) - 1]), np.array([-0.5]),
                                  np.array([0]), "stop", text))
        return out


class Advisor:
    """An AdviceFn: answers every consult with `reply(messages)`, or fails `fail` times."""

    def __init__(self, reply, fail: int = 0) -> None:
        self.reply, self.fail = reply, fail
        self.asked: list[str] = []

    async def __call__(self, request):
        self.asked.append(request.messages[-1]["content"])
        await asyncio.sleep(0)
        if self.fail:
            self.fail -= 1
            return Advice(None, "adv", 0.25, request.purpose, "server_error", "HTTP 500")
        return Advice(self.reply(request.messages[-1]["content"]), "adv", 0.5, request.purpose)


def flow(**params) -> MagrpoCode:
    return MagrpoCode(MagrpoCodeConfig(sandbox=SandboxConfig(timeout_s=20), test_timeout_s=2.0,
                                       turns=2, **params))


def play(workflow: MagrpoCode, aux: Engine, main: Engine, advisor: Advisor | None,
         group_size: int = 2):
    episode = Episode(run_id="r", workflow="magrpo_code", task_id=TASK.task_id, round_id="o",
                      round_size=1, round_index=0, group_size=group_size,
                      agent_models={"aux": "aux", "main": "main"},
                      routes={"aux": aux, "main": main}, sampling=SamplingParams(),
                      advisor=advisor)
    result = asyncio.run(workflow.run(TASK, episode))
    rows = [r for rows in episode.records().values() for r in rows]
    return result, episode, rows


def first_turn(prompt: str) -> bool:
    return "Your previous response" not in prompt


# turn 0: joint action 0 = (AUX_TIMES, MAIN_USES): 0.4+0.6+0.5 + 1.0*2/4 + 1.5 = 3.5
#         joint action 1 = (AUX_RIGHT, MAIN_BROKEN): 0.4+0.6, stopped at syntax = 1.0
# turn 1 on branch "0" (after AUX_TIMES): (AUX_RIGHT, MAIN_USES) 4.0, (AUX_TIMES, MAIN_OWN) 2.5
# turn 1 on branch "1" (after MAIN_BROKEN): (AUX_RIGHT, MAIN_OWN) 2.5, (AUX_RIGHT, MAIN_BROKEN) 1.0
def aux_answer(prompt, n):
    if first_turn(prompt):
        return [AUX_TIMES, AUX_RIGHT]
    return [AUX_RIGHT, AUX_TIMES] if AUX_TIMES in prompt else [AUX_RIGHT, AUX_RIGHT]


def main_answer(prompt, n):
    if first_turn(prompt):
        return [MAIN_USES, MAIN_BROKEN]
    return [MAIN_USES, MAIN_OWN] if MAIN_USES in prompt else [MAIN_OWN, MAIN_BROKEN]


def advice(content: str) -> str:
    which = "times" if "a * b" in content else "broken"
    return f'Fix it. {{"aux": "aux-{which}", "main": "main-{which}"}}'


def test_the_joint_tree_by_hand():
    aux, main, advisor = Engine(aux_answer), Engine(main_answer), Advisor(advice)
    result, episode, rows = play(flow(), aux, main, advisor)
    by_node = {}
    for r in rows:
        by_node.setdefault((r.turn, r.branch, r.agent), []).append(r)
    # 1 + G nodes, each with G rows per agent: 12 rows
    assert sorted(by_node) == [(0, "", "aux"), (0, "", "main"), (1, "0", "aux"),
                               (1, "0", "main"), (1, "1", "aux"), (1, "1", "main")]
    expected = {(0, ""): [3.5, 1.0], (1, "0"): [4.0, 2.5], (1, "1"): [2.5, 1.0]}
    for (turn, branch, agent), node in by_node.items():
        assert [r.candidate for r in node] == [0, 1]
        assert [r.reward for r in node] == pytest.approx(expected[turn, branch])
        assert len({r.group_key for r in node}) == 1 and {r.group_size for r in node} == {2}
    assert len({r.group_key for r in rows}) == 6  # one group per agent and node
    # the advisor saw each turn-0 joint program, with the task and its tests
    assert len(advisor.asked) == 2 and episode.advisor_calls == 2
    assert all(ADD_TEST.strip() in text and "Return a + b." in text for text in advisor.asked)
    assert sorted("a * b" in text for text in advisor.asked) == [False, True]
    assert any(AUX_TIMES.strip() in t and MAIN_USES.strip() in t for t in advisor.asked)
    # each child's prompts: the first prompt, the agent's own previous reply, its feedback
    later = [p for p in aux.prompts if not first_turn(p)]
    assert len(later) == 2 and all(p.startswith("Create a helper function") for p in later)
    assert any(AUX_TIMES.strip() in p and "aux-times" in p and "main-" not in p for p in later)
    assert any(AUX_RIGHT.strip() in p and "aux-broken" in p for p in later)
    assert any(MAIN_BROKEN.strip() in p and "main-broken" in p for p in main.prompts)
    # metrics: the leaves are turn 1's four joint actions; Figure 5's per-turn curves
    assert result["reward"] == pytest.approx((4.0 + 2.5 + 2.5 + 1.0) / 4)
    # every leaf passes all tests but the broken one (MAIN_OWN passes on its own code)
    assert result["success"] == pytest.approx(0.75)
    assert result["turn0/reward"] == pytest.approx(2.25) and result["turn1/reward"] == 2.5
    assert (result["nodes"], result["joint_actions"], result["terminated_nodes"]) == (3, 6, 0)

    # MAGRPO by hand (γ = 1): R = r + mean of the child node's returns; eq. 1 per node.
    # root: R0 = 3.5 + (4.0 + 2.5)/2 = 6.75, R1 = 1.0 + (2.5 + 1.0)/2 = 2.75; with grpo's
    # sample std (two values: gap / √2) A = ±(gap/2) / (gap/√2) = ±1/√2; so at every node.
    adv = magrpo(np.array([r.reward for r in rows]), [r.group_key for r in rows],
                 [r.episode_id for r in rows], [r.agent for r in rows],
                 np.array([r.turn for r in rows]), [r.branch for r in rows],
                 np.array([r.candidate for r in rows]))
    assert adv.tolist() == pytest.approx(
        [(1 if r.candidate == 0 else -1) / np.sqrt(2) for r in rows], rel=1e-5)
    # without σ: root A = ±(6.75 - 2.75)/2 = ±2, children ±0.75
    raw = magrpo(np.array([r.reward for r in rows]), [r.group_key for r in rows],
                 [r.episode_id for r in rows], [r.agent for r in rows],
                 np.array([r.turn for r in rows]), [r.branch for r in rows],
                 np.array([r.candidate for r in rows]), std_normalize=False)
    want = {(0, ""): 2.0, (1, "0"): 0.75, (1, "1"): 0.75}
    assert raw.tolist() == pytest.approx(
        [want[r.turn, r.branch] * (1 if r.candidate == 0 else -1) for r in rows])


def test_a_node_above_the_termination_threshold_is_a_leaf():
    # the root's mean joint reward is (3.5 + 1.0) / 2 = 2.25
    aux, main, advisor = Engine(aux_answer), Engine(main_answer), Advisor(advice)
    result, episode, rows = play(flow(termination_threshold=2.0), aux, main, advisor)
    assert len(rows) == 4 and {r.turn for r in rows} == {0} and advisor.asked == []
    assert result["terminated_nodes"] == 1 and result["reward"] == pytest.approx(2.25)
    # at the threshold it still expands (the rule is "exceeds")
    _, _, rows = play(flow(termination_threshold=2.25), Engine(aux_answer),
                      Engine(main_answer), Advisor(advice))
    assert len(rows) == 12


def test_a_failed_advice_is_counted_and_the_child_is_told():
    aux, main, advisor = Engine(aux_answer), Engine(main_answer), Advisor(advice, fail=2)
    result, episode, rows = play(flow(), aux, main, advisor)
    assert len(rows) == 12  # both children still played
    assert (episode.advisor_calls, episode.advisor_failures) == (2, 2)
    later = [p for p in aux.prompts + main.prompts if not first_turn(p)]
    assert len(later) == 4 and all(NO_FEEDBACK in p for p in later)


def test_a_greedy_path_is_one_joint_action_a_turn():
    """Evaluation plays group size 1: the tree is one path, its leaf the final answer."""
    aux, main, advisor = Engine(aux_answer), Engine(main_answer), Advisor(advice)
    result, _, rows = play(flow(), aux, main, advisor, group_size=1)
    rows.sort(key=lambda r: (r.turn, r.agent))
    assert [(r.turn, r.branch, r.agent) for r in rows] == [
        (0, "", "aux"), (0, "", "main"), (1, "0", "aux"), (1, "0", "main")]
    # turn 0: (AUX_TIMES, MAIN_USES) 3.5; turn 1 after AUX_TIMES: (AUX_RIGHT, MAIN_USES) 4.0
    assert [r.reward for r in rows] == pytest.approx([3.5, 3.5, 4.0, 4.0])
    assert result["success"] == 1.0 and result["reward"] == 4.0


def test_split_feedback_reads_the_json_fields_or_keeps_the_reply():
    assert split_feedback('x {"aux": "add a return", "main": "call aux"} y') == {
        "aux": "add a return", "main": "call aux"}
    # the last object with a field wins; a missing field gets the whole reply
    text = '{"aux": "old"} then {"main": {"edit": 1}}'
    assert split_feedback(text) == {"aux": text, "main": '{"edit": 1}'}
    assert split_feedback("Perfect! No edits needed!") == {
        "aux": "Perfect! No edits needed!", "main": "Perfect! No edits needed!"}


def test_the_advisor_prompt_is_the_papers_and_can_be_cut():
    [message] = advisor_messages(TASK, AUX_RIGHT + MAIN_OWN)
    text = message["content"]
    for line in ("You are an advisor helping 2 agents (an auxiliary agent and a main agent)",
                 "Example tests:", "Show your feedback and edits for the following code:",
                 '- Return "Perfect! No edits needed!" if the logic is sound.',
                 "Always include both aux and main fields, even if no edits are needed."):
        assert line in text
    assert ADD_TEST.strip() in text and MAIN_OWN.strip() in text
    [cut] = advisor_messages(TASK, "x" * 500, field_chars=40)
    assert "x" * 40 + "\n..." in cut["content"] and "x" * 41 not in cut["content"]


def test_multi_turn_config():
    workflow = flow()
    assert workflow.sampling == "tree"
    assert workflow.groups_per_round("aux", 4) == 1 + 4  # one group a node, H = 2
    assert units_per_round(workflow, {"aux": "p", "main": "p"}, 4, {"p": "episode"}) == {"p": 1}
    with pytest.raises(ValueError, match="turns=0: must be >= 1"):
        MagrpoCodeConfig(turns=0)
    with pytest.raises(ValueError, match="joint_mode='cross' with turns=2.*aligned"):
        MagrpoCodeConfig(turns=2, joint_mode="cross")
    with pytest.raises(ValueError, match="termination_threshold=nan"):
        MagrpoCodeConfig(turns=2, termination_threshold=float("nan"))
