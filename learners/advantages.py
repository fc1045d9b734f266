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

from buffers.schema import tree_path
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
    reward_team: np.ndarray,
    reward_local: np.ndarray,
    reward: np.ndarray,
    alpha: float,
    lam: float | None = None,
) -> np.ndarray:
    """Mixed reward of AT-GRPO: eq. 4, r = α·r_team + r_local, or, with `lam`, the λ-mix of
    appendix A.1.1–A.1.5, r = λ·r_team + (1−λ)·m·r_local.

    Nulls are NaN. The verifiability mask m of the appendix is the presence of `reward_local`:
    an environment that cannot check an action (m = 0) leaves its local reward null. A
    missing component counts as 0 only when the other one is present; a row with neither
    falls back to its combined `reward`.

    Args:
        reward_team, reward_local, reward: float [N], NaN where null.
        alpha: the team weight α of eq. 4 (unused when `lam` is given).
        lam: the appendix's λ ∈ [0, 1] (0.6 sudoku, 0.5 plan-path, 0.4 sokoban, 0.7 math);
            None selects eq. 4.

    Returns:
        float64 [N] (NaN where a row has no reward at all).
    """
    team = np.asarray(reward_team, dtype=np.float64)
    local = np.asarray(reward_local, dtype=np.float64)
    has_component = ~np.isnan(team) | ~np.isnan(local)
    team0, local0 = np.nan_to_num(team, nan=0.0), np.nan_to_num(local, nan=0.0)
    if lam is None:
        mixed = alpha * team0 + local0
    else:
        mixed = lam * team0 + (1.0 - lam) * local0
    return np.where(has_component, mixed, np.asarray(reward, dtype=np.float64))


def at_grpo(
    reward_team: np.ndarray,
    reward_local: np.ndarray,
    reward: np.ndarray,
    group_ids: Sequence[Hashable],
    alpha: float = 1.0,
    std_normalize: bool = True,
    lam: float | None = None,
) -> np.ndarray:
    """AT-GRPO advantage: the mixed reward (eq. 4, or the appendix's λ-mix when `lam` is
    given), then eq. 1 over agent- and turn-wise groups.

    The group key already encodes (task, round, parent branch, agent, turn) (DESIGN §4), so
    this is `grpo` over `group_ids` of `at_grpo_rewards`.

    Returns:
        float32 [N].
    """
    mixed = at_grpo_rewards(reward_team, reward_local, reward, alpha, lam)
    return grpo(mixed, group_ids, std_normalize=std_normalize)


def _passes_through(branch: str, prefix: str) -> bool:
    """Whether tree path `branch` runs through `prefix`, component-wise ("12" does not pass
    through "1"; every path passes through the root "")."""
    return not prefix or branch == prefix or branch.startswith(prefix + ".")


def tree_paths(
    episode_ids: Sequence[Hashable],
    agents: Sequence[Hashable],
    turns: np.ndarray,
    branches: Sequence[str],
    candidates: np.ndarray,
) -> tuple[list[str], np.ndarray]:
    """Where each row sits on its episode's tree, read from the branch strings alone.

    A *node* is the rows of one (episode, agent, turn, branch): the candidates drawn from one
    prompt. It *branched* when it holds several rows, or when it holds one row whose tree path
    (`branch.candidate`) some row of the episode continued from and no later node shares its
    branch (a one-action node's candidate is its round index, which can coincide with a later
    choice; a node that branched is the last one on its branch, since everything after it
    carries the longer path). A row was *kept* when its node did not branch (the only action
    taken there) or when some row's branch runs through its tree path.

    Rows absent from the table cannot testify: the kept candidate of an episode's last
    branching node, or one continued only by another model's agents (whose rows live in
    another buffer), looks unkept, so it adds nothing to earlier returns of its agent. Only
    a workflow whose agent acts at two branching levels meets this (arith_duo does not); a
    row-level mark of `Episode.keep` would lift it.

    Args:
        episode_ids, agents: [N] hashable ids.
        turns: int [N]; branches: [N] str tree paths ("", "2", "0.2"); candidates: int [N].

    Returns:
        (anchors [N] str: the path a later row's branch must run through to follow this row —
        its tree path if its node branched, else its own branch; kept bool [N]).
    """
    turns = np.asarray(turns)
    candidates = np.asarray(candidates)
    rows = range(len(turns))
    paths = [tree_path(branches[i], int(candidates[i])) for i in rows]
    continued: set[tuple[Hashable, str]] = set()  # (episode, every non-empty prefix of a branch)
    last_turn: dict[tuple[Hashable, str], int] = {}
    node_size: dict[tuple, int] = {}
    for i in rows:
        episode, branch, turn = episode_ids[i], branches[i], int(turns[i])
        parts = branch.split(".") if branch else []
        continued.update((episode, ".".join(parts[:k])) for k in range(1, len(parts) + 1))
        last_turn[episode, branch] = max(turn, last_turn.get((episode, branch), turn))
        node = (episode, agents[i], turn, branch)
        node_size[node] = node_size.get(node, 0) + 1
    anchors, kept = [], np.zeros(len(turns), dtype=bool)
    for i in rows:
        episode, branch, turn = episode_ids[i], branches[i], int(turns[i])
        was_continued = (episode, paths[i]) in continued
        branched = node_size[episode, agents[i], turn, branch] > 1 or (
            was_continued and turn == last_turn[episode, branch])
        anchors.append(paths[i] if branched else branch)
        kept[i] = was_continued or not branched
    return anchors, kept


