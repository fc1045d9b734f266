"""`max_staleness: auto`: the smallest η that keeps a learner fed, from measured rates.

The clock admits a unit while `issued < (v + η + 1) · B` (buffers/clock.py), so at most about
(η + 1) · B units are in flight for a learner that consumes B units a step. By Little's law
those units arrive at (η + 1) · B / W units a second, W being a unit's time from admission to
READY (generation, then the coach's score). The learner keeps busy a share 1 − w of its time
(w its waiting share) when they arrive at least (1 − w) · B / S units a second, S its step
time. So

    η + 1 ≥ (1 − w_target) · W / S,   η* = ⌈(1 − w_target) · W / S⌉ − 1,

clamped to [floor, cap]. A fixed η cannot know W / S; it moves with the coach's latency and
the learner's step (a 10 s coach over a 3 s step needs η ≈ 3, a 0.5 s coach η = 0).

The model ignores what can also starve the learner: a rollout side too small to keep
(η + 1) · B units going (slots, engine throughput). The measured wait corrects it: a window
whose wait share is above the target raises η by one over the model (up to the cap) while a
raise still helped, and stops raising when the last raise did not lower the wait (more η
cannot help a rollout-bound run; it would only add staleness). Lowering waits `patience`
windows in a row that all want a smaller η, so one quick window does not undo a raise, and
then goes to the largest η those windows asked for (one window of slow steps, a small W / S,
does not set it alone). It never goes back to an η whose window waited too long at (or one
above) the model's η while W / S is still as high (within 10 %): without that it would flap
between the model's η and the one the wait asked for. A long wait far above the model's η
marks nothing (a slow sampling call, the rollout side): it only resets the lowering count. A wait
counts as above the target only past a tolerance (`tolerance`, one point of share by default):
a measured share sitting on the target is noise.

The coach has a capacity of its own: it scores at most `coach.max_concurrency` rows at once
(and each HTTP judge its own `max_concurrency`). With (η + 1) steps' rows in flight, an η above
⌈coach rows / rows per step⌉ only queues rows for their scores: more staleness, no more
throughput (bench_async's 10 s cells trained ~5 rows/s at η 2 and at η 8 alike). That is the
coach ceiling: no raise goes above it, and an η above it is lowered to it at once.

`AutoStaleness.update(sample)` is a plain function of the samples it has seen: the driver
feeds it one `RateSample` a window per model and applies what it returns (the clock's
`set_max_staleness`, the bus, TensorBoard).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RateSample:
    """One model's measurements over one window (means over the window's learner steps)."""

    step_s: float  # learner time per step: sample, train, publish (busy time)
    wait_s: float  # learner time per step spent waiting for a ready batch
    unit_latency_s: float  # a unit's admission -> READY: generation plus coach latency
    eta: int  # η in force during the window
    rows_per_step: float = 0.0  # rows a learner step trains (0: unknown, no coach ceiling)

    @property
    def wait_share(self) -> float:
        total = self.step_s + self.wait_s
        return self.wait_s / total if total > 0 else 0.0


@dataclass(frozen=True)
class Decision:
    """A new η and why (published on the bus and in TensorBoard as it is)."""

    eta: int
    reason: str


class AutoStaleness:
    """η from measured rates for one model; see the module docstring."""

    def __init__(self, cap: int, target_wait: float = 0.1, floor: int = 0,
                 patience: int = 3, tolerance: float = 0.01,
                 coach_rows: int | None = None) -> None:
        """Args:
            cap: the largest η it may choose (the user's hard bound on staleness).
            target_wait: the learner's waiting share to stay under, in [0, 1).
            floor: the smallest η it may choose.
            patience: windows in a row that must all want a smaller η before it lowers.
            tolerance: how far above `target_wait` a measured share must be to count.
            coach_rows: rows the coach scores at once for this model (None: no limit known,
                or the coach runs inside episodes). With (η + 1) steps' rows in flight, an η
                above ⌈coach_rows / rows per step⌉ only queues rows at the coach: more
                staleness, no more throughput. That is the coach ceiling.
        """
        if not 0 <= floor <= cap:
            raise ValueError(f"auto staleness: need 0 <= floor ({floor}) <= cap ({cap})")
        if not 0 <= target_wait < 1:
            raise ValueError(f"auto staleness: target_wait={target_wait} must be in [0, 1)")
        if patience < 1:
            raise ValueError(f"auto staleness: patience={patience} must be >= 1")
        self.cap, self.floor = cap, floor
        self.coach_rows = coach_rows
        self.target_wait, self.patience, self.tolerance = target_wait, patience, tolerance
        self._lower_votes: list[int] = []  # the η each window in a row that wanted less asked for
        self._last_raise: tuple[int, float] | None = None  # (η before it, wait share then)
        self._too_low: tuple[int, float] | None = None  # (an η that waited too long, W / S)

    def model_eta(self, sample: RateSample) -> int:
        """η* = ⌈(1 − target) · W / S⌉ − 1, unclamped (S > 0; W = 0 gives 0)."""
        if sample.step_s <= 0:
            return self.floor
        return max(0, math.ceil((1 - self.target_wait) * sample.unit_latency_s
                                / sample.step_s - 1e-9) - 1)

    def coach_ceiling(self, sample: RateSample) -> int | None:
        """⌈coach_rows / rows per step⌉ (at least the floor), or None when unknown."""
        if not self.coach_rows or sample.rows_per_step <= 0:
            return None
        return max(self.floor, math.ceil(self.coach_rows / sample.rows_per_step - 1e-9))

    def update(self, sample: RateSample) -> Decision | None:
        """The η to set after this window, or None to keep `sample.eta`."""
        current, wait = sample.eta, sample.wait_share
        ceiling = self.coach_ceiling(sample)
        if ceiling is not None and current > ceiling:
            self._lower_votes, self._last_raise = [], None
            return Decision(ceiling, (
                f"lower {current} -> {ceiling} (the coach ceiling): the coach scores "
                f"{self.coach_rows} rows at once and a step trains {sample.rows_per_step:.0f}; "
                f"a larger η only queues rows for their scores (measured wait {wait:.0%})"))
        ratio = sample.unit_latency_s / sample.step_s if sample.step_s > 0 else 0.0
        if self._too_low is not None and ratio < 0.9 * self._too_low[1]:
            self._too_low = None  # units got faster relative to steps: try the model again
        want = self.model_eta(sample)
        basis = (f"unit latency {sample.unit_latency_s:.2f} s over learner step "
                 f"{sample.step_s:.2f} s needs η {want} for wait <= {self.target_wait:.0%}; "
                 f"measured wait {wait:.0%} at η {current}")
        waits_too_long = wait > self.target_wait + self.tolerance
        if waits_too_long and current <= want + 1 and (
                self._too_low is None or self._too_low[0] < current):
            # waited too long at (or one above) the model's η: the model misses something,
            # and going back to this η would flap. Far above the model's η, a long wait is
            # not η's doing (a slow sample, the rollout side) and marks nothing.
            self._too_low = (current, ratio)
        if waits_too_long and want <= current:
            if self._last_raise is not None and self._last_raise[0] < current \
                    and wait >= self._last_raise[1]:
                # the last raise did not lower the wait: the rollout side is the limit
                return None
            want = current + 1
            basis += "; wait above target, one more"
        if self._too_low is not None:
            want = max(want, self._too_low[0] + 1)
        if ceiling is not None and want > ceiling:
            want = ceiling
            basis += (f"; held at the coach ceiling {ceiling} ({self.coach_rows} rows scored "
                      f"at once, {sample.rows_per_step:.0f} a step)")
        want = min(max(want, self.floor), self.cap)
        if want > current:
            self._lower_votes = []
            self._last_raise = (current, wait)
            capped = " (the cap)" if want == self.cap else ""
            return Decision(want, f"raise {current} -> {want}{capped}: {basis}")
        if want < current and not waits_too_long:
            self._lower_votes.append(want)
            if len(self._lower_votes) >= self.patience:
                # the largest η the windows asked for: one window's slow steps (a small S)
                # would otherwise set η for all of them
                votes = ", ".join(map(str, self._lower_votes))
                want, self._lower_votes = max(self._lower_votes), []
                self._last_raise = None
                return Decision(want, f"lower {current} -> {want} after {self.patience} "
                                      f"windows asked for {votes} (the largest kept): {basis}")
            return None
        self._lower_votes = []
        return None


class StalenessPilot:
    """Runs `AutoStaleness` for the models whose `max_staleness` is "auto", from the learner
    step records the driver already reads (runtime/learner_worker.py `steps_since`).

    A window is `staleness_window_steps` consecutive steps taken under one η. The first step
    of a run (engines warming, the first round's full latency) starts none; after a change,
    neither do the steps sampled before the clock had it (the driver reads steps about once a
    second, and a small model steps faster), nor the first step under it, nor any step that
    began waiting less than W after the change: until then the learner still eats units admitted
    under the old η (a raise shows its effect only once its first units are READY, a unit's
    latency later), and a window measured in that fill would see the old η's wait and raise
    again for nothing. A unit's latency W is the
    clock's mean round time from admission to generated (buffers/clock.py `round_seconds`)
    plus the mean wait of the window's units from their last row to READY (the coach): an
    upper bound, since a unit's rows may be generated before its round ends.
    A user's fixed η (`ctl.py set-staleness`) switches a model to manual until `auto` is set
    again, which starts a fresh controller.
    """

    def __init__(self, learners: dict, coach_rows: int | None = None) -> None:
        """Args:
            learners: model_id -> LearnerConfig (those with `auto_staleness` start on auto).
            coach_rows: rows the coach scores at once, shared by every model (None: no
                ceiling; `coach_capacity` gives it from a run's config).
        """
        self.configs = dict(learners)
        self.coach_rows = coach_rows
        self.controllers: dict[str, AutoStaleness] = {}
        self._window: dict[str, list[dict]] = {}
        self._skip_next: set[str] = set()
        self._expect: dict[str, int] = {}  # model -> the η a decision set, until a step shows it
        self._settle: dict[str, float] = {}  # model -> time before which steps start no window
        # every window measured: model, version, the RateSample's fields, the η chosen (or
        # None: kept) -- the run summary keeps them, and unit tests replay recorded ones
        self.windows: list[dict] = []
        for model_id, cfg in self.configs.items():
            if cfg.auto_staleness:
                self.enable(model_id)

    def enable(self, model_id: str, cap: int | None = None) -> None:
        """Put `model_id` on auto (again), with its config's target and cap (or `cap`)."""
        cfg = self.configs[model_id]
        cap = cfg.staleness_cap if cap is None else cap
        share = None if self.coach_rows is None else max(1, self.coach_rows // len(self.configs))
        self.controllers[model_id] = AutoStaleness(cap=cap, target_wait=cfg.staleness_target_wait,
                                                    floor=0, coach_rows=share)
        self._window[model_id] = []
        self._expect.pop(model_id, None)
        self._settle.pop(model_id, None)
        self._skip_next.add(model_id)

    def disable(self, model_id: str) -> None:
        """A fixed η was set by hand: stop choosing for `model_id`."""
        self.controllers.pop(model_id, None)
        self._window.pop(model_id, None)
        self._expect.pop(model_id, None)
        self._settle.pop(model_id, None)
        self._skip_next.discard(model_id)

    def is_auto(self, model_id: str) -> bool:
        return model_id in self.controllers

    def observe(self, model_id: str, step: dict, round_s: float | None,
                now: float | None = None) -> Decision | None:
        """Take one learner step record; at the end of a window, the η to set (or None).

        `step` holds `version`, `max_staleness` (η it sampled under), `step_s`, `wait_s`,
        `ready_wait_s` and `at` (when it ended, epoch seconds); `round_s` is the clock's mean
        round time for the model; `now` is when a decision reaches the clock (default: the
        step's end), from which the next W seconds start no window.
        """
        controller = self.controllers.get(model_id)
        if controller is None:
            return None
        window = self._window[model_id]
        expected = self._expect.get(model_id)
        if expected is not None and step["max_staleness"] != expected:
            window.clear()  # sampled before the change reached the clock (fast steps)
            return None
        self._expect.pop(model_id, None)
        if step["version"] <= 1 or model_id in self._skip_next:
            self._skip_next.discard(model_id)
            window.clear()
            return None
        settle = self._settle.get(model_id)
        if settle is not None:
            # a step began waiting at its end less its step and wait; before `settle` its
            # batch still held units admitted under the old η
            began = step.get("at", math.inf) - step["step_s"] - step["wait_s"]
            if began < settle:
                window.clear()
                return None
            del self._settle[model_id]
        if window and window[-1]["max_staleness"] != step["max_staleness"]:
            window.clear()  # η changed by someone else (a restart, a restore)
        window.append(step)
        if len(window) < self.configs[model_id].staleness_window_steps:
            return None
        n = len(window)
        sample = RateSample(
            step_s=sum(s["step_s"] for s in window) / n,
            wait_s=sum(s["wait_s"] for s in window) / n,
            unit_latency_s=(round_s or 0.0) + sum(s["ready_wait_s"] for s in window) / n,
            eta=int(step["max_staleness"]),
            rows_per_step=sum(s.get("rows", 0) for s in window) / n)
        window.clear()
        decision = controller.update(sample)
        self.windows.append({"model": model_id, "version": int(step["version"]),
                             **dataclasses.asdict(sample),
                             "decision": None if decision is None else decision.eta})
        if decision is not None:
            # steps sampled before the clock has the new η, and the first one under it (its
            # units were admitted under the old η), start no window
            self._expect[model_id] = decision.eta
            self._skip_next.add(model_id)
            applied = max(float(step.get("at", 0.0)), now or 0.0)
            self._settle[model_id] = applied + sample.unit_latency_s
        return decision


def coach_capacity(cfg) -> int | None:
    """Rows a run's coach scores at once, outside the episodes; None when it scores inside
    them (`rollout.sync_coach`: no queue of rows to fill). The pool's `max_concurrency`,
    and for HTTP judges also each endpoint's (every row asks every judge of the ensemble)."""
    if cfg.rollout.sync_coach:
        return None
    coach = cfg.coach
    limits = [coach.max_concurrency]
    if coach.kind == "http":
        limits += [e.max_concurrency for e in coach.endpoints]
    return min(limits)
