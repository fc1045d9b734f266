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
    reinforce_pp,
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


def test_reinforce_pp_orders_ties_by_branch_then_candidate():
    # Same episode, agent, turn: order is branch "0" < "1", then candidate 0 < 1.
    # Sorted rewards [1 (b0,c0), 2 (b0,c1), 4 (b1,c0)] -> returns [7, 6, 4].
    adv = reinforce_pp(np.array([4.0, 2.0, 1.0]), ["e"] * 3, ["a"] * 3, np.zeros(3, int),
                       ["1", "0", "0"], np.array([0, 1, 0]), np.ones(3, int))
    returns = np.array([4.0, 6.0, 7.0])
    expected = (returns - returns.mean()) / np.sqrt(returns.var() + 1e-8)
    np.testing.assert_allclose(adv, expected, rtol=1e-5)


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
