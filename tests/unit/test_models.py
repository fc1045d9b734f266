"""Model provisioning: the tiny model's tokenizer, config and the cache's idempotence."""
from __future__ import annotations

import json

import pytest
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from runtime.models import (MARKER, TINY_SPECIAL_TOKENS, provision, provision_tiny,
                            resolve_model)

CHAT = [
    {"role": "system", "content": "you are the sender ."},
    {"role": "user", "content": "what is 12 + 30 ? answer : 42"},
]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return provision_tiny(tmp_path_factory.mktemp("models"))


def test_tiny_tokenizer_is_small_and_ends_turns_with_im_end(tiny_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    config = AutoConfig.from_pretrained(tiny_path)
    generation = GenerationConfig.from_pretrained(tiny_path)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert 64 <= len(tokenizer) <= 96
    assert config.vocab_size == len(tokenizer)  # every id the model can sample decodes
    assert tokenizer.eos_token_id == config.eos_token_id == generation.eos_token_id == im_end
    # The special tokens come first, each a single id of its own.
    assert tokenizer.convert_tokens_to_ids(list(TINY_SPECIAL_TOKENS)) == [0, 1, 2, 3, 4]


def test_tiny_chat_template_round_trips(tiny_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nyou are the sender .<|im_end|>\n"
                    "<|im_start|>user\nwhat is 12 + 30 ? answer : 42<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.unk_token_id not in ids  # every word of the prompt is in the vocabulary
    # Decoding joins tokens with spaces; re-encoding gives back the very same ids.
    assert tokenizer(tokenizer.decode(ids), add_special_tokens=False).input_ids == ids
    assert tokenizer.convert_ids_to_tokens(ids[:3]) == ["<|im_start|>", "system", "\n"]
    assert ids[-3:] == tokenizer.convert_tokens_to_ids(["<|im_start|>", "assistant", "\n"])


def test_tiny_model_shape_and_determinism(tiny_path, tmp_path):
    config = AutoConfig.from_pretrained(tiny_path)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.tie_word_embeddings) == (64, 2, 4, 2, True)
    again = provision_tiny(tmp_path)  # same seed, another cache: identical weights
    assert (again / "model.safetensors").read_bytes() == \
        (tiny_path / "model.safetensors").read_bytes()


def test_provision_is_idempotent(tiny_path):
    marker = json.loads((tiny_path / MARKER).read_text())
    stamp = (tiny_path / "model.safetensors").stat().st_mtime_ns
    assert provision_tiny(tiny_path.parent) == tiny_path
    assert (tiny_path / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    assert marker["name"] == "tiny" and marker["vocab_size"] > 0


def test_a_folder_without_marker_is_rebuilt(tmp_path):
    crashed = tmp_path / "tiny-v3-seed0"
    crashed.mkdir()
    (crashed / "config.json").write_text("{}")  # what an interrupted build could leave
    path = provision_tiny(tmp_path)
    assert (path / MARKER).exists()
    assert AutoConfig.from_pretrained(path).hidden_size == 64


def test_unknown_names_are_rejected_with_the_known_ones(tmp_path):
    with pytest.raises(KeyError, match="smollm2-135m"):
        provision("gpt-17")
    with pytest.raises(FileNotFoundError, match="tiny"):
        resolve_model(str(tmp_path / "missing"))
    assert resolve_model(str(provision_tiny(tmp_path))) == provision_tiny(tmp_path)


def test_chat_template_kwargs_reach_the_template(tiny_path):
    """ModelConfig.chat_template_kwargs (e.g. Qwen3's enable_thinking, which AT-GRPO turns
    off) are passed to the model's template by the route that encodes every prompt."""
    from actors.episode import ModelRoute

    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    # Qwen3's switch, reduced to its effect: an empty think block closes the prompt when off.
    tokenizer.chat_template = (tokenizer.chat_template + "{% if enable_thinking is defined and "
                               "not enable_thinking %}<think>\n\n</think>\n\n{% endif %}")
    thinking = ModelRoute("m", [object()], tokenizer)
    plain = ModelRoute("m", [object()], tokenizer, {"enable_thinking": False})
    with_thinking, without = thinking.encode(CHAT), plain.encode(CHAT)
    # the same prompt, then the closed think block's tokens
    assert without[:len(with_thinking)] == with_thinking
    assert len(without) > len(with_thinking)
