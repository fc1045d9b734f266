"""A scriptable OpenAI-compatible judge on a loopback port, for tests and benchmarks.

It speaks `POST /v1/chat/completions` (the subset the `openai` SDK uses) and answers each
request in the next planned mode, else in `default` mode:

    ok        `PROCESS_SCORE: N` (N from a hash of the prompt, 0..10), after `delay_s`, and
              `ANSWER_CORRECT` when a MathChat-style prompt shows a ground truth
    bold      `PROCESS_SCORE: **8**`
    garbage   prose without any score
    429       HTTP 429 with `Retry-After: retry_after_s` (when set)
    500       HTTP 500
    hang      never answers (the client's timeout must fire)
    down      (planned) the connection drops without an answer; `down()` closes the
              listening socket so new connections are refused until `up()`

A backward-chain prompt (one that asks for CONTRIBUTION) gets `CONTRIBUTION: D` and a
`RESIDUAL:` line in `ok` mode. The server runs its own event loop in a daemon thread, so a
test's loop, a Ray actor in another process and a benchmark can all call it; `requests`
records (monotonic time, mode) of every request it received, `peak_in_flight` the most it
was answering at once (a client's concurrency bound, seen from the server). Start with `LoopbackJudge()`,
stop with `close()`. CPU, standalone: `python -m actors.coach.loopback --delay 3`.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import threading
import time
from collections import deque

from aiohttp import web

from actors.engines.supervision import free_port

MODES = ("ok", "bold", "garbage", "429", "500", "hang", "down")


def _score_for(text: str) -> int:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=4).digest()[0] % 11


class LoopbackJudge:
    """See the module docstring. Thread-safe controls: `plan`, `set`, `down`, `up`."""

    def __init__(self, default: str = "ok", delay_s: float = 0.0, port: int = 0) -> None:
        self.default = default
        self.delay_s = delay_s
        self.retry_after_s: float | None = None
        self.score: int | None = None  # fixed PROCESS_SCORE in ok mode (None: from a hash)
        self.requests: list[tuple[float, str]] = []
        self.replies: list[tuple[list[dict], str]] = []  # (messages, reply text) answered
        self.settings: list[dict] = []  # each request's body less its messages (max_tokens, …)
        self.in_flight = self.peak_in_flight = 0  # requests being answered now, and the most
        self._plan: deque[str] = deque()
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._site: web.TCPSite | None = None
        self._ready = threading.Event()
        self.port = port or free_port()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="loopback-judge")
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("loopback judge did not start within 10 s")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def plan(self, *modes: str) -> None:
        """Answer the next requests in these modes, in order, then in `default` again."""
        unknown = set(modes) - set(MODES)
        if unknown:
            raise ValueError(f"unknown judge modes {sorted(unknown)}; known: {MODES}")
        with self._lock:
            self._plan.extend(modes)

    def set(self, default: str | None = None, delay_s: float | None = None,
            retry_after_s: float | None = None, score: int | None = None) -> None:
        """Change the default mode, the delay, Retry-After and the fixed score (None: hash)."""
        if default is not None and default not in MODES:
            raise ValueError(f"unknown judge mode {default!r}; known: {MODES}")
        with self._lock:
            if default is not None:
                self.default = default
            if delay_s is not None:
                self.delay_s = delay_s
            self.retry_after_s = retry_after_s
            self.score = score

    def down(self) -> None:
        """Close the listening socket: new connections are refused (an outage)."""
        asyncio.run_coroutine_threadsafe(self._stop_site(), self._loop).result(10)

    def up(self) -> None:
        asyncio.run_coroutine_threadsafe(self._start_site(), self._loop).result(10)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    # ------------------------------------------------------------------ server side
    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True,
                                     shutdown_timeout=1.0)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(self._start_site())
        self._ready.set()
        self._loop.run_forever()

    async def _start_site(self) -> None:
        if self._site is None:
            self._site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
            await self._site.start()

    async def _stop_site(self) -> None:
        if self._site is not None:
            await self._site.stop()
            self._site = None
        # an outage also ends the clients' kept-alive connections, not only the listener
        server = self._runner.server
        assert server is not None
        await server.shutdown(0.1)

    def _next_mode(self) -> tuple[str, float, float | None, int | None]:
        with self._lock:
            mode = self._plan.popleft() if self._plan else self.default
            self.requests.append((time.monotonic(), mode))
            return mode, self.delay_s, self.retry_after_s, self.score

    async def _handle(self, request: web.Request) -> web.Response:
        with self._lock:
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            return await self._answer(request)
        finally:
            with self._lock:
                self.in_flight -= 1

    async def _answer(self, request: web.Request) -> web.Response:
        body = await request.json()
        mode, delay, retry_after, score = self._next_mode()
        with self._lock:
            self.settings.append({k: v for k, v in body.items() if k != "messages"})
        if mode == "hang":
            await asyncio.sleep(3600)  # cancelled when the client gives up and disconnects
        if mode == "down":  # drop this connection without an answer
            assert request.transport is not None
            request.transport.abort()
            raise web.HTTPServiceUnavailable()
        if mode == "429":
            headers = {"retry-after": str(retry_after)} if retry_after is not None else {}
            return web.json_response({"error": {"message": "rate limited", "type": "rate"}},
                                     status=429, headers=headers)
        if mode == "500":
            return web.json_response({"error": {"message": "boom", "type": "server"}},
                                     status=500)
        if delay:
            await asyncio.sleep(delay)
        prompt = body["messages"][-1]["content"]
        if mode == "garbage":
            text = "The agent did fine, I suppose. Hard to say really."
        elif mode == "bold":
            text = "Evaluation: solid work.\nPROCESS_SCORE: **8**"
        elif "CONTRIBUTION" in prompt:
            delta = _score_for(prompt) - 5
            text = (f"CONTRIBUTION: {delta}\nRESIDUAL: earlier steps explain the rest "
                    f"(note {len(prompt)})")
        else:
            score = _score_for(prompt) if score is None else score
            text = f"Evaluation: the agent acted.\nPROCESS_SCORE: {score}"
            if "ANSWER_CORRECT" in prompt and ":\nN/A\n\nEvaluate" not in prompt:
                text += f"\nANSWER_CORRECT: {int(score >= 5)}"  # asked, with a ground truth
        with self._lock:
            self.replies.append((body["messages"], text))
        tokens = len(prompt) // 4
        return web.json_response({
            "id": "chatcmpl-loopback", "object": "chat.completion", "created": int(time.time()),
            "model": body["model"],
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": tokens, "completion_tokens": 12,
                      "total_tokens": tokens + 12}})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delay", type=float, default=0.0, help="seconds before each reply")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    judge = LoopbackJudge(delay_s=args.delay, port=args.port)
    print(f"loopback judge at {judge.base_url} (Ctrl-C stops it)", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        judge.close()


if __name__ == "__main__":
    main()
