"""Long-lived rollout actor: C concurrent rounds on asyncio, forever, until stopped.

Each slot loops: await admission from the version clock (DESIGN §5), take the next index of
the train task stream every actor shares (so actors can be added and removed live), play a round
(G joint episodes or one tree-sampled episode), report its rows to the round ledger (held by
the clock, buffers/ledger.py), push them to the buffers of the models that produced them,
then hand the coach requests to the coach pool (fire-and-forget; in the synchronous baseline
they are awaited inline first). Rollout actors are stateless: a crash loses only in-flight
rounds, and the ledger, not this actor, knows their rows, so they are counted with a reason.
`drain` (a live scale-down) stops taking rounds and lets the in-flight ones finish.
Episodes that consult the advisor (`Episode.consult`) reach the coach pool through `_consult`,
which counts the calls, failures and waiting time of this actor.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

from actors.episode import (
    Advice, AdviceRequest, CoachRequest, Episode, ModelRoute, SamplingParams,
)
from actors.tasks import TasksExhausted, TaskSource
from actors.workflows import WorkflowConfig, build_workflow
from actors.workflows.base import units_per_round
from buffers.schema import RewardCommit, StepRecord, new_id

log = logging.getLogger(__name__)


@dataclass
class AgentSampling:
    """One agent's sampling parameters; a null field takes the rollout-wide value."""

    temperature: float | None = None  # must equal the learner temperature of the agent's model
    top_p: float | None = None  # nucleus sampling mass (1.0 keeps behaviour logprobs exact)


@dataclass
class RolloutConfig:
    actors: int = 1  # rollout actors (R) at start, scaled independently of learners
    max_actors: int = 8  # the most a live scale-up (ctl.py scale-rollout) may run
    concurrency: int = 4  # concurrent rounds per actor (C)
    temperature: float = 1.0  # sampling temperature (the learner applies the same to logits)
    top_p: float = 1.0  # nucleus sampling mass; 1.0 keeps behaviour logprobs exact
    # per-agent overrides of temperature / top_p, e.g. {tool: {temperature: 0.7}}
    agent_sampling: dict[str, AgentSampling] = field(default_factory=dict)
    sync_coach: bool = False  # await the coach inside the episode (synchronous baseline)
    admission_wait_s: float = 1.0  # longest single wait for admission before re-checking stop/drain
    max_consecutive_failures: int = 20  # failed rounds in a row before the actor gives up
    seed: int = 0  # task order seed (each actor plays its own shard of workflow.tasks)

    def __post_init__(self) -> None:
        if self.actors < 1 or self.concurrency < 1:
            raise ValueError(f"rollout.actors={self.actors} and rollout.concurrency="
                             f"{self.concurrency} must both be >= 1")
        if self.max_actors < self.actors:
            raise ValueError(f"rollout.max_actors={self.max_actors} < rollout.actors="
                             f"{self.actors}: raise rollout.max_actors")
        if self.admission_wait_s <= 0:
            raise ValueError(f"rollout.admission_wait_s={self.admission_wait_s}: must be > 0")
        if self.temperature <= 0:
            raise ValueError(f"rollout.temperature={self.temperature}: must be > 0 (sampling only)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p={self.top_p}: must be in (0, 1]")
        for agent, spec in self.agent_sampling.items():
            if spec.temperature is not None and spec.temperature <= 0:
                raise ValueError(f"rollout.agent_sampling.{agent}.temperature="
                                 f"{spec.temperature}: must be > 0 (sampling only)")
            if spec.top_p is not None and not 0 < spec.top_p <= 1:
                raise ValueError(f"rollout.agent_sampling.{agent}.top_p={spec.top_p}: "
                                 "must be in (0, 1]")

    def sampling_for(self, agent: str) -> SamplingParams:
        """The agent's sampling parameters: its overrides, else the rollout-wide ones."""
        spec = self.agent_sampling.get(agent, AgentSampling())
        return SamplingParams(
            self.temperature if spec.temperature is None else spec.temperature,
            self.top_p if spec.top_p is None else spec.top_p)


