"""The HTTP coach against a real OpenAI-compatible server on a loopback port (DESIGN §8).

The server (actors/coach/loopback.py) is told to answer slowly, with 429, with 500, with
garbage, with `**8**`, or not at all; every test reads what the server actually received.
"""
from __future__ import annotations

import asyncio
import time

import pytest

from actors.coach import (
    BackpropConfig, BreakerConfig, CacheConfig, CoachConfig, CoachFailure, CoachPool,
    EndpointConfig, LLMCoach, RetryConfig,
)
from actors.coach.loopback import LoopbackJudge
from actors.coach.parse import parse_attribution, parse_verdict
from actors.episode import CoachRequest


@pytest.fixture
def judge():
    server = LoopbackJudge()
    yield server
    server.close()


def make_cfg(*servers, **overrides) -> CoachConfig:
    endpoint = dict(timeout_s=5.0)
    endpoint.update(overrides.pop("endpoint", {}))
    fields = dict(kind="http",
                  endpoints=[EndpointConfig(name=f"j{i}", base_url=s.base_url, model="judge",
                                            **endpoint)
                             for i, s in enumerate(servers)],
                  retry=RetryConfig(max_attempts=4, backoff_base_s=0.1, backoff_max_s=2.0,
                                    jitter=0.0),
                  breaker=BreakerConfig(failure_threshold=50, open_s=0.5, max_open_s=2.0,
                                        give_up_after_s=30.0))
    fields.update(overrides)
    return CoachConfig(**fields)


def request(i, agent="solver", **extra) -> CoachRequest:
    fields = dict(step_id=f"s{i}", model_id="m", agent=agent, workflow="arith_duo",
                  task_id="t", input_text=f"What is {i} + 1?", output_text=f"It is {i + 1}.",
                  finish_reason="stop", truth=str(i + 1), problem=f"What is {i} + 1?")
    fields.update(extra)
    return CoachRequest(**fields)


def run(coro):
    return asyncio.run(coro)


async def scored(coach, *requests):
    try:
        return await asyncio.gather(*(coach.score(r) for r in requests), return_exceptions=True)
    finally:
        await coach.close()


def test_retries_back_off_exponentially_and_then_score(judge):
    judge.plan("429", "500", "500")
    coach = LLMCoach(make_cfg(judge), "arith_duo")
    (verdict,) = run(scored(coach, request(1)))
    assert verdict.score == parse_verdict(judge.replies[-1][1]).score
    times = [t for t, _ in judge.requests]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert [m for _, m in judge.requests] == ["429", "500", "500", "ok"]
    # waits of 0.1, 0.2, 0.4 s (no jitter here), observed at the server
    for gap, wait in zip(gaps, (0.1, 0.2, 0.4)):
        assert gap >= wait - 0.01
    stats = coach.stats()
    assert stats["retries"] == 3 and stats["member/j0/errors/server_error"] == 2
    assert stats["member/j0/errors/rate_limited"] == 1


def test_retry_after_is_a_floor(judge):
    judge.set(retry_after_s=0.6)
    judge.plan("429")
    run(scored(LLMCoach(make_cfg(judge), "arith_duo"), request(1)))
    (t0, _), (t1, _) = judge.requests
    assert t1 - t0 >= 0.59


def test_exhausted_retries_fail_with_a_reason_and_no_score(judge):
    judge.set(default="500")
    coach = LLMCoach(make_cfg(judge), "arith_duo")
    (result,) = run(scored(coach, request(1)))
    assert isinstance(result, CoachFailure) and result.reason == "coach_server_error"
    assert len(judge.requests) == 4  # max_attempts


def test_a_hung_call_times_out_and_is_retried(judge):
    judge.plan("hang")
    coach = LLMCoach(make_cfg(judge, endpoint=dict(timeout_s=1.0)), "arith_duo")
    start = time.monotonic()
    (verdict,) = run(scored(coach, request(1)))
    assert 1.0 <= time.monotonic() - start < 4.0  # one timeout, then a prompt answer
    assert verdict.score == parse_verdict(judge.replies[-1][1]).score
    assert coach.stats()["member/j0/errors/timeout"] == 1


def test_slow_answers_are_awaited_within_the_timeout(judge):
    judge.set(delay_s=0.5)
    coach = LLMCoach(make_cfg(judge, endpoint=dict(timeout_s=2.0)), "arith_duo")
    start = time.monotonic()
    verdicts = run(scored(coach, *(request(i) for i in range(6))))
    assert all(v.score is not None for v in verdicts)
    assert time.monotonic() - start < 2.5  # concurrent (one after another takes 3 s)


