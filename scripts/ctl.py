"""Operate a live run over its control bus (DESIGN §9).

    python scripts/ctl.py --run runs/<run_id> status
    python scripts/ctl.py --run latest set-staleness policy 1
    python scripts/ctl.py --run latest set-staleness policy auto [--cap 8]   # η from rates
    python scripts/ctl.py --run latest scale-rollout 3
    python scripts/ctl.py --run latest pause | resume | checkpoint | stop [--reason "..."]
    python scripts/ctl.py --run latest watch            # one line per learner step, until ^C

The embedded broker's address and credentials come from `<run_dir>/bus.json` (mode 0600). For
an external broker pass `--url mqtt://host:1883 --run-id <run_id>` with the credentials in
TROUPE_BUS_USERNAME / TROUPE_BUS_PASSWORD (or the variables named by --username-env /
--password-env).

A command waits for the run's answer on `events/ack` or `events/error` and exits 0 (done),
1 (refused: the reason is printed) or 3 (no answer within --timeout: is the run alive?).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import signal
import sys
import time
from pathlib import Path
from typing import Any

import aiomqtt
import yaml

from runtime.bus import (BadMessage, BusConfig, BusConfigError, BusEndpoint, Checkpoint,
                         Command, Pause, Resume, ScaleRollout, SetStaleness, Stop,
                         check_run_id, encode_command, endpoint_for, event_topic,
                         payload_digest, control_topic)

EXIT_OK, EXIT_REFUSED, EXIT_USAGE, EXIT_NO_ANSWER = 0, 1, 2, 3


class CtlError(Exception):
    """A problem ctl reports in one line and exits on (bad arguments, no run, no broker)."""


def find_run(spec: str, runs_dir: Path) -> Path:
    """`runs/<id>`, or `latest`: the run under `runs_dir` whose bus.json is newest."""
    if spec != "latest":
        run_dir = Path(spec)
        if not run_dir.is_dir():
            raise CtlError(f"--run {spec}: no such run directory")
        return run_dir
    found = sorted(runs_dir.glob("*/bus.json"), key=lambda p: p.stat().st_mtime_ns)
    if not found:
        raise CtlError(f"--run latest: no run under {runs_dir}/ has a bus.json (has a run with "
                       "a control bus started?); pass --run runs/<run_id>")
    return found[-1].parent


def connect_info(args: argparse.Namespace) -> tuple[BusEndpoint, str, Path | None]:
    """The broker endpoint, run id and run directory (None with --url) the arguments name;
    `--run latest` is resolved here once, so every later read is of the same run."""
    cfg = BusConfig(url=args.url, username_env=args.username_env, password_env=args.password_env)
    if args.url is not None:
        if not args.run_id:
            raise CtlError("--url needs --run-id: an external broker serves many runs")
        return endpoint_for(cfg, Path(".")), check_run_id(args.run_id), None
    run_dir = find_run(args.run, Path(args.runs_dir))
    endpoint = endpoint_for(cfg, run_dir)
    run_id = args.run_id or json.loads((run_dir / "bus.json").read_text())["run_id"]
    return endpoint, check_run_id(run_id), run_dir


def staleness_command(args: argparse.Namespace, run_id: str, request_id: str,
                      run_dir: Path | None) -> SetStaleness:
    """A fixed η, or "auto" with its cap: --cap, else the run's configured staleness_cap."""
    if args.max_staleness != "auto":
        if not args.max_staleness.isdigit():
            raise CtlError(f"set-staleness {args.model} {args.max_staleness}: give an integer "
                           "η >= 0, or auto")
        if args.cap is not None:
            raise CtlError("--cap goes with set-staleness MODEL auto (a fixed η needs no cap)")
        return SetStaleness(run_id=run_id, model=args.model,
                            max_staleness=int(args.max_staleness), request_id=request_id)
    cap = args.cap
    if cap is None:
        if run_dir is None:
            raise CtlError("set-staleness MODEL auto with --url needs --cap N (the largest η)")
        config = run_dir / "config.yaml"
        learner = yaml.safe_load(config.read_text())["models"].get(args.model)
        if learner is None:
            raise CtlError(f"model {args.model!r} is not in {config}")
        cap = int(learner["learner"]["staleness_cap"])
    return SetStaleness(run_id=run_id, model=args.model, max_staleness=cap,
                        request_id=request_id, mode="auto")


