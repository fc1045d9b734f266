"""Coach prompt templates (MAPPA appendices B.4, C.4, F) and what fills them.

Templates are text files under `configs/coach_prompts/` with `{placeholder}` fields; a
workflow names its own (`coach_prompt` on its class), or `coach.prompt` in config picks one. The context
of one action is MAPPA §2.2's: the agent's role, its input, its output, the tool
observation, and the ground truth when available — which MathChat gives only to the final
agent (`coach.truth_agents`). An unknown placeholder is an error, never left in the prompt.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from actors.coach.config import CoachConfig, prompt_path
from actors.episode import CoachRequest



def workflow_prompt(workflow: str) -> str:
    """The template a workflow uses when `coach.prompt` is empty ("" if it has none)."""
    from actors.workflows.registry import entry  # workflows import the episode, as this does

    return getattr(entry(workflow).cls, "coach_prompt", "")

PLACEHOLDERS = ("problem", "agent_role", "agent_input", "agent_output", "tool_observation",
                "ground_truth_answer", "outcome", "residual", "trajectory")
_FIELD = re.compile(r"\{([a-z_]+)\}")
FORMAT_REMINDER = ("Your reply did not follow the required output format ({problem}). Evaluate "
                   "the same agent action again and end your reply with the lines exactly as "
                   "asked, e.g.\nPROCESS_SCORE: 7")
BACKPROP_REMINDER = ("Your reply did not follow the required output format ({problem}). Answer "
                     "again with exactly two lines:\nCONTRIBUTION: <integer from -10 to 10>\n"
                     "RESIDUAL: <one or two sentences>")


class Template:
    """One template file; `render(**fields)` fills every placeholder it names."""

    def __init__(self, name: str) -> None:
        path = prompt_path(name)
        self.name = name
        self.text = path.read_text()
        self.fields = set(_FIELD.findall(self.text))
        unknown = self.fields - set(PLACEHOLDERS)
        if unknown:
            raise ValueError(f"coach prompt {path.name} uses unknown placeholders "
                             f"{sorted(unknown)}; known: {list(PLACEHOLDERS)}")
        self.asks_answer = "ANSWER_CORRECT" in self.text

    def render(self, **values: str) -> str:
        missing = self.fields - set(values)
        if missing:
            raise KeyError(f"coach prompt {self.name}: no value for {sorted(missing)}")
        # one pass over the template: substituted text (model outputs) is never re-scanned
        return _FIELD.sub(lambda m: values[m.group(1)], self.text)


@dataclass(frozen=True)
class Rendered:
    """A chat to send, and whether the reply must carry ANSWER_CORRECT."""

    messages: tuple[tuple[str, str], ...]  # (role, content) pairs; hashable for the cache key
    require_answer: bool

    def as_openai(self) -> list[dict[str, str]]:
        return [{"role": role, "content": content} for role, content in self.messages]


class PromptBook:
    """Renders the forward (process score) and backward (attribution) prompts of a config."""

    def __init__(self, cfg: CoachConfig, workflow: str) -> None:
        name = cfg.prompt or workflow_prompt(workflow)
        if not name:
            raise ValueError(f"coach.prompt is empty and workflow {workflow!r} has no default "
                             "coach template; set coach.prompt to one of "
                             "configs/coach_prompts/*.txt")
        self.forward = Template(name)
        self.backward = Template(cfg.backprop.prompt) if cfg.backprop.enabled else None
        self.roles = dict(cfg.roles)
        self.truth_agents = set(cfg.truth_agents)

    def role(self, agent: str) -> str:
        return self.roles.get(agent, agent)

    def sees_truth(self, request: CoachRequest) -> bool:
        return request.truth is not None and (not self.truth_agents
                                              or request.agent in self.truth_agents)

    def _context(self, request: CoachRequest) -> dict[str, str]:
        tool = request.context.get("tool_observation") if request.context else None
        return dict(problem=request.problem or request.input_text,
                    agent_role=self.role(request.agent), agent_input=request.input_text,
                    agent_output=request.output_text or "(empty output)",
                    tool_observation=str(tool) if tool else "N/A",
                    ground_truth_answer=request.truth if self.sees_truth(request) else "N/A")

    def score_prompt(self, request: CoachRequest) -> Rendered:
        text = self.forward.render(**self._context(request))
        require = self.forward.asks_answer and self.sees_truth(request) and bool(self.truth_agents)
        return Rendered((("user", text),), require)

    def attribution_prompt(self, request: CoachRequest, outcome: str, residual: str,
                           trajectory: str) -> Rendered:
        assert self.backward is not None, "backprop prompt requested with backprop disabled"
        text = self.backward.render(**self._context(request), outcome=outcome,
                                    residual=residual, trajectory=trajectory)
        return Rendered((("user", text),), False)

    def trajectory(self, path: list[CoachRequest], excerpt: int = 600) -> str:
        """The on-path actions in order, as the backward prompt shows them."""
        return "\n\n".join(f"Step {i + 1} ({self.role(r.agent)}):\n{r.output_text[:excerpt]}"
                           for i, r in enumerate(path))
