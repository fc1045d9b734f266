"""Shared by the learner backend tests: a tiny random Llama on disk and a TrainBatch builder."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from buffers.schema import StepRecord, records_to_table
from learners.batch import TrainBatch, build_train_batch

VOCAB = 64
PAD = 0


def write_tiny_llama(path: str) -> str:
    """A randomly initialised 2-layer Llama (hidden 32, 4 heads, 2 KV heads, vocab 64) with a
    word-level tokenizer, saved as a HF folder at `path`."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, pad_token_id=PAD)
    LlamaForCausalLM(config).save_pretrained(path)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="t1"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t1",
                            pad_token="t0").save_pretrained(path)
    return path


def make_table(responses, behavior=None, prompt=(5, 6, 7), rewards=None, turns=None) -> pa.Table:
    """Rows of one episode and agent in STEP_SCHEMA: the given responses, behaviour logprobs
    (default −4 per token), rewards (default 0) and turns (default all 0: one group)."""
    records = [
        StepRecord(
            step_id=f"s{i}", run_id="r", model_id="m", agent="a", workflow="w", task_id="t",
            episode_id="e", branch="", turn=turns[i] if turns else 0, group_key=b"k" * 16,
            group_size=len(responses), candidate=i, prompt_ids=np.array(prompt, np.int32),
            response_ids=np.array(r, np.int32),
            behavior_logprobs=np.array(behavior[i] if behavior else [-4.0] * len(r), np.float32),
            token_versions=np.zeros(len(r), np.int32), finish_reason="stop",
            reward=rewards[i] if rewards else 0.0,
        )
        for i, r in enumerate(responses)
    ]
    return records_to_table(records)


def make_batch(responses, advantages, behavior=None, prompt=(5, 6, 7)) -> TrainBatch:
    """One group of rows with the given responses, advantages and behaviour logprobs."""
    table = make_table(responses, behavior, prompt)
    return build_train_batch(table, np.array(advantages, np.float32), PAD)


def policy_logprobs(lrn, responses) -> list[list[float]]:
    """The learner's current logprobs of each response, per row (what an engine serving its
    weights would report as behaviour logprobs)."""
    probe = make_batch(responses, [0.0] * len(responses))
    current = lrn.logprobs(probe)
    return [current[i][probe.loss_mask[i] > 0].tolist() for i in range(len(responses))]


def on_policy_batch(lrn, responses, advantages) -> TrainBatch:
    """Behaviour logprobs = the learner's own, as if sampled by an engine at its version."""
    return make_batch(responses, advantages, policy_logprobs(lrn, responses))
