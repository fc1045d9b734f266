"""reflect_code (UnityMAS-O Workflow D): config, score-delta rewards by hand, early stop, prompts.

Episodes run on the real `Episode` (rows, model ids, rewards as the buffers get them) with the
engine replaced by a script of replies (tests/unit/test_math_duo.py's ScriptedEngine: one call
per action, in the order the loop acts); the coder's code runs on the real hidden suite in the
real sandbox. The task is `add` with 4 hidden tests, (1, 2) -> 3, (0, 0) -> 0, (-1, 1) -> 0,
(2, 2) -> 4, so each program's pass rate is worked out by hand in its comment; the rewards are
unitymas-o.txt line 231: d_1 = s_1, d_t = s_t − s_{t−1}, to the planner and coder of round t and
the reflector of round t − 1.
"""
import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
from test_math_duo import ScriptedEngine, make_episode

from actors.sandbox import SandboxConfig, SandboxError
from actors.workflows import WorkflowConfig, build_workflow
from actors.workflows.base import Task, units_per_round
from actors.workflows.reflect_code import ReflectCode, ReflectCodeConfig, delta_rewards
from learners.advantages import path_returns
from runtime.config import ConfigError, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY = CONFIGS / "reflect_code_tiny.yaml"
ADD_TEST = ("METADATA = {}\n\n\ndef check(candidate):\n    assert candidate(1, 2) == 3\n"
            "    assert candidate(0, 0) == 0\n    assert candidate(-1, 1) == 0\n"
            "    assert candidate(2, 2) == 4\n")
ADD_TASK = Task("Mine/0", 'def add(a: int, b: int) -> int:\n    """Return a + b."""\n',
                "    return a + b\n", {"entry_point": "add", "test": ADD_TEST})
PARTIAL = {"planner": "reasoner", "reflector": "reasoner", "coder": "coder"}


def code(body: str) -> str:
    return f"Here it is.\n```python\ndef add(a, b):\n    {body}\n```"


THREE = code("return 3")  # passes (1, 2) only: s = 1/4
ABS = code("return abs(a) + b")  # (−1, 1) gives 2: s = 3/4
TIMES = code("return a * b")  # passes (0, 0) and (2, 2): s = 2/4
RIGHT = code("return a + b")  # s = 1


def workflow(**params) -> ReflectCode:
    params.setdefault("sandbox", SandboxConfig(timeout_s=20))
    return ReflectCode(ReflectCodeConfig(test_timeout_s=1.0, **params))


def play(flow: ReflectCode, replies: list[str], agents: dict[str, str] | None = None):
    """One episode on the script (one reply per action, in acting order). Returns (metrics,
    {(agent, turn): row}, engine, episode, {model_id: [rows]})."""
    engine = ScriptedEngine([[reply] for reply in replies])
    episode = make_episode(flow, ADD_TASK, engine, 1, agents or PARTIAL)
    metrics = asyncio.run(flow.run(ADD_TASK, episode))
    assert not engine.calls, f"the script has {len(engine.calls)} replies left"
    by_model = episode.records()
    rows = {(r.agent, r.turn): r for rows in by_model.values() for r in rows}
    return metrics, rows, engine, episode, by_model


# ------------------------------------------------------------------------------ config

@pytest.mark.parametrize("params,message", [
    ({"max_rounds": 1}, r"workflow.params.max_rounds=1: must be >= 2 .*reflector.* no rows"),
    ({"planner_tokens": 0}, "workflow.params.planner_tokens=0: must be >= 1"),
    ({"coder_tokens": -1}, "workflow.params.coder_tokens=-1: must be >= 1"),
    ({"feedback": "verbose"}, r"workflow.params.feedback='verbose': use one of \['tests', "),
    ({"feedback_chars": 10}, "workflow.params.feedback_chars=10: must be >= 40"),
    ({"test_timeout_s": 0.0}, "workflow.params.test_timeout_s=0.0: must be > 0"),
    ({"eval_fraction": 1.0}, r"workflow.params.eval_fraction=1.0: use a value in \(0, 1\)"),
    ({"test_timeout_s": 5.0, "sandbox": {"timeout_s": 30.0}},
     "workflow.params.sandbox.timeout_s=30.0 is below 35 s.*raise sandbox.timeout_s"),
    ({"no_such_field": 1}, "workflow.params of reflect_code.*no_such_field"),
])
def test_bad_params_name_the_field_value_and_fix(params, message):
    with pytest.raises(ValueError, match=message):
        build_workflow(WorkflowConfig(name="reflect_code", params=params))


