"""Grid environments (actors/envs): generators, oracles, parsing, rewards (AT-GRPO A.1.3-A.1.5).

The expected rewards below are worked out by hand from the paper's formulas (each case shows
its arithmetic), not computed by the code under test.
"""
import json
import random

import pytest

from actors.envs import (ENVIRONMENTS, EVAL_SEEDS, TRAIN_SEEDS, Environment, StepResult,
                         build_environment, eval_tasks, parse_moves, plan_path, sokoban,
                         split_seed, sudoku, task_generator, train_tasks)

GAMES = {"sudoku": sudoku, "plan_path": plan_path, "sokoban": sokoban}
SEEDS = 200


def answer(game, solution):
    """The oracle's solution as an agent writes it."""
    return json.dumps(solution) if game == "sudoku" else "[" + ",".join(solution) + "]"


# ------------------------------------------------------------------------------ generators

@pytest.mark.parametrize("split", ["train", "eval"])
@pytest.mark.parametrize("game", sorted(GAMES))
def test_every_generated_instance_is_solved_by_its_oracle_replayed_through_step(game, split):
    module = GAMES[game]
    for index in range(SEEDS):
        task = module.generate(split_seed(split, index))
        assert json.loads(json.dumps(task)) == task  # JSON-serialisable as is
        solution = module.solve(task)
        assert solution is not None, (game, split, index)
        env = ENVIRONMENTS[game]()
        env.reset(task)
        assert not env.solved
        result = env.step("planner", "I checked it.\n#### " + answer(game, solution))
        assert result.done and env.solved and result.team_reward == 1.0, (game, index)


def test_sudoku_instances_are_unique_and_have_the_asked_blanks():
    for index in range(SEEDS):
        task = sudoku.generate(split_seed("eval", index))
        assert sum(v == 0 for row in task["puzzle"] for v in row) == sudoku.DEFAULT_BLANKS
        assert sudoku.count_solutions(task["puzzle"]) == 1
        assert all(p in (0, s) for prow, srow in zip(task["puzzle"], task["solution"])
                   for p, s in zip(prow, srow))
    easy = sudoku.generate(3, blanks=sudoku.EASY_BLANKS)
    assert sum(v == 0 for row in easy["puzzle"] for v in row) == 4
    loose = sudoku.generate(3, blanks=12, unique=False)
    assert sudoku.solve(loose) is not None
    with pytest.raises(ValueError, match="blanks"):
        sudoku.generate(0, blanks=16)
    with pytest.raises(ValueError, match="size"):
        sudoku.generate(0, size=5)


def test_plan_path_and_sokoban_instances_are_not_trivial():
    for index in range(SEEDS):
        path = plan_path.generate(index)
        assert path["height"] == path["width"] == 10
        assert path["start"] not in path["walls"] and path["goal"] not in path["walls"]
        assert len(path["solution"]) >= plan_path.DEFAULT_MIN_PATH_LENGTH
        room = sokoban.generate(index)
        assert room["height"] == room["width"] == 6 and len(room["boxes"]) == 1
        assert not set(map(tuple, room["boxes"])) & set(map(tuple, room["goals"]))
        assert len(room["solution"]) >= sokoban.DEFAULT_MIN_MOVES
    two = sokoban.generate(1, boxes=2)
    assert len(two["boxes"]) == 2 and sokoban.solve(two) is not None


def test_generation_is_deterministic_in_the_seed():
    for module in GAMES.values():
        for seed in (0, 1, 2**40 + 7, split_seed("eval", 5)):
            assert module.generate(seed) == module.generate(seed)
        assert module.generate(0) != module.generate(1)
    # int seeding of Mersenne Twister aliases 2**32 + 2 with 2; str seeding does not
    aliased, plain = sudoku.generate(2**32 + 2), sudoku.generate(2)
    assert (aliased["puzzle"], aliased["solution"]) != (plain["puzzle"], plain["solution"])


def test_train_and_eval_seeds_and_instances_never_overlap():
    assert TRAIN_SEEDS.stop <= EVAL_SEEDS.start
    assert split_seed("train", 5) in TRAIN_SEEDS and split_seed("eval", 5) in EVAL_SEEDS
    with pytest.raises(ValueError):
        split_seed("train", 2**62)
    with pytest.raises(ValueError):
        split_seed("test", 0)
    for game in ("sudoku", "plan_path"):  # large instance spaces: raw seeds already differ
        module = GAMES[game]
        train = {module.instance_key(module.generate(split_seed("train", i)))
                 for i in range(SEEDS)}
        held = {module.instance_key(module.generate(split_seed("eval", i))) for i in range(SEEDS)}
        assert not train & held
    for game, module in GAMES.items():  # any game: train_tasks skips the eval instances
        held = [module.instance_key(task) for task in eval_tasks(game, 50)]
        assert len(set(held)) == 50
        stream = train_tasks(game, 50)
        train = {module.instance_key(next(stream)) for _ in range(SEEDS)}
        assert not train & set(held)


