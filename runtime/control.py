"""Live operation of a run (DESIGN §9): commands from the bus applied, events published.

`RunControl` belongs to the controller (`runtime/controller.py`) and runs on its thread:
- `apply_pending` applies the commands the bus handed over (`BusService.inbox`): η per model
  (at the clock, the one live copy), rollout actors (scale up: spawn; scale down: drain the
  highest-numbered actors, their unfinished rounds settled as `scaled_down`), pause/resume
  (the clock admits nothing while paused), checkpoint, stop, coach hold. A command that cannot
  be applied raises, and its sender gets the reason on `events/error`.
- `publish_steps` forwards each learner step to `events/step` and the versions to the
  retained `events/version`, and feeds `max_staleness: auto` (runtime/staleness.py): each η
  it chooses is set at the clock, logged, published on `events/staleness` and written to
  TensorBoard with its reason; `publish_status` keeps the retained `events/status` current.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING

import ray

from runtime.bus import (Checkpoint, CoachControl, Command, Pause, Resume, ScaleRollout,
                         SetStaleness, Stop)
from runtime.failures import ACTOR_GONE
from runtime.staleness import Decision, StalenessPilot, coach_capacity

if TYPE_CHECKING:
    from runtime.bus_service import BusService
    from runtime.controller import Run
    from runtime.stall import Snapshot

log = logging.getLogger("troupe")

STEP_EVENTS_EVERY_S = 1.0  # how often learners are asked for new steps
CALL_TIMEOUT_S = 60.0  # a control call to an actor that takes longer fails the command


def _command_call(refs, what: str):
    """`ray.get` of a command's call within CALL_TIMEOUT_S; a slow actor fails the command
    (its sender is told why) instead of holding the driver's loop."""
    try:
        return ray.get(refs, timeout=CALL_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(f"{what} did not answer within {CALL_TIMEOUT_S:.0f} s (alive, but "
                           "slow): the command may still take effect when it does; send it "
                           "again to be sure") from None


class RunControl:
    """Command application and event publishing for one `Run` (see the module docstring)."""

    def __init__(self, run: Run, bus: BusService | None) -> None:
        self.run = run
        self.bus = bus
        self.target_actors = run.cfg.rollout.actors
        self.paused = False
        self.coach_paused = False
        self.stop_reason: str | None = None
        self.commands: dict[str, int] = {}  # command class -> applied
        self.refused = 0
        self.scaling: list[dict] = []  # (time, from, to) of every scale command
        self._versions: dict[str, int] = {m: 0 for m in run.cfg.models}
        self._steps_at = 0.0
        self._rate: deque[tuple[float, int]] = deque(maxlen=64)  # (time, episodes) samples
        self.pilot = StalenessPilot({m: mc.learner for m, mc in run.cfg.models.items()},
                                    coach_rows=coach_capacity(run.cfg))
        self.staleness_changes: list[dict] = []  # every η the pilot set (the run summary)

    # ------------------------------------------------------------------ commands
    def apply_pending(self) -> None:
        if self.bus is None:
            return
        for command, done in self.bus.pending():
            if not done.set_running_or_notify_cancel():
                continue  # the sender's wait timed out: it was told "not applied"
            try:
                self.apply(command)
            except (ValueError, RuntimeError, ray.exceptions.RayError) as exc:
                self.refused += 1  # counted; the bus logs it and tells the sender why
                done.set_exception(exc)
                continue
            name = type(command).__name__
            self.commands[name] = self.commands.get(name, 0) + 1
            done.set_result(None)
            self.publish_status()

    def apply(self, command: Command) -> None:
        run = self.run
        if isinstance(command, SetStaleness):
            if command.model not in run.cfg.models:
                raise ValueError(f"model {command.model!r} is not trained by this run; its "
                                 f"models: {sorted(run.cfg.models)}")
            before = _command_call(run.clock.max_staleness.remote(command.model),
                                   "the clock (max_staleness)")
            if command.mode == "auto":
                if before > command.max_staleness:  # the new cap binds at once
                    _command_call(run.clock.set_max_staleness.remote(
                        command.model, command.max_staleness), "the clock (set_max_staleness)")
                self.pilot.enable(command.model, cap=command.max_staleness)
                log.info("control: max_staleness of %s is auto again (cap %d, now %d)",
                         command.model, command.max_staleness,
                         min(before, command.max_staleness))
                return
            _command_call(run.clock.set_max_staleness.remote(
                command.model, command.max_staleness), "the clock (set_max_staleness)")
            overridden = " (auto off until set-staleness auto)" if self.pilot.is_auto(
                command.model) else ""
            self.pilot.disable(command.model)
            log.info("control: max_staleness of %s %d -> %d%s", command.model, before,
                     command.max_staleness, overridden)
        elif isinstance(command, ScaleRollout):
            limit = run.cfg.rollout.max_actors
            if command.actors > limit:
                raise ValueError(f"actors={command.actors} exceeds rollout.max_actors={limit} "
                                 "of this run (set it higher when starting a run)")
            self.scale_to(command.actors)
        elif isinstance(command, Pause):
            _command_call(run.clock.pause.remote(), "the clock (pause)")
            self.paused = True
            log.info("control: paused (no new rounds; rounds in flight finish)")
        elif isinstance(command, Resume):
            _command_call(run.clock.resume.remote(), "the clock (resume)")
            self.paused = False
            log.info("control: resumed")
        elif isinstance(command, Checkpoint):
            _command_call([w.request_checkpoint.remote() for w in run.learners.values()],
                          f"learners {sorted(run.learners)} (request_checkpoint)")
            log.info("control: checkpoint requested from every learner")
        elif isinstance(command, Stop):
            self.stop_reason = command.reason or "stop requested on the control bus"
            log.info("control: stop requested (%s)", self.stop_reason)
        elif isinstance(command, CoachControl):
            method = run.coach.pause if command.action == "pause" else run.coach.resume
            _command_call(method.remote(), f"the coach pool ({command.action})")
            self.coach_paused = command.action == "pause"
            log.info("control: coach %sd", command.action)
        else:  # parse_control only builds the types above
            raise ValueError(f"no handler for {type(command).__name__}")

    def scale_to(self, n: int) -> None:
        """Run `n` rollout actors: spawn the missing ones, or drain the highest-numbered."""
        run = self.run
        live = sorted(i for i in run.rollouts if i not in run.draining)
        self.scaling.append({"at": time.time(), "from": len(live), "to": n})
        self.target_actors = n
        if n > len(live):
            free = (i for i in range(run.cfg.rollout.max_actors) if i not in run.rollouts)
            for _ in range(n - len(live)):
                run.spawn_rollout(next(free))
        for index in live[n:]:
            run.draining[index] = time.time()
            run.rollouts[index].drain.remote(run.cfg.run.drain_timeout_s, "scaled_down")
        log.info("control: rollout actors %d -> %d", len(live), n)

    # ------------------------------------------------------------------ events
    def publish_steps(self, force: bool = False) -> None:
        """Forward new learner steps to events/step and new versions to events/version, and
        let the staleness pilot see them."""
        now = time.time()
        if not force and now - self._steps_at < STEP_EVENTS_EVERY_S:
            return
        self._steps_at = now
        run = self.run
        changed = False
        for model_id in list(run.learners):
            try:
                steps = ray.get(run.learners[model_id].steps_since.remote(
                    self._versions[model_id]), timeout=CALL_TIMEOUT_S)
            except (*ACTOR_GONE, ray.exceptions.GetTimeoutError) as exc:
                # dead: the supervision loop restarts it; slow: asked again next round
                log.info("learner %s steps not read this round: %s", model_id,
                         type(exc).__name__)
                continue
            round_s, feed = None, bool(steps) and self.pilot.is_auto(model_id)
            if feed:
                try:
                    round_s = ray.get(run.clock.round_seconds.remote(model_id),
                                      timeout=CALL_TIMEOUT_S)
                except ray.exceptions.GetTimeoutError:  # slow: these steps go unmeasured
                    log.warning("auto staleness %s: the clock did not answer within %.0f s; "
                                "%d step(s) not measured", model_id, CALL_TIMEOUT_S, len(steps))
                    feed = False
            for step in steps:
                if self.bus is not None:
                    self.bus.publish("step", step)
                self._versions[model_id] = max(self._versions[model_id], step["version"])
                changed = True
                decision = (self.pilot.observe(model_id, step, round_s, now=time.time())
                            if feed else None)
                if decision is not None:
                    self._apply_auto(model_id, step["version"], decision)
        if changed and self.bus is not None:
            self.bus.publish("version", {"versions": dict(self._versions), "at": now})

    def _apply_auto(self, model_id: str, version: int, decision: Decision) -> None:
        """Set the η the pilot chose, and say so: log, events/staleness, TensorBoard."""
        try:
            ray.get(self.run.clock.set_max_staleness.remote(model_id, decision.eta),
                    timeout=CALL_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            # slow, not dead (a dead clock raises): the next window measures η as it is
            log.warning("auto staleness %s: η %d not set, the clock did not answer within "
                        "%.0f s", model_id, decision.eta, CALL_TIMEOUT_S)
            return
        change = {"model": model_id, "version": version, "max_staleness": decision.eta,
                  "reason": decision.reason, "at": time.time()}
        self.staleness_changes.append(change)
        log.info("auto staleness %s at v%d: %s", model_id, version, decision.reason)
        if self.bus is not None:
            self.bus.publish("staleness", change)
        self.run.metrics.scalars.remote({f"staleness/{model_id}/auto_eta": float(decision.eta)},
                                        version)
        self.run.metrics.text.remote(f"staleness/{model_id}/auto", decision.reason, version)

    def rewound(self, model_id: str, version: int) -> None:
        """A restarted learner continues from `version`: its next steps are new events."""
        self._versions[model_id] = version

    def episodes_per_s(self, episodes: int, now: float, window_s: float = 60.0) -> float:
        """Episodes per second over the last `window_s` (the rate at today's actor count)."""
        self._rate.append((now, episodes))
        while len(self._rate) > 2 and now - self._rate[1][0] >= window_s:
            self._rate.popleft()
        (t0, e0), (t1, e1) = self._rate[0], self._rate[-1]
        return (e1 - e0) / (t1 - t0) if t1 > t0 else 0.0

    def status(self, snapshot: Snapshot | None = None, rate: float | None = None) -> dict:
        run = self.run
        body = {
            "run_id": run.run_id, "state": run.state, "at": time.time(),
            "paused": self.paused, "coach_paused": self.coach_paused,
            "rollout_actors": {"target": self.target_actors,
                               "live": len(run.rollouts) - len(run.draining),
                               "draining": len(run.draining),
                               "max": run.cfg.rollout.max_actors},
            "restarts": {"total": run.restarts, "last_hour": run.restarts_last_hour(),
                         "budget_per_hour": run.cfg.run.actor_restarts_per_hour},
            "commands": dict(self.commands), "refused": self.refused,
        }
        if snapshot is not None:
            body["models"] = {
                m: {"version": c["version"], "max_staleness": c["max_staleness"],
                    "staleness_mode": "auto" if self.pilot.is_auto(m) else "fixed",
                    "issued_units": c["issued_units"], "limit": c["limit"],
                    **{k: snapshot.buffers[m][k] for k in ("ready_rows", "pending_rows",
                                                          "rows_trained")}}
                for m, c in snapshot.clock.items()}
        if rate is not None:
            body["episodes_per_s"] = round(rate, 4)
        return body

    def publish_status(self, snapshot: Snapshot | None = None, rate: float | None = None) -> None:
        if self.bus is not None:
            self.bus.publish("status", self.status(snapshot, rate))

    def publish_error(self, kind: str, detail: str) -> None:
        """A run-level failure (actor crash, engine restart, run stop) on events/error."""
        if self.bus is not None:
            self.bus.publish("error", {"topic": "run", "kind": kind, "reason": detail,
                                       "at": time.time()})
