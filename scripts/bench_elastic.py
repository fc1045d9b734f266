"""Episodes per second at 1, 2 and 3 rollout actors in one run, scaled live (DESIGN §9).

The run starts with one rollout actor; after `--warmup` seconds each level is measured for
`--window` seconds (episodes counted by the rollout actors themselves, over the window only),
then the run is scaled to the next level with the same command ctl.py sends
(`ScaleRollout`, applied by the controller) and the next window starts after the warmup.
Admission waits (slots refused by the staleness bound) are printed beside: when they grow,
the learner, not the rollouts, limits throughput.

    python scripts/bench_elastic.py                       # tiny model, ~5 min
    python scripts/bench_elastic.py --config configs/arith_duo_cpu.yaml --window 120
    # rollout-bound: a 3 s judge inside every episode, so more actors mean more episodes/s
    python scripts/bench_elastic.py --window 45 --warmup 15 rollout.sync_coach=true \
        coach.latency_s=3 rollout.concurrency=2 models.policy.learner.max_staleness=16
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a bare checkout

import ray  # noqa: E402

from runtime.bus import ScaleRollout, Stop  # noqa: E402
from runtime.config import load_config  # noqa: E402
from runtime.controller import Run  # noqa: E402


def counters(run: Run) -> tuple[int, int]:
    """(episodes, admission waits) over every rollout actor ever started in this run."""
    stats = [ray.get(a.stats.remote()) for a in list(run.rollouts.values())]
    return (run.retired_episodes + sum(s["episodes"] for s in stats),
            sum(s["admission_waits"] for s in stats))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/arith_duo_tiny.yaml")
    parser.add_argument("--levels", default="1,2,3", help="rollout actor counts, in order")
    parser.add_argument("--window", type=float, default=60.0, help="seconds measured per level")
    parser.add_argument("--warmup", type=float, default=20.0, help="seconds before each window")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    cfg = load_config(args.config, [f"rollout.actors={levels[0]}", "run.max_steps=1000000",
                                    f"rollout.max_actors={max(levels)}", "run.name=bench-elastic",
                                    "run.checkpoint_every=0", *args.overrides])
    run = Run(cfg)
    failure: list[BaseException] = []
    rows = []
    try:
        run.start()
        supervisor = threading.Thread(target=lambda: _capture(run.wait, failure), daemon=True)
        supervisor.start()
        for level in levels:
            if len(run.rollouts) - len(run.draining) != level:
                run.bus.submit(ScaleRollout(run_id=run.run_id, actors=level)).result(300)
            time.sleep(args.warmup)
            e0, w0 = counters(run)
            t0 = time.time()
            time.sleep(args.window)
            e1, w1 = counters(run)
            seconds = time.time() - t0
            rows.append((level, e1 - e0, seconds, (e1 - e0) / seconds, w1 - w0))
            print(f"{level} actor(s): {e1 - e0} episodes in {seconds:.0f} s = "
                  f"{(e1 - e0) / seconds:.2f}/s, admission waits {w1 - w0}", flush=True)
            assert not failure, failure
        run.bus.submit(Stop(run_id=run.run_id, reason="benchmark over")).result(300)
        supervisor.join(600)
        run.finish()
    finally:
        run.shutdown()
    print(f"\nconfig {args.config} {' '.join(args.overrides)}")
    print(f"{'actors':>6} {'episodes':>9} {'seconds':>8} {'episodes/s':>11} {'admission waits':>16}")
    for level, episodes, seconds, rate, waits in rows:
        print(f"{level:>6} {episodes:>9} {seconds:>8.0f} {rate:>11.2f} {waits:>16}")
    return 0


def _capture(fn, failures: list) -> None:
    try:
        fn()
    except BaseException as exc:  # reported by main, which stops the benchmark
        failures.append(exc)


if __name__ == "__main__":
    sys.exit(main())
