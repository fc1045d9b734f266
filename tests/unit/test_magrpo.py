"""MAGRPO joint-tree returns and advantages against hand-computed
numbers (DESIGN §6)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from omegaconf import OmegaConf

from buffers.schema import StepRecord, group_key, records_to_table, tree_path
from learners.advantages import (
    ADVANTAGES,
    compute_advantages,
    joint_returns,
    magrpo,
)
from learners.config import LearnerConfig, readiness_unit

HALF_SQRT2 = 1 / math.sqrt(2)  # |A| of a distinct pair under eq. 1 with the sample std


def record(i: int, *, reward: float, episode: str, agent: str, turn: int, branch: str,
           candidate: int, group_size: int) -> StepRecord:
    # A joint tree lives in one episode; parallel rounds share round_id "r" across episodes.
    return StepRecord(
        step_id=f"s{i}", run_id="run", model_id="m", agent=agent, workflow="w", task_id="t",
        episode_id=episode, branch=branch, turn=turn,
        group_key=group_key("t", "r", branch, agent, turn), group_size=group_size,
        candidate=candidate, prompt_ids=np.array([1, 2], np.int32),
        response_ids=np.array([3], np.int32), behavior_logprobs=np.zeros(1, np.float32),
        token_versions=np.zeros(1, np.int32), finish_reason="stop", reward=reward)


def joint_tree(rewards: dict[str, float], agents=("a", "b")) -> list[StepRecord]:
    """Rows of one episode's joint tree: `rewards` maps a joint action's tree path ("1.0")
    to its joint reward; every agent gets a row per joint action (aligned joint mode)."""
    rows = []
    for path, reward in rewards.items():
        *parent, candidate = path.split(".")
        branch = ".".join(parent)
        siblings = sum(1 for p in rewards if p.rpartition(".")[0] == branch)
        for agent in agents:
            rows.append(record(len(rows), reward=reward, episode="e", agent=agent,
                               turn=len(parent), branch=branch, candidate=int(candidate),
                               group_size=siblings))
    return rows


def columns(rows: list[StepRecord]) -> tuple:
    """(rewards, group ids, episodes, agents, turns, branches, candidates) of `rows`."""
    return (np.array([r.reward for r in rows]), [r.group_key for r in rows],
            [r.episode_id for r in rows], [r.agent for r in rows],
            np.array([r.turn for r in rows]), [r.branch for r in rows],
            np.array([r.candidate for r in rows]))


def returns_of(rows: list[StepRecord], gamma: float = 1.0) -> np.ndarray:
    rewards, _, *tree = columns(rows)  # joint_returns needs no group ids
    return joint_returns(rewards, *tree, gamma=gamma)


def by_path(rows: list[StepRecord], values: np.ndarray) -> dict[tuple[str, str], float]:
    """values keyed by (agent, tree path of the row)."""
    return {(r.agent, tree_path(r.branch, r.candidate)): float(v) for r, v in zip(rows, values)}


# Two turns, G = 2, agents a and b. The root node draws joint actions 0 and 1; each is expanded
# into G = 2 children at turn 1:
#
#   root (turn 0)      0: r = 1.0               1: r = 0.5
#   turn 1        0.0: r = 2   0.1: r = 0   1.0: r = 1   1.1: r = 3
TREE = {"0": 1.0, "1": 0.5, "0.0": 2.0, "0.1": 0.0, "1.0": 1.0, "1.1": 3.0}


def test_two_turn_joint_tree_returns_and_advantages():
    rows = joint_tree(TREE)
    # γ = 1. Leaves: R = r. Root: R(0) = 1 + mean(2, 0) = 2; R(1) = 0.5 + mean(1, 3) = 2.5.
    returns = {"0": 2.0, "1": 2.5, "0.0": 2.0, "0.1": 0.0, "1.0": 1.0, "1.1": 3.0}
    got = by_path(rows, returns_of(rows))
    assert got == {(a, p): r for a in "ab" for p, r in returns.items()}
    # Mean baseline within each node's G joint actions: root mean 2.25 -> -0.25, +0.25;
    # node "0" mean 1 -> +1, -1; node "1" mean 2 -> -1, +1.
    centered = {"0": -0.25, "1": 0.25, "0.0": 1.0, "0.1": -1.0, "1.0": -1.0, "1.1": 1.0}
    adv = by_path(rows, magrpo(*columns(rows), std_normalize=False))
    assert adv == pytest.approx({(a, p): v for a in "ab" for p, v in centered.items()})
    # Eq. 1 divides by the group std: a distinct pair has sample std |d|/√2, so A = ±1/√2
    # (less the 1e-6 in the denominator). Both agents of a joint action share its advantage.
    adv = by_path(rows, magrpo(*columns(rows)))
    expected = {(a, p): math.copysign(HALF_SQRT2, v) for a in "ab" for p, v in centered.items()}
    assert adv == pytest.approx(expected, rel=1e-5)


def test_discount_scales_the_mean_child_return():
    rows = joint_tree(TREE)
    # γ = 0.5: R(0) = 1 + 0.5·mean(2, 0) = 1.5; R(1) = 0.5 + 0.5·mean(1, 3) = 1.5. Equal
    # returns give exactly 0 at the root; the leaves keep their rewards and advantages.
    got = by_path(rows, returns_of(rows, gamma=0.5))
    assert got[("a", "0")] == got[("b", "1")] == 1.5
    adv = by_path(rows, magrpo(*columns(rows), gamma=0.5, std_normalize=False))
    assert adv[("a", "0")] == adv[("b", "1")] == 0.0
    assert adv[("a", "1.1")] == adv[("b", "1.1")] == pytest.approx(1.0)


def test_parallel_rollouts_are_discounted_return_to_go():
    # Parallel joint sampling (DESIGN §4): G = 2 episodes of one round, empty branches,
    # candidate = round index, one agent, 3 turns. γ = 0.5:
    #   e0 rewards 1, 0, 4 -> R2 = 4, R1 = 0 + 0.5·4 = 2, R0 = 1 + 0.5·2 = 2 (= 1 + 0 + 0.25·4)
    #   e1 rewards 0, 2, 0 -> R2 = 0, R1 = 2 + 0 = 2,     R0 = 0 + 0.5·2 = 1
    # Groups are (agent, turn) across the two episodes: turn 0 {2, 1} -> +0.5, -0.5;
    # turn 1 {2, 2} -> 0; turn 2 {4, 0} -> +2, -2.
    rewards = {("e0", 0): 1.0, ("e0", 1): 0.0, ("e0", 2): 4.0,
               ("e1", 0): 0.0, ("e1", 1): 2.0, ("e1", 2): 0.0}
    rows = [record(i, reward=r, episode=e, agent="a", turn=t, branch="", candidate=int(e[1]),
                   group_size=2) for i, ((e, t), r) in enumerate(rewards.items())]
    returns = returns_of(rows, gamma=0.5)
    np.testing.assert_allclose(returns, [2, 2, 4, 1, 2, 0])
    adv = magrpo(*columns(rows), gamma=0.5, std_normalize=False)
    np.testing.assert_allclose(adv, [0.5, 0, 2, -0.5, 0, -2], atol=1e-7)


def test_a_branch_terminated_early_is_a_leaf():
    # Joint action 0 reached the workflow's threshold and was not expanded; joint action 1 was.
    #   R(0) = 1.0 (a leaf: its reward);  R(1) = 0.25 + mean(0.5, 0.25) = 0.625
    # Root mean 0.8125 -> +0.1875, -0.1875; node "1" mean 0.375 -> +0.125, -0.125.
    rows = joint_tree({"0": 1.0, "1": 0.25, "1.0": 0.5, "1.1": 0.25})
    got = by_path(rows, returns_of(rows))
    assert got[("a", "0")] == 1.0 and got[("b", "1")] == 0.625
    adv = by_path(rows, magrpo(*columns(rows), std_normalize=False))
    assert adv == pytest.approx({(a, p): v for a in "ab" for p, v in
                                 {"0": 0.1875, "1": -0.1875, "1.0": 0.125, "1.1": -0.125}.items()})


def test_singleton_groups_give_zero():
    # G = 1: a round of one episode; each (agent, turn) group holds one row. The return still
    # sums the turns (2 + 3 = 5), but there is nothing to compare it with.
    rows = [record(i, reward=r, episode="e", agent=a, turn=t, branch="", candidate=0,
                   group_size=1) for i, (a, t, r) in enumerate([("a", 0, 2.0), ("b", 0, 2.0),
                                                                  ("a", 1, 3.0), ("b", 1, 3.0)])]
    np.testing.assert_allclose(returns_of(rows), [5, 5, 3, 3])
    adv = magrpo(*columns(rows))
    assert adv.dtype == np.float32 and (adv == 0.0).all()


def test_each_model_sees_the_same_advantages_from_its_own_agents_rows():
    # Agents on separate models: each learner's table holds only its agent's rows.
    rows = joint_tree(TREE)
    both = magrpo(*columns(rows))
    only_a = [r for r in rows if r.agent == "a"]
    np.testing.assert_array_equal(magrpo(*columns(only_a)),
                                  both[[r.agent == "a" for r in rows]])


def test_a_missing_row_of_one_agent_changes_no_return():
    # A FAILED row leaves agent b's node "0" with one row (whose own path nobody continued);
    # agent a's row of that joint action still marks the node as branched.
    rows = joint_tree(TREE)
    kept = [r for r in rows if (r.agent, tree_path(r.branch, r.candidate)) != ("b", "0.1")]
    full = by_path(rows, returns_of(rows))
    got = by_path(kept, returns_of(kept))
    assert got == {k: v for k, v in full.items() if k in got}


def test_agents_of_one_joint_action_must_share_its_reward():
    rows = joint_tree({"0": 1.0, "1": 0.0})
    rewards, *rest = columns(rows)
    rewards[1] = 0.5  # agent b's row of joint action 0
    with pytest.raises(ValueError, match="joint action .*candidate 0.* team reward"):
        magrpo(rewards, *rest)
    rewards[1] = np.nan
    with pytest.raises(ValueError, match="no reward"):
        magrpo(rewards, *rest)


def test_magrpo_from_table():
    rows = joint_tree(TREE)
    cfg = LearnerConfig(advantage="magrpo", magrpo_gamma=0.5, std_normalize=False)
    np.testing.assert_array_equal(
        compute_advantages(cfg, records_to_table(rows)),
        magrpo(*columns(rows), gamma=0.5, std_normalize=False))
    assert readiness_unit("magrpo") == "episode" and "magrpo" in ADVANTAGES


@pytest.mark.parametrize("fields", [
    {"advantage": "magrpo", "magrpo_gamma": 1.5},
    {"advantage": "magrpo", "magrpo_gamma": -0.1},
    {"advantage": "magrpo", "magrpo_gamma": float("nan")},
    {"advantage": "grpo", "magrpo_gamma": 0.9},  # only MAGRPO discounts
])
def test_bad_magrpo_gamma_names_the_field(fields):
    with pytest.raises(ValueError, match=f"LearnerConfig.magrpo_gamma={fields['magrpo_gamma']}"):
        LearnerConfig(**fields)


def test_magrpo_gamma_merges_from_overrides():
    merged = OmegaConf.merge(OmegaConf.structured(LearnerConfig),
                             OmegaConf.from_dotlist(["advantage=magrpo", "magrpo_gamma=0.9"]))
    assert OmegaConf.to_object(merged).magrpo_gamma == 0.9
    with pytest.raises(ValueError, match="LearnerConfig.magrpo_gamma=2.0 is invalid: use a disc"):
        OmegaConf.to_object(OmegaConf.merge(merged, {"magrpo_gamma": 2.0}))






def test_delta_is_a_reward_transform_not_an_estimator():
    assert "delta" not in ADVANTAGES
