"""Grid-game team workflows (sudoku, plan_path, sokoban; AT-GRPO A.1.3-A.1.5, §4.1 Alg. 1).

Episodes are driven by a script of replies (the engine is the only part replaced: what a model
writes is the input under test); the tool's code runs in the real sandbox and every reply is
stepped on the real environments. The expected rewards are worked out by hand from the
appendix's formulas; each case shows its arithmetic.
"""
import asyncio
import itertools
import json
import random

import numpy as np
import pytest

from actors.coach.rule import RuleCoach
from actors.envs import build_environment, plan_path, sokoban, sudoku
from actors.episode import Action, CoachRequest
from actors.sandbox import SandboxConfig
from actors.tasks import TaskConfig, TaskSource
from actors.workflows import WorkflowConfig, build_workflow, grid_prompts
from actors.workflows.base import Task, units_per_round
from actors.workflows.grid_team import Candidate, select
from buffers.schema import tree_path
from learners.advantages import at_grpo_rewards

GAMES = ("sudoku", "plan_path", "sokoban")
SOLUTION = [[1, 2, 3, 4], [3, 4, 1, 2], [2, 1, 4, 3], [4, 3, 2, 1]]
# one blank per row, on the diagonal: (0,0)=1, (1,1)=4, (2,2)=4, (3,3)=1
PUZZLE = [[0, 2, 3, 4], [3, 0, 1, 2], [2, 1, 0, 3], [4, 3, 2, 0]]
SUDOKU_TASK = {"game": "sudoku", "seed": 0, "size": 4, "blanks": 4, "puzzle": PUZZLE,
               "solution": SOLUTION}
# 3×4 map, one obstacle at (1,1): start (0,0), goal (2,3), d_0 = 5; shortest paths have 5 moves
PATH_TASK = {"game": "plan_path", "seed": 0, "height": 3, "width": 4, "walls": [[1, 1]],
             "start": [0, 0], "goal": [2, 3], "solution": ["D", "D", "R", "R", "R"]}
READ_STATE = ("```python\nimport json\ngrid = json.load(open('state.json'))['grid']\n"
              "r, c = next((r, c) for r in range(4) for c in range(4) if grid[r][c] == 0)\n"
              "print(json.dumps([[r + 1, c + 1, 1]]))\n```")


def task_of(game_task: dict) -> Task:
    module = {"sudoku": sudoku, "plan_path": plan_path}[game_task["game"]]
    return Task(f"{game_task['game']}-t", module.describe(game_task),
                json.dumps(game_task["solution"]), {"task": game_task})


class ScriptedEpisode:
    """The act/reward/annotate/keep/coach surface of actors.episode.Episode, from a script.

    `replies[agent]` is a list of calls, each a list of the K candidate texts.
    """

    def __init__(self, replies: dict[str, list[list[str]]], group_size: int) -> None:
        self.replies = {agent: list(calls) for agent, calls in replies.items()}
        self.group_size = group_size
        self.calls, self.meta, self.rewards, self.kept, self.requests = [], {}, {}, [], []
        self._ids = itertools.count()

    async def act(self, agent, messages, *, turn, n=1, max_new_tokens, parent_branch="",
                  prefix="", stop=None, meta=None):
        assert self.replies.get(agent), f"{agent} asked for turn {turn} beyond its script"
        texts = self.replies[agent].pop(0)
        assert len(texts) == n == self.group_size
        actions = []
        for candidate, text in enumerate(texts):
            step_id = f"s{next(self._ids)}"
            self.meta[step_id], self.rewards[step_id] = {}, {}
            actions.append(Action(step_id, agent, turn, candidate, prefix + text,
                                  np.zeros(len(text.split()) or 1, np.int32), "stop"))
        self.calls.append({"agent": agent, "turn": turn, "branch": parent_branch,
                           "prompt": messages[0]["content"], "actions": actions})
        return actions

    def reward(self, step_id, **values):
        self.rewards[step_id].update({k: v for k, v in values.items() if v is not None})

    def annotate(self, step_id, **meta):
        json.dumps(meta)
        self.meta[step_id].update(meta)

    def fail(self, step_id, reason):
        self.meta[step_id]["failed"] = reason

    def keep(self, action):
        self.kept.append(action.step_id)

    async def coach(self, actions, *, input_text, context=None, truth=None):
        self.requests += [CoachRequest(
            step_id=a.step_id, model_id="policy", agent=a.agent, workflow="sudoku",
            task_id="t", input_text=input_text, output_text=a.text, finish_reason="stop",
            context=context or {}, turn=a.turn) for a in actions]

    def rows(self, call: int) -> list[dict]:
        """Rewards and meta of the candidates of the `call`-th act."""
        return [{**self.rewards[a.step_id], **self.meta[a.step_id]}
                for a in self.calls[call]["actions"]]


