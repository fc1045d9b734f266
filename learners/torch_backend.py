"""`TorchLearner`: the single-process learner backend (transformers model + torch AdamW).

It runs on CPU (the embedded profile, tests) and implements `learners.protocol.Learner`; the
Megatron backend (tensor/pipeline/data parallel) will sit behind the same protocol.

One `train_step` (DESIGN §6): proximal logprobs are recomputed with the current weights before
any update; then `ppo_epochs` optimizer steps, each accumulating gradients over token-balanced
micro-batches weighted by their share of loss tokens, so every token weighs the same whatever
micro-batch it lands in. Metrics stay tensors until the loops end (one host sync per step).

Tiny-CPU check: `python -m pytest tests/unit/test_torch_learner.py`.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from learners.batch import TrainBatch, micro_batch_indices, micro_batches, select_rows
from learners.config import LearnerConfig
from learners.losses import decoupled_ppo_loss, masked_mean, token_logprobs
from learners.protocol import WeightRef, publish_folder, replace_folder, version_folder

# Files an inference server needs beside the weights to tokenise and apply the chat template.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
STATE_FILE = "learner_state.pt"
META_FILE = "meta.json"


def tokenizer_files(model_path: str) -> list[str]:
    """The tokenizer files of `model_path` that published weights copy along (the engines
    serve a published folder on its own, so it must carry the tokenizer)."""
    names = [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(model_path, name))]
    if "tokenizer_config.json" not in names:
        raise FileNotFoundError(
            f"{model_path} has no tokenizer_config.json; published weights must carry the "
            "tokenizer so an engine can serve them: save the tokenizer into the model folder"
        )
    return names


class TorchLearner:
    """Trains one model with decoupled PPO; see the module docstring for the step structure."""

    def __init__(
        self, cfg: LearnerConfig, model_id: str, model_path: str, weights_dir: str
    ) -> None:
        """Load the model and build the optimizer.

        Args:
            cfg: validated learner config.
            model_id: the physical model this learner trains (stamped on WeightRefs).
            model_path: HF folder with the initial weights and the tokenizer files.
            weights_dir: published versions go to `{weights_dir}/v{version}`.
        """
        torch.set_num_threads(cfg.num_threads)
        torch.manual_seed(cfg.seed)
        self.cfg = cfg
        self.model_id = model_id
        self.model_path = model_path
        self.weights_dir = weights_dir
        self._tokenizer_files = tokenizer_files(model_path)
        self.model = self._load_model()
        # Reference policy: the initial weights, frozen. The loss's k3 term (kl_beta) and the
        # KL penalty in reinforce_pp rewards (reward_kl_beta, MAPPA eq. 1) both measure to it.
        needs_reference = cfg.kl_beta > 0 or cfg.reward_kl_beta > 0
        self.reference = self._load_model().requires_grad_(False) if needs_reference else None
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay
        )
        self._version = 0

    def _load_model(self) -> PreTrainedModel:
        dtype = getattr(torch, self.cfg.dtype)
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype)
        # eval(): no dropout, so π_θ equals the proximal policy at the first micro-batch (u = 1)
        # and the recomputed logprobs match what an engine would report for the same weights.
        return model.eval()

    @property
    def version(self) -> int:
        """Number of train steps applied (v_m, DESIGN §5)."""
        return self._version

    def _token_logprobs(
        self, model: PreTrainedModel, batch: TrainBatch, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logprobs of `batch.target_ids` at temperature `cfg.temperature`.

        Returns:
            (logprobs float32 [B, L], 0 off the loss mask; per-token entropy float32 [B, L],
            differentiable when `cfg.entropy_coef` > 0, or None without `with_entropy`).
        """
        output = model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False
        )
        # Differentiable entropy only when the entropy bonus needs its gradient.
        entropy = "none" if not with_entropy else "grad" if self.cfg.entropy_coef > 0 else "metric"
        return token_logprobs(output.logits, batch.target_ids, batch.loss_mask,
                              self.cfg.temperature, entropy=entropy)

    @torch.no_grad()
    def _batch_logprobs(self, model: PreTrainedModel, batch: TrainBatch) -> torch.Tensor:
        """Logprobs of `batch.target_ids` under `model`, micro-batched, float32 [B, L]."""
        out = torch.zeros(batch.loss_mask.shape, dtype=torch.float32)
        for rows in micro_batch_indices(batch.seq_lens, self.cfg.micro_batch_tokens):
            part = select_rows(batch, rows)
            logprobs, _ = self._token_logprobs(model, part)
            out[rows, : logprobs.shape[1]] = logprobs
        return out

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Current-policy logprobs of `batch.target_ids`, float32 [B, L], 0 off the loss mask."""
        return self._batch_logprobs(self.model, batch)

    def reference_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Reference-policy logprobs of `batch.target_ids`, float32 [B, L], 0 off the mask."""
        if self.reference is None:
            raise ValueError("reference_logprobs: this learner has no reference policy; set "
                             "learner.reward_kl_beta > 0 or learner.kl_beta > 0")
        return self._batch_logprobs(self.reference, batch)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One decoupled-PPO update (`ppo_epochs` optimizer steps); version += 1.

        Returns:
            floats: loss, clip_fraction, importance_weight_mean, importance_weight_max,
            truncated_fraction, approx_kl, entropy (token-weighted means over micro-batches and
            epochs; the max is over all), grad_norm (mean over epochs, before clipping), kl_ref
            (when kl_beta > 0), tokens (loss tokens in the batch), time_s (wall time).
        """
        start = time.perf_counter()
        cfg = self.cfg
        if batch.num_tokens == 0:
            raise ValueError("train_step: the batch has no response tokens")
        parts = [mb for mb in micro_batches(batch, cfg.micro_batch_tokens) if mb.num_tokens > 0]
        # Each micro-batch's share of the batch's loss tokens: Σ share · (masked mean) is the
        # masked mean over the whole batch.
        shares = [mb.num_tokens / batch.num_tokens for mb in parts]
        with torch.no_grad():
            # Proximal policy = these weights before the update (AReaL's decoupled PPO).
            prox = [self._token_logprobs(self.model, mb)[0] for mb in parts]
            if cfg.kl_beta > 0:  # the loss's k3 term (a reference for rewards alone: skip)
                ref = [self._token_logprobs(self.reference, mb)[0] for mb in parts]
            else:
                ref = [None] * len(parts)

        sums: dict[str, torch.Tensor] = {}
        weight_max = torch.zeros(())
        grad_norms = []
        max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
        for _ in range(cfg.ppo_epochs):
            for mb, share, prox_logp, ref_logp in zip(parts, shares, prox, ref):
                logp, entropy = self._token_logprobs(self.model, mb, with_entropy=True)
                loss, metrics = decoupled_ppo_loss(
                    logp,
                    prox_logp,
                    mb.behavior_logprobs,
                    mb.advantages,
                    mb.loss_mask,
                    clip_eps_low=cfg.clip_eps_low,
                    clip_eps_high=cfg.clip_eps_high,
                    behavior_correction=cfg.behavior_correction,
                    behavior_cap=cfg.behavior_cap,
                    ref_logp=ref_logp,
                    kl_beta=cfg.kl_beta,
                )
                mean_entropy = masked_mean(entropy, mb.loss_mask)
                if cfg.entropy_coef > 0:  # exploration bonus: maximise entropy a little
                    loss = loss - cfg.entropy_coef * mean_entropy
                (loss * share).backward()
                metrics["loss"] = loss.detach()
                metrics["entropy"] = mean_entropy.detach()
                weight_max = torch.maximum(weight_max, metrics.pop("importance_weight_max"))
                for name, value in metrics.items():
                    sums[name] = sums.get(name, 0.0) + value * share
            grad_norms.append(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self._version += 1

        names = sorted(sums)
        values = torch.stack(
            [sums[n] / cfg.ppo_epochs for n in names] + [weight_max, torch.stack(grad_norms).mean()]
        ).tolist()  # the one host sync of the step
        result = dict(zip(names + ["importance_weight_max", "grad_norm"], values))
        result["tokens"] = float(batch.num_tokens)
        result["time_s"] = time.perf_counter() - start
        return result

    def publish_weights(self, version: int) -> WeightRef:
        """Write `{weights_dir}/v{version}`: safetensors + config + tokenizer files, atomically.

        The folder appears complete or not at all: it is written under a temporary name in the
        same directory and renamed. Versions are immutable, so an existing folder is an error.
        """
        final = version_folder(self.weights_dir, version)
        with publish_folder(final) as staging:
            self.model.save_pretrained(staging)
            for name in self._tokenizer_files:
                shutil.copy2(os.path.join(self.model_path, name), staging)
        return WeightRef(model_id=self.model_id, version=version, path=final)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict (HF names already), cloned to the CPU."""
        return {name: t.detach().to("cpu", copy=True) for name, t in
                self.model.state_dict().items()}

    def save(self, path: str) -> None:
        """Checkpoint model, optimizer, version and torch CPU RNG state into folder `path`.

        Written beside `path` and renamed into place, so a crash leaves the previous checkpoint.
        """
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=".ckpt.", dir=parent)
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "version": self._version,
            "torch_rng": torch.get_rng_state(),
        }
        torch.save(state, os.path.join(staging, STATE_FILE))
        with open(os.path.join(staging, META_FILE), "w") as f:
            json.dump({"model_id": self.model_id, "version": self._version}, f)
        replace_folder(staging, path)

    def load(self, path: str) -> None:
        """Restore a checkpoint written by `save` (same model_id required)."""
        with open(os.path.join(path, META_FILE)) as f:
            meta = json.load(f)
        if meta["model_id"] != self.model_id:
            raise ValueError(
                f"checkpoint {path} belongs to model {meta['model_id']!r}, not {self.model_id!r}"
            )
        state = torch.load(os.path.join(path, STATE_FILE), map_location="cpu", weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self._version = int(state["version"])
        torch.set_rng_state(state["torch_rng"])
