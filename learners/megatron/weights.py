"""HF ↔ megatron-core weights: one explicit name/shape mapping, TP sharding, PP slicing (DESIGN §6).

Three forms of the same weights:

    HF state dict  ──hf_to_megatron──►  full megatron state (TP=1, global layer numbers)
                   ◄──megatron_to_hf──
    full megatron  ──shard_for_rank──►  one rank's state (its TP shard, its PP stage's layers
                   ◄──gather_shards───  renumbered from 0, the padded vocabulary)

The mapping, layer i (Llama/SmolLM2, Qwen2, Qwen3 differ only in the optional rows):

    model.embed_tokens.weight                   embedding.word_embeddings.weight
    model.layers.i.input_layernorm.weight       decoder.layers.i.input_layernorm.weight
    model.layers.i.self_attn.{q,k,v}_proj.weight decoder.layers.i.self_attention.linear_qkv.weight
        fused per KV group g: [q rows of g's heads; k_g; v_g], so a contiguous TP split keeps
        whole groups (megatron's non-interleaved RoPE is HF's rotate_half: no permutation)
    model.layers.i.self_attn.{q,k,v}_proj.bias  ...linear_qkv.bias                 (Qwen2)
    model.layers.i.self_attn.q_norm.weight      ...self_attention.q_layernorm.weight (Qwen3)
    model.layers.i.self_attn.k_norm.weight      ...self_attention.k_layernorm.weight (Qwen3)
    model.layers.i.self_attn.o_proj.weight      ...self_attention.linear_proj.weight
    model.layers.i.post_attention_layernorm.weight  ...pre_mlp_layernorm.weight
    model.layers.i.mlp.{gate,up}_proj.weight    ...mlp.linear_fc1.weight = [gate; up]
    model.layers.i.mlp.down_proj.weight         ...mlp.linear_fc2.weight
    model.norm.weight                           decoder.final_layernorm.weight
    lm_head.weight                              output_layer.weight  (untied models only)

The Transformer-Engine layer spec keeps the two pre-norms inside the following linear
(`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`); `shard_for_rank` and
`gather_shards` rename them. TP splits dim 0 of the embedding, output layer, linear_qkv and
linear_fc1 (gate and up split separately, then stacked per rank) and dim 1 of linear_proj and
linear_fc2; norms are replicated.

Tiny-CPU check: `python -m pytest tests/unit/test_megatron_model.py` (the round-trip tests).
"""
from __future__ import annotations

import re

import torch

from learners.megatron.model import ModelSpec

