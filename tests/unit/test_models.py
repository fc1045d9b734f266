"""Model provisioning: the tiny models' tokenizers, config and the cache's idempotence."""
from __future__ import annotations

import json

import pytest
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from actors.envs import answer_span, parse_moves, plan_path, sudoku
from actors.sandbox import python_blocks
from runtime.models import (MARKER, TINY_GRID_WORDS, TINY_SPECIAL_TOKENS, TINY_WORDS, provision,
                            provision_tiny, provision_tiny_grid, resolve_model)

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


# ----------------------------------------------------------------------------- tiny-grid


@pytest.fixture(scope="module")
def grid_tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(provision_tiny_grid(tmp_path_factory.mktemp("grid")))


def _round_trip(tokenizer, text: str) -> str:
    """`text` as the model would write it: encoded, then decoded (tokens joined by spaces)."""
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.unk_token_id not in ids, f"{text!r} has a word outside the vocabulary"
    decoded = tokenizer.decode(ids)
    assert tokenizer(decoded, add_special_tokens=False).input_ids == ids
    return decoded


def test_tiny_grid_is_registered_and_leaves_tiny_alone(tmp_path):
    path = provision_tiny_grid(tmp_path)
    assert path.name == "tiny-grid-v1-seed0" and resolve_model("tiny-grid").name == path.name
    marker = json.loads((path / MARKER).read_text())
    vocab_size = AutoConfig.from_pretrained(path).vocab_size
    assert marker["name"] == "tiny-grid"
    assert marker["vocab_size"] == vocab_size == len(TINY_SPECIAL_TOKENS) + len(TINY_GRID_WORDS)
    # tiny's words are untouched (its folder, weights and ids stay what every other test uses)
    assert "[" not in TINY_WORDS and "print" not in TINY_WORDS
    assert provision_tiny(tmp_path).name == "tiny-v3-seed0"


def test_tiny_grid_writes_a_planner_move_list(grid_tokenizer):
    text = _round_trip(grid_tokenizer, "#### [r, d]")
    assert text == "#### [ r , d ]"  # one "####" token, not four "#"s
    assert parse_moves(text, "planner") == ("R", "D")
    # a "####" the model writes itself marks the answer too
    assert parse_moves(_round_trip(grid_tokenizer, "1 2 #### [u]"), "planner") == ("U",)


def test_tiny_grid_writes_sudoku_steps_and_grids(grid_tokenizer):
    task = sudoku.generate(0, blanks=1)
    state = sudoku.initial_state(task)
    (r, c), = [(r, c) for r in range(4) for c in range(4) if task["puzzle"][r][c] == 0]
    value = task["solution"][r][c]
    steps = _round_trip(grid_tokenizer, f"#### [[{r + 1},{c + 1},{value}]]")
    assert sudoku.parse(steps, state, "planner").edits == ((r + 1, c + 1, value),)
    grid = _round_trip(grid_tokenizer, "#### " + json.dumps(task["solution"]))
    assert sudoku.solved(sudoku.apply(state, sudoku.parse(grid, state, "planner")))


def test_tiny_grid_writes_a_tool_program_that_prints_a_list(grid_tokenizer):
    """The tool's decoded code is valid Python whose printed list the env reads."""
    import subprocess
    import sys

    for program, parsed in [('print("[r, d]")', ("R", "D")), ("print([[1, 2, 3]])", None)]:
        code = python_blocks("```python\n" + _round_trip(grid_tokenizer, program))[0]
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True, timeout=30).stdout
        if parsed:
            assert parse_moves(out, "tool") == parsed
        else:
            assert json.loads(answer_span(out, "tool")) == [[1, 2, 3]]
    # the plan-path map stays readable: dots, "#" obstacles and the coordinates' digits
    task = plan_path.generate(0, height=3, width=3, obstacle_ratio=0.2, min_path_length=1)
    ids = grid_tokenizer(plan_path.render(plan_path.initial_state(task)),
                         add_special_tokens=False).input_ids
    assert {".", "#", "0"} <= set(grid_tokenizer.convert_ids_to_tokens(ids))
