"""Token bucket, circuit breaker and backoff: the flow control of one coach endpoint."""
import asyncio
import random
import time

import pytest

from actors.coach.guards import BreakerTimeout, CircuitBreaker, TokenBucket, backoff_delay


def test_token_bucket_holds_its_rate():
    async def main():
        bucket = TokenBucket(rate=20.0, capacity=1.0)
        start = time.monotonic()
        for _ in range(11):
            await bucket.acquire(1)
        return time.monotonic() - start

    took = asyncio.run(main())
    assert took >= 0.5 - 0.02  # 1 at once, then 10 more at 20/s


def test_token_bucket_debt_delays_the_next_caller():
    async def main():
        bucket = TokenBucket(rate=100.0, capacity=100.0)
        await bucket.acquire(100)
        bucket.charge(50)  # the reply was 50 tokens larger than estimated
        start = time.monotonic()
        await bucket.acquire(10)
        return time.monotonic() - start

    assert asyncio.run(main()) >= 0.6 - 0.02  # repay 50, then 10 more, at 100/s


def test_breaker_opens_pauses_probes_and_closes():
    async def main():
        breaker = CircuitBreaker(threshold=2, open_s=0.2, max_open_s=1.0)
        assert await breaker.acquire(time.monotonic() + 1) is False
        breaker.failure(False)
        assert breaker.state == "closed"
        breaker.failure(False)
        assert breaker.state == "open" and breaker.opened == 1
        start = time.monotonic()
        probe = await breaker.acquire(time.monotonic() + 5)
        waited = time.monotonic() - start
        assert probe is True and breaker.state == "half_open" and waited >= 0.19
        # while the probe is out, others wait; its failure doubles the pause
        breaker.failure(True)
        reopened = time.monotonic()
        assert breaker.state == "open" and breaker.opened == 2
        with pytest.raises(BreakerTimeout):
            await breaker.acquire(time.monotonic() + 0.1)
        probe = await breaker.acquire(time.monotonic() + 5)
        # the pause (0.4 s) counts from the reopening, however long the timeout above took
        assert probe and time.monotonic() - reopened >= 0.39
        waiter = asyncio.create_task(breaker.acquire(time.monotonic() + 5))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        breaker.success(True)
        assert await waiter is False and breaker.state == "closed"

    asyncio.run(main())


def test_cancelled_probe_lets_another_through():
    async def main():
        breaker = CircuitBreaker(threshold=1, open_s=0.05, max_open_s=1.0)
        breaker.failure(False)
        assert await breaker.acquire(time.monotonic() + 1) is True
        breaker.abandon(True)
        assert await breaker.acquire(time.monotonic() + 1) is True

    asyncio.run(main())


def test_backoff_doubles_caps_jitters_and_honours_retry_after():
    rng = random.Random(0)
    assert [backoff_delay(a, 0.5, 30, 0.0) for a in (1, 2, 3, 8)] == [0.5, 1.0, 2.0, 30.0]
    jittered = [backoff_delay(3, 0.5, 30, 0.5, rng=rng) for _ in range(200)]
    assert 1.0 <= min(jittered) < 1.2 and 1.8 < max(jittered) <= 2.0
    assert backoff_delay(1, 0.5, 30, 0.5, retry_after_s=4.0, rng=rng) == 4.0
    assert backoff_delay(1, 0.5, 3, 0.5, retry_after_s=100.0, rng=rng) == 3.0