def path_returns(
    rewards: np.ndarray,
    episode_ids: Sequence[Hashable],
    agents: Sequence[Hashable],
    turns: np.ndarray,
    branches: Sequence[str],
    candidates: np.ndarray,
) -> np.ndarray:
    """Undiscounted return-to-go along each action's trajectory (MAPPA eq. 1 / eq. 3; DESIGN §6).

    MAPPA sums A_t = Σ_{τ≥t} r_τ (γ = 1) along each agent's trajectory. Here that is r_t plus
    the rewards of the *kept* actions of the same agent in the same episode at later turns
    on its path, i.e. whose branch runs through its anchor (`tree_paths`). With tree
    sampling the candidates drawn from one prompt are alternatives: a sibling is never a term
    of another's return, and a candidate nobody continued from has only its own reward.
    Joint / parallel sampling (one action per node, empty branches) is one trajectory per
    (episode, agent): plain return-to-go in turn order.

    A Python pass per trajectory (rows × its rows); rows are one per action, so few.

    Args:
        rewards: float [N] per-action rewards (already KL-penalised where that applies).
        episode_ids, agents, turns, branches, candidates: [N] as in `tree_paths`.

    Returns:
        float64 [N].
    """
    r = np.asarray(rewards, dtype=np.float64)
    turns = np.asarray(turns)
    anchors, kept = tree_paths(episode_ids, agents, turns, branches, candidates)
    trajectory, num_trajectories = _factorize(list(zip(episode_ids, agents)))
    members = np.argsort(trajectory, kind="stable")
    bounds = np.searchsorted(trajectory[members], np.arange(num_trajectories + 1))
    returns = r.copy()
    for t in range(num_trajectories):
        rows = members[bounds[t]:bounds[t + 1]]
        for i in rows:
            follows = [j for j in rows if turns[j] > turns[i] and kept[j]
                       and _passes_through(branches[j], anchors[i])]
            returns[i] += r[follows].sum()
    return returns


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
    """REINFORCE++ advantage as MAPPA uses it (eq. 1; appendix E.2 eqs. 2–4; DESIGN §6).

    r_t = reward_t − β·KL_t (eq. 2); A_t = the undiscounted return-to-go of r along the
    action's own trajectory (eq. 3, `path_returns`: with tree sampling the kept path, siblings
    never summed); then one global normalisation over all tokens of the batch: each row weighs
    as many tokens as its response has, μ = Σ L_i A_i / Σ L_i, σ² = Σ L_i (A_i − μ)² / Σ L_i
    (population variance, eq. 4), Â = (A − μ) / sqrt(σ² + 1e-8). Rows of an empty response
    carry no weight in μ and σ.

    Args:
        rewards: float [N] per-action reward (coach score), no NaN.
        episode_ids, agents: [N] hashable ids; (episode, agent) holds one agent's actions.
        turns: int [N]; branches: [N] str tree paths; candidates: int [N] (see `tree_paths`).
        response_lengths: int [N] response tokens per row.
        kl: float [N] per-action KL to the reference policy (`learners.prepare.row_kl`);
            required when β > 0.
        beta: the KL penalty β.

    Returns:
        float32 [N].
    """
    r = np.asarray(rewards, dtype=np.float64)
    if np.isnan(r).any():
        raise ValueError(f"reinforce_pp: {int(np.isnan(r).sum())} rows have no reward (NaN)")
    if beta > 0:
        if kl is None:
            raise ValueError("reinforce_pp: beta > 0 needs the per-row KL to the reference "
                             "policy; build the batch with learners.prepare.prepare_batch")
        r = r - beta * np.asarray(kl, dtype=np.float64)
    returns = path_returns(r, episode_ids, agents, turns, branches, candidates)

    weights = np.asarray(response_lengths, dtype=np.float64)
    total = weights.sum()
    if total <= 0:
        raise ValueError("reinforce_pp: the batch has no response tokens to normalise over")
    mu = (weights * returns).sum() / total
    var = (weights * (returns - mu) ** 2).sum() / total
    return ((returns - mu) / np.sqrt(var + REINFORCE_PP_EPS)).astype(np.float32)


