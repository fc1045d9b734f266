"""The code tool workflows share: run an action's ```python blocks in the sandbox.

A workflow holds one `CodeTool` per rollout actor (its sandbox bounds concurrent runs, DESIGN
§14) and asks it to run each action that may call the tool. Model code that fails is an
observation (the agent and the coach see it); an infrastructure failure of the sandbox raises
`SandboxError`, which fails the round with a counted reason (episode_error).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

from actors.sandbox import Sandbox, SandboxConfig, Workspace, python_blocks


@dataclass(frozen=True)
class ToolResult:
    """What one action's tool call did; `called` is False when it wrote no code block."""

    called: bool
    ok: bool  # the code exited 0 within every limit
    observation: str  # what the agent and the coach are shown ("" when not called)
    tripped: str | None = None  # the sandbox limit that ended the run, if any
    wall_s: float = 0.0

    def meta(self) -> dict[str, Any]:
        """Row annotations (Episode.annotate): what evaluation and metrics count."""
        return {"tool_called": self.called, "tool_ok": self.ok, "tool_tripped": self.tripped,
                "tool_wall_s": round(self.wall_s, 3)}

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
        blocks = python_blocks(text)
        if not blocks:
            return ToolResult(False, False, "")
        result = await self.sandbox.run_python("\n\n".join(blocks), workspace)
        return ToolResult(True, result.ok, result.observation(self.observation_chars),
                          result.tripped, result.wall_s)

    def stats(self) -> dict:
        return self.sandbox.stats() if self._sandbox is not None else {}
