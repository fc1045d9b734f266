"""One LLM judge behind an OpenAI-compatible chat endpoint (DESIGN §8, MAPPA §2.2).

`HttpCoach.ask(rendered, parse)` is the whole life of one question: the reply cache, then
calls through `openai.AsyncOpenAI` (the SDK's own retries are off so every retry is ours and
counted) under a concurrency bound, two token buckets (requests/s, tokens/min), a per-call
timeout and a circuit breaker; retries with exponential backoff and jitter on 429, 5xx,
timeouts and refused connections; one re-ask, with the original context, when the reply does
not parse; then `CoachFailure` with a reason. Nothing here ever returns a default score.
`HttpCoach.chat(messages)` is the same path without cache or parser, for the advisor
(actors/coach/advisor.py): its calls share the endpoint's limits and breaker with the scores.

The API key is read from the environment variable named in config when the client is first
built (inside the coach actor) and is never logged. Asyncio objects are built lazily too, so
an unused `HttpCoach` pickles into the actor that will run it.
"""
from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections import Counter, deque
from typing import Any, Callable, TypeVar

import numpy as np
import openai

from actors.coach.cache import ReplyCache, prompt_key
from actors.coach.config import BreakerConfig, EndpointConfig, RetryConfig
from actors.coach.guards import BreakerTimeout, CircuitBreaker, TokenBucket, backoff_delay
from actors.coach.parse import Unparsable
from actors.coach.prompts import Rendered

log = logging.getLogger(__name__)
T = TypeVar("T")