def test_rate_limit_holds(judge):
    coach = LLMCoach(make_cfg(judge, endpoint=dict(requests_per_s=10.0)), "arith_duo")
    run(scored(coach, *(request(i) for i in range(16))))
    times = sorted(t for t, _ in judge.requests)
    assert len(times) == 16
    assert times[-1] - times[0] >= 1.5 - 0.05  # paced: one at once, 15 more at 10/s
    for i, t in enumerate(times):  # no 1-second window holds more than rate + burst
        assert sum(1 for u in times[i:] if u - t < 1.0) <= 11


def test_tokens_per_minute_limit_holds(judge):
    # 19800 tokens/min = 330/s with a burst of ten seconds' worth (3300); 8 calls of ~475
    # tokens (~3800) cannot all go at once: the last waits for ~1.5 s of refill
    coach = LLMCoach(make_cfg(judge, endpoint=dict(tokens_per_min=19800.0, max_tokens=12)),
                     "arith_duo")
    run(scored(coach, *(request(i) for i in range(8))))
    stats = coach.stats()
    assert stats["member/j0/rate_wait_s"] > 0
    times = sorted(t for t, _ in judge.requests)
    per_call = stats["member/j0/tokens"] / 8
    # the bucket's guarantee: tokens sent before the last call <= burst + rate * elapsed
    assert 7 * per_call <= 3300 + 330 * (times[-1] - times[0]) + 50


def test_breaker_opens_pauses_calls_and_closes(judge):
    judge.set(default="500")
    cfg = make_cfg(judge, breaker=BreakerConfig(failure_threshold=3, open_s=0.5,
                                                max_open_s=1.0, give_up_after_s=30.0))
    coach = LLMCoach(cfg, "arith_duo")

    async def main():
        tasks = [asyncio.create_task(coach.score(request(i))) for i in range(5)]
        member = coach.members[0]
        for _ in range(100):
            if member.breaker.opened:
                break
            await asyncio.sleep(0.02)
        assert member.breaker.state == "open" and len(judge.requests) >= 3
        during = len(judge.requests)
        await asyncio.sleep(0.3)  # paused for open_s = 0.5: no request reaches the server
        assert len(judge.requests) == during
        await asyncio.sleep(0.5)  # then probes only, one at a time (each fails, pause doubles)
        assert len(judge.requests) - during <= 1
        judge.set(default="ok")
        verdicts = await asyncio.gather(*tasks)
        await coach.close()
        return verdicts, member

    verdicts, member = run(main())
    assert len(verdicts) == 5 and member.breaker.state == "closed"
    assert member.breaker.closed_again >= 1
    assert not member.failures  # the outage delayed the scores, it failed none
    answered = {parse_verdict(text).score for _, text in judge.replies}
    assert {v.score for v in verdicts} <= answered


def test_breaker_gives_up_after_the_deadline(judge):
    judge.down()
    cfg = make_cfg(judge, breaker=BreakerConfig(failure_threshold=1, open_s=0.2,
                                                max_open_s=0.4, give_up_after_s=1.0))
    (result,) = run(scored(LLMCoach(cfg, "arith_duo"), request(1)))
    assert isinstance(result, CoachFailure) and result.reason == "coach_unavailable"


def test_cache_hits_skip_the_server_and_persist(judge, tmp_path):
    path = str(tmp_path / "coach_cache.jsonl")
    cfg = make_cfg(judge, cache=CacheConfig(persist=True))
    coach = LLMCoach(cfg, "arith_duo", cache_path=path)
    first, second, other = run(scored(coach, request(1), request(1), request(2)))
    assert first.score == second.score
    assert coach.stats()["cache_hits"] >= 1
    asked = len(judge.requests)
    assert asked <= 3
    again = LLMCoach(cfg, "arith_duo", cache_path=path)  # a resumed run
    (third,) = run(scored(again, request(1)))
    assert third.score == first.score and len(judge.requests) == asked
    assert again.stats()["cache_hits"] == 1


def test_garbage_is_asked_again_once_then_fails(judge):
    judge.plan("garbage", "bold")
    coach = LLMCoach(make_cfg(judge), "arith_duo")
    (verdict,) = run(scored(coach, request(1)))
    assert verdict.score == 0.8
    reask = judge.replies[-1][0]
    assert len(reask) == 3 and reask[0]["content"].startswith("You are evaluating")
    assert reask[1]["role"] == "assistant" and "PROCESS_SCORE" in reask[2]["content"]
    judge.plan("garbage", "garbage")
    coach = LLMCoach(make_cfg(judge), "arith_duo")
    (result,) = run(scored(coach, request(2)))
    assert isinstance(result, CoachFailure) and result.reason == "coach_unparsable"
    assert len(judge.requests) == 4  # exactly one re-ask each time


