"""Asynchronous vs synchronous throughput with a slow HTTP coach (DESIGN §12).

The same arith_duo workload on the tiny model, scored by the HTTP coach (`coach.kind=http`)
talking to a loopback OpenAI-compatible judge this script starts (actors/coach/loopback.py)
that answers `PROCESS_SCORE: N` after a server-side delay of 0.5 s, 3 s and 10 s; in async
mode (η = 2, coach off the critical path) and synchronous mode (η = 0, coach awaited inside
the episode). Prints rewarded rows trained per second (after a warm-up step) and the
learner busy fraction of each, then the ratios. `--coach rule` uses the RuleCoach's injected
latency instead of HTTP. CPU:
    python scripts/bench_async.py                 # ~15-20 minutes on 2 cores
    python scripts/bench_async.py --steps 6 --latencies 3
Cluster: the same command inside `ray job submit --working-dir . -- python scripts/...`.
The last line reads `async/sync throughput at 3s coach: <ratio>`.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.coach.loopback import LoopbackJudge  # noqa: E402
from runtime.config import load_config  # noqa: E402
from runtime.controller import run  # noqa: E402

BASE = [
    "workflow.name=arith_duo", "workflow.agents.solver=policy",
    "workflow.agents.verifier=policy", "workflow.group_size=4",
    "workflow.arith_duo.solver_tokens=16", "workflow.arith_duo.verifier_tokens=8",
    "models.policy.path=tiny", "models.policy.engine.max_total_tokens=8192",
    "models.policy.learner.lr=1e-4", "models.policy.learner.batch_units=4",
    "rollout.concurrency=4", "run.name=bench-async", "run.keep_weights=2",
]


def coach_overrides(coach: str, latency: float, judge: LoopbackJudge | None) -> list[str]:
    if coach == "rule":
        return [f"coach.latency_s={latency}"]
    assert judge is not None
    judge.set(delay_s=latency)
    return ["coach.kind=http", "coach.cache.enabled=false",
            f"coach.endpoints=[{{name: loopback, base_url: '{judge.base_url}', model: judge, "
            f"timeout_s: {latency + 30}, max_concurrency: 64}}]"]


def measure(steps: int, latency: float, mode: str, runs_dir: str, coach: str,
            judge: LoopbackJudge | None) -> dict:
    eta = 0 if mode == "sync" else 2
    overrides = BASE + coach_overrides(coach, latency, judge) + [
        f"run.max_steps={steps}", f"run.runs_dir={runs_dir}",
        f"models.policy.learner.max_staleness={eta}",
        f"rollout.sync_coach={'true' if mode == 'sync' else 'false'}",
    ]
    summary = run(load_config(None, overrides))
    history = summary["learners"]["policy"]["history"]
    # Warm-up: the first step waits for engines, compilation and the first coach round trip.
    (t0, _, _), rest = history[0], history[1:]
    elapsed = rest[-1][0] - t0
    rows = sum(r for _, r, _ in rest)
    busy = sum(b for _, _, b in rest)
    return {"rows_per_s": rows / elapsed, "busy_fraction": busy / elapsed,
            "unaccounted": summary["rows"]["unaccounted"],
            "coach_failures": summary["coach"]["failures"],
            "coach_p50_s": summary["coach"]["latency_p50_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="learner steps per setting")
    parser.add_argument("--latencies", type=float, nargs="+", default=[0.5, 3.0, 10.0],
                        help="coach latency (server-side delay of the judge), seconds")
    parser.add_argument("--coach", choices=("http", "rule"), default="http")
    parser.add_argument("--runs-dir", default="runs/bench")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    judge = LoopbackJudge() if args.coach == "http" else None
    results = {}
    try:
        for latency in args.latencies:
            for mode in ("async", "sync"):
                results[latency, mode] = r = measure(args.steps, latency, mode, args.runs_dir,
                                                     args.coach, judge)
                print(f"coach {latency:>4.1f}s  {mode:<5}  rows/s {r['rows_per_s']:8.2f}  "
                      f"learner busy {r['busy_fraction']:6.1%}  coach p50 "
                      f"{r['coach_p50_s']:5.2f}s  coach failures {r['coach_failures']:.0f}  "
                      f"unaccounted rows {r['unaccounted']}", flush=True)
    finally:
        if judge is not None:
            judge.close()
    print()
    print(f"{'coach':>7} {'async rows/s':>13} {'sync rows/s':>12} {'ratio':>7} "
          f"{'busy async':>11} {'busy sync':>10}")
    for latency in args.latencies:
        a, s = results[latency, "async"], results[latency, "sync"]
        print(f"{latency:>6.1f}s {a['rows_per_s']:>13.2f} {s['rows_per_s']:>12.2f} "
              f"{a['rows_per_s'] / s['rows_per_s']:>7.2f} {a['busy_fraction']:>11.1%} "
              f"{s['busy_fraction']:>10.1%}")
    key = 3.0 if 3.0 in args.latencies else args.latencies[-1]
    ratio = results[key, "async"]["rows_per_s"] / results[key, "sync"]["rows_per_s"]
    print(f"async/sync throughput at {key:g}s coach: {ratio:.2f}")


if __name__ == "__main__":
    main()
