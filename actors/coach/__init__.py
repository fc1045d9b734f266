"""The coach (DESIGN §8): per-action process scores, off the critical path.

`build_coach(cfg, workflow, cache_path)` picks the scorer named by `coach.kind` from
`COACHES`; `CoachPool` owns all scoring traffic and commits results to the buffers, and
answers `Episode.consult` through its `Advisor` (`coach.advisor`, DESIGN §14).
"""
from __future__ import annotations

from actors.coach.advisor import Advisor
from actors.coach.config import (
    AdvisorConfig, BackpropConfig, BreakerConfig, CacheConfig, CoachConfig, EndpointConfig,
    RetryConfig,
)
from actors.coach.http import CoachFailure, HttpCoach
from actors.coach.judge import LLMCoach
from actors.coach.parse import Attribution, Unparsable, Verdict, parse_attribution, parse_verdict
from actors.coach.pool import Coach, CoachPool, CoachResult
from actors.coach.rule import RuleCoach
from actors.workflows.base import Workflow

COACHES = {
    "rule": lambda cfg, workflow, cache_path: RuleCoach(workflow, cfg.latency_s),
    "http": lambda cfg, workflow, cache_path: LLMCoach(cfg, workflow.name, cache_path),
}


def build_coach(cfg: CoachConfig, workflow: Workflow, cache_path: str | None = None) -> Coach:
    """The scorer of `cfg.kind`; `cache_path` is where an HTTP coach persists its replies."""
    return COACHES[cfg.kind](cfg, workflow, cache_path if cfg.cache.persist else None)


__all__ = [
    "Advisor", "AdvisorConfig", "Attribution", "BackpropConfig", "BreakerConfig", "CacheConfig", "Coach", "CoachConfig",
    "CoachFailure", "CoachPool", "CoachResult", "COACHES", "EndpointConfig", "HttpCoach",
    "LLMCoach", "RetryConfig", "RuleCoach", "Unparsable", "Verdict", "build_coach",
    "parse_attribution", "parse_verdict",
]
