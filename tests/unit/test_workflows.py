"""Workflow rules: parsing and scores for every kind of model output (never an exception)."""
import random

import pytest

from actors.workflows.arith_duo import ArithDuo, boxed_answer, num_eq
from actors.workflows.arith_duo import ArithDuoConfig
from actors.workflows.base import Task, units_per_round
from actors.workflows.signal_game import SignalGameConfig
from actors.workflows.signal_game import SignalGame

TASK = Task("t", "What is 17 + 25?", "42")


@pytest.mark.parametrize("text,finish,score", [
    ("The answer is \\boxed{42}.", "stop", 1.0),
    ("\\boxed{ 42 }", "length", 1.0),
    ("\\boxed{41}", "stop", 0.2),
    ("42", "stop", 0.0),  # right number but no box: format penalty takes everything
    ("", "stop", 0.0),
    ("\\boxed{", "length", 0.0),
    ("\x00\x01 garbage ✓ \\boxed{abc}", "stop", 0.0),
])
def test_verifier_scores(text, finish, score):
    wf = ArithDuo(ArithDuoConfig())
    assert wf.rule_score("verifier", TASK, text, finish, {}) == pytest.approx(score)


@pytest.mark.parametrize("text,finish,score", [
    ("17 + 25 = 42", "stop", 1.0),
    ("17 + 25 = 42 and then", "length", 0.7),
    ("17 + 25 = 43", "stop", 0.3),
    ("", "stop", 0.0),
    ("", "length", 0.0),
])
def test_solver_scores(text, finish, score):
    wf = ArithDuo(ArithDuoConfig())
    assert wf.rule_score("solver", TASK, text, finish, {}) == pytest.approx(score)


def test_boxed_takes_the_last_answer_and_num_eq():
    assert boxed_answer("\\boxed{1} then \\boxed{-3}") == -3
    assert boxed_answer("no box") is None
    assert num_eq(42.0, 42.0000001) and not num_eq(42, 43)


def test_arith_tasks_are_reproducible_and_correct():
    wf = ArithDuo(ArithDuoConfig(max_operand=9, operators="*"))
    a = [wf.make_task(random.Random(3), i) for i in range(5)]
    b = [wf.make_task(random.Random(3), i) for i in range(5)]
    assert a == b
    for task in a:
        x, op, y = task.prompt.removeprefix("What is ").rstrip("?").split()
        assert int(task.truth) == int(x) * int(y)


def test_signal_game_parses_only_valid_targets():
    game = SignalGame(SignalGameConfig(num_targets=4))
    assert game.parse_answer("3") == 3
    assert game.parse_answer(" 2 x") == 2
    assert game.parse_answer("7") is None
    assert game.parse_answer("") is None
    assert game.parse_answer("b") is None


def test_units_per_round_counts_shared_models_and_readiness():
    wf = ArithDuo(ArithDuoConfig())
    assert units_per_round(wf, {"solver": "p", "verifier": "p"}, 4, {"p": "group"}) == {"p": 2}
    assert units_per_round(wf, {"solver": "p", "verifier": "p"}, 4, {"p": "episode"}) == {"p": 1}
    game = SignalGame(SignalGameConfig())
    agents = {"sender": "a", "receiver": "b"}
    assert units_per_round(game, agents, 8, {"a": "group", "b": "group"}) == {"a": 1, "b": 1}
    assert units_per_round(game, agents, 8, {"a": "episode", "b": "episode"}) == {"a": 8, "b": 8}


def test_signal_game_refuses_to_invent_a_coach_score():
    game = SignalGame(SignalGameConfig())
    with pytest.raises(ValueError, match="inline"):
        game.rule_score("receiver", Task("t", "target 1", "1"), "1", "length", {})


def test_every_registered_workflow_builds_from_defaults_and_travels_to_ray_actors():
    """Workflows register themselves; each built one must pickle (it is sent to the coach
    and rollout actors) — a cached bound helper once broke this for dsbench_lite."""
    import pickle

    from actors.workflows import WorkflowConfig, build_workflow, workflow_names

    names = workflow_names()
    assert {"arith_duo", "signal_game", "mathchat", "dsbench_lite"} <= set(names)
    for name in names:
        workflow = build_workflow(WorkflowConfig(name=name))
        assert workflow.name == name
        clone = pickle.loads(pickle.dumps(workflow))
        assert clone.agents == workflow.agents


def test_workflow_params_are_checked_by_the_workflows_own_config():
    from actors.workflows import WorkflowConfig, build_workflow

    with pytest.raises(ValueError, match="workflow.params.max_operand=0"):
        build_workflow(WorkflowConfig(name="arith_duo", params={"max_operand": 0}))
    with pytest.raises(ValueError, match="workflow.params of arith_duo.*no_such_field"):
        build_workflow(WorkflowConfig(name="arith_duo", params={"no_such_field": 1}))
    with pytest.raises(ValueError, match="workflow.name='nope' is unknown"):
        build_workflow(WorkflowConfig(name="nope"))


def test_episode_scalars_namespace_and_average_present_keys():
    from actors.rollout import episode_scalars

    results = [{"success": 1.0, "turns_to_solve": 2.0, "behavior/tool/tool_call_rate": 1.0},
               {"success": 0.0, "behavior/tool/tool_call_rate": 0.5}]
    assert episode_scalars("sudoku", results) == {
        "episode/sudoku/success": 0.5,
        "episode/sudoku/turns_to_solve": 2.0,  # only the solved episode has it
        "behavior/tool/tool_call_rate": 0.75,
    }


class _RecordingRoute:
    """A model route that records the sampling parameters of every generate call."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, float]] = []

    def next_client(self):
        return self

    def encode(self, messages, prefix: str = "") -> list[int]:
        return [1, 2]

    def decode(self, ids) -> str:
        return "7"

    async def generate(self, prompt_ids, n, max_new_tokens, temperature=1.0, top_p=1.0,
                       stop=None):
        from actors.engines.client import Generation

        self.calls.append((temperature, top_p))
        return [Generation([3], [-0.1], [0], "stop", "7") for _ in range(n)]


def test_episode_samples_each_agent_with_its_own_parameters():
    import asyncio

    from actors.episode import Episode, SamplingParams

    route = _RecordingRoute()
    episode = Episode(run_id="r", workflow="arith_duo", task_id="t", round_id="o",
                      round_size=1, round_index=0, group_size=2,
                      agent_models={"solver": "m", "verifier": "m"}, routes={"m": route},
                      sampling=SamplingParams(1.0, 1.0),
                      agent_sampling={"verifier": SamplingParams(0.6, 0.9)})

    async def both() -> None:
        await episode.act("solver", "q", turn=0, n=2, max_new_tokens=4)
        await episode.act("verifier", "q", turn=1, n=2, max_new_tokens=4)
    asyncio.run(both())
    assert route.calls == [(1.0, 1.0), (0.6, 0.9)]
