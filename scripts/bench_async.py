"""Asynchronous vs synchronous throughput with a slow HTTP coach (DESIGN §12), and the mixed cells.

The same arith_duo workload on the tiny model, scored by the HTTP coach (`coach.kind=http`)
talking to a loopback OpenAI-compatible judge this script starts in a process of its own
(actors/coach/loopback.py)
that answers `PROCESS_SCORE: N` after a server-side delay (the coach latency). Cells, each a
fresh run (engines, learner, buffers) whose overrides are printed in the closing table:
- async: η = 2 (models.policy.learner.max_staleness=2), coach off the path
  (rollout.sync_coach=false), at each `--latencies` value;
- sync, the DESIGN §12 baseline: η = 0 and the coach awaited inside the episode
  (rollout.sync_coach=true), at each `--latencies` value;
- the two mixed cells at `--mixed-at` (3 s): η = 2 with the coach inline, and η = 0 with
  the coach off the path, which say how much of the gain is staleness and how much the coach;
- the reference: async with an instant coach (judge delay 0), the learner's busy fraction
  when the coach costs nothing;
- with `--staleness auto`, an `auto` cell at each latency: `max_staleness: auto` (η chosen
  from measured rates, runtime/staleness.py, up to `--cap`), coach off the path.
Every cell also prints the mean staleness of the rows it trained (versions behind).
Engines and learners run with `dtype: auto` (runtime/dtype.py), printed with its reason;
weights go to the engine through a folder (`weight_sync: disk`) in every cell.
Each cell prints rewarded rows trained per second and the learner busy fraction after one
warm-up step (the first waits for engines, compilation and the first coach round trip).
`--coach rule` uses the RuleCoach's injected latency instead of HTTP.

Tiny CPU run (~6 minutes on 2 cores):
    python scripts/bench_async.py --steps 3 --latencies 3 --mixed-at
Default, 9 runs of 8 learner steps (measured: 18.7 min on a 2-core AMD EPYC with avx512_bf16,
shared with other jobs at load average 3-14; each run prints its wall time):
    python scripts/bench_async.py
Fixed η = 2 against auto, with the windows the pilot measured written out (measured: 27 min):
    python scripts/bench_async.py --staleness auto --mixed-at --steps 20 --sync-steps 8 \
        --trace-out runs/bench/auto.json
Cluster: the same command inside `ray job submit --working-dir . -- python scripts/...`.
With `--staleness auto` the line before the last reads `busy at 3s coach vs instant: <ratio>`
(the auto cell's busy fraction over the instant-coach run's); the last line reads
`async/sync throughput at 3s coach: <ratio>`.
"""
from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_env import dtype_header  # noqa: E402
from runtime.config import TroupeConfig, load_config  # noqa: E402
from runtime.controller import run  # noqa: E402

BASE = [
    "workflow.name=arith_duo", "workflow.agents.solver=policy",
    "workflow.agents.verifier=policy", "workflow.group_size=4",
    "workflow.params.solver_tokens=16", "workflow.params.verifier_tokens=8",
    "models.policy.path=tiny", "models.policy.engine.max_total_tokens=8192",
    "models.policy.engine.dtype=auto", "models.policy.learner.dtype=auto",
    "models.policy.learner.lr=1e-4", "models.policy.learner.batch_units=4",
    "rollout.concurrency=4", "run.name=bench-async", "run.keep_weights=2",
    # every cell publishes the same way: `weight_sync: auto` tried tensors on 2 of the first
    # 4 steps and kept the folder in every cell (0.05-0.09 s a load against 0.6-1.5 s on the
    # tiny model in a busy server), but a trial step's 1-3 s then counted as busy time
    "models.policy.learner.weight_sync=disk",
]


@dataclass(frozen=True)
class Cell:
    """One run: staleness bound, where the coach sits, and its latency."""

    name: str
    eta: int | str  # models.policy.learner.max_staleness (an integer, or "auto")
    coach_inline: bool  # rollout.sync_coach
    latency_s: float  # the judge's server-side delay (or the RuleCoach's injected latency)


