"""Advantage estimators: one float32 advantage per row, broadcast to its tokens later (DESIGN §6).

The estimators are pure numpy functions over row-level arrays (N rows); nothing here loops over
tokens. `ADVANTAGES` maps a `LearnerConfig.advantage` name to an adapter that reads the needed
STEP_SCHEMA columns from an Arrow table, and `compute_advantages` dispatches through it.

Arithmetic runs in float64 and the result is cast to float32, so group statistics of a few
thousand rows carry no float32 cancellation error.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from learners.config import LearnerConfig

GRPO_EPS = 1e-6  # added to the group std (DESIGN §6)
REINFORCE_PP_EPS = 1e-8  # inside the sqrt of the global variance (MAPPA appendix E.2)


def _factorize(keys: Sequence[Hashable]) -> tuple[np.ndarray, int]:
    """Map keys to dense ids in order of first appearance.

    A dict, not `np.unique`: keys may be any hashable (tuples included), and numpy's
    fixed-width bytes dtype drops trailing NUL bytes (b"a" and b"a\\x00" would compare equal).
    Rows are few (one per action), so a Python pass over them is cheap.

    Returns:
        (ids int64 [N], number of distinct keys)
    """
    index: dict[Hashable, int] = {}
    ids = np.fromiter((index.setdefault(k, len(index)) for k in keys), np.int64, len(keys))
    return ids, len(index)


def grpo(
    rewards: np.ndarray, group_ids: Sequence[Hashable], std_normalize: bool = True
) -> np.ndarray:
    """Group-relative advantage (AT-GRPO eq. 1; GRPO): A = (r − mean_g r) / (std_g r + 1e-6).

    The std is the *sample* std (ddof = 1, Bessel-corrected), as in the common GRPO
    implementations. A group of one, or a group whose rewards are all equal, gives exactly 0
    (not a rounding residue). `std_normalize=False` gives Dr.GRPO: A = r − mean_g r.

    Args:
        rewards: float [N], no NaN.
        group_ids: [N] hashable group keys (bytes group_key, strings, ints).
        std_normalize: divide by the group std.

    Returns:
        float32 [N].
    """
    r = np.asarray(rewards, dtype=np.float64)
    if len(group_ids) != len(r):
        raise ValueError(f"grpo: {len(r)} rewards but {len(group_ids)} group ids")
    if np.isnan(r).any():
        raise ValueError(f"grpo: {int(np.isnan(r).sum())} rows have no reward (NaN)")
    gid, num_groups = _factorize(group_ids)
    count = np.bincount(gid, minlength=num_groups).astype(np.float64)
    mean = np.bincount(gid, weights=r, minlength=num_groups) / count
    centered = r - mean[gid]
    # Equality detected via min == max rather than centered == 0, which rounding can miss.
    low = np.full(num_groups, np.inf)
    high = np.full(num_groups, -np.inf)
    np.minimum.at(low, gid, r)
    np.maximum.at(high, gid, r)
    degenerate = (count[gid] < 2) | (low[gid] == high[gid])
    if std_normalize:
        sq = np.bincount(gid, weights=centered**2, minlength=num_groups)
        std = np.sqrt(sq / np.maximum(count - 1, 1))
        centered = centered / (std[gid] + GRPO_EPS)
    return np.where(degenerate, 0.0, centered).astype(np.float32)


def at_grpo_rewards(
    reward_team: np.ndarray, reward_local: np.ndarray, reward: np.ndarray, alpha: float
) -> np.ndarray:
    """Mixed reward of AT-GRPO eq. 4: r = α·r_team + r_local.

    Nulls are NaN. A missing component counts as 0 only when the other one is present; a row
    with neither falls back to its combined `reward`.

    Args:
        reward_team, reward_local, reward: float [N], NaN where null.
        alpha: the team weight α.

    Returns:
        float64 [N] (NaN where a row has no reward at all).
    """
    team = np.asarray(reward_team, dtype=np.float64)
    local = np.asarray(reward_local, dtype=np.float64)
    has_component = ~np.isnan(team) | ~np.isnan(local)
    mixed = alpha * np.nan_to_num(team, nan=0.0) + np.nan_to_num(local, nan=0.0)
    return np.where(has_component, mixed, np.asarray(reward, dtype=np.float64))


def at_grpo(
    reward_team: np.ndarray,
    reward_local: np.ndarray,
    reward: np.ndarray,
    group_ids: Sequence[Hashable],
    alpha: float = 1.0,
    std_normalize: bool = True,
) -> np.ndarray:
    """AT-GRPO advantage: eq. 4 mixed reward, then eq. 1 over agent- and turn-wise groups.

    The group key already encodes (task, round, parent branch, agent, turn) (DESIGN §4), so
    this is `grpo` over `group_ids` of `at_grpo_rewards`.

    Returns:
        float32 [N].
    """
    mixed = at_grpo_rewards(reward_team, reward_local, reward, alpha)
    return grpo(mixed, group_ids, std_normalize=std_normalize)


def reinforce_pp(
    rewards: np.ndarray,
    episode_ids: Sequence[Hashable],
    agents: Sequence[Hashable],
    turns: np.ndarray,
    branches: Sequence[str],
    candidates: np.ndarray,
    response_lengths: np.ndarray,
    kl: np.ndarray | None = None,
    beta: float = 0.0,
) -> np.ndarray:
    """REINFORCE++ advantage as MAPPA uses it (eq. 1; appendix E.2 eqs. 2–4).

    r_t = reward_t − β·KL_t; A_t = Σ_{τ≥t} r_τ (undiscounted return-to-go) over the same agent's
    actions in the same episode, ordered by (turn, branch, candidate); then one global
    normalisation over all tokens of the batch: each row weighs as many tokens as its response
    has, μ = Σ L_i A_i / Σ L_i, σ² = Σ L_i (A_i − μ)² / Σ L_i (population variance, eq. 4),
    Â = (A − μ) / sqrt(σ² + 1e-8). Rows of an empty response carry no weight in μ and σ.

    Args:
        rewards: float [N] per-action reward (coach score), no NaN.
        episode_ids, agents: [N] hashable ids; (episode, agent) is one trajectory.
        turns: int [N]; branches: [N] str tree paths; candidates: int [N] (tie breakers).
        response_lengths: int [N] response tokens per row.
        kl: float [N] per-action KL to the reference policy, or None for zeros.
        beta: the KL penalty β.

    Returns:
        float32 [N].
    """
    r = np.asarray(rewards, dtype=np.float64)
    n = len(r)
    if np.isnan(r).any():
        raise ValueError(f"reinforce_pp: {int(np.isnan(r).sum())} rows have no reward (NaN)")
    if kl is not None:
        r = r - beta * np.asarray(kl, dtype=np.float64)
    trajectory, _ = _factorize(list(zip(episode_ids, agents)))
    # np.unique sorts strings, giving a deterministic branch order for same-turn ties.
    _, branch_rank = np.unique(np.asarray(branches, dtype=str), return_inverse=True)
    order = np.lexsort((np.asarray(candidates), branch_rank, np.asarray(turns), trajectory))
    r_sorted = r[order]
    traj_sorted = trajectory[order]
    running = np.cumsum(r_sorted)
    # Return-to-go = (trajectory total up to its last row) − (running sum before this row).
    is_last = np.ones(n, dtype=bool)
    is_last[:-1] = traj_sorted[1:] != traj_sorted[:-1]
    last_index = np.flatnonzero(is_last)
    segment_end = last_index[np.searchsorted(last_index, np.arange(n))]
    returns = np.empty(n)
    returns[order] = running[segment_end] - running + r_sorted

    weights = np.asarray(response_lengths, dtype=np.float64)
    total = weights.sum()
    if total <= 0:
        raise ValueError("reinforce_pp: the batch has no response tokens to normalise over")
    mu = (weights * returns).sum() / total
    var = (weights * (returns - mu) ** 2).sum() / total
    return ((returns - mu) / np.sqrt(var + REINFORCE_PP_EPS)).astype(np.float32)


def _floats(table: pa.Table, name: str) -> np.ndarray:
    """A nullable float column as float64 numpy, NaN where null."""
    return pc.fill_null(table.column(name).cast(pa.float64()), np.nan).to_numpy()


def _grpo_from_table(cfg: LearnerConfig, table: pa.Table, kl: np.ndarray | None) -> np.ndarray:
    return grpo(_floats(table, "reward"), table.column("group_key").to_pylist(), cfg.std_normalize)


def _at_grpo_from_table(
    cfg: LearnerConfig, table: pa.Table, kl: np.ndarray | None
) -> np.ndarray:
    return at_grpo(
        _floats(table, "reward_team"),
        _floats(table, "reward_local"),
        _floats(table, "reward"),
        table.column("group_key").to_pylist(),
        alpha=cfg.team_alpha,
        std_normalize=cfg.std_normalize,
    )


def _reinforce_pp_from_table(
    cfg: LearnerConfig, table: pa.Table, kl: np.ndarray | None
) -> np.ndarray:
    return reinforce_pp(
        _floats(table, "reward"),
        table.column("episode_id").to_pylist(),
        table.column("agent").to_pylist(),
        table.column("turn").to_numpy(),
        table.column("branch").to_pylist(),
        table.column("candidate").to_numpy(),
        pc.list_value_length(table.column("response_ids")).to_numpy(),
        kl=kl,
        beta=cfg.reward_kl_beta,
    )


# name -> adapter(cfg, table in STEP_SCHEMA, optional per-row KL [N]) -> float32 [N]
ADVANTAGES: dict[str, Callable[[LearnerConfig, pa.Table, np.ndarray | None], np.ndarray]] = {
    "grpo": _grpo_from_table,
    "at_grpo": _at_grpo_from_table,
    "reinforce_pp": _reinforce_pp_from_table,
}


def compute_advantages(
    cfg: LearnerConfig, table: pa.Table, kl: np.ndarray | None = None
) -> np.ndarray:
    """One advantage per row of `table` with the estimator named by `cfg.advantage`.

    Args:
        cfg: learner config (advantage, std_normalize, team_alpha, reward_kl_beta).
        table: rows in STEP_SCHEMA, every one rewarded.
        kl: optional float [N] per-action KL to the reference policy; only reinforce_pp uses
            it (MAPPA eq. 1, weighted by `cfg.reward_kl_beta`).

    Returns:
        float32 [N], in the row order of `table`.
    """
    if kl is not None and len(kl) != table.num_rows:
        raise ValueError(f"compute_advantages: kl has {len(kl)} rows, table {table.num_rows}")
    return ADVANTAGES[cfg.advantage](cfg, table, kl)
