"""Flow control of one coach endpoint: token buckets, a circuit breaker, backoff delays.

Hand-written rather than taken from aiolimiter/tenacity (DESIGN §13): those are not in the
lock file, and the retry loop needs to tell the breaker about each attempt and to count each
wait, which is a few lines here. All three are asyncio-only (one event loop, no threads);
their asyncio primitives are created on first use so the owning coach pickles into its actor.
"""
from __future__ import annotations

import asyncio
import random
import time


class TokenBucket:
    """Refills `rate` tokens per second up to `capacity`; `acquire(n)` waits for n tokens.

    Waiters are served in arrival order (one lock), so a large request is not starved by
    small ones. `charge(n)` corrects an estimate after the fact and may leave a debt that
    later acquirers wait out (how tokens/min works when only the reply tells the real size).
    """

    def __init__(self, rate: float, capacity: float) -> None:
        if rate <= 0 or capacity <= 0:
            raise ValueError(f"TokenBucket needs rate > 0 and capacity > 0, got {rate}, {capacity}")
        self.rate = rate
        self.capacity = capacity
        self._tokens = capacity
        self._updated = time.monotonic()
        self._lock: asyncio.Lock | None = None
        self.waited_s = 0.0  # total time acquirers spent waiting (a metric)

    def _refill(self) -> None:
        now = time.monotonic()
        self._tokens = min(self.capacity, self._tokens + (now - self._updated) * self.rate)
        self._updated = now

    async def acquire(self, n: float = 1.0) -> None:
        n = min(n, self.capacity)  # a request larger than the bucket waits for a full bucket
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            while True:
                self._refill()
                if self._tokens >= n:
                    self._tokens -= n
                    return
                wait = (n - self._tokens) / self.rate
                self.waited_s += wait
                await asyncio.sleep(wait)

    def charge(self, n: float) -> None:
        self._refill()
        self._tokens -= n


class BreakerTimeout(Exception):
    """The breaker stayed open past the request's deadline."""


class CircuitBreaker:
    """Closed → (threshold consecutive failures) → open → (pause) → half-open → one probe.

    While open, `acquire` makes callers wait instead of failing them: an outage delays
    requests, it does not burn their retry budget. After the pause exactly one caller is let
    through as the probe; its success closes the breaker, its failure reopens it with twice
    the pause (up to `max_open_s`).
    """

    CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"

    def __init__(self, threshold: int, open_s: float, max_open_s: float) -> None:
        self.threshold = threshold
        self.base_open_s = open_s
        self.max_open_s = max_open_s
        self.state = self.CLOSED
        self.consecutive_failures = 0
        self._open_s = open_s
        self._reopen_at = 0.0
        self._changed: asyncio.Event | None = None
        self.opened = 0  # times the breaker opened (metrics)
        self.closed_again = 0  # times a probe closed it

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
        self._changed = asyncio.Event()

    async def acquire(self, deadline: float) -> bool:
        """Wait until a call may go out; True when this caller is the half-open probe.

        Raises BreakerTimeout when `deadline` (time.monotonic) passes first.
        """
        while True:
            now = time.monotonic()
            if self.state == self.CLOSED:
                return False
            if self.state == self.OPEN and now >= self._reopen_at:
                self.state = self.HALF_OPEN
                self._notify()
                return True
            if now >= deadline:
                raise BreakerTimeout(f"breaker {self.state} until past the request deadline")
            if self._changed is None:
                self._changed = asyncio.Event()
            until = self._reopen_at if self.state == self.OPEN else deadline
            wait = max(0.0, min(until, deadline) - now)
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=wait + 1e-3)
            except TimeoutError:
                pass  # the pause ended (or the deadline came): look at the state again

    def success(self, probe: bool) -> None:
        self.consecutive_failures = 0
        if probe or self.state != self.CLOSED:
            self.state = self.CLOSED
            self._open_s = self.base_open_s
            self.closed_again += 1
            self._notify()

    def failure(self, probe: bool) -> None:
        self.consecutive_failures += 1
        if probe:
            self._open(min(self._open_s * 2, self.max_open_s))
        elif self.state == self.CLOSED and self.consecutive_failures >= self.threshold:
            self._open(self._open_s)

    def abandon(self, probe: bool) -> None:
        """A probe ended without an answer either way (cancelled): let another probe go."""
        if probe and self.state == self.HALF_OPEN:
            self.state = self.OPEN
            self._reopen_at = time.monotonic()
            self._notify()

    def _open(self, pause: float) -> None:
        self.state = self.OPEN
        self._open_s = pause
        self._reopen_at = time.monotonic() + pause
        self.opened += 1
        self._notify()


def backoff_delay(attempt: int, base_s: float, max_s: float, jitter: float,
                  retry_after_s: float | None = None, rng: random.Random | None = None) -> float:
    """Wait before retry number `attempt` (1-based): base·2^(attempt−1), capped, jittered.

    With jitter j the wait is drawn uniformly from [(1−j)·d, d] (j = 1 is "full jitter").
    A server's Retry-After, when given, is a floor (still capped at `max_s`).
    """
    d = min(max_s, base_s * 2 ** (attempt - 1))
    d = d * (1 - jitter * (rng or random).random())
    if retry_after_s is not None:
        d = max(d, min(retry_after_s, max_s))
    return d
