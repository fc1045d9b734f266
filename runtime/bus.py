"""The control bus (DESIGN §9): broker, topics, validated command payloads, listener, events.

This module owns everything MQTT: the embedded amqtt broker a run starts on loopback (auth on,
generated credentials in `<run_dir>/bus.json`, mode 0600, DESIGN §10), the connection to an
external broker named by `bus.url`, the topic names under `troupe/<run_id>/`, one frozen
dataclass per control topic with strict JSON validation, the `ControlListener` that answers
every control message on `events/ack` or `events/error`, and `BusClient` for publishing.
The client side is aiomqtt, the maintained continuation of asyncio-mqtt.

Nothing here knows the controller: a handler callback receives parsed commands.
"""
from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import logging
import os
import re
import secrets
import ssl
import tempfile
import threading
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Union, get_type_hints
from urllib.parse import urlsplit

import aiomqtt
from amqtt.broker import Broker
from pwdlib.hashers.argon2 import Argon2Hasher

log = logging.getLogger(__name__)
# amqtt's session state machine logs every transition at INFO: a line per client per event
logging.getLogger("transitions").setLevel(logging.WARNING)

MAX_PAYLOAD_BYTES = 64 * 1024  # control payloads above this are rejected unread
EXCERPT_CHARS = 120  # how much of a bad payload `events/error` quotes back
CONTROL_TOPICS = ("staleness", "rollout_actors", "pause", "resume", "checkpoint", "stop", "coach")
# `ack` is ours, not DESIGN's list: with it every control message gets exactly one answer.
# staleness: every change of η made by `max_staleness: auto`, with its reason
EVENT_TOPICS = ("version", "status", "step", "error", "ack", "staleness")
STALENESS_MODES = ("fixed", "auto")
RETAINED_EVENTS = frozenset({"version", "status"})  # a late subscriber still gets the last one
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")  # no MQTT wildcards or levels
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_ENV = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class BusConfigError(ValueError):
    """A bus setting is wrong; the message names the field, the value and the fix."""


