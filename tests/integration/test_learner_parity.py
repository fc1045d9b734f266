"""Engine behaviour logprobs == the learner's recomputed logprobs, through the real row path.

Engine → Episode rows (StepRecord) → Arrow table → TrainBatch → TorchLearner.logprobs: the
same path a training step takes, so a misaligned token or a temperature not applied shows up
here. Tolerance: fp32 on both sides agrees to ~1e-6 on this CPU; 1e-3 is the stated bound.
"""
import asyncio

import numpy as np
import torch

from actors.engines.client import EngineClient
from actors.episode import Episode, ModelRoute, SamplingParams
from buffers.schema import records_to_table
from learners.batch import build_train_batch
from learners.config import LearnerConfig
from learners.protocol import build_learner

TOLERANCE = 1e-3


def sample_rows(url, model_path, temperature):
    from transformers import AutoTokenizer

    async def play():
        client = EngineClient(url)
        route = ModelRoute("tiny", [client], AutoTokenizer.from_pretrained(model_path))
        ep = Episode(run_id="r", workflow="w", task_id="t", round_id="x", round_size=1,
                     round_index=0, group_size=4, agent_models={"a": "tiny"},
                     routes={"tiny": route}, sampling=SamplingParams(temperature, 1.0))
        await ep.act("a", [{"role": "user", "content": "what is 2 + 3 ?"}], turn=0, n=4,
                     max_new_tokens=12)
        await ep.act("a", [{"role": "user", "content": "target 3"}], turn=1, n=2,
                     max_new_tokens=6)
        await client.aclose()
        return ep.records()["tiny"]

    return asyncio.run(play())


def test_engine_logprobs_match_learner_recompute(tiny_engine, tmp_path):
    for temperature in (1.0, 0.7):
        records = sample_rows(tiny_engine.url, tiny_engine.weights_path, temperature)
        table = records_to_table(records)
        batch = build_train_batch(table, np.zeros(len(records), np.float32), pad_id=1)
        learner = build_learner(LearnerConfig(temperature=temperature), "tiny",
                                str(tiny_engine.weights_path), str(tmp_path / "w"))
        recomputed = learner.logprobs(batch)
        mask = batch.loss_mask.bool()
        diff = (recomputed[mask] - batch.behavior_logprobs[mask]).abs().max().item()
        print(f"T={temperature}: max |engine − learner| logprob = {diff:.2e} over "
              f"{int(mask.sum())} tokens")
        assert int(mask.sum()) == sum(len(r.response_ids) for r in records)
        assert diff < TOLERANCE
        assert torch.all(recomputed[~mask] == 0)