def joint_returns(
    rewards: np.ndarray,
    episode_ids: Sequence[Hashable],
    agents: Sequence[Hashable],
    turns: np.ndarray,
    branches: Sequence[str],
    candidates: np.ndarray,
    gamma: float = 1.0,
) -> np.ndarray:
    """Return of each row's joint action on a MAGRPO joint tree (MAGRPO, Algorithm 1 line 11).

    A *joint action* is the rows of one (episode, turn, branch, candidate): the same-index
    candidates of every agent at one node (the reference implementation's "aligned" joint
    mode). It holds one joint reward r (Algorithm 1 line 7), so its agents' rows must agree.
    Its *children* are the joint actions of the next turn on its anchor (`tree_paths`): with
    tree expansion, the G joint actions drawn from its tree path; with parallel joint sampling
    (empty branches, one rollout per episode, DESIGN §4), the same rollout's next joint action.

    R = r + γ · mean over children of R, and R = r for a leaf. Early termination is data here:
    Algorithm 1 runs every rollout to the horizon H; a workflow that stops expanding a branch
    (the authors' released trainer stops a node whose mean reward exceeds `termination_threshold`)
    leaves its joint actions childless, whatever its rule. With one child per joint action R is
    Algorithm 1's R_t = Σ_{τ≥t} γ^{τ−t} r_τ.

    Rows absent from the table cannot testify: a later turn at which none of this model's
    agents acted adds nothing to the returns (as in `tree_paths`).

    Args:
        rewards: float [N] joint reward of each row's joint action, no NaN.
        episode_ids, agents, turns, branches, candidates: [N] as in `tree_paths`.
        gamma: the discount γ over turns (1.0 in the paper's multi-turn setting, appendix C).

    Returns:
        float64 [N]: each row's joint-action return.
    """
    r = np.asarray(rewards, dtype=np.float64)
    if np.isnan(r).any():
        raise ValueError(f"magrpo: {int(np.isnan(r).sum())} rows have no reward (NaN)")
    anchors, _ = tree_paths(episode_ids, agents, turns, branches, candidates)
    keys = [(e, int(t), b, int(c)) for e, t, b, c in zip(episode_ids, turns, branches, candidates)]
    joint, num_joint = _factorize(keys)
    low, high = np.full(num_joint, np.inf), np.full(num_joint, -np.inf)
    np.minimum.at(low, joint, r)
    np.maximum.at(high, joint, r)
    if (low != high).any():
        j = int(np.flatnonzero(low != high)[0])
        episode, turn, branch, candidate = keys[int(np.argmax(joint == j))]
        raise ValueError(
            f"magrpo: the joint action (episode {episode!r}, turn {turn}, branch {branch!r}, "
            f"candidate {candidate}) has rewards from {low[j]} to {high[j]} across its agents; "
            "MAGRPO shares one joint reward per joint action: give every agent's row the team "
            "reward, or train per-agent rewards with at_grpo or reinforce_pp")
    # A failed row can leave one agent's node a single row nobody continued, which
    # `tree_paths` reads as unbranched: the joint action branched when any agent's node did.
    joint_key, joint_anchor = [()] * num_joint, [""] * num_joint
    for i, j in enumerate(joint):
        if not joint_key[j] or anchors[i] != branches[i]:
            joint_key[j], joint_anchor[j] = keys[i], anchors[i]
    on_branch: dict[tuple[Hashable, str], dict[int, list[int]]] = {}
    for j, (episode, turn, branch, _) in enumerate(joint_key):
        on_branch.setdefault((episode, branch), {}).setdefault(turn, []).append(j)
    returns = low.copy()  # the joint reward
    # Children sit at later turns, so deepest-first sees every child's return before its parent.
    for j in sorted(range(num_joint), key=lambda j: -joint_key[j][1]):
        episode, turn = joint_key[j][:2]
        later = [t for t in on_branch.get((episode, joint_anchor[j]), {}) if t > turn]
        if later:
            children = on_branch[episode, joint_anchor[j]][min(later)]
            returns[j] += gamma * returns[children].mean()
    return returns[joint]


