"""Workflow registry: name -> builder taking the WorkflowConfig."""
from __future__ import annotations

from actors.workflows.arith_duo import ArithDuo
from actors.workflows.base import Task, Workflow, WorkflowConfig
from actors.workflows.signal_game import SignalGame

WORKFLOWS = {
    "signal_game": lambda cfg: SignalGame(cfg.signal_game),
    "arith_duo": lambda cfg: ArithDuo(cfg.arith_duo),
}


def build_workflow(cfg: WorkflowConfig) -> Workflow:
    if cfg.name not in WORKFLOWS:
        raise ValueError(f"workflow.name={cfg.name!r} is unknown; choose one of {sorted(WORKFLOWS)}")
    return WORKFLOWS[cfg.name](cfg)


__all__ = ["WORKFLOWS", "Task", "Workflow", "WorkflowConfig", "build_workflow"]
