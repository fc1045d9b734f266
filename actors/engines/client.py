"""Async HTTP client of one SGLang server: token ids in, tokens + logprobs + versions out.

Rollout actors hold one `EngineClient` per engine and call `generate` from many concurrent
episodes; all of them share one `httpx.AsyncClient` connection pool (DESIGN §7). Prompts and
responses travel as token ids, never as text, so the row's `response_ids` are exactly what
the engine sampled and `behavior_logprobs` belong to those very tokens (DESIGN §3).

What SGLang returns and how it maps onto a `Generation`:
- `meta_info.output_token_logprobs` is a list of `[logprob, token_id, text|None]`, one per
  sampled token including a final stop token. For temperature T > 0 the logprob is
  `log_softmax(logits / T)` of the full vocabulary: not renormalised by top_p/top_k, which
  is what a learner recomputing `logits / T` reproduces. For T = 0 (greedy) it is the
  unscaled `log_softmax(logits)`.
- `meta_info.weight_versions` lists `{version, start, end}` token ranges when the server
  tracks them; a request spans two versions only if a weight update lands mid-generation.
  Without it, every token carries `meta_info.weight_version`.
- `finish_reason.type` is `stop` (eos or a stop token), `length` or `abort`.
"""
from __future__ import annotations

import asyncio
import logging
import operator
from dataclasses import dataclass
from typing import Sequence

import httpx
import numpy as np

log = logging.getLogger(__name__)

FINISH_REASONS = ("stop", "length", "abort")
# the columns of an `output_token_logprobs` entry, [logprob, token_id, text]
_LOGPROB, _TOKEN_ID = operator.itemgetter(0), operator.itemgetter(1)


@dataclass(frozen=True)
class Generation:
    """One sampled candidate. `response_ids`, `logprobs` and `versions` share one length.

    Attributes:
        response_ids: int32 [T], the sampled tokens (a final stop token included).
        logprobs: float32 [T], behaviour logprob of each token under the serving weights.
        versions: int32 [T], weight version that produced each token.
        finish_reason: "stop", "length" or "abort".
        text: the server's detokenised response (special tokens skipped), for logs only.
    """

    response_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    finish_reason: str
    text: str | None

    @property
    def behavior_version(self) -> int:
        """Oldest version that produced a token (DESIGN §3 `behavior_version`)."""
        return int(self.versions.min()) if len(self.versions) else -1


class EngineError(RuntimeError):
    """The server answered with an error, or stayed unreachable through every retry."""


