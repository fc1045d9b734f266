"""magrpo_code (MAGRPO single-turn HumanEval): config, the paper's prompts, joint rewards by hand.

Episodes run on the real `Episode`, each with its own scripted engines (one per agent, so a
reply reaches its agent whatever order the concurrent acts take); joint programs run on the
real hidden suite in the real sandbox. Every expected reward is the level sum of
magrpo_code_reward.py, structure (0.4 aux + 0.6 main) + syntax 0.5 + tests 1.0 x rate +
cooperation (0.5 call + 1.0 beyond a wrapper), worked out in each case.
"""
import asyncio
import re
from pathlib import Path

import numpy as np
import pytest

from actors.engines.client import Generation
from actors.episode import Episode, SamplingParams
from actors.sandbox import SandboxConfig
from actors.workflows import WorkflowConfig, build_workflow
from actors.workflows.base import Task, units_per_round
from actors.workflows.humaneval import load_humaneval, record_to_task
from actors.workflows.magrpo_code import (MagrpoCode, MagrpoCodeConfig, prompts,
                                          signature_params)
from learners.advantages import grpo, magrpo
from runtime.config import ConfigError, load_config

TINY = Path(__file__).resolve().parents[2] / "configs" / "magrpo_code_tiny.yaml"
ADD_TEST = ("METADATA = {}\n\n\ndef check(candidate):\n    assert candidate(1, 2) == 3\n"
            "    assert candidate(0, 0) == 0\n    assert candidate(-1, 1) == 0\n"
            "    assert candidate(2, 2) == 4\n")
ADD_TASK = Task("Mine/0", 'def add(a: int, b: int) -> int:\n    """Return a + b."""\n',
                "    return a + b\n", {"entry_point": "add", "test": ADD_TEST})

# helpers: right, and a * b (passes (0, 0) and (2, 2): 2 of the 4 tests)
AUX_RIGHT = "def aux(a, b):\n    return a + b\n"
AUX_TIMES = "def aux(a, b):\n    return a * b\n"
# main functions: uses aux's value beyond wrapping it; its own code (no aux); a wrapper
MAIN_USES = "def add(a, b):\n    s = aux(a, b)\n    return int(s)\n"
MAIN_OWN = "def add(a, b):\n    return a + b\n"
MAIN_WRAPS = "def add(a, b):\n    return aux(a, b)\n"


class Script:
    """One agent's engine in one episode: answers its generate calls from `replies`."""

    def __init__(self, *replies: str | tuple[str, str], fail: bool = False,
                 events: list | None = None, name: str = "") -> None:
        self.replies, self.fail = list(replies), fail
        self.texts: list[str] = []
        self.prompts: list[str] = []
        self.events, self.name = events if events is not None else [], name

    def next_client(self):
        return self

    def encode(self, messages, prefix: str = "") -> list[int]:
        self.prompts.append(messages[-1]["content"])
        return [1, 2, 3]

    def decode(self, ids) -> str:
        return self.texts[int(ids[0])]

    async def generate(self, prompt_ids, n, max_new_tokens, temperature=1.0, top_p=1.0,
                       stop_token_ids=None, stop=None):
        self.events.append(f"{self.name} starts")
        await asyncio.sleep(0)  # a real engine call suspends: the other agent acts meanwhile
        self.events.append(f"{self.name} ends")
        if self.fail:
            raise ConnectionError("engine down")
        text, finish = self.replies.pop(0) if isinstance(self.replies[0], tuple) \
            else (self.replies.pop(0), "stop")
        self.texts.append(text)
        return [Generation(np.array([len(self.texts) - 1]), np.array([-0.5]), np.array([0]),
                           finish, text)]


def workflow(**params) -> MagrpoCode:
    return MagrpoCode(MagrpoCodeConfig(sandbox=SandboxConfig(timeout_s=20), test_timeout_s=2.0,
                                       **params))


