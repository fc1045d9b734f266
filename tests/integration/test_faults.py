"""Failure paths of a live run (the README's fault matrix): kill -9 of each part mid-run.

The row identity checked here (runtime.controller.row_accounting) compares the ledger's count,
made before rows are shipped, with what the buffers trained and dropped: it cannot balance by
construction (tests/integration/test_ledger.py shows it catching one missing row).
"""
import json
import os
import signal
import threading
import time
from pathlib import Path

import ray

from actors.coach.loopback import LoopbackJudge
from runtime.config import load_config
from runtime.controller import Run
from runtime.learner_worker import trained_twice

ROOT = Path(__file__).resolve().parents[2]


def http_coach(judge: LoopbackJudge) -> list[str]:
    """Overrides that score every row with the loopback judge over HTTP, cache off: each
    trained row needs one judge reply, so the judge's own count bounds the trained rows."""
    return ["coach.kind=http",
            f"coach.endpoints=[{{name: loopback, base_url: '{judge.base_url}', "
            "model: judge, max_concurrency: 16}]",
            "coach.roles={solver: Problem Solver, verifier: Verifier}",
            "coach.truth_agents=[verifier]", "coach.cache.enabled=false"]


def supervise(run: Run) -> tuple[threading.Thread, list]:
    """`run.wait()` on a thread, so the test can watch the recovery while it supervises."""
    failures: list[BaseException] = []

    def target() -> None:
        try:
            run.wait()
        except BaseException as exc:  # re-raised by the test after join
            failures.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, failures


def wait_for(what: str, check, deadline: float, every_s: float = 0.1):
    while not (value := check()):
        assert time.time() < deadline, f"{what}: not within the deadline"
        time.sleep(every_s)
    return value


def step_after(learner, version: int, since: float) -> float:
    """Seconds from `since` until the learner steps past `version`."""
    wait_for("a learner step after the kill",
             lambda: ray.get(learner.progress.remote())["version"] > version, since + 300)
    return time.time() - since


def finish(run: Run, thread: threading.Thread, failures: list) -> dict:
    """Join the supervising thread (it must have ended cleanly), then close the run's books."""
    thread.join(600)
    assert not thread.is_alive() and not failures, failures
    return run.finish()


def check_trained_rows(run: Run, rows: dict, judge: LoopbackJudge) -> int:
    """No row trained twice (the learner's audit) and none without a reply of the judge (its
    own count); returns the rows trained twice (0)."""
    trained, twice = trained_twice(run.run_dir / "logs" / "trained_policy.jsonl")
    assert trained > 0 and twice == 0
    assert rows["trained"] <= len(judge.replies)  # no trained row without a judge reply
    return twice


def played(run: Run) -> int:
    """Episodes the live rollout actors have finished."""
    return sum(ray.get(a.stats.remote())["episodes"] for a in list(run.rollouts.values()))


def test_killed_rollout_actor_is_replaced_and_rows_stay_accounted(tmp_path):
    """kill -9 of a rollout actor's process while it holds rounds: the controller replaces it
    at once, its in-flight rounds are settled as `actor_crashed` (the only rows lost), no row
    is trained twice (the learner's audit) and none without a judge reply (the judge's count)."""
    judge = LoopbackJudge(delay_s=0.05)
    cfg = load_config(ROOT / "configs" / "arith_duo_tiny.yaml",
                      [f"run.runs_dir={tmp_path}", "run.run_id=fault", "run.max_steps=8",
                       *http_coach(judge)])
    run = Run(cfg)
    try:
        run.start()
        learner = run.learners["policy"]
        deadline = time.time() + 300
        wait_for("learner v2", lambda: ray.get(learner.progress.remote())["version"] >= 2,
                 deadline, 0.5)
        # kill while rounds are in flight: wait until the actor holds admitted rounds
        wait_for("a round in flight",
                 lambda: ray.get(run.clock.ledger_stats.remote()).open_rounds > 0, deadline, 0.05)
        old = run.rollouts[0]
        pid = ray.get(old.stats.remote())["pid"]
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        version_at_kill = ray.get(learner.progress.remote())["version"]
        thread, failures = supervise(run)

        def replacement_played() -> bool:
            actor = run.rollouts.get(0)
            return actor is not None and actor is not old and \
                ray.get(actor.stats.remote())["episodes"] > 0
        wait_for("the replacement's first episode", replacement_played, killed_at + 300)
        replaced_s = time.time() - killed_at
        step_s = step_after(learner, version_at_kill, killed_at)
        summary = finish(run, thread, failures)
    finally:
        run.shutdown()
        judge.close()
    assert summary["actor_restarts"] == 1
    assert summary["learners"]["policy"]["version"] == 8
    rows = summary["rows"]
    assert rows["unaccounted"] == 0, rows
    assert rows["generated"] == summary["ledger"]["generated"] > 0
    # the killed actor's rounds were settled: still playing ones freed their units, ones
    # with rows were counted lost / dropped under actor_crashed; nothing else was lost
    crashed = (sum(rows["crashed_actor_units"].values()) + rows["lost"]["actor_crashed"]
               + rows["dropped"]["actor_crashed"])
    assert crashed > 0, rows
    assert rows["lost"]["episode_error"] == 0 and rows["dropped"]["failed"] == 0, rows
    assert summary["ledger"]["open_rounds"] == 0
    assert rows["buffered"] == rows["trained"] + sum(rows["dropped"].values())
    twice = check_trained_rows(run, rows, judge)
    print(f"rollout actor kill -9: run continued; replacement played its first episode "
          f"{replaced_s:.1f} s after the kill, next learner step {step_s:.1f} s after; rows "
          f"lost {rows['lost']}, dropped {rows['dropped']}, units freed "
          f"{rows['crashed_actor_units']}; trained twice {twice}; {rows['trained']} rows "
          f"trained, {len(judge.replies)} judge replies")


