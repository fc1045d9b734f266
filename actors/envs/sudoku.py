"""N×N Sudoku (4×4, 2×2 boxes by default): generator, oracle, parser, rewards (AT-GRPO A.1.3).

An action is a completed grid (JSON array of N arrays of N ints; 0 = leave the cell as it is)
or a JSON list of fill steps [r, c, v] with 1-based r, c (A.2.2 "Sudoku MAS Workflow"); Python
tuples are read too. Edits are applied in order: a clue never changes (an edit that would
change one is rejected), a filled non-clue cell may be overwritten, cells are never cleared.

Rewards, A.1.3 (λ_sudoku = 0.60), with G_{k-1}, G_k the grids before and after the action:
    r^team_k = 1{k = T, Solved(G_k)}; T is the terminal turn: solved, or k = K (solving ends
        the episode, so a solved grid always is terminal and this is 1{Solved(G_k)}).
    planner: 0.15·s_fmt + 0.55·s_legal + 0.30·s_prog
        s_fmt   = 1{a grid or step list whose values lie in 1..N (0 in a grid) and indices in
                  bounds}
        s_legal = 1{no row/column/box duplicates in G_k}
        s_prog  = (1/N²)·#{(r,c): G_{k-1}[r,c] = 0, G_k[r,c] ≠ 0}
        m       = 1{the text holds a grid (not all 0) or a non-empty step list}
    tool: 0.10·s_fmt + 0.20·s_exec + 0.70·s_san
        s_fmt   = as the planner's (schema valid, values in [1,N], indices in bounds)
        s_exec  = 1{no edit failed: none out of range or bounds, none changing a clue}
        s_san   = 1{at least one edit changed a cell, and every cell an edit set has no
                  duplicate in its row, column or box of G_k}
        m       = as the planner's

    python -c 'from actors.envs import sudoku; t = sudoku.generate(7); print(sudoku.describe(t))'
"""
from __future__ import annotations

import ast
import json
import math
import random
from dataclasses import dataclass

from actors.envs import GameRules, LocalReward, answer_span, local_reward

GAME = "sudoku"
LAMBDA = 0.60  # λ_sudoku
PLANNER_COEFFICIENTS = {"fmt": 0.15, "legal": 0.55, "prog": 0.30}
TOOL_COEFFICIENTS = {"fmt": 0.10, "exec": 0.20, "san": 0.70}
DEFAULT_SIZE = 4
DEFAULT_BLANKS = 8  # half the 4×4 board (the paper does not say)
EASY_BLANKS = 4  # the "easy" setting
_MAX_ATTEMPTS = 100  # full grids tried before a blank count is declared impossible
_MAX_ANSWER_CHARS = 50_000  # a longer bracketed answer is not read (a 9×9 grid is ~200)

Grid = tuple[tuple[int, ...], ...]
Edit = tuple[int, int, int]  # (r, c, v) as written: 1-based r, c


@dataclass(frozen=True)
class SudokuState:
    """The board: `grid` (0 = blank) and `givens`, the puzzle's clues that never change."""

    grid: Grid
    givens: Grid

    @property
    def size(self) -> int:
        return len(self.grid)


@dataclass(frozen=True)
class SudokuAction:
    """A parsed action: the edits in order; `kind` is "grid" or "steps"."""

    edits: tuple[Edit, ...]
    kind: str


# ------------------------------------------------------------------------------ board rules

def box_size(size: int) -> int:
    """The side of a sub-grid: √N (N must be a square: 4, 9, ...)."""
    box = math.isqrt(size)
    if size < 4 or box * box != size:
        raise ValueError(f"size={size}: Sudoku needs a square size >= 4 (4, 9, 16)")
    return box


def _units(size: int) -> list[list[tuple[int, int]]]:
    """Every row, column and box as a list of cells."""
    box = box_size(size)
    rows = [[(r, c) for c in range(size)] for r in range(size)]
    cols = [[(r, c) for r in range(size)] for c in range(size)]
    boxes = [[(br + r, bc + c) for r in range(box) for c in range(box)]
             for br in range(0, size, box) for bc in range(0, size, box)]
    return rows + cols + boxes


def duplicated_cells(grid: Grid) -> set[tuple[int, int]]:
    """Cells whose non-zero value repeats in their row, column or box."""
    bad: set[tuple[int, int]] = set()
    for unit in _units(len(grid)):
        seen: dict[int, list[tuple[int, int]]] = {}
        for r, c in unit:
            if grid[r][c]:
                seen.setdefault(grid[r][c], []).append((r, c))
        bad.update(cell for cells in seen.values() if len(cells) > 1 for cell in cells)
    return bad


def solved(state: SudokuState) -> bool:
    """Solved(·): every cell filled, no row/column/box duplicates (clues are kept by apply)."""
    return all(all(row) for row in state.grid) and not duplicated_cells(state.grid)


