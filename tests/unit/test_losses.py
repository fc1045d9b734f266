"""decoupled_ppo_loss against hand-computed token losses, weights and metrics."""
from __future__ import annotations

import math

import pytest
import torch

from learners.losses import decoupled_ppo_loss

torch.set_num_threads(1)

KW = dict(clip_eps_low=0.2, clip_eps_high=0.28, behavior_correction="tis", behavior_cap=2.0)


def run(ratio, weight, adv, mask=None, **overrides):
    """Build [1, T] inputs with u = ratio and w = weight per token; return loss, metrics, grad."""
    ratio, weight, adv = (torch.tensor([v], dtype=torch.float64) for v in (ratio, weight, adv))
    prox = torch.full_like(ratio, -1.0)
    logp = (prox + ratio.log()).requires_grad_(True)
    behav = prox - weight.log()
    mask = torch.ones_like(ratio) if mask is None else torch.tensor([mask], dtype=torch.float64)
    loss, metrics = decoupled_ppo_loss(logp, prox, behav, adv, mask, **{**KW, **overrides})
    loss.backward()
    return loss, metrics, logp.grad


def test_on_policy_is_minus_mean_advantage():
    loss, m, grad = run([1.0, 1.0], [1.0, 1.0], [1.0, -2.0])
    assert loss.item() == pytest.approx(0.5)  # mean(-1, +2)
    # d/dlogp of −u·A/2 at u = 1: [−0.5, +1.0].
    torch.testing.assert_close(grad, torch.tensor([[-0.5, 1.0]], dtype=torch.float64))
    assert m["clip_fraction"].item() == 0 and m["truncated_fraction"].item() == 0
    assert m["importance_weight_mean"].item() == pytest.approx(1.0)
    assert m["importance_weight_max"].item() == pytest.approx(1.0)
    assert m["approx_kl"].item() == pytest.approx(0.0, abs=1e-12)
    assert all(v.dim() == 0 and not v.requires_grad for v in m.values())


def test_weight_above_cap_truncated_in_tis_and_dropped_in_mask():
    # w = 3 > c = 2, u = 1, A = 1: TIS uses w′ = 2 -> loss −2; mask mode drops the token.
    loss, m, _ = run([1.0], [3.0], [1.0])
    assert loss.item() == pytest.approx(-2.0)
    assert m["truncated_fraction"].item() == 1.0
    assert m["importance_weight_max"].item() == pytest.approx(3.0)
    loss, m, grad = run([1.0], [3.0], [1.0], behavior_correction="mask")
    assert loss.item() == 0.0 and grad.abs().sum().item() == 0.0
    assert m["truncated_fraction"].item() == 1.0


def test_mask_mode_drops_weights_below_one_over_c_and_tis_keeps_them():
    # w = 0.25 < 1/c = 0.5: TIS keeps it (min(w, c) = w), mask mode drops it; w = 1.5 kept.
    loss, m, _ = run([1.0, 1.0], [0.25, 1.5], [1.0, 1.0])
    assert loss.item() == pytest.approx(-(0.25 + 1.5) / 2)
    assert m["truncated_fraction"].item() == 0.0
    assert m["importance_weight_mean"].item() == pytest.approx((0.25 + 1.5) / 2)
    loss, m, _ = run([1.0, 1.0], [0.25, 1.5], [1.0, 1.0], behavior_correction="mask")
    assert loss.item() == pytest.approx(-1.5 / 2)
    assert m["truncated_fraction"].item() == pytest.approx(0.5)


def test_clipping_on_both_sides_with_positive_and_negative_advantages():
    # Token losses (w = 1):
    #   u=1.5, A=+1: min(1.5, 1.28)  = 1.28  -> −1.28, clipped, no gradient
    #   u=0.5, A=−1: min(−0.5, −0.8) = −0.8  -> +0.8,  clipped, no gradient
    #   u=0.5, A=+1: min(0.5, 0.8)   = 0.5   -> −0.5,  unclipped
    #   u=1.5, A=−1: min(−1.5, −1.28) = −1.5 -> +1.5,  unclipped (negative advantage)
    ratio, adv = [1.5, 0.5, 0.5, 1.5], [1.0, -1.0, 1.0, -1.0]
    loss, m, grad = run(ratio, [1.0] * 4, adv)
    assert loss.item() == pytest.approx((-1.28 + 0.8 - 0.5 + 1.5) / 4)
    assert m["clip_fraction"].item() == pytest.approx(0.5)
    # d/dlogp of −u·A/4 = −u·A/4 on unclipped tokens.
    expected = torch.tensor([[0.0, 0.0, -0.5 / 4, 1.5 / 4]], dtype=torch.float64)
    torch.testing.assert_close(grad, expected)
    # approx_kl: mean of u − 1 − log u.
    kl = sum(u - 1 - math.log(u) for u in ratio) / 4
    assert m["approx_kl"].item() == pytest.approx(kl)


def test_masked_tokens_do_not_count():
    loss, m, grad = run([1.0, 5.0], [1.0, 100.0], [2.0, 9.0], mask=[1.0, 0.0])
    assert loss.item() == pytest.approx(-2.0)
    assert m["importance_weight_max"].item() == pytest.approx(1.0)
    assert grad[0, 1].item() == 0.0


def test_reference_kl_term_is_k3():
    # ref − logp = log 2: k3 = 2 − log 2 − 1 = 0.30685; A = 0 so the loss is β·k3.
    adv = torch.zeros(1, 1, dtype=torch.float64)
    logp = torch.zeros(1, 1, dtype=torch.float64, requires_grad=True)
    ref = torch.full((1, 1), math.log(2.0), dtype=torch.float64)
    loss, m = decoupled_ppo_loss(logp, logp.detach(), logp.detach(), adv, torch.ones(1, 1),
                                 ref_logp=ref, kl_beta=0.1, **KW)
    assert m["kl_ref"].item() == pytest.approx(1 - math.log(2.0))
    assert loss.item() == pytest.approx(0.1 * (1 - math.log(2.0)))


def test_unknown_correction_is_rejected():
    with pytest.raises(ValueError, match="behavior_correction"):
        run([1.0], [1.0], [1.0], behavior_correction="clip")
