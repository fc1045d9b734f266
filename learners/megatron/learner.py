"""`MegatronLearner`: the megatron-core learner backend (DESIGN §6; the mission's learner).

Same protocol and same step as `TorchLearner` — proximal logprobs recomputed before any update,
then `ppo_epochs` optimizer steps of the decoupled-PPO loss from `learners.losses` over
token-balanced micro-batches — but built from megatron-core's parts:

- the model is a `GPTModel` constructed from the HF `config.json` (`learners.megatron.model`),
  its weights loaded through the explicit HF↔megatron mapping (`learners.megatron.weights`);
- forward and backward run through `get_forward_backward_func` (no pipelining, or 1F1B
  across pipeline stages), micro-batches and gradient accumulation included;
- gradients live in megatron DDP's buffers and the optimizer comes from
  `get_megatron_optimizer` (Adam with decoupled weight decay, grad clipping, fp32 main params
  under bf16); the loss function returns a token sum and its count, so megatron divides by the
  batch's total loss tokens across micro-batches and data-parallel ranks;
- TP/PP sizes come from the config (`learners.megatron.parallel`), DP is the rest of the world;
- checkpoints use megatron's dist checkpointing (torch_dist backend); published weights are a
  HF safetensors folder that SGLang loads with `update_weights_from_disk`.

On a machine without CUDA, `learners.megatron.compat` makes the same code run on the CPU.

Tiny-CPU check: `python -m pytest tests/unit/test_megatron_learner.py`.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from learners.megatron import compat
from learners.batch import TrainBatch, micro_batch_indices, select_rows
from learners.config import LearnerConfig
from learners.losses import decoupled_ppo_loss, masked_mean, token_logprobs
from learners.megatron.checkpoint import load_checkpoint, read_meta, save_checkpoint
from learners.megatron.model import ModelSpec, build_gpt_model, transformer_config, uses_te_spec
from learners.megatron.parallel import init_parallel, is_writer, tensors_to_cpu
from learners.megatron.ranks import FollowerRanks
from learners.megatron.weights import gather_shards, hf_to_megatron, megatron_to_hf, shard_for_rank
from learners.protocol import WeightRef, publish_folder, version_folder
from learners.torch_backend import tokenizer_files
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func

@dataclass
class _MicroBatch:
    """One micro-batch with the per-token tensors its loss needs (all [b, l])."""

    batch: TrainBatch
    rows: torch.Tensor  # int64 [b], the rows of the full batch it holds
    prox_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None


class MegatronLearner:
    """Trains one model with decoupled PPO on megatron-core; see the module docstring."""

    def __init__(
        self, cfg: LearnerConfig, model_id: str, model_path: str, weights_dir: str
    ) -> None:
        """Join the process group, build the model stage of this rank, load HF weights.

        Args:
            cfg: validated learner config (TP/PP sizes, optimizer, loss settings).
            model_id: the physical model this learner trains (stamped on WeightRefs).
            model_path: HF folder with config.json, safetensors and the tokenizer files.
            weights_dir: published versions go to `{weights_dir}/v{version}`.
        """
        torch.set_num_threads(cfg.num_threads)
        torch.manual_seed(cfg.seed)
        self.cfg = cfg
        self.model_id = model_id
        self.model_path = model_path
        self.weights_dir = weights_dir
        self._tokenizer_files = tokenizer_files(model_path)
        self.spec = ModelSpec.from_hf_folder(model_path)
        self._followers = None
        ranks = cfg.tensor_parallel * cfg.pipeline_parallel
        if ranks > 1 and not dist.is_initialized() and "WORLD_SIZE" not in os.environ:
            # Driven as one object (the runtime's learner actor): spawn the other ranks.
            self._followers = FollowerRanks(ranks, (cfg, model_id, model_path, weights_dir))
        self.layout = init_parallel(cfg.tensor_parallel, cfg.pipeline_parallel, cfg.seed)
        self.dtype = getattr(torch, cfg.dtype)
        full_state = hf_to_megatron(_load_hf_state(model_path), self.spec)

        with compat.device_scope():
            module = self._build_stage(full_state)
            self.model_config = module.config
            self.model = DistributedDataParallel(
                config=module.config,
                ddp_config=DistributedDataParallelConfig(
                    grad_reduce_in_fp32=self.dtype == torch.float32, overlap_grad_reduce=False,
                    use_distributed_optimizer=self._distributed_optimizer),
                module=module)
            self.optimizer = get_megatron_optimizer(
                OptimizerConfig(
                    optimizer="adam", lr=cfg.lr, min_lr=cfg.lr, weight_decay=cfg.weight_decay,
                    adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8, clip_grad=cfg.grad_clip,
                    bf16=self.dtype == torch.bfloat16, params_dtype=self.dtype,
                    use_distributed_optimizer=self._distributed_optimizer),
                [self.model])
            # The hooks megatron's schedules call: DP/TP grad reduction divided by the batch's
            # loss tokens, no-sync while accumulating micro-batches, loss scaling (fp16 only).
            self.model_config.finalize_model_grads_func = finalize_model_grads
            self.model_config.no_sync_func = self.model.no_sync
            self.model_config.grad_scale_func = self.optimizer.scale_loss
            # Reference policy: the initial weights, frozen, no DDP. The loss's k3 term
            # (kl_beta) and the reinforce_pp reward penalty (reward_kl_beta) both use it.
            self.reference = None
            if cfg.kl_beta > 0 or cfg.reward_kl_beta > 0:
                self.reference = self._build_stage(full_state).requires_grad_(False).eval()
        self._forward_backward = get_forward_backward_func()
        self._version = 0

    @property
    def _distributed_optimizer(self) -> bool:
        # Megatron's distributed optimizer shards optimizer state over data-parallel ranks; with
        # one DP rank there is nothing to shard, and it only wraps CUDA tensors.
        return self.layout.dp_size > 1 and compat.distributed_optimizer_available()

    def _build_stage(self, full_state: dict[str, torch.Tensor]) -> torch.nn.Module:
        layout = self.layout
        config = transformer_config(self.spec, layout.tp_size, layout.pp_size, self.dtype)
        module = build_gpt_model(self.spec, config, layout.first_stage, layout.last_stage)
        local = shard_for_rank(full_state, self.spec, layout.tp_rank, layout.tp_size,
                               layout.pp_rank, layout.pp_size, te_spec=uses_te_spec(module))
        result = module.load_state_dict(local, strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        if missing or result.unexpected_keys:
            raise RuntimeError(f"HF→megatron mapping of {self.model_path} left parameters "
                               f"missing={missing} unexpected={result.unexpected_keys}")
        return module

    def _mirror(self, method: str, *args) -> None:
        """Rank 0 of a self-spawned group: have the follower ranks run the same call."""
        if self._followers is not None:
            self._followers.mirror(method, *args)

    def close(self) -> None:
        """Stop self-spawned follower ranks (no-op otherwise)."""
        if self._followers is not None:
            self._followers.close()
            self._followers = None

    @property
    def version(self) -> int:
        """Number of train steps applied (v_m, DESIGN §5)."""
        return self._version

    # ------------------------------------------------------------------ forward plumbing

    def _micro_batches(self, batch: TrainBatch) -> list[_MicroBatch]:
        """This data-parallel rank's token-balanced micro-batches (every TP/PP rank alike)."""
        index = micro_batch_indices(batch.seq_lens, self.cfg.micro_batch_tokens)
        my_rows = index[self.layout.dp_rank::self.layout.dp_size]
        mine = [select_rows(batch, rows) for rows in my_rows]
        if not mine:
            raise ValueError(f"train batch has {len(index)} micro-batches for "
                             f"{self.layout.dp_size} data-parallel ranks; lower "
                             "learner.micro_batch_tokens or raise learner.batch_units")
        if self.layout.pp_size > 1:
            # Pipeline stages exchange activations of one fixed shape.
            rows = max(p.num_rows for p in mine)
            length = max(p.input_ids.shape[1] for p in mine)
            mine = [_pad_to(p, rows, length) for p in mine]
        return [_MicroBatch(p, r) for p, r in zip(mine, my_rows)]

    def _forward_step(self, data_iterator: Iterator[_MicroBatch], model, *, train: bool):
        micro = next(data_iterator)
        input_ids = micro.batch.input_ids
        rows, length = input_ids.shape
        position_ids = torch.arange(length).unsqueeze(0).expand(rows, -1)
        # Right padding: a causal mask never lets a real token see a pad (True = masked out).
        causal = torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)
        device = next(model.parameters()).device
        output = model(input_ids.to(device), position_ids.to(device),
                       causal[None, None].to(device))
        return output, partial(self._loss if train else self._logprobs_only, micro)

    def _logprobs_only(self, micro: _MicroBatch, logits: torch.Tensor, non_loss_data=True):
        batch = micro.batch
        logprobs, _ = token_logprobs(logits[..., : self.spec.vocab_size],
                                     batch.target_ids.to(logits.device),
                                     batch.loss_mask.to(logits.device), self.cfg.temperature)
        return logprobs.detach().float().cpu()

    def _loss(self, micro: _MicroBatch, logits: torch.Tensor):
        """Decoupled-PPO loss of one micro-batch, as (token sum, token count, metric sums)."""
        cfg = self.cfg
        batch = _to_device(micro.batch, logits.device)
        logp, entropy = token_logprobs(logits[..., : self.spec.vocab_size], batch.target_ids,
                                       batch.loss_mask, cfg.temperature,
                                       entropy="grad" if cfg.entropy_coef > 0 else "metric")
        ref = micro.ref_logp.to(logits.device) if micro.ref_logp is not None else None
        loss, metrics = decoupled_ppo_loss(
            logp, micro.prox_logp.to(logits.device), batch.behavior_logprobs, batch.advantages,
            batch.loss_mask, clip_eps_low=cfg.clip_eps_low, clip_eps_high=cfg.clip_eps_high,
            behavior_correction=cfg.behavior_correction, behavior_cap=cfg.behavior_cap,
            ref_logp=ref, kl_beta=cfg.kl_beta)
        mean_entropy = masked_mean(entropy, batch.loss_mask)
        if cfg.entropy_coef > 0:  # exploration bonus: maximise entropy a little
            loss = loss - cfg.entropy_coef * mean_entropy
        tokens = batch.loss_mask.sum()
        metrics["loss"] = loss.detach()
        metrics["entropy"] = mean_entropy.detach()
        weight_max = metrics.pop("importance_weight_max")
        # Sums over tokens (clones: megatron may rescale what it is handed in place).
        reported = {name: (value * tokens).detach().clone() for name, value in metrics.items()}
        reported["importance_weight_max"] = weight_max.clone()
        reported["tokens"] = tokens.detach().clone()
        return loss * tokens, tokens.to(torch.int), reported

    def _run(self, model, micro: list[_MicroBatch], *, train: bool) -> list:
        """One pass of megatron's schedule over `micro`; returns the last stage's outputs."""
        return self._forward_backward(
            forward_step_func=partial(self._forward_step, train=train),
            data_iterator=iter(micro),
            model=[model],
            num_microbatches=len(micro),
            seq_length=micro[0].batch.input_ids.shape[1],
            micro_batch_size=micro[0].batch.num_rows,
            forward_only=not train,
            collect_non_loss_data=not train,
        )

    def _stage_logprobs(self, model, micro: list[_MicroBatch]) -> list[torch.Tensor | None]:
        """Per-micro-batch logprobs under `model` on the last stage (None on other stages)."""
        with torch.no_grad():
            outputs = self._run(model, micro, train=False)
        return outputs if self.layout.last_stage else [None] * len(micro)

    # ------------------------------------------------------------------ protocol

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Current-policy logprobs of `batch.target_ids`, float32 [B, L], 0 off the loss mask.

        Every rank returns the full batch's values (pipeline and data-parallel ranks receive
        them from the ranks that computed them).
        """
        self._mirror("logprobs", batch)
        return self._batch_logprobs(self.model, batch)

    def reference_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Reference-policy logprobs of `batch.target_ids`, as `logprobs` returns them."""
        if self.reference is None:
            raise ValueError("reference_logprobs: this learner has no reference policy; set "
                             "learner.reward_kl_beta > 0 or learner.kl_beta > 0")
        self._mirror("reference_logprobs", batch)
        return self._batch_logprobs(self.reference, batch)

    def _batch_logprobs(self, model, batch: TrainBatch) -> torch.Tensor:
        """Logprobs of `batch.target_ids` under `model` (the policy's DDP wrapper or the
        reference stage), float32 [B, L], gathered onto every rank."""
        out = torch.zeros(batch.loss_mask.shape, dtype=torch.float32)
        with compat.device_scope():
            micro = self._micro_batches(batch)
            values = self._stage_logprobs(model, micro)
        if self.layout.last_stage:
            for part, value in zip(micro, values):
                real_rows, length = len(part.rows), int(batch.seq_lens[part.rows].max())
                out[part.rows, :length] = value[:real_rows, :length]
        if dist.get_world_size() > 1:
            # Each token's value was written by exactly one rank of each TP group's last stage;
            # summing over PP and DP fills every rank's copy (TP ranks hold identical values).
            for group in (parallel_state.get_pipeline_model_parallel_group(),
                          parallel_state.get_data_parallel_group()):
                if dist.get_world_size(group) > 1:
                    dist.all_reduce(out, group=group)
        return out

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One decoupled-PPO update (`ppo_epochs` optimizer steps); version += 1.

        Returns:
            the metrics `TorchLearner.train_step` returns (loss, clip_fraction,
            importance_weight_mean, importance_weight_max, truncated_fraction, approx_kl,
            entropy, grad_norm, kl_ref when kl_beta > 0, tokens, time_s), token-weighted over
            micro-batches, epochs and data-parallel ranks.
        """
        start = time.perf_counter()
        cfg = self.cfg
        if batch.num_tokens == 0:
            raise ValueError("train_step: the batch has no response tokens")
        self._mirror("train_step", batch)
        with compat.device_scope():
            micro = self._micro_batches(batch)
            # Proximal policy = these weights before the update (AReaL's decoupled PPO).
            for part, prox in zip(micro, self._stage_logprobs(self.model, micro)):
                part.prox_logp = prox
            if cfg.kl_beta > 0:  # the loss's k3 term (a reference for rewards alone: skip)
                for part, ref in zip(micro, self._stage_logprobs(self.reference, micro)):
                    part.ref_logp = ref
            sums: dict[str, torch.Tensor] = {}
            weight_max = torch.zeros(())
            grad_norms = []
            for _ in range(cfg.ppo_epochs):
                self.model.zero_grad_buffer()
                self.optimizer.zero_grad()
                reported = self._run(self.model, micro, train=True)
                if cfg.grad_clip == 0:  # megatron only measures the norm when it clips
                    grad_norms.append(self.optimizer.get_grad_norm())
                ok, grad_norm, _ = self.optimizer.step()
                if not ok:
                    raise FloatingPointError("megatron optimizer skipped the step (inf/nan grads)")
                if cfg.grad_clip > 0:
                    grad_norms.append(grad_norm)
                for values in reported:
                    weight_max = torch.maximum(weight_max, values.pop("importance_weight_max"))
                    for name, value in values.items():
                        sums[name] = sums.get(name, 0.0) + value
        self._version += 1
        return self._reduce_metrics(sums, weight_max, grad_norms, start)

    def _reduce_metrics(self, sums: dict[str, torch.Tensor], weight_max: torch.Tensor,
                        grad_norms: list[float], start: float) -> dict[str, float]:
        """Token-weighted means over epochs and DP ranks; sums live on last-stage ranks."""
        names = sorted(sums) if self.layout.last_stage else []
        if dist.get_world_size() > 1:
            # Broadcast the metric names' order from the last stage, then sum over DP and PP.
            holder = [names]
            src = dist.get_process_group_ranks(
                parallel_state.get_pipeline_model_parallel_group())[-1]
            dist.broadcast_object_list(holder, src=src,
                                       group=parallel_state.get_pipeline_model_parallel_group())
            names = holder[0]
        total = torch.stack([sums.get(n, torch.zeros(())).float() for n in names]) \
            if names else torch.zeros(0)
        maximum = weight_max.float().reshape(1)
        if dist.get_world_size() > 1:
            for group in (parallel_state.get_pipeline_model_parallel_group(),
                          parallel_state.get_data_parallel_group()):
                if dist.get_world_size(group) > 1:
                    dist.all_reduce(total, group=group)
                    dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=group)
        values = dict(zip(names, total.tolist()))  # the one host sync of the step
        tokens = values.pop("tokens")
        result = {name: value / tokens for name, value in values.items()}
        result["importance_weight_max"] = float(maximum[0])
        result["grad_norm"] = float(sum(grad_norms) / len(grad_norms))
        result["tokens"] = tokens / self.cfg.ppo_epochs
        result["time_s"] = time.perf_counter() - start
        return result

    # ------------------------------------------------------------------ weights out

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The current weights as a HF state dict (gathered over TP and PP; every rank).

        Copies: on the CPU a gathered tensor may share the live parameter's storage, which
        the next step updates in place (and shared-memory sending would move).
        """
        self._mirror("hf_state_dict")
        live = {t.untyped_storage().data_ptr() for t in self.model.module.parameters()}
        return {name: t.clone() if t.untyped_storage().data_ptr() in live else t
                for name, t in self._gather_hf_state().items()}

    def _gather_hf_state(self) -> dict[str, torch.Tensor]:
        local = tensors_to_cpu(self.model.module.state_dict())
        layout = self.layout
        if dist.get_world_size() == 1:
            stages = [[local]]
        else:
            gathered: list = [None] * dist.get_world_size(parallel_state.get_model_parallel_group())
            dist.all_gather_object(gathered, (layout.pp_rank, layout.tp_rank, local),
                                   group=parallel_state.get_model_parallel_group())
            stages = [[None] * layout.tp_size for _ in range(layout.pp_size)]
            for pp_rank, tp_rank, state in gathered:
                stages[pp_rank][tp_rank] = state
        return megatron_to_hf(gather_shards(stages, self.spec), self.spec)

    def publish_weights(self, version: int) -> WeightRef:
        """Write `{weights_dir}/v{version}` as TorchLearner does: safetensors, config, tokenizer.

        Rank 0 writes, under a temporary name renamed into place, so the folder appears
        complete or not at all; an existing version is an error (versions are immutable).
        """
        final = version_folder(self.weights_dir, version)  # every rank checks, before collectives
        self._mirror("publish_weights", version)
        state = self._gather_hf_state()
        if is_writer():
            with publish_folder(final) as staging:
                self._write_hf_folder(state, staging)
        if dist.get_world_size() > 1:
            dist.barrier()
        return WeightRef(model_id=self.model_id, version=version, path=final)

    def _write_hf_folder(self, state: dict[str, torch.Tensor], folder: str) -> None:
        save_file({k: v.contiguous() for k, v in state.items()},
                  os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(self.model_path, "config.json")) as f:
            config = json.load(f)
        config["dtype"] = self.cfg.dtype  # what the safetensors hold, as save_pretrained says
        config.pop("torch_dtype", None)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        for name in [*self._tokenizer_files, "generation_config.json"]:
            if os.path.isfile(os.path.join(self.model_path, name)):
                shutil.copy2(os.path.join(self.model_path, name), folder)

    # ------------------------------------------------------------------ checkpoints

    def save(self, path: str) -> None:
        """Checkpoint weights, optimizer, version and RNG states into folder `path`
        (megatron dist checkpointing, see `learners.megatron.checkpoint`)."""
        self._mirror("save", path)
        save_checkpoint(path, self.model.module, self.optimizer,
                        {"model_id": self.model_id, "version": self._version})

    def load(self, path: str) -> None:
        """Restore a checkpoint written by `save` (same model_id and world size required)."""
        meta = read_meta(path)
        if meta["model_id"] != self.model_id:
            raise ValueError(
                f"checkpoint {path} belongs to model {meta['model_id']!r}, not {self.model_id!r}"
            )
        self._mirror("load", path)
        load_checkpoint(path, self.model.module, self.optimizer)
        self._version = int(meta["version"])