def build_command(args: argparse.Namespace, run_id: str, run_dir: Path | None = None) -> Command:
    """The command the arguments name; `run_dir` (None with --url) holds the run's config."""
    request_id = secrets.token_hex(6)
    if args.verb == "set-staleness":
        return staleness_command(args, run_id, request_id, run_dir)
    if args.verb == "scale-rollout":
        return ScaleRollout(run_id=run_id, actors=args.actors, request_id=request_id)
    if args.verb == "stop":
        return Stop(run_id=run_id, reason=args.reason, request_id=request_id)
    simple = {"pause": Pause, "resume": Resume, "checkpoint": Checkpoint}
    return simple[args.verb](run_id=run_id, request_id=request_id)


def read_event(message: aiomqtt.Message, topics: set[str]) -> dict[str, Any] | None:
    """The JSON object of an event on one of `topics`; None for any other message.

    The broker may hand a new client retained messages of other subscriptions (amqtt does):
    those are skipped. An unreadable event on our topics is reported, then skipped.
    """
    if message.topic.value not in topics:
        return None
    try:
        body = json.loads(message.payload)
    except (TypeError, ValueError) as err:
        print(f"ctl: unreadable event on {message.topic.value}: {err}", file=sys.stderr)
        return None
    if not isinstance(body, dict):
        print(f"ctl: event on {message.topic.value} is not a JSON object", file=sys.stderr)
        return None
    return body


async def send(endpoint: BusEndpoint, run_id: str, command: Command, timeout_s: float) -> int:
    """Publish `command`, print the run's answer to it, return the exit code."""
    name, payload = encode_command(command)
    digest = payload_digest(payload)
    async with endpoint.client(BusConfig()) as client:
        # Subscribe before publishing, so the answer cannot pass by unseen.
        await client.subscribe(event_topic(run_id, "ack"), qos=1)
        await client.subscribe(event_topic(run_id, "error"), qos=1)
        await client.publish(control_topic(run_id, name), payload, qos=1)
        try:
            async with asyncio.timeout(timeout_s):
                async for message in client.messages:
                    body = read_event(message, {event_topic(run_id, "ack"),
                                                event_topic(run_id, "error")})
                    if body is None or body.get("payload_sha256") != digest:
                        continue  # another topic, or the answer to another sender's message
                    if message.topic.matches(event_topic(run_id, "ack")):
                        print(f"ok: {body['command']} ({body['topic']})")
                        return EXIT_OK
                    print(f"refused: {body['reason']}", file=sys.stderr)
                    return EXIT_REFUSED
        except TimeoutError:
            print(f"no answer on {event_topic(run_id, 'ack')} within {timeout_s:.0f} s: the run "
                  "may be stopped, or its controller stalled (see its log)", file=sys.stderr)
            return EXIT_NO_ANSWER
    return EXIT_NO_ANSWER  # the message stream ended (broker went away)


async def status(endpoint: BusEndpoint, run_id: str, timeout_s: float) -> int:
    """Print the run's retained `events/status` and `events/version`."""
    wanted = {event_topic(run_id, "status"), event_topic(run_id, "version")}
    seen: dict[str, Any] = {}
    async with endpoint.client(BusConfig()) as client:
        for topic in sorted(wanted):
            await client.subscribe(topic, qos=1)
        try:
            async with asyncio.timeout(timeout_s):
                async for message in client.messages:
                    body = read_event(message, wanted)
                    if body is not None:
                        seen[message.topic.value.rsplit("/", 1)[1]] = body
                    if len(seen) == len(wanted):
                        break
        except TimeoutError:
            if not seen:
                print(f"no retained status for run {run_id} within {timeout_s:.0f} s: the run "
                      "has not published one yet", file=sys.stderr)
                return EXIT_NO_ANSWER
    print(json.dumps(seen, indent=2, sort_keys=True))
    return EXIT_OK


