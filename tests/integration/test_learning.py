"""Learning: two agents on two separate tiny models learn to signal (chance → ≥ 0.9).

The receiver's team success is read back from TensorBoard, as a user would watch it.
"""
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from runtime.config import load_config
from runtime.controller import run

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_signal_game_learns_from_chance_to_090(tmp_path):
    cfg = load_config(ROOT / "configs" / "signal_game_tiny.yaml",
                      [f"run.runs_dir={tmp_path}", "run.run_id=learn"])
    summary = run(cfg)
    assert summary["rows"]["unaccounted"] == 0
    acc = EventAccumulator(str(tmp_path / "learn" / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    success = np.array([e.value for e in acc.Scalars("episode/signal_game/success")])
    chance = 1 / cfg.workflow.params.get("num_targets", 4)
    early, late = success[:10].mean(), success[-10:].mean()
    print(f"success: first rounds {early:.3f}, last rounds {late:.3f} (chance {chance:.2f})")
    assert early <= chance + 0.15, "the untrained pair should be near chance"
    assert late >= 0.9, f"success only reached {late:.3f}"
