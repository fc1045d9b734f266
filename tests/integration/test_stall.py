"""A run that cannot make progress stops, and says why (runtime/stall.py, the coach's bug path).

Both runs use the tiny arith_duo config on a real engine: one whose coach never answers in
time (rows pile up PENDING), one whose HTTP coach names an API-key variable that is not set
(a programming error, not a judge failure). Neither may hang: each must raise with the cause.
"""
import re
import time
from pathlib import Path

import pytest

from runtime.config import load_config
from runtime.controller import run

ROOT = Path(__file__).resolve().parents[2]


def tiny(tmp_path, *overrides):
    return load_config(ROOT / "configs" / "arith_duo_tiny.yaml",
                       [f"run.runs_dir={tmp_path}", "run.max_steps=3", *overrides])


def test_a_run_with_no_learner_step_stops_naming_the_stuck_stage(tmp_path):
    cfg = tiny(tmp_path, "run.run_id=stall", "run.stall_timeout_s=40", "coach.latency_s=3600")
    started = time.time()
    with pytest.raises(RuntimeError) as info:
        run(cfg)
    message = str(info.value)
    assert "run.stall_timeout_s" in message
    assert "stuck at rows pending on the coach" in message, message
    pending = int(re.search(r"\{'policy': (\d+)\} rows wait for scores", message).group(1))
    assert pending > 0
    assert time.time() - started < 40 + 240  # the timeout, plus engine start-up on 2 cores


def test_a_coach_bug_stops_the_run_with_its_cause(tmp_path, monkeypatch):
    # The key variable exists where the config is checked but not where the coach runs (a
    # cluster worker without it): the coach's KeyError is a bug, not a judge failure.
    monkeypatch.setenv("TROUPE_TEST_KEY", "secret")
    cfg = tiny(tmp_path, "run.run_id=coach-bug", "coach.kind=http",
               "coach.endpoints=[{name: j, base_url: 'http://127.0.0.1:9/v1', model: j, "
               "api_key_env: TROUPE_TEST_KEY}]")
    monkeypatch.delenv("TROUPE_TEST_KEY")
    with pytest.raises(Exception, match="coach raised KeyError\\('TROUPE_TEST_KEY'\\)"):
        run(cfg)
