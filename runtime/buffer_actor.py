"""The replay buffer as a Ray actor: `ReplayBuffer` plus an awaitable sample for learners.

Durability (DESIGN §10): the buffer logs to `buffer/<model>/` (buffers/wal.py). Created over a
folder that already holds a log, it rebuilds itself from it: for a resumed run the controller
leaves `buffer/<model>.resume.json` naming the learner version the run continues from (samples
at or after it are rolled back, then the file is removed); without that file the log is a
live run's and the buffer is being restarted by Ray after a crash of its process, while the
learner lives on, so nothing is rolled back.

A learner used to poll `sample` every 20 ms; `sample_wait` instead waits inside the buffer's
process for a change that can complete a unit (rows arriving, rewards committed, an episode
sealed) and costs the learner one call per batch. It returns None after `timeout_s` so the
learner can re-read η from the clock and notice a stop.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path

from buffers.api import LearnerSample, ReadyBatch
from buffers.replay import ReplayBuffer

log = logging.getLogger("troupe")

NO_ROLLBACK = 2**62  # a version no sample reaches: recover every sample as trained


class BufferActor(ReplayBuffer):
    """`ReplayBuffer` whose arrivals wake waiting learners; runtime/ wraps it with ray.remote."""

    _changed: asyncio.Event | None = None  # created by the first waiter, inside the actor's loop

    def __init__(self, model_id: str, cfg, wal_dir: str | None = None) -> None:
        version = None
        resume_file = resume_file_of(wal_dir) if wal_dir else None
        if resume_file is not None and resume_file.exists():
            version = int(json.loads(resume_file.read_text())["version"])
        elif wal_dir and Path(wal_dir).is_dir() and any(Path(wal_dir).iterdir()):
            version = NO_ROLLBACK
            log.warning("buffer %s: restarted over its log in %s; recovering (no rollback)",
                        model_id, wal_dir)
        super().__init__(model_id, cfg, wal_dir, resume_from_version=version)
        if resume_file is not None and resume_file.exists():
            resume_file.unlink()  # rolled back once; a later restart must not roll back again
        self._incarnation = (os.getpid(), time.time())
        report = self.recovery_report()
        if report is not None:
            log.info("buffer %s recovered: %s", model_id, report)

    def incarnation(self) -> tuple[int, float]:
        """(process id, start time): it changes when Ray restarts the buffer."""
        return self._incarnation

    def recovery(self) -> dict | None:
        """The recovery report as plain data (None for a buffer built fresh)."""
        report = self.recovery_report()
        return None if report is None else dict(vars(report))

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

    async def sample_for_learner(self, num_units: int, current_version: int,
                                 max_staleness: int, timeout_s: float = 1.0) -> LearnerSample:
        """`sample_wait`, with the dropped units taken and the counters read in the same call."""
        batch = await self.sample_wait(num_units, current_version, max_staleness, timeout_s)
        return LearnerSample(batch, self.take_dropped_units(), self.stats())

    def _wake(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None


def leave_resume_file(wal_dir: str | Path, version: int) -> None:
    """Have the buffer over `wal_dir` roll back to `version` when it is next (re)created."""
    resume_file_of(wal_dir).write_text(json.dumps({"version": version}))


def resume_file_of(wal_dir: str | Path) -> Path:
    """`buffer/<model>.resume.json`, beside the model's log folder (not inside it)."""
    wal_dir = Path(wal_dir)
    return wal_dir.parent / f"{wal_dir.name}.resume.json"
