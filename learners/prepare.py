"""Rows -> the train batch a learner step consumes: KL penalty, advantages, tensors (DESIGN §6).

`prepare_batch` is the one call between a sampled table and `Learner.train_step`. Most
estimators need nothing but the rows; REINFORCE++ with `reward_kl_beta` > 0 (MAPPA eq. 1)
also needs each action's KL to the reference policy, which only the learner can compute —
hence the learner argument. Build order: tensors first (the reference forward reads them),
then the per-row KL, then advantages, set into the same tensors.

Tiny-CPU check: `python -m pytest tests/unit/test_learner_contract.py -k prepare`.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

from learners.advantages import compute_advantages
from learners.batch import TrainBatch, build_train_batch, with_advantages
from learners.config import LearnerConfig
from learners.protocol import Learner


def row_kl(
    behavior_logprobs: torch.Tensor, reference_logprobs: torch.Tensor, loss_mask: torch.Tensor
) -> np.ndarray:
    """Each row's mean per-token KL to the reference: k1 at the sampled tokens.

    KL_b = (1 / R_b) Σ_k (log π_behav(y_k) − log π_ref(y_k)) over the R_b response tokens.
    The tokens were sampled from the behaviour policy, so k1 is an unbiased estimate of
    KL(π_behav ‖ π_ref) per token: the divergence of the policy that took the action, which is
    what the action's reward should be charged for (MAPPA eq. 2; OpenRLHF's REINFORCE++ uses
    k1 of the rollout policy too). Current-policy logprobs would measure KL(π_θ ‖ π_ref) only
    with an importance weight, and would cost a second policy forward; the behaviour logprobs
    are in the batch already. One row's k1 can be negative; its expectation cannot.

    Args:
        behavior_logprobs, reference_logprobs, loss_mask: float32 [B, L] (batch alignment).

    Returns:
        float64 [B]; 0 for a row with no response tokens.
    """
    tokens = loss_mask.sum(-1)
    log_ratio = (behavior_logprobs - reference_logprobs) * loss_mask
    per_row = log_ratio.double().sum(-1) / tokens.double().clamp(min=1.0)
    return per_row.numpy()


def prepare_batch(
    learner: Learner, cfg: LearnerConfig, table: pa.Table, pad_id: int
) -> tuple[TrainBatch, np.ndarray, dict[str, float]]:
    """The train batch of `table`, its per-row advantages, and scalar metrics.

    With `cfg.reward_kl_beta` > 0, runs the learner's reference forward (no gradient) and
    charges each action r_t − β·KL_t (`row_kl`) before the return (MAPPA eq. 1).

    Args:
        learner: the model's learner (used only for `reference_logprobs`, when β > 0).
        cfg: its config.
        table: N rows in STEP_SCHEMA, every one rewarded.
        pad_id: padding token id.

    Returns:
        (TrainBatch of the N rows with advantages set; advantages float32 [N]; metrics:
        `reward_kl_mean` and `reward_kl_penalty_mean` (row means of KL_t and β·KL_t) when
        β > 0, else empty).
    """
    batch = build_train_batch(table, np.zeros(table.num_rows, np.float32), pad_id)
    kl = None
    metrics: dict[str, float] = {}
    if cfg.reward_kl_beta > 0:
        reference = learner.reference_logprobs(batch)
        kl = row_kl(batch.behavior_logprobs, reference, batch.loss_mask)
        metrics["reward_kl_mean"] = float(kl.mean()) if len(kl) else 0.0
        metrics["reward_kl_penalty_mean"] = cfg.reward_kl_beta * metrics["reward_kl_mean"]
    advantages = compute_advantages(cfg, table, kl)
    return with_advantages(batch, advantages), advantages, metrics
