"""Staleness admission (DESIGN §5.1): how many units rollouts may start ahead of the learners.

For every model m the clock keeps the learner version `v_m` and the number of units already
issued to rollouts. An episode (or round) may start only while, for every model it will
produce units for, `issued_units_m < (v_m + max_staleness_m + 1) * batch_units_m` — AReaL's
rule: no more data is in flight than the learner can consume before that data would exceed
the staleness bound. Units that are dropped instead of trained give their budget back.

The clock is the one source of truth for η (`max_staleness`) per model: rollouts are admitted
against it and learners read it before every sample, so a live change (control bus, DESIGN §9)
takes effect at the next admission and the next sampling. It also holds the run's pause.

A plain class: `runtime/` wraps it as an actor shared by every rollout actor. Rollout slots
await `wait_admit`, which wakes when something that can open admission changes (a new version,
released units, a larger η, a resume) instead of polling.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import asdict, dataclass

from buffers.ledger import LedgerStats, RoundLedger

ROUND_TIMES_KEPT = 32  # recent rounds whose admission -> generated time `round_seconds` averages


@dataclass
class ModelClock:
    """Admission state of one model."""

    batch_units: int  # units one learner step consumes
    max_staleness: int  # eta: how many versions a row may lag at training time
    version: int = 0  # optimizer steps the learner has applied
    issued_units: int = 0  # units admitted so far, net of released ones

    @property
    def limit(self) -> int:
        """Units that may have been issued in total at the current version."""
        return (self.version + self.max_staleness + 1) * self.batch_units


class VersionClock:
    """Per-model admission counters for the staleness bound, and the round ledger.

    Every admitted round is an entry of the ledger (buffers/ledger.py) until it closes, so a
    dead rollout actor's rounds are found by owner: those that never produced rows give their
    units back here; those that did are reconciled against the buffers by the controller
    (their units come back through the buffers' dropped units, never twice).
    """

    def __init__(self, models: dict[str, tuple[int, int]]) -> None:
        """Args:
            models: model_id -> (batch_units, max_staleness).
        """
        self._models: dict[str, ModelClock] = {}
        self.ledger = RoundLedger()
        self._released_surplus: dict[str, int] = {}  # model_id -> units rounds did not produce
        self.paused = False  # a paused run admits nothing; rounds in flight finish
        self.task_cursor = 0  # next index of the train task stream all rollout actors share
        # owners whose books are closed: an admission they still wait for (the caller died or
        # was cancelled mid-wait) is refused, so no round opens after its owner was settled
        self._retired: set[str] = set()
        self._closed = False  # every owner's books closed (end of run): nothing is admitted
        self._changed: asyncio.Event | None = None  # created by the first waiter, in its loop
        # model_id -> seconds from admission to `generated` of recent rounds producing its units
        self._round_s = {m: deque(maxlen=ROUND_TIMES_KEPT) for m in models}
        for model_id, (batch_units, max_staleness) in models.items():
            if batch_units < 1:
                raise ValueError(f"model {model_id!r}: batch_units={batch_units} must be >= 1")
            _check_eta(model_id, max_staleness)
            self._models[model_id] = ModelClock(batch_units, max_staleness)

    def try_admit(self, units: dict[str, int], owner: str = "", round_id: str | None = None) -> bool:
        """Admit a round that will produce `units[m]` units for each model m.

        All models are checked before any counter moves, so a refusal changes nothing. With a
        `round_id` the round opens in the ledger under `owner` (a rollout actor) and must end
        with `generated` + `shipped`, or `abandon`.
        """
        clocks = [(self._get(m), n) for m, n in units.items()]
        for model_id, n in units.items():
            if n < 0:
                raise ValueError(f"model {model_id!r}: units={n} must be >= 0")
        if self.paused or self._closed or owner in self._retired:
            return False
        if any(clock.issued_units >= clock.limit for clock, _ in clocks):
            return False
        if round_id is not None:
            self.ledger.open(round_id, owner, units)
        for clock, n in clocks:
            clock.issued_units += n
        return True

    async def wait_admit(self, units: dict[str, int], owner: str = "",
                         round_id: str | None = None, timeout_s: float = 1.0) -> bool:
        """`try_admit`, waiting up to `timeout_s` for a change that can open admission.

        Returns False on timeout, so a caller can look at its own state (stop, drain) between
        waits; the wait itself costs no calls.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self.try_admit(units, owner, round_id):
            remaining = deadline - loop.time()
            if remaining <= 0 or self._closed or owner in self._retired:
                return False
            if self._changed is None:
                self._changed = asyncio.Event()
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                return False
        return True

    def next_task_index(self) -> int:
        """The next task of the shared train stream (actors/tasks.py `TaskSource.task_at`)."""
        index = self.task_cursor
        self.task_cursor += 1
        return index

    def _wake(self) -> None:
        """Admission may have opened: wake every waiter (each re-checks; losers wait again)."""
        if self._changed is not None:
            self._changed.set()
            self._changed = None  # later waiters get a fresh event

    def pause(self) -> None:
        """Admit nothing until `resume`; rounds already admitted finish."""
        self.paused = True

    def resume(self) -> None:
        self.paused = False
        self._wake()

    def generated(self, round_id: str, episodes: dict[str, dict[str, int]],
                  units: dict[str, int] | None = None) -> None:
        """The round's rows exist (episode_id -> model_id -> rows), before any is shipped.

        `units` (model_id -> readiness units the round actually produced) gives back the
        surplus of what the round was admitted for: an episode that stopped early, or a
        branch not taken, leaves budget no learner step will ever consume (DESIGN §14).
        """
        entry = self.ledger.entry(round_id)
        played_s = time.monotonic() - entry.opened_at
        for model_id, admitted in entry.units.items():
            if admitted:
                self._round_s[model_id].append(played_s)
        if units is not None:
            over = {m: (n, entry.units.get(m, 0)) for m, n in units.items()
                    if n > entry.units.get(m, 0)}
            if over:
                raise ValueError(f"round {round_id} produced more units than it was admitted for "
                                 f"(model: (produced, admitted)) {over}: the workflow's "
                                 "groups_per_round must be an upper bound")
        self.ledger.generated(round_id, episodes)
        if units is not None:
            for model_id, admitted in entry.units.items():
                surplus = admitted - units.get(model_id, 0)
                if surplus:
                    self.release(model_id, surplus)
                    self._released_surplus[model_id] = (self._released_surplus.get(model_id, 0)
                                                        + surplus)
            entry.units = {m: units.get(m, 0) for m in entry.units}

    def shipped(self, round_id: str) -> None:
        """Every row of the round is in its buffer and the coach has its requests."""
        self.ledger.close(round_id)

    def abandon(self, round_id: str, rows: int, reason: str) -> None:
        """The round failed before shipping: count its rows lost and give its units back."""
        entry = self.ledger.abandon(round_id, rows, reason)
        for model_id, n in entry.units.items():
            self.release(model_id, n)

    def take_owner(self, owner: str | None) -> tuple[dict[str, int], dict]:
        """Close the books of a dead owner (every owner when None, at the end of a run).

        Returns:
            (units given back for rounds that produced no rows yet, model_id -> units;
             round_id -> RoundEntry of rounds with rows, for the controller to reconcile)
        """
        if owner is None:
            self._closed = True
        else:
            self._retired.add(owner)
        self._wake()  # its waiting admissions return refused now
        freed: dict[str, int] = {}
        with_rows = {}
        for round_id, entry in self.ledger.take(owner).items():
            if entry.episodes is not None:
                with_rows[round_id] = entry
                continue
            for model_id, n in entry.units.items():
                self.release(model_id, n)
                freed[model_id] = freed.get(model_id, 0) + n
        return freed, with_rows

    def count_lost(self, rows: int, reason: str) -> None:
        """Rows the controller found missing from every buffer when it reconciled a round."""
        self.ledger.count_lost(rows, reason)

    def ledger_stats(self) -> LedgerStats:
        return self.ledger.stats()

    def set_version(self, model_id: str, version: int) -> None:
        """Record that the learner of `model_id` now serves `version`."""
        clock = self._get(model_id)
        if version < clock.version:
            raise ValueError(f"model {model_id!r}: version {version} < current {clock.version}; versions only grow")
        clock.version = version
        self._wake()

    def release(self, model_id: str, units: int) -> None:
        """Give back the budget of `units` dropped units (they will never be trained)."""
        clock = self._get(model_id)
        if units < 0 or units > clock.issued_units:
            raise ValueError(f"model {model_id!r}: cannot release {units} units, {clock.issued_units} issued")
        clock.issued_units -= units
        self._wake()

    def set_max_staleness(self, model_id: str, eta: int) -> None:
        """Change eta live; admission follows the new bound from the next call."""
        _check_eta(model_id, eta)
        self._get(model_id).max_staleness = eta
        self._wake()

    def rewind(self, model_id: str, version: int, held_units: int) -> None:
        """A learner restarted from its checkpoint at `version` (the steps after it died with
        its process). Issued units are re-derived: the `version x batch_units` consumed, the
        `held_units` its recovered buffer holds, and the units of rounds still open (a round
        shipping right now may be counted in both: admission errs on the tight side, and no
        later release can exceed what is issued). The only way a version goes down."""
        clock = self._get(model_id)
        if version > clock.version:
            raise ValueError(f"model {model_id!r}: rewind to v{version} > current "
                             f"v{clock.version}; a rewind only goes back")
        in_flight = sum(entry.units.get(model_id, 0) for entry in self.ledger.open_entries())
        clock.version = version
        clock.issued_units = version * clock.batch_units + held_units + in_flight
        self._wake()

    def round_seconds(self, model_id: str) -> float | None:
        """Mean seconds from admission to `generated` of the last rounds that produced units
        of `model_id` (generation, tools, inline rewards); None before the first one."""
        self._get(model_id)  # an unknown model is a KeyError naming the known ones
        times = self._round_s[model_id]
        return sum(times) / len(times) if times else None

    def max_staleness(self, model_id: str) -> int:
        """η of `model_id` now: learners sample under it (the only copy of the live value)."""
        return self._get(model_id).max_staleness

    def state(self) -> dict:
        """What a checkpoint keeps: per model version, η and issued units; the ledger's counts."""
        return {"models": {m: asdict(c) for m, c in self._models.items()},
                "ledger": asdict(self.ledger.stats()), "paused": self.paused,
                "task_cursor": self.task_cursor,
                "released_surplus": dict(self._released_surplus)}

    def restore(self, versions: dict[str, int], etas: dict[str, int],
                issued_units: dict[str, int], ledger: dict, task_cursor: int) -> None:
        """Resume (runtime/resume.py): versions from the learners' checkpoints, η as it was,
        issued units re-derived from what the recovered buffers hold, ledger counters carried
        on so the run's row identity spans the resume. No round is open after a restore."""
        for model_id, clock in self._models.items():
            clock.version = versions[model_id]
            _check_eta(model_id, etas[model_id])
            clock.max_staleness = etas[model_id]
            clock.issued_units = issued_units[model_id]
        self.ledger.restore_counts(ledger)
        self.task_cursor = task_cursor
        self._wake()

    def snapshot(self) -> dict:
        """Plain data for metrics and status: model_id -> clock fields plus the current limit."""
        return {m: {**asdict(c), "limit": c.limit,
                    "released_surplus": self._released_surplus.get(m, 0)}
                for m, c in self._models.items()}

    def _get(self, model_id: str) -> ModelClock:
        clock = self._models.get(model_id)
        if clock is None:
            raise KeyError(f"unknown model {model_id!r}; known models: {sorted(self._models)}")
        return clock


def _check_eta(model_id: str, eta: int) -> None:
    if eta < 0:
        raise ValueError(f"model {model_id!r}: max_staleness={eta} must be >= 0 (0 = on-policy)")