class BadMessage(ValueError):
    """A control message failed validation; `reason` says exactly why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class BusConfig:
    # None: start an embedded broker on 127.0.0.1; else "mqtt://host:port" or "mqtts://host:port"
    url: str | None = None
    username_env: str = "TROUPE_BUS_USERNAME"  # env variable holding an external broker's user
    password_env: str = "TROUPE_BUS_PASSWORD"  # env variable holding its password
    keepalive_s: int = 30  # MQTT keepalive; a silent peer is dropped after 1.5x this
    max_queued_messages: int = 1024  # control messages waiting for the listener; more are dropped
    reconnect_s: float = 2.0  # wait before the listener reconnects after losing the broker

    def __post_init__(self) -> None:
        if self.url is not None:
            parts = urlsplit(self.url)
            if parts.scheme not in ("mqtt", "mqtts") or not parts.hostname:
                raise BusConfigError(f"bus.url={self.url!r}: write mqtt://host:port or "
                                     "mqtts://host:port, or leave it unset for the embedded broker")
            if parts.username or parts.password:
                raise BusConfigError(f"bus.url={self.url!r} carries credentials: put them in the "
                                     f"variables named by bus.username_env / bus.password_env")
        for name in ("username_env", "password_env"):
            if not _ENV.fullmatch(getattr(self, name)):
                raise BusConfigError(f"bus.{name}={getattr(self, name)!r}: must be an environment "
                                     "variable name such as TROUPE_BUS_PASSWORD")
        if not 5 <= self.keepalive_s <= 3600:
            raise BusConfigError(f"bus.keepalive_s={self.keepalive_s}: choose 5..3600 seconds")
        if self.max_queued_messages < 1:
            raise BusConfigError(
                f"bus.max_queued_messages={self.max_queued_messages}: must be >= 1")
        if self.reconnect_s <= 0:
            raise BusConfigError(f"bus.reconnect_s={self.reconnect_s}: must be > 0")



def check_run_id(run_id: str) -> str:
    """Return `run_id` if it can be one MQTT topic level, else raise `BusConfigError`."""
    if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id):
        raise BusConfigError(f"run_id={run_id!r}: use letters, digits and _ . : - (no '/', '+', "
                             "'#'), at most 128 characters")
    return run_id


def control_topic(run_id: str, name: str) -> str:
    """`troupe/<run_id>/control/<name>` for a name in `CONTROL_TOPICS`."""
    if name not in CONTROL_TOPICS:
        raise ValueError(f"control topic {name!r}: choose one of {list(CONTROL_TOPICS)}")
    return f"troupe/{check_run_id(run_id)}/control/{name}"


def event_topic(run_id: str, name: str) -> str:
    """`troupe/<run_id>/events/<name>` for a name in `EVENT_TOPICS`."""
    if name not in EVENT_TOPICS:
        raise ValueError(f"event topic {name!r}: choose one of {list(EVENT_TOPICS)}")
    return f"troupe/{check_run_id(run_id)}/events/{name}"


def control_filter(run_id: str) -> str:
    """The subscription that receives every control message of one run."""
    return f"troupe/{check_run_id(run_id)}/control/#"


def _int(low: int, high: int) -> Any:
    return field(metadata={"range": (low, high)})


def _text(max_len: int, pattern: re.Pattern[str] | None = None, choices: tuple = (),
          default: str | None = None) -> Any:
    meta = {"max_len": max_len, "pattern": pattern, "choices": choices}
    return field(metadata=meta) if default is None else field(default=default, metadata=meta)


def _request_id() -> Any:
    return _text(64, default="")  # echoed in the answer so a sender can match it


@dataclass(frozen=True)
class SetStaleness:
    """`control/staleness`: set η (max versions behind) of one model's learner.

    mode "fixed" sets η = `max_staleness` and turns the model's `auto` off; mode "auto" hands
    η to the run's controller (runtime/staleness.py) with `max_staleness` as its cap.
    """
    run_id: str = _text(128)
    model: str = _text(128, pattern=_NAME)
    max_staleness: int = _int(0, 1024)
    request_id: str = _request_id()
    mode: str = _text(8, choices=STALENESS_MODES, default="fixed")


@dataclass(frozen=True)
class ScaleRollout:
    """`control/rollout_actors`: run this many rollout actors (to run none, send `Pause`)."""
    run_id: str = _text(128)
    actors: int = _int(1, 1024)
    request_id: str = _request_id()


@dataclass(frozen=True)
class Pause:
    """`control/pause`: stop admitting new rounds; in-flight ones finish."""
    run_id: str = _text(128)
    request_id: str = _request_id()


@dataclass(frozen=True)
class Resume:
    """`control/resume`: admit rounds again after a pause."""
    run_id: str = _text(128)
    request_id: str = _request_id()


@dataclass(frozen=True)
class Checkpoint:
    """`control/checkpoint`: checkpoint every learner at its next step."""
    run_id: str = _text(128)
    request_id: str = _request_id()


@dataclass(frozen=True)
class Stop:
    """`control/stop`: end the run cleanly (checkpoint, then shut down)."""
    run_id: str = _text(128)
    reason: str = _text(512, default="")
    request_id: str = _request_id()


@dataclass(frozen=True)
class CoachControl:
    """`control/coach`: hold ("pause") or release ("resume") new coach requests, as the
    coach pool's breaker does in an outage; rows wait for their scores, none is dropped."""
    run_id: str = _text(128)
    action: str = _text(16, choices=("pause", "resume"))
    request_id: str = _request_id()


Command = Union[SetStaleness, ScaleRollout, Pause, Resume, Checkpoint, Stop, CoachControl]
COMMANDS: dict[str, type] = {"staleness": SetStaleness, "rollout_actors": ScaleRollout,
                             "pause": Pause, "resume": Resume, "checkpoint": Checkpoint,
                             "stop": Stop, "coach": CoachControl}
TOPIC_OF = {cls: name for name, cls in COMMANDS.items()}


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _reject_constant(name: str) -> None:
    raise BadMessage(f"payload holds {name}, which is not JSON")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise BadMessage(f"payload repeats a key: {_short(sorted(keys))}")
    return dict(pairs)


