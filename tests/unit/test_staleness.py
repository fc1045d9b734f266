"""AutoStaleness (runtime/staleness.py) on rate traces, with every expected η worked out.

`simulate` plays the clock's admission rule against a learner: (η + 1) · B units in flight
arrive at (η + 1) · B / W units a second, capped by what the rollout side can produce
(`capacity`, units a second); the learner needs B units a step of S seconds and waits for the
rest. Its windows are the traces the controller reads.
"""
import json
import math
import sys
from pathlib import Path

import pytest

from learners.config import LearnerConfig
from runtime.bus import BadMessage, encode_command, parse_control
from runtime.staleness import AutoStaleness, RateSample, StalenessPilot

B = 4  # units a learner step


def window(eta: int, latency: float, step: float, capacity: float = math.inf) -> RateSample:
    arrival = min((eta + 1) * B / latency, capacity)  # units a second
    period = max(step, B / arrival)  # a step starts when its B units are there
    return RateSample(step_s=step, wait_s=period - step, unit_latency_s=latency, eta=eta)


def run(controller: AutoStaleness, eta: int, trace) -> list[int]:
    """η after each window of `trace` ((latency, step, capacity) per window)."""
    etas = []
    for latency, step, capacity in trace:
        decision = controller.update(window(eta, latency, step, capacity))
        if decision is not None:
            eta = decision.eta
        etas.append(eta)
    return etas


def test_the_model_eta_is_the_smallest_that_keeps_the_wait_under_target():
    auto = AutoStaleness(cap=16, target_wait=0.1)
    # ⌈0.9 · W / S⌉ − 1: W/S = 10/3 -> ⌈3.0⌉ − 1 = 2; 0.5/3 -> 0; 3/3 -> 0; 30/3 -> 8
    assert [auto.model_eta(window(2, w, 3.0)) for w in (10.0, 0.5, 3.0, 30.0)] == [2, 0, 0, 8]
    for latency in (0.5, 3.0, 10.0, 30.0):  # and it is enough, while one less is not
        eta = auto.model_eta(window(0, latency, 3.0))
        assert window(eta, latency, 3.0).wait_share <= 0.1 + 1e-9
        if eta > 0:
            assert window(eta - 1, latency, 3.0).wait_share > 0.1


def test_a_slow_coach_raises_eta_at_once_and_a_fast_one_lowers_it_after_patience():
    auto = AutoStaleness(cap=16, target_wait=0.1, patience=3)
    # 13 s a unit (10 s coach + 3 s generation) over a 3 s step: η* = ⌈3.9⌉ − 1 = 3
    slow = [(13.0, 3.0, math.inf)] * 3
    # then the coach speeds up: 3.5 s a unit -> η* = ⌈1.05⌉ − 1 = 1, lowered on the 3rd window
    fast = [(3.5, 3.0, math.inf)] * 4
    assert run(auto, 2, slow + fast) == [3, 3, 3, 3, 3, 1, 1]


def test_the_cap_bounds_eta_and_the_reason_says_so():
    auto = AutoStaleness(cap=4, target_wait=0.1)
    decision = auto.update(window(2, 60.0, 3.0))  # η* = ⌈18⌉ − 1 = 17
    assert decision.eta == 4 and "(the cap)" in decision.reason
    assert "unit latency 60.00 s over learner step 3.00 s needs η 17" in decision.reason
    assert auto.update(window(4, 60.0, 3.0)) is None  # at the cap: nothing more to do


def test_a_rollout_bound_run_gets_one_raise_then_no_more():
    """The model says η = 0 is enough (W < S) but the rollout side makes 0.5 units a second
    against the 4 / 3 the learner eats: the wait stays at 1 − 3 / 8 = 62.5 % whatever η is.
    One raise is tried; it does not help, so η stays (more would only add staleness)."""
    auto = AutoStaleness(cap=16, target_wait=0.1)
    trace = [(2.0, 3.0, 0.5)] * 6
    assert run(auto, 0, trace) == [1, 1, 1, 1, 1, 1]
    assert window(1, 2.0, 3.0, 0.5).wait_share == pytest.approx(0.625)


