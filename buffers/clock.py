"""Staleness admission (DESIGN §5.1): how many units rollouts may start ahead of the learners.

For every model m the clock keeps the learner version `v_m` and the number of units already
issued to rollouts. An episode (or round) may start only while, for every model it will
produce units for, `issued_units_m < (v_m + max_staleness_m + 1) * batch_units_m` — AReaL's
rule: no more data is in flight than the learner can consume before that data would exceed
the staleness bound. Units that are dropped instead of trained give their budget back.

A plain class: `runtime/` wraps it as an actor shared by every rollout actor.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


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
    """Per-model admission counters for the staleness bound."""

    def __init__(self, models: dict[str, tuple[int, int]]) -> None:
        """Args:
            models: model_id -> (batch_units, max_staleness).
        """
        self._models: dict[str, ModelClock] = {}
        self._in_flight: dict[str, dict[str, int]] = {}  # owner -> model_id -> units
        for model_id, (batch_units, max_staleness) in models.items():
            if batch_units < 1:
                raise ValueError(f"model {model_id!r}: batch_units={batch_units} must be >= 1")
            _check_eta(model_id, max_staleness)
            self._models[model_id] = ModelClock(batch_units, max_staleness)

    def try_admit(self, units: dict[str, int], owner: str | None = None) -> bool:
        """Admit an episode/round that will produce `units[m]` units for each model m.

        All models are checked before any counter moves, so a refusal changes nothing.
        `owner` (a rollout actor) holds the units as in flight until it calls `shipped`; if
        the owner dies first, `release_owner` gives them back, so a crashed actor's rounds
        cannot eat the admission budget forever.
        """
        clocks = [(self._get(m), n) for m, n in units.items()]
        for model_id, n in units.items():
            if n < 0:
                raise ValueError(f"model {model_id!r}: units={n} must be >= 0")
        if any(clock.issued_units >= clock.limit for clock, _ in clocks):
            return False
        for clock, n in clocks:
            clock.issued_units += n
        if owner is not None:
            held = self._in_flight.setdefault(owner, {})
            for model_id, n in units.items():
                held[model_id] = held.get(model_id, 0) + n
        return True

    def shipped(self, units: dict[str, int], owner: str) -> None:
        """The owner's round reached the buffers (or was released): no longer in flight."""
        held = self._in_flight.get(owner, {})
        for model_id, n in units.items():
            if held.get(model_id, 0) < n:
                raise ValueError(f"owner {owner!r} ships {n} units of {model_id!r} but holds "
                                 f"{held.get(model_id, 0)}")
            held[model_id] -= n

    def abandon(self, units: dict[str, int], owner: str) -> None:
        """The owner's round was lost before reaching the buffers: free its budget."""
        self.shipped(units, owner)
        for model_id, n in units.items():
            self.release(model_id, n)

    def release_owner(self, owner: str) -> dict[str, int]:
        """Give back every unit a dead owner still held in flight; returns what was freed."""
        held = self._in_flight.pop(owner, {})
        for model_id, n in held.items():
            if n:
                self.release(model_id, n)
        return {m: n for m, n in held.items() if n}

    def set_version(self, model_id: str, version: int) -> None:
        """Record that the learner of `model_id` now serves `version`."""
        clock = self._get(model_id)
        if version < clock.version:
            raise ValueError(f"model {model_id!r}: version {version} < current {clock.version}; versions only grow")
        clock.version = version

    def release(self, model_id: str, units: int) -> None:
        """Give back the budget of `units` dropped units (they will never be trained)."""
        clock = self._get(model_id)
        if units < 0 or units > clock.issued_units:
            raise ValueError(f"model {model_id!r}: cannot release {units} units, {clock.issued_units} issued")
        clock.issued_units -= units

    def set_max_staleness(self, model_id: str, eta: int) -> None:
        """Change eta live; admission follows the new bound from the next call."""
        _check_eta(model_id, eta)
        self._get(model_id).max_staleness = eta

    def snapshot(self) -> dict:
        """Plain data for metrics and status: model_id -> clock fields plus the current limit."""
        return {m: {**asdict(c), "limit": c.limit} for m, c in self._models.items()}

    def _get(self, model_id: str) -> ModelClock:
        clock = self._models.get(model_id)
        if clock is None:
            raise KeyError(f"unknown model {model_id!r}; known models: {sorted(self._models)}")
        return clock


def _check_eta(model_id: str, eta: int) -> None:
    if eta < 0:
        raise ValueError(f"model {model_id!r}: max_staleness={eta} must be >= 0 (0 = on-policy)")
