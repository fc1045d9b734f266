"""scripts/evaluate.py on a real SGLang server (tiny model, arith_duo): JSON, TensorBoard, pass@k.

A run directory is made by hand (config.yaml + weights/policy/v3 = perturbed tiny weights),
and the evaluations share the session's tiny engine (one server start for the whole suite):
`evaluate.main(argv, engines=…)` loads the weights each evaluation asks for into it.

Run: python -m pytest tests/integration/test_evaluate.py -s   (-s prints the tables)
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from runtime.config import load_config, to_yaml
from weights_helper import save_perturbed_copy

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "evaluate.py"
TASKS = "6"  # eval tasks per greedy evaluation: enough to vary, seconds on the tiny model


def _load_script():
    spec = importlib.util.spec_from_file_location("evaluate_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


evaluate = _load_script()


def make_run(runs_dir: Path, run_id: str, model_path: Path, version: int | None) -> Path:
    """A run directory as a run leaves it: config.yaml and, if `version`, published weights."""
    cfg = load_config(ROOT / "configs" / "arith_duo_tiny.yaml",
                      [f"run.runs_dir={runs_dir}", f"run.run_id={run_id}"])
    run_dir = runs_dir / run_id
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    if version is not None:
        save_perturbed_copy(model_path, model_path, run_dir / "weights" / "policy" / f"v{version}")
    return run_dir


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_model_path) -> Path:
    return make_run(tmp_path_factory.mktemp("runs"), "evalrun", tiny_model_path, version=3)


@pytest.fixture(scope="module")
def engines(tiny_engine, tiny_model_path):
    """The session's tiny engine as the run's `policy` engine; left on its base weights."""
    yield {"policy": tiny_engine}
    if Path(tiny_engine.weights_path) != Path(tiny_model_path):
        tiny_engine.update_weights_from_disk(tiny_model_path, 0)


def run_eval(run_dir: Path, engines, *args: str) -> dict:
    """Evaluate and return the JSON report it wrote (the label is the last one written)."""
    assert evaluate.main(["--run", str(run_dir), *args], engines=engines) == 0
    written = max((run_dir / "eval").glob("*.json"), key=lambda p: p.stat().st_mtime_ns)
    return json.loads(written.read_text())


def scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """Every TensorBoard scalar of the run: tag -> {step: value} (the last value per step)."""
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


@pytest.fixture(scope="module")
def greedy(run_dir, engines) -> dict:
    return run_eval(run_dir, engines, "--max-tasks", TASKS)


def test_greedy_writes_json_and_tensorboard_at_the_version(run_dir, greedy):
    assert greedy["label"] == "v3" and greedy["step"] == 3
    assert (run_dir / "eval" / "v3.json").is_file()
    assert greedy["weights"]["policy"]["version"] == 3
    assert greedy["tasks"] == int(TASKS) and greedy["episodes"] == int(TASKS)
    workflow = greedy["metrics"]["workflow"]
    assert {"success", "boxed_fraction", "solver_useful"} <= set(workflow)
    agents = greedy["metrics"]["agents"]
    assert set(agents) == {"solver", "verifier"}
    for agent in agents.values():
        assert agent["actions"] == int(TASKS)  # one candidate per action (group size 1)
        assert agent["response_len"] > 0
        assert agent["tool_call_rate"] is None  # arith_duo has no tool: shown as "-"
        assert 0.0 <= agent["coach_score"] <= 1.0  # the run's rule coach scored every action
    tb = scalars(run_dir)
    for key, value in [("eval/arith_duo/success", workflow["success"]),
                       ("eval/solver/response_len", agents["solver"]["response_len"]),
                       ("eval/verifier/coach_score", agents["verifier"]["coach_score"])]:
        assert 3 in tb[key], f"{key} written at steps {sorted(tb[key])}, not at v3's step 3"
        assert tb[key][3] == pytest.approx(value, abs=1e-6), key
    assert "eval/solver/tool_call_rate" not in tb  # no value, no point


def test_greedy_evaluation_is_reproducible(run_dir, engines):
    # One episode at a time: concurrent episodes share server batches, and a different batch
    # can flip a near-tie of the greedy argmax (seen in bf16), which is the server's doing.
    first = run_eval(run_dir, engines, "--max-tasks", "4", "--concurrency", "1")
    again = run_eval(run_dir, engines, "--max-tasks", "4", "--concurrency", "1")
    assert again["metrics"] == first["metrics"]
    assert again["episodes_detail"] == first["episodes_detail"]


def test_pass_at_k_at_least_the_mean_accuracy(run_dir, engines):
    report = run_eval(run_dir, engines, "--samples", "3", "--max-tasks", "4")
    assert report["label"] == "v3_k3" and report["temperature"] == 0.6
    assert report["episodes"] == 12
    workflow = report["metrics"]["workflow"]
    assert workflow["pass_at_3"] >= workflow["success"]
    # sampled, not greedy: the three samples of a task do not all say the same
    by_task: dict[str, set] = {}
    for episode in report["episodes_detail"]:
        texts = tuple(a["text"] for a in episode["actions"])
        by_task.setdefault(episode["task_id"], set()).add(texts)
    assert any(len(replies) > 1 for replies in by_task.values())
    tb = scalars(run_dir)
    assert tb["eval/arith_duo/pass_at_3"][3] == pytest.approx(workflow["pass_at_3"])
    assert tb["eval/arith_duo/success_k3"][3] == pytest.approx(workflow["success"])
    assert tb["eval/solver/response_len_k3"][3] > 0


def test_pass_at_k_counts_a_task_once_any_sample_succeeds():
    """The arithmetic of summarize, on episodes made up (the tiny model never succeeds)."""
    def played(task_id, sample, success, agent_len):
        actions = [{"agent": "solver", "turn": 0, "response_len": agent_len},
                   {"agent": "verifier", "turn": 1, "response_len": 2, "tool_called": True,
                    "tool_ok": success > 0},
                   {"agent": "verifier", "turn": 2, "response_len": 2, "tool_called": False,
                    "tool_ok": False}]
        return evaluate.Played(task_id, sample, {"success": success}, actions, [],
                               scores=[("solver", 0.5), ("verifier", success)])

    episodes = [played("a", 0, 0.0, 4), played("a", 1, 1.0, 6), played("a", 2, 0.0, 8),
                played("b", 0, 0.0, 4), played("b", 1, 0.0, 4), played("b", 2, 0.0, 4)]
    summary = evaluate.summarize(episodes, {"solver": "policy", "verifier": "policy"}, samples=3)
    assert summary["workflow"] == {"success": pytest.approx(1 / 6), "pass_at_3": 0.5}
    solver, verifier = summary["agents"]["solver"], summary["agents"]["verifier"]
    assert (solver["actions"], solver["response_len"]) == (6, pytest.approx(5.0))
    assert solver["tool_call_rate"] is None and solver["tool_success"] is None
    assert verifier["tool_call_rate"] == 0.5  # one of its two actions per episode called it
    assert verifier["tool_success"] == pytest.approx(1 / 6)  # of the calls, not the actions
    assert verifier["coach_score"] == pytest.approx(1 / 6)


def test_compare_base_evaluates_the_base_at_step_0_then_the_weights(
        tmp_path, tiny_model_path, engines, capsys):
    run_dir = make_run(tmp_path, "comparerun", tiny_model_path, version=5)
    trained = run_eval(run_dir, engines, "--compare-base", "--max-tasks", "4")
    base = json.loads((run_dir / "eval" / "base.json").read_text())
    assert (base["label"], base["step"], trained["label"], trained["step"]) == ("base", 0, "v5", 5)
    assert base["weights"]["policy"]["path"] is None
    # the engine really switched weights: the same greedy prompts got other replies
    texts = [[a["text"] for a in e["actions"]] for e in base["episodes_detail"]]
    assert texts != [[a["text"] for a in e["actions"]] for e in trained["episodes_detail"]]
    assert trained["delta_vs_base"]["solver/response_len"] == pytest.approx(
        trained["metrics"]["agents"]["solver"]["response_len"]
        - base["metrics"]["agents"]["solver"]["response_len"])
    tb = scalars(run_dir)
    assert set(tb["eval/arith_duo/success"]) == {0, 5}
    out = capsys.readouterr().out
    assert "== eval base" in out and "== v5 vs base" in out
    alone = run_eval(run_dir, engines, "--base", "--max-tasks", "2")
    assert (alone["label"], alone["step"], alone["tasks"]) == ("base", 0, 2)
    assert "delta_vs_base" not in alone


def test_a_coach_that_cannot_be_built_is_reported_not_fatal(
        tmp_path, tiny_model_path, engines, monkeypatch, capsys):
    def no_judge(cfg, workflow):
        raise ConnectionError("judge at http://127.0.0.1:9/v1 refused the connection")

    monkeypatch.setattr(evaluate, "build_coach", no_judge)  # as an HTTP judge that is down
    run_dir = make_run(tmp_path, "nocoach", tiny_model_path, version=1)
    report = run_eval(run_dir, engines, "--max-tasks", "2")
    assert report["coach"]["available"] is False
    assert "refused the connection" in report["coach"]["reason"]
    assert report["metrics"]["agents"]["solver"]["response_len"] > 0  # the rest is measured
    assert "coach unavailable: could not be built" in capsys.readouterr().out
    assert "eval/solver/coach_score" not in scalars(run_dir)


def test_run_without_weights_names_the_fix(tmp_path, tiny_model_path):
    run_dir = make_run(tmp_path, "fresh", tiny_model_path, version=None)
    done = subprocess.run([sys.executable, str(SCRIPT), "--run", str(run_dir)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 2, done.stderr
    assert "no published weights for model 'policy'" in done.stderr
    assert "--base" in done.stderr  # the fix: evaluate the untrained model, or train first
    assert not (run_dir / "eval").exists()


def test_missing_version_lists_the_published_ones(run_dir, capsys):
    assert evaluate.main(["--run", str(run_dir), "--version", "7"]) == 2
    assert "--version 7: model 'policy' has versions [3]" in capsys.readouterr().err


def test_latest_is_the_newest_run(tmp_path, tiny_model_path):
    older = make_run(tmp_path, "older", tiny_model_path, version=None)
    os.utime(older / "config.yaml", (1e9, 1e9))  # written long ago, whatever the clock's grain
    newer = make_run(tmp_path, "newer", tiny_model_path, version=None)
    assert evaluate.find_run("latest", [f"run.runs_dir={tmp_path}"]) == newer
    with pytest.raises(evaluate.EvalError, match="make run"):
        evaluate.find_run("latest", [f"run.runs_dir={tmp_path / 'empty'}"])