def magrpo(
    rewards: np.ndarray,
    group_ids: Sequence[Hashable],
    episode_ids: Sequence[Hashable],
    agents: Sequence[Hashable],
    turns: np.ndarray,
    branches: Sequence[str],
    candidates: np.ndarray,
    gamma: float = 1.0,
    std_normalize: bool = True,
) -> np.ndarray:
    """MAGRPO advantage (MAGRPO, Algorithm 1 lines 11–12, eq. 1; DESIGN §6).

    The joint-action return R (`joint_returns`), then eq. 1 within the G joint actions of a
    node: A = (R − mean_G R) / σ_G(R), computed by `grpo` over `group_ids` (an agent's G rows
    at one node, or across the G episodes of a parallel round, DESIGN §4). Every agent's row of
    a joint action carries the same R, so all of them get the same advantage. Eq. 1 divides by
    σ; `std_normalize=False` keeps only the mean baseline (the authors' released trainer does
    that). A group of one, or of equal returns, gives A = 0.

    Args:
        rewards, episode_ids, agents, turns, branches, candidates, gamma: as in `joint_returns`.
        group_ids: [N] hashable group keys (bytes group_key); std_normalize: as in `grpo`.

    Returns:
        float32 [N].
    """
    returns = joint_returns(rewards, episode_ids, agents, turns, branches, candidates, gamma)
    return grpo(returns, group_ids, std_normalize=std_normalize)


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
        lam=cfg.team_lambda,
    )


def _tree_columns(table: pa.Table) -> tuple[list, list, np.ndarray, list, np.ndarray]:
    """episode_ids, agents, turns, branches, candidates: where each row sits in its tree."""
    return (table.column("episode_id").to_pylist(), table.column("agent").to_pylist(),
            table.column("turn").to_numpy(), table.column("branch").to_pylist(),
            table.column("candidate").to_numpy())


def _reinforce_pp_from_table(
    cfg: LearnerConfig, table: pa.Table, kl: np.ndarray | None
) -> np.ndarray:
    return reinforce_pp(
        _floats(table, "reward"),
        *_tree_columns(table),
        pc.list_value_length(table.column("response_ids")).to_numpy(),
        kl=kl,
        beta=cfg.reward_kl_beta,
    )


def _magrpo_from_table(cfg: LearnerConfig, table: pa.Table, kl: np.ndarray | None) -> np.ndarray:
    return magrpo(
        _floats(table, "reward"),
        table.column("group_key").to_pylist(),
        *_tree_columns(table),
        gamma=cfg.magrpo_gamma,
        std_normalize=cfg.std_normalize,
    )


# name -> adapter(cfg, table in STEP_SCHEMA, optional per-row KL [N]) -> float32 [N]
ADVANTAGES: dict[str, Callable[[LearnerConfig, pa.Table, np.ndarray | None], np.ndarray]] = {
    "grpo": _grpo_from_table,
    "at_grpo": _at_grpo_from_table,
    "reinforce_pp": _reinforce_pp_from_table,
    "magrpo": _magrpo_from_table,
}


def compute_advantages(
    cfg: LearnerConfig, table: pa.Table, kl: np.ndarray | None = None
) -> np.ndarray:
    """One advantage per row of `table` with the estimator named by `cfg.advantage`.

    Args:
        cfg: learner config (advantage, std_normalize, team_alpha, team_lambda,
            reward_kl_beta, magrpo_gamma).
        table: rows in STEP_SCHEMA, every one rewarded.
        kl: optional float [N] per-action KL to the reference policy; only reinforce_pp uses
            it (MAPPA eq. 1, weighted by `cfg.reward_kl_beta`, which then requires it).
            `learners.prepare.prepare_batch` computes it and calls this function.

    Returns:
        float32 [N], in the row order of `table`.
    """
    if kl is not None and len(kl) != table.num_rows:
        raise ValueError(f"compute_advantages: kl has {len(kl)} rows, table {table.num_rows}")
    return ADVANTAGES[cfg.advantage](cfg, table, kl)
