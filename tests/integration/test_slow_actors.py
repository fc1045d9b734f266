"""Slow is not dead (runtime/supervise.py): the driver's supervision rounds on a hand-wired run.

The run's buffer, clock, coach pool and metrics writer are the real actors; the learner, the
engine and the rollout actors are stand-ins (`Part`) whose answers can be delayed, because a
real one cannot be made slow on demand without being broken. The test drives the controller's
own round (`Run._status`) and checks: a slow rollout actor is counted and its last answer kept
(not restarted, the run goes on), a killed one is skipped as before, a killed buffer is still
restarted by Ray and seen by the round, and a part that never answers stops the run naming it.
"""
import sys
import threading
import time
from pathlib import Path

import pytest
import ray
import ray.cloudpickle

from actors.coach import CoachPool, build_coach
from actors.workflows import build_workflow
from buffers.clock import VersionClock
from runtime.buffer_actor import BufferActor
from runtime.config import load_config
from runtime.control import RunControl
from runtime.controller import Run
from runtime.metrics import MetricsWriter
from runtime.rollout_host import BufferCommit
from runtime.supervise import ActorHung

ROOT = Path(__file__).resolve().parents[2]
CALL_TIMEOUT_S = 1.0
UNANSWERED_S = 10.0
SLOW_S = 5.0  # the slow rollout actor's delay: past one call timeout, within the limit
# Ray's workers cannot import a test module: ship `Part` by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
ENGINE_STATS = {"restarts": 0, "behind_restarts": 0, "busy_probes": 0, "port_moves": 0,
                "last_progress_age_s": 0.0}


