"""Sokoban on an H×W room (6×6, walled border, 1 box by default): generator, BFS oracle,
rewards (AT-GRPO A.1.5).

An action is a move list such as [U,R,D,L]; the player moves one cell, pushing a box ahead
of it when the cell beyond the box is free. Moves run in order and stop at the first invalid
one (an unknown symbol, a step off the grid or into a wall, a push into a wall or another box;
the state reached so far stays) or once every box is on a goal.

Rewards, A.1.5 (λ_sok = 0.40), B boxes, b_k of them on goals:
    r^team_k = 1 if all boxes are on goals at k, else b_k / B
    planner: 0.10·s_fmt + 0.45·s_leg + 0.45·s_dlk
        s_fmt = 1{every item is one of U, D, L, R}
        s_leg = 1{every move is in bounds and not into a wall; every push is PushOK}
        s_dlk = DeadlockFree: 1{the moves leave no box off a goal in a static corner (a wall
                or the border on one vertical and one horizontal side) that was not there
                before} — a cornered box can never move, so "the move avoids" a deadlock is
                "no new cornered box"
        m     = 1{a non-empty bracketed list}
    tool: 0.10·s_fmt + 0.30·s_exec + 0.60·s_pot
        s_fmt  = as the planner's
        s_exec = 1{no illegal push, no wall/box collision}
        s_pot  = 1{ψ_k >= ψ_{k-1}}, ψ = -Σ_boxes min_goals Manhattan(box, goal)
        m      = as the planner's

    python -c 'from actors.envs import sokoban as s; print(s.describe(s.generate(5)))'
"""
from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

from actors.envs import MOVES, GameRules, LocalReward, local_reward, parse_moves

GAME = "sokoban"
LAMBDA = 0.40  # λ_sok
PLANNER_COEFFICIENTS = {"fmt": 0.10, "leg": 0.45, "dlk": 0.45}
TOOL_COEFFICIENTS = {"fmt": 0.10, "exec": 0.30, "pot": 0.60}
DEFAULT_SIZE = 6
DEFAULT_BOXES = 1
DEFAULT_MAX_INNER_WALLS = 2  # walls inside the border, drawn from 0..this (paper: silent)
DEFAULT_MIN_MOVES = 3  # instances solved in fewer moves are redrawn (paper: silent)
_MAX_ATTEMPTS = 1000
_MAX_SEARCH_STATES = 200_000  # the oracle gives up (None) beyond this many states

Cell = tuple[int, int]
Moves = tuple[str, ...]


@dataclass(frozen=True)
class Room:
    """The static level: size, walls, goals."""

    height: int
    width: int
    walls: frozenset[Cell]
    goals: frozenset[Cell]

    def blocked(self, cell: Cell) -> bool:
        r, c = cell
        return not (0 <= r < self.height and 0 <= c < self.width) or cell in self.walls


@dataclass(frozen=True)
class SokobanState:
    room: Room
    player: Cell
    boxes: frozenset[Cell]


@dataclass(frozen=True)
class Walk:
    """A move list run from a state: the state it ends in, whether every move ran."""

    state: SokobanState
    legal: bool
    moved: int


def _step(cell: Cell, symbol: str) -> Cell:
    dr, dc = MOVES[symbol]
    return cell[0] + dr, cell[1] + dc


def move(state: SokobanState, symbol: str) -> SokobanState | None:
    """One move, or None when it is invalid (unknown, into a wall, a blocked push)."""
    if symbol not in MOVES:
        return None
    target = _step(state.player, symbol)
    if state.room.blocked(target):
        return None
    boxes = state.boxes
    if target in boxes:
        beyond = _step(target, symbol)
        if state.room.blocked(beyond) or beyond in boxes:  # PushOK = 0
            return None
        boxes = (boxes - {target}) | {beyond}
    return SokobanState(state.room, target, boxes)


def solved(state: SokobanState) -> bool:
    return state.boxes <= state.room.goals


def walk(state: SokobanState, moves: Moves) -> Walk:
    """Run `moves` (the module docstring's rules)."""
    moved = 0
    for symbol in moves:
        if solved(state):
            break
        nxt = move(state, symbol)
        if nxt is None:
            return Walk(state, False, moved)
        state, moved = nxt, moved + 1
    return Walk(state, True, moved)


