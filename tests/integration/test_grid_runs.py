"""Acceptance: AT-GRPO's grid games run under launch_async.py on CPU (issue: 3 learner steps).

sudoku, plan_path and sokoban (tool agent + plan agent, tree sampling, the tool's code in the
sandbox) on their tiny-model CPU configs, and sudoku with role-specialised policies (two
models, two learners). Each run must reach version 3 on every model and balance its row
books; the rows it logged (the buffers' write-ahead segments) must be the tree's: groups of K
candidates of one agent at one turn, one kept candidate per group, every row with its
environment reward components whose λ-mix is the row's reward.

    python -m pytest tests/integration/test_grid_runs.py -x -q -s
"""
import importlib.util
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from launch_helper import ROOT, buffered_rows, launch, scalars

from runtime.config import load_config, to_yaml

LAMBDA = {"sudoku": 0.6, "plan_path": 0.5, "sokoban": 0.4}
K, HORIZON = 4, 2  # the CPU configs' group_size and horizon


def logged_rows(run_dir: Path, model_id: str) -> list[dict]:
    """Every row the model's buffer accepted, from its write-ahead segments."""
    columns = ["agent", "turn", "group_size", "candidate", "group_key", "branch", "meta",
               "reward", "reward_team", "reward_local", "outcome"]
    rows = buffered_rows(run_dir, model_id).select(columns).to_pylist()
    for row in rows:
        row["meta"] = json.loads(row["meta"])
    return rows


def check_books(summary: dict) -> None:
    assert all(s["version"] == 3 for s in summary["learners"].values()), summary["learners"]
    rows = summary["rows"]
    assert rows["generated"] > 0 and rows["trained"] > 0
    assert rows["unaccounted"] == 0, rows


def check_tree_rows(rows: list[dict], game: str, agents: set[str]) -> dict:
    """The rows are the tree's (module docstring); returns the figures the report quotes."""
    assert {r["agent"] for r in rows} == agents
    groups = defaultdict(list)
    for row in rows:
        groups[row["group_key"]].append(row)
    for members in groups.values():
        assert len(members) == K and sorted(r["candidate"] for r in members) == list(range(K))
        assert len({(r["agent"], r["turn"], r["branch"]) for r in members}) == 1
        assert sum(r["meta"]["kept"] for r in members) == 1
    lam = LAMBDA[game]
    for row in rows:
        assert 1 <= row["turn"] <= HORIZON and row["reward_team"] is not None
        local = row["reward_local"] or 0.0  # null: the mask m = 0
        assert row["reward"] == pytest.approx(lam * row["reward_team"] + (1 - lam) * local,
                                              abs=1e-6)
        assert row["reward"] == pytest.approx(row["meta"]["env_reward"], abs=1e-6)
        assert row["outcome"] in (0.0, 1.0)
        if row["agent"] == "tool":
            assert "tool_called" in row["meta"]
    by_agent = defaultdict(list)
    for row in rows:
        by_agent[row["agent"]].append(row["reward"])
    return {"rows": len(rows), "groups": len(groups),
            "groups_per_agent": dict(Counter(r[0]["agent"] for r in groups.values())),
            "masked": sum(r["reward_local"] is None for r in rows),
            "mean_reward": {a: round(sum(v) / len(v), 4) for a, v in sorted(by_agent.items())},
            "tool_called": sum(bool(r["meta"].get("tool_called")) for r in rows),
            "tool_ok": sum(bool(r["meta"].get("tool_ok")) for r in rows)}


@pytest.mark.slow
@pytest.mark.parametrize("game", ["sudoku", "plan_path", "sokoban"])
def test_grid_game_cpu_config_runs_three_steps(game, tmp_path):
    summary = launch(f"{game}_cpu.yaml", tmp_path)
    check_books(summary)
    run_dir = tmp_path / "r"
    figures = check_tree_rows(logged_rows(run_dir, "policy"), game, {"tool", "planner"})
    calls = scalars(run_dir, "behavior/tool/tool_call_rate")
    assert calls and max(calls) > 0  # the tool's code ran in the sandbox
    success = scalars(run_dir, f"episode/{game}/success")
    assert success
    assert scalars(run_dir, "behavior/planner/response_tokens")
    print(f"\n{game}: {figures} success_mean={sum(success) / len(success):.3f} "
          f"tool_call_rate={calls[-1]:.2f} trained={summary['rows']['trained']} "
          f"wall={summary['test_wall_s']:.0f}s")