Tensors = dict[str, torch.Tensor]

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# Where each megatron tensor is split across tensor-parallel ranks (absent: replicated).
_TP_DIM = {
    "embedding.word_embeddings.weight": 0,
    "output_layer.weight": 0,
    "self_attention.linear_qkv.weight": 0,
    "self_attention.linear_qkv.bias": 0,
    "self_attention.linear_proj.weight": 1,
    "mlp.linear_fc1.weight": 0,
    "mlp.linear_fc2.weight": 1,
}
_TE_NORMS = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """[q; k; v] rows regrouped per KV group: [q_g0; k_g0; v_g0; q_g1; ...] (weight or bias)."""
    groups, d = spec.num_kv_heads, spec.head_dim
    rest = q.shape[1:]
    q = q.reshape(groups, (spec.num_heads // groups) * d, *rest)
    k = k.reshape(groups, d, *rest)
    v = v.reshape(groups, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _split_qkv(qkv: torch.Tensor, spec: ModelSpec) -> tuple[torch.Tensor, ...]:
    """Inverse of `_fuse_qkv`."""
    groups, d = spec.num_kv_heads, spec.head_dim
    per_group_q = (spec.num_heads // groups) * d
    rest = qkv.shape[1:]
    grouped = qkv.reshape(groups, per_group_q + 2 * d, *rest)
    q, k, v = torch.split(grouped, [per_group_q, d, d], dim=1)
    return (q.reshape(-1, *rest).contiguous(), k.reshape(-1, *rest).contiguous(),
            v.reshape(-1, *rest).contiguous())


def hf_to_megatron(hf: Tensors, spec: ModelSpec) -> Tensors:
    """HF state dict → full megatron state (TP=1, unpadded vocabulary, global layer numbers)."""
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if not spec.tied:
        out["output_layer.weight"] = hf["lm_head.weight"]
    for i in range(spec.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = src + "self_attn."
        out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"]
        out[dst + "self_attention.linear_qkv.weight"] = _fuse_qkv(
            *(hf[f"{attn}{p}_proj.weight"] for p in "qkv"), spec)
        if spec.qkv_bias:
            out[dst + "self_attention.linear_qkv.bias"] = _fuse_qkv(
                *(hf[f"{attn}{p}_proj.bias"] for p in "qkv"), spec)
        if spec.qk_norm:
            out[dst + "self_attention.q_layernorm.weight"] = hf[attn + "q_norm.weight"]
            out[dst + "self_attention.k_layernorm.weight"] = hf[attn + "k_norm.weight"]
        out[dst + "self_attention.linear_proj.weight"] = hf[attn + "o_proj.weight"]
        out[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"]
        out[dst + "mlp.linear_fc1.weight"] = torch.cat(
            [hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]], dim=0)
        out[dst + "mlp.linear_fc2.weight"] = hf[src + "mlp.down_proj.weight"]
    return out


def megatron_to_hf(full: Tensors, spec: ModelSpec) -> Tensors:
    """Full megatron state (as `hf_to_megatron` or `gather_shards` return it) → HF state dict.

    Tied models get no `lm_head.weight` (HF re-ties it on load, as `save_pretrained` writes).
    """
    hf = {"model.embed_tokens.weight": full["embedding.word_embeddings.weight"],
          "model.norm.weight": full["decoder.final_layernorm.weight"]}
    if not spec.tied:
        hf["lm_head.weight"] = full["output_layer.weight"]
    for i in range(spec.num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        attn = dst + "self_attn."
        hf[dst + "input_layernorm.weight"] = full[src + "input_layernorm.weight"]
        for p, tensor in zip("qkv", _split_qkv(full[src + "self_attention.linear_qkv.weight"],
                                               spec)):
            hf[f"{attn}{p}_proj.weight"] = tensor
        if spec.qkv_bias:
            for p, tensor in zip("qkv", _split_qkv(full[src + "self_attention.linear_qkv.bias"],
                                                   spec)):
                hf[f"{attn}{p}_proj.bias"] = tensor
        if spec.qk_norm:
            hf[attn + "q_norm.weight"] = full[src + "self_attention.q_layernorm.weight"]
            hf[attn + "k_norm.weight"] = full[src + "self_attention.k_layernorm.weight"]
        hf[attn + "o_proj.weight"] = full[src + "self_attention.linear_proj.weight"]
        hf[dst + "post_attention_layernorm.weight"] = full[src + "pre_mlp_layernorm.weight"]
        gate, up = full[src + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        hf[dst + "mlp.gate_proj.weight"] = gate.contiguous()
        hf[dst + "mlp.up_proj.weight"] = up.contiguous()
        hf[dst + "mlp.down_proj.weight"] = full[src + "mlp.linear_fc2.weight"]
    return hf


def _suffix(name: str) -> str:
    match = _LAYER.match(name)
    return match.group(2) if match else name


def _pad_vocab(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    if tensor.shape[0] == rows:
        return tensor
    padding = torch.zeros(rows - tensor.shape[0], *tensor.shape[1:], dtype=tensor.dtype)
    return torch.cat([tensor, padding], dim=0)


def _tp_shard(name: str, tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    suffix = _suffix(name)
    if suffix not in _TP_DIM or size == 1:
        return tensor
    if suffix == "mlp.linear_fc1.weight":  # gate and up are each split, then stacked
        gate, up = tensor.chunk(2, dim=0)
        return torch.cat([gate.chunk(size)[rank], up.chunk(size)[rank]], dim=0).contiguous()
    return tensor.chunk(size, dim=_TP_DIM[suffix])[rank].contiguous()


def _tp_gather(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    suffix = _suffix(name)
    if suffix not in _TP_DIM or len(shards) == 1:
        return shards[0]
    if suffix == "mlp.linear_fc1.weight":
        gates, ups = zip(*(s.chunk(2, dim=0) for s in shards))
        return torch.cat([*gates, *ups], dim=0)
    return torch.cat(shards, dim=_TP_DIM[suffix])


def stage_layers(spec: ModelSpec, pp_rank: int, pp_size: int) -> range:
    """Global layer numbers held by pipeline stage `pp_rank` (an even split)."""
    per_stage = spec.num_layers // pp_size
    return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)


def shard_for_rank(full: Tensors, spec: ModelSpec, tp_rank: int, tp_size: int, pp_rank: int,
                   pp_size: int, te_spec: bool = False) -> Tensors:
    """The state dict of one rank's GPTModel stage, ready for `load_state_dict`.

    The embedding (and an untied output layer) are padded to `spec.padded_vocab_size(tp_size)`
    rows with zeros. A tied model's last stage, when it is not also the first, holds its own
    copy of the embedding as `output_layer.weight` (megatron keeps the two in sync).
    """
    vocab_rows = spec.padded_vocab_size(tp_size)
    layers = stage_layers(spec, pp_rank, pp_size)
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    out: Tensors = {}
    for name, tensor in full.items():
        match = _LAYER.match(name)
        if match:
            layer = int(match.group(1))
            if layer not in layers:
                continue
            suffix = match.group(2)
            if te_spec:
                suffix = _TE_NORMS.get(suffix, suffix)
            local = f"decoder.layers.{layer - layers.start}.{suffix}"
            out[local] = _tp_shard(name, tensor, tp_rank, tp_size)
        elif name == "embedding.word_embeddings.weight":
            padded = _pad_vocab(tensor, vocab_rows)
            if first:
                out[name] = _tp_shard(name, padded, tp_rank, tp_size)
            if last and spec.tied and not first:
                out["output_layer.weight"] = _tp_shard("output_layer.weight", padded, tp_rank,
                                                       tp_size)
        elif name == "output_layer.weight":
            if last:
                out[name] = _tp_shard(name, _pad_vocab(tensor, vocab_rows), tp_rank, tp_size)
        elif name == "decoder.final_layernorm.weight":
            if last:
                out[name] = tensor
        else:
            raise KeyError(f"shard_for_rank: no partition rule for {name!r}")
    return out


def gather_shards(stages: list[list[Tensors]], spec: ModelSpec) -> Tensors:
    """Inverse of `shard_for_rank`: `stages[pp_rank][tp_rank]` → full megatron state.

    Vocabulary padding is cut off; TE norm names are mapped back; a tied model's extra
    `output_layer.weight` copy on the last stage is dropped.
    """
    te_names = {v: k for k, v in _TE_NORMS.items()}
    full: Tensors = {}
    for pp_rank, tp_states in enumerate(stages):
        offset = stage_layers(spec, pp_rank, len(stages)).start
        for name in tp_states[0]:
            if spec.tied and name == "output_layer.weight":
                continue
            tensor = _tp_gather(name, [state[name] for state in tp_states])
            match = _LAYER.match(name)
            if match:
                suffix = te_names.get(match.group(2), match.group(2))
                name = f"decoder.layers.{int(match.group(1)) + offset}.{suffix}"
            elif name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                tensor = tensor[: spec.vocab_size]
            full[name] = tensor
    return full