def cornered_boxes(state: SokobanState) -> frozenset[Cell]:
    """Boxes off a goal with a wall (or the border) above or below AND left or right."""
    room = state.room

    def blocked(cell: Cell, symbol: str) -> bool:
        return room.blocked(_step(cell, symbol))

    return frozenset(box for box in state.boxes if box not in room.goals
                     and (blocked(box, "U") or blocked(box, "D"))
                     and (blocked(box, "L") or blocked(box, "R")))


def potential(state: SokobanState) -> int:
    """ψ = -Σ_boxes min_goals Manhattan(box, goal) (A.1.5)."""
    return -sum(min(abs(b[0] - g[0]) + abs(b[1] - g[1]) for g in state.room.goals)
                for b in state.boxes)


def solve_state(state: SokobanState) -> list[str] | None:
    """BFS over (player, boxes): a shortest move list to the goal, or None.

    States with a cornered box are pruned (they cannot be solved); None also when the search
    passes _MAX_SEARCH_STATES states.
    """
    if solved(state):
        return []
    parent: dict[SokobanState, tuple[SokobanState, str] | None] = {state: None}
    queue = deque([state])
    while queue and len(parent) < _MAX_SEARCH_STATES:
        current = queue.popleft()
        for symbol in MOVES:
            nxt = move(current, symbol)
            if nxt is None or nxt in parent or cornered_boxes(nxt):
                continue
            parent[nxt] = (current, symbol)
            if solved(nxt):
                moves = []
                while parent[nxt] is not None:
                    nxt, symbol = parent[nxt]
                    moves.append(symbol)
                return moves[::-1]
            queue.append(nxt)
    return None


def solve(task: dict) -> list[str] | None:
    """The BFS oracle: a shortest move list that puts every box on a goal, or None."""
    return solve_state(initial_state(task))


# ------------------------------------------------------------------------------ generator

def generate(seed: int, *, height: int = DEFAULT_SIZE, width: int = DEFAULT_SIZE,
             boxes: int = DEFAULT_BOXES, max_inner_walls: int = DEFAULT_MAX_INNER_WALLS,
             min_moves: int = DEFAULT_MIN_MOVES) -> dict:
    """A walled room with `boxes` boxes and as many goals, deterministic in `seed`.

    Inside the border: 0..max_inner_walls walls, goals, boxes (none on a goal) and the player
    on distinct random cells. A draw the oracle cannot solve, or solves in fewer than
    `min_moves` moves, is replaced by the next draw of the same stream.

    Raises:
        ValueError: bad sizes or counts, or no instance found in _MAX_ATTEMPTS draws.
    """
    if height < 3 or width < 3:
        raise ValueError(f"height={height}, width={width}: a walled room needs >= 3x3")
    if boxes < 1:
        raise ValueError(f"boxes={boxes}: need at least one box")
    if max_inner_walls < 0 or min_moves < 1:
        raise ValueError(f"max_inner_walls={max_inner_walls}, min_moves={min_moves}: need "
                         ">= 0 and >= 1")
    inner = [(r, c) for r in range(1, height - 1) for c in range(1, width - 1)]
    if 2 * boxes + 1 > len(inner):
        raise ValueError(f"boxes={boxes}: {len(inner)} inner cells cannot hold {boxes} boxes, "
                         f"{boxes} goals and the player")
    border = [(r, c) for r in range(height) for c in range(width) if (r, c) not in inner]
    rng = random.Random(f"{GAME}/{seed}")
    for _ in range(_MAX_ATTEMPTS):
        walls_count = rng.randint(0, min(max_inner_walls, len(inner) - 2 * boxes - 1))
        chosen = rng.sample(inner, walls_count + 2 * boxes + 1)
        walls, chosen = chosen[:walls_count], chosen[walls_count:]
        goals, box_cells, player = chosen[:boxes], chosen[boxes:2 * boxes], chosen[-1]
        room = Room(height, width, frozenset(border + walls), frozenset(goals))
        moves = solve_state(SokobanState(room, player, frozenset(box_cells)))
        if moves is not None and len(moves) >= min_moves:
            return {"game": GAME, "seed": seed, "height": height, "width": width,
                    "walls": [list(cell) for cell in sorted(room.walls)],
                    "goals": [list(cell) for cell in sorted(goals)],
                    "boxes": [list(cell) for cell in sorted(box_cells)],
                    "player": list(player), "solution": moves}
    raise ValueError(f"no solvable {height}x{width} room with {boxes} box(es) needing >= "
                     f"{min_moves} moves in {_MAX_ATTEMPTS} draws; lower min_moves or boxes")