class EngineClient:
    """Shared-pool async client of one SGLang server.

    Args:
        base_url: server URL, e.g. `SGLangEngine.url`.
        max_concurrency: open connections, i.e. requests in flight; more wait for a slot.
        request_timeout_s: read timeout of one request (CPU queues can take minutes).
        max_retries: retries of a request that fails to connect or loses its connection,
            e.g. while the engine restarts; after them `EngineError` is raised.
        retry_backoff_s: first retry delay; doubles per retry, capped at 8 s.
    """

    def __init__(self, base_url: str, max_concurrency: int = 64,
                 request_timeout_s: float = 600.0, max_retries: int = 8,
                 retry_backoff_s: float = 0.5) -> None:
        self.base_url = base_url.rstrip("/")
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            limits=httpx.Limits(max_connections=max_concurrency,
                                max_keepalive_connections=max_concurrency),
            # pool=None: waiting for a free connection is back-pressure, not a failure.
            timeout=httpx.Timeout(request_timeout_s, connect=10.0, pool=None),
        )

    async def generate(
        self,
        prompt_ids: Sequence[int] | np.ndarray,
        n: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop_token_ids: Sequence[int] | None = None,
        stop: Sequence[str] | None = None,
    ) -> list[Generation]:
        """Sample `n` candidates continuing `prompt_ids`.

        The server's `n` is used: one request, the prompt prefilled once and shared through
        the prefix cache, and each candidate answered with its own tokens and logprobs.
        Every sampling knob is sent explicitly (top_k=-1, min_p=0 disable those filters) so
        a model's generation_config defaults cannot silently change the behaviour policy.

        Args:
            prompt_ids: token ids of the rendered prompt.
            n: number of candidates (K of a tree-sampling group), >= 1.
            max_new_tokens: response length cap; reaching it gives finish_reason "length".
            temperature: sampling temperature; 0 means greedy.
            top_p: nucleus mass; 1.0 disables it.
            stop_token_ids: extra ids that end a response (the model's eos always does).
            stop: strings that end a response (e.g. a closing code fence). The tokens that
                completed one are part of the response (they were sampled and are trained);
                finish_reason is then "stop".

        Returns:
            `n` generations in candidate order.
        """
        if n < 1:
            raise ValueError(f"n={n}; ask for at least one candidate")
        sampling = {
            "max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
            "top_k": -1, "min_p": 0.0, "n": n,
        }
        if stop_token_ids:
            sampling["stop_token_ids"] = [int(t) for t in stop_token_ids]
        if stop:
            sampling["stop"] = [str(s) for s in stop]
        payload = {
            "input_ids": [int(t) for t in np.asarray(prompt_ids).reshape(-1)],
            "sampling_params": sampling,
            "return_logprob": True,
            "logprob_start_len": -1,  # output tokens only; prompt logprobs cost a forward
        }
        body = await self._post("/generate", payload)
        outputs = body if isinstance(body, list) else [body]
        if len(outputs) != n:
            raise EngineError(f"asked {self.base_url} for {n} candidates, got {len(outputs)}")
        return [_parse_output(output) for output in outputs]

    async def health(self) -> bool:
        """Whether the server answers `/health` with 200 right now (no retries)."""
        try:
            response = await self._http.get("/health", timeout=5.0)
        except httpx.TransportError as err:
            log.info("%s health probe failed: %r", self.base_url, err)
            return False
        return response.status_code == 200

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()

    async def _post(self, path: str, payload: dict) -> dict | list:
        """POST with bounded retries on transport failures and 503 (server starting)."""
        delay = self.retry_backoff_s
        for attempt in range(self.max_retries + 1):
            try:
                response = await self._http.post(path, json=payload)
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError) as err:
                # The engine died or is restarting; the supervisor brings it back.
                failure = repr(err)
            else:
                if response.status_code == 200:
                    return response.json()
                if response.status_code != 503:
                    raise EngineError(f"{self.base_url}{path} answered HTTP "
                                      f"{response.status_code}: {response.text[:2000]}")
                failure = "HTTP 503 (server starting or shutting down)"
            if attempt < self.max_retries:
                log.warning("%s%s failed (%s); retry %d/%d in %.1f s", self.base_url, path,
                            failure, attempt + 1, self.max_retries, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 8.0)
        raise EngineError(f"{self.base_url}{path} unreachable after {self.max_retries} "
                          f"retries; last failure: {failure}")


def _parse_output(output: dict) -> Generation:
    """Turn one `/generate` result into a `Generation`."""
    meta = output["meta_info"]
    token_logprobs = meta["output_token_logprobs"]
    n = len(token_logprobs)
    # itemgetter pulls each column out in C (a generator ran a Python frame per token), and
    # allocates nothing the garbage collector tracks (zip(*) would, one iterator per token).
    response_ids = np.fromiter(map(_TOKEN_ID, token_logprobs), dtype=np.int32, count=n)
    logprobs = np.fromiter(map(_LOGPROB, token_logprobs), dtype=np.float32, count=n)
    # compared as Python ints: cheaper than a list of numpy scalars, and the same test
    if "output_ids" in output and response_ids.tolist() != list(output["output_ids"]):
        raise EngineError("server logprob token ids disagree with output_ids: "
                          f"{response_ids.tolist()} vs {output['output_ids']}")
    versions = _token_versions(meta, len(response_ids))
    finish = meta["finish_reason"]
    reason = finish["type"] if isinstance(finish, dict) else str(finish)
    if reason not in FINISH_REASONS:
        raise EngineError(f"unknown finish_reason {finish!r}; expected {FINISH_REASONS}")
    return Generation(response_ids, logprobs, versions, reason, output.get("text"))


def _token_versions(meta: dict, length: int) -> np.ndarray:
    """Per-token weight versions from the server's version ranges or its single version."""
    versions = np.full(length, _version(meta["weight_version"]), dtype=np.int32)
    for span in meta.get("weight_versions") or ():
        versions[span["start"]:span["end"]] = _version(span["version"])
    return versions


def _version(value: str | int) -> int:
    """Engines are launched and updated with integer versions; anything else is a bug."""
    try:
        return int(value)
    except ValueError:
        raise EngineError(
            f"server reports weight_version {value!r}; launch engines through SGLangEngine, "
            "which stamps integer versions"
        ) from None
