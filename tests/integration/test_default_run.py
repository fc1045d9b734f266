"""Acceptance: the CPU default (`make run`'s config) survives a busy machine.

Three learner steps of configs/arith_duo_cpu.yaml (SmolLM2-135M, dtype auto) with a CPU hog
spinning beside the run on this 2-core machine: the engine must never be restarted (slow is
not dead) and the ledger must balance.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hogs import cpu_hog

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_default_config_beside_a_cpu_hog_has_no_restart_and_balanced_books(tmp_path):
    hog = cpu_hog()
    try:
        cmd = [sys.executable, str(ROOT / "scripts" / "launch_async.py"), "--config",
               str(ROOT / "configs" / "arith_duo_cpu.yaml"), f"run.runs_dir={tmp_path}",
               "run.run_id=default", "run.max_steps=3"]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1100)
        hog_ran_throughout = hog.poll() is None
    finally:
        hog.kill()
        hog.wait()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert hog_ran_throughout
    summary = json.loads((tmp_path / "default" / "summary.json").read_text())
    assert summary["learners"]["policy"]["version"] == 3
    assert summary["engine_restarts"] == 0, summary["engines"]
    rows = summary["rows"]
    assert rows["generated"] > 0 and rows["trained"] > 0
    assert rows["unaccounted"] == 0, rows
    assert summary["metrics"]["non_finite"] == {}
