"""code_duo (AT-GRPO A.1.2): pass vectors, rewards by hand, the HumanEval split, user files.

Pass vectors come from the real sandbox running the real harness; episodes run on the real
`Episode` with the engine replaced by a script of replies (tests/unit/test_math_duo.py). Every
expected reward is worked out by hand from r = λ·r_team + (1−λ)·m·r_loc with λ = 0.70 and
A.1.2's coefficients (coder .1/.1/.8, tester .2/.8, τ_mut = .6); each case shows its arithmetic.
"""
import asyncio
import json
from pathlib import Path

import pytest

from actors.sandbox import Sandbox, SandboxConfig, Workspace
from actors.tasks import TaskConfig, TaskSource
from actors.workflows.base import Task, units_per_round
from actors.workflows.code_duo import CodeDuo, CodeDuoConfig, coder_reward, mutation_score
from actors.workflows.code_duo import tester_reward as reward_of_tester  # "test*" is collected
from actors.workflows.humaneval import (HumanEvalTasks, Job, JobResult, coder_program,
                                        eval_bucket, golden_program, hidden_suite,
                                        load_humaneval, mutants, run_jobs)
from actors.workflows.humaneval import tester_suite as suite_of  # "test*" is collected
from runtime.config import ConfigError, load_config
from test_math_duo import play

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
LAM = 0.70
ADD_TEST = ("METADATA = {}\n\n\ndef check(candidate):\n    assert candidate(1, 2) == 3\n"
            "    assert candidate(0, 0) == 0\n    assert candidate(-1, 1) == 0\n"
            "    assert candidate(2, 2) == 4\n    assert True, 'not a test'\n")
ADD = {"task_id": "Mine/0", "prompt": 'def add(a: int, b: int) -> int:\n    """Return a + b."""\n',
       "entry_point": "add", "canonical_solution": "    return a + b\n", "test": ADD_TEST}
ADD_TASK = Task("Mine/0", ADD["prompt"], ADD["canonical_solution"],
                {"entry_point": "add", "test": ADD_TEST})


def result(*verdicts: str, build: str = "ok") -> JobResult:
    return JobResult(build, verdicts, ("",) * len(verdicts))


def code(body: str) -> str:
    return f"```python\ndef add(a, b):\n    {body}\n```"


def run(jobs: list[Job], entry_point: str = "add", timeout_s: float = 0.5) -> list[JobResult]:
    sandbox = Sandbox(SandboxConfig(timeout_s=20))
    with Workspace.create() as workspace:
        return asyncio.run(run_jobs(sandbox, workspace, jobs, entry_point, timeout_s))


# ------------------------------------------------------------------------------ pass vectors

def test_the_hidden_suite_is_one_test_per_assert_and_assert_true_is_not_a_test():
    suite = hidden_suite(ADD_TEST, "add")
    assert suite.tests == ["assert candidate(1, 2) == 3", "assert candidate(0, 0) == 0",
                           "assert candidate(-1, 1) == 0", "assert candidate(2, 2) == 4"]
    assert "candidate = add" in suite.text()


def test_pass_vectors_from_the_sandbox():
    suite = hidden_suite(ADD_TEST, "add")
    programs = {
        "right": coder_program(ADD["prompt"], "def add(a, b):\n    return a + b", "add"),
        "times": coder_program(ADD["prompt"], "def add(a, b):\n    return a * b", "add"),
        "raises": coder_program(ADD["prompt"], "def add(a, b):\n    return a + None", "add"),
        "hangs": coder_program(ADD["prompt"], "def add(a, b):\n    while True: pass", "add"),
        "syntax": coder_program(ADD["prompt"], "def add(a, b) return", "add"),
        "body": coder_program(ADD["prompt"], "    return b + a", "add"),  # the stub's body
    }
    out = dict(zip(programs, run([Job(p, suite) for p in programs.values()])))
    assert out["right"].verdicts == ("pass",) * 4 and out["right"].clean
    # 1·2 = 2 ≠ 3, 0·0 = 0, −1·1 = −1 ≠ 0, 2·2 = 4
    assert out["times"].verdicts == ("fail", "pass", "fail", "pass")
    assert out["times"].pass_rate == 0.5 and out["times"].clean
    assert set(out["raises"].verdicts) == {"error"} and not out["raises"].clean
    assert "TypeError" in out["raises"].details[0]
    # two timeouts, then the rest of the job counts as timed out without being waited for
    assert out["hangs"].verdicts == ("timeout",) * 4
    assert not out["syntax"].built and out["syntax"].verdicts == ("not_built",) * 4
    assert out["body"].all_passed


