"""The LLM coach: an ensemble of HTTP judges, the process score and reward backpropagation.

`LLMCoach.score(request)` asks every judge (MAPPA §2.2 prompt of the workflow) and combines
the scores that parsed by mean or median (DESIGN §8; MAPPA §4 suggests several coaches
against one coach's bias); fewer than `min_scores` scores is a failure with the first
judge's reason. `LLMCoach.attribute(path, outcome)` runs MAPPA appendix F's backward chain
with each judge — the last action first, each step receiving the residual the later steps
left unexplained — and combines the contributions per step the same way. A step whose chain
broke gets no contribution (None) and the pool fails its row; nothing is filled in.
"""
from __future__ import annotations

import asyncio
import logging
import statistics
from collections import deque

from actors.coach.cache import ReplyCache
from actors.coach.config import CoachConfig
from actors.coach.http import CoachFailure, HttpCoach
from actors.coach.parse import Verdict, parse_attribution, parse_verdict
from actors.coach.prompts import BACKPROP_REMINDER, FORMAT_REMINDER, PromptBook
from actors.episode import CoachRequest

log = logging.getLogger(__name__)
LAST_STEP_RESIDUAL = ("Nothing yet: this is the last step, the whole outcome remains to be "
                      "explained.")


def describe_outcome(outcome: float) -> str:
    return (f"{outcome:g} on a 0-1 scale (1: the system solved the task, 0: it did not)")


class LLMCoach:
    """Coach protocol over `cfg.endpoints`; see the module docstring."""

    def __init__(self, cfg: CoachConfig, workflow: str, cache_path: str | None = None) -> None:
        self.cfg = cfg
        self.book = PromptBook(cfg, workflow)
        cache = ReplyCache(cfg.cache.capacity, cache_path) if cfg.cache.enabled else None
        self.members = [HttpCoach(e, cfg.retry, cfg.breaker, cache, seed=i)
                        for i, e in enumerate(cfg.endpoints)]
        self.needed = cfg.min_scores or len(self.members)
        self._combine = statistics.fmean if cfg.combine == "mean" else statistics.median
        # recent scores of each judge (per-coach bias shows as a shifted mean)
        self.member_scores: dict[str, deque[float]] = {
            m.name: deque(maxlen=4096) for m in self.members}

    async def score(self, request: CoachRequest) -> Verdict:
        rendered = self.book.score_prompt(request)

        def parse(reply: str) -> Verdict:
            return parse_verdict(reply, rendered.require_answer)

        results = await asyncio.gather(
            *(m.ask(rendered, parse, FORMAT_REMINDER) for m in self.members),
            return_exceptions=True)
        verdicts = []
        for member, result in zip(self.members, results):
            if isinstance(result, CoachFailure):
                continue  # counted in the member's failures; the ensemble decides below
            if isinstance(result, BaseException):
                raise result  # a bug, not a coach answer: fail loudly
            verdicts.append(result)
            self.member_scores[member.name].append(result.score)
        if len(verdicts) < self.needed:
            first = next(r for r in results if isinstance(r, CoachFailure))
            raise CoachFailure(first.reason, f"{len(verdicts)}/{len(self.members)} judges scored")
        answers = [v.answer_correct for v in verdicts if v.answer_correct is not None]
        majority = None
        if answers and 2 * sum(answers) != len(answers):
            majority = int(2 * sum(answers) > len(answers))
        return Verdict(float(self._combine([v.score for v in verdicts])), majority)

    async def attribute(self, path: list[CoachRequest],
                        outcome: float) -> tuple[list[float | None], str | None]:
        """Δ_t per step of `path` (in [−1, 1]) and the failure reason of the steps left None."""
        chains = await asyncio.gather(*(self._chain(m, path, outcome) for m in self.members))
        deltas: list[float | None] = []
        reason = None
        for i in range(len(path)):
            values = [chain[i] for chain, _ in chains if chain[i] is not None]
            if len(values) >= self.needed:
                deltas.append(float(self._combine(values)))
            else:
                deltas.append(None)
                reason = reason or next(r for _, r in chains if r is not None)
        return deltas, reason

    async def _chain(self, member: HttpCoach, path: list[CoachRequest],
                     outcome: float) -> tuple[list[float | None], str | None]:
        deltas: list[float | None] = [None] * len(path)
        residual = LAST_STEP_RESIDUAL
        trajectory = self.book.trajectory(path)
        for i in reversed(range(len(path))):
            rendered = self.book.attribution_prompt(path[i], describe_outcome(outcome), residual,
                                                    trajectory)
            try:
                attribution = await member.ask(rendered, parse_attribution, BACKPROP_REMINDER)
            except CoachFailure as exc:  # the earlier steps cannot be attributed by this judge
                log.warning("coach %s: backprop chain broke at step %d: %s", member.name, i, exc)
                return deltas, f"backprop_{exc.reason}"
            deltas[i] = attribution.delta
            residual = attribution.residual
        return deltas, None

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for member in self.members:
            for key, value in member.stats().items():
                out[f"member/{member.name}/{key}"] = value
            scores = self.member_scores.get(member.name)
            if scores:
                out[f"member/{member.name}/score_mean"] = statistics.fmean(scores)
        for key in ("retries", "cache_hits", "reasks", "calls", "breaker_opened"):
            out[key] = float(sum(m.stats()[key] for m in self.members))
        return out

    async def close(self) -> None:
        await asyncio.gather(*(m.close() for m in self.members))
