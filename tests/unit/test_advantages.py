"""Advantage estimators against hand-computed numbers, and LearnerConfig validation."""
from __future__ import annotations

import math

import numpy as np
import pytest
from omegaconf import OmegaConf

from buffers.schema import StepRecord, group_key, records_to_table
from learners.advantages import (
    ADVANTAGES,
    at_grpo,
    at_grpo_rewards,
    compute_advantages,
    grpo,
    path_returns,
    reinforce_pp,
    tree_paths,
)
from learners.config import READINESS_UNITS, LearnerConfig, readiness_unit

NAN = float("nan")


def make_record(i: int, *, reward=None, episode="e", agent="a", turn=0, branch="",
                candidate=0, response_len=2, key=b"k" * 16, reward_team=None,
                reward_local=None) -> StepRecord:
    return StepRecord(
        step_id=f"s{i}", run_id="r", model_id="m", agent=agent, workflow="w", task_id="t",
        episode_id=episode, branch=branch, turn=turn, group_key=key, group_size=1,
        candidate=candidate, prompt_ids=np.array([1, 2], np.int32),
        response_ids=np.arange(response_len, dtype=np.int32),
        behavior_logprobs=np.zeros(response_len, np.float32),
        token_versions=np.zeros(response_len, np.int32), finish_reason="stop",
        reward=reward, reward_team=reward_team, reward_local=reward_local,
    )


# --- grpo -------------------------------------------------------------------------------------

def test_grpo_uses_sample_std_and_zeroes_degenerate_groups():
    # Group "x" = [0, 1, 2]: mean 1, sample std sqrt((1 + 0 + 1) / 2) = 1 (population std
    # would be sqrt(2/3) and give ±1.2247). "y" is a group of one, "z" has equal rewards.
    rewards = np.array([0.0, 5.0, 0.3, 1.0, 0.3, 2.0, 0.3])
    groups = ["x", "y", "z", "x", "z", "x", "z"]
    adv = grpo(rewards, groups)
    assert adv.dtype == np.float32
    expected = np.array([-1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]) / (1.0 + 1e-6)
    np.testing.assert_allclose(adv, expected, rtol=1e-6)
    assert adv[1] == 0.0 and adv[2] == 0.0 and adv[4] == 0.0 and adv[6] == 0.0  # exactly


def test_grpo_without_std_is_dr_grpo():
    # [1, 3] -> mean 2 -> [-1, 1]; [0, 1, 2] -> [-1, 0, 1].
    adv = grpo(np.array([1.0, 0.0, 3.0, 1.0, 2.0]), [b"a", b"b", b"a", b"b", b"b"], False)
    np.testing.assert_allclose(adv, [-1.0, -1.0, 1.0, 0.0, 1.0], atol=1e-7)


def test_grpo_rejects_missing_rewards():
    with pytest.raises(ValueError, match="no reward"):
        grpo(np.array([1.0, NAN]), ["a", "a"])


# --- at_grpo ----------------------------------------------------------------------------------

def test_at_grpo_rewards_mix_components_per_eq4():
    team = np.array([1.0, NAN, 2.0, NAN])
    local = np.array([0.5, 0.2, NAN, NAN])
    reward = np.array([9.0, 9.0, 9.0, 0.7])  # only used when both components are null
    mixed = at_grpo_rewards(team, local, reward, alpha=0.5)
    np.testing.assert_allclose(mixed, [0.5 * 1 + 0.5, 0.2, 0.5 * 2, 0.7])


def test_at_grpo_groups_the_mixed_reward():
    # Mixed rewards [1.0, 0.2, 1.0] in one group: deviations [4/15, -8/15, 4/15], sample
    # variance (96/225) / 2, std sqrt(48)/15, so A = [1/√3, -2/√3, 1/√3] (up to the 1e-6).
    team = np.array([1.0, NAN, 2.0])
    local = np.array([0.5, 0.2, NAN])
    adv = at_grpo(team, local, np.full(3, NAN), ["g", "g", "g"], alpha=0.5)
    s3 = math.sqrt(3)
    np.testing.assert_allclose(adv, [1 / s3, -2 / s3, 1 / s3], rtol=1e-5)


