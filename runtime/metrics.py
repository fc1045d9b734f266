"""The one metrics sink: a TensorBoard writer that every actor calls fire-and-forget.

Keys are namespaced (DESIGN §9): `reward/<agent>/…`, `coach/…`, `staleness/<model>/…`,
`buffer/<model>/…`, `train/<model>/…`, `perf/…`, `behavior/<agent>/…`, `episode/…`.
Scalars without an explicit step are written at the writer's own monotonically increasing
step for their key, so rollout-side metrics (which know no learner step) still plot.
A NaN or infinite value is written as it is (TensorBoard shows it) and counted per key
(`counts()`, in summary.json), with a warning the first time a key goes non-finite: a NaN
loss must be seen, not smoothed away.
"""
from __future__ import annotations

import logging
import math
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
from torch.utils.tensorboard import SummaryWriter

log = logging.getLogger("troupe.metrics")


class MetricsWriter:
    """Owns the run's TensorBoard event files."""

    def __init__(self, logdir: str | Path, flush_secs: int = 5) -> None:
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self._writer = SummaryWriter(str(self.logdir), flush_secs=flush_secs)
        self._key_steps: dict[str, int] = defaultdict(int)
        self._started = time.time()
        self.keys: set[str] = set()
        self.non_finite: Counter[str] = Counter()  # key -> NaN/inf values written
        self.missing: Counter[str] = Counter()  # key -> None values (nothing to write)

    def scalars(self, values: dict[str, float], step: int | None = None) -> None:
        """Write scalars at `step`, or at each key's own counter when step is None."""
        for key, value in values.items():
            if value is None:
                self.missing[key] += 1
                continue
            if not math.isfinite(value):
                if not self.non_finite[key]:
                    log.warning("metric %s is %s (written; counted in summary.json)", key, value)
                self.non_finite[key] += 1
            at = step if step is not None else self._key_steps[key]
            self._key_steps[key] = max(self._key_steps[key], at) + 1
            self._writer.add_scalar(key, float(value), at, walltime=time.time())
            self.keys.add(key)

    def histogram(self, key: str, values: list[float] | np.ndarray, step: int) -> None:
        values = np.asarray(values, dtype=np.float64)
        if values.size:
            self._writer.add_histogram(key, values, step)
            self.keys.add(key)

    def text(self, key: str, text: str, step: int = 0) -> None:
        self._writer.add_text(key, text, step)

    def counts(self) -> dict[str, dict[str, int]]:
        """Non-finite and missing values per key (both empty in a healthy run)."""
        return {"non_finite": dict(self.non_finite), "missing": dict(self.missing)}

    def flush(self) -> list[str]:
        """Flush event files; returns the keys written so far (sorted)."""
        self._writer.flush()
        return sorted(self.keys)

    def close(self) -> list[str]:
        keys = self.flush()
        self._writer.close()
        return keys
