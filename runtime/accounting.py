"""The run's row accounting: settling a dead owner's rounds, and the row identity.

Every generated row is counted by the round ledger before it is shipped (buffers/ledger.py);
the buffers count what they trained and dropped. `close_books` settles the open rounds of a
rollout actor that died or was removed; `row_accounting` checks the identity
`generated == trained + dropped + lost` at the end of a run.
"""
from __future__ import annotations

import logging

from runtime.supervise import SETUP_TIMEOUT_S, get_within

log = logging.getLogger("troupe")


def close_books(clock, buffers: dict, readiness: dict[str, str], owner: str | None,
                reason: str, timeout_s: float = SETUP_TIMEOUT_S) -> dict[str, int]:
    """Settle the open rounds of a dead owner (every owner when None) with the ledger.

    Rounds that made no rows yet give their units back at the clock. Rounds whose rows the
    ledger knows are compared with what every buffer received from each of their episodes:
    the missing rows are counted lost under `reason`; the received ones are dropped under it
    (their coach requests may never have left, so they could only time out), and those drops
    return their units through the buffer (`take_dropped_units`). Units of a model none of
    whose rows arrived are given back here. So no unit is released twice, and none leaks.

    Every call waits at most `timeout_s` (a buffer Ray is restarting first recovers its
    log), then raises `ActorHung` naming the actor and the call.

    Returns the units given back for rounds that made no rows (model_id -> units).
    """
    def get(refs, what: str):
        return get_within(refs, timeout_s, f"{what} (settling {owner or 'every owner'})")

    freed, rounds = get(clock.take_owner.remote(owner), "the clock's take_owner")
    for round_id, entry in rounds.items():
        lost, release = 0, {}
        for model_id, units in entry.units.items():
            episodes = {e: rows[model_id] for e, rows in entry.episodes.items()
                        if rows.get(model_id)}
            received = get(buffers[model_id].received_rows.remote(list(episodes)),
                           f"buffer {model_id}'s received_rows")
            lost += sum(n - received[e] for e, n in episodes.items())
            arrived = [e for e in episodes if received[e]]
            get([buffers[model_id].drop_episode.remote(e, reason) for e in arrived],
                f"buffer {model_id}'s drop_episode")
            if readiness[model_id] == "episode":
                release[model_id] = units - len(arrived)  # one unit per episode that never came
            elif not arrived:
                release[model_id] = units  # no group of this round was ever created
        get(clock.count_lost.remote(lost, reason), "the clock's count_lost")
        for model_id, units in release.items():
            if units > 0:
                get(clock.release.remote(model_id, units), "the clock's release")
        log.warning("round %s of %s settled (%s): %d of %d rows never reached a buffer",
                    round_id, entry.owner, reason, lost, entry.rows)
    return freed


def row_accounting(ledger: dict, buffers: dict[str, dict]) -> dict:
    """The run's row identity: ledger generated == trained + dropped (buffers) + lost (ledger).

    The ledger counted every row before it was shipped; the buffers count what they trained
    and dropped. No term is derived from another, so `unaccounted` is nonzero whenever a row
    went missing between a rollout and a buffer without a counted reason.
    """
    trained = sum(b["rows_trained"] for b in buffers.values())
    dropped = _add_counts(b["dropped"] for b in buffers.values())
    lost = dict(ledger["lost"])
    accounted = trained + sum(dropped.values()) + sum(lost.values())
    return {"generated": ledger["generated"],
            "buffered": sum(b["rows_added"] for b in buffers.values()),
            "trained": trained, "dropped": dropped, "lost": lost,
            "unaccounted": ledger["generated"] - accounted}


def _add_counts(counts) -> dict[str, int]:
    """Sum count dicts key by key, keeping zero entries (every reason stays listed)."""
    total: dict[str, int] = {}
    for one in counts:
        for key, n in one.items():
            total[key] = total.get(key, 0) + n
    return total