def test_a_wait_the_model_misses_is_raised_while_raises_help():
    """The measured latency understates the need (say the engine batches badly at high
    concurrency): the rollout side's capacity is 1 unit/s, the model wants η = 0, yet each raise
    lowers the wait until capacity binds."""
    auto = AutoStaleness(cap=16, target_wait=0.1)
    # W = 2.5, S = 3: (η+1)·4/2.5 arrival, capped at 1.0 unit/s -> wait 25 % for η >= 0
    # η 0: arrival 1.0 (1.6 capped) -> wait 25 %: raise to 1; η 1: still 25 %: no help, stop
    assert run(auto, 0, [(2.5, 3.0, 1.0)] * 4) == [1, 1, 1, 1]


def test_a_steady_run_at_the_right_eta_is_left_alone():
    auto = AutoStaleness(cap=16, target_wait=0.1)
    assert run(auto, 2, [(10.0, 3.0, math.inf)] * 10) == [2] * 10


def test_one_quick_window_does_not_undo_a_raise():
    auto = AutoStaleness(cap=16, target_wait=0.1, patience=3)
    trace = [(13.0, 3.0, math.inf), (3.5, 3.0, math.inf), (13.0, 3.0, math.inf),
             (3.5, 3.0, math.inf), (3.5, 3.0, math.inf)]
    assert run(auto, 0, trace) == [3, 3, 3, 3, 3]


@pytest.mark.parametrize("kwargs, message", [
    ({"cap": 2, "floor": 3}, r"need 0 <= floor \(3\) <= cap \(2\)"),
    ({"cap": 2, "target_wait": 1.0}, r"target_wait=1.0 must be in \[0, 1\)"),
    ({"cap": 2, "patience": 0}, "patience=0 must be >= 1"),
])
def test_bad_settings_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AutoStaleness(**kwargs)


# ---------------------------------------------------------------- the pilot (driver side)
def learner(**overrides) -> LearnerConfig:
    return LearnerConfig(**{"max_staleness": "auto", "staleness_cap": 8, **overrides})


def step(version: int, eta: int, step_s: float = 3.0, wait_s: float = 9.0,
         ready_wait_s: float = 10.0) -> dict:
    """A learner step record as runtime/learner_worker.py publishes it (the fields read)."""
    return {"version": version, "max_staleness": eta, "step_s": step_s, "wait_s": wait_s,
            "ready_wait_s": ready_wait_s}


def test_the_pilot_skips_warmup_measures_a_window_and_raises_to_the_model_eta():
    pilot = StalenessPilot({"policy": learner(), "fixed": learner(max_staleness=2)})
    assert pilot.is_auto("policy") and not pilot.is_auto("fixed")
    # v1 is warm-up; v2 + v3 are the window: W = 1 s round + 10 s coach, S = 3 s
    # -> η* = ⌈0.9 · 11 / 3⌉ − 1 = 3
    assert pilot.observe("policy", step(1, 1), round_s=1.0) is None
    assert pilot.observe("policy", step(2, 1), round_s=1.0) is None
    decision = pilot.observe("policy", step(3, 1), round_s=1.0)
    assert decision.eta == 3 and decision.reason.startswith("raise 1 -> 3")
    assert "unit latency 11.00 s over learner step 3.00 s needs η 3" in decision.reason
    # the step after a change was sampled before it: no window starts there
    assert pilot.observe("policy", step(4, 1), round_s=1.0) is None
    assert pilot.observe("policy", step(5, 3, wait_s=0.1), round_s=1.0) is None
    assert pilot.observe("policy", step(6, 3, wait_s=0.1), round_s=1.0) is None  # steady
    assert pilot.observe("fixed", step(9, 2), round_s=1.0) is None  # not on auto


