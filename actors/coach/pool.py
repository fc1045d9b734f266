"""The coach pool: owns all per-action scoring traffic, off the critical path (DESIGN §8).

Episodes hand requests to `CoachPool.submit` and move on; a fixed set of workers scores them
(bounded concurrency, bounded queue) and commits each row's reward to the buffer of the
model that produced it, by step_id, exactly once: a step_id the pool has taken before is
counted as a duplicate and not scored again. The synchronous baseline (DESIGN §12) awaits
`score_now` inside the episode instead, and then the episode, not the pool, carries the
score into the row. A failure marks the row FAILED with its reason; no score is made up.

Rewards (MAPPA §2.3, B.4): a judge's `PROCESS_SCORE: N` (0–10) is p_t = N/10 in [0, 1] and
the row's reward is p_t, like the rule coach's [0, 1] scores; an ensemble combines the p_t of
its judges. With reward backpropagation (MAPPA appendix F) the reward is
f_t = α·p_t + β·Δ_t with Δ_t = D/10 in [−1, 1] from the backward chain over the actions the
episode kept (`on_path`); a candidate the episode did not continue from did not produce the
outcome, so it gets Δ_t = 0 (F.3: steps that did not affect the outcome get small |Δ_t|).
`coach_score` always holds p_t.

The pool also answers `consult` for the advisor (`coach.advisor`, actors/coach/advisor.py):
a non-trained model episodes ask for feedback over the same endpoints and limits; it commits
nothing, and its counters appear as `advisor/…` in `stats()`.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import traceback
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Awaitable, Callable, Protocol

from actors.coach.advisor import Advisor
from actors.coach.config import CoachConfig
from actors.coach.http import CoachFailure
from actors.coach.parse import Verdict
from actors.coach.stats import ScoreBook
from actors.episode import Advice, AdviceRequest, CoachRequest
from buffers.schema import RewardCommit

log = logging.getLogger(__name__)
SEEN_CAPACITY = 1 << 18  # recent step_ids kept for the exactly-once check (~40 MB at most)


class Coach(Protocol):
    async def score(self, request: CoachRequest) -> Verdict:
        """A verdict with score in [0, 1]; raises (CoachFailure with a reason) otherwise."""
        ...

    def stats(self) -> dict[str, float]: ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class CoachResult:
    """The outcome for one row: a reward (and p_t) or a failure reason, never both."""

    step_id: str
    reward: float | None = None
    coach_score: float | None = None
    failed_reason: str | None = None

    def commit(self) -> RewardCommit:
        return RewardCommit(self.step_id, reward=self.reward, coach_score=self.coach_score,
                            failed_reason=self.failed_reason)


CommitFn = Callable[[str, list[RewardCommit]], Awaitable[None]]


class CoachPool:
    """Bounded, fire-and-forget scoring; commits land in the buffers by step_id."""

    def __init__(self, cfg: CoachConfig, coach: Coach, commit: CommitFn,
                 journal_path: str | None = None) -> None:
        self.cfg = cfg
        # every accepted request, one JSON line each: a resumed run re-sends those whose rows
        # the recovered buffers still hold pending (runtime/resume.py)
        self.journal = open(journal_path, "a", encoding="utf-8") if journal_path else None
        self.coach = coach
        self.commit = commit
        self.backprop = cfg.backprop if cfg.backprop.enabled else None
        self._queue: asyncio.Queue[list[CoachRequest]] | None = None
        self._workers: list[asyncio.Task] = []
        self._seen: OrderedDict[str, None] = OrderedDict()
        self.book = ScoreBook()
        self.failures: Counter[str] = Counter()
        self.requests = self.duplicates = self.in_flight = self.scored = 0
        self.scores_committed = self.commit_failures = 0
        self.resent = 0  # requests scored again for a restarted buffer (or a resumed run)
        self.started_at: float | None = None
        self.fatal: str | None = None  # a programming error in the coach: stops the run
        self.paused = False  # control/coach pause: workers take no new job; rows wait, none drop
        self._resumed: asyncio.Event | None = None
        # built here, in the pool's process, so a coach's judges it shares stay one object
        self.advisor = (Advisor(cfg, getattr(coach, "members", None))
                        if cfg.advisor.enabled else None)

    def check(self) -> None:
        """Raise the coach's programming error, if one happened (the controller polls this)."""
        if self.fatal is not None:
            raise RuntimeError(self.fatal)

    def pause(self) -> None:
        """Hold new coach calls (calls in flight finish); requests keep queueing, bounded by
        `queue_capacity`, which backpressures rollouts rather than dropping anything."""
        self.paused = True

    def resume(self) -> None:
        self.paused = False
        if self._resumed is not None:
            self._resumed.set()
            self._resumed = None

    def _ensure_workers(self) -> asyncio.Queue:
        if self._queue is None:
            self._queue = asyncio.Queue(maxsize=self.cfg.queue_capacity)
            self._workers = [asyncio.create_task(self._worker())
                             for _ in range(self.cfg.max_concurrency)]
        return self._queue

    def _fresh(self, requests: list[CoachRequest]) -> list[CoachRequest]:
        """The requests whose step_id the pool has not taken yet (exactly-once scoring)."""
        self.started_at = self.started_at or time.time()
        fresh = []
        for request in requests:
            if request.step_id in self._seen:
                self.duplicates += 1
                log.warning("coach request for step %s repeated; scored once only",
                            request.step_id)
                continue
            self._seen[request.step_id] = None
            if len(self._seen) > SEEN_CAPACITY:
                self._seen.popitem(last=False)
            fresh.append(request)
        self.requests += len(fresh)
        return fresh

    async def submit(self, requests: list[CoachRequest], resend: bool = False) -> int:
        """Queue requests for scoring; returns at once unless the queue is full.

        With backpropagation one queue entry is one episode (its chain needs every action).
        `resend`: requests whose scores a restarted buffer lost (its rows came back pending
        from its log): scored again even though the pool has seen their step_ids.
        """
        queue = self._ensure_workers()
        if resend:
            for request in requests:
                self._seen.pop(request.step_id, None)
            self.resent += len(requests)
        fresh = self._fresh(requests)
        if self.journal is not None and fresh and not resend:
            self.journal.write("".join(json.dumps(dataclasses.asdict(r), default=str) + "\n" for r in fresh))
            self.journal.flush()  # to the OS: a killed process loses none of it
        if self.backprop is None:
            jobs = [[r] for r in fresh]
        else:
            episodes: dict[str, list[CoachRequest]] = {}
            for request in fresh:
                episodes.setdefault(request.episode_id, []).append(request)
            jobs = list(episodes.values())
        for job in jobs:
            await queue.put(job)
        return len(fresh)

    async def score_now(self, requests: list[CoachRequest]) -> dict[str, CoachResult]:
        """Synchronous mode: score inline; the caller puts the results into its rows."""
        if self.backprop is not None:
            raise ValueError("score_now cannot backpropagate: the outcome is not known inside "
                             "the episode (set rollout.sync_coach=false)")
        fresh = self._fresh(requests)
        results = await self._run(fresh)
        return {r.step_id: r for r in results}

    async def consult(self, request: AdviceRequest) -> Advice:
        """The advisor's reply to one episode's question; a failure comes back as an Advice
        with `failed_reason` (logged and counted), which the episode raises as AdvisorFailure.

        Not paused by `pause()`: an episode waits on this answer, and holding it would hold
        the rollouts that `control/coach` pause means to keep running.
        """
        if self.advisor is None:
            raise RuntimeError("an episode called consult but coach.advisor.enabled=false: set "
                               "coach.advisor.enabled=true (with coach.advisor.endpoints, or "
                               "coach.kind=http to share the judges)")
        return await self.advisor.consult(request)

    async def _score(self, request: CoachRequest) -> tuple[Verdict | None, str | None]:
        start = time.perf_counter()
        self.in_flight += 1
        try:
            verdict = await self.coach.score(request)
            if not 0.0 <= verdict.score <= 1.0:
                raise ValueError(f"coach returned {verdict.score}; must be in [0, 1]")
        except CoachFailure as exc:  # the judge failed (HTTP, parse, timeout): the row fails
            self.failures[exc.reason] += 1
            log.warning("coach gave up on step %s: %s", request.step_id, exc)
            return None, exc.reason
        except Exception as exc:
            # A programming error (a rule that raises, a missing API-key variable, a score out
            # of range) would fail every row alike and starve the learners: the run stops.
            self.fatal = (f"coach raised {exc!r} scoring step {request.step_id} "
                          f"(agent {request.agent}):\n{traceback.format_exc()}")
            log.error("coach bug; the run will stop: %s", self.fatal)
            raise
        finally:
            self.in_flight -= 1
            self.book.latencies.append(time.perf_counter() - start)
        self.scored += 1
        self.book.add(request.agent, verdict.score, request.outcome, verdict.answer_correct,
                      request.on_path)
        return verdict, None

    async def _run(self, job: list[CoachRequest]) -> list[CoachResult]:
        scored = await asyncio.gather(*(self._score(r) for r in job))
        deltas: dict[str, float | None] = {}
        chain_failure = None
        if self.backprop is not None:
            deltas, chain_failure = await self._backpropagate(job)
        results = []
        for request, (verdict, reason) in zip(job, scored):
            if verdict is None:
                results.append(CoachResult(request.step_id, failed_reason=reason))
                continue
            if self.backprop is None:
                results.append(CoachResult(request.step_id, verdict.score, verdict.score))
                continue
            delta = deltas.get(request.step_id, 0.0) if request.on_path else 0.0
            if delta is None:
                self.failures[chain_failure] += 1
                results.append(CoachResult(request.step_id, failed_reason=chain_failure))
                continue
            reward = self.backprop.alpha * verdict.score + self.backprop.beta * delta
            results.append(CoachResult(request.step_id, reward, verdict.score))
        return results

    async def _backpropagate(self, job: list[CoachRequest]):
        """Δ_t for the episode's on-path actions, in turn order (MAPPA F.2)."""
        path = sorted((r for r in job if r.on_path), key=lambda r: r.turn)
        if not path:
            return {}, None
        outcome = path[-1].outcome
        if outcome is None:  # the workflow reported no outcome: nothing to attribute
            return {r.step_id: None for r in path}, "backprop_no_outcome"
        values, reason = await self.coach.attribute(path, outcome)
        return {r.step_id: d for r, d in zip(path, values)}, reason

    async def _worker(self) -> None:
        assert self._queue is not None
        while True:
            while self.paused:
                if self._resumed is None:
                    self._resumed = asyncio.Event()
                await self._resumed.wait()
            job = await self._queue.get()
            try:
                results = await self._run(job)
                by_model: dict[str, list[RewardCommit]] = {}
                for request, result in zip(job, results):
                    by_model.setdefault(request.model_id, []).append(result.commit())
                for model_id, commits in by_model.items():
                    try:
                        await self.commit(model_id, commits)
                    except Exception:  # the buffer is gone: the rows time out there, counted
                        self.commit_failures += len(commits)
                        log.exception("commit of %d coach results failed", len(commits))
                        continue
                    self.scores_committed += sum(c.failed_reason is None for c in commits)
            finally:
                self._queue.task_done()

    def stats(self) -> dict[str, float]:
        """Flat `coach/…` metrics (DESIGN §9): counts, latency, failures, scores per agent."""
        elapsed = max(time.time() - (self.started_at or time.time()), 1e-9)
        out = {"requests": self.requests, "scored": self.scored,
               "calls": self.scored + sum(self.failures.values()),  # an HTTP coach overrides
               "failures": sum(self.failures.values()), "duplicates": self.duplicates,
               "in_flight": self.in_flight, "queued": self._queue.qsize() if self._queue else 0,
               "committed": self.scores_committed, "commit_failures": self.commit_failures,
               "rows_per_s": self.scored / elapsed, "paused": float(self.paused),
               "resent": self.resent}
        out.update({f"failed/{reason}": n for reason, n in self.failures.items()})
        out.update(self.book.stats())
        coach = self.coach.stats()
        out.update(coach)
        if "calls" in coach:
            out["calls_per_s"] = coach["calls"] / elapsed
        if self.advisor is not None:
            out.update({f"advisor/{k}": v for k, v in self.advisor.stats().items()})
        return {k: float(v) for k, v in out.items()}

    def histograms(self) -> dict[str, list[float]]:
        """Recent coach scores per agent (`coach/score/<agent>` histograms)."""
        return self.book.histograms()

    async def close(self) -> None:
        if self.journal is not None:
            self.journal.close()
        for worker in self._workers:
            worker.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        if self.advisor is not None:
            await self.advisor.close()
        await self.coach.close()


def journaled_requests(path: str, step_ids: set[str]) -> list[CoachRequest]:
    """The requests of `step_ids` in a coach journal (the last one of each, in order)."""
    found: dict[str, CoachRequest] = {}
    with open(path, encoding="utf-8") as journal:
        for line in journal:
            if not line.endswith("\n"):
                break  # a torn last line: its request never reached the queue in full
            record = json.loads(line)
            if record["step_id"] in step_ids:
                found[record["step_id"]] = CoachRequest(**record)
    return list(found.values())