def instance_key(task: dict) -> str:
    """What makes two tasks the same instance (for train/eval overlap checks)."""
    return repr((task["height"], task["width"], task["walls"], task["goals"], task["boxes"],
                 task["player"]))


# ------------------------------------------------------------------------------ rewards

def apply(state: SokobanState, action: Moves | None) -> SokobanState:
    return state if action is None else walk(state, action).state


def team_reward(before: SokobanState, action: Moves | None, after: SokobanState, turn: int,
                horizon: int) -> float:
    """r^team_k = 1 if every box is on a goal, else b_k / B (A.1.5)."""
    if solved(after):
        return 1.0
    return len(after.boxes & after.room.goals) / len(after.boxes)


def planner_local(before: SokobanState, action: Moves | None, after: SokobanState, turn: int,
                  horizon: int) -> LocalReward:
    """Planner local reward (A.1.5): 0.10·fmt + 0.45·leg + 0.45·dlk, mask."""
    if action is None:
        return local_reward(PLANNER_COEFFICIENTS, None)
    return local_reward(PLANNER_COEFFICIENTS, {
        "fmt": all(symbol in MOVES for symbol in action),
        "leg": walk(before, action).legal,
        "dlk": cornered_boxes(after) <= cornered_boxes(before)})


def tool_local(before: SokobanState, action: Moves | None, after: SokobanState, turn: int,
               horizon: int) -> LocalReward:
    """Tool (executor/simulator) local reward (A.1.5): 0.10·fmt + 0.30·exec + 0.60·pot."""
    if action is None:
        return local_reward(TOOL_COEFFICIENTS, None)
    return local_reward(TOOL_COEFFICIENTS, {
        "fmt": all(symbol in MOVES for symbol in action),
        "exec": walk(before, action).legal,
        "pot": potential(after) >= potential(before)})


# ------------------------------------------------------------------------------ text

_LEGEND = ("# wall, _ floor, O goal, X box, * box on a goal, P player, S player on a goal; "
           "U = row - 1, D = row + 1, L = column - 1, R = column + 1")


def render(state: SokobanState) -> str:
    """The room, one row per line (legend in _LEGEND)."""
    room, rows = state.room, []
    for r in range(room.height):
        row = ""
        for c in range(room.width):
            cell, goal = (r, c), (r, c) in room.goals
            row += ("#" if cell in room.walls else
                    ("*" if goal else "X") if cell in state.boxes else
                    ("S" if goal else "P") if cell == state.player else
                    "O" if goal else "_")
        rows.append(row)
    on_goal = len(state.boxes & room.goals)
    return "\n".join(rows) + f"\nBoxes on goals: {on_goal} of {len(state.boxes)}."


def describe(task: dict) -> str:
    """The task statement with the room (a Task prompt)."""
    return ("Push every box onto a goal. You move one cell per step and push a box by walking "
            "into it; a box cannot be pushed into a wall or another box, and cannot be "
            f"pulled. Legend: {_LEGEND}. Answer with an action list such as [U,R,D,L].\n"
            + render(initial_state(task)))


def describe_action(before: SokobanState, action: Moves | None, after: SokobanState) -> str:
    if action is None:
        return "no action list found: give moves as a list such as [U,R,D,L]"
    run = walk(before, action)
    stopped = "" if run.legal else f"; move {run.moved + 1} ({action[run.moved]}) is invalid " \
                                   "(unknown symbol, into a wall, or a blocked push)"
    stuck = len(cornered_boxes(after))
    warning = f"; {stuck} box(es) stuck in a corner off the goals" if stuck else ""
    return f"{run.moved} of {len(action)} move(s) ran{stopped}{warning}."


def initial_state(task: dict) -> SokobanState:
    room = Room(task["height"], task["width"], frozenset(map(tuple, task["walls"])),
                frozenset(map(tuple, task["goals"])))
    return SokobanState(room, tuple(task["player"]), frozenset(map(tuple, task["boxes"])))


def _parse(text: str, state: SokobanState, agent: str) -> Moves | None:
    return parse_moves(text, agent)


RULES = GameRules(name=GAME, lam=LAMBDA, initial_state=initial_state, parse=_parse, apply=apply,
                  solved=solved, team_reward=team_reward,
                  local_rewards={"planner": planner_local, "tool": tool_local},
                  render=render, describe_action=describe_action)