def test_a_hand_set_eta_turns_the_pilot_off_until_auto_again_with_a_new_cap():
    pilot = StalenessPilot({"policy": learner()})
    pilot.disable("policy")
    assert not pilot.is_auto("policy")
    assert [pilot.observe("policy", step(v, 1), 1.0) for v in range(2, 8)] == [None] * 6
    pilot.enable("policy", cap=2)
    assert pilot.observe("policy", step(8, 1), 1.0) is None  # the first step after: skipped
    assert pilot.observe("policy", step(9, 1), 1.0) is None
    decision = pilot.observe("policy", step(10, 1), 1.0)
    assert decision.eta == 2 and "(the cap)" in decision.reason


def test_a_window_spans_only_steps_under_one_eta():
    pilot = StalenessPilot({"policy": learner(staleness_window_steps=3)})
    pilot.observe("policy", step(1, 1), 1.0)
    pilot.observe("policy", step(2, 1), 1.0)
    pilot.observe("policy", step(3, 1), 1.0)
    # η changed underneath (a restore): the window starts over with the step at η 2
    assert pilot.observe("policy", step(4, 2), 1.0) is None
    assert pilot.observe("policy", step(5, 2), 1.0) is None
    assert pilot.observe("policy", step(6, 2), 1.0).eta == 3


def test_auto_in_the_learner_config():
    assert learner().auto_staleness and learner().initial_staleness == 8  # starts at the cap
    assert learner(staleness_cap=0).initial_staleness == 0
    assert learner(staleness_start=1).initial_staleness == 1
    assert learner(staleness_start=0, staleness_cap=0).initial_staleness == 0
    with pytest.raises(ValueError, match=r"staleness_start=9 is invalid.*staleness_cap=8"):
        learner(staleness_start=9)
    with pytest.raises(ValueError, match=r"staleness_start='max' is invalid: use 'cap'"):
        learner(staleness_start="max")
    fixed = LearnerConfig(max_staleness=4)
    assert not fixed.auto_staleness and fixed.initial_staleness == 4
    for bad, field in (("Auto", "max_staleness"), (-1, "max_staleness")):
        with pytest.raises(ValueError, match=f"{field}={bad!r}.*or 'auto'"):
            LearnerConfig(max_staleness=bad)
    with pytest.raises(ValueError, match="staleness_target_wait=1.0"):
        learner(staleness_target_wait=1.0)
    with pytest.raises(ValueError, match="staleness_window_steps=0"):
        learner(staleness_window_steps=0)


def test_set_staleness_auto_on_the_bus_and_from_ctl(tmp_path):
    """`ctl.py set-staleness policy auto` sends mode auto with the run's configured cap."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import ctl

    run_dir = tmp_path / "run-1"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("models:\n  policy:\n    learner:\n"
                                         "      staleness_cap: 5\n")
    args = ctl.parse_args(["--run", str(run_dir), "set-staleness", "policy", "auto"])
    command = ctl.build_command(args, "run-1", run_dir)
    assert (command.mode, command.max_staleness) == ("auto", 5)
    topic, payload = encode_command(command)
    assert parse_control(f"troupe/run-1/control/{topic}", payload, "run-1") == command
    args = ctl.parse_args(["--run", str(run_dir), "set-staleness", "policy", "auto", "--cap", "3"])
    assert ctl.build_command(args, "run-1", run_dir).max_staleness == 3
    fixed = ctl.build_command(ctl.parse_args(["--run", str(run_dir), "set-staleness", "policy",
                                              "2"]), "run-1", run_dir)
    assert (fixed.mode, fixed.max_staleness) == ("fixed", 2)
    with pytest.raises(ctl.CtlError, match="give an integer η >= 0, or auto"):
        ctl.build_command(ctl.parse_args(["--run", str(run_dir), "set-staleness", "policy",
                                          "often"]), "run-1", run_dir)
    bad = payload.replace(b'"auto"', b'"smart"')
    with pytest.raises(BadMessage, match="choose one of \\['fixed', 'auto'\\]"):
        parse_control(f"troupe/run-1/control/{topic}", bad, "run-1")


# ---------------------------------------------------------------- recorded traces
# The windows the pilot measured in `bench_async.py --staleness auto` runs (tiny model, HTTP
# judge with a 0.5 / 3 / 10 s server-side delay, cap 8): each holds the window's mean step and
# wait, the unit latency, the η in force and the η the pilot chose (None: kept).
TRACES = json.loads((Path(__file__).parent / "data" / "auto_staleness_traces.json").read_text())


@pytest.mark.parametrize("latency", sorted(TRACES, key=float))
def test_recorded_windows_get_the_same_decisions_again(latency):
    """Replaying a real run's windows through a fresh controller gives the η it chose then."""
    auto = AutoStaleness(cap=8, target_wait=0.1)
    for window in TRACES[latency]:
        sample = RateSample(window["step_s"], window["wait_s"], window["unit_latency_s"],
                            window["eta"])
        decision = auto.update(sample)
        assert (None if decision is None else decision.eta) == window["decision"], window


