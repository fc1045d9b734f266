"""The coach end to end on real SGLang CPU engines: episodes → buffer → LLM judge → rewards.

Two judges, both real SGLang servers answering `/v1/chat/completions`:
- the session's tiny engine (`tiny_engine`): its 77-token character vocabulary cannot even
  spell `PROCESS_SCORE` (no capitals, no underscore), so constrained decoding cannot make it
  parsable; it shows the unparsable path end to end — every reply is asked again once, then
  the row is FAILED `coach_unparsable` in the buffer, never scored — in async and sync mode.
- SmolLM2-135M (slow): with SGLang's constrained decoding (`extra_body={"regex": ...}`,
  verified to work on CPU) it answers in the MathChat-style format of
  configs/coach_prompts/arith_duo.txt, and every row becomes READY with the judge's score.
Each row's reward is committed exactly once (a commit counter in front of the buffer).
"""
from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest
from transformers import AutoTokenizer

from actors.coach import CoachConfig, CoachPool, EndpointConfig, LLMCoach, RetryConfig
from actors.engines.client import EngineClient
from actors.engines.sglang import EngineConfig, SGLangEngine
from actors.episode import Episode, ModelRoute, SamplingParams
from actors.workflows.arith_duo import ArithDuo
from actors.workflows.arith_duo import ArithDuoConfig
from buffers.replay import BufferConfig, ReplayBuffer
from buffers.schema import new_id
from runtime.models import resolve_model

# Short enough for the tiny model's 1024-token context (its tokens are characters).
TINY_TEMPLATE = "role {agent_role}\ninput {agent_input}\noutput {agent_output}\nscore:"


class CountingCommit:
    """The pool's commit function: counts commits per step_id, applies them to the buffer."""

    def __init__(self, buffer: ReplayBuffer) -> None:
        self.buffer = buffer
        self.per_step: Counter[str] = Counter()

    async def __call__(self, model_id, commits) -> None:
        self.per_step.update(c.step_id for c in commits)
        self.buffer.commit_rewards(commits)


async def play_rounds(policy_url: str, tokenizer, pool: CoachPool, buffer: ReplayBuffer,
                      rounds: int, sync: bool) -> list[str]:
    """arith_duo rounds on the policy engine; rows to the buffer, requests to the pool."""
    workflow = ArithDuo(ArithDuoConfig(max_operand=9, solver_tokens=12, verifier_tokens=8))
    client = EngineClient(policy_url)
    routes = {"policy": ModelRoute("policy", [client], tokenizer)}
    rng = random.Random(0)
    step_ids = []
    for index in range(rounds):
        task = workflow.make_task(rng, index)
        episode = Episode(run_id="coach-e2e", workflow="arith_duo", task_id=task.task_id,
                          round_id=new_id(), round_size=1, round_index=0, group_size=2,
                          agent_models={"solver": "policy", "verifier": "policy"},
                          routes=routes, sampling=SamplingParams(), truth=task.truth,
                          problem=task.prompt, sync_scorer=pool.score_now if sync else None)
        result = await workflow.run(task, episode)
        records = episode.records()["policy"]
        assert buffer.try_add(records)
        step_ids += [r.step_id for r in records]
        for model_id, commits in episode.failures.items():  # what the rollout does
            buffer.commit_rewards(commits)
        requests = episode.coach_requests(result["success"])
        assert (len(requests) == 0) == sync
        await pool.submit(requests)
    for _ in range(600):  # async scores arrive later
        if buffer.stats().pending_rows == 0:
            break
        await asyncio.sleep(0.1)
    return step_ids


def play_then_close(policy_url: str, tokenizer, pool: CoachPool, buffer: ReplayBuffer,
                    rounds: int, sync: bool) -> list[str]:
    """`play_rounds`, then close the pool (which waits for its in-flight scores)."""
    async def main():
        try:
            return await play_rounds(policy_url, tokenizer, pool, buffer, rounds, sync)
        finally:
            await pool.close()

    return asyncio.run(main())