def test_configs_refuse_what_would_leave_a_learner_without_rows_or_misread_them():
    with pytest.raises(ConfigError, match=r"models \['spare'\] are not used by any agent"):
        load_config(TINY, ["models.spare.path=tiny"])
    with pytest.raises(ConfigError, match="max_rounds=1.*reflector"):  # its model: no rows
        load_config(TINY, ["workflow.params.max_rounds=1"])
    with pytest.raises(ConfigError, match=r"models.coder.learner.advantage='magrpo' cannot train "
                                          r"reflect_code's rows: .*use advantage=reinforce_pp"):
        load_config(TINY, ["models.coder.learner.advantage=magrpo"])


def test_the_sharing_configs_map_the_three_agents_to_one_two_and_three_models():
    shared = load_config(CONFIGS / "reflect_code_tiny_shared.yaml")
    partial = load_config(TINY)
    separate = load_config(CONFIGS / "reflect_code_tiny_specialised.yaml")
    gpu = load_config(CONFIGS / "reflect_code_gpu_qwen3_1_7b.yaml")
    assert shared.workflow.agents == {"planner": "policy", "coder": "policy",
                                      "reflector": "policy"}
    assert partial.workflow.agents == PARTIAL
    assert separate.workflow.agents == gpu.workflow.agents == {
        "planner": "planner", "coder": "coder", "reflector": "reflector"}  # line 216
    assert [len(c.models) for c in (shared, partial, separate, gpu)] == [1, 2, 3, 3]
    assert shared.workflow.params == partial.workflow.params == separate.workflow.params
    for cfg in (shared, partial, separate, gpu):
        assert cfg.workflow.params["max_rounds"] == 3  # line 229
        for model in cfg.models.values():
            assert model.learner.advantage == "reinforce_pp"
            assert model.buffer.readiness == "episode"
    # G joint episodes a round: each model is admitted for G episode units
    flow = build_workflow(partial.workflow)
    assert flow.sampling == "joint" and flow.agents == ("planner", "coder", "reflector")
    assert units_per_round(flow, partial.workflow.agents, 4,
                           {"reasoner": "episode", "coder": "episode"}) \
        == {"reasoner": 4, "coder": 4}
    assert [flow.groups_per_round(a, 4) for a in flow.agents] == [3, 3, 2]


def test_rule_score_never_invents_a_score():
    with pytest.raises(ValueError, match="inline"):
        workflow().rule_score("reflector", ADD_TASK, "looks fine", "stop", {})


# ------------------------------------------------------------------------------ rewards

