"""A whole run with the HTTP coach: launch_async.py, a loopback judge, backpropagation on.

The judge (actors/coach/loopback.py) runs in this test process and answers the run's coach
pool actor over loopback HTTP with a 0.3 s delay. The run must account for every row, score
every coached row (the judge never fails here), and write the `coach/…` metrics.
"""
import json
import subprocess
import sys
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from actors.coach.loopback import LoopbackJudge

ROOT = Path(__file__).resolve().parents[2]


def test_run_with_http_coach_and_backprop(tmp_path):
    judge = LoopbackJudge(delay_s=0.3)
    try:
        endpoint = (f"coach.endpoints=[{{name: loopback, base_url: '{judge.base_url}', "
                    "model: judge, max_concurrency: 64}]")
        cmd = [sys.executable, str(ROOT / "scripts" / "launch_async.py"), "--config",
               str(ROOT / "configs" / "arith_duo_tiny.yaml"), f"run.runs_dir={tmp_path}",
               "run.max_steps=3", "run.run_id=coach-http", "coach.kind=http", endpoint,
               "coach.roles={solver: Problem Solver, verifier: Verifier}",
               "coach.truth_agents=[verifier]", "coach.cache.persist=true",
               "coach.backprop.enabled=true", "coach.backprop.alpha=1.0",
               "coach.backprop.beta=0.5"]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    finally:
        judge.close()
    run_dir = tmp_path / "coach-http"
    summary = json.loads((run_dir / "summary.json").read_text())
    rows, coach = summary["rows"], summary["coach"]
    assert rows["unaccounted"] == 0 and summary["learners"]["policy"]["version"] == 3
    # every coached row was scored (the judge never fails here) and none written twice
    assert coach["scored"] > 0 and coach["failures"] == 0 and coach["commit_failures"] == 0
    assert coach["duplicates"] == 0 and rows["dropped"]["failed"] == 0
    assert coach["score/verifier/count"] > 0 and "answer_correct_agreement" in coach
    backward = [m for m, _ in judge.replies if "CONTRIBUTION" in m[-1]["content"]]
    assert backward  # the chain ran for kept actions
    assert (run_dir / "coach_cache.jsonl").stat().st_size > 0
    acc = EventAccumulator(str(run_dir / "tensorboard"),
                           size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"]) | set(acc.Tags()["histograms"])
    for key in ("coach/latency_p95_s", "coach/calls_per_s", "coach/retries",
                "coach/cache_hits", "coach/score/solver/mean", "coach/score/solver",
                "coach/member/loopback/calls", "coach/failures"):
        assert key in tags, f"{key} missing; coach keys: {sorted(t for t in tags if 'coach' in t)}"