def _decode(payload: bytes) -> dict[str, Any]:
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise BadMessage(f"payload is {len(payload)} bytes, over the {MAX_PAYLOAD_BYTES}-byte cap")
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadMessage(f"payload is not UTF-8 ({exc.reason} at byte {exc.start})") from exc
    try:
        body = json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_unique_keys)
    except RecursionError as exc:
        raise BadMessage("payload nests too deeply to be a command") from exc
    except ValueError as exc:  # JSONDecodeError, and ints longer than Python converts
        if isinstance(exc, BadMessage):
            raise
        raise BadMessage(f"payload is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadMessage(f"payload must be a JSON object, got {type(body).__name__}")
    return body


def _check_field(name: str, kind: type, meta: Mapping[str, Any], value: Any) -> None:
    if type(value) is not kind:  # exact: true is not an int, 3 is not a str
        raise BadMessage(f"field {name!r} must be {kind.__name__}, got {type(value).__name__} "
                         f"{_short(value)}")
    if "range" in meta:
        low, high = meta["range"]
        if not low <= value <= high:
            raise BadMessage(f"field {name!r}={value} is outside {low}..{high}")
    if kind is str:
        if len(value) > meta["max_len"]:
            raise BadMessage(f"field {name!r} is {len(value)} characters, over {meta['max_len']}")
        if meta["pattern"] is not None and not meta["pattern"].fullmatch(value):
            raise BadMessage(f"field {name!r}={_short(value)} must match {meta['pattern'].pattern}")
        if meta["choices"] and value not in meta["choices"]:
            raise BadMessage(f"field {name!r}={_short(value)}: choose one of "
                             f"{list(meta['choices'])}")


def parse_control(topic: str, payload: bytes, run_id: str) -> Command:
    """Validate one control message of run `run_id` and return its command (DESIGN §9).

    Raises:
        BadMessage: the topic is not a control topic of this run, or the payload is oversize,
            not UTF-8 JSON, not an object, misses or adds fields, has a wrong type, an
            out-of-range value, or another run's `run_id`.
    """
    prefix = f"troupe/{run_id}/control/"
    if not topic.startswith(prefix) or topic[len(prefix):] not in COMMANDS:
        raise BadMessage(f"topic {_short(topic)} is not one of {prefix}{{{','.join(COMMANDS)}}}")
    cls = COMMANDS[topic[len(prefix):]]
    body = _decode(payload)
    specs = {f.name: f for f in fields(cls)}
    unknown = sorted(set(body) - set(specs))
    if unknown:
        raise BadMessage(f"unknown field(s) {_short(unknown)} for {cls.__name__}; allowed: "
                         f"{sorted(specs)}")
    hints = get_type_hints(cls)
    for name, spec in specs.items():
        if name not in body:
            if spec.default is MISSING:
                raise BadMessage(f"missing field {name!r} for {cls.__name__}")
            continue
        _check_field(name, hints[name], spec.metadata, body[name])
    if body["run_id"] != run_id:
        raise BadMessage(f"run_id {_short(body['run_id'])} is not this run's ({run_id!r})")
    return cls(**body)


def encode_command(command: Command) -> tuple[str, bytes]:
    """The control topic name and JSON payload that `parse_control` turns back into `command`."""
    return TOPIC_OF[type(command)], json.dumps(asdict(command), sort_keys=True).encode()



def payload_digest(payload: bytes) -> str:
    """The key that ties an answer to the exact control payload it answers."""
    return hashlib.sha256(payload).hexdigest()[:32]


@dataclass(frozen=True)
class Ack:
    """`events/ack`: a control message was valid and its handler returned."""
    topic: str  # the control topic it came on
    command: str  # the command's class name
    request_id: str  # the sender's id, echoed
    payload_sha256: str  # `payload_digest` of the raw payload


@dataclass(frozen=True)
class Rejection:
    """`events/error` for a control message: why it was refused, or why its handler failed."""
    topic: str  # the control topic it came on
    reason: str  # the precise reason (`BadMessage.reason` or the handler's exception)
    excerpt: str  # the payload's first EXCERPT_CHARS characters, undecodable bytes escaped
    payload_sha256: str  # `payload_digest` of the raw payload


def _excerpt(payload: bytes) -> str:
    return payload[:EXCERPT_CHARS].decode("utf-8", errors="backslashreplace")[:EXCERPT_CHARS]



@dataclass(frozen=True)
class BusEndpoint:
    """Where a client connects and as whom."""
    host: str
    port: int
    username: str
    password: str = field(repr=False)
    tls: bool = False  # mqtts: verify the broker with the system's CA store

    def client(self, cfg: BusConfig, **options: Any) -> aiomqtt.Client:
        """A fresh aiomqtt client (not yet connected) for this endpoint."""
        return aiomqtt.Client(self.host, self.port, username=self.username,
                              password=self.password, keepalive=cfg.keepalive_s,
                              identifier=f"troupe-{secrets.token_hex(6)}",
                              tls_context=ssl.create_default_context() if self.tls else None,
                              **options)


def write_bus_json(run_dir: Path, endpoint: BusEndpoint, run_id: str) -> Path:
    """Write `<run_dir>/bus.json` (mode 0600: it holds the password) atomically."""
    path = Path(run_dir) / "bus.json"
    # mkstemp creates the file 0600 before anything is written, so the password is never
    # readable by others, not even for the moment between write and chmod.
    fd, tmp = tempfile.mkstemp(dir=run_dir, prefix=".bus.", suffix=".json")
    with os.fdopen(fd, "w") as out:
        json.dump({"host": endpoint.host, "port": endpoint.port, "username": endpoint.username,
                   "password": endpoint.password, "run_id": run_id}, out)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
    return path


def endpoint_for(cfg: BusConfig, run_dir: Path) -> BusEndpoint:
    """The broker of a run: its `bus.json` when embedded, else `cfg.url` plus env credentials."""
    if cfg.url is None:
        path = Path(run_dir) / "bus.json"
        if not path.is_file():
            raise BusConfigError(f"no {path}: the run's embedded broker has not started; if the "
                                 "run uses an external broker, set bus.url to it")
        info = json.loads(path.read_text())
        return BusEndpoint(info["host"], info["port"], info["username"], info["password"])
    missing = [name for name in (cfg.username_env, cfg.password_env) if not os.environ.get(name)]
    if missing:
        raise BusConfigError(f"bus.url={cfg.url!r} needs credentials: set the environment "
                             f"variable(s) {missing} (named by bus.username_env/bus.password_env)")
    parts = urlsplit(cfg.url)
    tls = parts.scheme == "mqtts"
    return BusEndpoint(parts.hostname, parts.port or (8883 if tls else 1883),
                       os.environ[cfg.username_env], os.environ[cfg.password_env], tls)


class EmbeddedBroker:
    """An amqtt broker on 127.0.0.1 (a free port) that admits only generated credentials.

    `start` writes them to `<run_dir>/bus.json` (DESIGN §10). Use from a running event loop,
    or through `BrokerThread` from synchronous code.
    """

    def __init__(self, run_dir: Path, run_id: str) -> None:
        self.run_dir = Path(run_dir)
        self.run_id = check_run_id(run_id)
        self.endpoint: BusEndpoint | None = None
        self._broker: Broker | None = None

    async def start(self) -> BusEndpoint:
        """Start serving; return the endpoint (also written to bus.json)."""
        username = f"troupe-{secrets.token_hex(4)}"
        password = secrets.token_urlsafe(32)
        # The password is 256 random bits, so a slow hash buys nothing; cheap argon2 keeps
        # each connect from blocking the broker's loop for a quarter second on a small machine.
        hashed = Argon2Hasher(time_cost=1, memory_cost=8192, parallelism=1).hash(password)
        with tempfile.TemporaryDirectory(prefix="troupe-bus-") as tmp:
            password_file = Path(tmp) / "passwd"
            password_file.write_text(f"{username}:{hashed}\n")
            # Only the file plugin: with no AnonymousAuthPlugin a client without a username gets
            # no yes from any plugin, and amqtt refuses it. Port 0: the OS picks a free port.
            self._broker = Broker({
                "listeners": {"default": {"type": "tcp", "bind": "127.0.0.1:0"}},
                "plugins": {"amqtt.plugins.authentication.FileAuthPlugin":
                            {"password_file": str(password_file)}},
            })  # the plugin reads the file here, in the constructor
        await self._broker.start()
        # amqtt does not report the port it bound; its listener's asyncio server does.
        sockets = self._broker._servers["default"].instance.sockets  # noqa: SLF001
        self.endpoint = BusEndpoint("127.0.0.1", sockets[0].getsockname()[1], username, password)
        write_bus_json(self.run_dir, self.endpoint, self.run_id)
        log.info("bus: embedded broker on 127.0.0.1:%d", self.endpoint.port)
        return self.endpoint

    async def stop(self) -> None:
        """Close every session and the listening socket."""
        if self._broker is not None:
            await self._broker.shutdown()
            self._broker = None


class BrokerThread:
    """`EmbeddedBroker` on its own event loop in a daemon thread, for a synchronous controller."""

    def __init__(self, run_dir: Path, run_id: str, timeout_s: float = 30.0) -> None:
        self.broker = EmbeddedBroker(run_dir, run_id)
        self.timeout_s = timeout_s  # how long start/stop may take before raising TimeoutError
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="troupe-bus-broker",
                                        daemon=True)

    def start(self) -> BusEndpoint:
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self.broker.start(), self._loop)
        return future.result(self.timeout_s)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.broker.stop(), self._loop).result(self.timeout_s)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(self.timeout_s)
        self._loop.close()



