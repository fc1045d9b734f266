"""The advisor: a non-trained model that episodes consult (DESIGN §14, MAGRPO appendix D).

MAGRPO's multi-turn setting shows the problem and the agents' first answers to an external
model (Claude-Sonnet-4 there) whose feedback goes into the next turn's prompts. Here that
model sits behind the coach pool's HTTP path: `Advisor.consult(request)` sends the workflow's
own chat messages through `HttpCoach.chat` — the endpoint's concurrency and rate limits,
per-call timeout, retries with backoff and circuit breaker — and returns an `Advice` with the
reply text, the latency and the endpoint that answered. It never raises for an endpoint that
failed: the failure comes back as `Advice.failed_reason`, logged and counted here, and the
episode turns it into `AdvisorFailure` (a Ray hop carries a dataclass, not an exception).

Endpoints: `coach.advisor.endpoints`, or — when that is empty — the coach's own judges, the
very same `HttpCoach` objects, so scores and advice share one concurrency bound, one rate
budget and one breaker (one provider account). Replies are not cached: advice is sampled, and
the G joint rollouts of a round ask about different answers anyway.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque

import numpy as np

from actors.coach.config import CoachConfig
from actors.coach.http import CoachFailure, HttpCoach
from actors.episode import Advice, AdviceRequest

log = logging.getLogger(__name__)
WINDOW = 4096  # recent consult latencies kept for percentiles


class Advisor:
    """Advice through the pool's endpoints; see the module docstring."""

    def __init__(self, cfg: CoachConfig, shared: list[HttpCoach] | None = None) -> None:
        """`shared`: the coach's judges, used when `cfg.advisor.endpoints` is empty."""
        self.cfg = cfg.advisor
        if self.cfg.endpoints:
            self.members = [HttpCoach(e, cfg.retry, cfg.breaker, cache=None, seed=1000 + i)
                            for i, e in enumerate(self.cfg.endpoints)]
            self._owned = True  # closed by close(); shared judges are the coach's to close
        elif shared:
            self.members, self._owned = list(shared), False
        else:
            raise ValueError("coach.advisor.endpoints is empty and the coach has no HTTP judges "
                             "to share: add coach.advisor.endpoints or set coach.kind=http")
        self.by_name = {m.name: m for m in self.members}
        self._next = 0  # round-robin start among endpoints whose breaker is closed
        self._slots: asyncio.Semaphore | None = None  # built in the event loop that uses it
        self.calls = self.in_flight = 0
        self.failures: Counter[str] = Counter()
        self.per_endpoint: Counter[str] = Counter()
        self.per_purpose: Counter[str] = Counter()
        self.latencies: deque[float] = deque(maxlen=WINDOW)

    def pick(self, name: str | None) -> HttpCoach:
        """The named endpoint, else the next one (in turn) whose breaker is closed."""
        if name is not None:
            if name not in self.by_name:
                raise ValueError(f"consult(endpoint={name!r}): no such advisor endpoint; known: "
                                 f"{sorted(self.by_name)} (coach.advisor.endpoints[].name)")
            return self.by_name[name]
        order = self.members[self._next:] + self.members[:self._next]
        self._next = (self._next + 1) % len(self.members)
        healthy = [m for m in order if m.breaker.state == m.breaker.CLOSED]
        return (healthy or order)[0]  # all open: wait on the next one's breaker

    async def consult(self, request: AdviceRequest) -> Advice:
        """The reply, or an Advice with `failed_reason`; a bug (not a failed call) raises."""
        member = self.pick(request.endpoint)
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.cfg.max_concurrency)
        start = time.monotonic()
        self.in_flight += 1
        try:
            async with self._slots:
                text = await member.chat(request.messages, max_tokens=self.cfg.max_tokens,
                                         temperature=self.cfg.temperature,
                                         extra_body=self.cfg.extra_body,
                                         give_up_after_s=self.cfg.give_up_after_s)
        except CoachFailure as exc:
            reason = exc.reason.removeprefix("coach_")
            self.failures[reason] += 1
            log.warning("advisor %s gave up (purpose %s, episode %s, task %s): %s; the "
                        "episode gets AdvisorFailure", member.name, request.purpose,
                        request.episode_id, request.task_id, exc)
            return self._count(request, member, start, None, reason, str(exc))
        finally:
            self.in_flight -= 1
        return self._count(request, member, start, text, None, "")

    def _count(self, request: AdviceRequest, member: HttpCoach, start: float, text: str | None,
               reason: str | None, detail: str) -> Advice:
        latency = time.monotonic() - start
        self.calls += 1
        self.per_endpoint[member.name] += 1
        self.per_purpose[request.purpose] += 1
        self.latencies.append(latency)
        return Advice(text=text, endpoint=member.name, latency_s=latency,
                      purpose=request.purpose, failed_reason=reason, detail=detail)

    def stats(self) -> dict[str, float]:
        """`advisor/…` keys of the pool's stats (`coach/advisor/…` in TensorBoard).

        Latency is per consult, answered or failed: how long an episode waited. The endpoint
        counters of a shared judge (`member/<name>/calls`) count its advice calls too.
        """
        lat = np.asarray(self.latencies) if self.latencies else np.zeros(1)
        out = {"calls": self.calls, "failures": sum(self.failures.values()),
               "in_flight": self.in_flight, "latency_s": float(lat.mean()),
               "latency_p50_s": float(np.percentile(lat, 50)),
               "latency_p95_s": float(np.percentile(lat, 95)),
               "latency_max_s": float(lat.max())}
        out.update({f"failed/{reason}": n for reason, n in self.failures.items()})
        out.update({f"endpoint/{name}/calls": n for name, n in self.per_endpoint.items()})
        out.update({f"purpose/{name}/calls": n for name, n in self.per_purpose.items()})
        return {k: float(v) for k, v in out.items()}

    async def close(self) -> None:
        if self._owned:
            await asyncio.gather(*(m.close() for m in self.members))
