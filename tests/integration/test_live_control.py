"""Operating a live run over its control bus (DESIGN §9): real Ray, SGLang, broker and ctl.py.

One run of arith_duo on the tiny model is driven the way an operator drives it: ctl.py (a
subprocess) lowers η, scales the rollout actors 1 -> 3 -> 1, pauses and resumes, has a command
refused, and stops the run; meanwhile 1,000 fuzzed control messages arrive. What is checked is
counted by the test itself (its own subscriber, its own message digests), not read from the
controller's counters:
- every row trained after the change to η = 0 has staleness 0 (learner steps on events/step);
- the added actors play episodes and the removed ones leave no row unaccounted;
- while paused no round is in flight;
- every fuzzed message gets exactly one answer and the run goes on;
- the stop writes a checkpoint holding the clock's counters.

    python -m pytest -q tests/integration/test_live_control.py
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import ray

from runtime.bus import BusClient, BusConfig, payload_digest
from runtime.config import load_config
from runtime.controller import Run

ROOT = Path(__file__).resolve().parents[2]
LIMIT_S = 300.0  # generous for a loaded 2-core machine; a stuck run never gets there


class Collector:
    """Subscribes to every event of the run on its own loop thread; keeps what arrived."""

    def __init__(self, endpoint, run_id: str) -> None:
        self.endpoint, self.run_id = endpoint, run_id
        self.events: list[tuple[str, dict]] = []
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self.loop.run_until_complete,
                                       args=(self._serve(),), daemon=True)
        self.thread.start()
        assert self.ready.wait(60), "collector could not subscribe"

    async def _serve(self) -> None:
        self.task = asyncio.current_task()
        async with self.endpoint.client(BusConfig(), max_queued_incoming_messages=0) as client:
            await client.subscribe(f"troupe/{self.run_id}/events/#", qos=1)
            self.ready.set()
            try:
                async for message in client.messages:
                    name = message.topic.value.rsplit("/", 1)[1]
                    self.events.append((name, json.loads(message.payload)))
            except asyncio.CancelledError:
                return

    def of(self, name: str) -> list[dict]:
        return [body for kind, body in list(self.events) if kind == name]

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.task.cancel)
        self.thread.join(10)


def ctl(run: Run, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "ctl.py"), "--run",
                           str(run.run_dir), "--timeout", "150", *args],
                          capture_output=True, text=True, timeout=200, cwd=ROOT)


def wait_for(what: str, check, limit_s: float = LIMIT_S, every_s: float = 0.2):
    deadline = time.time() + limit_s
    while True:
        value = check()
        if value:
            return value
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(every_s)


def fuzz_cases(run_id: str, n: int, rng: random.Random) -> list[tuple[str, bytes]]:
    """Distinct control messages, ~10% valid but harmless (resume, coach resume, a model the
    run does not have, which the controller refuses), the rest malformed in varied ways."""
    cases = []
    for i in range(n):
        kind = rng.choice(["resume", "coach", "ghost"] + ["bad"] * 27)
        if kind == "resume":
            cases.append(("resume", json.dumps({"run_id": run_id, "request_id": f"f{i}"})))
        elif kind == "coach":
            cases.append(("coach", json.dumps({"run_id": run_id, "action": "resume",
                                               "request_id": f"f{i}"})))
        elif kind == "ghost":
            cases.append(("staleness", json.dumps({"run_id": run_id, "model": "ghost",
                                                   "max_staleness": 1, "request_id": f"f{i}"})))
        else:
            body = rng.choice([
                {"run_id": run_id, "model": "policy", "max_staleness": rng.choice([-1, "2", None, 2.5])},
                {"run_id": "other-run", "model": "policy", "max_staleness": 1},
                {"run_id": run_id, "actors": rng.choice([0, -3, 10**6, "2", [2]])},
                {"run_id": run_id, "unknown_field": 1},
                {"run_id": run_id, "reason": "x" * rng.randrange(70_000, 150_000)},
            ])
            topic = rng.choice(["staleness", "rollout_actors", "pause", "bogus"])
            payload = json.dumps(body | {"i": i}) if rng.random() < 0.8 else (
                f"{i}:" + rng.randbytes(40).hex()[: rng.randrange(1, 80)])
            cases.append((topic, payload))
    return [(topic, payload.encode()) for topic, payload in cases]


class OperatedRun:
    """A started run supervised on a thread, with the test's own event subscriber."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.collector = Collector(run.bus.endpoint, run.run_id)
        self.failure: list[BaseException] = []
        self.supervisor = threading.Thread(target=lambda: _capture(run.wait, self.failure),
                                           daemon=True)
        self.supervisor.start()

    def stop(self) -> None:
        """`ctl.py stop`, then the supervision must end without a failure."""
        assert ctl(self.run, "stop", "--reason", "test over").returncode == 0
        self.supervisor.join(LIMIT_S)
        assert not self.supervisor.is_alive(), "the run did not stop"
        assert not self.failure, self.failure


@contextlib.contextmanager
def operated_run(run_id: str, tmp_path: Path, *overrides: str):
    """arith_duo_tiny under `overrides`, started and operated (see OperatedRun); shut down
    on the way out, whatever happened."""
    run = Run(load_config(ROOT / "configs" / "arith_duo_tiny.yaml", [
        f"run.runs_dir={tmp_path}", f"run.run_id={run_id}", "run.max_steps=1000",
        "run.checkpoint_every=0", *overrides]))
    operated = None
    try:
        run.start()
        operated = OperatedRun(run)
        yield operated
    finally:
        if operated is not None:
            operated.collector.close()
        run.shutdown()


