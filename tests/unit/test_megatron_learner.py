"""MegatronLearner on a tiny random Llama: logprobs, learning, parity with TorchLearner,
publishing, checkpoint resume (one process, world size 1, gloo on CPU)."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from learners.config import LearnerConfig
from learners.megatron.learner import MegatronLearner
from learners.protocol import WeightRef, build_learner
from learners.torch_backend import TorchLearner
from tiny_learner import make_batch, on_policy_batch, write_tiny_llama

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return write_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama")))


def config(**overrides) -> LearnerConfig:
    return LearnerConfig(**{"backend": "megatron", "lr": 1e-2, "micro_batch_tokens": 16,
                            **overrides})


def learner(model_path, tmp_path, **overrides) -> MegatronLearner:
    return MegatronLearner(config(**overrides), "m", model_path, str(tmp_path / "weights"))


def test_steps_match_torch_learner(model_path, tmp_path):
    # Same loss function, same Adam, same clipping: megatron's machinery reproduces the plain
    # torch loop step for step (fp32 reassociation only).
    batch = make_batch([[20, 21, 22], [30, 31], [40]], [1.0, -0.5, 0.3])
    reference = TorchLearner(config(backend="torch", ppo_epochs=2, grad_clip=5.0), "m",
                             model_path, str(tmp_path / "t"))
    megatron = learner(model_path, tmp_path, ppo_epochs=2, grad_clip=5.0)
    for _ in range(3):
        expected, got = reference.train_step(batch), megatron.train_step(batch)
        for key in ("loss", "grad_norm", "entropy", "importance_weight_mean", "approx_kl",
                    "clip_fraction", "truncated_fraction", "tokens"):
            assert got[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-5), key
    published = megatron.hf_state_dict()
    for name, tensor in reference.model.state_dict().items():
        if name in published:
            torch.testing.assert_close(published[name], tensor, atol=1e-4, rtol=1e-4)


def test_train_steps_reduce_loss_on_a_fixed_batch(model_path, tmp_path):
    # Positive advantages, behaviour = the initial policy, no cap in reach: each step's loss
    # is −(mean importance weight), which falls as the policy raises these responses.
    lrn = learner(model_path, tmp_path, lr=1e-3, behavior_cap=1e3)
    batch = on_policy_batch(lrn, [[20, 21, 22], [30, 31, 32]], [1.0, 1.0])
    before = lrn.logprobs(batch).sum().item()
    losses = []
    for _ in range(4):
        metrics = lrn.train_step(batch)
        assert all(math.isfinite(v) for v in metrics.values()), metrics
        losses.append(metrics["loss"])
    after = lrn.logprobs(batch).sum().item()
    assert losses[0] == pytest.approx(-1.0, abs=1e-5)  # on-policy at the start
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert after > before + 0.1, (before, after)
    assert lrn.version == 4 and metrics["tokens"] == 6.0


def test_publish_weights_writes_a_loadable_hf_folder(model_path, tmp_path):
    lrn = build_learner(config(), "m", model_path, str(tmp_path / "weights"))
    assert isinstance(lrn, MegatronLearner)
    lrn.train_step(make_batch([[20, 21]], [1.0]))
    ref = lrn.publish_weights(1)
    assert ref == WeightRef("m", 1, str(tmp_path / "weights" / "v1"))
    assert os.listdir(tmp_path / "weights") == ["v1"]  # no staging folder left behind
    assert os.path.exists(os.path.join(ref.path, "model.safetensors"))
    loaded = AutoModelForCausalLM.from_pretrained(ref.path, dtype=torch.float32)
    state = lrn.hf_state_dict()
    for name, tensor in loaded.state_dict().items():
        # A tied model's lm_head is not written: transformers re-ties it to the embedding.
        source = state[name] if name in state else state["model.embed_tokens.weight"]
        torch.testing.assert_close(tensor, source, atol=0, rtol=0)
    assert AutoTokenizer.from_pretrained(ref.path)("t3 t4")["input_ids"] == [3, 4]
    with pytest.raises(FileExistsError):
        lrn.publish_weights(1)


def test_bfloat16_trains_and_publishes_bfloat16(model_path, tmp_path):
    lrn = learner(model_path, tmp_path, dtype="bfloat16")
    batch = make_batch([[20, 21, 22], [30]], [1.0, -1.0])
    metrics = [lrn.train_step(batch) for _ in range(2)]
    assert all(math.isfinite(m["loss"]) and m["grad_norm"] > 0 for m in metrics)
    ref = lrn.publish_weights(2)
    with open(os.path.join(ref.path, "config.json")) as f:
        assert json.load(f)["dtype"] == "bfloat16"
    loaded = AutoModelForCausalLM.from_pretrained(ref.path)
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    # Every tensor bf16, the norms too (megatron's local spec builds them in float32), and
    # published exactly as the learner holds them.
    published = load_file(os.path.join(ref.path, "model.safetensors"))
    assert {t.dtype for t in published.values()} == {torch.bfloat16}
    for name, tensor in lrn.hf_state_dict().items():
        if name in published:
            torch.testing.assert_close(published[name], tensor, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_save_load_then_next_step_is_identical(model_path, tmp_path, dtype):
    batch = make_batch([[20, 21, 22], [30, 31]], [1.0, -0.5])
    first = learner(model_path, tmp_path, ppo_epochs=2, dtype=dtype)
    first.train_step(batch)
    first.save(str(tmp_path / "ckpt"))
    first.save(str(tmp_path / "ckpt"))  # overwriting a checkpoint replaces it
    expected = first.train_step(batch)

    resumed = learner(model_path, tmp_path, ppo_epochs=2, seed=123, dtype=dtype)
    resumed.load(str(tmp_path / "ckpt"))
    assert resumed.version == 1
    got = resumed.train_step(batch)
    for key in ("loss", "grad_norm", "approx_kl", "clip_fraction", "entropy"):
        assert got[key] == expected[key], key
    for name, tensor in first.hf_state_dict().items():
        torch.testing.assert_close(resumed.hf_state_dict()[name], tensor, atol=0, rtol=0)
    assert os.listdir(tmp_path) == ["ckpt"]  # no staging leftovers


def test_checkpoint_of_another_model_is_refused(model_path, tmp_path):
    first = learner(model_path, tmp_path)
    first.save(str(tmp_path / "ckpt"))
    other = MegatronLearner(config(), "other", model_path, str(tmp_path / "w2"))
    with pytest.raises(ValueError, match="belongs to model 'm'"):
        other.load(str(tmp_path / "ckpt"))