def test_task_source_serves_the_generators():
    from actors.tasks import TaskConfig, TaskSource

    cfg = TaskConfig(eval_size=3)
    for game, module in GAMES.items():
        held = TaskSource(cfg, "eval", generator=task_generator(game)).all()
        train = TaskSource(cfg, "train", generator=task_generator(game), seed=1)
        task = train.next()
        assert task.task_id.startswith(f"train-{game}-")
        assert task.extra["task"] == module.generate(task.extra["task"]["seed"])
        assert task.prompt == module.describe(task.extra["task"])
        assert task.prompt not in {t.prompt for t in held}
        env = ENVIRONMENTS[game]()
        env.reset(held[0].extra["task"])
        assert env.step("planner", "#### " + answer(game, json.loads(held[0].truth))).done
    with pytest.raises(ValueError, match="blanks"):
        task_generator("sudoku", blanks=99)


# ------------------------------------------------------------------------------ sudoku

SUDOKU = {"game": "sudoku", "seed": -1, "size": 4, "blanks": 3,
          "puzzle": [[1, 0, 3, 4], [3, 4, 0, 2], [2, 1, 4, 3], [4, 3, 2, 0]],
          "solution": [[1, 2, 3, 4], [3, 4, 1, 2], [2, 1, 4, 3], [4, 3, 2, 1]]}


def sudoku_step(agent, text):
    env = ENVIRONMENTS["sudoku"]()
    env.reset(SUDOKU)
    return env.step(agent, text)


@pytest.mark.parametrize("agent, text, team, local, reward", [
    # planner: two legal fills -> 0.15 + 0.55 + 0.30*2/16 = 0.7375; r = 0.4*0.7375
    ("planner", "#### [[1,2,2],[2,3,1]]", 0.0, 0.7375, 0.295),
    # planner solves (3 of 16 cells) -> 0.15 + 0.55 + 0.30*3/16 = 0.75625; r = 0.6 + 0.4*0.75625
    ("planner", "Valid.\n#### [[1,2,3,4],[3,4,1,2],[2,1,4,3],[4,3,2,1]]", 1.0, 0.75625, 0.9025),
    # planner duplicates 3 in row 1 -> 0.15 + 0 + 0.30/16 = 0.16875; r = 0.4*0.16875
    ("planner", "#### [[1,2,3]]", 0.0, 0.16875, 0.0675),
    # planner with an out-of-range step -> fmt 0: 0.55 + 0.30/16 = 0.56875; r = 0.4*0.56875
    ("planner", "#### [[1,2,2],[9,9,1]]", 0.0, 0.56875, 0.2275),
    # tool rewrites clue (1,1) -> exec 0; its other edit is sane: 0.10 + 0.70 = 0.8; r = 0.32
    ("tool", "[[1,1,2],[1,2,2]]", 0.0, 0.8, 0.32),
    # tool fill clashes with the 4 in row 1 -> san 0: 0.10 + 0.20 = 0.3; r = 0.12
    ("tool", "[[1,2,4]]", 0.0, 0.3, 0.12),
    # tool out of bounds -> fmt 0, exec 0, nothing applied so san 0: 0
    ("tool", "[[5,1,2]]", 0.0, 0.0, 0.0),
    # tool only rewrites a clue with its own value: nothing changes, san 0: 0.10 + 0.20 = 0.3
    ("tool", "[[1,1,1]]", 0.0, 0.3, 0.12),
    # tool's program prints the solution: team 1 (terminal because solved), local 1; r = 1
    ("tool", "[[1,2,3,4],[3,4,1,2],[2,1,4,3],[4,3,2,1]]", 1.0, 1.0, 1.0),
])
def test_sudoku_rewards_by_hand(agent, text, team, local, reward):
    result = sudoku_step(agent, text)
    assert result.mask == 1
    assert result.team_reward == pytest.approx(team)
    assert result.local_reward == pytest.approx(local)
    assert result.reward == pytest.approx(reward)


