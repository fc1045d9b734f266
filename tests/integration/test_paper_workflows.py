"""Acceptance: MAPPA's two systems run under launch_async.py on CPU (issue: 3 learner steps).

mathchat (solver → code executor → verifier) and dsbench_lite (data engineer → modeler →
analyst) on their CPU configs, with the executor's code run in the sandbox. Each run must
reach version 3, call the tool, balance its row books and leave no workspace behind.
"""
import pytest
from launch_helper import launch, scalars


def check_books(summary: dict) -> None:
    assert all(s["version"] == 3 for s in summary["learners"].values()), summary["learners"]
    rows = summary["rows"]
    assert rows["generated"] > 0 and rows["trained"] > 0
    assert rows["unaccounted"] == 0, rows


@pytest.mark.slow
def test_mathchat_cpu_runs_three_steps_with_the_sandbox(tmp_path):
    summary = launch("mathchat_cpu.yaml", tmp_path)
    check_books(summary)
    calls = scalars(tmp_path / "r", "episode/mathchat/tool_call_rate")
    assert calls and max(calls) > 0  # the executor's code ran in the sandbox
    assert scalars(tmp_path / "r", "episode/mathchat/success")


@pytest.mark.slow
def test_dsbench_lite_cpu_runs_three_steps_with_the_sandbox(tmp_path):
    summary = launch("dsbench_lite_cpu.yaml", tmp_path)
    check_books(summary)
    calls = scalars(tmp_path / "r", "episode/dsbench_lite/tool_call_rate")
    assert calls and max(calls) > 0
