"""Prompts of the grid-game team (actors/workflows/grid_team.py): AT-GRPO A.2.2 and A.3.

The Tool Agent and the Plan Agent prompts are the paper's "Sudoku MAS Workflow" (A.2.2) and
"Plan-Path MAS Workflow" (A.3, with its turn > 0 refinement, A.3.1). The paper prints no
Sokoban workflow; Sokoban uses the Plan-Path prompts (both answer with a move list) with the
room's rules in place of the map's. Sudoku has no printed refinement phase; from turn 2 on it
gets the same history block as Plan-Path.

What each prompt holds, in the paper's words:
    tool:    the task (rules and the current state), the env context (a JSON object, also
             written to `state.json` in the program's working directory), the output format,
             and from turn 2 on the history of earlier turns.
    planner: the task, the Tool Agent's code, its execution output, the proposal as the
             environment read it (the simulated step's verdict), the history, and the
             mandatory `####` answer format.
Texts that can grow (tool output, history) are cut to the workflow's `observation_chars` and
`history_chars`, keeping head and tail, so prompts stay inside small models' contexts.

    python -c 'from actors.workflows.grid_prompts import TEXTS; print(TEXTS["sudoku"].example)'
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from actors.envs import sudoku

STATE_FILE = "state.json"  # the env context, written to the tool program's working directory


@dataclass(frozen=True)
class GameText:
    """What the prompts say about one game.

    Attributes:
        tool_role, planner_goal: the paper's role title and what the planner decides.
        tool_output: what the tool's program must print (A.2.2 / A.3 "Use the 'print'
            function to output ...").
        example: one answer in the right format.
        check: what the planner verifies the execution output against.
        answer_forms: the answer formats the planner may use after `####`.
        state_label: the line above the current board.
        context: the committed state as the env context dict (JSON-serialisable).
    """

    tool_role: str
    planner_goal: str
    tool_output: str
    example: str
    check: str
    answer_forms: str
    state_label: str
    context: Callable[[Any], dict]


def _sudoku_context(state: Any) -> dict:
    return {"size": state.size, "subgrid_size": sudoku.box_size(state.size),
            "grid": [list(row) for row in state.grid], "blank": 0}


def _path_context(state: Any) -> dict:
    path_map = state.map
    return {"height": path_map.height, "width": path_map.width,
            "start": list(state.position), "goal": list(path_map.goal),
            "obstacles": [list(cell) for cell in sorted(path_map.walls)]}


def _sokoban_context(state: Any) -> dict:
    room = state.room
    return {"height": room.height, "width": room.width, "player": list(state.player),
            "boxes": [list(cell) for cell in sorted(state.boxes)],
            "goals": [list(cell) for cell in sorted(room.goals)],
            "walls": [list(cell) for cell in sorted(room.walls)]}


_MOVE_FORMAT = "Give the final action list AFTER the line that begins with ####."
TEXTS: dict[str, GameText] = {
    "sudoku": GameText(
        tool_role="Sudoku Coder",
        planner_goal="the final Sudoku solution",
        tool_output=("EITHER: (A) the completed grid as a JSON array of arrays, OR (B) a JSON "
                     "list of fill steps [r,c,v] using 1-based indices"),
        example="[[1,2,3,4],[3,4,1,2],[2,1,4,3],[4,3,2,1]]",
        check=("the Sudoku rules: rows, columns, and sub-grids must contain unique digits "
               "in 1..n"),
        answer_forms=("Give the final answer AFTER the line that begins with ####. You may "
                      "return EITHER a completed grid as JSON, OR a JSON list of fill steps "
                      "[r,c,v], 1-based indices. Examples:\n#### [[1,2,3,4],[3,4,1,2],"
                      "[2,1,4,3],[4,3,2,1]]\n#### [[1,3,4],[2,1,3]]"),
        state_label="Current puzzle (dots denote blanks):",
        context=_sudoku_context),
    "plan_path": GameText(
        tool_role="Path Coder",
        planner_goal="the final action list",
        tool_output=("the action list that moves from the start to the goal. You may output "
                     "the full action list if you can reach the target, or a partial list if "
                     "uncertain"),
        example="[U,R,D,L]",
        check=("the task requirements and environment constraints (bounds, obstacles, "
               "goal)"),
        answer_forms=f"{_MOVE_FORMAT} Example:\n#### [U,R,D,L]",
        state_label="Current grid (A you, G goal, # obstacle, . free):",
        context=_path_context),
    "sokoban": GameText(
        tool_role="Sokoban Coder",
        planner_goal="the final action list",
        tool_output=("the action list that pushes every box onto a goal. You may output the "
                     "full action list if you can solve it, or a partial list if uncertain"),
        example="[U,R,D,L]",
        check=("the task requirements and environment constraints (walls, pushes into a wall "
               "or another box, boxes stuck in corners, goals)"),
        answer_forms=f"{_MOVE_FORMAT} Example:\n#### [U,R,D,L]",
        state_label="Current room:",
        context=_sokoban_context),
}

TOOL_PROMPT = """You are an AI assistant designed to be helpful. Utilize your programming expertise to address the task. Propose Python code (within a single python code block) for the user to run. Ensure each response contains only ONE code block. Use the 'print' function to output {tool_output}.
Formatting requirements:
* The program's output IS the answer, e.g. {example}
* Print ONLY the answer (no extra text, no comments).
{refine}Task: {rules}
{state_label}
{state}
Environment (JSON; the same object is in the file {state_file} of the working directory):
{context}{history}"""
TOOL_REFINE = ("* Refine your earlier solution using the history below: if certain, print the "
               "full answer; if uncertain, print a safe partial one.")

PLANNER_PROMPT = """You are a planning and reasoning agent. You will receive the original task description, the Tool Agent's code and the code execution output. Your job is to reason carefully, decide {planner_goal}, and format your response EXACTLY as specified.
Instructions:
* Read the task, inspect the code, and verify the execution output against {check}.
* If the tool's output is correct and sufficient, adopt it. Otherwise, correct it or provide your own.
* Keep reasoning concise but explicit.
FORMATTING IS MANDATORY. {answer_forms}

