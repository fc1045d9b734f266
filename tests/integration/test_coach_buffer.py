"""The HTTP coach pool in Ray feeding a real ReplayBuffer: outages delay, never invent.

Rows go into a `ReplayBuffer` actor, their coach requests into a `CoachPool` actor (both
wrapped with `ray.remote` as the controller does), and a loopback judge misbehaves. Every
row must end READY with a score the judge actually sent for its prompt, or FAILED with a
reason — and through an outage, READY late rather than lost.
"""
from __future__ import annotations

import time

import numpy as np
import pytest
import ray

from actors.coach import (
    BreakerConfig, CoachConfig, CoachPool, EndpointConfig, LLMCoach, RetryConfig,
)
from actors.coach.loopback import LoopbackJudge
from actors.coach.parse import Unparsable, parse_verdict
from actors.episode import CoachRequest
from buffers.replay import BufferConfig, ReplayBuffer
from buffers.schema import StepRecord, group_key, new_id
from runtime.rollout_host import BufferCommit


def rows_and_requests(n: int, tag: str) -> tuple[list[StepRecord], list[CoachRequest]]:
    """n single-row groups (each row its own unit) and one coach request per row."""
    rows, requests = [], []
    for i in range(n):
        step_id = new_id()
        output = f"{tag} answer {i}: it is {i + 1}."
        rows.append(StepRecord(
            step_id=step_id, run_id="run", model_id="m", agent="solver", workflow="arith_duo",
            task_id=f"t{i}", episode_id=new_id(), branch="", turn=0,
            group_key=group_key(f"t{i}", tag, "", "solver", 0), group_size=1, candidate=0,
            prompt_ids=np.arange(3, dtype=np.int32), response_ids=np.arange(2, dtype=np.int32),
            behavior_logprobs=np.full(2, -0.5, np.float32),
            token_versions=np.zeros(2, np.int32), finish_reason="stop"))
        requests.append(CoachRequest(
            step_id=step_id, model_id="m", agent="solver", workflow="arith_duo",
            task_id=f"t{i}", input_text=f"What is {i} + 1?", output_text=output,
            finish_reason="stop", problem=f"What is {i} + 1?"))
    return rows, requests


def spawn(judge: LoopbackJudge, breaker: BreakerConfig):
    buffer = ray.remote(ReplayBuffer).options(num_cpus=0).remote(
        "m", BufferConfig(capacity_rows=1024, unit_timeout_s=120))
    cfg = CoachConfig(kind="http", max_concurrency=16,
                      endpoints=[EndpointConfig(base_url=judge.base_url, model="judge",
                                                timeout_s=2.0)],
                      retry=RetryConfig(max_attempts=3, backoff_base_s=0.05, backoff_max_s=0.5),
                      breaker=breaker)
    pool = ray.remote(CoachPool).options(num_cpus=0, max_concurrency=1000).remote(
        cfg, LLMCoach(cfg, "arith_duo"), BufferCommit({"m": buffer}))
    return buffer, pool