class CoachFailure(Exception):
    """No score could be obtained; `reason` becomes the row's failed_reason."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class _Retryable(Exception):
    """An attempt failed in a way worth retrying; `kind` names it for metrics and reasons."""

    def __init__(self, kind: str, retry_after_s: float | None = None) -> None:
        super().__init__(kind)
        self.kind = kind
        self.retry_after_s = retry_after_s


# failure reason of a request whose attempts all failed the same way
_EXHAUSTED = {"rate_limited": "coach_rate_limited", "server_error": "coach_server_error",
              "timeout": "coach_timeout", "unreachable": "coach_unreachable"}


def _retry_after(exc: openai.APIStatusError) -> float | None:
    value = exc.response.headers.get("retry-after") if exc.response is not None else None
    try:
        return float(value) if value is not None else None
    except ValueError:  # an HTTP date instead of seconds: use our own backoff
        return None


class HttpCoach:
    """One endpoint; see the module docstring. `stats()` gives its per-judge metrics."""

    def __init__(self, endpoint: EndpointConfig, retry: RetryConfig, breaker: BreakerConfig,
                 cache: ReplyCache | None, seed: int = 0) -> None:
        self.endpoint = endpoint
        self.name = endpoint.label()
        self.retry = retry
        self.breaker_cfg = breaker
        self.cache = cache
        self._rng = random.Random(seed)
        self._client: openai.AsyncOpenAI | None = None
        self._slots: asyncio.Semaphore | None = None
        self._in_flight: dict[str, asyncio.Future[str]] = {}  # prompt key -> reply being asked
        # Calls are paced (a burst of one): any window of T seconds holds at most
        # 1 + requests_per_s·T calls. Tokens may burst up to ten seconds' worth, since one
        # call can need more than a second's budget: a window holds ≤ (10 + T)·tokens/s.
        self._requests = (TokenBucket(endpoint.requests_per_s, 1.0)
                          if endpoint.requests_per_s else None)
        self._tokens = (TokenBucket(endpoint.tokens_per_min / 60.0, endpoint.tokens_per_min / 6)
                        if endpoint.tokens_per_min else None)
        self.breaker = CircuitBreaker(breaker.failure_threshold, breaker.open_s,
                                      breaker.max_open_s)
        self.calls = self.replies = self.retries = self.reasks = self.cache_hits = 0
        self.tokens_used = 0
        self.errors: Counter[str] = Counter()  # attempt errors by kind
        self.failures: Counter[str] = Counter()  # questions given up, by reason
        self.retry_waits: deque[float] = deque(maxlen=4096)  # each backoff wait, seconds
        self.call_starts: deque[float] = deque(maxlen=4096)  # time.monotonic of each call
        self._latencies: deque[float] = deque(maxlen=4096)  # seconds per successful call

    def __getstate__(self) -> dict:
        if self._client is not None:
            raise RuntimeError("an HttpCoach in use cannot be copied to another process")
        return self.__dict__.copy()

    def _ensure(self) -> None:
        if self._client is None:
            key = os.environ[self.endpoint.api_key_env] if self.endpoint.api_key_env else "none"
            self._client = openai.AsyncOpenAI(base_url=self.endpoint.base_url, api_key=key,
                                              max_retries=0, timeout=self.endpoint.timeout_s)
            self._slots = asyncio.Semaphore(self.endpoint.max_concurrency)

    async def ask(self, rendered: Rendered, parse: Callable[[str], T], reminder: str) -> T:
        """Answer to one question, parsed; raises CoachFailure with a reason."""
        key = prompt_key(self.endpoint.base_url, self.endpoint.model, self.endpoint.temperature,
                         self.endpoint.max_tokens, self.endpoint.extra_body, rendered.messages)
        cached = self.cache.get(key) if self.cache is not None else None
        if cached is not None:
            self.cache_hits += 1
            return parse(cached)  # only replies that parsed are cached
        if self.cache is not None and key in self._in_flight:
            self.cache_hits += 1  # the same prompt is being asked right now: share its reply
            return parse(await asyncio.shield(self._in_flight[key]))
        if self.cache is None:
            return parse(await self._ask(rendered, parse, reminder))
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._in_flight[key] = future
        try:
            reply = await self._ask(rendered, parse, reminder)
        except asyncio.CancelledError:
            future.cancel()  # sharers see the cancellation (the pool is shutting down)
            raise
        except Exception as exc:
            future.set_exception(exc)  # sharers fail with the same reason
            future.exception()  # retrieved: no "never retrieved" warning without sharers
            raise
        finally:
            del self._in_flight[key]
        future.set_result(reply)
        self.cache.put(key, reply)
        return parse(reply)

    async def _ask(self, rendered: Rendered, parse: Callable[[str], T], reminder: str) -> str:
        """The reply text that parsed, after at most one re-ask; raises CoachFailure."""
        messages = rendered.as_openai()
        reply = await self._call(messages)
        try:
            parse(reply)
        except Unparsable as first:
            # MAPPA's loop falls back to 5.0 here; we ask once more with the same context
            self.reasks += 1
            log.info("coach %s: unparsable reply (%s); asking again", self.name, first)
            messages = messages + [{"role": "assistant", "content": reply},
                                   {"role": "user", "content": reminder.format(problem=first)}]
            reply = await self._call(messages)
            try:
                parse(reply)
            except Unparsable as second:
                self.failures["coach_unparsable"] += 1
                raise CoachFailure("coach_unparsable", str(second)) from None
        return reply

    async def chat(self, messages: list[dict[str, str]], *, max_tokens: int | None = None,
                   temperature: float | None = None, extra_body: dict[str, Any] | None = None,
                   give_up_after_s: float | None = None) -> str:
        """One reply to `messages` as is: no cache, no parser; raises CoachFailure.

        `max_tokens`, `temperature` and `extra_body` replace the endpoint's for this call
        (None keeps the endpoint's); `give_up_after_s` replaces `breaker.give_up_after_s`
        (how long retries and breaker pauses may take).
        """
        return await self._call(messages, max_tokens=max_tokens, temperature=temperature,
                                extra_body=extra_body, give_up_after_s=give_up_after_s)

    async def _call(self, messages: list[dict[str, str]], *, max_tokens: int | None = None,
                    temperature: float | None = None, extra_body: dict[str, Any] | None = None,
                    give_up_after_s: float | None = None) -> str:
        """One reply text, retrying what is worth retrying; see the module docstring."""
        self._ensure()
        sampling = (self.endpoint.max_tokens if max_tokens is None else max_tokens,
                    self.endpoint.temperature if temperature is None else temperature,
                    self.endpoint.extra_body if extra_body is None else extra_body)
        deadline = time.monotonic() + (self.breaker_cfg.give_up_after_s
                                       if give_up_after_s is None else give_up_after_s)
        attempt = 0
        while True:
            try:
                probe = await self.breaker.acquire(deadline)
            except BreakerTimeout as exc:
                self.failures["coach_unavailable"] += 1
                raise CoachFailure("coach_unavailable", str(exc)) from None
            try:
                return await self._attempt(messages, probe, *sampling)
            except _Retryable as exc:
                self.errors[exc.kind] += 1
                # An outage (breaker open) pauses the request instead of using its budget:
                # the attempts count only failures of a coach the breaker considers healthy.
                attempt = 0 if self.breaker.state != CircuitBreaker.CLOSED else attempt + 1
                if attempt >= self.retry.max_attempts:
                    reason = _EXHAUSTED[exc.kind]
                    self.failures[reason] += 1
                    raise CoachFailure(reason, f"{attempt} attempts") from None
                if time.monotonic() >= deadline:
                    self.failures["coach_unavailable"] += 1
                    raise CoachFailure("coach_unavailable", "deadline passed") from None
                wait = backoff_delay(max(attempt, 1), self.retry.backoff_base_s,
                                     self.retry.backoff_max_s, self.retry.jitter,
                                     exc.retry_after_s, self._rng)
                self.retries += 1
                self.retry_waits.append(wait)
                log.info("coach %s: %s, retry in %.2fs (attempt %d)", self.name, exc.kind, wait,
                         attempt)
                await asyncio.sleep(wait)

    async def _attempt(self, messages: list[dict[str, str]], probe: bool, max_tokens: int,
                       temperature: float, extra_body: dict[str, Any]) -> str:
        assert self._client is not None and self._slots is not None
        estimate = sum(len(m["content"]) for m in messages) / 4 + max_tokens
        settled = False
        try:
            async with self._slots:
                if self._requests is not None:
                    await self._requests.acquire(1)
                if self._tokens is not None:
                    await self._tokens.acquire(estimate)
                start = time.monotonic()
                self.calls += 1
                self.call_starts.append(start)
                try:
                    async with asyncio.timeout(self.endpoint.timeout_s):
                        response = await self._client.chat.completions.create(
                            model=self.endpoint.model, messages=messages,
                            max_tokens=max_tokens, temperature=temperature,
                            extra_body=extra_body or None)
                except (TimeoutError, openai.APITimeoutError):
                    raise _Retryable("timeout") from None
                except openai.APIConnectionError:
                    raise _Retryable("unreachable") from None
                except openai.RateLimitError as exc:
                    raise _Retryable("rate_limited", _retry_after(exc)) from None
                except openai.InternalServerError as exc:
                    raise _Retryable("server_error", _retry_after(exc)) from None
                except openai.APIStatusError as exc:  # 4xx other than 429: the server is up
                    settled = True
                    self.breaker.success(probe)
                    reason = f"coach_http_{exc.status_code}"
                    self.failures[reason] += 1
                    raise CoachFailure(reason, exc.message) from None
            settled = True
            self.breaker.success(probe)
        except _Retryable:
            settled = True
            self.breaker.failure(probe)
            raise
        finally:
            if not settled:  # cancelled (or an unexpected error): the probe answered nothing
                self.breaker.abandon(probe)
        self._latencies.append(time.monotonic() - start)
        self.replies += 1
        usage = response.usage
        if usage is not None:
            self.tokens_used += usage.total_tokens
            if self._tokens is not None:
                self._tokens.charge(usage.total_tokens - estimate)
        if not response.choices or response.choices[0].message.content is None:
            return ""  # an empty reply goes to the parser (re-ask), not silently scored
        return response.choices[0].message.content

    def stats(self) -> dict[str, float]:
        lat = np.asarray(self._latencies) if self._latencies else np.zeros(1)
        out = {"calls": self.calls, "replies": self.replies, "retries": self.retries,
               "reasks": self.reasks, "cache_hits": self.cache_hits,
               "tokens": self.tokens_used, "breaker_opened": self.breaker.opened,
               "breaker_open": float(self.breaker.state != CircuitBreaker.CLOSED),
               "call_latency_p50_s": float(np.percentile(lat, 50)),
               "call_latency_p95_s": float(np.percentile(lat, 95)),
               "call_latency_max_s": float(lat.max()),
               "rate_wait_s": sum(b.waited_s for b in (self._requests, self._tokens) if b)}
        out.update({f"errors/{k}": v for k, v in self.errors.items()})
        out.update({f"failed/{k}": v for k, v in self.failures.items()})
        return {k: float(v) for k, v in out.items()}

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
