"""The policy loss: decoupled PPO with the behaviour correction always on (DESIGN §6), and the
per-token logprobs both learner backends feed it (`token_logprobs`).

Pure torch on [B, T] tensors; metrics are detached 0-d tensors so the caller decides when to
synchronise with the host (never inside the micro-batch loop).
"""
from __future__ import annotations

import torch

from learners.config import BEHAVIOR_CORRECTIONS


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` over positions where `mask` is 1; 0 for an empty mask. Both [B, T]."""
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def token_logprobs(logits: torch.Tensor, target_ids: torch.Tensor, loss_mask: torch.Tensor,
                   temperature: float, entropy: str = "none"
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs of `target_ids` and per-token entropy at the rollout temperature.

    Args:
        logits: [B, L, V] (V = the HF vocabulary: megatron's padding rows already cut off).
        target_ids, loss_mask: [B, L].
        entropy: "none" (skip: a full-vocabulary softmax saved), "metric" (no gradient) or
            "grad" (differentiable, for an entropy bonus).

    Returns:
        (logprobs float32 [B, L], 0 off the mask; entropy float32 [B, L] or None).
    """
    # float32 before the softmax: bf16 log-softmax errors are as large as the corrections.
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    log_norm = torch.logsumexp(logits, dim=-1)
    target_logits = logits.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)
    logprobs = torch.where(loss_mask > 0, target_logits - log_norm, 0.0)
    if entropy == "none":
        return logprobs, None
    source = logits if entropy == "grad" else logits.detach()
    norm = log_norm if entropy == "grad" else log_norm.detach()
    return logprobs, norm - (torch.softmax(source, -1) * source).sum(-1)


def decoupled_ppo_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
    behavior_correction: str,
    behavior_cap: float,
    ref_logp: torch.Tensor | None = None,
    kl_beta: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled PPO objective (AReaL, "decoupled PPO"; DESIGN §6), masked token mean.

    The behaviour policy that sampled the tokens (an older engine version, maybe bf16) and the
    proximal policy that anchors the trust region (the learner's weights before this step) are
    kept apart:

        u = exp(logp − prox_logp)                 trust-region ratio, clipped to [1−ε_lo, 1+ε_hi]
        w = exp(prox_logp − behav_logp)           off-policy importance weight, no gradient
        w′ = min(w, c)                            behavior_correction="tis" (truncated IS)
        w′ = w · 1[1/c ≤ w ≤ c]                   behavior_correction="mask"
        loss_tok = −w′ · min(u·A, clip(u, 1−ε_lo, 1+ε_hi)·A)
                   + kl_beta · k3,  k3 = exp(ref − logp) − (ref − logp) − 1   (if ref_logp given)

    With prox = behav (on-policy) w = 1 and this is the PPO clipped surrogate of MAPPA appendix
    E.3 eq. 5 with an asymmetric clip.

    Args:
        logp: [B, T] logprobs of the target tokens under π_θ (with gradient).
        prox_logp: [B, T] logprobs under the proximal policy (no gradient needed).
        behav_logp: [B, T] logprobs the engine reported when sampling.
        advantages: [B, T] per-token advantage (a row's advantage broadcast to its tokens).
        mask: [B, T] float, 1 on tokens that count.
        clip_eps_low, clip_eps_high: ε_lo, ε_hi.
        behavior_correction: "tis" or "mask".
        behavior_cap: c ≥ 1.
        ref_logp: [B, T] logprobs under the frozen reference policy, or None.
        kl_beta: weight of the k3 reference-KL term.

    Returns:
        (loss 0-d with gradient, metrics of detached 0-d tensors: clip_fraction,
        importance_weight_mean, importance_weight_max, truncated_fraction, approx_kl, and
        kl_ref when ref_logp is given). Means are over masked tokens.
    """
    if behavior_correction not in BEHAVIOR_CORRECTIONS:
        raise ValueError(
            f"behavior_correction={behavior_correction!r}: use one of {BEHAVIOR_CORRECTIONS}"
        )
    mask = mask.to(logp.dtype)
    log_ratio = logp - prox_logp.detach()
    ratio = torch.exp(log_ratio)
    weight = torch.exp(prox_logp.detach() - behav_logp.detach())
    if behavior_correction == "tis":
        corrected = torch.clamp(weight, max=behavior_cap)
    else:
        inside = (weight >= 1.0 / behavior_cap) & (weight <= behavior_cap)
        corrected = weight * inside.to(weight.dtype)

    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    # max of the negated terms == −min(u·A, clip(u)·A): the pessimistic bound.
    token_loss = corrected * torch.maximum(unclipped, clipped)

    metrics: dict[str, torch.Tensor] = {}
    if ref_logp is not None and kl_beta > 0:
        ref_log_ratio = ref_logp.detach() - logp
        k3 = torch.exp(ref_log_ratio) - ref_log_ratio - 1.0
        token_loss = token_loss + kl_beta * k3
        metrics["kl_ref"] = masked_mean(k3.detach(), mask)
    loss = masked_mean(token_loss, mask)

    with torch.no_grad():
        active = mask > 0
        metrics["clip_fraction"] = masked_mean((clipped > unclipped).to(mask.dtype), mask)
        metrics["importance_weight_mean"] = masked_mean(weight, mask)
        # w > 0 everywhere, so 0 is a safe fill for masked positions (and an empty mask).
        metrics["importance_weight_max"] = torch.where(active, weight, 0.0).max()
        metrics["truncated_fraction"] = masked_mean((corrected != weight).to(mask.dtype), mask)
        # Schulman's k3 estimator of KL(π_prox ‖ π_θ): u − 1 − log u ≥ 0.
        metrics["approx_kl"] = masked_mean(ratio - 1.0 - log_ratio, mask)
    return loss, metrics
