"""Checkpoints of the megatron learner: megatron's dist checkpointing plus RNG and metadata.

A checkpoint folder (DESIGN §10 `checkpoints/`):

    dist/                 weights and optimizer state, megatron dist checkpointing (torch_dist);
                          every rank writes its own shards, so any TP/PP/DP layout saves in
                          parallel
    rng_rank<r>.pt        torch CPU RNG, megatron's tracker states (and CUDA RNG) of rank r
    meta.json             model_id, version, world_size (written by rank 0 last)

It is written under `<path>.staging` and renamed into place by rank 0, so a crash leaves the
previous checkpoint intact.
"""
from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist

from learners.megatron import compat
from learners.megatron.parallel import is_writer
from learners.protocol import replace_folder
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

META_FILE = "meta.json"
DIST_DIR = "dist"


def _sharded_state(module, optimizer, is_loading: bool) -> dict:
    model_state = module.sharded_state_dict()
    return {"model": model_state,
            "optimizer": optimizer.sharded_state_dict(model_state, is_loading=is_loading)}


def _barrier() -> None:
    if dist.get_world_size() > 1:
        dist.barrier()


def save_checkpoint(path: str, module, optimizer, meta: dict) -> None:
    """Write weights and optimizer state of `module` (the unwrapped GPTModel), RNG and `meta`."""
    path = os.path.abspath(path)
    staging = path + ".staging"
    if is_writer():
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(os.path.join(staging, DIST_DIR))
    _barrier()
    with compat.device_scope():
        dist_checkpointing.save(_sharded_state(module, optimizer, is_loading=False),
                                os.path.join(staging, DIST_DIR),
                                sharded_strategy=get_default_save_sharded_strategy("torch_dist"))
    rng = {"torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if compat.cuda_present():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(rng, os.path.join(staging, f"rng_rank{dist.get_rank()}.pt"))
    _barrier()
    if is_writer():
        with open(os.path.join(staging, META_FILE), "w") as f:
            json.dump({**meta, "world_size": dist.get_world_size()}, f)
        replace_folder(staging, path)
    _barrier()


def read_meta(path: str) -> dict:
    """The checkpoint's metadata; raises ValueError when its world size is not this one."""
    with open(os.path.join(path, META_FILE)) as f:
        meta = json.load(f)
    if meta["world_size"] != dist.get_world_size():
        raise ValueError(
            f"checkpoint {path} was written by {meta['world_size']} ranks, this learner has "
            f"{dist.get_world_size()}; resume with the same tensor/pipeline/data sizes")
    return meta


def load_checkpoint(path: str, module, optimizer) -> None:
    """Restore weights, optimizer state and this rank's RNG states from `path`."""
    with compat.device_scope():
        state = dist_checkpointing.load(_sharded_state(module, optimizer, is_loading=True),
                                        os.path.join(path, DIST_DIR))
        module.load_state_dict(state["model"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
    rng = torch.load(os.path.join(path, f"rng_rank{dist.get_rank()}.pt"), weights_only=False)
    torch.set_rng_state(rng["torch"])
    get_cuda_rng_tracker().set_states(rng["tracker"])
    if "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"])