def judge_cfg(url: str, model: str, prompt: str, **endpoint) -> CoachConfig:
    return CoachConfig(kind="http", prompt=prompt,
                       roles={"solver": "Problem Solver", "verifier": "Verifier"},
                       truth_agents=["verifier"],
                       endpoints=[EndpointConfig(base_url=url + "/v1", model=model,
                                                 timeout_s=120, **endpoint)],
                       retry=RetryConfig(backoff_base_s=0.1))


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_tiny_engine_judge_unparsable_path_end_to_end(tiny_engine, tiny_model_path, tmp_path,
                                                      sync):
    template = tmp_path / "tiny_coach.txt"
    template.write_text(TINY_TEMPLATE)
    # temperature 1: the tiny judge's replies are random character soup, never a score
    cfg = judge_cfg(tiny_engine.url, "tiny", str(template), max_tokens=12, temperature=1.0)
    buffer = ReplayBuffer("policy", BufferConfig())
    commit = CountingCommit(buffer)
    coach = LLMCoach(cfg, "arith_duo")
    pool = CoachPool(cfg, coach, commit)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)

    step_ids = play_then_close(tiny_engine.url, tokenizer, pool, buffer, 2, sync)
    stats, coach_stats = buffer.stats(), pool.stats()
    assert len(step_ids) == 8  # 2 rounds x (2 solver + 2 verifier candidates)
    assert stats.dropped["failed"] == 8 and stats.ready_rows == 0 and stats.pending_rows == 0
    assert coach_stats["failed/coach_unparsable"] == 8 and coach_stats["scored"] == 0
    assert coach_stats["reasks"] == 8
    assert coach_stats["calls"] == 16  # each reply asked again exactly once
    assert buffer.sample(1, 0, 0) is None  # nothing trainable came of it
    if sync:  # inline: the episode committed the failures, the pool nothing
        assert not commit.per_step
    else:
        assert set(commit.per_step) == set(step_ids)
        assert max(commit.per_step.values()) == 1


@pytest.mark.slow
def test_smollm_judge_scores_every_row_through_constrained_decoding(tiny_engine, tiny_model_path,
                                                                    tmp_path):
    judge = SGLangEngine("smollm-judge", resolve_model("smollm2-135m"),
                         EngineConfig(max_total_tokens=4096, random_seed=0,
                                      startup_timeout_s=300), tmp_path / "judge-logs")
    judge.start()
    try:
        regex = r"PROCESS_SCORE: (10|[0-9])\nANSWER_CORRECT: [01]"
        cfg = judge_cfg(judge.url, "smollm-judge", "arith_duo", max_tokens=24,
                        extra_body={"regex": regex})
        buffer = ReplayBuffer("policy", BufferConfig())
        commit = CountingCommit(buffer)
        pool = CoachPool(cfg, LLMCoach(cfg, "arith_duo"), commit)
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)

        step_ids = play_then_close(tiny_engine.url, tokenizer, pool, buffer, 2, False)
    finally:
        judge.close()
    stats, coach_stats = buffer.stats(), pool.stats()
    assert stats.pending_rows == 0 and stats.dropped["failed"] == 0
    assert coach_stats["scored"] == 8 and coach_stats["reasks"] == 0
    assert set(commit.per_step) == set(step_ids) and max(commit.per_step.values()) == 1
    batch = buffer.sample(stats.ready_units, 0, 0)
    table = batch.table.to_pydict()
    assert sorted(table["step_id"]) == sorted(step_ids)
    for reward, score in zip(table["reward"], table["coach_score"]):
        assert reward == pytest.approx(score)
        assert round(score * 10) == pytest.approx(score * 10, abs=1e-5)  # N/10, N in 0..10
    assert coach_stats["score/verifier/count"] == 4 and "score/solver/mean" in coach_stats