def test_at_grpo_from_table():
    k1, k2 = group_key("t", "0", "", "a", 0), group_key("t", "0", "", "b", 0)
    records = [
        make_record(0, key=k1, reward_team=1.0, reward_local=0.0),
        make_record(1, key=k2, reward=4.0),
        make_record(2, key=k1, reward_team=0.0, reward_local=0.5),
    ]
    # α = 2: rewards 2.0 and 0.5 in group k1 -> ±(0.75 / sample std 1.06066) = ±0.70711.
    cfg = LearnerConfig(advantage="at_grpo", team_alpha=2.0)
    adv = compute_advantages(cfg, records_to_table(records))
    np.testing.assert_allclose(adv, [1 / math.sqrt(2), 0.0, -1 / math.sqrt(2)], rtol=1e-5)


def test_at_grpo_lambda_mix_per_appendix():
    # Sudoku's λ = 0.6 (appendix A.1.3): r = 0.6·r_team + 0.4·m·r_local, m = 0 where the
    # environment could not check the action (local reward null).
    team = np.array([1.0, 0.0, 0.0, NAN])
    local = np.array([0.5, 0.85, NAN, NAN])
    reward = np.array([9.0, 9.0, 9.0, 0.3])
    mixed = at_grpo_rewards(team, local, reward, alpha=1.0, lam=0.6)
    np.testing.assert_allclose(mixed, [0.6 + 0.2, 0.34, 0.0, 0.3])


def test_at_grpo_lambda_mix_from_table():
    k = group_key("t", "0", "", "a", 0)
    records = [make_record(0, key=k, reward_team=1.0, reward_local=1.0),
               make_record(1, key=k, reward_team=0.0, reward_local=0.5)]
    # λ = 0.5 (plan-path, A.1.4): rewards 1.0 and 0.25 -> ±(0.375 / sample std 0.53033) = ±1/√2
    cfg = LearnerConfig(advantage="at_grpo", team_lambda=0.5)
    adv = compute_advantages(cfg, records_to_table(records))
    np.testing.assert_allclose(adv, [1 / math.sqrt(2), -1 / math.sqrt(2)], rtol=1e-5)


@pytest.mark.parametrize("fields, match", [
    ({"advantage": "at_grpo", "team_lambda": 1.5}, "team_lambda=1.5"),
    ({"advantage": "grpo", "team_lambda": 0.6}, "only applies to advantage='at_grpo'"),
    ({"advantage": "at_grpo", "team_lambda": 0.6, "team_alpha": 2.0}, "team_alpha=2.0"),
])
def test_team_lambda_is_checked(fields, match):
    with pytest.raises(ValueError, match=match):
        LearnerConfig(**fields)


# --- reinforce_pp -----------------------------------------------------------------------------

def _rpp_rows():
    # (episode, agent, turn, reward, response length), deliberately out of order.
    return [("e1", "a", 2, 2.0, 1), ("e1", "b", 0, 3.0, 1), ("e1", "a", 0, 1.0, 2),
            ("e2", "a", 0, 1.0, 4), ("e1", "a", 1, 0.0, 2)]


def _rpp(rows, kl=None, beta=0.0):
    episodes, agents, turns, rewards, lengths = zip(*rows)
    n = len(rows)
    return reinforce_pp(np.array(rewards), episodes, agents, np.array(turns), [""] * n,
                        np.zeros(n, int), np.array(lengths), kl=kl, beta=beta)


def test_reinforce_pp_return_to_go_and_token_weighted_normalisation():
    # Returns-to-go: e1/a turns 0,1,2 with rewards 1,0,2 -> 3,2,2; e1/b -> 3; e2/a -> 1.
    # In row order: [2, 3, 3, 1, 2]. Token weights [1, 1, 2, 4, 2] (Σ = 10):
    # μ = (2 + 3 + 6 + 4 + 4) / 10 = 1.9;
    # σ² = (0.01 + 1.21 + 2·1.21 + 4·0.81 + 2·0.01) / 10 = 0.69.
    adv = _rpp(_rpp_rows())
    expected = (np.array([2, 3, 3, 1, 2]) - 1.9) / math.sqrt(0.69 + 1e-8)
    np.testing.assert_allclose(adv, expected, rtol=1e-5)
    # Token-weighted mean of the result is 0 and weighted variance 1.
    w = np.array([1, 1, 2, 4, 2])
    assert abs((w * adv).sum()) < 1e-5
    assert abs((w * adv.astype(np.float64) ** 2).sum() / w.sum() - 1) < 1e-5


