"""Slow is not dead: the driver's calls to its actors, each with a timeout.

Every supervision round the controller asks every part for its counters and health. A call
can fail in two ways, and they mean different things:
- dead: Ray raises `ACTOR_GONE` (runtime/failures.py) for it. The controller's restart-or-stop
  logic for that kind of actor handles it, as it always did.
- slow: no answer within `run.call_timeout_s`. The round goes on with the part's last answer.
  The call stays pending (it is not sent again while it runs, so a hung actor's queue does
  not grow); later rounds check it without waiting. Each round it is still unanswered counts
  one slow call for that actor (summary `supervision.slow_calls`, TensorBoard
  `perf/slow_calls/<actor>`) and is warned about with the actor, the call and the seconds.
- hung: a call still unanswered after `run.unanswered_timeout_s` raises `ActorHung`, which
  stops the run with that cause: a live actor that never answers is a failure, not a wait.

`SGLangEngine.ensure_alive` restarts a dead server inside the call, which takes minutes. It is
polled like any call: while a restart runs its call stays pending across rounds, so the
driver keeps supervising learners, rollouts and commands meanwhile; its bound is the engine's
launch time (`engine_restart_s`) when that is longer than `run.unanswered_timeout_s`.

One-time calls (starting engines, recovering logs, stopping learners) use `get_within`:
a long explicit limit, then `ActorHung`.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import ray

from runtime.failures import ACTOR_GONE

if TYPE_CHECKING:
    from actors.engines.sglang import EngineConfig

log = logging.getLogger("troupe")

Call = tuple[str, str]  # (actor, method), e.g. ("buffer-policy", "stats")
Calls = dict[Call, Callable[[], "ray.ObjectRef"]]  # call -> its sender, e.g. actor.stats.remote

WARN_EVERY_S = 30.0  # one warning per call this often while it stays unanswered
SETUP_TIMEOUT_S = 900.0  # one-time calls that load: a buffer's log, a learner's checkpoint
READY_TIMEOUT_S = 60.0  # fetching the result of a call Ray already reports done
# stopping learners end their step and may write a checkpoint; a step longer than
# run.stall_timeout_s (900 s by default) is already a stall
LEARNER_STOP_TIMEOUT_S = 1800.0
ENGINE_STOP_TIMEOUT_S = 30.0  # one engine server's stop at shutdown (the run is over)
ENGINE_LAUNCHES = 3  # SGLangEngine launches up to 3 times when its port was taken meanwhile
ENGINE_MARGIN_S = 60.0  # stopping the old server, waiting for its port (15 s), reaping it


class ActorHung(RuntimeError):
    """A live actor left a call unanswered past its limit: the run stops with this cause."""


def engine_restart_s(cfg: EngineConfig) -> float:
    """The longest a server (re)start inside `SGLangEngine.start` / `ensure_alive` may take:
    its launches, and a restart's wait for its learner to write the served version's folder
    (at most `weight_update_timeout_s`)."""
    return (cfg.startup_timeout_s * ENGINE_LAUNCHES + cfg.weight_update_timeout_s
            + ENGINE_MARGIN_S)


def get_within(refs, timeout_s: float, what: str):
    """`ray.get` of a one-time call that may take long but not forever; dead actors raise
    their errors as `ray.get` does."""
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise ActorHung(f"{what} did not answer within {timeout_s:.0f} s: the actor is alive "
                        "(Ray reports no death) but hung or starved; see its log") from None


class SlowCalls:
    """The slow-versus-hung rule, per call (pure bookkeeping, no Ray).

    `unanswered` is told each time a round finds a call still unanswered; it counts one slow
    call for the actor, warns (at most every `WARN_EVERY_S` per call), and raises `ActorHung`
    once the call has waited its limit. `answered` ends the call's streak.
    """

    def __init__(self, call_timeout_s: float, unanswered_timeout_s: float) -> None:
        self.call_timeout_s = call_timeout_s  # one round's wait for an answer
        self.unanswered_timeout_s = unanswered_timeout_s  # a call's limit, over rounds
        self.counts: dict[str, int] = {}  # actor -> rounds that found a call of it unanswered
        self._warned_at: dict[Call, float] = {}  # call -> its wait at the last warning

    def unanswered(self, call: Call, waited_s: float, limit_s: float | None = None) -> None:
        """`call` has waited `waited_s` since it was sent; `limit_s` overrides
        `unanswered_timeout_s` for calls that legitimately take longer (engine restarts)."""
        actor, method = call
        self.counts[actor] = self.counts.get(actor, 0) + 1
        limit = self.unanswered_timeout_s if limit_s is None else limit_s
        if waited_s >= limit:
            raise ActorHung(
                f"{actor} left {method} unanswered for {waited_s:.0f} s (limit {limit:.0f} s, "
                f"run.unanswered_timeout_s={self.unanswered_timeout_s:g}): the actor is alive "
                "(Ray reports no death) but hung or starved; see its log")
        warned = self._warned_at.get(call)
        if warned is None or waited_s - warned >= WARN_EVERY_S:
            self._warned_at[call] = waited_s
            log.warning("%s did not answer %s within %.1f s: slow, not dead; its last answer "
                        "stands (the run stops if it stays unanswered for %.0f s)", actor,
                        method, waited_s, limit)

    def answered(self, call: Call) -> None:
        self._warned_at.pop(call, None)

    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> dict:
        """The run summary's `supervision` section."""
        return {"slow_calls": dict(self.counts), "slow_calls_total": self.total(),
                "call_timeout_s": self.call_timeout_s,
                "unanswered_timeout_s": self.unanswered_timeout_s}

    def scalars(self) -> dict[str, float]:
        """`perf/slow_calls` (all actors) and `perf/slow_calls/<actor>` for TensorBoard."""
        out = {"perf/slow_calls": float(self.total())}
        out.update({f"perf/slow_calls/{actor}": float(n) for actor, n in self.counts.items()})
        return out


