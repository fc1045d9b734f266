"""Plan-Path on an H×W grid (10×10 by default): generator, BFS oracle, rewards (AT-GRPO A.1.4).

An action is a move list such as [U,R,D,L] (A.3); U/D/L/R move one cell up (row - 1), down,
left (column - 1) or right. Moves run in order and stop at the first invalid one (an unknown
symbol, leaving the grid, or entering an obstacle; the agent keeps the cell it reached) or
when the goal is reached (later moves are ignored).

Rewards, A.1.4 (λ_plan = 0.50), d = Manhattan distance to the goal, d_0 = max(1, d at start):
    r^team_k = 1 if at the goal at k, else max(0, (d_{k-1} - d_k) / d_0)
    planner: 0.20·s_fmt + 0.40·s_leg + 0.40·s_sp
        s_fmt = 1{every item is one of U, D, L, R}
        s_leg = 1{every move runs: next cell in bounds and not an obstacle}
        s_sp  = 1{every move is SPNext from the cell it is taken in: the list is a prefix of
                a shortest path from s_{k-1} to the goal (a move after the goal is not)}
        m     = 1{a non-empty bracketed list} (the map and the BFS oracle always exist)
    tool: 0.10·s_fmt + 0.40·s_exec + 0.50·s_shape
        s_fmt   = as the planner's
        s_exec  = 1{no invalid move and at least one move ran ("simulation advances")}
        s_shape = 1{φ_k >= φ_{k-1}}, φ = -d (the potential does not decrease)
        m       = as the planner's
The paper writes the planner's scores for one action a_k; an agent answers with a list, so
s_leg and s_sp ask it of every move of the list.

    python -c 'from actors.envs import plan_path as p; print(p.describe(p.generate(3)))'
"""
from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

from actors.envs import MOVES, GameRules, LocalReward, local_reward, parse_moves

GAME = "plan_path"
LAMBDA = 0.50  # λ_plan
PLANNER_COEFFICIENTS = {"fmt": 0.20, "leg": 0.40, "sp": 0.40}
TOOL_COEFFICIENTS = {"fmt": 0.10, "exec": 0.40, "shape": 0.50}
DEFAULT_SIZE = 10
DEFAULT_OBSTACLE_RATIO = 0.2  # share of cells that are obstacles (the paper does not say)
DEFAULT_MIN_PATH_LENGTH = 4  # shorter instances are redrawn (the paper does not say)
_MAX_ATTEMPTS = 1000

Cell = tuple[int, int]
Moves = tuple[str, ...]


@dataclass(frozen=True)
class PathMap:
    """The static map: size, obstacle cells, start and goal."""

    height: int
    width: int
    walls: frozenset[Cell]
    start: Cell
    goal: Cell

    def passable(self, cell: Cell) -> bool:
        r, c = cell
        return 0 <= r < self.height and 0 <= c < self.width and cell not in self.walls


@dataclass(frozen=True)
class PathState:
    map: PathMap
    position: Cell


@dataclass(frozen=True)
class Walk:
    """A move list run from a state: where it ends, whether every move ran, how many did."""

    position: Cell
    legal: bool
    moved: int


def _step(cell: Cell, symbol: str) -> Cell:
    dr, dc = MOVES[symbol]
    return cell[0] + dr, cell[1] + dc


def walk(state: PathState, moves: Moves) -> Walk:
    """Run `moves` from the state's position (the module docstring's rules)."""
    position, moved = state.position, 0
    for symbol in moves:
        if position == state.map.goal:
            break
        if symbol not in MOVES or not state.map.passable(_step(position, symbol)):
            return Walk(position, False, moved)
        position, moved = _step(position, symbol), moved + 1
    return Walk(position, True, moved)


def manhattan(a: Cell, b: Cell) -> int:
    return abs(a[0] - b[0]) + abs(a[1] - b[1])