def test_mutants_are_killed_only_by_tests_the_reference_passes():
    reference = golden_program(ADD_TASK)
    found = mutants(reference, "add", 8)
    assert len(found) == 2  # `return None` and a + b -> a - b
    suite = suite_of("```python\nassert add(2, 2) == 4\nassert add(1, 1) == 3\n"
                         "assert add(0, 0) == 0\n```", "add", 8)
    runs = run([Job(reference, suite)] + [Job(m, suite, reference=0) for m in found])
    assert runs[0].verdicts == ("pass", "fail", "pass")
    # a - b: 2 - 2 = 0 ≠ 4 kills it at test 0; None ≠ 4 too; test 1 never counts
    assert [r.killed for r in runs[1:]] == [True, True]
    assert all(r.verdicts[1] == "skipped" for r in runs[1:])
    assert mutation_score(runs[0], runs[1:]) == 1.0


def test_the_testers_suite_keeps_asserts_on_the_function_and_drops_its_own_definition():
    reply = ("Reasoning...\n```python\nimport math\ndef add(a, b):\n    return 0\n"
             "assert add(1, 2) == 3\nassert math.pi > 3\nx = 5\nassert add(x, 1) == 6\n"
             "assert add(0, 0) == 0\n```")
    suite = suite_of(reply, "add", max_tests=2)
    assert suite.tests == ["assert add(1, 2) == 3", "assert add(x, 1) == 6"]
    assert "def add" not in suite.text() and "import math" in suite.text()
    # a block that does not parse whole keeps the lines that do
    assert suite_of("```python\nassert add(1, 1) == 2\nassert add(\n```", "add", 8).tests \
        == ["assert add(1, 1) == 2"]
    assert suite_of("no code", "add", 8).num_tests == 0


def test_a_failing_test_reports_what_the_code_gave():
    suite = suite_of("```python\nassert add(1, 2) == 3\n```", "add", 8)
    [out] = run([Job(coder_program(ADD["prompt"], "def add(a, b):\n    return a * b", "add"),
                     suite)])
    assert out.verdicts == ("fail",) and out.details == ("got 2",)


# ------------------------------------------------------------------------------ rewards

@pytest.mark.parametrize("hidden,previous,reward,local", [
    # p = 3/4; s_build 1, s_run 1, s_nr = 1/2 (passes test 0, not 1) -> r_loc = .1+.1+.4 = .6
    # r = .7·.75 + .3·.6 = .525 + .18 = .705
    (result("pass", "fail", "pass", "pass"), {0, 1}, 0.705, 0.6),
    # p = 1/3; an error: s_run 0; G empty: s_nr 1 -> r_loc = .1 + .8 = .9; r = .7/3 + .27
    (result("pass", "error", "fail"), set(), 0.7 / 3 + 0.27, 0.9),
    # turn 2 regression (test_math ... hand case): G = {0,1,3}, passes 1 and 3: s_nr = 2/3,
    # p = .5 -> r_loc = .2 + .8·2/3 = .73333, r = .35 + .22 = .57
    (result("fail", "pass", "fail", "pass"), {0, 1, 3}, 0.57, 0.2 + 0.8 * 2 / 3),
    # not built: p 0, every score 0, m 1 -> r_loc = 0 (s_nr 0: G = {0} not passed)
    (result("not_built", "not_built", build="SyntaxError"), {0}, 0.0, 0.0),
    # no code block: m = 0, r_team = 0 -> r = 0, local null
    (None, {0}, 0.0, None),
])
def test_coder_reward_by_hand(hidden, previous, reward, local):
    step = coder_reward(hidden, frozenset(previous), LAM)
    assert step.value == pytest.approx(reward)
    assert step.row_rewards()["reward_local"] == (None if local is None
                                                 else pytest.approx(local))


def killed(flag: bool) -> JobResult:
    return result("fail" if flag else "pass", "skipped")


