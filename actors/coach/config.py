"""The coach's structured config (DESIGN §8): which coach, its endpoints, limits and prompts.

`CoachConfig.kind` picks the scorer: "rule" (the workflow's rules, offline) or "http" (one
or more OpenAI-compatible chat endpoints, combined as an ensemble). `CoachConfig.advisor`
opens the same pool to a non-trained advisor model (`Episode.consult`, DESIGN §14). Every
check names the field, the value and the fix, as `runtime/config.py` does; the API key itself
never appears here, only the NAME of the environment variable holding it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KINDS = ("rule", "http")
COMBINE = ("mean", "median")
PROMPTS_DIR = Path(__file__).resolve().parents[2] / "configs" / "coach_prompts"


def prompt_path(name: str) -> Path:
    """A template name (`configs/coach_prompts/<name>.txt`) or a path ending in `.txt`."""
    return Path(name) if name.endswith(".txt") else PROMPTS_DIR / f"{name}.txt"


def available_prompts() -> list[str]:
    return sorted(p.stem for p in PROMPTS_DIR.glob("*.txt"))


@dataclass
class EndpointConfig:
    """One OpenAI-compatible chat endpoint (a provider, or a vLLM/SGLang judge server)."""

    name: str = ""  # label in metrics (coach/member/<name>/…); "" uses the model name
    base_url: str = ""  # e.g. http://127.0.0.1:30000/v1 for a local SGLang judge
    model: str = ""  # model name sent in each request
    api_key_env: str = ""  # NAME of the env var holding the API key; "" sends a placeholder
    timeout_s: float = 60.0  # per call, from the first byte sent to the whole reply
    max_concurrency: int = 16  # calls in flight to this endpoint at once
    requests_per_s: float = 0.0  # token-bucket rate limit on calls (0: unlimited)
    tokens_per_min: float = 0.0  # token-bucket limit on prompt+reply tokens (0: unlimited)
    max_tokens: int = 512  # reply length cap of each call
    temperature: float = 0.0  # sampling temperature of the judge
    extra_body: dict[str, Any] = field(default_factory=dict)  # sent as is (e.g. SGLang regex)

    def label(self) -> str:
        return self.name or self.model

    def check(self, where: str) -> None:
        if not self.base_url:
            raise ValueError(f"{where}.base_url is empty: give the endpoint URL, e.g. "
                             "http://127.0.0.1:30000/v1")
        if not self.model:
            raise ValueError(f"{where}.model is empty: name the judge model the endpoint serves")
        if self.api_key_env and self.api_key_env not in os.environ:
            raise ValueError(f"{where}.api_key_env={self.api_key_env!r}: that environment variable "
                             "is not set; export it before starting the run (the key is read "
                             "from the environment, never from config)")
        if self.timeout_s <= 0:
            raise ValueError(f"{where}.timeout_s={self.timeout_s}: must be > 0 seconds")
        if self.max_concurrency < 1:
            raise ValueError(f"{where}.max_concurrency={self.max_concurrency}: must be >= 1")
        if self.requests_per_s < 0 or self.tokens_per_min < 0:
            raise ValueError(f"{where}.requests_per_s={self.requests_per_s} and tokens_per_min="
                             f"{self.tokens_per_min} must be >= 0 (0 disables the limit)")
        if self.max_tokens < 1:
            raise ValueError(f"{where}.max_tokens={self.max_tokens}: must be >= 1")


@dataclass
class RetryConfig:
    max_attempts: int = 4  # calls per request while the breaker is closed (1 = no retry)
    backoff_base_s: float = 0.5  # first retry waits about this long, doubling each time
    backoff_max_s: float = 30.0  # cap of one backoff wait (also caps a server's Retry-After)
    jitter: float = 0.5  # fraction of each wait drawn at random (0: none, 1: full jitter)

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"coach.retry.max_attempts={self.max_attempts}: must be >= 1")
        if self.backoff_base_s < 0 or self.backoff_max_s < self.backoff_base_s:
            raise ValueError(f"coach.retry.backoff_base_s={self.backoff_base_s} and backoff_max_s="
                             f"{self.backoff_max_s}: need 0 <= base <= max")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"coach.retry.jitter={self.jitter}: must be in [0, 1]")


@dataclass
class BreakerConfig:
    failure_threshold: int = 5  # consecutive failed calls that open the breaker
    open_s: float = 5.0  # calls pause this long before one probe is let through
    max_open_s: float = 60.0  # the pause doubles after each failed probe, up to this
    give_up_after_s: float = 1800.0  # a request still unscored after this is FAILED

    def __post_init__(self) -> None:
        if self.failure_threshold < 1:
            raise ValueError(f"coach.breaker.failure_threshold={self.failure_threshold}: >= 1")
        if self.open_s <= 0 or self.max_open_s < self.open_s:
            raise ValueError(f"coach.breaker.open_s={self.open_s} and max_open_s="
                             f"{self.max_open_s}: need 0 < open_s <= max_open_s")
        if self.give_up_after_s <= 0:
            raise ValueError(f"coach.breaker.give_up_after_s={self.give_up_after_s}: must be > 0")


@dataclass
class CacheConfig:
    enabled: bool = True  # reuse the reply to an identical rendered prompt
    capacity: int = 100_000  # replies kept in memory (least recently used leave first)
    persist: bool = False  # also append replies to <run dir>/coach_cache.jsonl and reload it

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"coach.cache.capacity={self.capacity}: must be >= 1")


@dataclass
class BackpropConfig:
    """MAPPA appendix F: a backward chain of coach calls attributes the outcome to actions."""

    enabled: bool = False  # combine f_t = alpha * p_t + beta * delta_t (needs kind=http)
    alpha: float = 1.0  # weight of the process score p_t in [0, 1]
    beta: float = 1.0  # weight of the outcome contribution delta_t in [-1, 1]
    prompt: str = "backprop"  # template of each backward step (configs/coach_prompts/)

    def __post_init__(self) -> None:
        if self.alpha < 0 or self.beta < 0:
            raise ValueError(f"coach.backprop.alpha={self.alpha} and beta={self.beta}: "
                             "must both be >= 0 (MAPPA eq. 6)")


@dataclass
class AdvisorConfig:
    """A non-trained model that episodes ask for advice (MAGRPO's external feedback, app. D).

    Its replies are observations of the episode, never rows: nothing it writes is trained.
    """

    enabled: bool = False  # episodes may call Episode.consult (else consult is an error)
    # the advisor's endpoints; [] = the coach's own judges (coach.kind=http), sharing their
    # concurrency, rate limits and breaker (one provider account, one budget)
    endpoints: list[EndpointConfig] = field(default_factory=list)
    max_tokens: int | None = None  # reply cap of each advice call; null = the endpoint's own
    temperature: float | None = None  # sampling temperature; null = the endpoint's own
    # sent instead of the endpoint's extra_body ({} drops a shared judge's score regex);
    # null = the endpoint's own
    extra_body: dict[str, Any] | None = None
    max_concurrency: int = 16  # consults in progress at once over all its endpoints (a
    # consult keeps its slot through retry waits); each endpoint's own bound applies too
    give_up_after_s: float = 120.0  # longest an episode waits for one advice (retries and
    # breaker pauses included) before consult raises AdvisorFailure and it goes on without

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"coach.advisor.max_tokens={self.max_tokens}: must be >= 1, or "
                             "null to use each endpoint's max_tokens")
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"coach.advisor.temperature={self.temperature}: must be >= 0, or "
                             "null to use each endpoint's temperature")
        if self.max_concurrency < 1:
            raise ValueError(f"coach.advisor.max_concurrency={self.max_concurrency}: must be >= 1")
        if self.give_up_after_s <= 0:
            raise ValueError(f"coach.advisor.give_up_after_s={self.give_up_after_s}: must be > 0 "
                             "seconds (an episode waits at most this for one advice)")

    def check(self, coach_kind: str) -> None:
        """Cross-field checks against the coach it shares a pool with."""
        if not self.enabled:
            return
        if not self.endpoints and coach_kind != "http":
            raise ValueError(f"coach.advisor.enabled=true but coach.advisor.endpoints is empty and "
                             f"coach.kind={coach_kind!r} has no endpoints to share: add a "
                             "{base_url, model} entry to coach.advisor.endpoints, or set "
                             "coach.kind=http")
        for i, endpoint in enumerate(self.endpoints):
            endpoint.check(f"coach.advisor.endpoints[{i}]")
        labels = [e.label() for e in self.endpoints]
        if len(set(labels)) != len(labels):
            raise ValueError(f"coach.advisor.endpoints have repeated names {labels}: give each a "
                             "distinct `name` (Episode.consult(endpoint=...) and metrics use it)")


@dataclass
class CoachConfig:
    kind: str = "rule"  # "rule": the workflow's rule score; "http": LLM judge endpoint(s)
    latency_s: float = 0.0  # seconds each RuleCoach call takes (simulates a remote judge)
    max_concurrency: int = 64  # requests (or backprop episodes) scored at once by the pool
    queue_capacity: int = 4096  # requests waiting at most; submit waits beyond it
    prompt: str = ""  # template under configs/coach_prompts ("" = the workflow's default)
    roles: dict[str, str] = field(default_factory=dict)  # agent -> role title in the prompt
    truth_agents: list[str] = field(default_factory=list)  # agents shown the ground truth
    # (and asked ANSWER_CORRECT when the template does); [] = every agent sees it
    endpoints: list[EndpointConfig] = field(default_factory=list)  # the judges (ensemble)
    combine: str = "mean"  # how an ensemble's scores combine: "mean" or "median"
    min_scores: int = 0  # judges that must score a row (0 = all of them)
    retry: RetryConfig = field(default_factory=RetryConfig)  # retries with backoff + jitter
    breaker: BreakerConfig = field(default_factory=BreakerConfig)  # pause during outages
    cache: CacheConfig = field(default_factory=CacheConfig)  # prompt-hash reply cache
    backprop: BackpropConfig = field(default_factory=BackpropConfig)  # MAPPA appendix F
    advisor: AdvisorConfig = field(default_factory=AdvisorConfig)  # Episode.consult's model

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"coach.kind={self.kind!r}: choose one of {list(KINDS)}")
        if self.latency_s < 0:
            raise ValueError(f"coach.latency_s={self.latency_s}: must be >= 0")
        if self.max_concurrency < 1 or self.queue_capacity < 1:
            raise ValueError("coach.max_concurrency and coach.queue_capacity must be >= 1, got "
                             f"{self.max_concurrency} and {self.queue_capacity}")
        if self.combine not in COMBINE:
            raise ValueError(f"coach.combine={self.combine!r}: choose one of {list(COMBINE)}")
        self.advisor.check(self.kind)  # also for kind=rule: an advisor may have its own endpoints
        if self.kind == "rule":
            if self.backprop.enabled:
                raise ValueError("coach.backprop.enabled=true needs coach.kind=http: the backward "
                                 "chain is a sequence of LLM calls")
            return
        if not self.endpoints:
            raise ValueError("coach.kind=http but coach.endpoints is empty: add at least one "
                             "{base_url, model} entry")
        for i, endpoint in enumerate(self.endpoints):
            endpoint.check(f"coach.endpoints[{i}]")
        labels = [e.label() for e in self.endpoints]
        if len(set(labels)) != len(labels):
            raise ValueError(f"coach.endpoints have repeated names {labels}: give each a distinct "
                             "`name` (metrics are kept per judge)")
        if not 0 <= self.min_scores <= len(self.endpoints):
            raise ValueError(f"coach.min_scores={self.min_scores}: must be in "
                             f"0..{len(self.endpoints)} (0 = every endpoint must score)")
        templates = (("prompt", self.prompt), ("backprop.prompt", self.backprop.prompt))
        for field_name, name in templates:
            if name and not prompt_path(name).is_file():
                raise ValueError(f"coach.{field_name}={name!r}: no such template; choose one of "
                                 f"{available_prompts()} or give a path to a .txt file")
