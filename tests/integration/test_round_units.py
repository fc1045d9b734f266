"""Units follow what a round produced (DESIGN §14): surplus released, groups sealed at round end.

A joint workflow whose odd episodes stop after turn 0 plays through a real RolloutActor, a
real SGLang engine (tiny model), a real VersionClock and a real ReplayBuffer in this process.
The round is admitted for 2 groups (turns 0 and 1); the turn-1 group gets rows from half the
episodes only. Counted independently of the code under test (from the rows the engine
produced, grouped here by turn):
- the clock's issued units equal the groups that got rows (the surplus came back at once);
- every group is ready as soon as its rows are scored — none waits for the unit timeout
  (set to an hour, so a group waiting for the missing episodes could never be ready).
"""
from __future__ import annotations

import asyncio
import dataclasses
import random
from collections import Counter

import pytest
from transformers import AutoTokenizer

from actors.engines.client import EngineClient
from actors.episode import ModelRoute
from actors.rollout import RolloutActor, RolloutConfig
from actors.tasks import TaskConfig
from actors.workflows.base import Task, WorkflowConfig
from actors.workflows.registry import register
from buffers.clock import VersionClock
from buffers.replay import BufferConfig, ReplayBuffer
from buffers.schema import RewardCommit, StepBatch, records_to_table

G = 4


@dataclasses.dataclass
class EarlyStopConfig:
    stop_odd: bool = True  # odd episodes of a round stop after turn 0


@register("early_stop_probe", EarlyStopConfig)
class EarlyStop:
    """Two turns for even episodes, one for odd ones (when stop_odd)."""

    name = "early_stop_probe"
    agents = ("a",)
    sampling = "joint"
    coach_prompt = ""

    def __init__(self, cfg: EarlyStopConfig) -> None:
        self.cfg = cfg

    def make_task(self, rng: random.Random, index: int) -> Task:
        return Task(f"probe-{index}", f"count {rng.randint(0, 9)}", "0")

    def groups_per_round(self, agent: str, group_size: int) -> int:
        return 2

    async def run(self, task: Task, episode) -> dict[str, float]:
        [first] = await episode.act("a", task.prompt, turn=0, max_new_tokens=2)
        episode.reward(first.step_id, reward=0.5)  # inline rule reward: READY on arrival
        if self.cfg.stop_odd and episode.round_index % 2:
            return {"turns": 1.0}
        [second] = await episode.act("a", task.prompt + " more", turn=1, max_new_tokens=2)
        episode.reward(second.step_id, reward=0.5)
        return {"turns": 2.0}

    def rule_score(self, agent, task, output_text, finish_reason, context) -> float:
        return 0.5


class LocalPorts:
    """The rollout actor's ports over in-process parts; rows are scored at once."""

    def __init__(self, clock: VersionClock, buffer: ReplayBuffer) -> None:
        self.clock, self.buffer = clock, buffer
        self.rows_by_turn: Counter[int] = Counter()

    async def admit(self, units, round_id, timeout_s=1.0):
        return await self.clock.wait_admit(units, "r0", round_id, timeout_s)

    async def next_task(self):
        return self.clock.next_task_index()

    async def generated(self, round_id, episodes, units):
        self.clock.generated(round_id, episodes, units)

    async def shipped(self, round_id):
        self.clock.shipped(round_id)

    async def abandon(self, round_id, rows, reason):
        self.clock.abandon(round_id, rows, reason)

    async def add_rows(self, model_id, records, origin):
        self.rows_by_turn.update(r.turn for r in records)
        return self.buffer.try_add(StepBatch(records_to_table(records)), origin)

    async def seal_episode(self, model_id, episode_id, num_rows):
        self.buffer.seal_episode(episode_id, num_rows)

    async def submit_coach(self, requests):
        self.buffer.commit_rewards([RewardCommit(r.step_id, reward=0.5, coach_score=0.5)
                                    for r in requests])

    async def score_now(self, requests):
        raise AssertionError("synchronous coach not used here")

    async def commit_rewards(self, model_id, commits):
        self.buffer.commit_rewards(commits)

    def report(self, scalars):
        pass


def build(tiny_engine, tiny_model_path, readiness="group", group_size=G, **params):
    """A rollout actor of the probe over a real clock and buffer in this process."""
    clock = VersionClock({"m": (100, 0)})
    buffer = ReplayBuffer("m", BufferConfig(readiness=readiness, unit_timeout_s=3600.0))
    ports = LocalPorts(clock, buffer)
    route = ModelRoute("m", [EngineClient(tiny_engine.url)],
                       AutoTokenizer.from_pretrained(str(tiny_model_path)))
    cfg = WorkflowConfig(name="early_stop_probe", agents={"a": "m"}, group_size=group_size,
                         params=params, tasks=TaskConfig(eval_size=0))
    actor = RolloutActor(RolloutConfig(concurrency=1), cfg, "run", 0, {"m": route}, ports,
                         {"m": readiness})
    return clock, buffer, ports, route, actor