Task: {rules}
{state_label}
{state}
Tool code:
{code}
Tool execution output:
{output}
Tool proposal, as the environment reads it:
{proposal}{history}"""


def clip(text: str, limit: int) -> str:
    """`text` cut to at most `limit` characters, keeping its head and tail (the verdict and
    the last printed lines are at the ends)."""
    if len(text) <= limit:
        return text
    marker = " [...] "
    keep = max(limit - len(marker), 2)
    return text[:keep - keep // 2] + marker + text[len(text) - keep // 2:]


def rules(task_prompt: str) -> str:
    """The game's rules: the first line of the env's `describe(task)` (the rest is the
    initial board, which the prompts replace by the current state)."""
    return task_prompt.split("\n", 1)[0]


def history_block(lines: list[str], limit: int) -> str:
    """Earlier turns, oldest first; when they exceed `limit` the oldest are dropped first."""
    if not lines:
        return ""
    kept: list[str] = []
    used = 0
    for line in reversed(lines):
        if kept and used + len(line) > limit:
            break
        kept.append(clip(line, limit))
        used += len(line)
    dropped = len(lines) - len(kept)
    head = f"({dropped} earlier turn(s) not shown)\n" if dropped else ""
    return "\nHistory (previous attempts, planner answers and the environment):\n" + head + \
        "\n".join(reversed(kept))


def tool_prompt(text: GameText, task_prompt: str, state_text: str, context: dict,
                history: str) -> str:
    """The Tool Agent's prompt (A.2.2 Tool Agent; A.3 Path Coder, turn > 0 refinement)."""
    return TOOL_PROMPT.format(
        tool_output=text.tool_output, example=text.example,
        refine=TOOL_REFINE + "\n" if history else "", rules=rules(task_prompt),
        state_label=text.state_label, state=state_text,
        state_file=STATE_FILE, context=json.dumps(context, separators=(",", ":")),
        history=history)


def planner_prompt(text: GameText, task_prompt: str, state_text: str, code: str,
                   output: str, proposal: str, history: str) -> str:
    """The Plan Agent's prompt (A.2.2 Plan Agent; A.3 Planner & Verifier)."""
    return PLANNER_PROMPT.format(
        planner_goal=text.planner_goal, check=text.check, answer_forms=text.answer_forms,
        rules=rules(task_prompt), state_label=text.state_label, state=state_text, code=code,
        output=output,
        proposal=proposal, history=history)