def test_sudoku_pure_reward_functions():
    before = sudoku.initial_state(SUDOKU)
    action = sudoku.parse("#### [[1,2,2],[2,3,1],[4,4,1]]", before, "planner")
    after = sudoku.apply(before, action)
    assert sudoku.solved(after)
    # r^team = 1{k = T, Solved}: solved at k = 1 of 4 is terminal -> 1; unsolved at k = K -> 0
    assert sudoku.team_reward(before, action, after, 1, 4) == 1.0
    assert sudoku.team_reward(before, None, before, 4, 4) == 0.0
    local = sudoku.planner_local(before, action, after, 1, 4)
    assert local.scores == {"fmt": 1.0, "legal": 1.0, "prog": 3 / 16}
    masked = sudoku.tool_local(before, None, before, 1, 4)
    assert masked.mask == 0 and masked.value == 0.0
    assert sum(sudoku.PLANNER_COEFFICIENTS.values()) == pytest.approx(1.0)
    assert sum(sudoku.TOOL_COEFFICIENTS.values()) == pytest.approx(1.0)
    assert sudoku.LAMBDA == 0.60


def test_sudoku_parsing():
    state = sudoku.initial_state(SUDOKU)
    grid = sudoku.parse("#### [[1,2,3,4],[3,4,1,2],[2,1,4,3],[4,3,2,1]]", state, "planner")
    assert grid.kind == "grid" and len(grid.edits) == 16
    steps = sudoku.parse("#### [(1, 2, 2), (4, 4, 1)]", state, "planner")  # Python tuples
    assert steps == sudoku.SudokuAction(((1, 2, 2), (4, 4, 1)), "steps")
    # the planner's answer is the first list after the last ####
    text = "draft [[1,1,1]]\n#### wrong\n#### [[1,2,2]] then [[2,3,1]]"
    assert sudoku.parse(text, state, "planner").edits == ((1, 2, 2),)
    # the tool's is the last list its program printed
    assert sudoku.parse("debug [1, 2]\n[[2,3,1]]", state, "tool").edits == ((2, 3, 1),)
    for bad in ["[[1,2,2]]",  # planner without ####
                "#### no json", "#### [[1,2]]", "#### [[1,2,3],[4,5]]", "#### []",
                "#### [[true,2,2]]", "#### [[0,0,0,0],[0,0,0,0],[0,0,0,0],[0,0,0,0]]",
                "#### [[1,2,3,4],[3,4,1,2],[2,1,4,3]]", "#### [[1,2,'x']]", "#### [[[[[["]:
        assert sudoku.parse(bad, state, "planner") is None, bad


# ------------------------------------------------------------------------------ plan-path

PATH = {"game": "plan_path", "seed": -1, "height": 3, "width": 4, "walls": [[1, 1]],
        "start": [0, 0], "goal": [2, 3], "solution": ["D", "D", "R", "R", "R"]}
# . . . .    start (0,0), goal (2,3); Manhattan d_0 = 5; BFS distances to the goal:
# . # . .    5 4 3 2 / 4 # 2 1 / 3 2 1 0
# . . . G


@pytest.mark.parametrize("agent, text, team, local, reward", [
    # R,R: d 5 -> 3, team 2/5 = 0.4; fmt, leg, sp all 1; r = 0.5*0.4 + 0.5*1
    ("planner", "#### [R, R]", 0.4, 1.0, 0.7),
    # D then R into the obstacle: stops at (1,0), d = 4, team 0.2; leg 0, sp 0 -> 0.2; r = 0.2
    ("planner", "#### [D, R]", 0.2, 0.2, 0.2),
    # L leaves the grid: team 0; fmt only -> 0.2; r = 0.5*0.2
    ("planner", "#### [L]", 0.0, 0.2, 0.1),
    # legal detour D,U: back at start, team 0; sp 0 -> 0.2 + 0.4 = 0.6; r = 0.3
    ("planner", "#### [D, U]", 0.0, 0.6, 0.3),
    # reaches the goal: team 1, local 1; r = 1
    ("planner", '#### ["D","D","R","R","R"]', 1.0, 1.0, 1.0),
    # a move past the goal is ignored but is not on a shortest path: 0.2 + 0.4 = 0.6; r = 0.8
    ("planner", "#### [D, D, R, R, R, U]", 1.0, 0.6, 0.8),
    # tool R,R then an unknown symbol: fmt 0, exec 0, shape 1 (d 5 -> 3) -> 0.5; team 0.4;
    # r = 0.5*0.4 + 0.5*0.5 = 0.45
    ("tool", "[R, R, X]", 0.4, 0.5, 0.45),
    # tool off the grid: fmt 1, exec 0, shape 1 (d unchanged) -> 0.6; r = 0.3
    ("tool", "[L]", 0.0, 0.6, 0.3),
])
def test_plan_path_rewards_by_hand(agent, text, team, local, reward):
    env = ENVIRONMENTS["plan_path"]()
    env.reset(PATH)
    result = env.step(agent, text)
    assert result.mask == 1
    assert (result.team_reward, result.local_reward, result.reward) == \
        pytest.approx((team, local, reward))