def test_recorded_traces_raise_eta_with_the_coach_latency():
    """The first window of each recorded run: the slower the coach, the larger the η the
    model asks for, and a 10 s coach raises η at once."""
    first = {float(k): v[0] for k, v in TRACES.items()}
    model = {k: AutoStaleness(cap=8).model_eta(RateSample(w["step_s"], w["wait_s"],
                                                          w["unit_latency_s"], w["eta"]))
             for k, w in first.items()}
    latencies = sorted(model)
    assert [model[k] for k in latencies] == sorted(model[k] for k in latencies)
    assert first[10.0]["decision"] is not None and first[10.0]["decision"] >= 3


def test_steps_sampled_before_a_change_reached_the_clock_start_no_window():
    """Steps come in bursts (the driver reads them about once a second): after the pilot
    raised η 1 -> 3 at v3, steps v4-v6 still sampled under η 1 and must not be measured as
    if η 3 had been in force (their waits would trigger a second, needless raise)."""
    pilot = StalenessPilot({"policy": learner()})
    for version in (1, 2):
        pilot.observe("policy", step(version, 1), 1.0)
    assert pilot.observe("policy", step(3, 1), 1.0).eta == 3
    for version in (4, 5, 6):  # still η 1 at sampling: ignored however long they waited
        assert pilot.observe("policy", step(version, 1), 1.0) is None
    assert pilot.observe("policy", step(7, 3, wait_s=0.1), 1.0) is None  # first under η 3
    assert pilot.observe("policy", step(8, 3, wait_s=0.1), 1.0) is None
    assert pilot.observe("policy", step(9, 3, wait_s=0.1), 1.0) is None  # a window: steady
    assert [w["version"] for w in pilot.windows] == [3, 9]


# ---------------------------------------------------------------- the coach ceiling
BENCH_ROWS_PER_STEP = 16  # bench_async's arith_duo: 4 units a step, 4 rows a unit


def replay_with(latency: str, coach_rows: int | None) -> list[tuple[int, str]]:
    """The recorded windows of one latency with the η this controller itself would have had
    in force (the measured rates as recorded); the decisions it makes, with their reasons."""
    auto = AutoStaleness(cap=8, target_wait=0.1, coach_rows=coach_rows)
    eta, decisions = TRACES[latency][0]["eta"], []
    for w in TRACES[latency]:
        decision = auto.update(RateSample(w["step_s"], w["wait_s"], w["unit_latency_s"], eta,
                                          rows_per_step=BENCH_ROWS_PER_STEP))
        if decision is not None:
            eta = decision.eta
            decisions.append((eta, decision.reason))
    return decisions