def distances_to_goal(path_map: PathMap) -> dict[Cell, int]:
    """BFS distance from every reachable cell to the goal (four-neighbourhood)."""
    distance = {path_map.goal: 0}
    queue = deque([path_map.goal])
    while queue:
        cell = queue.popleft()
        for symbol in MOVES:
            nxt = _step(cell, symbol)
            if path_map.passable(nxt) and nxt not in distance:
                distance[nxt] = distance[cell] + 1
                queue.append(nxt)
    return distance


def shortest_path(path_map: PathMap, source: Cell | None = None) -> list[str] | None:
    """A shortest move list from `source` (default: start) to the goal, or None."""
    distance = distances_to_goal(path_map)
    position = path_map.start if source is None else source
    if position not in distance:
        return None
    moves = []
    while position != path_map.goal:
        symbol = next(s for s in MOVES if distance.get(_step(position, s)) ==
                      distance[position] - 1)
        moves.append(symbol)
        position = _step(position, symbol)
    return moves


def solve(task: dict) -> list[str] | None:
    """The BFS oracle: a shortest move list from start to goal, or None if unreachable."""
    return shortest_path(_map(task))


# ------------------------------------------------------------------------------ generator

def generate(seed: int, *, height: int = DEFAULT_SIZE, width: int = DEFAULT_SIZE,
             obstacle_ratio: float = DEFAULT_OBSTACLE_RATIO,
             min_path_length: int = DEFAULT_MIN_PATH_LENGTH) -> dict:
    """A map with round(obstacle_ratio·H·W) obstacles, deterministic in `seed`.

    Obstacles, start and goal are distinct random cells; a draw whose goal is unreachable or
    nearer than `min_path_length` moves is replaced by the next draw of the same stream.

    Raises:
        ValueError: a bad size or ratio, or no instance found in _MAX_ATTEMPTS draws.
    """
    if height < 1 or width < 1 or height * width < 2:
        raise ValueError(f"height={height}, width={width}: the grid needs at least 2 cells")
    if not 0 <= obstacle_ratio < 1:
        raise ValueError(f"obstacle_ratio={obstacle_ratio}: must be in [0, 1)")
    if min_path_length < 1:
        raise ValueError(f"min_path_length={min_path_length}: must be >= 1")
    walls_count = round(obstacle_ratio * height * width)
    if walls_count + 2 > height * width:
        raise ValueError(f"obstacle_ratio={obstacle_ratio}: leaves no room for start and goal")
    rng = random.Random(f"{GAME}/{seed}")
    cells = [(r, c) for r in range(height) for c in range(width)]
    for _ in range(_MAX_ATTEMPTS):
        chosen = rng.sample(cells, walls_count + 2)
        path_map = PathMap(height, width, frozenset(chosen[:walls_count]),
                           chosen[walls_count], chosen[walls_count + 1])
        moves = shortest_path(path_map)
        if moves is not None and len(moves) >= min_path_length:
            return {"game": GAME, "seed": seed, "height": height, "width": width,
                    "walls": [list(cell) for cell in sorted(path_map.walls)],
                    "start": list(path_map.start), "goal": list(path_map.goal),
                    "solution": moves}
    raise ValueError(f"no {height}x{width} map with obstacle_ratio={obstacle_ratio} and a path "
                     f"of >= {min_path_length} moves in {_MAX_ATTEMPTS} draws; lower either")


def instance_key(task: dict) -> str:
    """What makes two tasks the same instance (for train/eval overlap checks)."""
    return repr((task["height"], task["width"], task["walls"], task["start"], task["goal"]))


# ------------------------------------------------------------------------------ rewards

def apply(state: PathState, action: Moves | None) -> PathState:
    return state if action is None else PathState(state.map, walk(state, action).position)


def solved(state: PathState) -> bool:
    return state.position == state.map.goal


def team_reward(before: PathState, action: Moves | None, after: PathState, turn: int,
                horizon: int) -> float:
    """r^team_k = 1 at the goal, else max(0, (d_{k-1} - d_k)/d_0) (A.1.4)."""
    if solved(after):
        return 1.0
    goal = before.map.goal
    d0 = max(1, manhattan(before.map.start, goal))
    return max(0.0, (manhattan(before.position, goal) - manhattan(after.position, goal)) / d0)


