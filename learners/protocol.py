"""The learner protocol every backend implements, and the registry that builds one (DESIGN §6).

Callers (the runtime) see only `Learner`, `WeightRef` and `build_learner`. Backends are named
by import path and imported on first use, so this module stays free of torch and of any
backend's heavy imports: "torch" (transformers + AdamW) and "megatron" (megatron-core, the
default) are one registry line each.

Both backends write folders the same way, through the helpers here: a published version
(`publish_folder`) appears complete or not at all, and a checkpoint (`replace_folder`)
replaces the previous one without a moment where neither is complete.
"""
from __future__ import annotations

import importlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from learners.batch import TrainBatch
    from learners.config import LearnerConfig


@dataclass(frozen=True)
class WeightRef:
    """A published policy: what engines load and stamp onto the rows they generate.

    Attributes:
        model_id: the physical model these weights belong to.
        version: the learner version v_m they were published at (DESIGN §5).
        path: a folder holding a HF checkpoint (config, safetensors, tokenizer files).
    """

    model_id: str
    version: int
    path: str


class Learner(Protocol):
    """One model's trainer. Plain class: the runtime wraps it with `ray.remote` at spawn time."""

    @property
    def version(self) -> int:
        """Number of train steps applied so far (v_m)."""
        ...

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Per-token logprobs of `batch.target_ids` under the current policy, no gradient.

        Returns:
            float32 [B, L], aligned with `batch.loss_mask` (0 where the mask is 0).
        """
        ...

    def reference_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Per-token logprobs of `batch.target_ids` under the frozen reference policy (the
        initial weights), no gradient. Built when `kl_beta > 0` or `reward_kl_beta > 0`;
        otherwise a ValueError naming those fields.

        Returns:
            float32 [B, L], aligned with `batch.loss_mask` (0 where the mask is 0).
        """
        ...

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """Apply one decoupled-PPO update on `batch`; returns scalar metrics as floats."""
        ...

    def publish_weights(self, version: int) -> WeightRef:
        """Write the current weights as a loadable HF folder for `version`."""
        ...

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The current weights by HF name, on the CPU, copies the next step does not touch."""
        ...

    def save(self, path: str) -> None:
        """Checkpoint everything needed to resume training bit-for-bit into folder `path`."""
        ...

    def load(self, path: str) -> None:
        """Restore a checkpoint written by `save`."""
        ...


def version_folder(weights_dir: str, version: int) -> str:
    """`{weights_dir}/v{version}`, which must not exist yet: versions are immutable."""
    final = os.path.join(weights_dir, f"v{version}")
    if os.path.exists(final):
        raise FileExistsError(f"{final} exists; a published version is never overwritten")
    return final


@contextmanager
def publish_folder(final: str) -> Iterator[str]:
    """Yield an empty folder beside `final` and rename it to `final` once the block completes.

    The folder is written under a temporary name in the same directory (one file system, so
    the rename is atomic): readers see it complete or not at all. When the block raises, the
    partial folder is removed and the error propagates.
    """
    parent, name = os.path.split(os.path.abspath(final))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{name}.", dir=parent)
    try:
        yield staging
        os.chmod(staging, 0o755)  # mkdtemp makes it 0700; engines may run as another user
        os.rename(staging, final)
    except BaseException:
        # Deliberate cleanup of the partial folder; the error still propagates.
        shutil.rmtree(staging, ignore_errors=True)
        raise


def replace_folder(staging: str, path: str) -> None:
    """Rename the complete folder `staging` to `path`, replacing a folder already there.

    The old folder is moved aside before the rename and deleted after it, so a crash at any
    point leaves one complete folder (at `path`, or aside under a hidden name).
    """
    if not os.path.exists(path):
        os.rename(staging, path)
        return
    previous = tempfile.mkdtemp(prefix=".old.", dir=os.path.dirname(os.path.abspath(path)))
    os.rename(path, os.path.join(previous, "ckpt"))
    os.rename(staging, path)
    shutil.rmtree(previous)


# name -> "module:Class"; imported lazily by build_learner.
LEARNERS: dict[str, str] = {
    "torch": "learners.torch_backend:TorchLearner",
    "megatron": "learners.megatron.learner:MegatronLearner",
}


def build_learner(
    cfg: LearnerConfig, model_id: str, model_path: str, weights_dir: str
) -> Learner:
    """Build the backend named by `cfg.backend`.

    Args:
        cfg: the learner config (already validated).
        model_id: the physical model this learner trains.
        model_path: a HF folder with the initial weights and tokenizer.
        weights_dir: where published versions go, as `{weights_dir}/v{version}`.
    """
    if cfg.backend not in LEARNERS:
        raise ValueError(
            f"LearnerConfig.backend={cfg.backend!r} is not registered; "
            f"use one of {sorted(LEARNERS)}"
        )
    if cfg.dtype == "auto":
        raise ValueError(
            "LearnerConfig.dtype='auto' reached a learner unresolved; the runtime resolves it "
            "(runtime.dtype.resolve_dtype) — outside a run pass 'float32' or 'bfloat16'"
        )
    module_name, class_name = LEARNERS[cfg.backend].split(":")
    backend_class = getattr(importlib.import_module(module_name), class_name)
    return backend_class(cfg, model_id, model_path, weights_dir)
