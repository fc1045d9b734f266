"""Ray plumbing for the rollout side: the ports a RolloutActor talks through, and its host.

`RayRolloutPorts` turns the rollout actor's needs (admission, buffering, coach, metrics) into
calls on actor handles; `RolloutHost` builds the engine clients and tokenizers inside the
rollout process (they hold sockets, so they cannot be shipped) and runs a `RolloutActor`.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass

from actors.episode import Advice, AdviceRequest, CoachRequest, ModelRoute
from actors.engines.client import EngineClient
from actors.rollout import RolloutActor, RolloutConfig
from actors.workflows import WorkflowConfig
from buffers.schema import RewardCommit, StepBatch, StepRecord
from runtime.failures import ACTOR_GONE
from runtime.logs import configure_logging

log = logging.getLogger("troupe")

BUFFER_RESTART_S = 180.0  # how long shipping waits for a buffer that Ray is restarting


class RayRolloutPorts:
    """RolloutPorts over Ray actor handles (clock, buffers, coach pool, metrics)."""

    def __init__(self, clock, buffers: dict, coach, metrics, owner: str = "") -> None:
        self.owner = owner  # this rollout actor's name at the clock (in-flight accounting)
        self.clock = clock
        self.buffers = buffers
        self.coach = coach
        self.metrics = metrics

    def for_owner(self, owner: str) -> "RayRolloutPorts":
        return RayRolloutPorts(self.clock, self.buffers, self.coach, self.metrics, owner)

    async def admit(self, units: dict[str, int], round_id: str, timeout_s: float) -> bool:
        return await self.clock.wait_admit.remote(units, self.owner, round_id, timeout_s)

    async def next_task(self) -> int:
        return await self.clock.next_task_index.remote()

    async def generated(self, round_id: str, episodes: dict[str, dict[str, int]],
                        units: dict[str, int]) -> None:
        await self.clock.generated.remote(round_id, episodes, units)

    async def shipped(self, round_id: str) -> None:
        await self.clock.shipped.remote(round_id)

    async def abandon(self, round_id: str, rows: int, reason: str) -> None:
        await self.clock.abandon.remote(round_id, rows, reason)

    async def add_rows(self, model_id: str, records: list[StepRecord], origin: str) -> bool:
        """Ship one episode's rows of one model; rides out a restart of the buffer.

        Converted here, in the (parallel) rollout process: the buffer is one serial actor and
        ingests this wire form without copying token data. If the buffer's process dies
        during the call, Ray restarts it from its log, which holds every accepted call: the
        rows are sent again only if that log shows they never arrived (no row twice).
        """
        buffer = self.buffers[model_id]
        batch = StepBatch.from_records(records)
        deadline = time.monotonic() + BUFFER_RESTART_S
        while True:
            try:
                return await buffer.try_add.remote(batch, origin)
            except ACTOR_GONE as exc:
                if time.monotonic() > deadline:
                    raise
                log.warning("buffer %s unavailable while shipping (%s); checking what arrived",
                            model_id, type(exc).__name__)
                await asyncio.sleep(1.0)
                try:
                    arrived = (await buffer.received_rows.remote([origin]))[origin]
                except ACTOR_GONE:
                    continue  # still restarting
                if arrived >= len(records):
                    return True  # accepted and logged before the crash

    async def seal_episode(self, model_id: str, episode_id: str, num_rows: int) -> None:
        await self.buffers[model_id].seal_episode.remote(episode_id, num_rows)

    async def submit_coach(self, requests: list[CoachRequest]) -> None:
        await self.coach.submit.remote(requests)

    async def score_now(self, requests: list[CoachRequest]) -> dict:
        return await self.coach.score_now.remote(requests)

    async def consult(self, request: AdviceRequest) -> Advice:
        return await self.coach.consult.remote(request)

    async def commit_rewards(self, model_id: str, commits: list[RewardCommit]) -> None:
        await self.buffers[model_id].commit_rewards.remote(commits)

    def report(self, scalars: dict[str, float]) -> None:
        self.metrics.scalars.remote(scalars)  # fire-and-forget: metrics never block rollouts


class BufferCommit:
    """The coach pool's commit function: reward commits go to the producing model's buffer."""

    def __init__(self, buffers: dict) -> None:
        self.buffers = buffers

    async def __call__(self, model_id: str, commits: list[RewardCommit]) -> None:
        await self.buffers[model_id].commit_rewards.remote(commits)


@dataclass(frozen=True)
class RolloutSetup:
    """What one rollout actor is: its place in the run and how it reaches the engines."""

    run_id: str
    actor_index: int  # its slot (rollout.actors / max_actors); shards the task stream
    owner: str  # its unique name at the clock (in-flight round accounting)
    engine_urls: dict[str, list[str]]  # model_id -> the SGLang servers serving it
    model_paths: dict[str, str]  # model_id -> HF folder (the tokenizer)
    readiness: dict[str, str]  # model_id -> "group" | "episode" (DESIGN §4)
    template_kwargs: dict[str, dict]  # model_id -> extra chat-template arguments


class RolloutHost:
    """Owns one RolloutActor and its engine clients inside a Ray actor process."""

    def __init__(self, cfg: RolloutConfig, workflow_cfg: WorkflowConfig, setup: RolloutSetup,
                 ports: RayRolloutPorts) -> None:
        from transformers import AutoTokenizer

        configure_logging()  # this actor's process: the first call in it configures
        routes = {
            model_id: ModelRoute(model_id, [EngineClient(url) for url in urls],
                                 AutoTokenizer.from_pretrained(setup.model_paths[model_id]),
                                 setup.template_kwargs.get(model_id))
            for model_id, urls in setup.engine_urls.items()
        }
        self.actor = RolloutActor(cfg, workflow_cfg, setup.run_id, setup.actor_index, routes,
                                  ports.for_owner(setup.owner), setup.readiness)

    async def run(self) -> dict:
        return await self.actor.run()

    async def stop(self) -> dict:
        return await self.actor.stop()

    async def drain(self, timeout_s: float, reason: str = "scaled_down") -> dict:
        return await self.actor.drain(timeout_s, reason)

    async def stats(self) -> dict:
        return {**self.actor.stats(), "pid": os.getpid()}