def _candidates(grid: list[list[int]], r: int, c: int, box: int) -> list[int]:
    used = set(grid[r]) | {grid[i][c] for i in range(len(grid))}
    br, bc = r - r % box, c - c % box
    used |= {grid[br + i][bc + j] for i in range(box) for j in range(box)}
    return [v for v in range(1, len(grid) + 1) if v not in used]


def _search(grid: list[list[int]], box: int, limit: int, found: list[Grid],
            rng: random.Random | None = None) -> None:
    """Backtracking on the blank with fewest candidates; stops at `limit` solutions."""
    best = None
    for r, row in enumerate(grid):
        for c, value in enumerate(row):
            if value == 0:
                options = _candidates(grid, r, c, box)
                if best is None or len(options) < len(best[2]):
                    best = (r, c, options)
    if best is None:
        found.append(tuple(tuple(row) for row in grid))
        return
    r, c, options = best
    if rng is not None:
        rng.shuffle(options)
    for value in options:
        grid[r][c] = value
        _search(grid, box, limit, found, rng)
        grid[r][c] = 0
        if len(found) >= limit:
            return


def count_solutions(puzzle: Grid | list[list[int]], limit: int = 2) -> int:
    """How many completions the puzzle has, counting up to `limit`."""
    grid = [list(row) for row in puzzle]
    if duplicated_cells(tuple(map(tuple, grid))):
        return 0
    found: list[Grid] = []
    _search(grid, box_size(len(grid)), limit, found)
    return len(found)


def solve(task: dict) -> list[list[int]] | None:
    """The backtracking oracle: a completion of task["puzzle"], or None if it has none."""
    grid = [list(row) for row in task["puzzle"]]
    if duplicated_cells(tuple(map(tuple, grid))):
        return None
    found: list[Grid] = []
    _search(grid, box_size(len(grid)), 1, found)
    return [list(row) for row in found[0]] if found else None


# ------------------------------------------------------------------------------ generator

def generate(seed: int, *, size: int = DEFAULT_SIZE, blanks: int = DEFAULT_BLANKS,
             unique: bool = True) -> dict:
    """A puzzle with `blanks` blank cells, deterministic in `seed` (see actors.envs for ranges).

    A random full grid (randomised backtracking) loses cells in a random order; with `unique`
    a removal is kept only if the puzzle still has exactly one solution, and a grid that
    cannot reach `blanks` that way is replaced by the next one from the same stream.

    Raises:
        ValueError: a size that is not a square >= 4, or a blank count out of reach.
    """
    box = box_size(size)
    if not 1 <= blanks < size * size:
        raise ValueError(f"blanks={blanks}: must be in [1, {size * size - 1}] for size {size}")
    rng = random.Random(f"{GAME}/{seed}")
    for _ in range(_MAX_ATTEMPTS):
        found: list[Grid] = []
        _search([[0] * size for _ in range(size)], box, 1, found, rng)
        solution = found[0]
        puzzle = [list(row) for row in solution]
        cells = [(r, c) for r in range(size) for c in range(size)]
        rng.shuffle(cells)
        removed = 0
        for r, c in cells:
            if removed == blanks:
                break
            puzzle[r][c] = 0
            if unique and count_solutions(puzzle, 2) != 1:
                puzzle[r][c] = solution[r][c]
            else:
                removed += 1
        if removed == blanks:
            return {"game": GAME, "seed": seed, "size": size, "blanks": blanks,
                    "puzzle": puzzle, "solution": [list(row) for row in solution]}
    raise ValueError(f"blanks={blanks}: no uniquely solvable {size}x{size} puzzle with that "
                     f"many blanks in {_MAX_ATTEMPTS} grids; use fewer blanks or unique=False")


def instance_key(task: dict) -> str:
    """What makes two tasks the same instance (for train/eval overlap checks)."""
    return json.dumps(task["puzzle"])


# ------------------------------------------------------------------------------ parsing

def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse(text: str, state: SudokuState, agent: str) -> SudokuAction | None:
    """The action in an agent's text (see the module docstring), or None when it has none.

    None (mask 0) means no JSON grid of N rows of N ints and no non-empty list of int triples;
    values or indices out of range still parse (s_fmt = 0 then).
    """
    span = answer_span(text, agent)
    if span is None or len(span) > _MAX_ANSWER_CHARS:
        return None
    try:
        value = json.loads(span)
    except (ValueError, RecursionError):
        try:
            value = ast.literal_eval(span)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
    if not isinstance(value, (list, tuple)) or not value:
        return None
    rows = [list(item) if isinstance(item, (list, tuple)) else None for item in value]
    if any(row is None or not all(_is_int(x) for x in row) for row in rows):
        return None
    size = state.size
    if len(rows) == size and all(len(row) == size for row in rows):
        edits = tuple((r + 1, c + 1, v) for r, row in enumerate(rows)
                      for c, v in enumerate(row) if v != 0)
        return SudokuAction(edits, "grid") if edits else None  # an all-blank grid: no action
    if all(len(row) == 3 for row in rows):
        return SudokuAction(tuple((r, c, v) for r, c, v in rows), "steps")
    return None


