"""weight_sync auto with local engines: both paths timed on the first steps, the faster kept."""
from __future__ import annotations

from runtime.learner_worker import SyncTrial


def play(trial: SyncTrial, seconds: dict[str, float], steps: int) -> list[str]:
    """The path each of `steps` syncs takes, each recorded with that path's seconds."""
    paths = []
    for _ in range(steps):
        tensor = trial.use_tensor()
        path = "tensor" if tensor else "disk"
        trial.record(tensor, seconds[path])
        paths.append(path)
    return paths


def test_alternates_disk_first_then_keeps_the_faster():
    trial = SyncTrial(trials=2)
    assert play(trial, {"disk": 2.3, "tensor": 1.3}, 7) == [
        "disk", "tensor", "disk", "tensor", "tensor", "tensor", "tensor"]
    assert trial.choice == "tensor"
    assert trial.summary() == {"path": "tensor", "trials": 2, "disk_s": 2.3, "tensor_s": 1.3}
    slower = SyncTrial(trials=2)
    assert play(slower, {"disk": 0.03, "tensor": 0.22}, 6)[4:] == ["disk", "disk"]
    assert slower.choice == "disk"


def test_a_folder_step_during_the_trial_counts_for_disk():
    trial = SyncTrial(trials=2)
    trial.record(False, 1.0)  # weights_to_disk_every forced a folder
    trial.record(False, 1.2)
    assert trial.use_tensor() and trial.choice is None  # tensor still owes its trials
    trial.record(True, 0.5)
    assert trial.use_tensor()
    trial.record(True, 0.7)
    assert trial.use_tensor() and trial.choice == "tensor"
    assert trial.medians() == {"disk": 1.1, "tensor": 0.6}