def test_a_run_obeys_its_operator(tmp_path):
    with operated_run("live", tmp_path, "coach.latency_s=0.2", "rollout.max_actors=3",
                      "run.drain_timeout_s=60") as operated:
        run, collector = operated.run, operated.collector
        learner = run.learners["policy"]
        wait_for("two learner steps", lambda: ray.get(learner.progress.remote())["version"] >= 2)

        # η 1 -> 0: from the next sampling on, only rows of the current version are trained
        answer = ctl(run, "set-staleness", "policy", "0")
        assert answer.returncode == 0, answer.stdout + answer.stderr
        changed_at = ray.get(learner.progress.remote())["version"]

        # scale up to 3 actors; the new ones must play
        answer = ctl(run, "scale-rollout", "3")
        assert answer.returncode == 0, answer.stdout + answer.stderr
        assert len(run.rollouts) == 3
        wait_for("episodes from the added actors", lambda: all(
            ray.get(run.rollouts[i].stats.remote())["episodes"] > 0 for i in (1, 2)))

        # 1,000 fuzzed messages while the run trains: each answered once, the run goes on
        _fuzz(run, collector, 1000)
        version_after_fuzz = ray.get(learner.progress.remote())["version"]
        wait_for("a learner step after the fuzz",
                 lambda: ray.get(learner.progress.remote())["version"] > version_after_fuzz)

        # scale down to 1: the two removed actors drain and leave
        answer = ctl(run, "scale-rollout", "1")
        assert answer.returncode == 0, answer.stdout + answer.stderr
        wait_for("the drained actors to leave", lambda: list(run.rollouts) == [0])

        # pause: in-flight rounds finish, then nothing is admitted; resume: rounds again
        assert ctl(run, "pause").returncode == 0
        wait_for("no round in flight", lambda: ray.get(
            run.clock.ledger_stats.remote()).open_rounds == 0)
        closed = ray.get(run.clock.ledger_stats.remote()).closed_rounds
        time.sleep(3)
        paused = ray.get(run.clock.ledger_stats.remote())
        assert (paused.open_rounds, paused.closed_rounds) == (0, closed)
        assert ctl(run, "resume").returncode == 0
        wait_for("rounds after resume", lambda: ray.get(
            run.clock.ledger_stats.remote()).closed_rounds > closed)

        refused = ctl(run, "set-staleness", "ghost", "1")
        assert refused.returncode == 1 and "ghost" in refused.stdout + refused.stderr

        steps_before_stop = ray.get(learner.progress.remote())["version"]
        operated.stop()
        steps = ray.get(learner.steps_since.remote(0))
        summary = run.finish()
        wait_for("the final status", lambda: any(
            s["state"] == "finished" for s in collector.of("status")), limit_s=30)

    # η: every step sampled after the change trained only rows of its own version
    after = [s for s in steps if s["version"] > changed_at + 1]
    assert after, "no step after the staleness change"
    assert all(s["max_staleness"] == 0 and s["staleness_max"] == 0 for s in after), after
    # the test's own subscriber saw one events/step per learner step, in order
    seen = [s["version"] for s in collector.of("step")]
    assert seen == list(range(1, len(seen) + 1)) and len(seen) >= steps_before_stop
    assert collector.of("version") and collector.of("status")
    assert collector.of("status")[-1]["state"] == "finished"
    # rows: none unaccounted, the removed actors' rounds settled
    rows = summary["rows"]
    assert rows["unaccounted"] == 0, rows
    assert summary["ledger"]["open_rounds"] == 0
    assert [(s["from"], s["to"]) for s in summary["control"]["scaling"]] == [(1, 3), (3, 1)]
    assert summary["control"]["stop_reason"] == "test over"
    # the stop checkpointed the learner with the clock's counters
    version = summary["learners"]["policy"]["version"]
    meta = json.loads((run.run_dir / "checkpoints" / "policy" / f"v{version}" /
                       "checkpoint.json").read_text())
    assert meta["version"] == version and meta["clock"]["models"]["policy"]["version"] == version
    assert meta["clock"]["models"]["policy"]["max_staleness"] == 0


def _capture(fn, failures: list) -> None:
    try:
        fn()
    except BaseException as exc:  # handed to the test thread, which fails on it
        failures.append(exc)


def _fuzz(run: Run, collector: Collector, n: int) -> None:
    cases = fuzz_cases(run.run_id, n, random.Random(5))
    digests = {(f"troupe/{run.run_id}/control/{t}", payload_digest(p)) for t, p in cases}
    assert len(digests) == n, "fuzz cases must be distinct to be counted"

    def answers() -> list[dict]:
        return [b for b in collector.of("ack") + collector.of("error") if "payload_sha256" in b]

    earlier = {(b["topic"], b["payload_sha256"]) for b in answers()}
    async def send() -> None:
        async with BusClient(run.bus.endpoint, run.run_id) as sender:
            for topic, payload in cases:
                await sender.client.publish(f"troupe/{run.run_id}/control/{topic}", payload, qos=1)

    asyncio.run(send())

    def fuzz_answers() -> list[tuple[str, str]]:
        return [key for key in ((b["topic"], b["payload_sha256"]) for b in answers())
                if key not in earlier]

    wait_for(f"answers to {n} fuzzed messages", lambda: len(fuzz_answers()) >= n, every_s=1.0)
    time.sleep(2)  # a duplicate answer would arrive right behind
    got = fuzz_answers()
    assert sorted(got) == sorted(digests), "a message unanswered, or answered twice"