def test_reinforce_pp_kl_penalty_flows_to_earlier_turns():
    # β·KL = 0.5·2 = 1 on e1/a turn 2 (row 0): rewards 1,0,1 -> returns 2,1,1.
    kl = np.array([2.0, 0, 0, 0, 0])
    adv = _rpp(_rpp_rows(), kl=kl, beta=0.5)
    returns = np.array([1, 3, 2, 1, 1], dtype=float)
    w = np.array([1, 1, 2, 4, 2])
    mu = (w * returns).sum() / w.sum()  # 1.6
    var = (w * (returns - mu) ** 2).sum() / w.sum()
    np.testing.assert_allclose(adv, (returns - mu) / np.sqrt(var + 1e-8), rtol=1e-5)


def _normalised(returns, lengths):
    """MAPPA eq. 4 on hand-computed returns: token-weighted mean, population variance."""
    returns, w = np.asarray(returns, float), np.asarray(lengths, float)
    mu = (w * returns).sum() / w.sum()
    var = (w * (returns - mu) ** 2).sum() / w.sum()
    return (returns - mu) / np.sqrt(var + 1e-8)


def _tree_rows(rows):
    """(episode, agent, turn, branch, candidate, reward) tuples -> reinforce_pp arguments."""
    episodes, agents, turns, branches, candidates, rewards = zip(*rows)
    return (np.array(rewards, float), episodes, agents, np.array(turns), list(branches),
            np.array(candidates))


def test_reinforce_pp_siblings_are_alternatives_not_terms_of_each_others_return():
    # The reported case: one episode's verifier drew 4 candidates (turn 1, continuing from
    # solver candidate 2), all rewarded 1; another episode's verifier got 0. The old code
    # summed siblings in candidate order (returns 4, 3, 2, 1). Each candidate is its own
    # trajectory's last action here, so returns = [1, 1, 1, 1, 0]: μ = 0.8, σ² = 0.16,
    # Â = 0.2 / 0.4 = 0.5 for the four and −0.8 / 0.4 = −2 for the other.
    rows = [("e1", "verifier", 1, "2", c, 1.0) for c in range(4)]
    rows.append(("e2", "verifier", 1, "0", 0, 0.0))
    adv = reinforce_pp(*_tree_rows(rows), np.full(5, 3))
    np.testing.assert_allclose(adv, [0.5, 0.5, 0.5, 0.5, -2.0], rtol=1e-6)


# A tree-sampled episode on one model shared by two agents (AT-GRPO tree sampling):
#   turn 0  solver    K=3 from the root (branch "")       -> the episode keeps candidate 1
#   turn 1  verifier  K=3 continuing it (branch "1")      -> keeps candidate 2
#   turn 2  solver    K=2 refining     (branch "1.2")     -> keeps candidate 0
#   turn 3  verifier  one action (n=1, candidate = round index 0, branch "1.2.0")
# "Kept" is read from the branches: verifier t1 candidate 2 is kept because the rows of turn 2
# carry branch "1.2"; solver t2 candidate 0 because the turn-3 row carries "1.2.0".
TREE = [
    ("e", "solver", 0, "", 0, 0.1), ("e", "solver", 0, "", 1, 0.5), ("e", "solver", 0, "", 2, 0.2),
    ("e", "verifier", 1, "1", 0, 0.3), ("e", "verifier", 1, "1", 1, 0.0),
    ("e", "verifier", 1, "1", 2, 0.6),
    ("e", "solver", 2, "1.2", 0, 0.9), ("e", "solver", 2, "1.2", 1, 0.4),
    ("e", "verifier", 3, "1.2.0", 0, 1.0),
]
# Return-to-go along each candidate's own path, over the same agent's kept actions:
#   solver t0 c0: 0.1 (nobody continued from it)          solver t0 c2: 0.2
#   solver t0 c1: 0.5 + 0.9 (its kept refinement, t2 c0)  = 1.4   (not + 0.4: t2 c1 not kept)
#   verifier t1 c0: 0.3    verifier t1 c1: 0.0
#   verifier t1 c2: 0.6 + 1.0 (the turn-3 verifier action on its path) = 1.6
#   solver t2 c0: 0.9      solver t2 c1: 0.4      verifier t3: 1.0
TREE_RETURNS = [0.1, 1.4, 0.2, 0.3, 0.0, 1.6, 0.9, 0.4, 1.0]


