"""Failure paths of a live run: a dead rollout actor is replaced and nothing is lost silently.

The row identity checked here (runtime.controller.row_accounting) compares the ledger's count,
made before rows are shipped, with what the buffers trained and dropped: it cannot balance by
construction (tests/integration/test_ledger.py shows it catching one missing row).
"""
import json
import os
import signal
import time
from pathlib import Path

import ray

from actors.coach.loopback import LoopbackJudge
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
    # shipping waited for the restart and checked the log: no round was lost with it (rows
    # of rounds the end of the run cut off are counted run_stopped, as in every run)
    lost = summary["rows"]["lost"]
    assert summary["actor_restarts"] == 0 and lost["actor_crashed"] == lost["episode_error"] == 0
    assert summary["rows"]["unaccounted"] == 0, summary["rows"]
    print(f"buffer kill: run continued; {summary['learners']['policy']['buffer_retries']} "
          f"learner calls retried, rollout restarts {summary['actor_restarts']}, rows "
          f"lost {summary['rows']['lost']}, dropped {summary['rows']['dropped']}, "
          f"{time.time() - killed_at:.0f} s to the end of the run")


def test_killed_learner_actor_continues_from_its_checkpoint_without_training_a_row_twice(
        tmp_path):
    """kill -9 of the learner's process after it trained past a checkpoint: Ray restarts it,
    it continues from that checkpoint, its buffer rolls back what the lost steps had trained,
    and along the surviving lineage no row is trained twice (counted from the audit)."""
    cfg = load_config(ROOT / "configs" / "arith_duo_tiny.yaml",
                      [f"run.runs_dir={tmp_path}", "run.run_id=learner-kill",
                       "run.max_steps=16", "run.checkpoint_every=4", "coach.latency_s=0.2"])
    run = Run(cfg)
    try:
        run.start()
        learner = run.learners["policy"]
        deadline = time.time() + 300
        while (progress := ray.get(learner.progress.remote()))["version"] < 6:
            assert time.time() < deadline, "no learner step within 300 s"
            time.sleep(0.1)
        killed_at = time.time()
        os.kill(progress["pid"], signal.SIGKILL)
        run.wait()
        summary = run.finish()
    finally:
        run.shutdown()
    audit = run.run_dir / "logs" / "trained_policy.jsonl"
    rows, twice = trained_twice(audit)
    assert rows > 0 and twice == 0
    assert summary["learner_restarts"] == {"policy": 1}
    [recovery] = summary["learner_recoveries"]
    assert recovery["version"] >= 4 and recovery["version"] % 4 == 0
    assert summary["learners"]["policy"]["version"] == 16
    assert summary["rows"]["unaccounted"] == 0, summary["rows"]
    lines = [json.loads(line) for line in audit.read_text().splitlines()]
    marker = next(i for i, r in enumerate(lines) if "resumed_from" in r)
    lost = [r["version"] for r in lines[:marker] if r["version"] > recovery["version"]]
    print(f"learner kill: continued from v{recovery['version']} ({len(lost)} steps lost, "
          f"{recovery['recovery']['rows_untrained']} rows rolled back), recovered in "
          f"{recovery['seconds']:.1f} s, first step {lines[marker + 1]['at'] - killed_at:.1f} s "
          f"after the kill")


def test_coach_server_down_60s_delays_rewards_and_fabricates_none(tmp_path):
    """The coach's HTTP server refuses connections for 60 s mid-run: rows wait for their
    scores (the breaker pauses calls), none is dropped or given a reward the judge did not
    send, and training goes on once it is back. Every trained row needs one judge reply
    (cache off, no backpropagation), so the judge's own count bounds the trained rows."""
    judge = LoopbackJudge(delay_s=0.05)
    endpoint = (f"coach.endpoints=[{{name: loopback, base_url: '{judge.base_url}', "
                "model: judge, max_concurrency: 16}]")
    cfg = load_config(ROOT / "configs" / "arith_duo_tiny.yaml", [
        f"run.runs_dir={tmp_path}", "run.run_id=coach-down", "run.max_steps=10",
        "coach.kind=http", endpoint, "coach.roles={solver: Problem Solver, verifier: Verifier}",
        "coach.truth_agents=[verifier]", "coach.cache.enabled=false"])
    run = Run(cfg)
    try:
        run.start()
        learner = run.learners["policy"]
        deadline = time.time() + 300
        while ray.get(learner.progress.remote())["version"] < 3:
            assert time.time() < deadline, "no learner step within 300 s"
            time.sleep(0.2)
        judge.down()
        down_at = time.time()
        time.sleep(60)
        version_at_up = ray.get(learner.progress.remote())["version"]
        judge.up()
        up_at = time.time()
        while ray.get(learner.progress.remote())["version"] <= version_at_up:
            assert time.time() < up_at + 300, "no learner step after the coach came back"
            time.sleep(0.2)
        first_step_s = time.time() - up_at
        run.wait()
        summary = run.finish()
    finally:
        run.shutdown()
        judge.close()
    rows, coach = summary["rows"], summary["coach"]
    assert summary["learners"]["policy"]["version"] == 10
    assert rows["unaccounted"] == 0 and sum(rows["lost"].values()) == 0
    assert rows["dropped"]["failed"] == 0 and rows["dropped"]["timeout"] == 0
    assert coach["failures"] == 0  # calls retried through the breaker, no row failed
    assert rows["trained"] <= len(judge.replies)  # no trained row without a judge reply
    print(f"coach down {up_at - down_at:.0f} s: run continued; learner at v{version_at_up} when it came back "
          f"({version_at_up - 3} steps during the outage), first step {first_step_s:.1f} s "
          f"after; breaker opened {coach.get('breaker_opened', 0):.0f}x; rows lost 0, failed "
          f"0; {rows['trained']} rows trained, {len(judge.replies)} judge replies")
