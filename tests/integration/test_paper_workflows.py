"""Acceptance: MAPPA's two systems run under launch_async.py on CPU (issue: 3 learner steps).

mathchat (solver → code executor → verifier) and dsbench_lite (data engineer → modeler →
analyst) on their CPU configs, with the executor's code run in the sandbox. Each run must
reach version 3, call the tool, balance its row books and leave no workspace behind.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parents[2]


def launch(config: str, tmp_path: Path, *overrides: str) -> dict:
    workspaces = tmp_path / "workspaces"
    workspaces.mkdir()
    cmd = [sys.executable, str(ROOT / "scripts" / "launch_async.py"), "--config",
           str(ROOT / "configs" / config), f"run.runs_dir={tmp_path}", "run.run_id=r",
           "run.max_steps=3", f"workflow.params.sandbox.workspace_root={workspaces}",
           *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert list(workspaces.iterdir()) == []  # every episode's workspace was removed
    return json.loads((tmp_path / "r" / "summary.json").read_text())


def scalars(run_dir: Path, key: str) -> list[float]:
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return [e.value for e in acc.Scalars(key)] if key in acc.Tags()["scalars"] else []


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