class RolloutPorts(Protocol):
    """How a rollout actor reaches the rest of the system (runtime provides it)."""

    async def admit(self, units: dict[str, int], round_id: str, timeout_s: float) -> bool: ...
    async def next_task(self) -> int: ...
    async def generated(self, round_id: str, episodes: dict[str, dict[str, int]],
                        units: dict[str, int]) -> None: ...
    async def shipped(self, round_id: str) -> None: ...
    async def abandon(self, round_id: str, rows: int, reason: str) -> None: ...
    async def add_rows(self, model_id: str, records: list[StepRecord], origin: str) -> bool: ...
    async def seal_episode(self, model_id: str, episode_id: str, num_rows: int) -> None: ...
    async def submit_coach(self, requests: list[CoachRequest]) -> None: ...
    async def score_now(self, requests: list[CoachRequest]) -> dict: ...
    async def consult(self, request: AdviceRequest) -> Advice: ...
    async def commit_rewards(self, model_id: str, commits: list[RewardCommit]) -> None: ...
    def report(self, scalars: dict[str, float]) -> None: ...


class RolloutActor:
    """Plays rounds of one workflow; see the module docstring."""

    def __init__(self, cfg: RolloutConfig, workflow_cfg: WorkflowConfig, run_id: str,
                 actor_index: int, routes: dict[str, ModelRoute], ports: RolloutPorts,
                 readiness: dict[str, str]) -> None:
        self.cfg = cfg
        self.workflow_cfg = workflow_cfg
        self.workflow = build_workflow(workflow_cfg)
        self.run_id = run_id
        self.actor_index = actor_index
        self.routes = routes
        self.ports = ports
        self.readiness = readiness  # model_id -> "group" | "episode"
        self.agent_models = dict(workflow_cfg.agents)
        self.sampling = SamplingParams(cfg.temperature, cfg.top_p)
        self.agent_sampling = {agent: cfg.sampling_for(agent) for agent in cfg.agent_sampling}
        # the train split (a task file, or the workflow's generator), read at the indices the
        # clock hands out: one stream shared by every actor, however many run
        self.tasks = TaskSource(workflow_cfg.tasks, workflow_cfg.tasks.train_split,
                                generator=self.workflow.make_task, seed=cfg.seed)
        self.tasks_exhausted = False
        self.drained = False
        self._stopping = False
        self._draining = False
        self._cancel_reason = "run_stopped"  # loss reason of rounds a stop cancels
        self._workers: list[asyncio.Task] = []
        self._consecutive_failures = 0
        self.rounds = 0
        self.episodes = 0
        self.rows_generated = 0
        self.rows_added = 0
        self.rounds_failed: Counter[str] = Counter()  # reason -> rounds abandoned
        self.last_error = ""  # the latest round failure, for the run's stall diagnosis
        self.admission_waits = 0
        self.backpressure_waits = 0
        self.advisor_calls = self.advisor_failures = 0  # Episode.consult, answered or failed
        self.advisor_latency_s = 0.0  # total time this actor's episodes waited for advice
        self.started_at = time.time()

    async def run(self) -> dict:
        """Run C slots until `stop`; re-raises the failure that made a slot give up."""
        self.started_at = time.time()
        self._workers = [asyncio.create_task(self._slot()) for _ in range(self.cfg.concurrency)]
        done, _ = await asyncio.wait(self._workers, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                await self.stop()
                raise task.exception()
        return self.stats()

    async def stop(self) -> dict:
        """Stop taking tasks and cancel in-flight rounds (their rows are counted as lost)."""
        self._stopping = True
        for task in self._workers:
            task.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        return self.stats()

    async def drain(self, timeout_s: float, reason: str = "scaled_down") -> dict:
        """Take no new round; let in-flight rounds finish for up to `timeout_s`, then cancel
        the rest (their rows are counted lost under `reason`). `run` returns afterwards."""
        self._draining = True
        _, running = await asyncio.wait(self._workers, timeout=timeout_s) if self._workers \
            else (set(), set())
        if running:
            log.warning("rollout actor %d: %d round(s) still running after the %.0f s drain; "
                        "cancelled (%s)", self.actor_index, len(running), timeout_s, reason)
            self._cancel_reason = reason
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
        self.drained = True
        return self.stats()

    async def _slot(self) -> None:
        units = units_per_round(self.workflow, self.agent_models, self.workflow_cfg.group_size,
                                self.readiness)
        while not (self._stopping or self._draining):
            round_id = new_id()
            admitted = False
            while not (self._stopping or self._draining):
                if await self.ports.admit(units, round_id, self.cfg.admission_wait_s):
                    admitted = True
                    break
                self.admission_waits += 1
            if not admitted:
                return
            index = await self.ports.next_task()
            try:
                task = self.tasks.task_at(index)
            except TasksExhausted:
                await self.ports.abandon(round_id, 0, "run_stopped")  # gives its units back
                self.tasks_exhausted = True
                log.info("rollout actor %d: every epoch of workflow.tasks is done; slot ends",
                         self.actor_index)
                return
            await self._play_round(task, round_id)

    def _episodes_for(self, task, round_id: str) -> list[Episode]:
        g = self.workflow_cfg.group_size
        joint = self.workflow.sampling == "joint"
        count = g if joint else 1
        return [Episode(run_id=self.run_id, workflow=self.workflow.name, task_id=task.task_id,
                        round_id=round_id, round_size=count, round_index=i, group_size=g,
                        agent_models=self.agent_models, routes=self.routes,
                        sampling=self.sampling, agent_sampling=self.agent_sampling,
                        truth=task.truth, problem=task.prompt,
                        sync_scorer=self.ports.score_now if self.cfg.sync_coach else None,
                        advisor=self._consult)
                for i in range(count)]

    async def _consult(self, request: AdviceRequest) -> Advice:
        """An episode's advisor call, through the coach pool; counted for this actor."""
        advice = await self.ports.consult(request)
        self.advisor_calls += 1
        self.advisor_failures += advice.failed_reason is not None
        self.advisor_latency_s += advice.latency_s
        return advice

    async def _play_round(self, task, round_id: str) -> None:
        episodes = self._episodes_for(task, round_id)
        try:
            results = await asyncio.gather(*(self.workflow.run(task, ep) for ep in episodes))
        except asyncio.CancelledError:
            await self._abandon(round_id, episodes, self._cancel_reason)
            raise
        except Exception as exc:  # counted: the round's rows are lost with a reason
            await self._abandon(round_id, episodes, "episode_error")
            self._consecutive_failures += 1
            self.last_error = f"{task.task_id}: {exc!r}"
            log.warning("round of %s failed (%d in a row): %r", task.task_id,
                        self._consecutive_failures, exc)
            if self._consecutive_failures >= self.cfg.max_consecutive_failures:
                raise RuntimeError(f"rollout actor {self.actor_index}: "
                                   f"{self._consecutive_failures} rounds failed in a row") from exc
            return
        self._consecutive_failures = 0
        # The round is over: its groups are sealed at the rows it produced, and the clock
        # gets back the units it was admitted for but did not produce (DESIGN §14).
        group_sizes: Counter[str] = Counter()
        for ep in episodes:
            group_sizes.update(ep.group_counts())
        records = {ep.episode_id: ep.records(group_sizes) for ep in episodes}  # built once
        # The ledger learns the rows before any is shipped: if this actor dies while shipping,
        # the controller still knows what should have arrived (buffers/ledger.py).
        await self.ports.generated(round_id, {
            episode_id: {m: len(rows) for m, rows in by_model.items()}
            for episode_id, by_model in records.items()}, self._produced_units(records))
        await self._ship(episodes, records, results)
        await self.ports.shipped(round_id)
        self.rounds += 1
        self.episodes += len(episodes)
        self._report(results, episodes)

    def _produced_units(self, records: dict[str, dict[str, list[StepRecord]]]) -> dict[str, int]:
        """Readiness units the round produced per model: its groups, or its episodes."""
        groups: dict[str, set[str]] = {}
        episodes: Counter[str] = Counter()
        for by_model in records.values():
            for model_id, rows in by_model.items():
                groups.setdefault(model_id, set()).update(r.group_key for r in rows)
                episodes[model_id] += 1
        return {model_id: (episodes[model_id] if self.readiness[model_id] == "episode"
                           else len(groups.get(model_id, ())))
                for model_id in set(self.agent_models.values())}

    async def _abandon(self, round_id: str, episodes: list[Episode], reason: str) -> None:
        rows = sum(ep.num_rows for ep in episodes)
        self.rows_generated += rows
        self.rounds_failed[reason] += 1
        await self.ports.abandon(round_id, rows, reason)

    async def _ship(self, episodes: list[Episode], records: dict[str, dict[str, list]],
                    results: list[dict[str, float]]) -> None:
        """Buffer every row (waiting on backpressure), seal episodes, then ask the coach.

        `records` is episode_id -> model_id -> the episode's StepRecords for that model. The
        coach requests leave only after their rows are in the buffers, so a score can never
        arrive before its row; each carries its episode's outcome ("success").
        """
        batches = [(ep, model_id, rows) for ep in episodes
                   for model_id, rows in records[ep.episode_id].items()]
        self.rows_generated += sum(len(records) for _, _, records in batches)
        # A cancellation (run stop) in here leaves the round open in the ledger: the
        # controller then counts what did not reach a buffer against the ledger's rows.
        for ep, model_id, records in batches:
            while not await self.ports.add_rows(model_id, records, ep.episode_id):
                self.backpressure_waits += 1
                await asyncio.sleep(0.05)
            self.rows_added += len(records)
            if self.readiness[model_id] == "episode":
                await self.ports.seal_episode(model_id, ep.episode_id, len(records))
        for ep in episodes:  # rows the inline coach (synchronous mode) or the episode failed
            for model_id, commits in ep.failures.items():
                await self.ports.commit_rewards(model_id, commits)
        requests = [r for ep, result in zip(episodes, results)
                    for r in ep.coach_requests(result.get("success"))]
        if requests:
            await self.ports.submit_coach(requests)

    def _report(self, results: list[dict[str, float]], episodes: list[Episode]) -> None:
        if any(ep.advisor_calls for ep in episodes):  # a workflow that consults: every episode
            results = [{**r, **ep.advisor_scalars()} for r, ep in zip(results, episodes)]
        self.ports.report(episode_scalars(self.workflow.name, results))

    def stats(self) -> dict:
        elapsed = max(time.time() - self.started_at, 1e-9)
        return {
            "actor": self.actor_index, "rounds": self.rounds,
            "task_epoch": self.tasks.epoch, "tasks_exhausted": self.tasks_exhausted,
            "drained": self.drained, "episodes": self.episodes,
            "episodes_per_s": self.episodes / elapsed, "rows_generated": self.rows_generated,
            "rows_added": self.rows_added, "rounds_failed": dict(self.rounds_failed),
            "last_error": self.last_error,
            "admission_waits": self.admission_waits,
            "backpressure_waits": self.backpressure_waits,
            "advisor_calls": self.advisor_calls, "advisor_failures": self.advisor_failures,
            "advisor_latency_s": self.advisor_latency_s,
        }


def episode_scalars(workflow: str, results: list[dict[str, float]]) -> dict[str, float]:
    """Means over a round's episode results: `episode/<workflow>/<key>`, except the per-agent
    behaviour keys a workflow returns as `behavior/<agent>/<metric>` (DESIGN §9), which keep
    their name. A key some episodes lack (e.g. turns to solve of unsolved ones) is averaged
    over the episodes that have it."""
    scalars: dict[str, float] = {}
    for key in dict.fromkeys(k for r in results for k in r):
        values = [r[key] for r in results if key in r]
        name = key if key.startswith("behavior/") else f"episode/{workflow}/{key}"
        scalars[name] = sum(values) / len(values)
    return scalars