def play_round(flow: MagrpoCode, task: Task, pairs: list[tuple[object, object]],
               round_id: str = "round", failures: bool = False):
    """One round of G = len(pairs) episodes (aux reply, main reply), as a rollout actor plays
    it (concurrently, groups sealed at what the round produced). Returns (results, episodes,
    rows by episode index: {"aux": row, "main": row}, scripts); an episode's exception is its
    result, allowed only with `failures`."""
    scripts = [tuple(s if isinstance(s, Script) else Script(s) for s in pair) for pair in pairs]
    episodes = [Episode(run_id="r", workflow="magrpo_code", task_id=task.task_id,
                        round_id=round_id, round_size=len(pairs), round_index=i,
                        group_size=len(pairs), agent_models={"aux": "aux", "main": "main"},
                        routes={"aux": aux, "main": main}, sampling=SamplingParams())
                for i, (aux, main) in enumerate(scripts)]

    async def play():
        return await asyncio.gather(*(flow.run(task, ep) for ep in episodes),
                                    return_exceptions=True)
    results = asyncio.run(play())
    assert failures or not [r for r in results if isinstance(r, BaseException)], results
    sizes = {}
    for ep in episodes:
        for key, count in ep.group_counts().items():
            sizes[key] = sizes.get(key, 0) + count
    rows = [{r.agent: r for rows in ep.records(sizes).values() for r in rows} for ep in episodes]
    return results, episodes, rows, scripts


# ------------------------------------------------------------------------------ config

@pytest.mark.parametrize("params,message", [
    ({"joint_mode": "crossed"}, "workflow.params.joint_mode='crossed': use one of"),
    ({"aux_tokens": 0}, "workflow.params.aux_tokens=0: must be >= 1"),
    ({"main_tokens": -1}, "workflow.params.main_tokens=-1: must be >= 1"),
    ({"test_timeout_s": 0.0}, "workflow.params.test_timeout_s=0.0: must be > 0"),
    ({"eval_fraction": 1.0}, "workflow.params.eval_fraction=1.0: use a value in"),
    ({"test_timeout_s": 10.0, "sandbox": {"timeout_s": 15.0}},
     "workflow.params.sandbox.timeout_s=15.0 is below 2 x test_timeout_s=10.0.*raise"),
    ({"no_such_field": 1}, "workflow.params of magrpo_code.*no_such_field"),
])
def test_bad_params_name_the_field_value_and_fix(params, message):
    with pytest.raises(ValueError, match=message):
        build_workflow(WorkflowConfig(name="magrpo_code", params=params))


def test_cross_mode_with_magrpo_is_a_config_error_and_trains_with_grpo():
    with pytest.raises(ConfigError, match=r"models.policy.learner.advantage='magrpo' cannot "
                                          r"train magrpo_code's rows: .*joint_mode=cross.*"
                                          r"use advantage=grpo"):
        load_config(TINY, ["workflow.params.joint_mode=cross"])
    cfg = load_config(TINY, ["workflow.params.joint_mode=cross",
                             "models.policy.learner.advantage=grpo",
                             "models.policy.buffer.readiness=group"])
    assert cfg.workflow.params["joint_mode"] == "cross"
    aligned = load_config(TINY)
    assert aligned.models["policy"].learner.advantage == "magrpo"
    assert build_workflow(aligned.workflow).estimator_error("magrpo") == ""


def test_a_round_is_one_group_per_agent_and_g_episode_units():
    flow = workflow()
    assert flow.sampling == "joint" and flow.agents == ("aux", "main")
    assert flow.groups_per_round("aux", 4) == 1
    assert units_per_round(flow, {"aux": "a", "main": "m"}, 4,
                           {"a": "episode", "m": "episode"}) == {"a": 4, "m": 4}
    with pytest.raises(ValueError, match="inline"):  # never invents a per-action score
        flow.rule_score("aux", ADD_TASK, "def aux(): return 1", "stop", {})


# ------------------------------------------------------------------------------ prompts

# Appendix D, "Coding Collaboration" (magrpo.txt lines 616-643), line by line; the paper's
# ‘‘‘python is ```python, and {entry_point} / {params} are filled in below.
PAPER_AUX = ["Create a helper function for this coding problem.",
             "- Output ONLY the function code, no explanations or examples",
             "- Do NOT include markdown code blocks (```python)",
             "- Do NOT include any text before or after the function",
             "- Do NOT include test cases or example usage",
             "- Create a helper function named aux that can assist the main function",
             "- The function should return useful data for solving the problem",
             "Your output should follow this format:", "def aux(...):"]
