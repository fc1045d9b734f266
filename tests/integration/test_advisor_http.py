"""Episode.consult against a real OpenAI-compatible server on a loopback port (DESIGN §14).

The advisor (MAGRPO's external model) is asked through the coach pool's HTTP path: the test
builds a `CoachPool` and `Episode`s in this process, as the rollout actor does, and reads what
the server (actors/coach/loopback.py) received. No engine, no Ray: `consult` makes no row.
"""
from __future__ import annotations

import asyncio
import logging
import time

import pytest

from actors.coach import (
    AdvisorConfig, BreakerConfig, CoachConfig, CoachPool, EndpointConfig, LLMCoach, RetryConfig,
    RuleCoach,
)
from actors.coach.loopback import LoopbackJudge
from actors.episode import AdvisorFailure, CoachRequest, Episode, SamplingParams
from actors.rollout import episode_scalars
from actors.workflows.arith_duo import ArithDuo, ArithDuoConfig

CHAT = [{"role": "system", "content": "You are an advisor helping 2 agents."},
        {"role": "user", "content": "Show your feedback and edits for: def f(x): return x"}]


@pytest.fixture
def judge():
    server = LoopbackJudge()
    yield server
    server.close()


def endpoint(server: LoopbackJudge, name: str = "adv", **fields) -> EndpointConfig:
    return EndpointConfig(name=name, base_url=server.base_url, model="advisor",
                          **{"timeout_s": 5.0, **fields})


def advisor_pool(*endpoints: EndpointConfig, retry_attempts: int = 3,
                 breaker: BreakerConfig | None = None, **advisor) -> CoachPool:
    """A pool with the rule coach for scores and an advisor of its own endpoints."""
    cfg = CoachConfig(
        kind="rule",
        advisor=AdvisorConfig(enabled=True, endpoints=list(endpoints), **advisor),
        retry=RetryConfig(max_attempts=retry_attempts, backoff_base_s=0.05, backoff_max_s=0.2,
                          jitter=0.0),
        breaker=breaker or BreakerConfig(failure_threshold=50, open_s=0.5, max_open_s=1.0))
    return CoachPool(cfg, RuleCoach(ArithDuo(ArithDuoConfig())), _no_commits)


async def _no_commits(model_id, commits):
    raise AssertionError("consult must commit nothing")


def episode_of(pool: CoachPool, index: int = 0) -> Episode:
    return Episode(run_id="r", workflow="magrpo_probe", task_id=f"t{index}", round_id="o",
                   round_size=1, round_index=0, group_size=1,
                   agent_models={"aux": "m", "main": "m"}, routes={},
                   sampling=SamplingParams(), advisor=pool.consult)


def test_reply_comes_back_counted_and_without_a_row(judge):
    pool = advisor_pool(endpoint(judge), max_tokens=900, temperature=0.3)
    episode = episode_of(pool)

    async def main():
        try:
            return await episode.consult(CHAT, purpose="feedback")
        finally:
            await pool.close()

    advice = asyncio.run(main())
    (messages, text), = judge.replies
    assert messages == CHAT  # passed through as the workflow wrote them
    assert advice.text == text and advice.endpoint == "adv" and advice.failed_reason is None
    assert advice.purpose == "feedback" and advice.latency_s > 0
    # the advisor's settings replace the endpoint's (max_tokens 512, temperature 0)
    assert judge.settings[0]["max_tokens"] == 900 and judge.settings[0]["temperature"] == 0.3
    assert judge.settings[0]["model"] == "advisor"
    # no training row: nothing a non-trained model wrote is recorded
    assert episode.num_rows == 0 and episode.records() == {} and episode.coach_requests() == []
    assert (episode.advisor_calls, episode.advisor_failures) == (1, 0)
    assert episode.advisor_latency_s == pytest.approx(advice.latency_s)
    stats = pool.stats()
    assert stats["advisor/calls"] == 1 and stats["advisor/failures"] == 0
    assert stats["advisor/endpoint/adv/calls"] == 1 and stats["advisor/purpose/feedback/calls"] == 1
    assert stats["advisor/latency_s"] == pytest.approx(advice.latency_s)
    assert stats["requests"] == 0 and stats["scored"] == 0  # not a coach score either


def test_server_errors_raise_after_the_retries_and_are_counted(judge, caplog):
    judge.set(default="500")
    pool = advisor_pool(endpoint(judge), retry_attempts=3)
    episode = episode_of(pool)

    async def main():
        with pytest.raises(AdvisorFailure) as failure:
            await episode.consult(CHAT)
        judge.set(default="ok")  # the workflow goes on; a later consult is answered
        advice = await episode.consult(CHAT)
        await pool.close()
        return failure.value, advice

    with caplog.at_level(logging.WARNING, logger="actors.coach.advisor"):
        failure, advice = asyncio.run(main())
    assert failure.reason == "server_error" and failure.endpoint == "adv"
    assert [mode for _, mode in judge.requests] == ["500", "500", "500", "ok"]  # 3 attempts
    assert advice.text == judge.replies[-1][1]
    assert (episode.advisor_calls, episode.advisor_failures) == (2, 1)
    stats = pool.stats()
    assert stats["advisor/calls"] == 2 and stats["advisor/failures"] == 1
    assert stats["advisor/failed/server_error"] == 1
    assert any("gave up" in r.getMessage() and episode.episode_id in r.getMessage()
               for r in caplog.records)  # logged, with the episode it failed


