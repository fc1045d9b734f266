"""Tensor, pipeline and data parallelism of MegatronLearner: two gloo processes vs one.

Each case spawns two processes (`torch.multiprocessing.spawn`, gloo on loopback) that build a
MegatronLearner on the tiny model (4 heads, 2 KV heads, 2 layers, a 77-token vocabulary that
TP=2 pads to 78), take logprobs, train two steps and gather the weights back to HF form; the
same sequence then runs in this process at TP = PP = DP = 1. Measured on this CPU the losses
agree to ~1e-6 and the weights after two Adam steps to ~7e-5 (lr 1e-2); the bounds are 1e-5
relative on the losses and 1e-3 on the weights.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from actors.engines.supervision import free_port
from buffers.schema import StepRecord, records_to_table
from learners.batch import build_train_batch
from learners.config import LearnerConfig
from runtime.models import provision_tiny

PAD = 1


def _batch():
    responses = [[20, 21, 22], [30, 31], [40], [41, 42, 43, 44]]
    records = [
        StepRecord(
            step_id=f"s{i}", run_id="r", model_id="m", agent="a", workflow="w", task_id="t",
            episode_id="e", branch="", turn=0, group_key=b"k" * 16, group_size=len(responses),
            candidate=i, prompt_ids=np.array([5, 6, 7], np.int32),
            response_ids=np.array(r, np.int32),
            behavior_logprobs=np.full(len(r), -4.0, np.float32),
            token_versions=np.zeros(len(r), np.int32), finish_reason="stop", reward=0.0,
        )
        for i, r in enumerate(responses)
    ]
    # micro_batch_tokens=16 below makes two micro-batches: one per rank when DP = 2.
    return build_train_batch(records_to_table(records), np.array([1.0, -0.5, 0.3, 0.7],
                                                                 np.float32), PAD)


def _train(model_path: str, weights_dir: str, tensor_parallel: int, pipeline_parallel: int):
    from learners.megatron.learner import MegatronLearner

    cfg = LearnerConfig(backend="megatron", lr=1e-2, micro_batch_tokens=16, num_threads=1,
                        tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel)
    learner = MegatronLearner(cfg, "m", model_path, weights_dir)
    batch = _batch()
    logprobs = learner.logprobs(batch)
    steps = [learner.train_step(batch) for _ in range(2)]
    return logprobs, steps, learner.hf_state_dict()


def _rank(rank: int, port: int, model_path: str, out: str, tensor_parallel: int,
          pipeline_parallel: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    result = _train(model_path, f"{out}/w{rank}", tensor_parallel, pipeline_parallel)
    torch.save(result, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """TP = PP = DP = 1 in this process: the reference every parallel layout must reproduce."""
    model_path = str(provision_tiny())
    return _train(model_path, str(tmp_path_factory.mktemp("single")), 1, 1)


@pytest.mark.parametrize("tensor_parallel,pipeline_parallel", [(2, 1), (1, 2), (1, 1)],
                         ids=["tp2", "pp2", "dp2"])
def test_two_processes_reproduce_one(tensor_parallel, pipeline_parallel, single_process,
                                     tmp_path):
    model_path = str(provision_tiny())
    mp.spawn(_rank, args=(free_port(), model_path, str(tmp_path), tensor_parallel,
                          pipeline_parallel), nprocs=2)
    expected_logprobs, expected_steps, expected_state = single_process
    for rank in range(2):  # every rank reports the same values
        logprobs, steps, state = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        torch.testing.assert_close(logprobs, expected_logprobs, atol=1e-5, rtol=1e-5)
        for got, expected in zip(steps, expected_steps):
            print(f"{tensor_parallel=} {pipeline_parallel=} rank {rank}: loss {got['loss']:.7f} "
                  f"vs {expected['loss']:.7f}, grad norm {got['grad_norm']:.6f} vs "
                  f"{expected['grad_norm']:.6f}")
            for key in ("loss", "grad_norm", "entropy", "importance_weight_mean", "tokens"):
                assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key
        assert set(state) == set(expected_state)
        for name, tensor in expected_state.items():
            torch.testing.assert_close(state[name], tensor, atol=1e-3, rtol=1e-3)


def test_tensor_parallel_learner_as_one_ray_actor(single_process, tmp_path):
    """TP=2 driven as one object, as the runtime drives a learner: rank 0 lives in the actor
    and spawns rank 1, which mirrors every call."""
    import os

    import ray

    from learners.megatron.learner import MegatronLearner

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep sockets on loopback
    started = not ray.is_initialized()  # an earlier run in this session keeps its Ray instance
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False)
    try:
        cfg = LearnerConfig(backend="megatron", lr=1e-2, micro_batch_tokens=16, num_threads=1,
                            tensor_parallel=2)
        actor = ray.remote(MegatronLearner).options(num_cpus=0.5).remote(
            cfg, "m", str(provision_tiny()), str(tmp_path / "weights"))
        batch = _batch()
        logprobs = ray.get(actor.logprobs.remote(batch))
        steps = [ray.get(actor.train_step.remote(batch)) for _ in range(2)]
        ref = ray.get(actor.publish_weights.remote(2))
        ray.get(actor.close.remote())
        ray.kill(actor)
    finally:
        if started:
            ray.shutdown()
    expected_logprobs, expected_steps, expected_state = single_process
    torch.testing.assert_close(logprobs, expected_logprobs, atol=1e-5, rtol=1e-5)
    for got, expected in zip(steps, expected_steps):
        assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5, abs=1e-6)
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
    from safetensors.torch import load_file

    published = load_file(os.path.join(ref.path, "model.safetensors"))
    assert set(published) == set(expected_state)
    for name, tensor in expected_state.items():
        torch.testing.assert_close(published[name], tensor, atol=1e-3, rtol=1e-3)
