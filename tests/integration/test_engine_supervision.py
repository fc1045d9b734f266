"""Engine supervision tells a slow server from a dead one (actors.engines.supervision).

Faults on the session's tiny server: CPU hogs beside a long decode batch (slow, not dead),
SIGSTOP (dead after `unresponsive_s`), kill -9 (dead at once), a probe during a weight update
(passed over). Each test tunes the engine's supervision settings through `supervised`, which
restores them, leaves the server healthy and does not spend the session's restart budget.

Run: python -m pytest tests/integration/test_engine_supervision.py -s --durations=0
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from transformers import LlamaForCausalLM

from actors.engines.sglang import EngineConfig, SGLangEngine
from actors.engines.supervision import RestartBudget, free_port
from hogs import cpu_hog
from weights_helper import save_perturbed_copy

PROMPT = [3, 10, 20, 30, 40]  # tiny-model token ids (bos first)


@pytest.fixture
def supervised(tiny_engine: SGLangEngine):
    """`tune(**EngineConfig fields)` for one test; afterwards the old settings, a healthy
    server and the session's restart budget (deliberate faults here do not spend it)."""
    original_cfg, original_budget = tiny_engine.cfg, tiny_engine._restart_budget
    tiny_engine._restart_budget = RestartBudget()

    def tune(**overrides) -> None:
        tiny_engine.cfg = dataclasses.replace(original_cfg, **overrides)
    yield tune
    tiny_engine.cfg = original_cfg
    tiny_engine.ensure_alive()
    assert tiny_engine.is_alive()
    tiny_engine._restart_budget = original_budget


def group_members(pgid: int, include_zombies: bool = False) -> list[int]:
    """Pids whose /proc/<pid>/stat names process group `pgid`."""
    members = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{name}/stat").read_bytes()
        except OSError:
            continue  # exited while we listed
        state, _, pgrp = stat[stat.rindex(b")") + 2:].split()[:3]
        if int(pgrp) == pgid and (include_zombies or state != b"Z"):
            members.append(int(name))
    return members


def resume(pgid: int) -> None:
    """SIGCONT a group that a test stopped, unless a restart already removed it."""
    try:
        os.killpg(pgid, signal.SIGCONT)
    except ProcessLookupError:
        pass  # the engine killed the stopped server: the expected outcome


def generate_once(url: str, max_new_tokens: int = 4, temperature: float = 1.0) -> dict:
    """One /generate call on PROMPT; returns the server's JSON answer."""
    response = httpx.post(f"{url}/generate", timeout=120, json={
        "input_ids": PROMPT, "return_logprob": True,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": temperature},
    })
    response.raise_for_status()
    return response.json()


def decode_batch(url: str, requests: int, new_tokens: int) -> list[int]:
    """`requests` concurrent generations of exactly `new_tokens`; their output lengths."""
    async def run() -> list[int]:
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            async def one(index: int) -> int:
                response = await client.post("/generate", json={
                    "input_ids": PROMPT + [index % 40 + 5],
                    "sampling_params": {"max_new_tokens": new_tokens, "ignore_eos": True},
                })
                response.raise_for_status()
                return len(response.json()["output_ids"])
            return await asyncio.gather(*(one(i) for i in range(requests)))
    return asyncio.run(run())


def test_busy_server_that_misses_probes_is_not_restarted(tiny_engine, supervised, caplog):
    # Probes of 50 ms always time out (SGLang's /health takes >= 1 s), so every probe below
    # fails and only the out-of-band CPU progress keeps the decoding server alive.
    supervised(probe_timeout_s=0.05)
    restarts, busy = tiny_engine.restarts, tiny_engine.busy_probes
    hogs = [cpu_hog() for _ in range(2)]
    try:
        with ThreadPoolExecutor(1) as pool, caplog.at_level(logging.WARNING):
            batch = pool.submit(decode_batch, tiny_engine.url, requests=16, new_tokens=200)
            probes = 0
            while not batch.done():
                tiny_engine.ensure_alive()
                probes += 1
                time.sleep(1.0)
            lengths = batch.result()
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    stats = tiny_engine.stats()
    print(f"\n{probes} probes during the batch: {stats}")
    assert lengths == [200] * 16  # every in-flight request completed
    assert tiny_engine.restarts == restarts
    assert tiny_engine.busy_probes - busy > 0
    assert "probe timed out but server is busy" in caplog.text


def test_stopped_server_is_restarted_after_the_window(tiny_engine, supervised, caplog):
    supervised(probe_timeout_s=3.0, unresponsive_s=10.0)
    assert tiny_engine.ensure_alive()  # answers now: the no-progress clock starts here
    pgid, restarts = tiny_engine.pid, tiny_engine.restarts
    os.killpg(pgid, signal.SIGSTOP)  # alive to the kernel, yet no CPU and no answers
    stopped_at = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING):
            while tiny_engine.restarts == restarts:
                call_at = time.monotonic() - stopped_at
                assert call_at < 30, "a stopped server was never restarted"
                tiny_engine.ensure_alive()
    finally:
        resume(pgid)
    print(f"\nrestart decided by the call made {call_at:.1f} s after SIGSTOP")
    # Not before the window (the previous call, at most one probe earlier, left it alone),
    # and within it plus one probe and one CPU sample.
    assert 10.0 - 3.0 - 1.0 <= call_at <= 10.0 + 3.0 + 2.0
    assert "no progress for" in caplog.text
    assert group_members(pgid, include_zombies=True) == []  # no stopped process leaked
    assert generate_once(tiny_engine.url)["meta_info"]["finish_reason"]