def test_an_open_breaker_gives_up_at_the_advisor_deadline(judge):
    judge.down()  # connections refused: the first failure opens the breaker
    pool = advisor_pool(endpoint(judge), give_up_after_s=0.6,
                        breaker=BreakerConfig(failure_threshold=1, open_s=0.2, max_open_s=0.4,
                                              give_up_after_s=1800.0))
    episode = episode_of(pool)

    async def main():
        start = time.monotonic()
        with pytest.raises(AdvisorFailure) as failure:
            await episode.consult(CHAT)
        took = time.monotonic() - start
        await pool.close()
        return failure.value, took

    failure, took = asyncio.run(main())
    # the episode waits coach.advisor.give_up_after_s, not the scores' 30-minute deadline
    assert failure.reason == "unavailable" and 0.5 <= took < 3.0
    assert failure.latency_s == pytest.approx(took, abs=0.1)
    assert pool.stats()["advisor/failed/unavailable"] == 1 and episode.advisor_failures == 1


@pytest.mark.parametrize("endpoint_limit,advisor_limit,peak", [(2, 16, 2), (4, 1, 1)])
def test_concurrency_limits_hold(judge, endpoint_limit, advisor_limit, peak):
    judge.set(delay_s=0.3)
    pool = advisor_pool(endpoint(judge, max_concurrency=endpoint_limit),
                        max_concurrency=advisor_limit)
    episodes = [episode_of(pool, i) for i in range(6)]

    async def main():
        start = time.monotonic()
        replies = await asyncio.gather(*(ep.consult(CHAT) for ep in episodes))
        took = time.monotonic() - start
        await pool.close()
        return replies, took

    replies, took = asyncio.run(main())
    assert all(r.text for r in replies) and len(judge.replies) == 6
    assert judge.peak_in_flight == peak  # seen by the server, not by our own counters
    assert took >= (6 / peak) * 0.3 - 0.05  # waves of `peak` calls of 0.3 s each


def test_shared_judges_bound_scores_and_advice_together(judge):
    """No advisor endpoints: advice goes to the coach's own judges, through the same
    HttpCoach (one concurrency bound, one breaker, one rate budget)."""
    judge.set(delay_s=0.3)
    cfg = CoachConfig(kind="http", endpoints=[endpoint(judge, "j0", max_concurrency=2)],
                      advisor=AdvisorConfig(enabled=True, max_tokens=700, extra_body={}))
    coach = LLMCoach(cfg, "arith_duo")
    pool = CoachPool(cfg, coach, _no_commits)
    assert pool.advisor.members[0] is coach.members[0]
    requests = [CoachRequest(step_id=f"s{i}", model_id="m", agent="solver", workflow="arith_duo",
                             task_id="t", input_text=f"What is {i} + 1?",
                             output_text=f"{i + 1}", finish_reason="stop", truth=str(i + 1))
                for i in range(3)]
    episodes = [episode_of(pool, i) for i in range(3)]

    async def main():
        scores, *advice = await asyncio.gather(
            pool.score_now(requests), *(ep.consult(CHAT) for ep in episodes))
        await pool.close()
        return scores, advice

    scores, advice = asyncio.run(main())
    assert all(r.failed_reason is None for r in scores.values()) and len(advice) == 3
    assert judge.peak_in_flight == 2  # six calls, one bound
    by_tokens = sorted(s["max_tokens"] for s in judge.settings)
    assert by_tokens == [512] * 3 + [700] * 3  # the judge's setting for scores, the advisor's
    stats = pool.stats()
    assert stats["member/j0/calls"] == 6  # the judge's counters count every call it took
    assert stats["advisor/calls"] == 3 and stats["scored"] == 3


def test_named_endpoint_and_turns_between_endpoints():
    servers = [LoopbackJudge() for _ in range(2)]
    try:
        pool = advisor_pool(endpoint(servers[0], "a"), endpoint(servers[1], "b"))
        episode = episode_of(pool)

        async def main():
            named = [await episode.consult(CHAT, endpoint="b") for _ in range(2)]
            turns = [await episode.consult(CHAT) for _ in range(4)]
            with pytest.raises(ValueError, match=r"endpoint='c'.*\['a', 'b'\]"):
                await episode.consult(CHAT, endpoint="c")
            await pool.close()
            return named, turns

        named, turns = asyncio.run(main())
    finally:
        for server in servers:
            server.close()
    assert [a.endpoint for a in named] == ["b", "b"]
    assert sorted(a.endpoint for a in turns) == ["a", "a", "b", "b"]
    assert (len(servers[0].replies), len(servers[1].replies)) == (2, 4)


def test_round_metrics_average_the_advisor_counters_per_episode(judge):
    pool = advisor_pool(endpoint(judge), retry_attempts=2)
    episodes = [episode_of(pool, i) for i in range(3)]

    async def main():
        await episodes[0].consult(CHAT)
        judge.plan("500", "500")  # the second episode's consult fails (retry_attempts=2)
        with pytest.raises(AdvisorFailure):
            await episodes[1].consult(CHAT)
        await episodes[0].consult(CHAT)
        await pool.close()

    asyncio.run(main())
    scalars = episode_scalars("magrpo_probe", [ep.advisor_scalars() for ep in episodes])
    assert scalars["episode/magrpo_probe/advisor_calls"] == pytest.approx(1.0)  # 2, 1, 0
    assert scalars["episode/magrpo_probe/advisor_failures"] == pytest.approx(1 / 3)
    assert scalars["episode/magrpo_probe/advisor_latency_s"] > 0  # over episodes that asked
