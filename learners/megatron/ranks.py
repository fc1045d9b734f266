"""Follower ranks: a TP × PP learner behind one caller (DESIGN §1, §6).

The runtime drives each learner as one plain object inside one Ray actor. A megatron model
split over TP × PP ranks needs that many processes in one process group, so when a
`MegatronLearner` is built with TP × PP > 1 and no process group exists (no launcher set one
up), it becomes rank 0 and spawns ranks 1 … N−1 as child processes. Every protocol call on
rank 0 is first broadcast to the followers (method name and arguments, pickled over the
process group), and each follower runs the same call on its own learner, so megatron's
collectives line up. The followers exit when rank 0 closes them (also at its interpreter
exit), or with a connection error on their next collective when rank 0's process dies.

With CUDA, rank r uses GPU r of those visible to the caller (a Ray actor that asked for
TP × PP GPUs sees exactly those).
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing
import os

import torch
import torch.distributed as dist

from actors.engines.supervision import free_port

log = logging.getLogger("troupe.megatron")

_CLOSE = "close"


def _backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _join(rank: int, world_size: int, port: int) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(_backend(), init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)


def _follow(rank: int, world_size: int, port: int, learner_args: tuple) -> None:
    """A follower's whole life: join, build the same learner, mirror calls until closed."""
    from learners.megatron.learner import MegatronLearner

    _join(rank, world_size, port)
    learner = MegatronLearner(*learner_args)
    while True:
        message = [None]
        dist.broadcast_object_list(message, src=0)
        method, args = message[0]
        if method == _CLOSE:
            break
        getattr(learner, method)(*args)
    dist.destroy_process_group()


class FollowerRanks:
    """Spawns ranks 1 … N−1 and joins the group as rank 0 (see the module docstring)."""

    def __init__(self, world_size: int, learner_args: tuple) -> None:
        """Args:
            world_size: TP × PP.
            learner_args: the (cfg, model_id, model_path, weights_dir) every rank builds from.
        """
        port = free_port()
        context = multiprocessing.get_context("spawn")
        self._processes = [
            # Not daemonic: megatron's checkpoint writer starts processes of its own.
            context.Process(target=_follow, args=(rank, world_size, port, learner_args),
                            name=f"megatron-rank{rank}")
            for rank in range(1, world_size)
        ]
        for process in self._processes:
            process.start()
        atexit.register(self.close)
        _join(0, world_size, port)
        log.info("megatron learner: rank 0 of %d in pid %d, followers %s", world_size,
                 os.getpid(), [p.pid for p in self._processes])

    def mirror(self, method: str, *args) -> None:
        """Have every follower run `method(*args)` on its learner (rank 0 runs it after)."""
        dead = [p.name for p in self._processes if not p.is_alive()]
        if dead:
            raise RuntimeError(f"megatron follower ranks {dead} died; rebuild the learner "
                               "(it restores from its last checkpoint)")
        dist.broadcast_object_list([(method, args)], src=0)

    def close(self) -> None:
        """Stop the followers (idempotent)."""
        if not self._processes:
            return
        atexit.unregister(self.close)
        if all(p.is_alive() for p in self._processes):
            dist.broadcast_object_list([(_CLOSE, ())], src=0)
        for process in self._processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
        self._processes = []