def play_rounds(tiny_engine, tiny_model_path, stop_odd: bool, rounds: int = 3):
    clock, buffer, ports, _, actor = build(tiny_engine, tiny_model_path, stop_odd=stop_odd)

    async def go():
        for _ in range(rounds):
            task = actor.tasks.next()
            assert await ports.admit({"m": 2}, f"round-{task.task_id}")
            await actor._play_round(task, f"round-{task.task_id}")

    asyncio.run(go())
    return clock, buffer, ports


@pytest.mark.parametrize("stop_odd", [True, False])
def test_units_follow_what_the_round_produced(tiny_engine, tiny_model_path, stop_odd):
    rounds = 3
    clock, buffer, ports = play_rounds(tiny_engine, tiny_model_path, stop_odd, rounds)
    # counted here, from the rows that reached the buffer: groups with rows per round
    assert ports.rows_by_turn[0] == rounds * G
    assert ports.rows_by_turn[1] == rounds * (G // 2 if stop_odd else G)
    groups = rounds * 2  # both turns got rows in every round
    snap = clock.snapshot()["m"]
    assert snap["issued_units"] == groups
    assert snap["released_surplus"] == 0  # every admitted group got at least one row
    stats = buffer.stats()
    assert stats.ready_units == groups, stats  # sealed at what arrived: nothing waits
    batch = buffer.sample(groups, current_version=0, max_staleness=0)
    assert batch is not None and len(batch.unit_ids) == groups
    sizes = sorted(int(b - a) for a, b in zip(batch.unit_offsets[:-1], batch.unit_offsets[1:]))
    expected = sorted([G] * rounds + [G // 2 if stop_odd else G] * rounds)
    assert sizes == expected


def test_a_turn_no_episode_reached_gives_its_units_back(tiny_engine, tiny_model_path):
    """Admitted for 3 groups per round, the probe produces at most 2: 1 unit comes back."""
    original = EarlyStop.groups_per_round
    EarlyStop.groups_per_round = lambda self, agent, group_size: 3
    try:
        clock, buffer, ports, _, actor = build(tiny_engine, tiny_model_path)

        async def go():
            task = actor.tasks.next()
            assert await ports.admit({"m": 3}, "r1")
            assert clock.snapshot()["m"]["issued_units"] == 3
            await actor._play_round(task, "r1")

        asyncio.run(go())
    finally:
        EarlyStop.groups_per_round = original
    snap = clock.snapshot()["m"]
    assert snap["issued_units"] == 2 and snap["released_surplus"] == 1
    assert buffer.stats().ready_units == 2


def test_a_row_the_episode_failed_is_counted_and_never_coached(tiny_engine, tiny_model_path):
    """Episode.fail (a sandbox failure): the row ships, is dropped as failed, and no coach
    request is made for it — counted here from what reached the buffer and the coach."""
    from actors.episode import Episode, SamplingParams

    clock, buffer, ports, route, actor = build(tiny_engine, tiny_model_path, "episode", 1)
    coached: list[str] = []
    original_submit = ports.submit_coach

    async def submit(requests):
        coached.extend(r.step_id for r in requests)
        await original_submit(requests)

    ports.submit_coach = submit
    episode = Episode(run_id="run", workflow="early_stop_probe", task_id="t", round_id="r",
                      round_size=1, round_index=0, group_size=1, agent_models={"a": "m"},
                      routes={"m": route}, sampling=SamplingParams())

    async def go():
        [good] = await episode.act("a", "count 1", turn=0, max_new_tokens=2)
        [bad] = await episode.act("a", "count 2", turn=1, max_new_tokens=2)
        episode.fail(bad.step_id, "sandbox")
        await episode.coach([good, bad], input_text="x")
        assert clock.try_admit({"m": 1}, "r0", "r")
        clock.generated("r", {episode.episode_id: {"m": 2}}, {"m": 1})
        await actor._ship([episode], {episode.episode_id: episode.records()}, [{}])
        return good, bad

    good, bad = asyncio.run(go())
    assert coached == [good.step_id]
    stats = buffer.stats()
    assert stats.dropped["failed"] == 1 and stats.ready_units == 1, stats
    batch = buffer.sample(1, current_version=0, max_staleness=0)
    assert batch.table.column("step_id").to_pylist() == [good.step_id]