def test_prompt_carries_role_input_output_and_truth_only_for_truth_agents(judge):
    cfg = make_cfg(judge, roles={"solver": "Problem Solver", "verifier": "Verifier"},
                   truth_agents=["verifier"])
    judge.set(score=6)
    coach = LLMCoach(cfg, "arith_duo")
    solver, verifier = run(scored(coach, request(1, "solver"), request(2, "verifier")))
    prompts = [m[0]["content"] for m, _ in judge.replies]
    solver_prompt = next(p for p in prompts if "It is 2." in p)
    assert "Problem Solver" in solver_prompt and "What is 1 + 1?" in solver_prompt
    assert "Ground truth answer (if applicable):\nN/A" in solver_prompt
    verifier_prompt = next(p for p in prompts if "It is 3." in p)
    assert "Ground truth answer (if applicable):\n3" in verifier_prompt
    assert solver.score == 0.6 and solver.answer_correct is None
    assert verifier.score == 0.6 and verifier.answer_correct == 1
    # the verifier must answer ANSWER_CORRECT: a reply without it is asked again, then fails
    judge.plan("bold", "bold")
    (result,) = run(scored(LLMCoach(cfg, "arith_duo"), request(3, "verifier")))
    assert isinstance(result, CoachFailure) and result.reason == "coach_unparsable"


def test_ensemble_mean_median_and_quorum():
    servers = [LoopbackJudge() for _ in range(3)]
    try:
        for server, score in zip(servers, (2, 9, 4)):
            server.set(score=score)
        mean = LLMCoach(make_cfg(*servers, combine="mean"), "arith_duo")
        median = LLMCoach(make_cfg(*servers, combine="median"), "arith_duo")
        (m,), (d,) = run(scored(mean, request(1))), run(scored(median, request(1)))
        assert m.score == pytest.approx(0.5) and d.score == pytest.approx(0.4)
        assert mean.stats()["member/j1/score_mean"] == pytest.approx(0.9)
        servers[1].set(default="500")
        quorum = LLMCoach(make_cfg(*servers, min_scores=2, cache=CacheConfig(enabled=False)),
                          "arith_duo")
        everyone = LLMCoach(make_cfg(*servers, cache=CacheConfig(enabled=False)), "arith_duo")
        (q,), (e,) = run(scored(quorum, request(1))), run(scored(everyone, request(1)))
        assert q.score == pytest.approx(0.3)
        assert isinstance(e, CoachFailure) and e.reason == "coach_server_error"
        assert quorum.stats()["member/j1/failed/coach_server_error"] == 1
    finally:
        for server in servers:
            server.close()


class Recorder:
    def __init__(self):
        self.commits = []

    async def __call__(self, model_id, commits):
        self.commits.extend(commits)


def test_backprop_chain_runs_backwards_and_combines(judge):
    cfg = make_cfg(judge, backprop=BackpropConfig(enabled=True, alpha=0.5, beta=2.0))
    rec = Recorder()
    pool = CoachPool(cfg, LLMCoach(cfg, "arith_duo"), rec)
    steps = [request(1, "solver", episode_id="e", turn=0, outcome=1.0),
             request(2, "solver", episode_id="e", turn=0, outcome=1.0, on_path=False),
             request(3, "verifier", episode_id="e", turn=1, outcome=1.0)]

    async def main():
        await pool.submit(steps)
        for _ in range(200):
            if len(rec.commits) == 3:
                break
            await asyncio.sleep(0.05)
        await pool.close()

    run(main())
    backward = [(m, t) for m, t in judge.replies if "CONTRIBUTION" in m[-1]["content"]]
    assert len(backward) == 2  # the on-path actions only, the last one first
    assert "It is 4." in backward[0][0][0]["content"]  # the verifier's output
    residual = parse_attribution(backward[0][1]).residual
    assert residual in backward[1][0][0]["content"]  # passed to the solver's step
    deltas = {"s3": parse_attribution(backward[0][1]).delta,
              "s1": parse_attribution(backward[1][1]).delta, "s2": 0.0}
    process = {}
    for messages, text in judge.replies:
        for sid, out in (("s1", "It is 2."), ("s2", "It is 3."), ("s3", "It is 4.")):
            if "CONTRIBUTION" not in messages[-1]["content"] and out in messages[0]["content"]:
                process[sid] = parse_verdict(text).score
    for commit in rec.commits:
        assert commit.coach_score == pytest.approx(process[commit.step_id])
        assert commit.reward == pytest.approx(0.5 * process[commit.step_id]
                                              + 2.0 * deltas[commit.step_id])