PAPER_MAIN = ["Solve this coding problem by implementing the required function.",
              "You have access to a helper function: aux(...)",
              "- Output ONLY the function code, no explanations or examples",
              "- Do NOT include markdown code blocks (```python)",
              "- Do NOT include any text before or after the function",
              "- Do NOT include test cases or example usage",
              "- Do NOT redefine the aux() function",
              "- Implement ONLY the '{entry_point}' function as specified",
              ("- You can call aux() to assign a value to a variable within your function if "
               "helpful"),
              "Your output should follow this format:", "def {entry_point}({params}):"]


def test_prompts_hold_the_papers_instructions_and_the_task():
    record = next(r for r in load_humaneval() if r["task_id"] == "HumanEval/0")
    task = record_to_task(record, "train")
    texts = prompts(task)
    fill = {"{entry_point}": "has_close_elements",
            "{params}": "numbers: List[float], threshold: float"}
    for prompt, lines in ((texts["aux"], PAPER_AUX), (texts["main"], PAPER_MAIN)):
        for line in lines:
            for key, value in fill.items():
                line = line.replace(key, value)
            assert line in prompt.splitlines(), line
        assert "Problem:\n" + task.prompt.strip("\n") in prompt  # the whole task, as given
        assert "return result" in prompt
    # the helper is never told the entry point's signature, only the problem
    assert "def has_close_elements(numbers" not in texts["aux"].split(task.prompt.strip("\n"))[1]


def test_params_are_the_entry_points_not_the_first_def_of_the_prompt():
    by_id = {r["task_id"]: r for r in load_humaneval()}
    # HumanEval/10's prompt defines is_palindrome before the entry point make_palindrome
    assert signature_params(by_id["HumanEval/10"]["prompt"], "make_palindrome") == "string: str"
    assert signature_params(by_id["HumanEval/32"]["prompt"], "find_zero") == "xs: list"
    assert all(signature_params(r["prompt"], r["entry_point"]) != "..." for r in by_id.values())
    assert signature_params("not python (", "f") == "..."


def test_both_agents_act_at_once_from_the_task_alone():
    """Decentralised (lines 672, 687): each prompt is the task's, whatever the other replied;
    the two acts overlap (each one's engine call is under way before either returns)."""
    flow = workflow()
    events: list[str] = []
    aux, main = Script(AUX_RIGHT, events=events, name="aux"), \
        Script(MAIN_USES, events=events, name="main")
    other_aux, other_main = Script("nothing useful"), Script("def add(a, b):\n    return 0\n")
    play_round(flow, ADD_TASK, [(aux, main), (other_aux, other_main)])
    assert events == ["aux starts", "main starts", "aux ends", "main ends"]
    expected = prompts(ADD_TASK)
    assert aux.prompts == other_aux.prompts == [expected["aux"]]
    assert main.prompts == other_main.prompts == [expected["main"]]
    assert "aux(a, b)" not in expected["main"] and "return a + b" not in expected["main"]


def test_prefixes_are_filled_in_and_open_the_replies():
    flow = workflow(aux_prefix="def aux(x):\n    return ",
                    main_prefix="def {entry_point}({params}):\n    return ")
    _, _, rows, _ = play_round(flow, ADD_TASK, [("x\n", "aux(a) + b\n")])
    assert '"text": "def add(a: int, b: int):\\n    return aux(a) + b\\n"' \
        in rows[0]["main"].meta
    assert '"text": "def aux(x):\\n    return x\\n"' in rows[0]["aux"].meta


# ------------------------------------------------------------------------------ joint rewards