def wait_settled(buffer, n: int, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while True:
        stats = ray.get(buffer.stats.remote())
        if stats.pending_rows == 0 and stats.rows_added == n:
            return
        assert time.time() < deadline, f"rows still pending after {timeout_s} s: {stats}"
        time.sleep(0.2)


def answered_scores(judge: LoopbackJudge) -> dict[str, set[float]]:
    """Per agent output (the row's identity in the prompt): every score the judge sent."""
    scores: dict[str, set[float]] = {}
    for messages, text in judge.replies:
        try:
            score = parse_verdict(text).score
        except Unparsable:
            continue
        prompt = messages[0]["content"]
        key = prompt.split("What the agent outputted:\n", 1)[1].split("\n", 1)[0]
        scores.setdefault(key, set()).add(score)
    return scores


def trained(buffer, n_units: int):
    batch = ray.get(buffer.sample.remote(n_units, 0, 0))
    assert batch is not None
    return batch.table.to_pydict()


def test_no_row_gets_a_score_the_judge_did_not_give(ray_local):
    judge = LoopbackJudge()
    try:
        judge.plan(*(["429", "500", "garbage", "bold", "ok", "garbage", "garbage", "500"] * 6))
        buffer, pool = spawn(judge, BreakerConfig(failure_threshold=100, open_s=0.5))
        rows, requests = rows_and_requests(40, "mixed")
        ray.get(buffer.try_add.remote(rows))
        ray.get(pool.submit.remote(requests))
        ray.get(pool.submit.remote(requests[:5]))  # a repeat is not scored (or written) again
        wait_settled(buffer, 40, 60)
        stats = ray.get(buffer.stats.remote())
        coach = ray.get(pool.stats.remote())
        table = trained(buffer, stats.ready_units)
        given = answered_scores(judge)
        by_step = {r.step_id: r.output_text for r in requests}
        for step_id, reward, score in zip(table["step_id"], table["reward"],
                                          table["coach_score"]):
            assert reward == pytest.approx(score)
            assert any(reward == pytest.approx(s) for s in given[by_step[step_id]])
        failed = stats.dropped["failed"]
        assert failed == coach["failures"] and failed + len(table["step_id"]) == 40
        assert coach["duplicates"] == 5 and coach["requests"] == 40
        assert coach["committed"] == len(table["step_id"]) and stats.late_commits == 0
        # a judge that only talks nonsense: asked twice each, and the rows fail, unscored
        judge.set(default="garbage")
        more_rows, more = rows_and_requests(3, "nonsense")
        ray.get(buffer.try_add.remote(more_rows))
        ray.get(pool.submit.remote(more))
        wait_settled(buffer, 43, 30)
        after = ray.get(pool.stats.remote())
        assert ray.get(buffer.stats.remote()).dropped["failed"] == failed + 3
        assert after["failed/coach_unparsable"] == coach.get("failed/coach_unparsable", 0) + 3
        assert ray.get(buffer.sample.remote(1, 0, 0)) is None  # nothing new became trainable
    finally:
        judge.close()


def test_outage_delays_rewards_but_loses_no_row_and_invents_no_score(ray_local):
    judge = LoopbackJudge()
    try:
        buffer, pool = spawn(judge, BreakerConfig(failure_threshold=3, open_s=0.3,
                                                  max_open_s=1.0, give_up_after_s=60))
        rows, requests = rows_and_requests(24, "outage")
        ray.get(buffer.try_add.remote(rows))
        ray.get(pool.submit.remote(requests[:8]))
        deadline = time.time() + 30
        while ray.get(buffer.stats.remote()).ready_units < 8:  # scored before the outage
            assert time.time() < deadline
            time.sleep(0.1)
        judge.down()  # the judge goes away with 16 rows still to score
        outage_start = time.time()
        ray.get(pool.submit.remote(requests[8:]))
        time.sleep(3.0)
        during = ray.get(buffer.stats.remote())
        assert during.pending_rows >= 16  # nothing scored while the judge is gone
        assert ray.get(pool.stats.remote())["breaker_opened"] >= 1
        judge.up()
        wait_settled(buffer, 24, 30)
        delay = time.time() - outage_start
        stats = ray.get(buffer.stats.remote())
        assert stats.dropped["failed"] == 0 and stats.ready_units == 24  # none lost
        table = trained(buffer, 24)
        given = answered_scores(judge)
        by_step = {r.step_id: r.output_text for r in requests}
        for step_id, reward in zip(table["step_id"], table["reward"]):
            assert any(reward == pytest.approx(s) for s in given[by_step[step_id]])
        coach = ray.get(pool.stats.remote())
        assert coach["failures"] == 0 and coach["retries"] >= 3 and delay >= 3.0
    finally:
        judge.close()