class Part:
    """A stand-in for a polled actor: each polling call answers `answer` after `delay_s`
    (read when the call starts; the actor runs calls on threads, so `set_delay` answers
    while a call sleeps)."""

    def __init__(self, answer: dict) -> None:
        self.answer = answer
        self.delay_s = 0.0
        self.calls = 0
        self._lock = threading.Lock()

    def set_delay(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def sent(self) -> int:
        """Polling calls received so far."""
        return self.calls

    def _reply(self) -> dict:
        with self._lock:
            self.calls += 1
        time.sleep(self.delay_s)
        return self.answer

    def stats(self) -> dict:
        return self._reply()

    def progress(self) -> dict:
        return self._reply()

    def ensure_alive(self) -> dict:
        return self._reply()

    def request_checkpoint(self) -> dict:  # as a learner
        return self._reply()

    def take_owner(self, owner) -> tuple[dict, dict]:  # as the clock: nothing to settle
        self._reply()
        return {}, {}

    def stop(self) -> None:
        pass


def part(answer: dict):
    return ray.remote(Part).options(num_cpus=0, max_concurrency=4).remote(answer)


def wire(run: Run) -> None:
    """What `Run.start` builds, with stand-ins where a real part would need a model."""
    cfg = run.cfg
    mc = cfg.models["policy"]
    run.metrics = ray.remote(MetricsWriter).options(num_cpus=0).remote(
        str(run.run_dir / "tensorboard"))
    run.control = RunControl(run, None)
    run.buffers = {"policy": ray.remote(BufferActor).options(
        num_cpus=0, max_restarts=1, max_task_retries=0).remote(
        "policy", mc.buffer, str(run.run_dir / "buffer" / "policy"))}
    run.clock = ray.remote(VersionClock).options(num_cpus=0).remote(
        {"policy": (mc.learner.batch_units, mc.learner.initial_staleness)})
    coach = build_coach(cfg.coach, build_workflow(cfg.workflow),
                        str(run.run_dir / "coach_cache.jsonl"))
    run.coach = ray.remote(CoachPool).options(num_cpus=0, max_concurrency=1000).remote(
        cfg.coach, coach, BufferCommit(run.buffers), str(run.run_dir / "coach_requests.jsonl"))
    run.learners = {"policy": part({"version": 0, "in_step_s": 0.0})}
    run.engines = {"policy": [part(ENGINE_STATS)]}
    for index in range(3):  # healthy, slow, killed
        run.rollouts[index] = part({"episodes": 10 * index + 1, "admission_waits": 0})
        run.owners[index] = f"rollout-{index}-{index + 1}"
    run.buffer_incarnations = {"policy": ray.get(
        run.buffers["policy"].incarnation.remote(), timeout=120)}
    run.started_at = time.time()


def rounds_until(run: Run, what: str, done, limit_s: float) -> None:
    """Supervision rounds (as `Run.wait` runs them, faster) until `done()`."""
    deadline = time.monotonic() + limit_s
    while not done():
        assert time.monotonic() < deadline, f"{what}: not within {limit_s:.0f} s"
        run._status()
        time.sleep(0.3)


def test_a_slow_actor_is_counted_and_skipped_a_dead_one_is_handled_a_hung_one_stops(
        tmp_path, ray_local):
    cfg = load_config(ROOT / "configs" / "arith_duo_tiny.yaml",
                      [f"run.runs_dir={tmp_path}", "run.run_id=slow",
                       f"run.call_timeout_s={CALL_TIMEOUT_S}",
                       f"run.unanswered_timeout_s={UNANSWERED_S}"])
    run = Run(cfg)
    try:
        wire(run)
        run.stall_base = run._snapshot()  # the first snapshot waits for every part
        slow, dead = run.rollouts[1], run.rollouts[2]
        ray.get(slow.set_delay.remote(SLOW_S), timeout=30)
        ray.kill(dead)

        # slow: the round waits one call timeout, keeps the slow actor's last answer, and
        # skips the dead one (its `run` reference reports it to Run.wait, as before)
        started = time.monotonic()
        now = run._status()
        took = time.monotonic() - started
        assert took < SLOW_S - 1.0, f"the round waited {took:.1f} s for the slow actor"
        assert sorted(s["episodes"] for s in now.rollouts) == [1, 11]
        assert run.slow_calls.counts.get("rollout-1-2", 0) >= 1
        # while its call is pending, later rounds check it instead of sending it again
        run._status()
        assert ray.get(slow.sent.remote(), timeout=30) == 2  # the first snapshot's + this one
        # until it answers: then its count stops growing, it was never restarted
        ray.get(slow.set_delay.remote(0.0), timeout=30)

        def answered() -> bool:  # a round that found its call answered counts nothing
            before = run.slow_calls.counts["rollout-1-2"]
            run._status()
            return run.slow_calls.counts["rollout-1-2"] == before

        rounds_until(run, "the slow actor's late answer", answered, 4 * SLOW_S)
        slow_rounds = run.slow_calls.counts["rollout-1-2"]
        assert slow_rounds >= 2 and run.restarts == 0 and run.rollouts[1] is slow

        # dead: a killed buffer is restarted by Ray (over its log) and the round sees it
        ray.kill(run.buffers["policy"], no_restart=False)
        rounds_until(run, "the buffer's restart", lambda: run.buffer_restarts == {"policy": 1},
                     120)

        # hung: a call unanswered for run.unanswered_timeout_s stops the run, naming it
        ray.get(slow.set_delay.remote(600.0), timeout=30)
        hung_at = time.monotonic()
        with pytest.raises(ActorHung, match="rollout-1-2 left stats unanswered") as hung:
            rounds_until(run, "the hung actor's stop", lambda: False, UNANSWERED_S + 30)
        assert time.monotonic() - hung_at >= UNANSWERED_S
        assert "run.unanswered_timeout_s=10" in str(hung.value)
        keys = ray.get(run.metrics.flush.remote(), timeout=30)
        assert "perf/slow_calls/rollout-1-2" in keys and "perf/slow_calls" in keys
        summary = run.slow_calls.summary()
        assert summary["slow_calls"]["rollout-1-2"] > slow_rounds
        print(f"slow rollout actor: round took {took:.2f} s (call timeout {CALL_TIMEOUT_S} s, "
              f"actor delay {SLOW_S} s), {slow_rounds} slow rounds then answered, restarts "
              f"{run.restarts}; killed buffer restarted and seen; hung after "
              f"{time.monotonic() - hung_at:.1f} s; summary {summary}")
    finally:
        run.shutdown()


def test_a_slow_actor_fails_an_operator_command_and_a_hung_one_stops_settling(
        tmp_path, ray_local, monkeypatch):
    """The driver's other waits (runtime/control.py, runtime/accounting.py) are bounded too:
    a learner slower than the command limit fails `checkpoint` with the reason (the run goes
    on), and a clock that never answers while a dead actor's rounds are settled stops the
    run naming the call."""
    import runtime.control
    from runtime.accounting import close_books
    from runtime.bus import Checkpoint

    cfg = load_config(ROOT / "configs" / "arith_duo_tiny.yaml",
                      [f"run.runs_dir={tmp_path}", "run.run_id=slow-commands"])
    run = Run(cfg)
    try:
        wire(run)
        learner = run.learners["policy"]
        monkeypatch.setattr(runtime.control, "CALL_TIMEOUT_S", CALL_TIMEOUT_S)
        ray.get(learner.set_delay.remote(SLOW_S), timeout=30)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"learners \['policy'\] \(request_checkpoint\) "
                           r"did not answer within 1 s"):
            run.control.apply(Checkpoint(run_id=run.run_id))
        took = time.monotonic() - started
        assert took < SLOW_S - 1.0, f"the command waited {took:.1f} s for the slow learner"
        ray.get(learner.set_delay.remote(0.0), timeout=30)
        run.control.apply(Checkpoint(run_id=run.run_id))  # answered in time: applied
        assert ray.get(learner.sent.remote(), timeout=30) == 2

        clock = part({})
        ray.get(clock.set_delay.remote(600.0), timeout=30)
        started = time.monotonic()
        with pytest.raises(ActorHung, match=r"the clock's take_owner \(settling rollout-9\) "
                           r"did not answer within 2 s"):
            close_books(clock, run.buffers, {"policy": "episode"}, "rollout-9", "actor_crashed",
                        timeout_s=2.0)
        hung_s = time.monotonic() - started
        assert 2.0 <= hung_s < 10.0
        print(f"slow learner: checkpoint command failed after {took:.2f} s (limit "
              f"{CALL_TIMEOUT_S} s, learner {SLOW_S} s); hung clock: settling stopped after "
              f"{hung_s:.1f} s")
    finally:
        run.shutdown()