def _in_range(edit: Edit, size: int) -> bool:
    r, c, v = edit
    return 1 <= r <= size and 1 <= c <= size and 1 <= v <= size


def apply(state: SudokuState, action: SudokuAction | None) -> SudokuState:
    """G_k: the edits applied in order; out-of-range edits and clue changes are skipped."""
    if action is None:
        return state
    grid = [list(row) for row in state.grid]
    for r, c, v in _applied_edits(state, action):
        grid[r - 1][c - 1] = v
    return SudokuState(tuple(map(tuple, grid)), state.givens)


def _applied_edits(state: SudokuState, action: SudokuAction) -> list[Edit]:
    """The edits that change the board: in range, and not on a clue."""
    return [(r, c, v) for r, c, v in action.edits
            if _in_range((r, c, v), state.size) and not state.givens[r - 1][c - 1]]


def _failed_edits(state: SudokuState, action: SudokuAction) -> int:
    """Edits that raise when applied: out of range or bounds, or changing a clue."""
    failed = 0
    for r, c, v in action.edits:
        if not _in_range((r, c, v), state.size):
            failed += 1
        elif state.givens[r - 1][c - 1] not in (0, v):
            failed += 1
    return failed


# ------------------------------------------------------------------------------ rewards

def team_reward(before: SudokuState, action: SudokuAction | None, after: SudokuState,
                turn: int, horizon: int) -> float:
    """r^team_k = 1{k = T, Solved(G_k)} (A.1.3), T the terminal turn (solved, or k = K)."""
    terminal = solved(after) or turn >= horizon
    return float(terminal and solved(after))


def planner_local(before: SudokuState, action: SudokuAction | None, after: SudokuState,
                  turn: int, horizon: int) -> LocalReward:
    """Reasoner/planner local reward (A.1.3): 0.15·fmt + 0.55·legal + 0.30·prog, mask."""
    if action is None:
        return local_reward(PLANNER_COEFFICIENTS, None)
    size = before.size
    filled = sum(1 for r in range(size) for c in range(size)
                 if before.grid[r][c] == 0 and after.grid[r][c] != 0)
    return local_reward(PLANNER_COEFFICIENTS, {
        "fmt": all(_in_range(edit, size) for edit in action.edits),
        "legal": not duplicated_cells(after.grid),
        "prog": filled / (size * size)})


def tool_local(before: SudokuState, action: SudokuAction | None, after: SudokuState,
               turn: int, horizon: int) -> LocalReward:
    """Tool (executor) local reward (A.1.3): 0.10·fmt + 0.20·exec + 0.70·san, mask."""
    if action is None:
        return local_reward(TOOL_COEFFICIENTS, None)
    size = before.size
    # an edit that writes the value already there changes nothing and earns no s_san
    set_cells = {(r - 1, c - 1) for r, c, v in _applied_edits(before, action)
                 if before.grid[r - 1][c - 1] != v}
    return local_reward(TOOL_COEFFICIENTS, {
        "fmt": all(_in_range(edit, size) for edit in action.edits),
        "exec": _failed_edits(before, action) == 0,
        "san": bool(set_cells) and not set_cells & duplicated_cells(after.grid)})


# ------------------------------------------------------------------------------ text

def render(state: SudokuState) -> str:
    """The board, one row per line, dots for blanks (A.2.2 "dots denote blanks")."""
    return "\n".join(" ".join(str(v) if v else "." for v in row) for row in state.grid)


def describe(task: dict) -> str:
    """The task statement with the puzzle (a Task prompt)."""
    size = task["size"]
    box = box_size(size)
    state = initial_state(task)
    return (f"Solve the {size}x{size} Sudoku. Fill digits 1..{size}; rows, columns and "
            f"{box}x{box} sub-grids must have unique digits.\nCurrent puzzle (dots denote "
            f"blanks):\n{render(state)}")


def describe_action(before: SudokuState, action: SudokuAction | None,
                    after: SudokuState) -> str:
    if action is None:
        return ("no answer found: give a JSON grid of the full board or a JSON list of "
                "[row, col, value] fill steps (1-based)")
    failed = _failed_edits(before, action)
    clashes = len(duplicated_cells(after.grid))
    kind = "a full grid" if action.kind == "grid" else "fill steps"
    return (f"{len(action.edits)} edit(s) as {kind}, {failed} rejected (out of range "
            f"or changing a clue); {clashes} cell(s) now clash with another in a row, column "
            "or sub-grid.")


def initial_state(task: dict) -> SudokuState:
    puzzle = tuple(tuple(row) for row in task["puzzle"])
    box_size(len(puzzle))
    return SudokuState(puzzle, puzzle)


RULES = GameRules(name=GAME, lam=LAMBDA, initial_state=initial_state, parse=parse, apply=apply,
                  solved=solved, team_reward=team_reward,
                  local_rewards={"planner": planner_local, "tool": tool_local},
                  render=render, describe_action=describe_action)
