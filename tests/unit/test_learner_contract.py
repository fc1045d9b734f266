"""What every learner backend must do alike (the Learner protocol of DESIGN §6), run on each.

Backend-specific behaviour (megatron's parity with torch, bf16, checkpoint formats) stays in
test_torch_learner.py and test_megatron_learner.py.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from learners.advantages import compute_advantages
from learners.batch import build_train_batch
from learners.config import LearnerConfig
from learners.prepare import prepare_batch
from learners.protocol import build_learner
from tiny_learner import (PAD, make_batch, make_table, on_policy_batch, policy_logprobs,
                          write_tiny_llama)

torch.set_num_threads(1)
BACKENDS = ["torch", "megatron"]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return write_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama")))


def learner(backend, model_path, tmp_path, **overrides):
    cfg = LearnerConfig(**{"backend": backend, "lr": 1e-2, "micro_batch_tokens": 16,
                           **overrides})
    return build_learner(cfg, "m", model_path, str(tmp_path / "weights"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_logprobs_match_a_direct_forward(backend, model_path, tmp_path):
    lrn = learner(backend, model_path, tmp_path, temperature=0.7)
    batch = make_batch([[8, 9, 10, 11], [12], [13, 14]], [0.0, 0.0, 0.0])
    got = lrn.logprobs(batch)  # micro_batch_tokens=16 splits the three rows
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, batch.target_ids[..., None])[..., 0]
    mask = batch.loss_mask > 0
    torch.testing.assert_close(got[mask], expected[mask], atol=1e-5, rtol=1e-5)
    assert got.shape == batch.loss_mask.shape and (got[~mask] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_first_step_is_on_policy(backend, model_path, tmp_path):
    # Behaviour = proximal = current weights: u = w = 1, so loss = −(token mean of A).
    lrn = learner(backend, model_path, tmp_path)
    batch = on_policy_batch(lrn, [[20, 21, 22], [30]], [1.0, -1.0])
    metrics = lrn.train_step(batch)
    assert metrics["loss"] == pytest.approx(-(3 * 1.0 - 1.0) / 4, abs=1e-5)
    assert metrics["importance_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["clip_fraction"] == 0.0 and metrics["approx_kl"] == pytest.approx(0, abs=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_reference_kl_is_reported(backend, model_path, tmp_path):
    lrn = learner(backend, model_path, tmp_path, kl_beta=0.1)
    batch = make_batch([[20, 21]], [1.0])
    first = lrn.train_step(batch)
    second = lrn.train_step(batch)
    assert first["kl_ref"] == pytest.approx(0.0, abs=1e-7)  # still the reference weights
    assert second["kl_ref"] > 0.0


def _reference_logprobs(model_path, batch) -> torch.Tensor:
    """Logprobs under the initial weights, from a plain HF forward (temperature 1)."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    return torch.log_softmax(logits, -1).gather(-1, batch.target_ids[..., None])[..., 0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_prepare_batch_charges_the_reference_kl(backend, model_path, tmp_path):
    cfg_fields = {"advantage": "reinforce_pp", "reward_kl_beta": 0.5}
    lrn = learner(backend, model_path, tmp_path, **cfg_fields)
    responses, rewards, turns = [[20, 21, 22], [30], [40, 41]], [1.0, 0.0, 0.5], [0, 1, 2]

    # Sampled at the initial weights: behaviour = reference, so every row's KL is 0.
    table = make_table(responses, policy_logprobs(lrn, responses), rewards=rewards, turns=turns)
    _, _, metrics = prepare_batch(lrn, lrn.cfg, table, PAD)
    assert metrics["reward_kl_mean"] == pytest.approx(0.0, abs=1e-5)

    for _ in range(2):  # move the policy away from the reference
        lrn.train_step(make_batch([[20, 21]], [1.0]))
    table = make_table(responses, policy_logprobs(lrn, responses), rewards=rewards, turns=turns)
    batch, advantages, metrics = prepare_batch(lrn, lrn.cfg, table, PAD)

    # By hand: KL_b = mean over row b's response tokens of (behaviour − reference logprob).
    mask = batch.loss_mask
    ref = _reference_logprobs(model_path, batch)
    kl = (((batch.behavior_logprobs - ref) * mask).sum(-1) / mask.sum(-1)).double().numpy()
    assert np.abs(kl).min() > 1e-3  # the policy did move
    assert metrics["reward_kl_mean"] == pytest.approx(kl.mean(), abs=1e-5)
    assert metrics["reward_kl_penalty_mean"] == pytest.approx(0.5 * kl.mean(), abs=1e-5)
    # r_t − β·KL_t feeds the return-to-go over turns 0, 1, 2 of the one trajectory.
    expected = compute_advantages(lrn.cfg, table, kl)
    np.testing.assert_allclose(advantages, expected, atol=1e-4)
    assert not np.allclose(advantages, compute_advantages(LearnerConfig(advantage="reinforce_pp"),
                                                          table), atol=1e-3)
    torch.testing.assert_close(batch.advantages,
                               build_train_batch(table, advantages, PAD).advantages)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prepare_batch_without_reward_kl(backend, model_path, tmp_path):
    lrn = learner(backend, model_path, tmp_path, advantage="reinforce_pp")
    table = make_table([[20, 21], [30]], rewards=[1.0, 0.0], turns=[0, 1])
    batch, advantages, metrics = prepare_batch(lrn, lrn.cfg, table, PAD)
    assert metrics == {}
    np.testing.assert_array_equal(advantages, compute_advantages(lrn.cfg, table))
    expected = build_train_batch(table, advantages, PAD)
    for name in ("input_ids", "loss_mask", "target_ids", "behavior_logprobs", "advantages"):
        torch.testing.assert_close(getattr(batch, name), getattr(expected, name))
    with pytest.raises(ValueError, match="reward_kl_beta"):  # no reference was built
        lrn.reference_logprobs(batch)


@pytest.mark.parametrize("backend", BACKENDS)
def test_hf_state_dict_is_a_copy_the_next_step_leaves_alone(backend, model_path, tmp_path):
    """Tensor weight sync sends this dict after a step while the next step trains."""
    lrn = learner(backend, model_path, tmp_path)
    before = lrn.hf_state_dict()
    kept = {name: t.clone() for name, t in before.items()}
    lrn.train_step(on_policy_batch(lrn, [[20, 21, 22], [30]], [1.0, -1.0]))
    after = lrn.hf_state_dict()
    assert set(after) == set(before) and all(t.device.type == "cpu" for t in after.values())
    assert any(not torch.equal(after[n], kept[n]) for n in kept)  # the step moved weights
    for name, tensor in before.items():  # ... but not the dict handed out before it
        assert torch.equal(tensor, kept[name]), name
    on_disk = AutoModelForCausalLM.from_pretrained(lrn.publish_weights(1).path,
                                                   dtype=torch.float32).state_dict()
    for name, tensor in after.items():  # the same names and values as the published folder
        torch.testing.assert_close(tensor.float(), on_disk[name], atol=0, rtol=0)


def test_weight_sync_fields_are_checked():
    with pytest.raises(ValueError, match=r"weight_sync='ram'.*'auto', 'disk', 'tensor'"):
        LearnerConfig(weight_sync="ram")
    with pytest.raises(ValueError, match="weights_to_disk_every=0"):
        LearnerConfig(weights_to_disk_every=0)