@dataclass
class Answers:
    """What one poll got: answers, failures, and the calls that were slow."""

    values: dict[Call, Any] = field(default_factory=dict)  # answered now, or last (slow)
    failed: dict[Call, Exception] = field(default_factory=dict)  # dead actor, or the call raised
    slow: set[Call] = field(default_factory=set)  # unanswered this round

    def get(self, call: Call, default: Any = None) -> Any:
        """The call's answer: this round's, or its last one when it is slow now (`default`
        if it never answered). Raises what the call raised: a dead actor's `ACTOR_GONE`,
        or the error inside the call."""
        if call in self.failed:
            raise self.failed[call]
        return self.values.get(call, default)


class Poller:
    """Sends the driver's calls and waits for them with timeouts (`SlowCalls` decides).

    A polled call is sent once and kept pending until it answers: a round waits up to
    `call_timeout_s` for the calls it sent, and only checks the ones still pending from
    earlier rounds, so one hung actor costs no round more than one timeout. A call that must
    be answered (`wait_all`, `gather`, `wait`) is sent afresh: its answer is of now.
    """

    def __init__(self, slow: SlowCalls) -> None:
        self.slow = slow
        self._pending: dict[Call, tuple[ray.ObjectRef, float]] = {}  # call -> (ref, sent at)
        self._last: dict[Call, Any] = {}  # each call's last answer

    def poll(self, calls: Calls, limits: dict[Call, float] | None = None,
             wait_all: bool = False) -> Answers:
        """Ask every call (`calls[call]()` sends it, unless it is still pending) and collect
        what answered. `limits`: per-call `SlowCalls.unanswered` limits. `wait_all`: send
        every call afresh and keep waiting, `call_timeout_s` at a time, until each answered or
        hit its limit (the first snapshot, the final summary)."""
        limits = limits or {}
        earlier = [] if wait_all else [call for call in calls if call in self._pending]
        now = time.monotonic()
        for call, send in calls.items():
            if call not in earlier:
                self._pending[call] = (send(), now)
        timeout = self.slow.call_timeout_s
        answers = Answers()
        ready = self._ready([c for c in calls if c not in earlier], timeout)
        ready += self._ready(earlier, 0.0)
        while True:
            for call in ready:
                self._collect(call, answers)
            unanswered = [call for call in calls if call in self._pending]
            for call in unanswered:
                waited = time.monotonic() - self._pending[call][1]
                self.slow.unanswered(call, waited, limits.get(call))
            if not (wait_all and unanswered):
                break
            ready = self._ready(unanswered, timeout)
        for call in unanswered:
            answers.slow.add(call)
            if call in self._last:
                answers.values[call] = self._last[call]
        return answers

    def gather(self, calls: Calls) -> list:
        """Every call's answer in order, waited for up to its limit; raises a failure."""
        answers = self.poll(calls, wait_all=True)
        return [answers.get(call) for call in calls]

    def wait(self, call: Call, send: Callable[[], ray.ObjectRef]) -> Any:
        """One call's answer, waited for up to its limit (counted slow meanwhile)."""
        return self.gather({call: send})[0]

    def wait_until_up(self, actor, method: str, *args, what: str, limit_s: float) -> Any:
        """`actor.method(*args)`'s answer, sent again every second for `limit_s` while the
        actor's process is dead and Ray restarts it (then its error is raised). While it is up
        but does not answer it is slow, up to `unanswered_timeout_s`."""
        deadline = time.monotonic() + limit_s
        while True:
            try:
                return self.wait((what, method), lambda: getattr(actor, method).remote(*args))
            except ACTOR_GONE as exc:
                if time.monotonic() > deadline:
                    raise
                log.warning("%s unavailable (%s); waiting for its restart", what,
                            type(exc).__name__)
                time.sleep(1.0)

    def forget(self, actor: str) -> None:
        """An actor that was replaced or removed: drop its pending calls and answers."""
        for store in (self._pending, self._last):
            for call in [c for c in store if c[0] == actor]:
                del store[call]

    def _ready(self, calls: list[Call], timeout_s: float) -> list[Call]:
        if not calls:
            return []
        by_ref = {self._pending[call][0]: call for call in calls}
        done, _ = ray.wait(list(by_ref), num_returns=len(by_ref), timeout=timeout_s)
        return [by_ref[ref] for ref in done]

    def _collect(self, call: Call, answers: Answers) -> None:
        ref, _ = self._pending[call]
        try:
            value = ray.get(ref, timeout=self.slow.call_timeout_s)
        except ray.exceptions.GetTimeoutError:
            return  # done but not fetched yet: still pending, counted slow by the caller
        except ray.exceptions.RayError as exc:  # re-raised by Answers.get where it is read
            del self._pending[call]
            answers.failed[call] = exc
            return
        del self._pending[call]
        self.slow.answered(call)
        self._last[call] = value
        answers.values[call] = value