def play(game_task: dict, replies, group_size: int = 2, **params):
    params.setdefault("sandbox", {"timeout_s": 10})
    workflow = build_workflow(WorkflowConfig(name=game_task["game"], params=params))
    episode = ScriptedEpisode(replies, group_size)
    return asyncio.run(workflow.run(task_of(game_task), episode)), episode, workflow


# ------------------------------------------------------------------------------ one turn, by hand

def test_sudoku_turn_rows_get_the_hand_computed_rewards_and_the_best_candidates_continue():
    result, episode, _ = play(SUDOKU_TASK, {
        "tool": [[READ_STATE, "I would rather not write code."]],
        "planner": [["Looks fine to me.", "The tool's step is right.\n#### " +
                     json.dumps(SOLUTION)]],
    })
    tool, planner = episode.rows(0), episode.rows(1)
    # tool 0 reads state.json, fills (1,1) with 1: fmt 1, exec 1, san 1 -> local
    # 0.10 + 0.20 + 0.70 = 1.0; a proposal at turn 1 of 4 does not end the episode -> team 0;
    # r = 0.6*0 + 0.4*1.0 = 0.4
    assert tool[0]["tool_called"] and tool[0]["tool_ok"]
    assert tool[0]["reward_team"] == 0.0 and tool[0]["reward_local"] == pytest.approx(1.0)
    assert tool[0]["reward"] == pytest.approx(0.4)
    # tool 1 wrote no code: nothing printed, mask 0 -> null local, r = 0.6*0 = 0
    assert not tool[1]["tool_called"] and "reward_local" not in tool[1]
    assert tool[1]["reward_team"] == 0.0 and tool[1]["reward"] == 0.0
    # planner 0 has no #### answer: mask 0, team 0 -> r = 0
    assert "reward_local" not in planner[0] and planner[0]["reward"] == 0.0
    # planner 1 solves it: team 1; local 0.15*1 + 0.55*1 + 0.30*(4/16) = 0.775;
    # r = 0.6*1 + 0.4*0.775 = 0.91
    assert planner[1]["reward_team"] == 1.0
    assert planner[1]["reward_local"] == pytest.approx(0.775)
    assert planner[1]["reward"] == pytest.approx(0.91)
    assert [r["kept"] for r in tool + planner] == [True, False, False, True]
    assert episode.kept == ["s0", "s3"]
    # one group per agent and turn; the planner's group hangs below the kept tool candidate
    assert [(c["agent"], c["turn"], c["branch"]) for c in episode.calls] == [
        ("tool", 1, ""), ("planner", 1, "0")]
    # the planner saw the kept tool candidate's code, its output and the env's verdict
    prompt = episode.calls[1]["prompt"]
    assert "state.json" in prompt and "[[1, 1, 1]]" in prompt
    assert "Tool proposal (simulated only)" in prompt and "####" in prompt
    assert all(row["outcome"] == 1.0 for row in tool + planner)
    assert result["success"] == 1.0 and result["turns_to_solve"] == 1.0
    assert result["behavior/tool/tool_call_rate"] == 0.5
    assert result["behavior/tool/tool_success"] == 1.0
    assert result["behavior/planner/reward"] == pytest.approx(0.455)  # (0 + 0.91) / 2
    assert result["behavior/tool/response_tokens"] > 0


def test_rows_components_mix_back_to_the_row_reward_in_the_learner():
    """The learner's at_grpo λ-mix of (reward_team, reward_local) is the row's reward."""
    _, episode, _ = play(SUDOKU_TASK, {
        "tool": [[READ_STATE, "no code"]],
        "planner": [["nothing", "#### " + json.dumps(SOLUTION)]]})
    rows = episode.rows(0) + episode.rows(1)
    nan = float("nan")
    team = np.array([r["reward_team"] for r in rows])
    local = np.array([r.get("reward_local", nan) for r in rows])
    mixed = at_grpo_rewards(team, local, np.full(len(rows), nan), alpha=1.0, lam=sudoku.LAMBDA)
    assert mixed == pytest.approx([r["reward"] for r in rows])


# ------------------------------------------------------------------------------ several turns

