"""The control bus against a real embedded amqtt broker and real aiomqtt clients (DESIGN §9).

One broker (in its own thread, as a synchronous controller runs it) serves the module; each
test runs its clients on a fresh event loop. Nothing is mocked.

    python -m pytest -q tests/integration/test_bus.py
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import stat
import time
from pathlib import Path

import aiomqtt
import pytest
from omegaconf import OmegaConf

from runtime.bus import (
    COMMANDS, MAX_PAYLOAD_BYTES, BadMessage, BrokerThread, BusClient, BusConfig, BusConfigError,
    BusEndpoint, Checkpoint, CoachControl, ControlListener, Pause, Resume, ScaleRollout,
    SetStaleness, Stop, control_topic, encode_command, endpoint_for, event_topic,
    parse_control, payload_digest)

RUN = "bus-test-run"
CFG = BusConfig(max_queued_messages=4096, reconnect_s=0.5)
# A dead listener answers nothing; a slow one (loaded 2-core machine) still answers within this.
STALL_S = 20.0

EXAMPLES = [SetStaleness(RUN, "tiny", 3, "r1"), ScaleRollout(RUN, 2, "r2"), Pause(RUN, "r3"),
            Resume(RUN, "r4"), Checkpoint(RUN, "r5"), Stop(RUN, "operator said so", "r6"),
            CoachControl(RUN, "pause", "r7"), Stop(RUN),
            SetStaleness(RUN, "tiny", 6, "r8", "auto")]


@pytest.fixture(scope="module")
def bus(tmp_path_factory: pytest.TempPathFactory):
    run_dir = tmp_path_factory.mktemp("run")
    broker = BrokerThread(run_dir, RUN)
    endpoint = broker.start()
    yield endpoint, run_dir
    broker.stop()


async def _collect(endpoint: BusEndpoint, topic: str, sink: list, ready: asyncio.Event) -> None:
    async with endpoint.client(CFG) as client:
        await client.subscribe(topic, qos=1)
        ready.set()
        async for message in client.messages:
            # amqtt 0.12.1 also hands a new client retained messages of other clients'
            # subscriptions; only the answer topics count here.
            if message.topic.value in (event_topic(RUN, "ack"), event_topic(RUN, "error")):
                sink.append((message.topic.value, json.loads(message.payload)))


class Harness:
    """A listener plus a subscriber that records every answer, both on the current loop."""

    def __init__(self, endpoint: BusEndpoint, handler) -> None:
        self.endpoint, self.answers = endpoint, []
        self.listener = ControlListener(endpoint, RUN, handler, CFG)

    async def __aenter__(self) -> Harness:
        ready = asyncio.Event()
        self.collector = asyncio.create_task(
            _collect(self.endpoint, f"troupe/{RUN}/events/#", self.answers, ready))
        self.serving = asyncio.create_task(self.listener.run())
        waits = [asyncio.create_task(ready.wait()),
                 asyncio.create_task(self.listener.subscribed.wait())]
        await asyncio.wait_for(asyncio.gather(*waits), STALL_S)
        return self

    async def __aexit__(self, *exc_info) -> None:
        for task in (self.serving, self.collector):
            task.cancel()
        await asyncio.gather(self.serving, self.collector, return_exceptions=True)

    async def wait_answers(self, count: int) -> None:
        """Until `count` answers arrived; fail at once if the listener died, or on a stall."""
        seen, last_progress = 0, time.monotonic()
        while len(self.answers) < count:
            if self.serving.done():
                raise AssertionError(f"listener died: {self.serving.exception()!r}")
            if len(self.answers) > seen:
                seen, last_progress = len(self.answers), time.monotonic()
            if time.monotonic() - last_progress > STALL_S:
                raise AssertionError(f"no answer for {STALL_S} s: {len(self.answers)}/{count}")
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # let a wrong extra answer arrive, so the counts catch it


def test_bus_json_is_private_and_complete(bus):
    endpoint, run_dir = bus
    path = run_dir / "bus.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    info = json.loads(path.read_text())
    assert info == {"host": "127.0.0.1", "port": endpoint.port, "username": endpoint.username,
                    "password": endpoint.password, "run_id": RUN}
    assert endpoint_for(BusConfig(), run_dir) == endpoint
    assert not [p for p in os.listdir(run_dir) if p != "bus.json"], "temp files left behind"


@pytest.mark.parametrize("who", ["anonymous", "wrong password", "unknown user"])
def test_broker_refuses(bus, who):
    endpoint, _ = bus
    username, password = {"anonymous": (None, None),
                          "wrong password": (endpoint.username, endpoint.password + "x"),
                          "unknown user": ("intruder", endpoint.password)}[who]

    async def go() -> None:
        client = aiomqtt.Client(endpoint.host, endpoint.port, username=username,
                                password=password, timeout=STALL_S)
        with pytest.raises(aiomqtt.MqttCodeError) as refused:
            async with client:
                pass
        assert "authorized" in str(refused.value).lower()

    asyncio.run(go())


def test_broker_accepts_its_credentials(bus):
    endpoint, _ = bus

    async def go() -> None:
        async with endpoint.client(CFG) as client:
            await client.subscribe(f"troupe/{RUN}/ping")
            await client.publish(f"troupe/{RUN}/ping", b"hi", qos=1)
            async for message in client.messages:
                assert message.payload == b"hi"
                break

    asyncio.run(asyncio.wait_for(go(), STALL_S))


def test_every_command_round_trips(bus):
    endpoint, _ = bus
    assert {type(c) for c in EXAMPLES} == set(COMMANDS.values())
    for command in EXAMPLES:
        name, payload = encode_command(command)
        assert parse_control(control_topic(RUN, name), payload, RUN) == command
    received = []

    async def go() -> None:
        async with Harness(endpoint, received.append) as harness:
            async with BusClient(endpoint, RUN, CFG) as sender:
                for command in EXAMPLES:
                    await sender.publish_command(command)
            await harness.wait_answers(len(EXAMPLES))
            acks = [body for topic, body in harness.answers if topic.endswith("/ack")]
            assert [a["request_id"] for a in acks] == [c.request_id for c in EXAMPLES]

    asyncio.run(go())
    assert received == EXAMPLES


def _fuzz_case(rng: random.Random, i: int) -> tuple[str, bytes, str]:
    """One (topic name, payload, expected answer) case; each payload is unique (its index)."""
    command = EXAMPLES[rng.randrange(len(EXAMPLES) - 1)]
    name, _ = encode_command(command)
    body = json.loads(encode_command(command)[1])
    body["request_id"] = f"f{i}"
    kind = rng.choice(["valid", "valid", "type", "unknown", "missing", "range", "run", "huge",
                       "garbage", "not_object", "deep", "nan", "dup", "topic", "handler"])
    if kind == "valid":
        return name, json.dumps(body).encode(), "ack"
    if kind == "type":
        key = rng.choice(sorted(k for k in body if k != "request_id"))  # it keeps them distinct
        numeric = key in ("max_staleness", "actors")
        body[key] = rng.choice([True, None, 2.5, [1], {"a": 1}, "7" if numeric else 7])
    elif kind == "unknown":
        body[rng.choice(["extra", "max_stale", "Run_id", ""])] = 1
    elif kind == "missing":
        required = {"staleness": ["run_id", "model", "max_staleness"],
                    "rollout_actors": ["actors"], "coach": ["action"]}.get(name, ["run_id"])
        del body[rng.choice(required)]
    elif kind == "range":
        name, body = rng.choice([("staleness", {"model": "tiny", "max_staleness": -1}),
                                 ("staleness", {"model": "tiny", "max_staleness": 10**9}),
                                 ("staleness", {"model": "../etc", "max_staleness": 1}),
                                 ("rollout_actors", {"actors": 0}),
                                 ("coach", {"action": "explode"})])
        body |= {"run_id": RUN, "request_id": f"f{i}"}
    elif kind == "run":
        body["run_id"] = rng.choice(["other-run", "", RUN + "x"])
    elif kind == "huge":
        body["reason"] = "x" * rng.randrange(MAX_PAYLOAD_BYTES, 4 * MAX_PAYLOAD_BYTES)
    elif kind == "garbage":
        return name, f"{i}:".encode() + rng.randbytes(rng.randrange(1, 300)), "error"
    elif kind == "not_object":
        return name, json.dumps(rng.choice([[i], i, f"s{i}", [None, i]])).encode(), "error"
    elif kind == "deep":
        depth = rng.randrange(2_000, 30_000)
        return name, f'{{"i": {i}, "x": '.encode() + b"[" * depth + b"]" * depth + b"}", "error"
    elif kind == "nan":
        return name, json.dumps(body)[:-1].encode() + b', "x": NaN}', "error"
    elif kind == "dup":
        return name, json.dumps(body)[:-1].encode() + f', "run_id": "{RUN}"}}'.encode(), "error"
    elif kind == "topic":
        name = rng.choice(["bogus", "pause/extra", "Pause"])
    elif kind == "handler":
        return "staleness", json.dumps({"run_id": RUN, "model": "explode", "max_staleness": 1,
                                        "request_id": f"f{i}"}).encode(), "error"
    return name, json.dumps(body).encode(), "error"


def test_fuzz_every_message_answered_once(bus):
    endpoint, _ = bus
    rng = random.Random(9)
    cases = [_fuzz_case(rng, i) for i in range(1200)]
    expected = {(f"troupe/{RUN}/control/{n}", payload_digest(p)): want for n, p, want in cases}
    assert len(expected) == len(cases), "fuzz cases must be distinct to be counted"
    handled = []

    def handler(command) -> None:
        if isinstance(command, SetStaleness) and command.model == "explode":
            raise RuntimeError("deliberate handler fault")
        handled.append(command)

    async def go(harness_out: list) -> None:
        async with Harness(endpoint, handler) as harness:
            async with BusClient(endpoint, RUN, CFG) as sender:
                for name, payload, _ in cases:
                    await sender.client.publish(f"troupe/{RUN}/control/{name}", payload, qos=1)
            await harness.wait_answers(len(cases))
            assert not harness.serving.done(), "the listener must still be serving"
            harness_out.append(harness)

    out: list = []
    start = time.monotonic()
    asyncio.run(go(out))
    harness = out[0]
    got: dict[tuple[str, str], list[str]] = {}
    for topic, body in harness.answers:
        kind = topic.rsplit("/", 1)[1]
        assert kind in ("ack", "error"), topic
        got.setdefault((body["topic"], body["payload_sha256"]), []).append(kind)
        if kind == "error":
            assert body["reason"] and len(body["excerpt"]) <= 120
    assert set(got) == set(expected), "an answer for a message nobody sent, or one missing"
    wrong = {key: (want, got[key]) for key, want in expected.items() if got[key] != [want]}
    assert not wrong, f"{len(wrong)} messages answered wrongly, e.g. {next(iter(wrong.items()))}"
    kinds = [want for want in expected.values()]
    assert len(handled) == kinds.count("ack") == harness.listener.acked
    assert harness.listener.rejected + harness.listener.handler_failures == kinds.count("error")
    assert harness.listener.handler_failures > 0
    print(f"fuzz: {len(cases)} messages, {kinds.count('ack')} acks, "
          f"{kinds.count('error')} errors in {time.monotonic() - start:.1f} s")


def test_handler_exception_is_reported_and_listener_survives(bus):
    endpoint, _ = bus
    calls = []

    async def handler(command) -> None:
        calls.append(command)
        if len(calls) == 1:
            raise ValueError("first call fails")

    async def go() -> None:
        async with Harness(endpoint, handler) as harness:
            async with BusClient(endpoint, RUN, CFG) as sender:
                await sender.publish_command(Pause(RUN, "a"))
                await sender.publish_command(Resume(RUN, "b"))
            await harness.wait_answers(2)
            (error_topic, error), (ack_topic, ack) = harness.answers
            assert error_topic == event_topic(RUN, "error")
            assert error["reason"] == "handler raised ValueError: first call fails"
            assert error["topic"] == control_topic(RUN, "pause")
            assert ack_topic == event_topic(RUN, "ack") and ack["request_id"] == "b"

    asyncio.run(go())


def test_retained_control_message_is_refused(bus):
    endpoint, _ = bus

    async def go() -> None:
        async with BusClient(endpoint, RUN, CFG) as sender:
            _, payload = encode_command(Stop(RUN, "left behind"))
            await sender.client.publish(control_topic(RUN, "stop"), payload, qos=1, retain=True)
        stopped = []
        async with Harness(endpoint, stopped.append) as harness:
            await harness.wait_answers(1)
            await asyncio.sleep(1.0)  # amqtt may deliver it twice (see _collect); both refused
            assert all("retained" in body["reason"] for _, body in harness.answers)
            assert not stopped and harness.listener.acked == 0
        async with BusClient(endpoint, RUN, CFG) as sender:  # clear it for the other tests
            await sender.client.publish(control_topic(RUN, "stop"), b"", qos=1, retain=True)

    asyncio.run(go())


def test_late_subscriber_gets_last_status(bus):
    endpoint, _ = bus

    async def go() -> None:
        async with BusClient(endpoint, RUN, CFG) as publisher:
            await publisher.publish_event("status", {"step": 1})
            await publisher.publish_event("status", {"step": 2})
            await publisher.publish_event("step", {"step": 2})  # not retained
        async with endpoint.client(CFG) as late:
            await late.subscribe(f"troupe/{RUN}/events/#", qos=1)
            async for message in late.messages:
                assert message.topic.value == event_topic(RUN, "status") and message.retain
                assert json.loads(message.payload) == {"step": 2}
                break

    asyncio.run(asyncio.wait_for(go(), STALL_S))


def test_config_errors_name_field_and_fix(monkeypatch, tmp_path: Path):
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(BusConfig),
                                              {"url": "mqtt://broker.example:1884"}))
    assert cfg.url == "mqtt://broker.example:1884"
    for bad, field_name in [({"url": "http://x:1"}, "bus.url"), ({"keepalive_s": 0}, "keepalive_s"),
                            ({"url": "mqtt://u:p@x:1"}, "bus.url"),
                            ({"password_env": "not a name"}, "password_env")]:
        with pytest.raises(BusConfigError, match=field_name):
            BusConfig(**bad)
    monkeypatch.delenv("TROUPE_BUS_PASSWORD", raising=False)
    monkeypatch.setenv("TROUPE_BUS_USERNAME", "ops")
    with pytest.raises(BusConfigError, match="TROUPE_BUS_PASSWORD"):
        endpoint_for(cfg, tmp_path)
    monkeypatch.setenv("TROUPE_BUS_PASSWORD", "secret")
    assert endpoint_for(cfg, tmp_path) == BusEndpoint("broker.example", 1884, "ops", "secret")
    with pytest.raises(BusConfigError, match="bus.json"):
        endpoint_for(BusConfig(), tmp_path)
    with pytest.raises(BadMessage, match="not this run's"):
        parse_control(control_topic(RUN, "pause"), b'{"run_id": "x"}', RUN)
