"""The replay buffer as a Ray actor: `ReplayBuffer` plus an awaitable sample for learners.

A learner used to poll `sample` every 20 ms; `sample_wait` instead waits inside the buffer's
process for a change that can complete a unit (rows arriving, rewards committed, an episode
sealed) and costs the learner one call per batch. It returns None after `timeout_s` so the
learner can re-read η from the clock and notice a stop.
"""
from __future__ import annotations

import asyncio

from buffers.api import ReadyBatch
from buffers.replay import ReplayBuffer


class BufferActor(ReplayBuffer):
    """`ReplayBuffer` whose arrivals wake waiting learners; runtime/ wraps it with ray.remote."""

    _changed: asyncio.Event | None = None  # created by the first waiter, inside the actor's loop

    def try_add(self, rows, origin: str | None = None) -> bool:
        accepted = super().try_add(rows, origin)
        if accepted:
            self._wake()
        return accepted

    def commit_rewards(self, commits) -> None:
        super().commit_rewards(commits)
        self._wake()

    def seal_episode(self, episode_id: str, num_rows: int) -> None:
        super().seal_episode(episode_id, num_rows)
        self._wake()

    async def sample_wait(self, num_units: int, current_version: int, max_staleness: int,
                          timeout_s: float = 1.0) -> ReadyBatch | None:
        """`sample`, waiting up to `timeout_s` for arrivals when no batch is ready yet.

        Unit timeouts are checked by `sample` itself, so a wait never outlives them by more
        than `timeout_s`.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            batch = self.sample(num_units, current_version, max_staleness)
            remaining = deadline - loop.time()
            if batch is not None or remaining <= 0:
                return batch
            if self._changed is None:
                self._changed = asyncio.Event()
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                return self.sample(num_units, current_version, max_staleness)

    def _wake(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None
