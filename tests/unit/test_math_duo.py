"""math_duo (AT-GRPO A.1.1): rewards by hand from the appendix, answers, agreement, the tree.

Episodes run on the real `Episode` (rows, group keys, branches, rewards as the buffers get
them) with the engine replaced by a script of replies: what a model writes is the input under
test. The tool's code runs in the real sandbox. Every expected reward is worked out by hand from
r = λ·r_team + (1−λ)·m·r_loc with λ_math = 0.70 and the appendix's coefficients; each case shows
its arithmetic.
"""
import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from actors.coach.rule import RuleCoach
from actors.episode import Episode, SamplingParams
from actors.sandbox import SandboxConfig
from actors.tasks import TaskConfig, TaskSource
from actors.workflows import WorkflowConfig, build_workflow
from actors.workflows.base import Task, units_per_round
from actors.workflows.math_duo import (MathDuo, MathDuoConfig, check_final, final_answer,
                                       printed_answer, reasoner_reward, tool_reward,
                                       truth_available)
from learners.advantages import at_grpo_rewards
from runtime.config import ConfigError, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TASK = Task("t", "A shop has 6 boxes with 7 pencils in each box. It sells 5 pencils. "
                 "How many pencils does the shop have now?", "37")
LAM = 0.70


# ------------------------------------------------------------------------------ the engine

@dataclass
class Generation:
    response_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str


class ScriptedEngine:
    """A model route and engine client whose generate calls answer from a script.

    `calls` holds, per generate call in order, the K replies (text, or (text, finish_reason)).
    Each reply becomes one token whose id `decode` maps back to the text.
    """

    def __init__(self, calls: list[list]) -> None:
        self.calls = [list(c) for c in calls]
        self.texts: list[str] = []
        self.model_id, self.template_kwargs = "policy", {}
        self.prompts: list[str] = []

    def next_client(self):
        return self

    def encode(self, messages, prefix: str = "") -> list[int]:
        self.prompts.append(messages[-1]["content"] if isinstance(messages, list) else messages)
        return [1, 2, 3]

    def decode(self, ids) -> str:
        return self.texts[int(ids[0])]

    async def generate(self, prompt_ids, n, max_new_tokens, temperature=1.0, top_p=1.0,
                       stop_token_ids=None, stop=None):
        assert self.calls, "the workflow asked for more generations than the script holds"
        replies = self.calls.pop(0)
        assert len(replies) == n, f"script has {len(replies)} replies, the workflow asked {n}"
        out = []
        for reply in replies:
            text, finish = (reply, "stop") if isinstance(reply, str) else reply
            self.texts.append(text)
            out.append(Generation([len(self.texts) - 1], [-0.5], [0], finish))
        return out


def make_episode(workflow, task: Task, engine: ScriptedEngine, group_size: int,
                 agents: dict[str, str] | None = None) -> Episode:
    agents = agents or {a: "policy" for a in workflow.agents}
    return Episode(run_id="r", workflow=workflow.name, task_id=task.task_id, round_id="round",
                   round_size=1, round_index=0, group_size=group_size, agent_models=agents,
                   routes={m: engine for m in set(agents.values())},
                   sampling=SamplingParams(), truth=task.truth, problem=task.prompt)


def play(workflow, task: Task, calls: list[list], group_size: int):
    """Run one episode on the script; returns (metrics, rows in action order, engine)."""
    engine = ScriptedEngine(calls)
    episode = make_episode(workflow, task, engine, group_size)
    result = asyncio.run(workflow.run(task, episode))
    assert not engine.calls, f"the script has {len(engine.calls)} calls left"
    rows = [r for rows in episode.records().values() for r in rows]
    return result, sorted(rows, key=lambda r: r.created_at), engine, episode


def math_duo(**params) -> MathDuo:
    return MathDuo(MathDuoConfig(sandbox=SandboxConfig(timeout_s=10), **params))


# ------------------------------------------------------------------------------ rewards