class BusClient:
    """A connected publisher: `async with BusClient(endpoint, run_id) as bus: ...`."""

    def __init__(self, endpoint: BusEndpoint, run_id: str, cfg: BusConfig | None = None) -> None:
        self.run_id = check_run_id(run_id)
        self.client = endpoint.client(cfg or BusConfig())

    async def __aenter__(self) -> BusClient:
        await self.client.__aenter__()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.client.__aexit__(*exc_info)

    async def publish_event(self, name: str, body: Mapping[str, Any]) -> None:
        """Publish `body` as JSON on `events/<name>`; version and status are retained."""
        await self.client.publish(event_topic(self.run_id, name), json.dumps(dict(body)),
                                  qos=1, retain=name in RETAINED_EVENTS)

    async def publish_command(self, command: Command) -> None:
        """Publish a control command (never retained: it would replay on every restart)."""
        name, payload = encode_command(command)
        await self.client.publish(control_topic(self.run_id, name), payload, qos=1)


Handler = Callable[[Command], Union[Awaitable[None], None]]


class ControlListener:
    """Subscribes to `troupe/<run_id>/control/#` and answers every message exactly once.

    A valid command goes to `handler` (sync or async; keep it short, it runs in the receive
    loop) and is answered on `events/ack`; a bad message, or a handler that raises, on
    `events/error`. Neither stops the listener. After a lost connection it reconnects every
    `cfg.reconnect_s`; a refused first connection (wrong credentials) raises instead.
    """

    def __init__(self, endpoint: BusEndpoint, run_id: str, handler: Handler,
                 cfg: BusConfig | None = None) -> None:
        self.endpoint = endpoint
        self.run_id = check_run_id(run_id)
        self.handler = handler
        self.cfg = cfg or BusConfig()
        self.subscribed = asyncio.Event()  # set while subscribed; tests and callers await it
        self.received = self.acked = self.rejected = self.handler_failures = 0
        self.reconnects = self.foreign = 0  # foreign: delivered outside our subscription

    async def run(self) -> None:
        """Serve until cancelled."""
        connected_once = False
        while True:
            try:
                client = self.endpoint.client(
                    self.cfg, max_queued_incoming_messages=self.cfg.max_queued_messages)
                async with client:
                    connected_once = True
                    await client.subscribe(control_filter(self.run_id), qos=1)
                    self.subscribed.set()
                    async for message in client.messages:
                        await self._answer(client, message)
            except aiomqtt.MqttError as exc:
                self.subscribed.clear()
                if not connected_once:
                    raise
                self.reconnects += 1  # a deliberate retry: the broker may come back
                log.warning("bus: lost the broker (%s); reconnecting in %.1f s", exc,
                            self.cfg.reconnect_s)
                await asyncio.sleep(self.cfg.reconnect_s)

    async def _answer(self, client: aiomqtt.Client, message: aiomqtt.Message) -> None:
        topic = message.topic.value
        if not topic.startswith(f"troupe/{self.run_id}/control/"):
            # amqtt 0.12.1 sends a connecting client the retained messages of every session's
            # subscriptions, not only its own: not ours to answer, counted and dropped.
            self.foreign += 1
            log.debug("bus: dropped %s, outside %s", topic, control_filter(self.run_id))
            return
        self.received += 1
        payload = message.payload if isinstance(message.payload, bytes) else str(
            message.payload).encode()
        digest = payload_digest(payload)
        try:
            if message.retain:
                raise BadMessage("retained control messages are refused (one would replay on "
                                 "every restart); publish without retain")
            command = parse_control(topic, payload, self.run_id)
        except BadMessage as bad:
            self.rejected += 1
            await self._publish(client, "error", Rejection(topic, bad.reason, _excerpt(payload),
                                                           digest))
            return
        try:
            result = self.handler(command)
            if inspect.isawaitable(result):
                await result
        except Exception as exc:  # counted and reported on events/error: a handler bug must
            # not take the bus down with it, and the sender still gets its one answer
            self.handler_failures += 1
            if isinstance(exc, ValueError):  # the run refused it (the reason goes back)
                log.warning("bus: %s refused: %s", topic, exc)
            else:
                log.exception("bus: handler failed on %s", topic)
            await self._publish(client, "error", Rejection(
                topic, f"handler raised {type(exc).__name__}: {exc}", _excerpt(payload), digest))
            return
        self.acked += 1
        await self._publish(client, "ack", Ack(topic, type(command).__name__, command.request_id,
                                                digest))

    async def _publish(self, client: aiomqtt.Client, name: str, answer: Ack | Rejection) -> None:
        await client.publish(event_topic(self.run_id, name), json.dumps(asdict(answer)), qos=1)