def test_three_rounds_score_deltas_by_hand_on_the_agents_line_231_credits():
    metrics, rows, _, episode, by_model = play(workflow(), [
        "1. return the sum", THREE, "It returns a constant.",  # s_1 = 1/4
        "1. add a and b", ABS, "abs() is wrong for negatives.",  # s_2 = 3/4
        "1. multiply", TIMES,  # s_3 = 2/4; round 3 is the last: no reflector
    ])
    # d = (.25, .75 − .25, .5 − .75) = (.25, .5, −.25)
    assert {key: row.reward for key, row in rows.items()} == {
        ("planner", 1): 0.25, ("coder", 1): 0.25,
        ("reflector", 1): 0.5, ("planner", 2): 0.5, ("coder", 2): 0.5,
        ("reflector", 2): -0.25, ("planner", 3): -0.25, ("coder", 3): -0.25}
    assert {row.outcome for row in rows.values()} == {0.0}
    meta = {key: json.loads(row.meta) for key, row in rows.items()}
    assert meta["reflector", 1]["credited_round"] == 2 and meta["reflector", 1]["round"] == 1
    assert meta["coder", 2]["score"] == 0.75 and meta["coder", 2]["reward_delta"] == 0.5
    assert meta["coder", 1]["tests_passed"]["verdicts"] == ["pass", "fail", "fail", "fail"]
    assert meta["coder", 3]["tool_called"] and meta["coder", 3]["tool_ok"]
    # partial sharing: planner and reflector rows to one model, the coder's to the other
    assert sorted((r.agent, r.turn) for r in by_model["reasoner"]) == [
        ("planner", 1), ("planner", 2), ("planner", 3), ("reflector", 1), ("reflector", 2)]
    assert sorted((r.agent, r.turn) for r in by_model["coder"]) == [
        ("coder", 1), ("coder", 2), ("coder", 3)]
    assert episode.coach_requests() == []  # inline: READY on arrival, never coached
    assert metrics["success"] == 0.0 and metrics["rounds"] == 3.0
    assert metrics["pass_rate_first"] == 0.25 and metrics["pass_rate_last"] == 0.5
    assert metrics["improvement"] == 0.25 and "rounds_to_solve" not in metrics
    assert metrics["behavior/coder/tool_call_rate"] == 1.0
    assert metrics["behavior/reflector/response_tokens"] == 1.0  # one scripted token each

    # reinforce_pp's return-to-go over an agent's rows: the deltas telescope, so the coder of
    # round t returns s_3 − s_{t−1} (.5, .25, −.25) and the reflector of round t s_3 − s_t
    keys = sorted(rows)
    returns = dict(zip(keys, path_returns(
        [rows[k].reward for k in keys], ["e"] * len(keys), [k[0] for k in keys],
        [k[1] for k in keys], [""] * len(keys), [0] * len(keys))))
    assert [returns["coder", t] for t in (1, 2, 3)] == pytest.approx([0.5, 0.25, -0.25])
    assert [returns["reflector", t] for t in (1, 2)] == pytest.approx([0.25, -0.25])


def test_the_loop_stops_once_every_test_passes():
    metrics, rows, _, _, _ = play(workflow(), ["plan", RIGHT])  # s_1 = 1: no reflection
    assert {key: row.reward for key, row in rows.items()} == {("planner", 1): 1.0,
                                                               ("coder", 1): 1.0}
    assert metrics["success"] == 1.0 and metrics["rounds"] == 1.0
    assert metrics["rounds_to_solve"] == 1.0 and metrics["improvement"] == 0.0
    assert "behavior/reflector/response_tokens" not in metrics

    # solved in round 2: s = (.25, 1) -> d = (.25, .75); no second reflection, no round 3
    metrics, rows, _, _, _ = play(workflow(), ["plan", THREE, "constant", "plan", RIGHT])
    assert {key: row.reward for key, row in rows.items()} == {
        ("planner", 1): 0.25, ("coder", 1): 0.25,
        ("reflector", 1): 0.75, ("planner", 2): 0.75, ("coder", 2): 0.75}
    assert {row.outcome for row in rows.values()} == {1.0}
    assert metrics["rounds"] == 2.0 and metrics["rounds_to_solve"] == 2.0
    assert metrics["improvement"] == 0.75


def test_a_reply_without_code_scores_zero_and_the_next_round_gets_the_whole_score():
    metrics, rows, engine, _, _ = play(workflow(max_rounds=2), [
        "plan", "I would add them.", "Write a code block.", "plan", RIGHT])
    # s = (0, 1) -> d = (0, 1)
    assert rows["coder", 1].reward == 0.0 and rows["planner", 1].reward == 0.0
    assert rows["reflector", 1].reward == 1.0 and rows["coder", 2].reward == 1.0
    assert json.loads(rows["coder", 1].meta)["tool_called"] is False
    assert metrics["behavior/coder/tool_call_rate"] == 0.5
    assert "nothing ran (0 tests passed)" in engine.prompts[2]  # the reflector is told


