"""The stall watchdog: a run that makes no learner step for `run.stall_timeout_s` stops, and
says where the rows got stuck.

The controller snapshots every part's counters whenever a learner steps (`Snapshot`); when no
step came for the timeout it snapshots again and `diagnose` compares the two. The stages are
checked in the order rows flow backwards from the learner, so the first stuck stage found is
the one closest to the learner that holds work:

1. learner   — a step has been running the whole window (a slow machine, a wrong dtype);
2. coach     — rows sit PENDING in a buffer waiting for scores;
3. dropped   — units complete but are dropped (stale, timeout, incomplete, failed);
4. engines   — rounds fail (engine unreachable, episode errors) or engines restart;
5. admission — the clock refuses rounds (issued units at the staleness limit);
6. rollouts  — nothing of the above: rollouts produce no rows at all.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Snapshot:
    """Counters of every part at one moment (plain data gathered by the controller)."""

    at: float  # wall time
    learners: dict[str, dict] = field(default_factory=dict)  # model -> {version, in_step_s}
    buffers: dict[str, dict] = field(default_factory=dict)  # model -> BufferStats as a dict
    clock: dict[str, dict] = field(default_factory=dict)  # model -> {issued_units, limit, ...}
    coach: dict[str, float] = field(default_factory=dict)  # CoachPool.stats()
    rollouts: list[dict] = field(default_factory=list)  # RolloutActor.stats() per actor
    engines: dict[str, dict] = field(default_factory=dict)  # engine name -> SGLangEngine.stats()

    def versions(self) -> dict[str, int]:
        return {m: int(s["version"]) for m, s in self.learners.items()}


def _sum(rows: list[dict], key: str) -> int:
    total = 0
    for row in rows:
        value = row.get(key, 0)
        total += sum(value.values()) if isinstance(value, dict) else value
    return total


def diagnose(before: Snapshot, now: Snapshot, batch_units: dict[str, int]) -> str:
    """One message naming the stuck stage first, then the figures behind it."""
    window = now.at - before.at
    stage = _stuck_stage(before, now, batch_units, window)
    figures = "; ".join(_figures(before, now))
    return f"no learner step for {window:.0f} s — stuck at {stage}. State: {figures}"


def _stuck_stage(before: Snapshot, now: Snapshot, batch_units: dict[str, int],
                 window: float) -> str:
    for model, s in now.learners.items():
        if s.get("in_step_s", 0.0) >= 0.9 * window:
            return (f"learner step: {model}'s step has run for {s['in_step_s']:.0f} s "
                    "(a slow machine or dtype? see the log's dtype line)")
    pending = {m: b["pending_rows"] for m, b in now.buffers.items() if b["pending_rows"]}
    if pending:
        return (f"rows pending on the coach: {pending} rows wait for scores (coach in flight "
                f"{now.coach.get('in_flight', 0):.0f}, queued {now.coach.get('queued', 0):.0f}, "
                f"failures {now.coach.get('failures', 0):.0f})")
    dropped = {m: sum(b["dropped"].values()) - sum(before.buffers[m]["dropped"].values())
               for m, b in now.buffers.items() if m in before.buffers}
    if any(dropped.values()):
        reasons = {m: {k: v for k, v in b["dropped"].items() if v} for m, b in now.buffers.items()}
        return f"dropped units: {dropped} rows dropped in the window (totals {reasons})"
    failed = _sum(now.rollouts, "rounds_failed") - _sum(before.rollouts, "rounds_failed")
    restarts = _sum(list(now.engines.values()), "restarts") - \
        _sum(list(before.engines.values()), "restarts")
    if failed or restarts:
        last = next((r["last_error"] for r in now.rollouts if r.get("last_error")), "")
        return (f"engine errors: {failed} rounds failed and {restarts} engine restarts in the "
                f"window (last error: {last or 'none'})")
    full = {m: f"{c['issued_units']}/{c['limit']}" for m, c in now.clock.items()
            if c["issued_units"] >= c["limit"]}
    if full:
        ready = {m: b["ready_units"] for m, b in now.buffers.items()}
        return (f"admission: issued/limit units {full} while buffers hold ready units {ready} "
                f"of {batch_units} needed per step (units lost without being released?)")
    rounds = _sum(now.rollouts, "rounds") - _sum(before.rollouts, "rounds")
    return f"rollouts: {rounds} rounds shipped in the window and no units ready"


def _figures(before: Snapshot, now: Snapshot) -> list[str]:
    out = [f"learners {now.learners}"]
    for m, b in now.buffers.items():
        out.append(f"buffer {m}: pending {b['pending_rows']}, ready units {b['ready_units']}, "
                   f"added {b['rows_added']}, trained {b['rows_trained']}")
    out.append(f"clock {now.clock}")
    out.append("coach " + ", ".join(f"{k} {now.coach.get(k, 0):.0f}"
                                    for k in ("requests", "scored", "in_flight", "queued",
                                              "failures")))
    out.append(f"rollouts rounds {_sum(now.rollouts, 'rounds')} "
               f"(+{_sum(now.rollouts, 'rounds') - _sum(before.rollouts, 'rounds')}), "
               f"failed {_sum(now.rollouts, 'rounds_failed')}")
    out.append(f"engines {now.engines}")
    return out