def test_aligned_rows_of_a_joint_action_share_its_level_reward():
    flow = workflow()
    pairs = [
        # 0.4 + 0.6 + 0.5 + 1.0 (4/4) + 1.5 (calls aux, uses its value, not a wrapper) = 4.0
        (AUX_RIGHT, MAIN_USES),
        # aux is a * b: 2 of 4 tests; main does not call it: 0.4 + 0.6 + 0.5 + 1.0 = 2.5
        (AUX_TIMES, MAIN_OWN),
        # main's `return a +` does not compile: 0.4 + 0.6, stopped at syntax = 1.0
        (AUX_RIGHT, "def add(a, b):\n    return a +\n"),
        # aux inside a markdown block still counts; no main function: 0.4, stopped = 0.4
        ("```python\ndef aux(a, b):\n    return a - b\n```", ("I cannot do it.", "length")),
    ]
    results, _, rows, _ = play_round(flow, ADD_TASK, pairs)
    expected = [(4.0, 1.0, ""), (2.5, 1.0, ""), (1.0, 0.0, "syntax"), (0.4, 0.0, "structure")]
    for (total, success, stopped), result, pair in zip(expected, results, rows):
        assert pair["aux"].reward == pair["main"].reward == pytest.approx(total)
        assert pair["aux"].reward_team == pair["aux"].reward
        assert pair["aux"].outcome == pair["main"].outcome == success
        assert result["reward"] == pytest.approx(total) and result["success"] == success
        assert f'"stopped_at": "{stopped}"' in pair["main"].meta
    assert results[0]["cooperation"] == 1.5 and results[0]["pass_rate"] == 1.0
    assert results[1]["tests"] == 1.0 and results[1]["behavior/main/calls_aux"] == 0.0
    assert results[3]["behavior/main/truncated"] == 1.0 and results[3]["structure"] == 0.4
    assert '"tests_passed": null' in rows[2]["main"].meta  # syntax failed: the tests never ran
    # one group per agent of G = 4 rows, across the round's episodes
    for agent in ("aux", "main"):
        assert len({pair[agent].group_key for pair in rows}) == 1
        assert {pair[agent].group_size for pair in rows} == {4}
        assert [pair[agent].candidate for pair in rows] == [0, 1, 2, 3]
    # MAGRPO trains them: eq. 1 over the 4 joint rewards, the same for both agents' rows
    flat = [pair[agent] for pair in rows for agent in ("aux", "main")]
    advantages = magrpo(np.array([r.reward for r in flat]), [r.group_key for r in flat],
                        [r.episode_id for r in flat], [r.agent for r in flat],
                        np.array([r.turn for r in flat]), [r.branch for r in flat],
                        np.array([r.candidate for r in flat]))
    assert np.array_equal(advantages[0::2], advantages[1::2]) and advantages[0] > 0


def test_normalised_rewards_divide_by_the_maximum():
    _, _, rows, _ = play_round(workflow(normalize_reward=True), ADD_TASK,
                               [(AUX_RIGHT, MAIN_USES), (AUX_TIMES, MAIN_WRAPS)])
    # 4.0 / 4; wrapper of a * b: 0.4 + 0.6 + 0.5 + 0.5 (2/4) + 0.5 (call only) = 2.5 -> 0.625
    assert [pair["main"].reward for pair in rows] == [1.0, 0.625]
    assert [pair["aux"].reward for pair in rows] == [1.0, 0.625]


def test_cross_rows_average_every_pairing():
    """G = 2: aux (right, a * b) x main (uses aux, wraps aux). The joint rewards:
    R(right, uses) = 1 + .5 + 1 + 1.5 = 4.0     R(right, wraps) = 1 + .5 + 1 + .5 = 3.0
    R(times, uses) = 1 + .5 + .5 + 1.5 = 3.5    R(times, wraps) = 1 + .5 + .5 + .5 = 2.5
    aux rows average their row of the matrix, main rows their column."""
    flow = workflow(joint_mode="cross")
    results, _, rows, _ = play_round(flow, ADD_TASK,
                                     [(AUX_RIGHT, MAIN_USES), (AUX_TIMES, MAIN_WRAPS)])
    assert [pair["aux"].reward for pair in rows] == [(4.0 + 3.0) / 2, (3.5 + 2.5) / 2]
    assert [pair["main"].reward for pair in rows] == [(4.0 + 3.5) / 2, (3.0 + 2.5) / 2]
    assert '"pair_rewards": [4.0, 3.0]' in rows[0]["aux"].meta
    assert '"pair_rewards": [3.0, 2.5]' in rows[1]["main"].meta
    # the episode's own pair (the diagonal) gives its metrics and outcome
    assert [r["reward"] for r in results] == [4.0, 2.5]
    assert [pair["aux"].outcome for pair in rows] == [1.0, 0.0]
    assert flow._rounds == {}  # the round's meeting point is gone
    # the rows of an episode differ: magrpo refuses them, grpo (per agent's group) trains them
    flat = [pair[agent] for pair in rows for agent in ("aux", "main")]
    columns = (np.array([r.reward for r in flat]), [r.group_key for r in flat])
    with pytest.raises(ValueError, match="shares one joint reward per joint action"):
        magrpo(*columns, [r.episode_id for r in flat], [r.agent for r in flat],
               np.zeros(4), [""] * 4, np.array([r.candidate for r in flat]))
    assert np.allclose(grpo(*columns), [1 / np.sqrt(2), 1 / np.sqrt(2),
                                        -1 / np.sqrt(2), -1 / np.sqrt(2)], atol=1e-5)