class JudgeProcess:
    """The loopback judge (actors/coach/loopback.py) in a process of its own, as a remote
    judge would be: in the driver's process its event loop would share that process's
    interpreter lock with the run's supervision loop. `set(delay_s=...)` starts it anew
    with that server-side delay when the delay changes."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.delay_s: float | None = None
        self.base_url = ""

    def set(self, delay_s: float) -> None:
        if self.proc is not None and self.delay_s == delay_s:
            return
        self.close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "actors.coach.loopback", "--delay", str(delay_s)],
            stdout=subprocess.PIPE, text=True, cwd=ROOT)
        line = self.proc.stdout.readline()  # "loopback judge at http://... (Ctrl-C stops it)"
        if not line.startswith("loopback judge at "):
            self.close()
            raise RuntimeError(f"the loopback judge did not start: {line!r}")
        self.base_url, self.delay_s = line.split()[3], delay_s

    def close(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
            self.proc = None


def coach_overrides(coach: str, latency: float, judge: JudgeProcess | None,
                    concurrency: int) -> list[str]:
    """The coach at `latency`; at most `concurrency` scores in flight (pool and endpoint),
    so it scores at most concurrency / latency rows a second."""
    if coach == "rule":
        return [f"coach.latency_s={latency}", f"coach.max_concurrency={concurrency}"]
    assert judge is not None
    judge.set(delay_s=latency)
    return ["coach.kind=http", "coach.cache.enabled=false",
            f"coach.max_concurrency={concurrency}",
            f"coach.endpoints=[{{name: loopback, base_url: '{judge.base_url}', model: judge, "
            f"timeout_s: {latency + 30}, max_concurrency: {concurrency}}}]"]


def cell_config(cell: Cell, steps: int, runs_dir: str, coach: str,
                judge: JudgeProcess | None, cap: int, concurrency: int) -> TroupeConfig:
    overrides = BASE + coach_overrides(coach, cell.latency_s, judge, concurrency) + [
        f"run.max_steps={steps}", f"run.runs_dir={runs_dir}",
        f"models.policy.learner.max_staleness={cell.eta}",
        f"models.policy.learner.staleness_cap={cap}",
        f"rollout.sync_coach={'true' if cell.coach_inline else 'false'}",
    ]
    return load_config(None, overrides)


def measure(cfg: TroupeConfig) -> dict:
    """One run; throughput and busy fraction over the steps after the first."""
    started = time.perf_counter()
    summary = run(cfg)
    history = summary["learners"]["policy"]["history"]  # (step end time, rows, step seconds)
    (t0, _, _), rest = history[0], history[1:]
    elapsed = rest[-1][0] - t0
    learner = summary["learners"]["policy"]
    changes = summary["control"]["staleness_changes"]
    return {"rows_per_s": sum(r for _, r, _ in rest) / elapsed,
            "busy_fraction": sum(b for _, _, b in rest) / elapsed,
            "staleness_mean": learner["staleness_mean"],
            "etas": [cfg.models["policy"].learner.initial_staleness]
            + [c["max_staleness"] for c in changes],
            "windows": summary["control"]["staleness_windows"],
            "unaccounted": summary["rows"]["unaccounted"],
            "coach_failures": summary["coach"]["failures"],
            "coach_p50_s": summary["coach"]["latency_p50_s"],
            "dtypes": summary["dtypes"]["policy"], "wall_s": time.perf_counter() - started}


def plan(latencies: list[float], mixed_at: list[float], auto: bool) -> list[Cell]:
    cells = [Cell("instant", 2, False, 0.0)]
    for latency in latencies:
        cells += [Cell("async", 2, False, latency), Cell("sync", 0, True, latency)]
        if auto:
            cells.append(Cell("auto", "auto", False, latency))
    for latency in mixed_at:
        cells += [Cell("η2 inline", 2, True, latency), Cell("η0 async", 0, False, latency)]
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="learner steps per cell")
    parser.add_argument("--sync-steps", type=int, default=None,
                        help="learner steps of the sync cells (default: --steps); a rate needs "
                             "fewer steps than an auto cell needs to settle")
    parser.add_argument("--latencies", type=float, nargs="+", default=[0.5, 3.0, 10.0],
                        help="coach latency (server-side delay of the judge), seconds")
    parser.add_argument("--mixed-at", type=float, nargs="*", default=[3.0],
                        help="latencies of the two mixed cells (none: skip them)")
    parser.add_argument("--coach", choices=("http", "rule"), default="http")
    parser.add_argument("--runs-dir", default="runs/bench")
    parser.add_argument("--staleness", choices=("fixed", "auto"), default="fixed",
                        help="auto: add a max_staleness=auto cell at each latency")
    parser.add_argument("--cap", type=int, default=8, help="staleness_cap of the auto cells")
    parser.add_argument("--coach-concurrency", type=int, default=64,
                        help="scores in flight at once (the coach's throughput is this over "
                             "its latency)")
    parser.add_argument("--trace-out", default=None,
                        help="write the auto cells' measured windows (JSON) here")
    args = parser.parse_args()
    if not set(args.mixed_at) <= set(args.latencies):
        parser.error(f"--mixed-at {args.mixed_at} must be among --latencies {args.latencies} "
                     "(the mixed cells are compared with the sync cell at the same latency)")
    logging.basicConfig(level=logging.WARNING)
    _, header = dtype_header("cpu")
    print(header, flush=True)
    judge = JudgeProcess() if args.coach == "http" else None
    cells = plan(args.latencies, args.mixed_at, args.staleness == "auto")
    results, started = {}, time.perf_counter()
    try:
        for cell in cells:
            steps = args.sync_steps if cell.name == "sync" and args.sync_steps else args.steps
            cfg = cell_config(cell, steps, args.runs_dir, args.coach, judge, args.cap,
                              args.coach_concurrency)
            results[cell] = r = measure(cfg)
            r["config"] = (cfg.models["policy"].learner.max_staleness, cfg.rollout.sync_coach)
            print(f"{cell.name:<10} coach {cell.latency_s:>4.1f}s  rows/s {r['rows_per_s']:8.2f}  "
                  f"learner busy {r['busy_fraction']:6.1%}  "
                  f"staleness mean {r['staleness_mean']:4.2f}  "
                  f"η {'->'.join(map(str, r['etas']))}  coach p50 {r['coach_p50_s']:5.2f}s  "
                  f"coach failures {r['coach_failures']:.0f}  unaccounted rows {r['unaccounted']}  "
                  f"({r['wall_s']:.0f} s)", flush=True)
    finally:
        if judge is not None:
            judge.close()
    if args.trace_out:
        traces = {f"{c.latency_s:g}": results[c]["windows"] for c in cells if c.name == "auto"}
        Path(args.trace_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.trace_out).write_text(json.dumps(traces, indent=1))
    report(cells, results, args, time.perf_counter() - started)


def report(cells: list[Cell], results: dict, args, wall_s: float) -> None:
    instant = results[cells[0]]
    sync_steps = f" ({args.sync_steps} for sync)" if args.sync_steps else ""
    print(f"\n{len(cells)} runs of {args.steps} learner steps{sync_steps} ({args.coach} coach) in "
          f"{wall_s / 60:.1f} min; busy/instant = learner busy over the instant-coach run's")
    print(f"{'cell':<10} {'coach':>6} {'max_staleness':>13} {'sync_coach':>10} "
          f"{'dtype engine/learner':>21} "
          f"{'rows/s':>8} {'busy':>7} {'busy/instant':>12} {'stale mean':>10}")
    for cell in cells:
        r = results[cell]
        eta, inline = r["config"]
        dtypes = f"{r['dtypes']['engine']}/{r['dtypes']['learner']}"
        print(f"{cell.name:<10} {cell.latency_s:>5.1f}s {eta:>13} {str(inline).lower():>10} "
              f"{dtypes:>21} {r['rows_per_s']:>8.2f} {r['busy_fraction']:>7.1%} "
              f"{r['busy_fraction'] / instant['busy_fraction']:>12.2f} "
              f"{r['staleness_mean']:>10.2f}")
    print(f"\n{'coach':>7} {'async rows/s':>13} {'sync rows/s':>12} {'ratio':>7} "
          f"{'busy async':>11} {'busy sync':>10}")
    by = {(c.name, c.latency_s): results[c] for c in cells}
    for latency in args.latencies:
        a, s = by["async", latency], by["sync", latency]
        print(f"{latency:>6.1f}s {a['rows_per_s']:>13.2f} {s['rows_per_s']:>12.2f} "
              f"{a['rows_per_s'] / s['rows_per_s']:>7.2f} {a['busy_fraction']:>11.1%} "
              f"{s['busy_fraction']:>10.1%}")
    key = 3.0 if 3.0 in args.latencies else args.latencies[-1]
    for latency in args.mixed_at:
        sync = by["sync", latency]["rows_per_s"]
        print(f"at {latency:g}s coach, rows/s over sync: staleness alone (η2 inline) "
              f"{by['η2 inline', latency]['rows_per_s'] / sync:.2f}, coach off the path alone "
              f"(η0 async) {by['η0 async', latency]['rows_per_s'] / sync:.2f}, both (async) "
              f"{by['async', latency]['rows_per_s'] / sync:.2f}")
    busy = by["async", key]["busy_fraction"] / instant["busy_fraction"]
    print(f"learner busy at {key:g}s coach vs instant-coach run: {busy:.2f}")
    if args.staleness == "auto":
        print(f"\n{'coach':>7} {'busy η=2':>9} {'stale η=2':>10} {'busy auto':>10} "
              f"{'stale auto':>11} {'auto η over the run':>20}")
        for latency in args.latencies:
            f, a = by["async", latency], by["auto", latency]
            print(f"{latency:>6.1f}s {f['busy_fraction']:>9.1%} {f['staleness_mean']:>10.2f} "
                  f"{a['busy_fraction']:>10.1%} {a['staleness_mean']:>11.2f} "
                  f"{'->'.join(map(str, a['etas'])):>20}")
        auto_busy = by["auto", key]["busy_fraction"] / instant["busy_fraction"]
        print(f"busy at {key:g}s coach vs instant: {auto_busy:.2f}")
    ratio = by["async", key]["rows_per_s"] / by["sync", key]["rows_per_s"]
    print(f"async/sync throughput at {key:g}s coach: {ratio:.2f}")


if __name__ == "__main__":
    main()
