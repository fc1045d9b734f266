"""AutoStaleness (runtime/staleness.py) on rate traces, with every expected η worked out.

`simulate` plays the clock's admission rule against a learner: (η + 1) · B units in flight
arrive at (η + 1) · B / W units a second, capped by what the rollout side can produce
(`capacity`, units a second); the learner needs B units a step of S seconds and waits for the
rest. Its windows are the traces the controller reads.
"""
import math

import pytest

from runtime.staleness import AutoStaleness, RateSample

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
