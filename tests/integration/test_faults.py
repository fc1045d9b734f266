"""Failure paths of a live run: a dead rollout actor is replaced and nothing is lost silently.

The row identity checked here (runtime.controller.row_accounting) compares the ledger's count,
made before rows are shipped, with what the buffers trained and dropped: it cannot balance by
construction (tests/integration/test_ledger.py shows it catching one missing row).
"""
import os
import signal
import time
from pathlib import Path

import ray

from runtime.config import load_config
from runtime.controller import Run
from runtime.learner_worker import trained_twice

ROOT = Path(__file__).resolve().parents[2]


def test_killed_rollout_actor_is_replaced_and_rows_stay_accounted(tmp_path):
    cfg = load_config(ROOT / "configs" / "arith_duo_tiny.yaml",
                      [f"run.runs_dir={tmp_path}", "run.run_id=fault", "run.max_steps=5",
                       "coach.latency_s=0.2"])
    run = Run(cfg)
    try:
        run.start()
        deadline = time.time() + 300
        while ray.get(run.learners["policy"].summary.remote())["version"] < 1:
            assert time.time() < deadline, "no learner step within 300 s"
            time.sleep(0.5)
        # kill while rounds are in flight: wait until the actor holds admitted rounds
        while ray.get(run.clock.ledger_stats.remote()).open_rounds == 0:
            assert time.time() < deadline, "the rollout actor never had a round in flight"
            time.sleep(0.05)
        ray.kill(run.rollouts[0])
        run.wait()
        summary = run.finish()
    finally:
        run.shutdown()
    assert summary["actor_restarts"] == 1
    assert summary["learners"]["policy"]["version"] == 5
    rows = summary["rows"]
    assert rows["unaccounted"] == 0, rows
    assert rows["generated"] == summary["ledger"]["generated"] > 0
    # the killed actor's rounds were settled: still playing ones freed their units, ones
    # with rows were counted lost / dropped under actor_crashed
    crashed = (sum(rows["crashed_actor_units"].values()) + rows["lost"]["actor_crashed"]
               + rows["dropped"]["actor_crashed"])
    assert crashed > 0, rows
    assert summary["ledger"]["open_rounds"] == 0
    assert rows["buffered"] == rows["trained"] + sum(rows["dropped"].values())


def test_killed_buffer_actor_recovers_from_its_log_and_the_run_goes_on(tmp_path):
    """kill -9 of the buffer's process: Ray restarts it, it rebuilds itself from its
    write-ahead log, the learner's calls wait for it, and no row is trained twice (counted
    from the learner's audit of trained step_ids, not from the buffer)."""
    cfg = load_config(ROOT / "configs" / "arith_duo_tiny.yaml",
                      [f"run.runs_dir={tmp_path}", "run.run_id=buffer-kill", "run.max_steps=16",
                       "coach.latency_s=0.2"])
    run = Run(cfg)
    try:
        run.start()
        learner = run.learners["policy"]
        deadline = time.time() + 300
        while ray.get(learner.progress.remote())["version"] < 4:
            assert time.time() < deadline, "no learner step within 300 s"
            time.sleep(0.2)
        pid, _ = ray.get(run.buffers["policy"].incarnation.remote())
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        run.wait()
        summary = run.finish()
    finally:
        run.shutdown()
    rows, twice = trained_twice(run.run_dir / "logs" / "trained_policy.jsonl")
    assert rows > 0 and twice == 0
    assert summary["learners"]["policy"]["version"] == 16
    assert summary["buffer_restarts"] == {"policy": 1}
    # shipping waited for the restart and checked the log: no round was lost with it
    assert summary["actor_restarts"] == 0 and sum(summary["rows"]["lost"].values()) == 0
    assert summary["rows"]["unaccounted"] == 0, summary["rows"]
    print(f"buffer kill: run continued; {summary['learners']['policy']['buffer_retries']} "
          f"learner calls retried, rollout restarts {summary['actor_restarts']}, rows "
          f"lost {summary['rows']['lost']}, dropped {summary['rows']['dropped']}, "
          f"{time.time() - killed_at:.0f} s to the end of the run")