@pytest.mark.parametrize("answer,tool,reward,ends", [
    # turn 1, no tool answer yet: never ends; r_loc = .2·1 + .8·1 = 1 -> .3·1 = .30
    ("37", None, 0.30, False),
    # agrees with a tool answer and is right: r_team = 1 -> .7 + .3·1 = 1.00
    ("37", "37.0", 1.00, True),
    # agrees but wrong: ends, r_team = 0; r_loc = .2 (format only) -> .3·.2 = .06
    ("36", "36", 0.06, True),
    # right but disagrees with the tool: goes on, r_team = 0 -> .30
    ("37", "12", 0.30, False),
    # no answer at all: r_loc = 0 -> 0
    (None, "37", 0.0, False),
])
def test_reasoner_reward_by_hand(answer, tool, reward, ends):
    step, ended = reasoner_reward(answer, "37", tool, LAM)
    assert step.value == pytest.approx(reward) and ended == ends
    assert step.local.mask == 1 and step.local.coefficients == {"fmt": 0.2, "tool": 0.0,
                                                                "step": 0.8}


@pytest.mark.parametrize("ran,ok,answer,finish,reasoner,last,reward,local,ends", [
    # runs cleanly, prints the right answer the reasoner gave: .7·1 + .3·(.1+.1+.8) = 1.00
    (True, True, "37", "stop", "37", False, 1.00, 1.0, True),
    # runs, prints a wrong answer: r_loc = .1 + .1 = .2 -> .3·.2 = .06
    (True, True, "12", "stop", "37", False, 0.06, 0.2, False),
    # crashed, cut at the token budget, printed nothing: r_loc = 0, mask still 1
    (True, False, None, "length", "37", False, 0.0, 0.0, False),
    # no code block: m = 0 (no logs); the last step ends with the reasoner right: .7·1 = .70
    (False, False, None, "stop", "37", True, 0.70, None, True),
    # last step, wrong print, reasoner right: .7·1 + .3·.2 = .76
    (True, True, "12", "stop", "37", True, 0.76, 0.2, True),
    # last step with the reasoner wrong: r_team = 0 even though the tool is right: .3·1 = .30
    (True, True, "37", "stop", "36", True, 0.30, 1.0, True),
])
def test_tool_reward_by_hand(ran, ok, answer, finish, reasoner, last, reward, local, ends):
    step, ended = tool_reward(ran, ok, answer, finish, "37", reasoner, last, LAM)
    assert step.value == pytest.approx(reward) and ended == ends
    assert step.row_rewards()["reward_local"] == (None if local is None
                                                 else pytest.approx(local))


def test_unreadable_truth_masks_the_local_reward():
    assert not truth_available("") and truth_available("37") and truth_available("\\frac{1}{2}")
    step, _ = reasoner_reward("5", "", None, LAM)  # a record without an answer
    assert step.local.mask == 0 and step.row_rewards()["reward_local"] is None
    assert step.value == 0.0  # λ·0 + (1−λ)·0·r_loc


def test_the_learner_mixes_the_row_components_into_the_same_reward():
    cases = [reasoner_reward("37", "37", None, LAM)[0],
             tool_reward(True, True, "12", "stop", "37", "37", True, LAM)[0],
             tool_reward(False, False, None, "stop", "37", "37", True, LAM)[0]]
    team = [c.row_rewards()["reward_team"] for c in cases]
    local = [c.row_rewards()["reward_local"] for c in cases]
    mixed = at_grpo_rewards(team, [float("nan") if v is None else v for v in local],
                            [float("nan")] * 3, 1.0, LAM)
    assert list(mixed) == pytest.approx([c.value for c in cases])
    assert list(mixed) == pytest.approx([0.3, 0.76, 0.7])


# ------------------------------------------------------------------------------ answers

@pytest.mark.parametrize("answer,reference,same", [
    ("37", "37", True),
    ("37.0000001", "37", True),  # NumEq_δ, δ = 1e-6
    ("37.01", "37", False),
    ("1,000", "1000", True),
    ("\\frac{1}{2}", "0.5", True),  # not plain numbers: math-verify
    ("x^2 + 1", "1 + x^2", True),
    ("", "37", False),
    (None, "37", False),
])
def test_check_final_is_numeq_then_math_verify(answer, reference, same):
    assert check_final(answer, reference) == same