def test_path_returns_follow_the_kept_branch_of_the_same_agent():
    np.testing.assert_allclose(path_returns(*_tree_rows(TREE)), TREE_RETURNS, atol=1e-12)
    anchors, kept = tree_paths(*_tree_rows(TREE)[1:])
    assert anchors == ["0", "1", "2", "1.0", "1.1", "1.2", "1.2.0", "1.2.1", "1.2.0"]
    assert kept.tolist() == [False, True, False, False, False, True, True, False, True]


def test_reinforce_pp_tree_episode_normalised_globally():
    # Token weights (response lengths) [1, 2, 1, 1, 1, 2, 1, 1, 2] (Σ = 12) over the returns
    # above: μ = (0.1 + 2.8 + 0.2 + 0.3 + 0 + 3.2 + 0.9 + 0.4 + 2.0) / 12 = 9.9 / 12 = 0.825.
    lengths = [1, 2, 1, 1, 1, 2, 1, 1, 2]
    adv = reinforce_pp(*_tree_rows(TREE), np.array(lengths))
    np.testing.assert_allclose(adv, _normalised(TREE_RETURNS, lengths), rtol=1e-5)
    w = np.array(lengths)
    assert abs((w * np.array(TREE_RETURNS)).sum() / w.sum() - 0.825) < 1e-12
    assert abs((w * adv).sum()) < 1e-5


def test_tree_from_table_with_reward_kl():
    # β = 0.5, KL = 0.4 on solver t2 c0 and 1.0 on verifier t1 c1: their rewards become
    # 0.9 − 0.2 = 0.7 and 0.0 − 0.5 = −0.5, so solver t0 c1 returns 0.5 + 0.7 = 1.2.
    records = [make_record(i, episode=e, agent=a, turn=t, branch=b, candidate=c, reward=r,
                           response_len=1)
               for i, (e, a, t, b, c, r) in enumerate(TREE)]
    kl = np.array([0, 0, 0, 0, 1.0, 0, 0.4, 0, 0])
    cfg = LearnerConfig(advantage="reinforce_pp", reward_kl_beta=0.5)
    adv = compute_advantages(cfg, records_to_table(records), kl)
    returns = [0.1, 1.2, 0.2, 0.3, -0.5, 1.6, 0.7, 0.4, 1.0]
    np.testing.assert_allclose(adv, _normalised(returns, np.ones(9)), rtol=1e-5)
    with pytest.raises(ValueError, match="prepare_batch"):
        compute_advantages(cfg, records_to_table(records))  # β > 0 never silently ignored


def test_one_action_node_before_a_branching_node_on_the_same_branch():
    # Tree mode gives an n=1 action candidate = round index 0, which here equals the later
    # choice: planner t0 (n=1, ""), planner t1 K=2 ("") keeps 0, planner t2 (n=1, "0").
    # t0's own path "0" is continued, but t1 is a later node on its branch, so t0 did not
    # branch: its return runs over everything kept after it: 1 + 2 + 8 = 11 (not + 4).
    # t1 c0: 2 + 8 = 10; t1 c1: 4 (not kept, nothing follows); t2: 8.
    rows = [("e", "p", 0, "", 0, 1.0), ("e", "p", 1, "", 0, 2.0), ("e", "p", 1, "", 1, 4.0),
            ("e", "p", 2, "0", 0, 8.0)]
    np.testing.assert_allclose(path_returns(*_tree_rows(rows)), [11, 10, 4, 8])


