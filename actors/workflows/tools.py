"""The code tool workflows share: run an action's ```python blocks in the sandbox.

A workflow holds one `CodeTool` per rollout actor (its sandbox bounds concurrent runs, DESIGN
§14) and hands it each action that may call the tool (`call`). Model code that fails is an
observation (the agent and the coach see it); an infrastructure failure of the sandbox marks
that action's row FAILED `sandbox` (`Episode.fail`: it is counted, never trained, never sent
to the coach) and the agent is told the tool was unavailable.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Iterator

from actors.sandbox import Sandbox, SandboxConfig, SandboxError, Workspace, python_blocks

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolResult:
    """What one action's tool call did; `called` is False when it wrote no code block."""

    called: bool
    ok: bool  # the code exited 0 within every limit
    observation: str  # what the agent and the coach are shown ("" when not called)
    tripped: str | None = None  # the sandbox limit that ended the run, if any
    wall_s: float = 0.0
    infra_error: str = ""  # the sandbox itself failed (not the model's code)
    stdout: str = ""  # the program's printed output alone (what an environment reads)

    def meta(self) -> dict[str, Any]:
        """Row annotations (Episode.annotate): what evaluation and metrics count."""
        return {"tool_called": self.called, "tool_ok": self.ok, "tool_tripped": self.tripped,
                "tool_wall_s": round(self.wall_s, 3), "tool_infra_error": self.infra_error}

    def context(self) -> dict[str, Any]:
        """The coach request's context: MAPPA §2.2's tool execution results."""
        return {"tool_observation": self.observation if self.called else "",
                "tool_called": self.called, "tool_ok": self.ok}


class CodeTool:
    """Runs the Python blocks of a reply in a workspace; the sandbox is made on first use."""

    def __init__(self, cfg: SandboxConfig, observation_chars: int = 1500) -> None:
        self.cfg = cfg
        self.observation_chars = observation_chars
        self._sandbox: Sandbox | None = None
        self.infra_failures = 0

    @property
    def sandbox(self) -> Sandbox:
        if self._sandbox is None:  # not at config validation: it probes the isolation once
            self._sandbox = Sandbox(self.cfg)
        return self._sandbox

    @contextlib.contextmanager
    def workspace(self) -> Iterator[Workspace]:
        """A fresh per-episode workspace, removed when the episode ends."""
        workspace = Workspace.create(self.cfg.workspace_root or None)
        try:
            yield workspace
        finally:
            workspace.cleanup()

    @staticmethod
    def stop_strings(prefix: str) -> list[str]:
        """Stops at the closing fence: any fence once the prefix opened a block, else a bare
        fence line ("```python" does not contain "```\\n", a closing fence does)."""
        return ["```"] if "```" in prefix else ["```\n"]

    async def run(self, text: str, workspace: Workspace) -> ToolResult:
        """Run the reply's code blocks (joined, in order); a sandbox failure is reported in
        `infra_error`, never raised."""
        blocks = python_blocks(text)
        if not blocks:
            return ToolResult(False, False, "")
        try:
            result = await self.sandbox.run_python("\n\n".join(blocks), workspace)
        except SandboxError as exc:  # counted: the row is FAILED `sandbox` (see call)
            self.infra_failures += 1
            log.warning("sandbox failure (%d so far): %s", self.infra_failures, exc)
            return ToolResult(True, False, "The code could not be run: the tool is unavailable.",
                              infra_error=str(exc)[:500])
        return ToolResult(True, result.ok, result.observation(self.observation_chars),
                          result.tripped, result.wall_s, stdout=result.stdout)

    async def call(self, episode, action, workspace: Workspace) -> ToolResult:
        """Run an action's code and record it on its row (annotations; FAILED on a sandbox
        failure, so the row is neither trained nor coached)."""
        result = await self.run(action.text, workspace)
        episode.annotate(action.step_id, **result.meta())
        if result.infra_error:
            episode.fail(action.step_id, "sandbox")
        return result

    def stats(self) -> dict:
        return self.sandbox.stats() if self._sandbox is not None else {}