def test_plan_path_continues_from_the_kept_clone_over_two_turns():
    code = "```python\nprint('{}')\n```".format
    result, episode, _ = play(PATH_TASK, {
        # turn 1 tool: [R,R] -> (0,2), d 5 -> 3: team 2/5 = 0.4, local 1 -> r = 0.2 + 0.5 = 0.7
        #              [D]   -> (1,0), d 5 -> 4: team 1/5 = 0.2, local 1 -> r = 0.1 + 0.5 = 0.6
        # turn 2 tool: no code (mask 0, r = 0); [R,R,R] from (2,0) reaches the goal (r = 1)
        "tool": [[code("[R,R]"), code("[D]")], ["no idea", code("[R,R,R]")]],
        # turn 1 planner: [D,D] -> (2,0) on a shortest path: team 0.4, local 1 -> r = 0.7
        #                 [L] is illegal: team 0, local 0.20 (fmt only) -> r = 0.1
        # turn 2 planner: both reach the goal (r = 1): the tie goes to the first
        "planner": [["#### [D,D]", "#### [L]"], ["#### [R,R,R]", "go\n#### [R,R,R]"]],
    })
    rewards = [[round(r["reward"], 6) for r in episode.rows(i)] for i in range(4)]
    assert rewards == [[0.7, 0.6], [0.7, 0.1], [0.0, 1.0], [1.0, 1.0]]
    assert episode.rows(1)[1]["reward_local"] == pytest.approx(0.2)
    assert [(c["agent"], c["turn"], c["branch"]) for c in episode.calls] == [
        ("tool", 1, ""), ("planner", 1, "0"), ("tool", 2, "0.0"), ("planner", 2, "0.0.1")]
    # turn 2 starts from the kept planner candidate's clone: at (2,0), not (0,2) or (0,0)
    turn2 = episode.calls[2]["prompt"]
    assert '"start":[2,0]' in turn2 and "Turn 2 of 4" in turn2
    assert "History" in turn2 and "the planner answered [D,D]" in turn2
    assert "History" not in episode.calls[0]["prompt"]
    assert result["success"] == 1.0 and result["turns_to_solve"] == 2.0 and result["turns"] == 2


def test_an_unsolved_episode_plays_every_turn_and_reports_no_turns_to_solve():
    replies = {"tool": [["no code"]] * 3, "planner": [["#### [U]"]] * 3}
    result, episode, _ = play(PATH_TASK, replies, group_size=1, horizon=3)
    assert [c["turn"] for c in episode.calls] == [1, 1, 2, 2, 3, 3]
    assert result["success"] == 0.0 and "turns_to_solve" not in result
    assert "behavior/tool/tool_success" not in result  # no code ran: no success rate
    assert result["behavior/tool/tool_call_rate"] == 0.0


# ------------------------------------------------------------------------------ selection, tree

def candidate(reward: float, failed: bool = False) -> Candidate:
    from actors.envs import StepResult

    action = Action("s", "tool", 1, 0, "", np.zeros(1, np.int32), "stop")
    return Candidate(action, None, StepResult("", 0.0, 0.0, 1, reward, False), failed=failed)


def test_select_takes_the_highest_mixed_reward_ties_to_the_first_never_a_failed_row():
    pool = [candidate(0.2), candidate(0.7), candidate(0.7), candidate(0.1)]
    assert select(pool) is pool[1]
    failed = [candidate(0.9, failed=True), candidate(0.0)]
    assert select(failed) is failed[1]
    assert tree_path("", 2) == "2" and tree_path("0.3", 1) == "0.3.1"


@pytest.mark.parametrize("game", GAMES)
def test_groups_per_round_bounds_the_turns(game):
    workflow = build_workflow(WorkflowConfig(name=game, params={"horizon": 3}))
    assert workflow.groups_per_round("tool", 4) == workflow.groups_per_round("planner", 4) == 3
    shared = units_per_round(workflow, {"tool": "p", "planner": "p"}, 4, {"p": "group"})
    split = units_per_round(workflow, {"tool": "a", "planner": "b"}, 4,
                            {"a": "group", "b": "group"})
    assert shared == {"p": 6} and split == {"a": 3, "b": 3}


# ------------------------------------------------------------------------------ coach mode

def test_coach_mode_leaves_reward_to_the_rule_coach_which_returns_the_recorded_mix():
    _, episode, workflow = play(SUDOKU_TASK, {
        "tool": [[READ_STATE, "no code"]],
        "planner": [["nothing", "#### " + json.dumps(SOLUTION)]]}, reward_source="coach")
    rows = episode.rows(0) + episode.rows(1)
    assert all("reward" not in r and "reward_team" in r for r in rows)  # not READY inline
    assert len(episode.requests) == 4  # each candidate once
    coach = RuleCoach(workflow)
    scores = [asyncio.run(coach.score(r)).score for r in episode.requests]
    assert scores == pytest.approx([0.4, 0.0, 0.0, 0.91])
    assert [r["env_reward"] for r in rows] == pytest.approx(scores)
    with pytest.raises(ValueError, match="step_reward"):
        workflow.rule_score("tool", Task("t", "", ""), "text", "stop", {})


