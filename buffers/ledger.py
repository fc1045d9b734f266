"""The round ledger: every generated row is counted here, independently of the buffers.

A rollout round (one task launch: a tree-sampled episode or G joint episodes) moves through
three states, each reported by its rollout actor:

    admitted ──(round played)──► generated ──(rows in the buffers, coach asked)──► closed
        └──(round failed / cancelled)──► abandoned: its rows are generated AND lost

`generated` is reported *before* a single row is shipped, so the ledger's count does not
depend on what reached a buffer. The run's accounting identity (runtime/controller.py) is

    ledger generated == buffers trained + buffers dropped + ledger lost

and nothing in it is derived from another of its terms: a row dropped on its way to a buffer
makes it fail. Rounds left open by a dead actor are reconciled by the controller against
what each buffer received from every episode (`ReplayBuffer.received_rows`).

A plain class held by the version clock's actor (buffers/clock.py), so admission and the
ledger entry of a round are created in one call.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

# scaled_down: a round still running when a removed rollout actor's drain time ran out
LOSS_REASONS = ("episode_error", "run_stopped", "actor_crashed", "scaled_down")


@dataclass
class RoundEntry:
    """An open round: who plays it, the units it was admitted for, and once generated, its rows."""

    owner: str  # the rollout actor playing it
    units: dict[str, int]  # model_id -> readiness units admitted (DESIGN §5.1)
    # episode_id -> model_id -> rows; None until the round reports `generated`
    episodes: dict[str, dict[str, int]] | None = None
    opened_at: float = field(default_factory=lambda: time.monotonic())  # admission time

    @property
    def rows(self) -> int:
        return sum(sum(m.values()) for m in (self.episodes or {}).values())


@dataclass
class LedgerStats:
    """What the ledger counted; `generated` is the left side of the accounting identity."""

    generated: int  # rows of every round that reported them (or was abandoned with them)
    lost: dict[str, int] = field(default_factory=dict)  # reason -> rows that never reached a buffer
    open_rounds: int = 0  # admitted rounds not closed yet
    closed_rounds: int = 0
    abandoned_rounds: int = 0


class RoundLedger:
    """Open rounds by id, plus counters of generated and lost rows."""

    def __init__(self) -> None:
        self._open: dict[str, RoundEntry] = {}
        self._generated = 0
        self._lost: Counter[str] = Counter({reason: 0 for reason in LOSS_REASONS})
        self._closed = self._abandoned = 0

    def open(self, round_id: str, owner: str, units: dict[str, int]) -> None:
        if round_id in self._open:
            raise ValueError(f"round {round_id} was admitted twice")
        self._open[round_id] = RoundEntry(owner, dict(units))

    def generated(self, round_id: str, episodes: dict[str, dict[str, int]]) -> None:
        """The round's rows exist (episode -> model -> rows); they are counted from now on."""
        entry = self.entry(round_id)
        if entry.episodes is not None:
            raise ValueError(f"round {round_id} reported its rows twice")
        entry.episodes = {e: dict(m) for e, m in episodes.items()}
        self._generated += entry.rows

    def close(self, round_id: str) -> RoundEntry:
        """Every row of the round reached its buffer: the round leaves the ledger."""
        entry = self.entry(round_id)
        if entry.episodes is None:
            raise ValueError(f"round {round_id} closed before reporting its rows")
        self._closed += 1
        return self._open.pop(round_id)

    def abandon(self, round_id: str, rows: int, reason: str) -> RoundEntry:
        """The round failed before shipping anything: its `rows` are generated and lost."""
        entry = self.entry(round_id)
        if entry.episodes is not None:
            raise ValueError(f"round {round_id} already reported its rows; some may be in a "
                             "buffer, so the controller reconciles it (take_owner)")
        self.count_lost(rows, reason)
        self._generated += rows
        self._abandoned += 1
        return self._open.pop(round_id)

    def count_lost(self, rows: int, reason: str) -> None:
        if reason not in LOSS_REASONS:
            raise ValueError(f"loss reason {reason!r} is not one of {LOSS_REASONS}")
        if rows < 0:
            raise ValueError(f"lost rows={rows} must be >= 0")
        self._lost[reason] += rows

    def take(self, owner: str | None = None) -> dict[str, RoundEntry]:
        """Remove and return the open rounds of `owner` (every open round when None)."""
        taken = {r: e for r, e in self._open.items() if owner is None or e.owner == owner}
        for round_id in taken:
            del self._open[round_id]
        return taken

    def restore_counts(self, stats: dict) -> None:
        """Carry a checkpointed run's counters on (its open rounds died with it: not restored)."""
        if self._open:
            raise ValueError(f"restore_counts with {len(self._open)} open rounds: restore first")
        self._generated = int(stats["generated"])
        self._lost = Counter({reason: 0 for reason in LOSS_REASONS})
        self._lost.update({reason: int(n) for reason, n in stats["lost"].items()})
        self._closed = int(stats["closed_rounds"])
        self._abandoned = int(stats["abandoned_rounds"])

    def open_entries(self) -> list[RoundEntry]:
        return list(self._open.values())

    def stats(self) -> LedgerStats:
        return LedgerStats(self._generated, dict(self._lost), len(self._open), self._closed,
                           self._abandoned)

    def entry(self, round_id: str) -> RoundEntry:
        entry = self._open.get(round_id)
        if entry is None:
            raise KeyError(f"round {round_id} is not open in the ledger")
        return entry