def test_killed_server_restarts_at_once_on_the_latest_weights(
        tiny_engine, supervised, tiny_model_path, tmp_path):
    supervised(unresponsive_s=600.0)  # only an immediate restart fits in this test
    version = max(7, tiny_engine.weight_version + 1)
    new_path = save_perturbed_copy(tiny_engine.weights_path, tiny_model_path, tmp_path / "v7")
    assert tiny_engine.update_weights_from_disk(new_path, version)["success"]
    pgid, restarts = tiny_engine.pid, tiny_engine.restarts
    os.killpg(pgid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while group_members(pgid):  # zombies wait for the engine to reap them
        assert time.monotonic() < deadline, "killed server group still running"
        time.sleep(0.1)

    started = time.monotonic()
    tiny_engine.ensure_alive()
    overhead = time.monotonic() - started - tiny_engine.startup_seconds
    print(f"\nrestart: {tiny_engine.startup_seconds:.1f} s startup + {overhead:.1f} s")
    assert tiny_engine.restarts == restarts + 1
    assert overhead < 10.0  # detected from the exit code, no waiting for the window
    assert tiny_engine.weights_path == new_path and tiny_engine.weight_version == version
    assert tiny_engine.stats()["weight_version"] == version

    answer = generate_once(tiny_engine.url, max_new_tokens=4)
    assert answer["meta_info"]["weight_version"] == str(version)
    # The served distribution is the new weights' (fp32 logprobs match to ~1e-5).
    response = [entry[1] for entry in answer["meta_info"]["output_token_logprobs"]]
    served = torch.tensor([entry[0] for entry in answer["meta_info"]["output_token_logprobs"]])
    model = LlamaForCausalLM.from_pretrained(new_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + response])).logits[0, len(PROMPT) - 1:-1]
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]
    assert torch.allclose(served, expected, atol=1e-3)


def test_a_restart_behind_the_served_version_without_a_weights_source_is_counted(
        tiny_engine, supervised, tiny_model_path, tmp_path, caplog):
    """Tensor updates leave the served version only in memory. With no learner to write a
    folder of it (`set_weights_source` never called), the restart serves the last folder:
    counted in `behind_restarts`, logged, and the server says its older version."""
    supervised(unresponsive_s=600.0)
    disk_path, disk_version = tiny_engine.weights_path, tiny_engine.disk_version
    served = max(tiny_engine.weight_version, disk_version) + 1
    new_path = save_perturbed_copy(disk_path, tiny_model_path, tmp_path / "t", seed=3)
    model = LlamaForCausalLM.from_pretrained(new_path, dtype=torch.float32)
    assert tiny_engine.update_weights_from_tensor(list(model.state_dict().items()),
                                                  served)["success"]
    behind = tiny_engine.behind_restarts
    os.killpg(tiny_engine.pid, signal.SIGKILL)
    with caplog.at_level(logging.ERROR, logger="actors.engines.sglang"):
        tiny_engine.ensure_alive()
    assert tiny_engine.behind_restarts == behind + 1
    assert tiny_engine.stats()["behind_restarts"] == behind + 1
    assert f"served v{served} from memory, but restarts on the folder of v{disk_version}" \
        in caplog.text
    assert tiny_engine.weight_version == disk_version
    assert generate_once(tiny_engine.url)["meta_info"]["weight_version"] == str(disk_version)


def test_probe_during_a_weight_update_returns_at_once(tiny_engine, supervised):
    supervised()
    pgid, restarts = tiny_engine.pid, tiny_engine.restarts
    path, version = tiny_engine.weights_path, tiny_engine.weight_version + 1
    # A stopped server keeps the update's HTTP call (and the engine's lock) open; the timer
    # frees it if ensure_alive wrongly waits, so a regression fails instead of hanging.
    os.killpg(pgid, signal.SIGSTOP)
    safety = threading.Timer(20.0, resume, (pgid,))
    safety.start()
    try:
        with ThreadPoolExecutor(1) as pool:
            update = pool.submit(tiny_engine.update_weights_from_disk, path, version)
            while tiny_engine._gate.in_flight == 0:
                time.sleep(0.01)
            time.sleep(0.5)  # let the update take the lock and send its request
            started = time.monotonic()
            tiny_engine.ensure_alive()
            took = time.monotonic() - started
            resume(pgid)
            answer = update.result(timeout=120)
    finally:
        safety.cancel()
        resume(pgid)
    print(f"\nensure_alive during a weight update returned in {took * 1000:.0f} ms")
    assert took < 1.0
    assert answer["success"] and tiny_engine.weight_version == version
    assert tiny_engine.restarts == restarts and tiny_engine.pid == pgid