def _load_hf_state(path: str) -> dict[str, torch.Tensor]:
    """All tensors of a HF folder (one or several safetensors files)."""
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} holds no *.safetensors weights; the megatron learner "
                                "loads HF safetensors checkpoints (save_pretrained writes them)")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(os.path.join(path, name)))
    return state


def _to_device(batch: TrainBatch, device: torch.device) -> TrainBatch:
    if batch.input_ids.device == device:
        return batch
    return TrainBatch(**{name: getattr(batch, name).to(device) for name in
                         ("input_ids", "attention_mask", "loss_mask", "target_ids",
                          "behavior_logprobs", "advantages", "seq_lens")},
                      num_tokens=batch.num_tokens)


def _pad_to(batch: TrainBatch, rows: int, length: int) -> TrainBatch:
    """`batch` right-padded to [rows, length]; added rows and columns carry no loss."""
    def pad(tensor: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(rows, length, dtype=tensor.dtype)
        out[: tensor.shape[0], : tensor.shape[1]] = tensor
        return out

    seq_lens = torch.ones(rows, dtype=batch.seq_lens.dtype)
    seq_lens[: batch.num_rows] = batch.seq_lens
    return TrainBatch(input_ids=pad(batch.input_ids), attention_mask=pad(batch.attention_mask),
                      loss_mask=pad(batch.loss_mask), target_ids=pad(batch.target_ids),
                      behavior_logprobs=pad(batch.behavior_logprobs),
                      advantages=pad(batch.advantages), seq_lens=seq_lens,
                      num_tokens=batch.num_tokens)
