"""A megatron-core `GPTModel` built from a Hugging Face model's own `config.json` (DESIGN §6).

Nothing about the architecture is a flag in troupe's config: `ModelSpec.from_hf_config` reads
the family (Llama/SmolLM2, Qwen2, Qwen3), sizes, RMSNorm epsilon, RoPE theta, grouped-query
heads, tied or untied embeddings, Qwen2's q/k/v bias and Qwen3's per-head QK-norm, and refuses
what it cannot build exactly (RoPE scaling, sliding windows, biases Llama does not use).

The layer spec is Transformer-Engine's where CUDA and TE are present, otherwise megatron-core's
local spec; parameter names differ only in where the two pre-norms live, which
`learners.megatron.weights` handles. Fusions that need CUDA kernels are off.

Tiny-CPU check: `python -m pytest tests/unit/test_megatron_model.py`.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from learners.megatron import compat  # noqa: F401  (sets the flash_mla guard before megatron)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

log = logging.getLogger("troupe.megatron")

FAMILIES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelSpec:
    """The architecture of one HF decoder, as far as megatron-core needs it.

    Attributes:
        family: "llama" (SmolLM2 included), "qwen2" or "qwen3".
        vocab_size: the HF vocabulary (rows of the embedding before megatron's padding).
        num_kv_heads: key/value heads (GQA groups); divides num_heads.
        head_dim: per-head width (Qwen3 sets it independently of hidden/heads).
        qkv_bias: q/k/v projections carry a bias (Qwen2).
        qk_norm: RMSNorm over each query and key head before RoPE (Qwen3).
        tied: the output layer reuses the input embedding.
    """

    family: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float
    norm_eps: float
    max_positions: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool

    @classmethod
    def from_hf_config(cls, config: dict) -> ModelSpec:
        """Read a `config.json` dict; raises ValueError naming what cannot be built exactly."""
        family = config.get("model_type")
        if family not in FAMILIES:
            raise ValueError(f"model_type={family!r} is not supported by the megatron learner; "
                             f"use a model of family {list(FAMILIES)} or learner.backend=torch")
        _require(config.get("hidden_act", "silu") == "silu", config, "hidden_act", "silu")
        _require(not config.get("mlp_bias", False), config, "mlp_bias", "false")
        if family == "llama":
            _require(not config.get("attention_bias", False), config, "attention_bias", "false")
        if family in ("qwen2", "qwen3"):
            _require(not config.get("use_sliding_window", False), config,
                     "use_sliding_window", "false")
        rope = config.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", (config.get("rope_scaling") or {}).get("rope_type",
                                                                                 "default"))
        _require(rope_type == "default" and not config.get("rope_scaling"), config,
                 "rope_parameters.rope_type", "'default' (no RoPE scaling)")
        heads = config["num_attention_heads"]
        return cls(
            family=family,
            num_layers=config["num_hidden_layers"],
            hidden_size=config["hidden_size"],
            ffn_hidden_size=config["intermediate_size"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            vocab_size=config["vocab_size"],
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            norm_eps=float(config["rms_norm_eps"]),
            max_positions=config["max_position_embeddings"],
            tied=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2",
            qk_norm=family == "qwen3",
        )

    @classmethod
    def from_hf_folder(cls, path: str) -> ModelSpec:
        with open(os.path.join(path, "config.json")) as f:
            return cls.from_hf_config(json.load(f))

    def padded_vocab_size(self, tensor_parallel: int) -> int:
        """Embedding rows in megatron: the vocabulary rounded up so each TP rank gets equal rows.

        On GPUs rows are also rounded to a multiple of 128 per rank (faster GEMMs); the extra
        rows are zero, never sampled, and cut off before any softmax and on export.
        """
        multiple = tensor_parallel * (128 if compat.cuda_present() else 1)
        return -(-self.vocab_size // multiple) * multiple


def _require(ok: bool, config: dict, key: str, supported: str) -> None:
    if not ok:
        raise ValueError(f"HF config {key}={config.get(key)!r} is not supported by the megatron "
                         f"learner (it needs {supported}); use learner.backend=torch")


def transformer_config(spec: ModelSpec, tensor_parallel: int, pipeline_parallel: int,
                       dtype: torch.dtype) -> TransformerConfig:
    """The `TransformerConfig` of `spec` at the given parallel sizes and parameter dtype."""
    if spec.num_kv_heads % tensor_parallel:
        raise ValueError(
            f"learner.tensor_parallel={tensor_parallel} does not divide the model's "
            f"{spec.num_kv_heads} key/value heads; use a divisor of {spec.num_kv_heads}")
    if spec.num_layers % pipeline_parallel:
        raise ValueError(
            f"learner.pipeline_parallel={pipeline_parallel} does not divide the model's "
            f"{spec.num_layers} layers; use a divisor of {spec.num_layers}")
    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=spec.norm_eps,
        gated_linear_unit=True,  # SwiGLU: fc1 holds gate and up
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        # The loss function returns a token sum and its token count, so every token weighs the
        # same across micro-batches and data-parallel ranks (finalize_model_grads divides).
        calculate_per_token_loss=True,
        # Weights always come from a HF checkpoint: random init would be thrown away.
        perform_initialization=False,
        use_cpu_initialization=not compat.cuda_present(),
        # Fused kernels need CUDA (and TE/apex); the unfused paths are exact.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )


def layer_spec(spec: ModelSpec):
    """TE layer spec with CUDA and Transformer Engine, megatron-core's local spec otherwise."""
    if compat.cuda_present():
        try:
            from megatron.core.models.gpt.gpt_layer_specs import (
                get_gpt_layer_with_transformer_engine_spec,
            )

            import transformer_engine  # noqa: F401
        except ImportError as err:
            log.warning("CUDA without Transformer Engine (%s): using the local layer spec", err)
        else:
            return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=spec.qk_norm)
    local = get_gpt_layer_local_spec(qk_layernorm=spec.qk_norm, normalization="RMSNorm")
    local.submodules.self_attention.submodules.core_attention = SdpaAttention
    return local


