"""The driver's slow-versus-dead rule (runtime/supervise.py) and its config fields."""
import ast
import logging
from pathlib import Path

import pytest
import ray.exceptions

from actors.engines.sglang import EngineConfig
from runtime.config import ConfigError, RunConfig, load_config
from runtime.supervise import (ENGINE_LAUNCHES, WARN_EVERY_S, ActorHung, Answers, SlowCalls,
                               engine_restart_s)

ROOT = Path(__file__).resolve().parents[2]
STATS = ("rollout-0-1", "stats")


def test_a_slow_call_is_counted_per_actor_and_does_not_raise():
    slow = SlowCalls(call_timeout_s=10, unanswered_timeout_s=300)
    slow.unanswered(STATS, waited_s=10)
    slow.unanswered(STATS, waited_s=15)  # the same call, still pending a round later
    slow.unanswered(("learner-policy", "progress"), waited_s=10)
    assert slow.counts == {"rollout-0-1": 2, "learner-policy": 1}
    assert slow.summary() == {"slow_calls": {"rollout-0-1": 2, "learner-policy": 1},
                              "slow_calls_total": 3, "call_timeout_s": 10,
                              "unanswered_timeout_s": 300}
    assert slow.scalars() == {"perf/slow_calls": 3.0, "perf/slow_calls/rollout-0-1": 2.0,
                              "perf/slow_calls/learner-policy": 1.0}


def test_a_call_unanswered_for_its_limit_is_hung_and_the_message_names_it():
    slow = SlowCalls(call_timeout_s=10, unanswered_timeout_s=300)
    slow.unanswered(STATS, waited_s=299.9)
    with pytest.raises(ActorHung) as hung:
        slow.unanswered(STATS, waited_s=300.0)
    message = str(hung.value)
    assert "rollout-0-1" in message and "stats" in message and "300 s" in message
    assert "run.unanswered_timeout_s=300" in message
    assert slow.counts["rollout-0-1"] == 2  # the hung round is counted too


def test_a_longer_limit_of_its_own_lets_a_call_wait_past_the_run_limit():
    """An engine's ensure_alive restarts its server inside the call: minutes are normal."""
    slow = SlowCalls(call_timeout_s=10, unanswered_timeout_s=300)
    alive = ("engine-policy-0", "ensure_alive")
    slow.unanswered(alive, waited_s=500, limit_s=780)  # past 300 s, within its own limit
    with pytest.raises(ActorHung, match="limit 780 s"):
        slow.unanswered(alive, waited_s=780, limit_s=780)


def test_warnings_name_actor_call_and_seconds_and_repeat_only_every_interval(caplog):
    slow = SlowCalls(call_timeout_s=10, unanswered_timeout_s=300)
    with caplog.at_level(logging.WARNING, logger="troupe"):
        for waited in (10, 15, 20, 10 + WARN_EVERY_S):
            slow.unanswered(STATS, waited_s=waited)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2, warnings  # the first, then one interval later
    assert "rollout-0-1 did not answer stats within 10.0 s" in warnings[0]
    assert "slow, not dead" in warnings[0]
    assert f"within {10 + WARN_EVERY_S:.1f} s" in warnings[1]


def test_an_answer_ends_the_streak_so_the_next_slow_call_warns_at_once(caplog):
    slow = SlowCalls(call_timeout_s=10, unanswered_timeout_s=300)
    with caplog.at_level(logging.WARNING, logger="troupe"):
        slow.unanswered(STATS, waited_s=10)
        slow.answered(STATS)
        slow.unanswered(STATS, waited_s=10)
    assert len(caplog.records) == 2
    assert slow.counts["rollout-0-1"] == 2  # answers do not reset the count


def test_answers_give_the_last_value_of_a_slow_call_and_raise_a_dead_actors_error():
    dead = ray.exceptions.ActorDiedError()
    answers = Answers(values={STATS: {"episodes": 3}},
                      failed={("rollout-1-2", "stats"): dead},
                      slow={STATS})
    assert answers.get(STATS) == {"episodes": 3}
    assert answers.get(("clock", "snapshot"), {}) == {}  # never answered: the default
    with pytest.raises(ray.exceptions.RayActorError):
        answers.get(("rollout-1-2", "stats"))


def test_an_engine_check_may_take_its_restart_time():
    cfg = EngineConfig(startup_timeout_s=240, weight_update_timeout_s=100)
    # its launches, plus the wait for the learner's folder of the served version
    assert engine_restart_s(cfg) >= ENGINE_LAUNCHES * 240 + 100


@pytest.mark.parametrize("fields, named", [
    ({"call_timeout_s": 0}, "run.call_timeout_s=0"),
    ({"call_timeout_s": -1}, "run.call_timeout_s=-1"),
    ({"call_timeout_s": 10, "unanswered_timeout_s": 10}, "run.unanswered_timeout_s=10"),
])
def test_bad_timeouts_are_refused_naming_the_field_and_the_fix(fields, named):
    with pytest.raises(ConfigError) as error:
        RunConfig(**fields)
    assert named in str(error.value)
    assert "use" in str(error.value) or "must exceed" in str(error.value)


def test_the_timeouts_are_run_fields_with_defaults_and_overrides():
    cfg = load_config(ROOT / "configs" / "arith_duo_tiny.yaml")
    assert (cfg.run.call_timeout_s, cfg.run.unanswered_timeout_s) == (10.0, 300.0)
    with pytest.raises(ConfigError, match="run.unanswered_timeout_s=5.0: must exceed"):
        load_config(ROOT / "configs" / "arith_duo_tiny.yaml", ["run.unanswered_timeout_s=5"])


# The driver's modules: everything `Run` (runtime/controller.py) calls on its own thread.
DRIVER_MODULES = ["runtime/controller.py", "runtime/control.py", "runtime/accounting.py",
                  "runtime/resume.py", "runtime/supervise.py", "runtime/stall.py",
                  "runtime/staleness.py", "runtime/bus_service.py", "scripts/launch_async.py"]


def untimed_ray_waits(source: str) -> list[int]:
    """Lines of `ray.get(...)` / `ray.wait(...)` calls in `source` without a `timeout=`."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("get", "wait") and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "ray"
                and not any(k.arg == "timeout" for k in node.keywords)):
            lines.append(node.lineno)
    return lines


def test_the_driver_never_waits_on_an_actor_without_a_timeout():
    """Part 2 of the supervision rule: no blocking `ray.get` without a limit in the driver
    (one-time calls go through `get_within`, polls through `Poller`)."""
    assert untimed_ray_waits("import ray\nray.get(ref)\nray.get(ref, timeout=1)\n") == [2]
    found = {path: untimed_ray_waits((ROOT / path).read_text()) for path in DRIVER_MODULES}
    assert {p: lines for p, lines in found.items() if lines} == {}