@pytest.mark.parametrize("reference,again,mutant_runs,team,reward,local", [
    # valid; 2 of 3 mutants killed: 0.667/.6 > 1 -> s_cov 1; r_loc = .2 + .8 = 1
    # r = .7·.5 + .3·1 = .65
    (result("pass", "pass"), result("pass", "pass"), [killed(True), killed(False),
                                                      killed(True)], 0.5, 0.65, 1.0),
    # 1 of 4 killed: .25/.6 = .41667 -> r_loc = .2 + .8·.41667 = .53333, r = .3·.53333 = .16
    (result("pass", "pass"), result("pass", "pass"), [killed(True)] + [killed(False)] * 3,
     0.0, 0.16, 0.2 + 0.8 * 0.25 / 0.6),
    # a test fails on the reference: s_valid 0; 1 of 2 killed: .5/.6 -> r_loc = .66667,
    # r = .7·1 + .3·.66667 = .9
    (result("pass", "fail"), result("pass", "fail"), [killed(True), killed(False)], 1.0, 0.9,
     0.8 * 0.5 / 0.6),
    # not deterministic: the second run differs -> s_valid 0; no mutant: s_cov 0 -> r_loc 0
    (result("pass", "pass"), result("pass", "fail"), [], 0.0, 0.0, 0.0),
    # valid, no mutant could be made: s_cov 0 -> r_loc .2, r = .7·.25 + .06 = .235
    (result("pass"), result("pass"), [], 0.25, 0.235, 0.2),
    # no test in the reply: m = 0 -> r = λ·r_team, local null
    (None, None, [], 0.5, 0.35, None),
])
def test_tester_reward_by_hand(reference, again, mutant_runs, team, reward, local):
    step = reward_of_tester(reference, again, mutant_runs, team, LAM)
    assert step.value == pytest.approx(reward)
    assert step.row_rewards()["reward_local"] == (None if local is None
                                                 else pytest.approx(local))


# ------------------------------------------------------------------------------ episodes

def code_duo(**params) -> CodeDuo:
    params.setdefault("sandbox", SandboxConfig(timeout_s=20))
    return CodeDuo(CodeDuoConfig(test_timeout_s=0.5, **params))


def test_alignment_ends_the_episode_and_every_row_has_its_hand_computed_reward():
    result_, rows, engine, episode = play(code_duo(horizon=4), ADD_TASK, [
        # a·b: p = .5, G empty: r_loc 1 -> .35 + .3 = .65;  a+b: p = 1 -> 1.00 (kept)
        [code("return a * b"), code("return a + b")],
        # wrong expected value: s_valid 0, no test passes on the reference: MutScore 0 ->
        # r_loc 0, r_team = p of the kept code = 1 -> .70
        # right tests: valid, both mutants killed (2+3 = 5: a−b = −1, None) -> r_loc 1 -> 1.00
        ["```python\nassert add(1, 1) == 3\n```",
         "```python\nassert add(2, 3) == 5\nassert add(0, 0) == 0\n```"],
    ], group_size=2)
    assert [r.reward for r in rows] == pytest.approx([0.65, 1.00, 0.70, 1.00])
    assert [r.reward_team for r in rows] == pytest.approx([0.5, 1.0, 1.0, 1.0])
    assert [r.branch for r in rows] == ["", "", "1", "1"]
    assert result_["success"] == 1.0 and result_["aligned"] == 1.0 and result_["turns"] == 1.0
    assert result_["turns_to_solve"] == 1.0 and result_["pass_rate"] == 1.0
    assert result_["behavior/coder/tool_call_rate"] == 1.0
    assert result_["behavior/coder/tool_success"] == 1.0
    assert result_["behavior/tester/tool_success"] == 0.5  # one of two suites valid
    meta = [json.loads(r.meta) for r in rows]
    assert meta[0]["tests_passed"]["verdicts"] == ["fail", "pass", "fail", "pass"]
    assert meta[3]["mutation_score"] == 1.0 and meta[3]["kept"]
    assert episode.coach_requests() == []  # inline rewards never reach the coach
    # the tester saw the problem alone at turn 1 (A.2.2 Phase 1)
    assert "history" not in engine.prompts[1].lower()


def test_non_regression_and_the_mismatch_history_across_turns():
    result_, rows, engine, _ = play(code_duo(horizon=2), ADD_TASK, [
        [code("return abs(a) + b")],  # passes tests 0, 1, 3: p = .75 -> .525 + .3 = .825
        ["```python\nassert add(-1, 1) == 0\n```"],  # valid; kills both mutants; p = .75
        # a·b: G = {0,1,3}, passes 1 and 3: s_nr = 2/3 -> r_loc .73333, r = .35 + .22 = .57
        [code("return a * b")],
        ["```python\nassert add(-1, 1) == 0\n```"],  # the kept code now p = .5
    ], group_size=1)
    assert [r.reward for r in rows] == pytest.approx([0.825, 0.7 * 0.75 + 0.3, 0.57,
                                                      0.7 * 0.5 + 0.3])
    assert result_["turns"] == 2.0 and result_["success"] == 0.0 and result_["aligned"] == 0.0
    # turn 2's coder prompt shows the failing test and what the code gave
    assert "assert add(-1, 1) == 0  -> failed (got 2)" in engine.prompts[2]


def test_a_reply_without_code_is_masked_and_fails_nothing():
    _, rows, _, _ = play(code_duo(horizon=1), ADD_TASK, [["I would add them."], ["no tests"]],
                         group_size=1)
    assert [r.reward_local for r in rows] == [None, None]
    assert [r.reward for r in rows] == [0.0, 0.0]