def test_plan_path_shaping_and_team_reward_after_a_committed_turn():
    env = ENVIRONMENTS["plan_path"]()
    env.reset(PATH)
    env.step("planner", "#### [R, R, R]")  # now at (0,3), d = 2
    # tool steps away: d 2 -> 3, shape 0; exec 1, fmt 1 -> 0.5; team max(0, -1/5) = 0; r = 0.25
    result = env.step("tool", "[L]")
    assert (result.team_reward, result.local_reward, result.reward) == \
        pytest.approx((0.0, 0.5, 0.25))
    # the tool only simulates: the planner still starts from (0,3); D,D: d 2 -> 0, goal
    result = env.step("planner", "#### [D, D]")
    assert result.done and result.team_reward == 1.0 and result.info["turn"] == 2
    assert sum(plan_path.PLANNER_COEFFICIENTS.values()) == pytest.approx(1.0)
    assert sum(plan_path.TOOL_COEFFICIENTS.values()) == pytest.approx(1.0)
    assert plan_path.LAMBDA == 0.50


def test_move_parsing():
    assert parse_moves("#### [U,R,D,L]", "planner") == ("U", "R", "D", "L")
    assert parse_moves('#### ["u", \'R\']', "planner") == ("U", "R")
    assert parse_moves("print me\n['D', 'D']", "tool") == ("D", "D")
    assert parse_moves("#### [up]", "planner") == ("UP",)  # parsed, fails s_fmt
    for bad in ["[U,R]", "#### U R", "#### []", "#### [", "nothing"]:
        assert parse_moves(bad, "planner") is None, bad
    assert parse_moves("no list here", "tool") is None


# ------------------------------------------------------------------------------ sokoban

ROOM = {"game": "sokoban", "seed": -1, "height": 6, "width": 6,
        "walls": [[r, c] for r in range(6) for c in range(6) if r in (0, 5) or c in (0, 5)],
        "goals": [[3, 4], [4, 4]], "boxes": [[2, 2], [4, 3]], "player": [3, 1],
        "solution": []}
# ######     B = 2 boxes: (2,2) and (4,3); goals (3,4), (4,4); player (3,1)
# #____#     ψ_0 = -(min(1+2, 2+2) + min(1+1, 0+1)) = -(3 + 1) = -4
# #_X__#
# #P__O#
# #__XO#
# ######


@pytest.mark.parametrize("agent, text, team, local, reward", [
    # D,R,R pushes (4,3) onto (4,4): b = 1, team 1/2; fmt, leg, dlk 1; r = 0.4*0.5 + 0.6*1
    ("planner", "#### [D, R, R]", 0.5, 1.0, 0.8),
    # R,U,R,U,L corners box (2,2) at (1,1) off a goal: dlk 0 -> 0.10 + 0.45; r = 0.6*0.55
    ("planner", "#### [R, U, R, U, L]", 0.0, 0.55, 0.33),
    # same moves as the tool: exec 1; ψ -4 -> -(5 + 1) = -6, pot 0 -> 0.10 + 0.30; r = 0.24
    ("tool", "[R, U, R, U, L]", 0.0, 0.4, 0.24),
    # R,R,D pushes (4,3) into the wall: stops; leg 0, no new corner: 0.10 + 0.45; r = 0.33
    ("planner", "#### [R, R, D]", 0.0, 0.55, 0.33),
    # the same as the tool: exec 0, ψ unchanged so pot 1 -> 0.10 + 0.60; r = 0.6*0.7 = 0.42
    ("tool", "[R, R, D]", 0.0, 0.7, 0.42),
])
def test_sokoban_rewards_by_hand(agent, text, team, local, reward):
    env = ENVIRONMENTS["sokoban"]()
    env.reset(ROOM)
    result = env.step(agent, text)
    assert result.mask == 1
    assert (result.team_reward, result.local_reward, result.reward) == \
        pytest.approx((team, local, reward))


def test_sokoban_malformed_planner_keeps_the_team_term_only():
    env = ENVIRONMENTS["sokoban"]()
    env.reset(ROOM)
    env.step("planner", "#### [D, R, R]")  # one box on a goal
    result = env.step("planner", "I would push right. RIGHT")  # no #### and no list
    # mask 0: r = 0.4 * (1/2) + 0.6 * 0 = 0.2
    assert result.mask == 0 and result.reward == pytest.approx(0.2)
    assert "no action list" in result.observation and not result.done


