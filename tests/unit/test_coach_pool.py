"""CoachPool: fire-and-forget scoring commits by step_id; failures are FAILED, never defaults."""
import asyncio
import time

import pytest

from actors.coach import CoachConfig, CoachFailure, CoachPool, RuleCoach
from actors.episode import CoachRequest
from actors.workflows.arith_duo import ArithDuo
from actors.workflows.arith_duo import ArithDuoConfig


def request(step_id, text, agent="verifier"):
    return CoachRequest(step_id=step_id, model_id="m", agent=agent, workflow="arith_duo",
                        task_id="t", input_text="What is 1 + 1?", output_text=text,
                        finish_reason="stop", truth="2")


class Recorder:
    def __init__(self):
        self.commits = []

    async def __call__(self, model_id, commits):
        self.commits.extend(commits)


def test_submit_returns_before_slow_scores_and_commits_them_later():
    async def main():
        rec = Recorder()
        pool = CoachPool(CoachConfig(latency_s=0.3, max_concurrency=8),
                         RuleCoach(ArithDuo(ArithDuoConfig()), 0.3), rec)
        start = time.perf_counter()
        await pool.submit([request(f"s{i}", "\\boxed{2}" if i % 2 else "no") for i in range(8)])
        assert time.perf_counter() - start < 0.1  # fire-and-forget
        assert rec.commits == []
        await asyncio.sleep(0.6)
        await pool.close()
        return rec, pool

    rec, pool = asyncio.run(main())
    scores = {c.step_id: c.reward for c in rec.commits}
    assert len(scores) == 8  # 8 concurrent calls of 0.3 s finish together
    assert scores["s1"] == pytest.approx(1.0) and scores["s0"] == pytest.approx(0.0)
    assert all(c.coach_score == c.reward for c in rec.commits)
    stats = pool.stats()
    assert stats["calls"] == 8 and stats["latency_p50_s"] >= 0.3


class Broken:
    """A coach that raises `error` for every request."""

    def __init__(self, error):
        self.error = error

    async def score(self, request):
        raise self.error

    def stats(self):
        return {}

    async def close(self):
        return None


def run_one(coach):
    async def main():
        rec = Recorder()
        pool = CoachPool(CoachConfig(), coach, rec)
        await pool.submit([request("x", "\\boxed{2}")])
        await asyncio.sleep(0.05)
        await pool.close()
        return rec, pool

    return asyncio.run(main())


def test_judge_failure_marks_row_failed_without_a_score():
    rec, pool = run_one(Broken(CoachFailure("coach_timeout", "judge did not answer")))
    (commit,) = rec.commits
    assert commit.failed_reason == "coach_timeout" and commit.reward is None
    assert pool.stats()["failures"] == 1
    pool.check()  # a judge failure is an outcome of the row, not a reason to stop the run


@pytest.mark.parametrize("bug", [KeyError("OPENAI_API_KEY"), ValueError("rule broke")])
def test_a_programming_error_stops_the_run_instead_of_failing_rows(bug):
    rec, pool = run_one(Broken(bug))
    assert rec.commits == []  # no row is failed in its name
    assert pool.stats()["failures"] == 0
    with pytest.raises(RuntimeError, match=repr(bug).replace("(", r"\(").replace(")", r"\)")):
        pool.check()


def test_score_now_awaits_inline():
    async def main():
        pool = CoachPool(CoachConfig(), RuleCoach(ArithDuo(ArithDuoConfig()), 0.2), Recorder())
        start = time.perf_counter()
        scores = await pool.score_now([request("a", "\\boxed{2}"), request("b", "")])
        return scores, time.perf_counter() - start

    results, took = asyncio.run(main())
    assert {k: r.reward for k, r in results.items()} == {"a": pytest.approx(1.0), "b": 0.0}
    assert all(r.coach_score == r.reward and r.failed_reason is None for r in results.values())
    assert took >= 0.2
