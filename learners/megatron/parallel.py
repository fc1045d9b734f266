"""torch.distributed and megatron-core's parallel_state for one learner process (DESIGN §6).

Two ways a learner process joins a process group:

- launched by a multi-process launcher (torchrun, or a test's `torch.multiprocessing.spawn`):
  the group already exists, or `RANK`/`WORLD_SIZE`/`MASTER_ADDR`/`MASTER_PORT` describe it;
  world size = TP × PP × DP;
- inside the runtime's Ray LearnerWorker: nothing is set, so the learner starts a world of one
  on a free loopback port (gloo on CPU, NCCL with CUDA) when TP = PP = 1, or spawns its
  follower ranks first (`learners.megatron.ranks`) when TP × PP > 1.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from actors.engines.supervision import free_port
from learners.megatron import compat
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed


@dataclass(frozen=True)
class ParallelLayout:
    """This rank's place in the TP × PP × DP grid."""

    tp_size: int
    pp_size: int
    dp_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def init_parallel(tensor_parallel: int, pipeline_parallel: int, seed: int) -> ParallelLayout:
    """Join (or start) the process group and set megatron's TP/PP/DP groups; DP is the rest.

    Re-entrant: a second learner in the same process with the same sizes reuses the groups;
    with other sizes the groups are rebuilt.

    Raises:
        ValueError: when the world size is not a multiple of TP × PP.
    """
    if not dist.is_initialized():
        backend = "nccl" if compat.cuda_present() else "gloo"
        if "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(
                backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                world_size=1)
    world = dist.get_world_size()
    if world % (tensor_parallel * pipeline_parallel):
        raise ValueError(
            f"learner.tensor_parallel={tensor_parallel} × learner.pipeline_parallel="
            f"{pipeline_parallel} does not divide the world size {world}; launch "
            f"TP × PP × DP processes (inside the Ray runtime the world is 1: use 1 and 1)")
    if parallel_state.model_parallel_is_initialized():
        same = (parallel_state.get_tensor_model_parallel_world_size() == tensor_parallel
                and parallel_state.get_pipeline_model_parallel_world_size() == pipeline_parallel)
        if not same:
            parallel_state.destroy_model_parallel()
    if not parallel_state.model_parallel_is_initialized():
        with compat.device_scope():
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=tensor_parallel,
                pipeline_model_parallel_size=pipeline_parallel)
    compat.install()
    # Seeds the per-TP-rank RNG streams megatron's layers fork into (dropout, init).
    model_parallel_cuda_manual_seed(seed)
    return ParallelLayout(
        tp_size=tensor_parallel,
        pp_size=pipeline_parallel,
        dp_size=parallel_state.get_data_parallel_world_size(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
    )


def is_writer() -> bool:
    """Global rank 0 writes shared files (published weights, checkpoint metadata)."""
    return dist.get_rank() == 0


def tensors_to_cpu(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached CPU copies, skipping megatron's `_extra_state` entries (not weights)."""
    return {name: tensor.detach().cpu() for name, tensor in state.items()
            if not name.endswith("_extra_state") and tensor is not None}