class SdpaAttention(DotProductAttention):
    """megatron's local `DotProductAttention` computed by torch's fused SDPA kernel.

    The stock local attention materialises [b, heads, s, s] scores (baddbmm, masked softmax,
    bmm, and a copy of K/V per query head); SDPA's kernel does the same causal softmax
    attention without them, with grouped-query heads shared in place. Batches are right-padded,
    so causal attention is exact for every real token. Anything else the stock module supports
    (packed sequences, attention bias, softmax offsets, other mask types) goes to it.
    """

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if (packed_seq_params is not None or attention_bias is not None
                or self.softmax_offset is not None or mask_type != AttnMaskType.causal):
            return super().forward(query, key, value, attention_mask, attn_mask_type,
                                   attention_bias, packed_seq_params)
        # [s, b, heads, d] -> [b, heads, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        context = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=k.shape[1] != q.shape[1],
            dropout_p=self.config.attention_dropout if self.training else 0.0)
        seq, batch = query.shape[0], query.shape[1]
        return context.permute(2, 0, 1, 3).reshape(seq, batch, self.hidden_size_per_partition)


def uses_te_spec(model: GPTModel) -> bool:
    """Whether `model` was built with the TE spec (norms fused into linear_qkv / linear_fc1)."""
    return not any(".input_layernorm." in name for name in model.state_dict())


def build_gpt_model(spec: ModelSpec, config: TransformerConfig, pre_process: bool,
                    post_process: bool) -> GPTModel:
    """The GPTModel of one pipeline stage; logits are gathered over TP (full vocabulary)."""
    with compat.device_scope():
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec(spec),
            vocab_size=spec.padded_vocab_size(config.tensor_model_parallel_size),
            max_sequence_length=spec.max_positions,
            pre_process=pre_process,
            post_process=post_process,
            parallel_output=False,
            share_embeddings_and_output_weights=spec.tied,
            position_embedding_type="rope",
            rotary_base=int(spec.rope_theta),
            rotary_percent=1.0,
        )
    _mark_tensor_parallel_weights(model)
    _cast_params(model, config.params_dtype)
    if compat.cuda_present():
        model = model.cuda()
    return model


def _cast_params(model: GPTModel, dtype: torch.dtype) -> None:
    """Every parameter in `dtype`, as Transformer Engine's layers create them.

    Without TE, megatron-core's local spec builds its norms as a plain `torch.nn.RMSNorm`
    (`WrappedTorchNorm`), which ignores `params_dtype` and stays float32. Under bfloat16 that
    leaves float32 norm weights beside bf16 ones: the bf16 optimizer puts them in its fp32
    group, whose ids its `sharded_state_dict` cannot map (checkpoint save raises "Param id N
    does not match any model sharded param"), and published weights mix float32 norms into a
    folder whose config says bfloat16.
    """
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)


def _mark_tensor_parallel_weights(model: GPTModel) -> None:
    """Tag TP-split weights as megatron's initialisers would have.

    megatron-core sets `tensor_model_parallel`/`partition_dim` on a parallel layer's weight
    only inside its weight initialiser, which `perform_initialization=False` skips (the weights
    come from the HF checkpoint). Untagged, every split weight counts as a TP duplicate, so
    the grad norm (and clipping) under TP > 1 sees only rank 0's shard.
    """
    partition_dims = ((ColumnParallelLinear, 0), (VocabParallelEmbedding, 0),
                      (RowParallelLinear, 1))
    for module in model.modules():
        dim = next((d for kind, d in partition_dims if isinstance(module, kind)), None)
        weight = getattr(module, "weight", None)
        if dim is not None and weight is not None and not hasattr(weight,
                                                                   "tensor_model_parallel"):
            set_tensor_model_parallel_attributes(weight, True, dim, 1)