def test_cross_with_a_round_of_one_is_aligned():
    """scripts/evaluate.py plays rounds of one: the only pairing is the episode's own."""
    _, _, rows, _ = play_round(workflow(joint_mode="cross"), ADD_TASK, [(AUX_TIMES, MAIN_USES)])
    assert rows[0]["aux"].reward == rows[0]["main"].reward == 3.5
    assert '"joint_mode": "aligned"' in rows[0]["aux"].meta


def test_a_failed_episode_aborts_its_cross_round_instead_of_hanging():
    flow = workflow(joint_mode="cross")

    async def bounded():
        return await asyncio.wait_for(asyncio.to_thread(
            play_round, flow, ADD_TASK,
            [(AUX_RIGHT, MAIN_USES), (Script(fail=True), MAIN_OWN), (AUX_TIMES, MAIN_WRAPS)],
            failures=True),
            timeout=60)
    results, *_ = asyncio.run(bounded())
    assert isinstance(results[1], ConnectionError)
    for sibling in (results[0], results[2]):
        assert isinstance(sibling, RuntimeError) and re.search("sibling episode failed",
                                                               str(sibling))
    assert flow._rounds == {}


class _BrokenSandbox:
    """`run_jobs` whose sandbox fails (an infrastructure error, not the model's) for programs
    holding `marker`, and runs the others for real."""

    def __init__(self, marker: str) -> None:
        from actors.workflows import magrpo_code
        self.marker, self.real = marker, magrpo_code.run_jobs

    async def __call__(self, sandbox, workspace, jobs, entry_point, test_timeout_s):
        from actors.sandbox import SandboxError
        if self.marker in jobs[0].program:
            raise SandboxError("bwrap: cannot create the namespace")
        return await self.real(sandbox, workspace, jobs, entry_point, test_timeout_s)


def test_a_sandbox_failure_fails_the_unscored_rows(monkeypatch):
    from actors.workflows import magrpo_code
    monkeypatch.setattr(magrpo_code, "run_jobs", _BrokenSandbox("a * b"))
    # aligned: the pair (times, uses) is unscored, so both its rows FAIL; the other is 4.0
    flow = workflow()
    results, episodes, rows, _ = play_round(flow, ADD_TASK,
                                            [(AUX_RIGHT, MAIN_USES), (AUX_TIMES, MAIN_USES)])
    assert rows[0]["aux"].reward == rows[0]["main"].reward == 4.0
    assert rows[1]["aux"].reward is None and rows[1]["main"].reward is None
    failed = [c for commits in episodes[1].failures.values() for c in commits]
    assert {c.step_id for c in failed} == {rows[1]["aux"].step_id, rows[1]["main"].step_id}
    assert {c.failed_reason for c in failed} == {"sandbox"}
    assert results[1]["sandbox_failures"] == 1.0 and "success" not in results[1]
    assert flow.tool.infra_failures == 1
    # cross: aux "times" has no scored pairing (FAILED); the main rows average what was scored
    flow = workflow(joint_mode="cross")
    _, episodes, rows, _ = play_round(flow, ADD_TASK,
                                      [(AUX_RIGHT, MAIN_USES), (AUX_TIMES, MAIN_WRAPS)])
    assert rows[0]["aux"].reward == (4.0 + 3.0) / 2  # R(right, uses), R(right, wraps)
    assert rows[1]["aux"].reward is None
    assert rows[0]["main"].reward == 4.0 and rows[1]["main"].reward == 3.0  # one scored each
    assert '"pair_rewards": [4.0, null]' in rows[0]["main"].meta
