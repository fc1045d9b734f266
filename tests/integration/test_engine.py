"""The SGLang engine on CPU: behaviour logprobs, weight versions, restarts, n candidates.

Run: python -m pytest tests/integration/test_engine.py -s   (-s prints measured parities)
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from actors.engines.client import EngineClient, EngineError, Generation, _parse_output
from actors.engines.sglang import SGLangEngine
from weights_helper import save_perturbed_copy

# fp32 engine vs fp32 transformers forward: measured ~1e-6..1e-5 on the tiny model; the bound
# leaves room for other CPUs while staying far below any real policy difference (> 1e-2).
LOGPROB_TOL = 1e-3

CHATS = [
    [{"role": "user", "content": "what is 2 + 3 ?"}],
    [{"role": "system", "content": "you are the sender ."},
     {"role": "user", "content": "say the target message : a b c"}],
    [{"role": "user", "content": "question : is 7 = 7 ? answer yes or no"}],
]


def generate(url: str, prompt_ids, **kwargs) -> list[Generation]:
    """Run one `EngineClient.generate` in a fresh event loop (tests are synchronous)."""
    async def call() -> list[Generation]:
        client = EngineClient(url)
        try:
            return await client.generate(prompt_ids, **kwargs)
        finally:
            await client.aclose()
    return asyncio.run(call())


@functools.lru_cache(maxsize=4)
def reference_model(path: str) -> LlamaForCausalLM:
    """The same weights in transformers, fp32, for recomputing logprobs."""
    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def reference_distributions(model, prompt_ids, response_ids, temperature: float):
    """[T, V] log_softmax(logits / T) at each response position, given everything before."""
    ids = torch.tensor([list(prompt_ids) + [int(t) for t in response_ids]])
    with torch.no_grad():
        logits = model(ids).logits[0]
    predicting = logits[len(prompt_ids) - 1: ids.shape[1] - 1]  # position t predicts t+1
    if temperature > 0:  # greedy logprobs are unscaled (see actors.engines.client)
        predicting = predicting / temperature
    return torch.log_softmax(predicting, dim=-1)


def reference_logprobs(model, prompt_ids, response_ids, temperature: float) -> np.ndarray:
    """[T] logprob of each response token under the reference model."""
    rows = reference_distributions(model, prompt_ids, response_ids, temperature)
    index = torch.as_tensor(np.asarray(response_ids), dtype=torch.long)[:, None]
    return rows.gather(-1, index)[:, 0].numpy()


def max_logprob_diff(model, prompt_ids, gen: Generation, temperature: float) -> float:
    expected = reference_logprobs(model, prompt_ids, gen.response_ids, temperature)
    return float(np.abs(expected - gen.logprobs).max())


@pytest.fixture(scope="module")
def prompts(tiny_model_path: Path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    texts = [tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
             for chat in CHATS]
    return [tokenizer(text, add_special_tokens=False).input_ids for text in texts]


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_match_transformers(tiny_engine: SGLangEngine, prompts, temperature):
    model = reference_model(str(tiny_engine.weights_path))
    worst = 0.0
    for prompt in prompts:
        [gen] = generate(tiny_engine.url, prompt, n=1, max_new_tokens=16,
                         temperature=temperature)
        assert len(gen.response_ids) == len(gen.logprobs) == len(gen.versions) > 0
        assert gen.response_ids.dtype == np.int32 and gen.logprobs.dtype == np.float32
        worst = max(worst, max_logprob_diff(model, prompt, gen, temperature))
        if temperature == 0.0:  # greedy picks the argmax, so its logprob is the row max
            rows = reference_distributions(model, prompt, gen.response_ids, 0.0)
            assert np.all(gen.logprobs >= rows.max(dim=-1).values.numpy() - LOGPROB_TOL)
    print(f"\nlogprob parity at T={temperature}: max |engine - transformers| = {worst:.2e}")
    assert worst < LOGPROB_TOL


def test_weight_update_changes_version_and_policy(tiny_engine: SGLangEngine, tiny_model_path,
                                                  prompts, tmp_path):
    old_model = reference_model(str(tiny_engine.weights_path))
    new_version = tiny_engine.weight_version + 1
    new_path = tmp_path / f"v{new_version}"
    save_perturbed_copy(tiny_engine.weights_path, tiny_model_path, new_path, seed=1)

    answer = tiny_engine.update_weights_from_disk(new_path, new_version)
    assert answer["success"], answer
    assert tiny_engine.weight_version == new_version

    new_model = reference_model(str(new_path))
    to_new, to_old = [], []
    for prompt in prompts:
        [gen] = generate(tiny_engine.url, prompt, n=1, max_new_tokens=16)
        assert np.all(gen.versions == new_version) and gen.behavior_version == new_version
        to_new.append(max_logprob_diff(new_model, prompt, gen, 1.0))
        to_old.append(max_logprob_diff(old_model, prompt, gen, 1.0))
    print(f"\nafter update: parity with new weights {max(to_new):.2e}, "
          f"distance to old weights {max(to_old):.2e}")
    assert max(to_new) < LOGPROB_TOL
    assert max(to_old) > 100 * LOGPROB_TOL  # the server really serves the new weights


def test_killed_server_restarts_with_same_weights(tiny_engine: SGLangEngine, prompts):
    restarts, version = tiny_engine.restarts, tiny_engine.weight_version
    os.killpg(tiny_engine.pid, signal.SIGKILL)  # the whole server, as an OOM kill would
    deadline = time.monotonic() + 30
    while tiny_engine.is_alive():
        assert time.monotonic() < deadline, "killed server still answers"
        time.sleep(0.2)

    url = tiny_engine.ensure_alive()
    assert tiny_engine.restarts == restarts + 1
    assert tiny_engine.ensure_alive() == url  # alive now: no second restart
    assert tiny_engine.restarts == restarts + 1
    print(f"\nrestart took {tiny_engine.startup_seconds:.1f} s")

    model = reference_model(str(tiny_engine.weights_path))
    [gen] = generate(url, prompts[0], n=1, max_new_tokens=8)
    assert np.all(gen.versions == version)  # the restart reloaded the current weights
    assert max_logprob_diff(model, prompts[0], gen, 1.0) < LOGPROB_TOL


def test_n_candidates_have_consistent_lengths(tiny_engine: SGLangEngine, prompts):
    model = reference_model(str(tiny_engine.weights_path))
    gens = generate(tiny_engine.url, prompts[1], n=4, max_new_tokens=6)
    assert len(gens) == 4
    for gen in gens:
        assert len(gen.response_ids) == len(gen.logprobs) == len(gen.versions) == 6
        assert gen.finish_reason == "length"
        assert np.all(gen.versions == tiny_engine.weight_version)
        # Each candidate's logprobs belong to its own tokens, not to a sibling's.
        assert max_logprob_diff(model, prompts[1], gen, 1.0) < LOGPROB_TOL
    assert len({tuple(gen.response_ids) for gen in gens}) > 1  # near-uniform model: distinct


def test_stop_token_is_kept_with_its_logprob(tiny_engine: SGLangEngine, tiny_model_path,
                                             prompts):
    vocab_size = len(AutoTokenizer.from_pretrained(tiny_model_path))
    # Every id stops, so the first sampled token ends the response.
    [gen] = generate(tiny_engine.url, prompts[0], n=1, max_new_tokens=8,
                     stop_token_ids=list(range(vocab_size)))
    assert gen.finish_reason == "stop"
    assert len(gen.response_ids) == len(gen.logprobs) == 1
    model = reference_model(str(tiny_engine.weights_path))
    assert max_logprob_diff(model, prompts[0], gen, 1.0) < LOGPROB_TOL


def test_client_gives_up_on_a_dead_port_after_bounded_retries(tiny_engine: SGLangEngine):
    dead_url = "http://127.0.0.1:9"  # discard port: nothing listens there
    with pytest.raises(EngineError, match="unreachable after 2 retries"):
        async def call():
            client = EngineClient(dead_url, max_retries=2, retry_backoff_s=0.01)
            try:
                await client.generate([3, 5], n=1, max_new_tokens=2)
            finally:
                await client.aclose()
        asyncio.run(call())

    async def probe() -> bool:
        client = EngineClient(tiny_engine.url)
        try:
            return await client.health()
        finally:
            await client.aclose()
    assert asyncio.run(probe())


@pytest.mark.slow
def test_smollm2_conversion_answers_arithmetic():
    """The converted 135M folder loads in transformers and answers greedily (~1 min).

    Checked with transformers, not a second server: the session's tiny server is running and
    two servers do not fit a small CPU machine.
    """
    from runtime.models import provision_smollm2

    path = provision_smollm2()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert model.config.vocab_size == 49152 and model.config.num_hidden_layers == 30
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 17+25?"}],
                                         tokenize=False, add_generation_prompt=True)
    prompt = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=24, do_sample=False)
    answer = tokenizer.decode(out[0, prompt.shape[1]:], skip_special_tokens=True)
    print(f"\nSmolLM2-135M greedy answer to 'What is 17+25?': {answer!r}")
    assert any(ch.isdigit() for ch in answer)  # an arithmetic answer, right or wrong
    # The turn ends with <|im_end|> before the cap: the saved eos ids are the right ones.
    assert tokenizer.eos_token_id in out[0, prompt.shape[1]:].tolist()


def test_weight_update_on_a_dead_server_restarts_it_on_the_new_weights(
        tiny_engine: SGLangEngine, prompts):
    path, version = tiny_engine.weights_path, tiny_engine.weight_version + 1
    restarts = tiny_engine.restarts
    os.killpg(tiny_engine.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while tiny_engine.is_alive():
        assert time.monotonic() < deadline, "killed server still answers"
        time.sleep(0.2)

    answer = tiny_engine.update_weights_from_disk(path, version)
    assert answer["success"], answer
    assert tiny_engine.restarts == restarts + 1
    assert tiny_engine.weight_version == version
    [gen] = generate(tiny_engine.url, prompts[0], n=1, max_new_tokens=4)
    assert np.all(gen.versions == version)


def _group_cpu_seconds(pgid: int) -> float:
    out = subprocess.run(["ps", "-eo", "pgid=,times="], capture_output=True, text=True,
                         check=True).stdout
    return sum(float(t) for g, t in (line.split() for line in out.splitlines()) if int(g) == pgid)


def test_idle_server_does_not_spin(tiny_engine: SGLangEngine):
    # Without --sleep-on-idle the scheduler polls its sockets in a busy loop: one full core
    # per idle server, which starved whole runs on this 2-core machine.
    tiny_engine.ensure_alive()
    time.sleep(2.0)
    before = _group_cpu_seconds(tiny_engine.pid)
    time.sleep(10.0)
    used = _group_cpu_seconds(tiny_engine.pid) - before
    print(f"\nidle server: {used:.1f} CPU seconds in 10 s")
    assert used < 3.0


# 4 requests of 800 tokens decode together for seconds on the tiny model (the session server's
# 4096 KV slots hold all four): an update lands mid-way.
LONG_REQUESTS, LONG_TOKENS = 4, 800


def _long_batch(url: str) -> list[dict]:
    """LONG_REQUESTS requests of exactly LONG_TOKENS new tokens in one /generate call."""
    response = httpx.post(f"{url}/generate", timeout=600, json={
        "input_ids": [[3, 10, 20, 30, 40 + i] for i in range(LONG_REQUESTS)],
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": LONG_TOKENS, "ignore_eos": True},
    })
    response.raise_for_status()
    return response.json()


@pytest.mark.parametrize("mode", ["continue", "drain"])
def test_a_weight_update_never_aborts_requests_in_flight(tiny_engine: SGLangEngine,
                                                         tiny_model_path, tmp_path, mode):
    """"continue": requests in flight go on with the new weights and their token_versions
    switch once, old -> new. "drain": the update waits for them; they keep the old version."""
    old = tiny_engine.weight_version
    new = old + 1
    path = save_perturbed_copy(tiny_engine.weights_path, tiny_model_path, tmp_path / f"v{new}",
                               seed=3)
    original = tiny_engine.cfg
    tiny_engine.cfg = dataclasses.replace(original, weight_update=mode)
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            running = pool.submit(_long_batch, tiny_engine.url)
            time.sleep(0.3)
            # Scheduled after the batch (first come, first served): once this one token is
            # back, the batch is decoding; a second more and all of it is.
            generate(tiny_engine.url, [3, 7, 9], n=1, max_new_tokens=1)
            time.sleep(1.0)
            assert not running.done(), "the long batch ended before the update: lengthen it"
            answer = tiny_engine.update_weights_from_disk(path, new)
            still_running = not running.done()
            outputs = running.result()
    finally:
        tiny_engine.cfg = original
    assert answer["success"], answer
    gens = [_parse_output(output) for output in outputs]
    # None was aborted: each ran to its length cap.
    assert ([(g.finish_reason, len(g.response_ids)) for g in gens]
            == [("length", LONG_TOKENS)] * LONG_REQUESTS)
    switches = [np.flatnonzero(np.diff(g.versions)) for g in gens]
    print(f"\n{mode}: update took {answer['update_s']:.2f} s; switch at tokens "
          f"{[int(s[0]) + 1 if len(s) else None for s in switches]}")
    if mode == "continue":
        assert still_running  # the update did not wait for the batch
        for gen, switch in zip(gens, switches):  # tokens before the update are old ones
            assert len(switch) == 1 and gen.versions[0] == old and gen.versions[-1] == new
            assert gen.behavior_version == old and 0 < switch[0] + 1 < LONG_TOKENS
    else:
        assert not still_running  # the update waited for the whole batch
        assert all(np.all(g.versions == old) for g in gens)
    assert tiny_engine.weight_version == new
    [after] = generate(tiny_engine.url, [3, 7, 9], n=1, max_new_tokens=4)
    assert np.all(after.versions == new)  # not left paused, and serving the new version


def test_weights_from_tensor_serve_the_new_policy_and_a_restart_falls_back_to_disk(
        tiny_engine: SGLangEngine, tiny_model_path, prompts, tmp_path):
    disk_path, disk_version = tiny_engine.weights_path, tiny_engine.weight_version
    new_version = disk_version + 1
    new_path = save_perturbed_copy(disk_path, tiny_model_path, tmp_path / "t", seed=5)
    new_model = reference_model(str(new_path))
    answer = tiny_engine.update_weights_from_tensor(list(new_model.state_dict().items()),
                                                    new_version)
    print(f"\ntensor update: {answer['update_s']:.2f} s")
    assert answer["success"], answer
    assert tiny_engine.weight_version == new_version
    [gen] = generate(tiny_engine.url, prompts[0], n=1, max_new_tokens=16)
    assert np.all(gen.versions == new_version)
    assert max_logprob_diff(new_model, prompts[0], gen, 1.0) < LOGPROB_TOL
    # Nothing of these weights is on disk: a restart would serve the folder's version, and
    # says so, rather than the tensor version's number on the folder's weights.
    assert tiny_engine.weights_path == disk_path and tiny_engine.disk_version == disk_version
    args = tiny_engine._server_args()
    assert args[args.index("--weight-version") + 1] == str(disk_version)
    # Leave the session's server on weights that exist on disk.
    assert tiny_engine.update_weights_from_disk(new_path, new_version + 1)["success"]
