"""The run's end of the control bus: broker, listener and event publisher on one loop thread.

The controller is synchronous (it supervises Ray actors with `ray.wait`), while the bus is
asyncio (aiomqtt). `BusService` runs the embedded broker (unless `bus.url` names an external
one), a `ControlListener` and a publishing client on an event loop in a daemon thread.

A valid command is handed to the controller's thread through `inbox` together with a future;
the listener answers the sender (`events/ack` or `events/error`) only once the controller has
applied the command, or refused it with a reason, so an ack means "done", not "received".
Events are published fire-and-forget from any thread with `publish`; a failed publish is
counted and logged, never raised into the run.
"""
from __future__ import annotations

import asyncio
import json
import concurrent.futures
import logging
import queue
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiomqtt

from runtime.bus import (BusConfig, BusEndpoint, Command, ControlListener, EmbeddedBroker,
                         endpoint_for, event_topic, RETAINED_EVENTS)

log = logging.getLogger("troupe.bus")

APPLY_TIMEOUT_S = 120.0  # a command the controller has not applied by then is answered refused


class BusService:
    """Start with `start()` (returns the endpoint), stop with `stop()`; see the module doc."""

    def __init__(self, cfg: BusConfig, run_dir: Path, run_id: str,
                 inbox_capacity: int = 256) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.run_id = run_id
        # (command, future) pairs for the controller; bounded: a flood is refused, not queued
        self.inbox: queue.Queue = queue.Queue(maxsize=inbox_capacity)
        self.published = self.publish_failures = 0
        self.endpoint: BusEndpoint | None = None
        self.listener: ControlListener | None = None
        self._broker: EmbeddedBroker | None = None
        self._client: aiomqtt.Client | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="troupe-bus",
                                        daemon=True)
        self._listener_task: asyncio.Task | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout_s: float = 60.0) -> BusEndpoint:
        """Start broker (embedded mode), publisher and listener; return once subscribed."""
        self._thread.start()
        return asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout_s)

    async def _start(self) -> BusEndpoint:
        if self.cfg.url is None:
            self._broker = EmbeddedBroker(self.run_dir, self.run_id)
            self.endpoint = await self._broker.start()
        else:
            self.endpoint = endpoint_for(self.cfg, self.run_dir)
            log.info("bus: external broker %s:%d", self.endpoint.host, self.endpoint.port)
        self._client = self.endpoint.client(self.cfg)
        await self._client.__aenter__()
        self.listener = ControlListener(self.endpoint, self.run_id, self._handle, self.cfg)
        self._listener_task = asyncio.create_task(self.listener.run())
        subscribed = asyncio.create_task(self.listener.subscribed.wait())
        done, _ = await asyncio.wait({subscribed, self._listener_task},
                                     return_when=asyncio.FIRST_COMPLETED)
        if self._listener_task in done:  # refused (credentials) or broker unreachable
            subscribed.cancel()
            self._listener_task.result()
        return self.endpoint

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop listening and publishing; shut the embedded broker down."""
        if not self._thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout_s)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout_s)

    async def _stop(self) -> None:
        if self._listener_task is not None:
            self._listener_task.cancel()
            await asyncio.gather(self._listener_task, return_exceptions=True)
        if self._client is not None:
            try:
                await self._client.__aexit__(None, None, None)
            except aiomqtt.MqttError as exc:  # already disconnected: nothing left to close
                log.info("bus: publisher closed with %s", exc)
        if self._broker is not None:
            await self._broker.stop()

    # ------------------------------------------------------------------ commands
    def submit(self, command: Command) -> concurrent.futures.Future:
        """Queue a command for the controller from any thread (what a bus message does);
        the future resolves when it is applied, or raises why it was refused."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        try:
            self.inbox.put_nowait((command, done))
        except queue.Full:
            raise RuntimeError(f"{self.inbox.maxsize} commands are waiting for the controller;"
                               " retry later") from None
        return done

    async def _handle(self, command: Command) -> None:
        """The listener's handler: hand the command to the controller and await its verdict."""
        done = self.submit(command)
        try:
            await asyncio.wait_for(asyncio.wrap_future(done), APPLY_TIMEOUT_S)
        except TimeoutError:
            done.cancel()  # the controller skips a cancelled command: refused means not applied
            raise RuntimeError(f"the controller did not apply it within {APPLY_TIMEOUT_S:.0f} s "
                               "(the run is starting or busy); not applied") from None

    def pending(self) -> list[tuple[Command, concurrent.futures.Future]]:
        """Commands waiting for the controller (called from its thread), oldest first."""
        taken = []
        while True:
            try:
                taken.append(self.inbox.get_nowait())
            except queue.Empty:
                return taken

    # ------------------------------------------------------------------ events
    def publish(self, name: str, body: Mapping[str, Any]) -> None:
        """Publish `body` on `events/<name>` from any thread; never blocks, never raises."""
        if self._client is None or not self._thread.is_alive():
            return
        future = asyncio.run_coroutine_threadsafe(self._publish(name, dict(body)), self._loop)
        future.add_done_callback(self._published)

    async def _publish(self, name: str, body: dict) -> None:
        await self._client.publish(event_topic(self.run_id, name),
                                   json.dumps(body, default=str), qos=1,
                                   retain=name in RETAINED_EVENTS)

    def _published(self, future: concurrent.futures.Future) -> None:
        if future.cancelled():
            return
        exc = future.exception()
        if exc is None:
            self.published += 1
            return
        self.publish_failures += 1  # counted: events are best effort, the run goes on
        if self.publish_failures in (1, 10, 100) or self.publish_failures % 1000 == 0:
            log.warning("bus: publishing an event failed (%d so far): %r",
                        self.publish_failures, exc)

    def stats(self) -> dict[str, int]:
        listener = self.listener
        return {"published": self.published, "publish_failures": self.publish_failures,
                "received": listener.received if listener else 0,
                "acked": listener.acked if listener else 0,
                "rejected": listener.rejected if listener else 0,
                "refused": listener.handler_failures if listener else 0}
