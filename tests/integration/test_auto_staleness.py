"""`max_staleness: auto` in a live run (runtime/staleness.py): real Ray, SGLang and broker.

arith_duo on the tiny model with a slow coach (the RuleCoach's injected latency, 4 s a
score), η starting at 1 under `auto` (`staleness_start: 1`; the default start is the cap).
What is checked comes from the test's own subscriber (every `events/staleness` and
`events/step`) and the clock, not from the pilot's counters:
- the pilot raises η above 1, says why on the bus, and the clock admits under it;
- the learner's later steps sample under the raised η;
- `ctl.py set-staleness policy 0` turns auto off: η stays 0 and no auto change comes for
  the following windows; `set-staleness policy auto --cap 2` hands it back and η rises from
  0 to at most 2;
- no row is unaccounted, and TensorBoard got `staleness/policy/auto_eta`.

A deliberate fault turns it red: with the pilot never fed (`StalenessPilot.observe`
returning None) no raise comes within the limit.

    python -m pytest -q tests/integration/test_auto_staleness.py
"""
from __future__ import annotations

import ray

from test_live_control import ctl, operated_run, wait_for

LIMIT_S = 300.0  # a loaded 2-core machine; a pilot that never acts does not get there either


def test_auto_staleness_raises_eta_under_a_slow_coach_and_yields_to_the_operator(tmp_path):
    with operated_run("auto", tmp_path, "coach.latency_s=4.0",
                      "models.policy.learner.max_staleness=auto",
                      "models.policy.learner.staleness_cap=4",
                      "models.policy.learner.staleness_start=1") as operated:
        run, collector = operated.run, operated.collector
        learner = run.learners["policy"]

        raised = wait_for("an auto raise of η", lambda: [
            e for e in collector.of("staleness") if e["max_staleness"] > 1], limit_s=LIMIT_S)[0]
        assert raised["reason"].startswith("raise 1 -> "), raised
        assert "unit latency" in raised["reason"] and "needs η" in raised["reason"]
        assert ray.get(run.clock.max_staleness.remote("policy")) >= raised["max_staleness"]
        wait_for("a step sampled under the raised η", lambda: [
            s for s in collector.of("step") if s["max_staleness"] > 1], limit_s=LIMIT_S)

        # the operator's fixed η wins until auto is set again
        answer = ctl(run, "set-staleness", "policy", "0")
        assert answer.returncode == 0, answer.stdout + answer.stderr
        changes_at_override = len(collector.of("staleness"))
        version = ray.get(learner.progress.remote())["version"]
        wait_for("five more learner steps",
                 lambda: ray.get(learner.progress.remote())["version"] >= version + 5,
                 limit_s=LIMIT_S)
        assert len(collector.of("staleness")) == changes_at_override, collector.of("staleness")
        assert ray.get(run.clock.max_staleness.remote("policy")) == 0

        answer = ctl(run, "set-staleness", "policy", "auto", "--cap", "2")
        assert answer.returncode == 0, answer.stdout + answer.stderr
        again = wait_for("an auto raise after auto was set again", lambda: collector.of(
            "staleness")[changes_at_override:], limit_s=LIMIT_S)[0]
        assert again["reason"].startswith("raise 0 -> ") and 0 < again["max_staleness"] <= 2

        operated.stop()
        summary = run.finish()

    assert summary["rows"]["unaccounted"] == 0, summary["rows"]
    assert [c["max_staleness"] for c in summary["control"]["staleness_changes"]] == \
        [e["max_staleness"] for e in collector.of("staleness")]
    assert "staleness/policy/auto_eta" in summary["tensorboard_keys"]
