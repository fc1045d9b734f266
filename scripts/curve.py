"""Print a run's learning curve from its TensorBoard logs, and whether it rose.

    python scripts/curve.py runs/<run_id>                      # the workflow's success
    python scripts/curve.py runs/<run_id> --key reward/verifier/mean

The series is split into thirds by position; the last line reads
`<key>: first third <a>, last third <b>, rise <b - a>` — the figure the README quotes for
`make run`. Rollout metrics (episode/…) have one point per round, learner metrics one per step.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def read_series(run_dir: Path, key: str | None) -> tuple[str, np.ndarray]:
    """(key, values in step order); without a key, the run's `episode/<workflow>/success`."""
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    if key is None:
        key = next((t for t in tags if t.startswith("episode/") and t.endswith("/success")), None)
        if key is None:
            raise SystemExit(f"no episode/<workflow>/success in {run_dir}; pass --key")
    if key not in tags:
        raise SystemExit(f"{key} not logged in {run_dir}; have {sorted(tags)}")
    events = sorted(acc.Scalars(key), key=lambda e: e.step)
    return key, np.array([e.value for e in events], dtype=np.float64)


def thirds(values: np.ndarray) -> tuple[float, float]:
    """Means of the first and the last third of the series."""
    if len(values) < 3:
        raise SystemExit(f"only {len(values)} points: too few to split into thirds")
    third = len(values) // 3
    return float(values[:third].mean()), float(values[-third:].mean())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--key", default=None, help="a scalar tag (default: episode success)")
    parser.add_argument("--bins", type=int, default=10, help="points printed along the curve")
    args = parser.parse_args()
    key, values = read_series(args.run_dir, args.key)
    chunks = np.array_split(values, min(args.bins, len(values)))
    print(f"{key} ({len(values)} points), mean per tenth: "
          + " ".join(f"{c.mean():.3f}" for c in chunks))
    first, last = thirds(values)
    print(f"{key}: first third {first:.3f}, last third {last:.3f}, rise {last - first:+.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