def test_tree_paths_compare_whole_components():
    # Candidates 1 and 12 of one node (the others failed); the episode continued from 12.
    # Branch "12" must not count as passing through candidate 1's path "1".
    rows = [("e", "a", 0, "", 1, 1.0), ("e", "a", 0, "", 12, 2.0), ("e", "a", 1, "12", 0, 4.0)]
    np.testing.assert_allclose(path_returns(*_tree_rows(rows)), [1, 6, 4])


def test_last_branching_node_adds_nothing_to_earlier_returns():
    # The documented limit: which of the final K candidates the episode kept is in no row
    # (nothing continues from it), so neither adds to the turn-0 return: 1, not 1 + 2 + 4.
    rows = [("e", "a", 0, "", 0, 1.0), ("e", "a", 1, "0", 0, 2.0), ("e", "a", 1, "0", 1, 4.0)]
    np.testing.assert_allclose(path_returns(*_tree_rows(rows)), [1, 2, 4])


def test_joint_sampling_keeps_plain_return_to_go():
    # MAGRPO-style joint rollouts: n=1 per act, empty branches, candidate = round index
    # (e1 is round index 0, e2 index 3). Per (episode, agent), in turn order:
    #   e1/a turns 0,1,2 rewards 1,2,4 -> 7,6,4;  e1/b turns 0,1 rewards 0.5,0.25 -> 0.75,0.25
    #   e2/a turns 0,1 rewards 3,-1 -> 2,-1
    rows = [("e1", "a", 2, "", 0, 4.0), ("e2", "a", 0, "", 3, 3.0), ("e1", "b", 1, "", 0, 0.25),
            ("e1", "a", 0, "", 0, 1.0), ("e2", "a", 1, "", 3, -1.0), ("e1", "a", 1, "", 0, 2.0),
            ("e1", "b", 0, "", 0, 0.5)]
    returns = [4, 2, 0.25, 7, -1, 6, 0.75]
    np.testing.assert_allclose(path_returns(*_tree_rows(rows)), returns)
    lengths = np.array([1, 2, 3, 1, 2, 3, 1])
    np.testing.assert_allclose(reinforce_pp(*_tree_rows(rows), lengths),
                               _normalised(returns, lengths), rtol=1e-5)


def test_reinforce_pp_from_table_reads_lengths_and_ids():
    records = [make_record(i, reward=r, episode=e, agent=a, turn=t, response_len=n)
               for i, (e, a, t, r, n) in enumerate(_rpp_rows())]
    cfg = LearnerConfig(advantage="reinforce_pp")
    adv = compute_advantages(cfg, records_to_table(records))
    np.testing.assert_allclose(adv, _rpp(_rpp_rows()), rtol=1e-6)


# --- registry and config ----------------------------------------------------------------------

def test_registry_matches_readiness_units():
    assert set(ADVANTAGES) == set(READINESS_UNITS)
    assert readiness_unit("grpo") == "group" and readiness_unit("at_grpo") == "group"
    assert readiness_unit("reinforce_pp") == "episode"
    assert LearnerConfig(advantage="reinforce_pp").readiness_unit == "episode"


@pytest.mark.parametrize("field,value", [
    ("advantage", "ppo"), ("backend", "jax"), ("behavior_correction", "clip"),
    ("behavior_cap", 0.5), ("clip_eps_low", 1.0), ("temperature", 0.0), ("dtype", "float16"),
    ("ppo_epochs", 0), ("lr", 0.0), ("max_staleness", -1), ("reward_kl_beta", 0.01),
])
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"LearnerConfig.{field}="):
        LearnerConfig(**{field: value})


def test_config_is_an_omegaconf_structured_config():
    merged = OmegaConf.merge(OmegaConf.structured(LearnerConfig),
                             OmegaConf.from_dotlist(["advantage=reinforce_pp", "lr=0.001"]))
    cfg = OmegaConf.to_object(merged)
    assert isinstance(cfg, LearnerConfig) and cfg.lr == 0.001
    with pytest.raises(ValueError, match="LearnerConfig.behavior_cap="):
        OmegaConf.to_object(OmegaConf.merge(merged, {"behavior_cap": 0.1}))
