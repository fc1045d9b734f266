"""End to end: launch_async.py under Ray with real SGLang engines, a coach and learners.

Runs the script as a user would (a subprocess), then reads what it left: summary.json's row
accounting and the TensorBoard event files.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parents[2]

EXPECTED_KEYS = [
    "reward/solver/mean", "reward/verifier/mean",
    "train/policy/loss", "train/policy/clip_fraction", "train/policy/importance_weight_mean",
    "train/policy/truncated_fraction", "staleness/policy/mean", "staleness/policy/histogram",
    "buffer/policy/pending_rows", "buffer/policy/ready_rows", "buffer/policy/dropped_stale",
    "perf/episodes_per_s", "perf/policy/learner_busy_fraction", "coach/latency_p50_s",
    "episode/arith_duo/success", "perf/policy/weight_sync_s",
]


@pytest.fixture(scope="module")
def e2e_run(tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    cmd = [sys.executable, str(ROOT / "scripts" / "launch_async.py"), "--config",
           str(ROOT / "configs" / "arith_duo_tiny.yaml"), f"run.runs_dir={runs}",
           "run.max_steps=4", "run.run_id=e2e", "coach.latency_s=0.5"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return runs / "e2e", proc


def test_run_reports_where_its_outputs_are(e2e_run):
    run_dir, proc = e2e_run
    assert f"run directory: {run_dir}" in proc.stdout
    assert "tensorboard --logdir" in proc.stdout
    assert (run_dir / "config.yaml").exists()
    weights = sorted((run_dir / "weights" / "policy").glob("v*"))
    assert weights and weights[-1].name == "v4"
    assert (weights[-1] / "model.safetensors").exists()


def test_every_row_is_trained_or_dropped_with_a_reason(e2e_run):
    run_dir, _ = e2e_run
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = summary["rows"]
    assert summary["learners"]["policy"]["version"] == 4
    assert rows["generated"] > 0 and rows["trained"] > 0
    assert rows["unaccounted"] == 0, rows
    assert rows["generated"] == (rows["trained"] + sum(rows["dropped"].values())
                                 + sum(rows["lost"].values()))
    assert summary["engine_restarts"] == 0
    assert summary["metrics"]["non_finite"] == {}
    buffer = summary["buffers"]["policy"]
    assert buffer["pending_rows"] == 0 and buffer["ready_rows"] == 0  # drained at the end
    assert summary["coach"]["calls"] > 0
    # Engines on the learner's host (weight_sync auto): its first steps alternate folder and
    # tensors (2 each), and the last version, sent as tensors, is written as a folder at the end.
    assert summary["learners"]["policy"]["tensor_syncs"] == 2
    assert summary["learners"]["policy"]["weights"].endswith("v4")
    assert summary["engines"]["policy-0"]["weight_version"] == 4


def test_tensorboard_has_the_namespaced_keys(e2e_run):
    run_dir, _ = e2e_run
    acc = EventAccumulator(str(run_dir / "tensorboard"),
                           size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"]) | set(acc.Tags()["histograms"])
    missing = [k for k in EXPECTED_KEYS if k not in tags]
    assert not missing, f"missing {missing}; have {sorted(tags)}"
    losses = [e.value for e in acc.Scalars("train/policy/loss")]
    assert len(losses) == 4