def test_the_coach_ceiling_holds_eta_where_more_only_queues_rows_at_the_coach():
    # 64 rows scored at once, 16 a step: more than ceil(64 / 16) = 4 steps' rows in flight
    # only wait for their scores (the 10 s cells trained ~5 rows/s at η 2 and at η 8 alike).
    decisions = replay_with("10", coach_rows=64)
    assert decisions[0][0] == 4 and "coach ceiling 4" in decisions[0][1]
    assert all(eta <= 4 for eta, _ in decisions)
    # A coach wide enough leaves the recorded decisions as they were (up to the cap).
    assert replay_with("10", coach_rows=512)[0][0] == 8
    # Started above the ceiling (a user's cap, a wider coach before): lowered at once.
    auto = AutoStaleness(cap=8, coach_rows=64)
    decision = auto.update(RateSample(0.2, 2.0, 12.0, 8, rows_per_step=16))
    assert decision.eta == 4 and decision.reason.startswith("lower 8 -> 4 (the coach ceiling)")
    # Unknown rows per step (older step records): no ceiling.
    assert AutoStaleness(cap=8, coach_rows=64).coach_ceiling(RateSample(0.2, 2, 12, 1)) is None


def test_coach_capacity_from_the_run_config():
    from runtime.config import load_config
    from runtime.staleness import coach_capacity

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(root / "configs" / "arith_duo_tiny.yaml", ["coach.max_concurrency=48"])
    assert coach_capacity(cfg) == 48
    inline = load_config(root / "configs" / "arith_duo_tiny.yaml", ["rollout.sync_coach=true"])
    assert coach_capacity(inline) is None  # scored inside episodes: no queue to fill
    judge = load_config(root / "configs" / "arith_duo_tiny.yaml", [
        "coach.kind=http", "coach.endpoints=[{base_url: 'http://127.0.0.1:9/v1', model: j, "
        "max_concurrency: 12}]"])
    assert coach_capacity(judge) == 12  # every row asks every judge


# ---------------------------------------------------------------- the pipeline's fill
def pipeline(pilot: StalenessPilot, eta: int, latency: float, step_s: float, steps: int,
             round_s: float = 1.0, stamp: bool = True) -> tuple[list[int], float]:
    """A learner fed through a pipeline that takes `latency` (W) seconds: units admitted at
    time t arrive at t + W, so a step's wait depends on the η in force W seconds before it,
    not on the η at its sampling. Each step's record goes to the pilot (stamped with its end
    time unless `stamp` is False, as older records were) and a decision takes effect at once.
    Returns the η the clock had at each step's sampling, and the learner's waiting share
    over the steps after the first (the first waits W for the first units in any case)."""
    changes = [(-math.inf, eta)]  # (time the clock got it, η)
    t, waited, busy, etas = 0.0, 0.0, 0.0, []
    for version in range(1, steps + 1):
        feeding = [e for at, e in changes if at <= t - latency][-1]  # what arrives now
        wait = latency if version == 1 else window(feeding, latency, step_s).wait_s
        t += wait + step_s
        if version > 1:
            waited, busy = waited + wait, busy + step_s
        record = {"version": version, "max_staleness": changes[-1][1], "step_s": step_s,
                  "wait_s": wait, "ready_wait_s": latency - round_s}
        if stamp:
            record["at"] = t
        etas.append(changes[-1][1])
        decision = pilot.observe("policy", record, round_s, now=t)
        if decision is not None:
            changes.append((t, decision.eta))
    return etas, waited / (waited + busy)


