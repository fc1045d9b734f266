"""The coach pool: owns all per-action scoring traffic, off the critical path (DESIGN §8).

Episodes hand requests to `CoachPool.submit` and move on; a fixed set of workers scores them
(bounded concurrency, bounded queue) and commits each score to the buffer of the model that
produced the action, by step_id. The synchronous baseline (DESIGN §12) instead awaits
`score_now` inside the episode. `RuleCoach` is the offline coach: the workflow's rule score
with an optional injected latency, so the decoupling is measurable without a remote judge.
A coach failure marks the row FAILED with a reason; no score is ever made up.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Awaitable, Callable, Protocol

import numpy as np

from actors.episode import CoachRequest
from actors.workflows.base import Task, Workflow
from buffers.schema import RewardCommit

log = logging.getLogger(__name__)


@dataclass
class CoachConfig:
    kind: str = "rule"  # "rule": the workflow's rule score (the HTTP coach comes later)
    latency_s: float = 0.0  # seconds each RuleCoach call takes (simulates a remote judge)
    max_concurrency: int = 64  # coach calls in flight at once
    queue_capacity: int = 4096  # requests waiting at most; submit waits beyond it

    def __post_init__(self) -> None:
        if self.kind != "rule":
            raise ValueError(f"coach.kind={self.kind!r}: only 'rule' exists in this version")
        if self.latency_s < 0:
            raise ValueError(f"coach.latency_s={self.latency_s}: must be >= 0")
        if self.max_concurrency < 1 or self.queue_capacity < 1:
            raise ValueError("coach.max_concurrency and coach.queue_capacity must be >= 1, got "
                             f"{self.max_concurrency} and {self.queue_capacity}")


class Coach(Protocol):
    async def score(self, request: CoachRequest) -> float:
        """A score in [0, 1]; raises when no score could be obtained."""
        ...


class RuleCoach:
    """Scores an action with its workflow's rules, after `latency_s` of simulated thinking."""

    def __init__(self, workflow: Workflow, latency_s: float = 0.0) -> None:
        self.workflow = workflow
        self.latency_s = latency_s

    async def score(self, request: CoachRequest) -> float:
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        task = Task(task_id=request.task_id, prompt=request.input_text, truth=request.truth or "")
        return float(self.workflow.rule_score(request.agent, task, request.output_text,
                                              request.finish_reason, request.context))


CommitFn = Callable[[str, list[RewardCommit]], Awaitable[None]]


class CoachPool:
    """Bounded, fire-and-forget scoring; commits land in the buffers by step_id."""

    def __init__(self, cfg: CoachConfig, coach: Coach, commit: CommitFn) -> None:
        self.cfg = cfg
        self.coach = coach
        self.commit = commit
        self._queue: asyncio.Queue[CoachRequest] | None = None
        self._workers: list[asyncio.Task] = []
        self._latencies: deque[float] = deque(maxlen=4096)
        self.calls = 0
        self.failures = 0
        self.in_flight = 0
        self.scores_committed = 0
        self.commit_failures = 0

    def _ensure_workers(self) -> asyncio.Queue:
        if self._queue is None:
            self._queue = asyncio.Queue(maxsize=self.cfg.queue_capacity)
            self._workers = [asyncio.create_task(self._worker())
                             for _ in range(self.cfg.max_concurrency)]
        return self._queue

    async def submit(self, requests: list[CoachRequest]) -> int:
        """Queue requests for scoring; returns at once unless the queue is full."""
        queue = self._ensure_workers()
        for request in requests:
            await queue.put(request)
        return len(requests)

    async def score_now(self, requests: list[CoachRequest]) -> dict[str, float]:
        """Synchronous mode: score inline and return {step_id: score}; failures raise."""
        scores = await asyncio.gather(*(self._call(r) for r in requests))
        return {r.step_id: s for r, s in zip(requests, scores)}

    async def _call(self, request: CoachRequest) -> float:
        start = time.perf_counter()
        self.in_flight += 1
        try:
            score = await self.coach.score(request)
        finally:
            self.in_flight -= 1
            self.calls += 1
            self._latencies.append(time.perf_counter() - start)
        if not 0.0 <= score <= 1.0:
            raise ValueError(f"coach returned {score} for step {request.step_id}; must be in [0, 1]")
        return score

    async def _worker(self) -> None:
        assert self._queue is not None
        while True:
            request = await self._queue.get()
            try:
                try:
                    score = await self._call(request)
                    commit = RewardCommit(request.step_id, reward=score, coach_score=score)
                except Exception as exc:  # counted and recorded on the row, never a default score
                    self.failures += 1
                    log.warning("coach failed on step %s: %r", request.step_id, exc)
                    commit = RewardCommit(request.step_id, failed_reason="coach_error")
                try:
                    await self.commit(request.model_id, [commit])
                except Exception:  # the buffer is gone: the row times out there, counted
                    self.commit_failures += 1
                    log.exception("commit of step %s failed", request.step_id)
                    continue
                self.scores_committed += commit.failed_reason is None
            finally:
                self._queue.task_done()

    def stats(self) -> dict[str, float]:
        lat = np.asarray(self._latencies) if self._latencies else np.zeros(1)
        return {
            "calls": float(self.calls), "failures": float(self.failures),
            "in_flight": float(self.in_flight),
            "queued": float(self._queue.qsize() if self._queue else 0),
            "committed": float(self.scores_committed),
            "commit_failures": float(self.commit_failures),
            "latency_p50_s": float(np.percentile(lat, 50)),
            "latency_p95_s": float(np.percentile(lat, 95)),
            "latency_max_s": float(lat.max()),
        }

    async def close(self) -> None:
        for worker in self._workers:
            worker.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
