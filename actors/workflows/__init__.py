"""Workflows: each module registers itself (actors/workflows/registry.py); build one by name."""
from __future__ import annotations

from actors.workflows.base import Task, Workflow, WorkflowConfig
from actors.workflows.registry import discover, entry, make_settings, workflow_names


def build_workflow(cfg: WorkflowConfig) -> Workflow:
    """The workflow `cfg.name`, built from its validated `cfg.params`."""
    found = entry(cfg.name)
    return found.cls(make_settings(cfg.name, cfg.params))


__all__ = ["Task", "Workflow", "WorkflowConfig", "build_workflow", "discover", "workflow_names"]