# ------------------------------------------------------------------------------ prompts, tasks

@pytest.mark.parametrize("game", GAMES)
def test_prompts_hold_the_rules_the_current_state_and_the_env_context(game):
    workflow = build_workflow(WorkflowConfig(name=game))
    task = workflow.make_task(random.Random(3), 0)
    env = build_environment(game)
    env.reset(task.extra["task"])
    context = workflow.text.context(env.state)
    prompt = grid_prompts.tool_prompt(workflow.text, task.prompt, env.observation, context, "")
    rules = task.prompt.split("\n", 1)[0]
    assert rules in prompt and env.observation in prompt and "ONE code block" in prompt
    shown = prompt.split("working directory):\n", 1)[1]
    assert json.loads(shown) == context
    planner = grid_prompts.planner_prompt(workflow.text, task.prompt, env.observation,
                                          "```python\nprint(1)\n```", "1", "verdict", "")
    assert "FORMATTING IS MANDATORY" in planner and "####" in planner
    assert "print(1)" in planner and planner.rstrip().endswith("verdict")


def test_history_keeps_the_newest_turns_within_its_budget():
    lines = [f"Turn {k}: " + "x" * 50 for k in range(1, 5)]
    block = grid_prompts.history_block(lines, 130)
    assert "Turn 4" in block and "Turn 3" in block and "Turn 1" not in block
    assert "2 earlier turn(s) not shown" in block
    assert grid_prompts.history_block([], 100) == ""
    assert grid_prompts.clip("a" * 50 + "b" * 50, 20).startswith("a")
    assert len(grid_prompts.clip("a" * 100, 20)) <= 20


@pytest.mark.parametrize("game", GAMES)
def test_train_and_eval_tasks_come_from_the_env_generator_and_never_meet(game):
    workflow = build_workflow(WorkflowConfig(name=game))
    cfg = TaskConfig(eval_size=8)
    evals = TaskSource(cfg, "eval", generator=workflow.make_task).all()
    train = TaskSource(cfg, "train", generator=workflow.make_task)
    trains = [train.task_at(i) for i in range(16)]
    assert {t.prompt for t in evals}.isdisjoint({t.prompt for t in trains})
    assert all(t.task_id.startswith("eval-") for t in evals)
    assert all(t.extra["task"]["game"] == game for t in evals + trains)
    env = build_environment(game)
    env.reset(trains[0].extra["task"])  # the task dict plays


def test_an_easy_sudoku_setting_has_few_blanks():
    workflow = build_workflow(WorkflowConfig(name="sudoku", params={"blanks": 2}))
    task = workflow.make_task(random.Random(0), 0)
    assert sum(v == 0 for row in task.extra["task"]["puzzle"] for v in row) == 2


@pytest.mark.parametrize("game,params,field", [
    ("sudoku", {"horizon": 0}, "workflow.params.horizon=0"),
    ("sudoku", {"blanks": 16}, "workflow.params.blanks=16"),
    ("sudoku", {"size": 5}, "size=5"),
    ("plan_path", {"obstacle_ratio": 1.5}, "workflow.params.obstacle_ratio=1.5"),
    ("plan_path", {"tool_tokens": 0}, "workflow.params.tool_tokens=0"),
    ("sokoban", {"boxes": 0}, "workflow.params.boxes=0"),
    ("sokoban", {"reward_source": "judge"}, "workflow.params.reward_source='judge'"),
    ("sokoban", {"observation_chars": 5}, "workflow.params.observation_chars=5"),
    ("sokoban", {"blanks": 4}, "blanks"),  # a sudoku field is unknown to sokoban
])
def test_config_errors_name_the_field(game, params, field):
    with pytest.raises(ValueError, match=field.replace("(", r"\(").replace("[", r"\[")):
        build_workflow(WorkflowConfig(name=game, params=params))


def test_sandbox_settings_reach_the_tool():
    workflow = build_workflow(WorkflowConfig(
        name="sokoban", params={"sandbox": {"timeout_s": 3, "max_concurrency": 1}}))
    assert workflow.tool.cfg == SandboxConfig(timeout_s=3, max_concurrency=1)


def test_a_task_without_a_game_dict_is_refused_by_name():
    workflow = build_workflow(WorkflowConfig(name="sokoban"))
    episode = ScriptedEpisode({}, 1)
    with pytest.raises(ValueError, match="extra\\['task'\\] must hold a sokoban task"):
        asyncio.run(workflow.run(Task("x", "p", "t", {"task": SUDOKU_TASK}), episode))
    assert sokoban.GAME == "sokoban"
