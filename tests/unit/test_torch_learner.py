"""TorchLearner on a tiny random Llama: logprobs, learning signal, publishing, resume."""
from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from learners.config import LearnerConfig
from learners.protocol import WeightRef, build_learner
from learners.torch_backend import TorchLearner
from tiny_learner import VOCAB, make_batch, on_policy_batch, write_tiny_llama

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return write_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama")))


def learner(model_path, tmp_path, **overrides) -> TorchLearner:
    cfg = LearnerConfig(**{"lr": 1e-2, "micro_batch_tokens": 16, **overrides})
    return TorchLearner(cfg, "m", model_path, str(tmp_path / "weights"))


def test_positive_advantage_raises_that_responses_logprob(model_path, tmp_path):
    lrn = learner(model_path, tmp_path)
    responses = [[20, 21, 22], [30, 31, 32]]
    batch = on_policy_batch(lrn, responses, [1.0, -1.0])
    before = lrn.logprobs(batch)[0].sum().item()
    for step in range(4):
        metrics = lrn.train_step(batch)
        assert all(math.isfinite(v) for v in metrics.values()), metrics
    after = lrn.logprobs(batch)[0].sum().item()
    assert after > before + 0.1, (before, after)
    assert lrn.version == 4 and metrics["tokens"] == 6.0
    expected_keys = {"loss", "clip_fraction", "importance_weight_mean", "importance_weight_max",
                     "truncated_fraction", "approx_kl", "entropy", "grad_norm", "tokens", "time_s"}
    assert expected_keys <= set(metrics)


def test_publish_weights_writes_a_loadable_hf_folder(model_path, tmp_path):
    lrn = build_learner(dataclasses.replace(LearnerConfig(backend="torch"), lr=1e-2), "m",
                        model_path, str(tmp_path / "weights"))
    lrn.train_step(make_batch([[20, 21]], [1.0]))
    ref = lrn.publish_weights(1)
    assert ref == WeightRef("m", 1, str(tmp_path / "weights" / "v1"))
    assert os.listdir(tmp_path / "weights") == ["v1"]  # no staging folder left behind
    assert os.path.exists(os.path.join(ref.path, "model.safetensors"))
    loaded = AutoModelForCausalLM.from_pretrained(ref.path, dtype=torch.float32)
    for name, tensor in lrn.model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, atol=0, rtol=0)
    assert AutoTokenizer.from_pretrained(ref.path)("t3 t4")["input_ids"] == [3, 4]
    with pytest.raises(FileExistsError):
        lrn.publish_weights(1)


def test_save_load_then_next_step_is_identical(model_path, tmp_path):
    batch = make_batch([[20, 21, 22], [30, 31]], [1.0, -0.5])
    first = learner(model_path, tmp_path, ppo_epochs=2)
    first.train_step(batch)
    first.save(str(tmp_path / "ckpt"))
    first.save(str(tmp_path / "ckpt"))  # overwriting a checkpoint replaces it
    expected = first.train_step(batch)

    resumed = learner(model_path, tmp_path, ppo_epochs=2, seed=123)
    resumed.load(str(tmp_path / "ckpt"))
    assert resumed.version == 1
    got = resumed.train_step(batch)
    for key in ("loss", "grad_norm", "approx_kl", "clip_fraction", "entropy"):
        assert got[key] == expected[key], key
    for name, tensor in first.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[name], tensor, atol=0, rtol=0)
    assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == []  # no staging leftovers


def test_missing_tokenizer_fails_early(tmp_path):
    path = str(tmp_path / "bare")
    LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=1, num_attention_heads=4)).save_pretrained(path)
    with pytest.raises(FileNotFoundError, match="tokenizer_config.json"):
        TorchLearner(LearnerConfig(), "m", path, str(tmp_path / "w"))
