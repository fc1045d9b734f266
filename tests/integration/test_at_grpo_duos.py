"""Acceptance: AT-GRPO's math and code systems run under launch_async.py on CPU (3 learner steps).

math_duo (reasoner + Python tool, appendix A.1.1) and code_duo (coder + unit tester, A.1.2) on
their tiny CPU configs, code_duo also with one model per role (the role-specialised variant).
Each run must reach version 3 on every model, run code in the sandbox, train rows whose
rewards carry both AT-GRPO components, balance its row books and leave no workspace behind.
"""
from pathlib import Path

import pyarrow.compute as pc
import pytest
from launch_helper import buffered_rows, launch, scalars


def check_books(summary: dict, models: set[str]) -> None:
    assert set(summary["learners"]) == models
    assert all(s["version"] == 3 for s in summary["learners"].values()), summary["learners"]
    rows = summary["rows"]
    assert rows["generated"] > 0 and rows["trained"] > 0
    assert rows["unaccounted"] == 0, rows


def check_rows(run_dir: Path, model: str, agents: set[str]) -> None:
    """Rows carry the λ-mix inline with its components, in groups of K = 4 per (agent, turn)."""
    rows = buffered_rows(run_dir, model)
    assert set(rows.column("agent").to_pylist()) == agents
    assert pc.all(pc.is_valid(rows.column("reward_team"))).as_py()
    rewarded = rows.filter(pc.is_valid(rows.column("reward")))
    assert rewarded.num_rows > 0
    assert set(rows.column("group_size").to_pylist()) == {4}


def check_behaviour(run_dir: Path, workflow: str, agents: list[str], tool_agents: list[str]):
    assert scalars(run_dir, f"episode/{workflow}/success")
    assert scalars(run_dir, f"episode/{workflow}/turns")
    for agent in agents:
        assert scalars(run_dir, f"behavior/{agent}/response_tokens"), agent
    for agent in tool_agents:
        assert scalars(run_dir, f"behavior/{agent}/tool_call_rate"), agent


@pytest.mark.slow
def test_math_duo_cpu_runs_three_steps(tmp_path):
    summary = launch("math_duo_cpu.yaml", tmp_path)
    check_books(summary, {"policy"})
    run_dir = tmp_path / "r"
    calls = scalars(run_dir, "behavior/tool/tool_call_rate")
    assert calls and max(calls) > 0  # the tool's code ran in the sandbox
    check_behaviour(run_dir, "math_duo", ["reasoner", "tool"], ["tool"])
    check_rows(run_dir, "policy", {"reasoner", "tool"})


@pytest.mark.slow
def test_code_duo_cpu_runs_three_steps(tmp_path):
    summary = launch("code_duo_cpu.yaml", tmp_path)
    check_books(summary, {"policy"})
    run_dir = tmp_path / "r"
    calls = scalars(run_dir, "behavior/coder/tool_call_rate")
    assert calls and max(calls) > 0  # the coder's programs ran against the hidden tests
    check_behaviour(run_dir, "code_duo", ["coder", "tester"], ["coder", "tester"])
    check_rows(run_dir, "policy", {"coder", "tester"})


@pytest.mark.slow
def test_code_duo_cpu_specialised_runs_three_steps_on_two_models(tmp_path):
    summary = launch("code_duo_cpu_specialised.yaml", tmp_path)
    check_books(summary, {"coder", "tester"})
    run_dir = tmp_path / "r"
    check_behaviour(run_dir, "code_duo", ["coder", "tester"], ["coder", "tester"])
    check_rows(run_dir, "coder", {"coder"})
    check_rows(run_dir, "tester", {"tester"})
