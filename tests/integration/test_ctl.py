"""scripts/ctl.py against a real embedded broker and a real ControlListener (DESIGN §9).

ctl runs as a subprocess, as an operator runs it; the listener runs on its own event loop in a
thread, as the controller will. The test counts what the handler received itself.

    python -m pytest -q tests/integration/test_ctl.py
"""
from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from runtime.bus import (BrokerThread, BusClient, BusConfig, ControlListener, Pause,
                         ScaleRollout, SetStaleness, Stop, write_bus_json)

RUN = "ctl-test-run"
ROOT = Path(__file__).resolve().parents[2]
ANSWER_S = 60.0  # a loaded 2-core machine answers well within this; a dead listener never


class ListenerThread:
    """A ControlListener serving on its own loop in a daemon thread; `commands` it received."""

    def __init__(self, endpoint, run_id: str) -> None:
        self.commands: list = []
        self.listener = ControlListener(endpoint, run_id, self.commands.append,
                                        BusConfig(reconnect_s=0.5))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> ListenerThread:
        self.thread.start()
        self.serving = self._call(self._start())
        self._call(asyncio.wait_for(self.listener.subscribed.wait(), ANSWER_S))
        return self

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(ANSWER_S + 5)

    async def _start(self) -> asyncio.Task:
        return asyncio.create_task(self.listener.run())

    async def _shutdown(self) -> None:
        self.serving.cancel()
        await asyncio.gather(self.serving, return_exceptions=True)

    def __exit__(self, *exc_info) -> None:
        self._call(self._shutdown())  # the client disconnects before its loop stops
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory):
    run_dir = tmp_path_factory.mktemp("runs") / RUN
    run_dir.mkdir()
    broker = BrokerThread(run_dir, RUN)
    endpoint = broker.start()
    with ListenerThread(endpoint, RUN) as listener:
        yield run_dir, endpoint, listener
    broker.stop()


def ctl(*args: str, timeout_s: float = ANSWER_S) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/ctl.py", *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=timeout_s + 60,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))


def test_commands_reach_the_run_and_are_acknowledged(run_dir):
    path, _, listener = run_dir
    before = len(listener.commands)
    done = ctl("--run", str(path), "set-staleness", "policy", "1")
    assert done.returncode == 0, done.stderr
    assert "ok: SetStaleness" in done.stdout
    done = ctl("--run", str(path), "scale-rollout", "3")
    assert done.returncode == 0, done.stderr
    for verb in ("pause", "stop"):
        assert ctl("--run", str(path), verb).returncode == 0
    got = listener.commands[before:]
    assert [type(c) for c in got] == [SetStaleness, ScaleRollout, Pause, Stop]
    assert (got[0].model, got[0].max_staleness, got[1].actors) == ("policy", 1, 3)
    assert got[3].reason == "stopped from ctl.py" and all(c.run_id == RUN for c in got)
    assert len({c.request_id for c in got}) == 4  # each invocation its own request id


def test_a_refused_command_prints_the_reason_and_exits_1(run_dir):
    path, _, listener = run_dir
    before = len(listener.commands)
    done = ctl("--run", str(path), "scale-rollout", "0")
    assert done.returncode == 1
    assert "field 'actors'=0 is outside 1..1024" in done.stderr
    assert len(listener.commands) == before  # the handler never saw it


def test_latest_finds_the_newest_run_with_a_bus(run_dir):
    path, _, listener = run_dir
    before = len(listener.commands)
    done = ctl("--runs-dir", str(path.parent), "resume")
    assert done.returncode == 0, done.stderr
    assert len(listener.commands) == before + 1


def test_no_listener_is_told_apart_from_a_refusal(run_dir, tmp_path):
    _, endpoint, _ = run_dir
    silent = tmp_path / "silent"
    silent.mkdir()
    write_bus_json(silent, endpoint, "nobody-listens")  # the broker is up, no run listens
    started = time.monotonic()
    done = ctl("--run", str(silent), "--timeout", "3", "pause", timeout_s=3)
    assert done.returncode == 3, (done.stdout, done.stderr)
    assert "no answer" in done.stderr and time.monotonic() - started < 60


def test_status_prints_the_retained_snapshot(run_dir):
    path, endpoint, _ = run_dir

    async def publish() -> None:
        async with BusClient(endpoint, RUN) as bus:
            await bus.publish_event("status", {"state": "training", "versions": {"policy": 4}})
            await bus.publish_event("version", {"policy": 4})
    asyncio.run(publish())
    done = ctl("--run", str(path), "status")
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert shown["status"]["state"] == "training" and shown["version"] == {"policy": 4}


def test_watch_prints_a_line_per_step_until_interrupted(run_dir):
    path, endpoint, _ = run_dir
    watcher = subprocess.Popen([sys.executable, "scripts/ctl.py", "--run", str(path), "watch"],
                               cwd=ROOT, text=True, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in watcher.stdout],
                     daemon=True).start()

    def next_line() -> str:
        try:
            return lines.get(timeout=ANSWER_S)
        except queue.Empty:
            pytest.fail(f"watch printed nothing for {ANSWER_S:.0f} s")
    try:
        assert "watching run" in next_line()

        async def publish() -> None:
            async with BusClient(endpoint, RUN) as bus:
                for step in (1, 2):
                    await bus.publish_event("step", {"model": "policy", "step": step,
                                                     "loss": 0.125})
        asyncio.run(publish())
        first, second = next_line(), next_line()
        assert "model policy | step 1 | loss 0.125" in first
        assert "step 2" in second
        watcher.send_signal(signal.SIGINT)
        assert watcher.wait(timeout=30) == 0
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait()