def test_restart_budget_is_a_rate_per_hour(tiny_model_path, tmp_path):
    budget = RestartBudget()
    now = 100_000.0
    assert budget.take(2, now=now - 7200) and budget.take(2, now=now - 3601)
    assert budget.recent(now) == 0  # older than an hour: forgotten
    assert budget.take(2, now=now - 60) and budget.take(2, now=now - 30)
    assert not budget.take(2, now=now)  # a third within the hour is refused
    assert budget.take(2, now=now + 3541)  # once the first of them is an hour old

    # The engine raises with the log tail instead of restarting (never started: no server).
    engine = SGLangEngine("budget", tiny_model_path, EngineConfig(max_restarts_per_hour=2),
                          tmp_path)
    clock = time.monotonic()
    engine._restart_budget.take(2, now=clock - 4000)
    assert engine.stats()["restarts_last_hour"] == 0
    engine._restart_budget.take(2, now=clock - 20)
    engine._restart_budget.take(2, now=clock - 10)
    assert engine.stats()["restarts_last_hour"] == 2
    with pytest.raises(RuntimeError, match=r"(?s)restarted 2 times in the last hour.*"
                                           r"max_restarts_per_hour=2.*no log written"):
        engine.ensure_alive()
    assert engine.restarts == 0 and engine.pid is None
    engine.close()


@pytest.mark.parametrize("field", ["unresponsive_s", "probe_timeout_s"])
def test_supervision_windows_must_be_positive(field):
    with pytest.raises(ValueError, match=f"EngineConfig.{field}=0"):
        EngineConfig(**{field: 0})
    with pytest.raises(ValueError, match="EngineConfig.max_restarts_per_hour=-1"):
        EngineConfig(max_restarts_per_hour=-1)


# The main thread ends (pthread_exit, GIL released by ctypes) while a second thread lives on
# for a moment and then exits the process with code 7: in between, /proc shows the leader
# as a zombie that waitpid cannot reap yet — what a killed multi-threaded server looks like
# while its threads unwind.
_DYING = (
    "import ctypes, os, threading, time\n"
    "threading.Thread(target=lambda: (time.sleep(1.5), os._exit(7))).start()\n"
    "time.sleep(0.2)\n"
    "ctypes.CDLL(None).pthread_exit(None)\n"
)


def test_a_dying_server_counts_as_exited_before_it_can_be_reaped(tiny_model_path, tmp_path):
    engine = SGLangEngine("dying", tiny_model_path,
                          EngineConfig(max_restarts_per_hour=0, unresponsive_s=600.0), tmp_path)
    engine._port = free_port()  # nothing listens: a probe is refused at once
    engine._proc = subprocess.Popen([sys.executable, "-c", _DYING], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while not _leader_state(engine._proc.pid) == b"Z":
            assert time.monotonic() < deadline, "the leader never became a zombie"
            time.sleep(0.02)
        assert engine._proc.poll() is None  # not reapable yet: poll() alone says "running"
        # Supervision must not call it live-but-unresponsive (restart after 600 s): it waits
        # for the exit and restarts at once, here refused by the budget so no server starts.
        with pytest.raises(RuntimeError, match=r"is down \(exited with code 7\)"):
            engine.ensure_alive()
        assert engine._proc.returncode == 7
    finally:
        if engine._proc.poll() is None:
            os.killpg(engine._proc.pid, signal.SIGKILL)
            engine._proc.wait()
        engine._proc = None
        engine.close()


def _leader_state(pid: int) -> bytes:
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    return stat[stat.rindex(b")") + 2:][:1]




def test_free_port_picks_outside_the_ephemeral_range():
    with open("/proc/sys/net/ipv4/ip_local_port_range") as file:
        low = int(file.read().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(20000 <= port < low for port in ports), (ports, low)
    assert len(ports) > 1  # drawn at random, not one fixed port


def test_a_port_taken_during_startup_moves_the_server_to_another(tiny_model_path, tmp_path):
    """The CI fault: the port was free when picked and taken before the server bound it."""
    engine = SGLangEngine("moved", tiny_model_path,
                          EngineConfig(max_total_tokens=4096, startup_timeout_s=300), tmp_path)
    engine._port = taken = free_port()
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)

    def take_port_once_launched() -> None:
        while engine._proc is None:  # the server loads for >= 10 s before it binds
            time.sleep(0.01)
        holder.bind(("127.0.0.1", taken))
        holder.listen()
    thief = threading.Thread(target=take_port_once_launched, daemon=True)
    thief.start()
    try:
        url = engine.start()
        thief.join(timeout=5)
        log_text = engine.log_path.read_text(errors="replace")
        # Counted from the log, not from the engine: two starts, one refused bind.
        assert log_text.count("==== start ") == 2
        assert log_text.count("address already in use") == 1
        assert engine.port_moves == 1 and engine.stats()["port_moves"] == 1
        assert not url.endswith(f":{taken}")
        assert generate_once(url)["meta_info"]["completion_tokens"] >= 1
    finally:
        holder.close()
        engine.close()
