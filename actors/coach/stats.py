"""What the coach pool measures (DESIGN §9 `coach/…` keys, MAPPA §4).

Latency of scoring one row (all retries included), per-agent score distributions, and per
agent the correlation of coach score with the episode's outcome: a score that climbs while
the outcome does not is the reward-hacking signature MAPPA §4 reports (the DSBench coach
preferring regression tasks). Windows are bounded deques (STYLE §8).
"""
from __future__ import annotations

from collections import deque

import numpy as np

WINDOW = 4096


def _percentiles(values: deque, prefix: str) -> dict[str, float]:
    arr = np.asarray(values, dtype=np.float64)
    if not arr.size:
        return {}
    p10, p50, p90 = np.percentile(arr, [10, 50, 90])
    return {f"{prefix}mean": float(arr.mean()), f"{prefix}std": float(arr.std()),
            f"{prefix}p10": float(p10), f"{prefix}p50": float(p50), f"{prefix}p90": float(p90),
            f"{prefix}max": float(arr.max())}


class ScoreBook:
    """Recent (score, outcome) pairs per agent and recent per-row latencies."""

    def __init__(self) -> None:
        self.latencies: deque[float] = deque(maxlen=WINDOW)
        self.scores: dict[str, deque[float]] = {}
        self.pairs: dict[str, deque[tuple[float, float]]] = {}
        self.answer_checks: deque[bool] = deque(maxlen=WINDOW)

    def add(self, agent: str, score: float, outcome: float | None,
            answer_correct: int | None, on_path: bool) -> None:
        self.scores.setdefault(agent, deque(maxlen=WINDOW)).append(score)
        if outcome is not None:
            self.pairs.setdefault(agent, deque(maxlen=WINDOW)).append((score, outcome))
            if answer_correct is not None and on_path:
                # the coach's ANSWER_CORRECT against the rule outcome of the answer kept
                self.answer_checks.append(answer_correct == round(outcome))

    def stats(self) -> dict[str, float]:
        lat = np.asarray(self.latencies) if self.latencies else np.zeros(1)
        out = {"latency_p50_s": float(np.percentile(lat, 50)),
               "latency_p95_s": float(np.percentile(lat, 95)),
               "latency_max_s": float(lat.max())}
        for agent, scores in self.scores.items():
            out.update(_percentiles(scores, f"score/{agent}/"))
            out[f"score/{agent}/count"] = float(len(scores))
        for agent, pairs in self.pairs.items():
            corr = correlation(pairs)
            if corr is not None:
                out[f"score_vs_outcome/{agent}"] = corr
        if self.answer_checks:
            out["answer_correct_agreement"] = float(np.mean(self.answer_checks))
        return out

    def histograms(self) -> dict[str, list[float]]:
        return {f"score/{agent}": list(scores) for agent, scores in self.scores.items()}


def correlation(pairs) -> float | None:
    """Pearson correlation of (score, outcome) pairs; None when undefined (< 3, constant)."""
    if len(pairs) < 3:
        return None
    arr = np.asarray(pairs, dtype=np.float64)
    if arr[:, 0].std() == 0 or arr[:, 1].std() == 0:
        return None
    return float(np.corrcoef(arr[:, 0], arr[:, 1])[0, 1])