def test_no_window_is_measured_while_the_pipeline_fills_after_a_raise():
    """W = 11 s (1 s round + 10 s coach), S = 3 s: η* = ⌈0.9 · 11 / 3⌉ − 1 = 3. From η 1 the
    learner waits 45 %; the raise to 3 only shows 11 s later, when its first units are
    READY. The windows of that fill still wait 45 % at "η 3"; measured, they mark 3 as too
    low and raise to 4, which steady-state η 3 never needed (it waits 0 %)."""
    etas, _ = pipeline(StalenessPilot({"policy": learner(staleness_start=1)}), 1, 11.0, 3.0, 30)
    assert sorted(set(etas)) == [1, 3] and etas[-1] == 3
    # the same run with unstamped records (no settle time known): the needless raise
    unstamped, _ = pipeline(StalenessPilot({"policy": learner(staleness_start=1)}), 1, 11.0,
                            3.0, 30, stamp=False)
    assert unstamped[-1] == 4, unstamped


def test_starting_at_the_cap_lowers_to_the_model_eta_and_waits_less_than_climbing():
    """The same rates, started at the cap (8) as `auto` does by default: the first units
    already fill the pipeline, so the learner never waits, and after 3 windows that want
    less, η comes down to the model's 3. Started at 1 it climbs to 3 and waits meanwhile."""
    pilot = StalenessPilot({"policy": learner()})
    from_cap, wait_from_cap = pipeline(pilot, learner().initial_staleness, 11.0, 3.0, 30)
    assert from_cap[0] == 8 and from_cap[-1] == 3 and sorted(set(from_cap)) == [3, 8]
    assert [w["decision"] for w in pilot.windows if w["decision"] is not None] == [3]
    _, wait_from_one = pipeline(StalenessPilot({"policy": learner(staleness_start=1)}), 1,
                                11.0, 3.0, 30)
    assert wait_from_cap == 0.0 and wait_from_one > 0.05, (wait_from_cap, wait_from_one)


# ---------------------------------------------------------------- started at the cap
# Windows measured by `bench_async.py --staleness auto --latencies 0.5 3 10 --steps 20
# --coach-concurrency 512 --cap 32` (auto started at the cap 32, 16 rows a step). The tiny
# model's steps take 0.1-0.4 s, so one slow step moves W / S by 3x and a 20 ms sampling call
# is a 15 % wait.
CAP32 = json.loads((Path(__file__).parent / "data" /
                    "auto_staleness_traces_cap32.json").read_text())


def replay_cap32(latency: str) -> list[tuple[int, str]]:
    auto = AutoStaleness(cap=32, target_wait=0.1, coach_rows=512)
    eta, decisions = 32, []
    for w in CAP32[latency]:
        decision = auto.update(RateSample(w["step_s"], w["wait_s"], w["unit_latency_s"], eta,
                                          rows_per_step=w["rows_per_step"]))
        if decision is not None:
            eta = decision.eta
            decisions.append((eta, decision.reason))
    return decisions


def test_a_lowering_goes_to_the_largest_eta_its_windows_asked_for():
    """At 3 s the three calm windows asked for 18, 15 and 8 (the last one's steps took
    0.40 s against 0.13-0.21). Lowering to the last window's 8 (as it once did) would starve
    the learner as soon as its steps are quick again; the largest, 18, does not."""
    decisions = replay_cap32("3")
    assert decisions[0][0] == 18
    assert "windows asked for 18, 15, 8 (the largest kept)" in decisions[0][1], decisions[0][1]


def test_one_long_wait_far_above_the_model_eta_does_not_pin_eta_at_the_cap():
    """At 0.5 s the model asks for 4-9 at the start, yet one window waited 66 % (a slow
    sampling call) at η 32. Marking 32 as too low held η at the cap for the whole run (mean
    staleness 4.95); the wait far above the model's η now only restarts the lowering count."""
    decisions = replay_cap32("0.5")
    assert decisions and decisions[0][0] < 32 and decisions[0][1].startswith("lower 32 -> ")


def test_a_coach_slower_than_the_cap_can_cover_keeps_the_cap():
    """At 10 s the model asks for η ≈ 60-90 over the cap 32: nothing to lower."""
    assert replay_cap32("10") == []
