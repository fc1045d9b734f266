"""Weights for engine tests: a perturbed copy of a model folder, as a learner step would write."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import LlamaForCausalLM


def save_perturbed_copy(source: Path, tokenizer_dir: Path, target: Path, seed: int = 7) -> Path:
    """Write `source`'s weights plus noise as an HF folder (as a learner step would)."""
    model = LlamaForCausalLM.from_pretrained(source, dtype=torch.float32)
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tokenizer_dir / name, target / name)
    return target