def on_shortest_path(state: PathState, moves: Moves) -> bool:
    """SPNext for every move in turn: the list is a prefix of a shortest path to the goal."""
    distance = distances_to_goal(state.map)
    position = state.position
    for symbol in moves:
        if position == state.map.goal or symbol not in MOVES:
            return False
        nxt = _step(position, symbol)
        if not state.map.passable(nxt) or distance.get(nxt) != distance.get(position, 0) - 1:
            return False
        position = nxt
    return True


def planner_local(before: PathState, action: Moves | None, after: PathState, turn: int,
                  horizon: int) -> LocalReward:
    """Planner local reward (A.1.4): 0.20·fmt + 0.40·leg + 0.40·sp, mask."""
    if action is None:
        return local_reward(PLANNER_COEFFICIENTS, None)
    return local_reward(PLANNER_COEFFICIENTS, {
        "fmt": all(symbol in MOVES for symbol in action),
        "leg": walk(before, action).legal,
        "sp": on_shortest_path(before, action)})


def tool_local(before: PathState, action: Moves | None, after: PathState, turn: int,
               horizon: int) -> LocalReward:
    """Tool (executor/simulator) local reward (A.1.4): 0.10·fmt + 0.40·exec + 0.50·shape."""
    if action is None:
        return local_reward(TOOL_COEFFICIENTS, None)
    run = walk(before, action)
    goal = before.map.goal
    return local_reward(TOOL_COEFFICIENTS, {
        "fmt": all(symbol in MOVES for symbol in action),
        "exec": run.legal and run.moved > 0,
        "shape": -manhattan(after.position, goal) >= -manhattan(before.position, goal)})


# ------------------------------------------------------------------------------ text

def render(state: PathState) -> str:
    """The grid (A you, G goal, # obstacle, . free) and the coordinates of you and the goal."""
    path_map = state.map
    rows = []
    for r in range(path_map.height):
        row = []
        for c in range(path_map.width):
            cell = (r, c)
            row.append("A" if cell == state.position else "G" if cell == path_map.goal
                       else "#" if cell in path_map.walls else ".")
        rows.append(" ".join(row))
    return ("\n".join(rows) + f"\nYou are at (row {state.position[0]}, column "
            f"{state.position[1]}); the goal is at (row {path_map.goal[0]}, column "
            f"{path_map.goal[1]}).")


def describe(task: dict) -> str:
    """The task statement with the map (a Task prompt)."""
    return (f"Find a path on the {task['height']}x{task['width']} grid from your position A to "
            "the goal G. Rows count from 0 at the top, columns from 0 at the left; U moves to "
            "row - 1, D to row + 1, L to column - 1, R to column + 1. # cells are obstacles; "
            "you may not leave the grid. Answer with an action list such as [U,R,D,L].\n"
            + render(initial_state(task)))


def describe_action(before: PathState, action: Moves | None, after: PathState) -> str:
    if action is None:
        return "no action list found: give moves as a list such as [U,R,D,L]"
    run = walk(before, action)
    stopped = "" if run.legal else f"; move {run.moved + 1} ({action[run.moved]}) is invalid " \
                                   "(unknown symbol, off the grid or into an obstacle)"
    return f"{run.moved} of {len(action)} move(s) ran{stopped}."


def _map(task: dict) -> PathMap:
    return PathMap(task["height"], task["width"], frozenset(map(tuple, task["walls"])),
                   tuple(task["start"]), tuple(task["goal"]))


def initial_state(task: dict) -> PathState:
    path_map = _map(task)
    return PathState(path_map, path_map.start)


def _parse(text: str, state: PathState, agent: str) -> Moves | None:
    return parse_moves(text, agent)


RULES = GameRules(name=GAME, lam=LAMBDA, initial_state=initial_state, parse=_parse, apply=apply,
                  solved=solved, team_reward=team_reward,
                  local_rewards={"planner": planner_local, "tool": tool_local},
                  render=render, describe_action=describe_action)