def test_answers_are_read_from_the_box_the_hashes_and_the_last_printed_line():
    assert final_answer("so 6·7 − 5 = 37.\n\\boxed{37}") == "37"
    assert final_answer("\\boxed{1} then \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert final_answer("Reasoning...\n#### 37\nthanks") == "37"
    assert final_answer("no answer here") is None and final_answer("\\boxed{3") is None
    assert printed_answer("step 1\n\n  37  \n\n") == "37"
    assert printed_answer("") is None


# ------------------------------------------------------------------------------ episodes

REASONER_RIGHT = "6 boxes of 7 is 42, minus 5 sold.\n\\boxed{37}"
REASONER_WRONG = "6 times 7 is 41, minus 5.\n\\boxed{36}"
CODE_RIGHT = "```python\nprint(6 * 7 - 5)\n```"
CODE_CRASH = "```python\nprint(1 / 0)\n```"
CODE_WRONG = "```python\nprint(6 * 7)\n```"


def test_agreement_at_the_tool_step_ends_the_episode_and_the_tree_keeps_the_best():
    result, rows, engine, _ = play(math_duo(horizon=4), TASK, [
        [REASONER_WRONG, REASONER_RIGHT],  # .06 vs .30: candidate 1 kept
        [CODE_CRASH, CODE_RIGHT],  # 0 (.3·(.1 fmt)) vs 1.00: candidate 1 kept, agrees
    ], group_size=2)
    assert result["success"] == 1.0 and result["turns"] == 1.0 and result["agreed"] == 1.0
    assert result["turns_to_solve"] == 1.0
    assert [(r.agent, r.turn, r.candidate, r.branch) for r in rows] == [
        ("reasoner", 1, 0, ""), ("reasoner", 1, 1, ""), ("tool", 1, 0, "1"), ("tool", 1, 1, "1")]
    # crash: s_fmt 1, s_tool 0, s_step 0 -> r_loc .1, r = .3·.1 = .03
    assert [r.reward for r in rows] == pytest.approx([0.06, 0.30, 0.03, 1.00])
    assert [r.reward_team for r in rows] == [0.0, 0.0, 0.0, 1.0]
    assert [r.reward_local for r in rows] == pytest.approx([0.2, 1.0, 0.1, 1.0])
    assert all(r.outcome == 1.0 for r in rows)
    assert [json.loads(r.meta)["kept"] for r in rows] == [False, True, False, True]
    assert len({r.group_key for r in rows}) == 2 and {r.group_size for r in rows} == {2}
    # the tool saw the problem alone at turn 1 (A.2.2), the reasoner too
    assert "History" not in engine.prompts[0] and "History" not in engine.prompts[1]
    assert result["behavior/tool/tool_call_rate"] == 1.0
    assert result["behavior/tool/tool_success"] == 0.5
    assert result["behavior/reasoner/response_tokens"] == 1.0


def test_the_reasoner_adopting_the_tools_answer_ends_the_episode_at_its_own_step():
    result, rows, engine, _ = play(math_duo(horizon=4), TASK, [
        [REASONER_WRONG, REASONER_WRONG],  # both .06; ties go to the first
        [CODE_RIGHT, CODE_WRONG],  # 37 disagrees with 36: .3·1 = .30 vs .3·.2 = .06
        [REASONER_RIGHT, REASONER_WRONG],  # 37 agrees with the tool's 37: 1.00 vs .06
    ], group_size=2)
    assert result["turns"] == 2.0 and result["success"] == 1.0 and result["agreed"] == 1.0
    assert [r.reward for r in rows] == pytest.approx([0.06, 0.06, 0.30, 0.06, 1.00, 0.06])
    assert [r.branch for r in rows] == ["", "", "0", "0", "0.0", "0.0"]
    # turn 2's prompt shows the mismatch history: the tool's printed 37 and the reasoner's 36
    assert "History" in engine.prompts[2] and "37" in engine.prompts[2] \
        and "Its boxed answer: 36" in engine.prompts[2]


def test_without_agreement_the_episode_stops_after_turn_t_with_the_reasoners_answer():
    result, rows, _, _ = play(math_duo(horizon=2), TASK, [
        [REASONER_WRONG], [CODE_RIGHT], [REASONER_WRONG], [CODE_WRONG],
    ], group_size=1)
    assert result["turns"] == 2.0 and result["success"] == 0.0 and result["agreed"] == 0.0
    assert "turns_to_solve" not in result  # only solved episodes have it
    # last tool step: ends, but the final (reasoner's 36) is wrong: r_team = 0, r_loc = .2
    assert rows[-1].reward == pytest.approx(0.06) and rows[-1].reward_team == 0.0
    assert all(r.outcome == 0.0 for r in rows)


def test_a_reply_without_code_is_masked():
    _, rows, _, _ = play(math_duo(horizon=1), TASK, [
        [REASONER_RIGHT], ["I think it is 37."]], group_size=1)
    tool = rows[-1]
    # T = 1: the tool's step ends the episode with the reasoner right: λ·1, local masked
    assert tool.reward_local is None and tool.reward == pytest.approx(0.70)
    assert json.loads(tool.meta)["env_mask"] == 0


def test_coach_source_sends_rows_with_the_environments_reward_and_the_rule_coach_returns_it():
    workflow = math_duo(horizon=1, reward_source="coach")
    result, rows, _, episode = play(workflow, TASK, [[REASONER_RIGHT], [CODE_RIGHT]],
                                    group_size=1)
    assert all(r.reward is None and r.reward_team is not None for r in rows)
    requests = episode.coach_requests(result["success"])
    # the reasoner's turn-1 step cannot end the episode: .3·1; the tool agrees: .7 + .3·1
    assert [r.context["step_reward"] for r in requests] == pytest.approx([0.30, 1.0])
    coach = RuleCoach(workflow)
    scores = [asyncio.run(coach.score(r)).score for r in requests]
    assert scores == pytest.approx([0.30, 1.0])


def test_rule_score_never_invents_a_score():
    with pytest.raises(ValueError, match="step_reward"):
        math_duo().rule_score("reasoner", TASK, "\\boxed{37}", "stop", {})
    assert math_duo().rule_score("tool", TASK, "", "stop", {"step_reward": 0.76}) == 0.76


def test_inline_rows_never_reach_the_coach_and_the_episode_refuses_to_send_them():
    workflow = math_duo(horizon=1)
    _, _, _, episode = play(workflow, TASK, [[REASONER_RIGHT], [CODE_RIGHT]], group_size=1)
    assert episode.coach_requests() == []
    engine = ScriptedEngine([["\\boxed{1}"]])
    episode = make_episode(workflow, TASK, engine, 1)
    [action] = asyncio.run(episode.act("reasoner", "q", turn=1, max_new_tokens=4))
    episode.reward(action.step_id, reward=0.5)
    with pytest.raises(ValueError, match="inline reward"):
        asyncio.run(episode.coach([action], input_text="q"))


# ------------------------------------------------------------------------------ tasks, config

def test_tasks_are_mathchats_generator_or_a_users_file(tmp_path):
    workflow = math_duo(steps=2, max_number=9)
    source = TaskSource(TaskConfig(), "train", generator=workflow.make_task)
    first = source.task_at(0)
    assert first.task_id.startswith("train-math_duo-") and first.truth.lstrip("-").isdigit()
    path = tmp_path / "problems.jsonl"
    path.write_text("\n".join(json.dumps({"problem": f"What is {i} + 1?", "answer": str(i + 1),
                                          "split": "eval" if i < 2 else "train"})
                              for i in range(6)))
    cfg = TaskConfig(path=str(path))
    train = TaskSource(cfg, "train", generator=workflow.make_task)
    assert len(train) == 4 and TaskSource(cfg, "eval").all()[0].truth == "1"


def test_one_group_per_agent_and_turn():
    workflow = math_duo(horizon=4)
    assert units_per_round(workflow, {"reasoner": "p", "tool": "p"}, 4, {"p": "group"}) \
        == {"p": 8}


@pytest.mark.parametrize("override,field", [
    ("workflow.params.team_lambda=1.5", "team_lambda"),
    ("workflow.params.horizon=0", "horizon"),
    ("workflow.params.steps=9", "steps"),
    ("workflow.params.reward_source=judge", "reward_source"),
    ("workflow.params.no_such_field=1", "no_such_field"),
])
def test_config_errors_name_the_field(override, field):
    with pytest.raises(ConfigError, match=field):
        load_config(CONFIGS / "math_duo_cpu.yaml", [override])


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("math_duo_*.yaml"))
                         + sorted(CONFIGS.glob("code_duo_*.yaml")), ids=lambda p: p.name)
def test_configs_train_at_grpo_with_the_workflows_lambda(path):
    cfg = load_config(path)
    workflow = build_workflow(cfg.workflow)
    for model in cfg.models.values():
        assert model.learner.advantage == "at_grpo"
        assert model.learner.team_lambda == workflow.cfg.team_lambda
        assert model.buffer.readiness == "group"


def test_build_from_config():
    workflow = build_workflow(WorkflowConfig(name="math_duo", agents={"reasoner": "p",
                                                                      "tool": "p"},
                                             params={"horizon": 2}))
    assert isinstance(workflow, MathDuo) and workflow.cfg.team_lambda == 0.70