def test_sokoban_pure_rules():
    state = sokoban.initial_state(ROOM)
    blocked = sokoban.SokobanState(state.room, (2, 1), frozenset({(2, 2), (2, 3)}))
    assert sokoban.move(blocked, "R") is None  # a box cannot push another box
    assert sokoban.potential(state) == -4
    done = sokoban.SokobanState(state.room, (3, 1), frozenset({(3, 4), (4, 4)}))
    assert sokoban.team_reward(state, ("R",), done, 1, 4) == 1.0
    assert sum(sokoban.PLANNER_COEFFICIENTS.values()) == pytest.approx(1.0)
    assert sum(sokoban.TOOL_COEFFICIENTS.values()) == pytest.approx(1.0)
    assert sokoban.LAMBDA == 0.40
    solution = sokoban.solve(ROOM)
    env = ENVIRONMENTS["sokoban"]()
    env.reset(ROOM)
    assert env.step("planner", "#### " + answer("sokoban", solution)).team_reward == 1.0


# ------------------------------------------------------------------------------ protocol

JUNK = ["", "####", "#### [", "[[[[", "####]]]][[", "#### [[1,2,3]", "\x00\xff ü 漢字",
        "#### " + "[" * 500 + "]" * 500, "#### " + "[" * 20000 + "]" * 20000,
        "#### " + "[" * 3000 + "]" * 3000, "#### [" + ",".join(["U"] * 5000) + "]",
        "#### [[1e9, -3, 2]]", "#### [None]", "#### {\"a\": 1}", "#### [[1,2,3],[1,2,3,4]]"]


@pytest.mark.parametrize("game", sorted(GAMES))
def test_malformed_output_is_an_observation_not_an_exception(game):
    module = GAMES[game]
    task = module.generate(11)
    for text in JUNK:
        for agent in ("tool", "planner"):
            env = build_environment(game, horizon=4)
            env.reset(task)
            result = env.step(agent, text)
            assert isinstance(result, StepResult) and result.observation
            assert 0.0 <= result.reward <= 1.0
            if not result.info["parsed"]:
                assert result.mask == 0 and result.reward == pytest.approx(
                    module.LAMBDA * result.team_reward)


@pytest.mark.parametrize("game", sorted(GAMES))
def test_clone_is_independent(game):
    module = GAMES[game]
    task = module.generate(4)
    env = ENVIRONMENTS[game](horizon=2)
    first = env.reset(task)
    assert isinstance(env, Environment)
    branch = env.clone()
    branch.task["seed"] = "changed"
    result = branch.step("planner", "#### " + answer(game, module.solve(task)))
    assert result.done and branch.solved and branch.turn == 2
    assert not env.solved and not env.done and env.turn == 1 and env.observation == first
    assert env.task["seed"] == 4
    # the original plays on by itself: two bad turns end it unsolved at the horizon
    assert not env.step("planner", "#### nothing").done
    last = env.step("planner", "#### nothing")
    assert last.done and not env.solved and last.team_reward == 0.0
    with pytest.raises(RuntimeError):
        env.step("planner", "#### [U]")
    assert branch.done and branch.solved  # untouched by the original's turns


def test_tool_steps_never_commit_and_guards():
    env = ENVIRONMENTS["plan_path"](horizon=1)
    with pytest.raises(RuntimeError):
        env.step("planner", "#### [R]")
    env.reset(PATH)
    for _ in range(3):
        assert not env.step("tool", "[D, D, R, R, R]").done  # would solve, but only simulated
    assert env.turn == 1 and not env.solved
    with pytest.raises(ValueError):
        env.step("coder", "[R]")
    with pytest.raises(ValueError):
        env.reset(SUDOKU)
    with pytest.raises(ValueError):
        build_environment("chess")
    with pytest.raises(ValueError):
        ENVIRONMENTS["sokoban"](horizon=0)
    assert env.step("planner", "#### [R]").done  # horizon 1: the only turn ends it


def test_seeded_episodes_replay_identically():
    """Same task and same texts give the same observations and rewards (tree branches agree)."""
    rng = random.Random(0)
    texts = ["#### [" + ",".join(rng.choice("UDLRX") for _ in range(6)) + "]" for _ in range(4)]
    runs = []
    for _ in range(2):
        env = ENVIRONMENTS["sokoban"]()
        env.reset(sokoban.generate(9))
        runs.append([env.step("planner", text) for text in texts])
    assert runs[0] == runs[1]
