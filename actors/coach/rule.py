"""The offline coach: the workflow's rule score, with an optional injected latency (DESIGN §8).

It gives the `Coach` interface without a remote judge, so the decoupling of scoring from
generation and training is measurable on a laptop.
"""
from __future__ import annotations

import asyncio

from actors.coach.parse import Verdict
from actors.episode import CoachRequest
from actors.workflows.base import Task, Workflow


class RuleCoach:
    """Scores an action with its workflow's rules, after `latency_s` of simulated thinking."""

    def __init__(self, workflow: Workflow, latency_s: float = 0.0) -> None:
        self.workflow = workflow
        self.latency_s = latency_s

    async def score(self, request: CoachRequest) -> Verdict:
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        task = Task(task_id=request.task_id, prompt=request.input_text, truth=request.truth or "")
        return Verdict(float(self.workflow.rule_score(request.agent, task, request.output_text,
                                                      request.finish_reason, request.context)))

    def stats(self) -> dict[str, float]:
        return {}

    async def close(self) -> None:
        return None