@pytest.mark.slow
def test_role_specialised_sudoku_trains_two_models(tmp_path):
    summary = launch("sudoku_cpu_specialised.yaml", tmp_path)
    check_books(summary)
    assert set(summary["learners"]) == {"tool", "planner"}
    run_dir = tmp_path / "r"
    tool = check_tree_rows(logged_rows(run_dir, "tool"), "sudoku", {"tool"})
    planner = check_tree_rows(logged_rows(run_dir, "planner"), "sudoku", {"planner"})
    print(f"\nsudoku specialised: tool {tool} planner {planner} "
          f"trained={summary['rows']['trained']} wall={summary['test_wall_s']:.0f}s")


@pytest.mark.slow
def test_coach_mode_rows_wait_for_the_rule_coach_and_are_scored_once(tmp_path):
    """reward_source=coach: rows arrive with their components but no reward (PENDING), the
    coach pool scores each once with rule_score (the recorded λ-mix), and none is left
    pending or scored twice."""
    summary = launch("sudoku_cpu.yaml", tmp_path, "workflow.params.reward_source=coach")
    check_books(summary)
    rows = logged_rows(tmp_path / "r", "policy")
    assert rows and all(r["reward"] is None and r["reward_team"] is not None for r in rows)
    coach = summary["coach"]
    assert coach["requests"] == len(rows) and coach["duplicates"] == 0
    assert coach["failures"] == 0 and coach["commit_failures"] == 0
    assert coach["committed"] == coach["scored"] >= summary["rows"]["trained"]
    print(f"\nsudoku coach mode: rows={len(rows)} coach={coach['requests']:.0f} requests, "
          f"{coach['committed']:.0f} committed; rows={summary['rows']} "
          f"wall={summary['test_wall_s']:.0f}s")


def _evaluate_script():
    spec = importlib.util.spec_from_file_location("evaluate_script", ROOT / "scripts" /
                                                  "evaluate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("game", ["sudoku", "sokoban"])
def test_evaluate_plays_the_eval_split_one_candidate_per_action(game, tmp_path, tiny_engine,
                                                                tiny_model_path):
    """scripts/evaluate.py on a grid game: the eval split's tasks, group size 1, the tool's
    tool-call rate and success per agent (the session's tiny engine, base weights)."""
    cfg = load_config(ROOT / "configs" / f"{game}_cpu.yaml",
                      [f"run.runs_dir={tmp_path}", "run.run_id=evalrun",
                       f"workflow.params.sandbox.workspace_root={tmp_path / 'ws'}"])
    run_dir = tmp_path / "evalrun"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    assert Path(tiny_engine.weights_path) == Path(tiny_model_path)  # the base weights
    evaluate = _evaluate_script()
    assert evaluate.main(["--run", str(run_dir), "--base", "--max-tasks", "3"],
                         engines={"policy": tiny_engine}) == 0
    report = json.loads((run_dir / "eval" / "base.json").read_text())
    assert report["tasks"] == 3 and report["temperature"] == 0.0
    assert all(e["task_id"].startswith(f"eval-{game}-") for e in report["episodes_detail"])
    for episode in report["episodes_detail"]:
        turns = Counter((a["agent"], a["turn"]) for a in episode["actions"])
        assert set(turns.values()) == {1}  # one candidate per action in evaluation
    metrics = report["metrics"]
    assert "success" in metrics["workflow"]
    assert "behavior/tool/tool_call_rate" in metrics["workflow"]
    assert metrics["agents"]["tool"]["tool_call_rate"] == 1.0  # the opened code block
    assert metrics["agents"]["planner"]["tool_call_rate"] is None
    print(f"\n{game} eval: {metrics}")