def step_line(body: dict[str, Any]) -> str:
    """One `watch` line from an `events/step` payload: its known fields first, then the rest."""
    head = [f"{time.strftime('%H:%M:%S')}"]
    for key in ("model", "version", "step"):
        if key in body:
            head.append(f"{key} {body[key]}")
    rest = [f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}"
            for key, value in sorted(body.items())
            if key not in ("model", "version", "step", "at")]  # the line starts with the time
    return " | ".join(head + rest)


async def watch(endpoint: BusEndpoint, run_id: str) -> int:
    """Print one line per `events/step`, and every `events/error`, until SIGINT or SIGTERM.

    The handlers are installed explicitly: a process started in the background by a script
    inherits SIGINT ignored, and Ctrl-C (or a supervisor's SIGTERM) must still end the watch.
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with endpoint.client(BusConfig()) as client:
        await client.subscribe(event_topic(run_id, "step"), qos=1)
        await client.subscribe(event_topic(run_id, "error"), qos=1)
        await client.subscribe(event_topic(run_id, "staleness"), qos=1)
        print(f"watching run {run_id} (Ctrl-C to stop)", flush=True)
        printer = asyncio.create_task(_print_events(client, run_id))
        stopper = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait({printer, stopper}, return_when=asyncio.FIRST_COMPLETED)
        for task in (printer, stopper):
            task.cancel()
        if printer in done:
            printer.result()  # the broker went away: raise its error
    return EXIT_OK


async def _print_events(client: aiomqtt.Client, run_id: str) -> None:
    topics = {event_topic(run_id, name) for name in ("step", "error", "staleness")}
    async for message in client.messages:
        body = read_event(message, topics)
        if body is None:
            continue
        if message.topic.matches(event_topic(run_id, "error")):
            print(f"error on {body.get('topic', '?')}: {body.get('reason', body)}", flush=True)
        elif message.topic.matches(event_topic(run_id, "staleness")):
            print(f"auto staleness {body.get('model', '?')} -> {body.get('max_staleness', '?')}: "
                  f"{body.get('reason', '')}", flush=True)
        else:
            print(step_line(body), flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", default="latest", help="runs/<run_id>, or latest (default)")
    parser.add_argument("--runs-dir", default="runs", help="where --run latest looks")
    parser.add_argument("--url", default=None, help="external broker, mqtt://host:port")
    parser.add_argument("--run-id", default=None, help="the run's id (with --url)")
    parser.add_argument("--username-env", default=BusConfig.username_env)
    parser.add_argument("--password-env", default=BusConfig.password_env)
    parser.add_argument("--timeout", type=float, default=30.0,
                        help="seconds to wait for the run's answer (default 30)")
    verbs = parser.add_subparsers(dest="verb", required=True)
    verbs.add_parser("status", help="the run's retained status and weight versions")
    staleness = verbs.add_parser("set-staleness", help="set a model's max_staleness (η), or "
                                 "auto: chosen from measured rates")
    staleness.add_argument("model")
    staleness.add_argument("max_staleness", help="an integer >= 0, or auto")
    staleness.add_argument("--cap", type=int, default=None,
                           help="with auto: the largest η (default: the run's staleness_cap)")
    scale = verbs.add_parser("scale-rollout", help="run N rollout actors")
    scale.add_argument("actors", type=int)
    for verb in ("pause", "resume", "checkpoint"):
        verbs.add_parser(verb)
    stop = verbs.add_parser("stop", help="end the run cleanly")
    stop.add_argument("--reason", default="stopped from ctl.py")
    verbs.add_parser("watch", help="one line per learner step, until Ctrl-C")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        endpoint, run_id, run_dir = connect_info(args)
        if args.verb == "status":
            return asyncio.run(status(endpoint, run_id, args.timeout))
        if args.verb == "watch":
            return asyncio.run(watch(endpoint, run_id))
        command = build_command(args, run_id, run_dir)
        return asyncio.run(send(endpoint, run_id, command, args.timeout))
    except (CtlError, BusConfigError, BadMessage) as err:
        print(f"ctl: {err}", file=sys.stderr)
        return EXIT_USAGE
    except aiomqtt.MqttError as err:
        print(f"ctl: cannot reach the run's broker at {endpoint.host}:{endpoint.port}: {err}",
              file=sys.stderr)
        return EXIT_NO_ANSWER
    except KeyboardInterrupt:
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
