"""What every learner backend must do alike (the Learner protocol of DESIGN §6), run on each.

Backend-specific behaviour (megatron's parity with torch, bf16, checkpoint formats) stays in
test_torch_learner.py and test_megatron_learner.py.
"""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from learners.config import LearnerConfig
from learners.protocol import build_learner
from tiny_learner import make_batch, on_policy_batch, write_tiny_llama

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