# ------------------------------------------------------------------------------ tasks

def test_humaneval_split_is_disjoint_deterministic_and_sized_by_hash():
    records = load_humaneval()
    assert len(records) == 164
    train, held_out = HumanEvalTasks(0.2).split_tasks(True), HumanEvalTasks(0.2).split_tasks(False)
    assert (len(train), len(held_out)) == (136, 28)
    assert {t.task_id for t in train}.isdisjoint({t.task_id for t in held_out})
    assert {t.task_id for t in train} | {t.task_id for t in held_out} \
        == {r["task_id"] for r in records}
    assert [t.task_id for t in held_out][:5] == ["HumanEval/0", "HumanEval/2", "HumanEval/3",
                                                 "HumanEval/8", "HumanEval/16"]
    assert all(eval_bucket(t.task_id) < 0.2 for t in held_out)
    assert HumanEvalTasks(0.2).split_tasks(False) == held_out  # the same every time
    assert len(HumanEvalTasks(0.5).split_tasks(False)) > len(held_out)
    task = held_out[0]
    assert task.extra["entry_point"] == "has_close_elements" and "def check" in \
        task.extra["test"] and task.truth.strip().startswith("for idx")


def test_task_source_serves_the_shipped_split_like_a_file():
    workflow = code_duo()
    cfg = TaskConfig()
    train = TaskSource(cfg, "train", generator=workflow.make_task, seed=3)
    held_out = TaskSource(cfg, "eval", generator=workflow.make_task).all()
    assert len(train) == 136 and len(held_out) == 28
    served = {train.task_at(i).task_id for i in range(136)}  # one epoch: each task once
    assert len(served) == 136 and served.isdisjoint({t.task_id for t in held_out})
    assert train.task_at(0).extra["split"] == "train"


def test_every_humaneval_reference_passes_its_hidden_tests_on_a_sample():
    tasks = HumanEvalTasks(0.2).split_tasks(False)[:6]
    for task in tasks:
        suite = hidden_suite(task.extra["test"], task.extra["entry_point"])
        [out] = run([Job(golden_program(task), suite)], task.extra["entry_point"], 2.0)
        assert out.all_passed, task.task_id


def test_a_users_jsonl_in_humaneval_form(tmp_path):
    path = tmp_path / "mine.jsonl"
    sub = dict(ADD, task_id="Mine/1", prompt=ADD["prompt"].replace("a + b", "a - b"),
               canonical_solution="    return a - b\n", split="eval")
    path.write_text(json.dumps(dict(ADD, split="train")) + "\n" + json.dumps(sub) + "\n")
    cfg = TaskConfig(path=str(path), id_field="task_id", prompt_field="prompt",
                     answer_field="canonical_solution")
    workflow = code_duo(horizon=1)
    [task] = TaskSource(cfg, "train", generator=workflow.make_task).all()
    assert task.task_id == "Mine/0" and task.extra["entry_point"] == "add"
    assert task.truth == ADD["canonical_solution"]
    assert TaskSource(cfg, "eval", generator=workflow.make_task).all()[0].task_id == "Mine/1"
    result_, rows, _, _ = play(workflow, task, [[code("return a + b")],
                                                ["```python\nassert add(2, 3) == 5\n```"]],
                               group_size=1)
    assert result_["success"] == 1.0 and rows[0].reward == pytest.approx(1.0)


def test_config_errors_name_the_field():
    for override, field in [("workflow.params.eval_fraction=1.5", "eval_fraction"),
                            ("workflow.params.max_tests=0", "max_tests"),
                            ("workflow.params.team_lambda=-1", "team_lambda"),
                            ("workflow.params.test_timeout_s=0", "test_timeout_s")]:
        with pytest.raises(ConfigError, match=field):
            load_config(CONFIGS / "code_duo_cpu.yaml", [override])


def test_shared_and_specialised_configs_differ_only_in_the_model_mapping():
    shared = load_config(CONFIGS / "code_duo_cpu.yaml")
    special = load_config(CONFIGS / "code_duo_cpu_specialised.yaml")
    assert set(shared.workflow.agents.values()) == {"policy"}
    assert special.workflow.agents == {"coder": "coder", "tester": "tester"}
    assert shared.workflow.params == special.workflow.params
    workflow = code_duo()
    assert units_per_round(workflow, shared.workflow.agents, 4, {"policy": "group"}) \
        == {"policy": 8}
    assert units_per_round(workflow, special.workflow.agents, 4,
                           {"coder": "group", "tester": "group"}) == {"coder": 4, "tester": 4}


def test_rule_score_never_invents_a_score():
    with pytest.raises(ValueError, match="step_reward"):
        code_duo().rule_score("coder", ADD_TASK, "", "stop", {})