def test_killed_sglang_server_is_restarted_and_the_run_goes_on(tmp_path):
    """kill -9 of the SGLang server's process group mid-run: supervision restarts it on the
    latest weights, rounds whose requests failed past the client's retries are counted
    `episode_error` (the only rows lost), and no row is trained twice or without a reply.

    Weights go as tensors, so the newest folder is the base (v0) when the server dies: the
    restart must ask the learner for a folder of the version it served (CI once saw a
    restart on an old folder drop 8 rows as stale)."""
    judge = LoopbackJudge(delay_s=0.05)
    cfg = load_config(ROOT / "configs" / "arith_duo_tiny.yaml",
                      [f"run.runs_dir={tmp_path}", "run.run_id=engine-kill", "run.max_steps=8",
                       "models.policy.learner.weight_sync=tensor", *http_coach(judge)])
    run = Run(cfg)
    try:
        run.start()
        learner, engine = run.learners["policy"], run.engines["policy"][0]
        deadline = time.time() + 300
        wait_for("learner v2", lambda: ray.get(learner.progress.remote())["version"] >= 2,
                 deadline, 0.5)
        before = ray.get(engine.stats.remote())
        killed_at = time.time()
        os.killpg(before["pid"], signal.SIGKILL)
        version_at_kill = ray.get(learner.progress.remote())["version"]
        thread, failures = supervise(run)
        wait_for("the server's restart", lambda: (s := ray.get(engine.stats.remote()))[
            "restarts"] > before["restarts"] and s["pid"] != before["pid"] and
            ray.get(engine.is_alive.remote()), killed_at + 300, 0.5)
        restarted_s = time.time() - killed_at
        after = ray.get(engine.stats.remote())
        episodes = played(run)
        wait_for("an episode on the restarted server", lambda: played(run) > episodes,
                 killed_at + 300, 0.2)
        played_s = time.time() - killed_at
        step_s = step_after(learner, version_at_kill, killed_at)
        summary = finish(run, thread, failures)
    finally:
        run.shutdown()
        judge.close()
    assert summary["engine_restarts"] == 1
    # it came back on the version it served (or newer), from a folder its learner wrote then
    assert after["weight_version"] >= version_at_kill >= 2, after
    assert (after["restart_folders"], after["behind_restarts"]) == (1, 0), after
    assert summary["learners"]["policy"]["restart_folders"] == 1
    assert summary["learners"]["policy"]["tensor_syncs"] == 8  # no step wrote a folder
    assert summary["engines"]["policy-0"]["weight_version"] == 8  # the restarted one took updates
    assert summary["learners"]["policy"]["version"] == 8
    rows = summary["rows"]
    assert rows["unaccounted"] == 0, rows
    assert summary["ledger"]["open_rounds"] == 0
    lost = {k: v for k, v in rows["lost"].items() if v}
    assert set(lost) <= {"episode_error", "run_stopped"}, rows  # only rounds in flight
    # the restarted server served the latest weights: no row came back too stale to train
    assert rows["dropped"]["failed"] == rows["dropped"]["stale"] == 0, rows
    twice = check_trained_rows(run, rows, judge)
    print(f"SGLang server kill -9: run continued; server answering again {restarted_s:.1f} s "
          f"after the kill, episodes flowing {played_s:.1f} s after, next learner step "
          f"{step_s:.1f} s after; rows lost {lost}, dropped {rows['dropped']}; trained twice "
          f"{twice}; {rows['trained']} rows trained, {len(judge.replies)} judge replies")


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
    cfg = load_config(ROOT / "configs" / "arith_duo_tiny.yaml", [
        f"run.runs_dir={tmp_path}", "run.run_id=coach-down", "run.max_steps=10",
        *http_coach(judge)])
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