def test_a_sandbox_failure_fails_the_rows_of_the_unscored_round(monkeypatch):
    flow = workflow()
    verify, calls = flow._verify, []

    async def flaky(*args):
        calls.append(1)
        if len(calls) == 2:
            raise SandboxError("workspace vanished")
        return await verify(*args)

    monkeypatch.setattr(flow, "_verify", flaky)
    metrics, rows, _, episode, _ = play(flow, ["plan", THREE, "constant", "plan", ABS])
    failed = {c.step_id for commits in episode.failures.values() for c in commits}
    assert failed == {rows[k].step_id for k in [("reflector", 1), ("planner", 2), ("coder", 2)]}
    assert all(c.failed_reason == "sandbox" for cs in episode.failures.values() for c in cs)
    assert rows["planner", 1].reward == 0.25 and rows["coder", 1].reward == 0.25
    assert rows["coder", 2].reward is None  # never rewarded: it ships FAILED
    assert json.loads(rows["coder", 2].meta)["tool_called"] is True  # the verifier was asked
    assert metrics["sandbox_failures"] == 1.0 and metrics["rounds"] == 1.0
    assert flow.tool.infra_failures == 1


# ------------------------------------------------------------------------------ prompts

def test_prompts_carry_the_loop_state_from_verifier_and_reflector_to_the_next_round():
    _, _, engine, _, _ = play(workflow(max_rounds=2), [
        "PLAN-ONE", THREE, "REFLECTION: it returns a constant.", "PLAN-TWO", ABS])
    planner1, coder1, reflector, planner2, coder2 = engine.prompts
    for prompt in engine.prompts:  # every agent sees the problem
        assert 'def add(a: int, b: int) -> int:\n    """Return a + b."""' in prompt
    assert "You are the Planner" in planner1 and "Do not write code" in planner1
    assert "previous attempt" not in planner1.lower()
    assert "You are the Coder" in coder1 and "Plan:\nPLAN-ONE" in coder1
    assert "one ```python block" in coder1
    # the reflector sees the plan, the code and the verifier's test results (line 231)
    assert "You are the Reflector" in reflector and "PLAN-ONE" in reflector
    assert "def add(a, b):\n    return 3" in reflector
    assert "Verifier: passed 1 of 4 tests." in reflector
    assert "assert candidate(0, 0) == 0  -> failed (got 3)" in reflector
    # round 2's planner and coder see the previous code, its report and the reflection
    for prompt in (planner2, coder2):
        assert "(round 1) did not pass every test" in prompt
        assert "return 3" in prompt and "passed 1 of 4 tests." in prompt
        assert "Reflector's feedback:\nREFLECTION: it returns a constant." in prompt
    assert "Plan:\nPLAN-TWO" in coder2


def test_summary_feedback_reports_the_count_but_no_test():
    _, _, engine, _, _ = play(workflow(max_rounds=2, feedback="summary"),
                              ["plan", THREE, "constant", "plan", RIGHT])
    reflector = engine.prompts[2]
    assert "Verifier: passed 1 of 4 tests." in reflector and "assert" not in reflector


def test_the_workflow_builds_by_name():
    flow = build_workflow(WorkflowConfig(name="reflect_code", params={"max_rounds": 3}))
    assert isinstance(flow, ReflectCode) and flow.coach_prompt == ""
    assert flow.estimator_error("reinforce_pp") == "" and flow.estimator_error("magrpo")


def test_delta_rewards_credit_the_first_score_then_each_improvement():
    # Scores 0.2, 0.5, 0.4, 1.0 -> 0.2, 0.5 − 0.2, 0.4 − 0.5 (a regression), 1.0 − 0.4;
    # they sum to the last score.
    rewards = delta_rewards([0.2, 0.5, 0.4, 1.0])
    assert rewards == pytest.approx([0.2, 0.3, -0.1, 0.6])
    assert sum(rewards) == pytest.approx(1.0)
    assert delta_rewards(np.array([0.0, 0.0])) == [0.0, 0.0]  # no improvement, no credit


def test_delta_rewards_of_one_round_and_of_none():
    assert delta_rewards([0.7]) == [0.7]
    assert delta_rewards([]) == []


def test_delta_rewards_reject_a_missing_score():
    with pytest.raises(ValueError, match="round 2 is nan"):
        delta_rewards([0.5, float("nan"), 1.0])
