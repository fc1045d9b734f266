"""Turn-based environments for AT-GRPO's grid tasks (DESIGN §14; AT-GRPO appendix A.1.3-A.1.5).

Owns the `Environment` protocol, the `StepResult` an action returns, the per-agent reward
record `LocalReward` and the λ-mix, the `GameRules` bundle a game module fills with pure
functions, the one engine `GridGameEnv` that plays any such bundle, the registry
`ENVIRONMENTS`, the answer parsers the games share, the seed ranges of the train and eval
splits (`split_seed`, `eval_tasks`, `train_tasks`), and `task_generator`, the adapter that
lets a generator-backed `actors.tasks.TaskSource` serve these games.

Roles. Every game has two agents, AT-GRPO's Tool agent and Plan agent (A.2.2 "Sudoku MAS
Workflow", A.3): `"tool"` writes a program whose printed output is a proposal (a grid, fill
steps or a move list); `"planner"` reads it and gives the final answer after a `####` line.
The paper calls the Sudoku planner "Reasoner" in A.1.3; it is the same role.

A turn k (1-based, horizon K) is one tool step then one planner step. The tool's proposal is
executed on a scratch copy of the committed state (the executor/simulator the paper's tool
rewards speak of) and never changes the game; the planner's answer is committed, advances the
turn and may end the episode (goal met, or k = K). Each step is scored at once on the state its
own action yields (simulated for the tool, committed for the planner), so each of the K tree
candidates of one agent at one turn gets its reward right after its step, which AT-GRPO's
agent- and turn-wise groups need.

Rewards (A.1.3-A.1.5): r^i_k = λ·r^team_k + (1-λ)·m^i_k·r^{i,loc}_k, with r^{i,loc}_k = Σ_l
c^i_l·s^i_{l,k}. A step carries the acting agent's local reward only (a float, not a per-role
dict): each agent's local terms depend on its own action alone.

Seeds. `generate(seed)` of each game seeds `random.Random(f"<game>/<seed>")` (a str is hashed
with SHA-512; int seeds would alias, Random(2**32 + 2) is Random(2)). Train seeds are
`TRAIN_SEEDS = [0, 2**62)` and eval seeds `EVAL_SEEDS = [2**62, 2**63)`; `split_seed(split, i)`
maps an index into its split's range and refuses an index that would leave it, so the seeds
never meet. Distinct seeds can still draw the same instance (6×6 Sokoban with one box has a
small instance space), so `eval_tasks` keeps the first distinct instances of the eval seeds
and `train_tasks` skips any of them (each game's `instance_key` says what "same" means).
Through `TaskSource` the streams are TaskSource's own (SHA-512 of "train/<seed>/<i>" vs
"eval/<i>") and its prompt-level overlap check does the skipping: a prompt, `describe(task)`,
depends on the instance only.

    python -c 'from actors.envs import ENVIRONMENTS as E, sudoku; env = E["sudoku"]();
    print(env.reset(sudoku.generate(0))); print(env.step("planner", "#### [[1,1,4]]"))'
"""
from __future__ import annotations

import copy
import itertools
import json
import random
import re
from dataclasses import dataclass, field
from typing import (TYPE_CHECKING, Any, Callable, ClassVar, Iterator, Protocol,
                    runtime_checkable)

if TYPE_CHECKING:
    from actors.workflows.base import Task

AGENTS = ("tool", "planner")  # the order they act in within a turn
DEFAULT_HORIZON = 4  # T = 4 turns (AT-GRPO §5.1)
FINAL_MARKER = "####"  # the planner's answer follows the last "####" (A.2.2)
_MAX_DRAWS_PER_TASK = 20  # eval seeds tried per distinct eval instance before giving up

SEEDS_PER_SPLIT = 2**62
TRAIN_SEEDS = range(0, SEEDS_PER_SPLIT)
EVAL_SEEDS = range(SEEDS_PER_SPLIT, 2 * SEEDS_PER_SPLIT)


def split_seed(split: str, index: int) -> int:
    """The generator seed of task `index` of a split: train i -> i, eval i -> 2**62 + i.

    Raises:
        ValueError: an unknown split, or an index outside [0, 2**62) (it would reach the other
            split's range).
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r}: use 'train' or 'eval'")
    if not 0 <= index < SEEDS_PER_SPLIT:
        raise ValueError(f"index={index}: must be in [0, 2**62) so train and eval seeds stay "
                         "apart")
    return index if split == "train" else SEEDS_PER_SPLIT + index


# ------------------------------------------------------------------------------ rewards

@dataclass(frozen=True)
class LocalReward:
    """One agent's local reward r^{i,loc}_k = Σ_l c^i_l·s^i_{l,k} and its mask m^i_k.

    `scores` and `coefficients` share their keys (the paper's sub-term names, e.g. "fmt",
    "legal", "prog"); the coefficients sum to 1. A masked step (mask 0) has all scores 0.
    """

    scores: dict[str, float]
    coefficients: dict[str, float]
    mask: int

    @property
    def value(self) -> float:
        """r^{i,loc}_k, before the mask."""
        return sum(self.coefficients[name] * self.scores[name] for name in self.coefficients)


def local_reward(coefficients: dict[str, float], scores: dict[str, float] | None) -> LocalReward:
    """A LocalReward from sub-scores; None (an action we could not parse) gives mask 0."""
    if scores is None:
        return LocalReward({name: 0.0 for name in coefficients}, dict(coefficients), 0)
    return LocalReward({name: float(scores[name]) for name in coefficients},
                       dict(coefficients), 1)


def mix_reward(lam: float, team: float, local: LocalReward) -> float:
    """r^i_k = λ·r^team_k + (1-λ)·m^i_k·r^{i,loc}_k (AT-GRPO A.1.3-A.1.5)."""
    return lam * team + (1.0 - lam) * local.mask * local.value


@dataclass(frozen=True)
class StepResult:
    """What one agent's action did.

    Attributes:
        observation: text for the next prompt: what the action did, then the board.
        team_reward: r^team_k of the state this action yields (simulated for the tool).
        local_reward: the acting agent's r^{i,loc}_k before its mask.
        mask: m^i_k (0 when the action could not be parsed: the local term drops out).
        reward: r^i_k, the λ-mix the learner uses for this action.
        done: the episode ended (goal met or the last turn's planner step).
        info: "agent", "turn", "scores" (the sub-scores s^i_{l,k}), "parsed", "committed".
    """

    observation: str
    team_reward: float
    local_reward: float
    mask: int
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------ protocol

@runtime_checkable
class Environment(Protocol):
    """A multi-agent game the workflow drives one action at a time (DESIGN §14)."""

    agents: tuple[str, ...]
    horizon: int

    def reset(self, task: dict) -> str:
        """Start the episode of a generated task dict; returns the first observation."""
        ...

    def step(self, agent: str, text: str) -> StepResult:
        """Apply one agent's raw text; malformed text is an observation, never an exception."""
        ...

    def clone(self) -> Environment:
        """An independent deep copy (a tree branch); stepping one never touches the other."""
        ...

    @property
    def observation(self) -> str:
        """The committed state as prompt text."""
        ...

    @property
    def solved(self) -> bool:
        """Whether the committed state meets the goal."""
        ...

    @property
    def done(self) -> bool:
        """Whether the episode has ended."""
        ...


@dataclass(frozen=True)
class GameRules:
    """A game as pure functions; `GridGameEnv` plays it.

    Every reward function takes (before, action, after, turn, horizon): the committed state
    before the action, the parsed action (None when unparseable), the state it yields, the
    1-based turn k and the horizon K.
    """

    name: str
    lam: float  # λ of the team-local mix
    initial_state: Callable[[dict], Any]  # task dict -> state
    parse: Callable[[str, Any, str], Any]  # (text, state, agent) -> action or None
    apply: Callable[[Any, Any], Any]  # (state, action or None) -> state
    solved: Callable[[Any], bool]
    team_reward: Callable[[Any, Any, Any, int, int], float]
    local_rewards: dict[str, Callable[[Any, Any, Any, int, int], LocalReward]]  # per agent
    render: Callable[[Any], str]  # state -> board text
    describe_action: Callable[[Any, Any, Any], str]  # (before, action, after) -> feedback


class GridGameEnv:
    """Plays one `GameRules` for `horizon` turns (the module docstring's turn model).

    A subclass only names its rules (`SudokuEnv.rules = sudoku.RULES`).
    """

    rules: ClassVar[GameRules]
    agents: tuple[str, ...] = AGENTS

    def __init__(self, horizon: int = DEFAULT_HORIZON) -> None:
        if horizon < 1:
            raise ValueError(f"horizon={horizon}: an episode needs at least one turn")
        self.horizon = horizon
        self.task: dict | None = None
        self.state: Any = None
        self.turn = 1  # k of the turn being played (1-based)
        self._done = False

    def reset(self, task: dict) -> str:
        if task.get("game") != self.rules.name:
            raise ValueError(f"task game {task.get('game')!r}: this environment plays "
                             f"{self.rules.name!r}")
        self.task = copy.deepcopy(task)
        self.state = self.rules.initial_state(self.task)
        self.turn, self._done = 1, False
        return self.observation

    def step(self, agent: str, text: str) -> StepResult:
        if self.state is None:
            raise RuntimeError("step before reset: call reset(task) first")
        if self._done:
            raise RuntimeError(f"step after the episode ended (turn {self.turn - 1} of "
                               f"{self.horizon}); reset or clone an unfinished episode")
        if agent not in self.agents:
            raise ValueError(f"agent {agent!r}: this game's agents are {self.agents}")
        rules, before, turn = self.rules, self.state, self.turn
        action = rules.parse(text, before, agent)
        after = rules.apply(before, action)
        team = rules.team_reward(before, action, after, turn, self.horizon)
        local = rules.local_rewards[agent](before, action, after, turn, self.horizon)
        committed = agent == "planner"  # the tool's proposal is only simulated
        done = False
        if committed:
            self.state = after
            done = rules.solved(after) or turn >= self.horizon
            self.turn, self._done = turn + 1, done
        return StepResult(
            observation=self._report(before, action, after, turn, committed, done),
            team_reward=team, local_reward=local.value, mask=local.mask,
            reward=mix_reward(rules.lam, team, local), done=done,
            info={"agent": agent, "turn": turn, "scores": dict(local.scores),
                  "parsed": action is not None, "committed": committed})

    def _report(self, before: Any, action: Any, after: Any, turn: int, committed: bool,
                done: bool) -> str:
        """A step's observation: what the action did, the board it yields, where play stands."""
        rules, solved = self.rules, self.rules.solved(after)
        if not committed:
            prefix = "Tool proposal (simulated only)"
            status = (f"The proposal would {'' if solved else 'not '}solve it. Turn {turn} of "
                      f"{self.horizon}.")
        else:
            prefix = "Planner's answer applied"
            status = ("Solved." if solved else "Episode over: out of turns." if done else
                      f"Turn {self.turn} of {self.horizon} next.")
        return (f"{prefix}: {rules.describe_action(before, action, after)}\n"
                f"{rules.render(after)}\n{status}")

    def clone(self) -> GridGameEnv:
        return copy.deepcopy(self)

    @property
    def observation(self) -> str:
        if self.state is None:
            raise RuntimeError("no observation before reset(task)")
        return f"{self.rules.render(self.state)}\nTurn {min(self.turn, self.horizon)} of " \
               f"{self.horizon}."

    @property
    def solved(self) -> bool:
        return self.state is not None and self.rules.solved(self.state)

    @property
    def done(self) -> bool:
        return self._done


# ------------------------------------------------------------------------------ parsing

def answer_text(text: str, agent: str) -> str | None:
    """The part of an agent's text that holds its answer.

    The planner must answer after a `####` (A.2.2 "FORMATTING IS MANDATORY"): no marker, no
    answer. The tool's text is its program's printed output; a `####` there is honoured too.
    """
    position = text.rfind(FINAL_MARKER)
    if position < 0:
        return None if agent == "planner" else text
    return text[position + len(FINAL_MARKER):]


def bracket_spans(text: str) -> list[str]:
    """The top-level balanced [...] substrings of `text`, in order (unclosed ones dropped)."""
    spans, depth, start = [], 0, 0
    for position, char in enumerate(text):
        if char == "[":
            if depth == 0:
                start = position
            depth += 1
        elif char == "]" and depth:
            depth -= 1
            if depth == 0:
                spans.append(text[start:position + 1])
    return spans


def answer_span(text: str, agent: str) -> str | None:
    """The bracketed answer: the planner's first list after `####`, the tool's last list."""
    answer = answer_text(text, agent)
    if answer is None:
        return None
    spans = bracket_spans(answer)
    if not spans:
        return None
    return spans[0] if agent == "planner" else spans[-1]


MOVES = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}  # (row, column) steps
_SEPARATORS = re.compile(r"[,\s]+")


def parse_moves(text: str, agent: str) -> tuple[str, ...] | None:
    """A move list such as [U,R,D,L] or ["U","R"] (A.3), upper-cased item by item.

    Items outside U/D/L/R are kept (they fail s_fmt); None when there is no bracketed list or
    it is empty (no action: mask 0).
    """
    span = answer_span(text, agent)
    if span is None:
        return None
    items = (item.strip().strip("'\"`").upper() for item in _SEPARATORS.split(span[1:-1]))
    return tuple(item for item in items if item) or None


# ------------------------------------------------------------------------------ registry

from actors.envs import plan_path, sokoban, sudoku  # noqa: E402  (they import the above)

GAMES = {module.RULES.name: module for module in (sudoku, plan_path, sokoban)}


class SudokuEnv(GridGameEnv):
    """4×4 Sudoku (AT-GRPO A.1.3); see actors/envs/sudoku.py."""

    rules = sudoku.RULES


class PlanPathEnv(GridGameEnv):
    """10×10 Plan-Path (AT-GRPO A.1.4); see actors/envs/plan_path.py."""

    rules = plan_path.RULES


class SokobanEnv(GridGameEnv):
    """6×6 Sokoban (AT-GRPO A.1.5); see actors/envs/sokoban.py."""

    rules = sokoban.RULES


ENVIRONMENTS: dict[str, type[GridGameEnv]] = {
    "sudoku": SudokuEnv, "plan_path": PlanPathEnv, "sokoban": SokobanEnv}


def build_environment(name: str, horizon: int = DEFAULT_HORIZON) -> GridGameEnv:
    """A registered environment by name."""
    if name not in ENVIRONMENTS:
        raise ValueError(f"environment {name!r}: registered ones are {sorted(ENVIRONMENTS)}")
    return ENVIRONMENTS[name](horizon)


def eval_tasks(game: str, size: int, **params: Any) -> list[dict]:
    """The eval set: the first `size` distinct instances drawn from EVAL_SEEDS, in seed order.

    A small game (6×6 Sokoban with one box) repeats instances across seeds, so disjoint seed
    ranges alone do not make disjoint splits; `train_tasks` skips these instances.
    """
    module, tasks, keys = _game(game), [], set()
    for index in range(_MAX_DRAWS_PER_TASK * max(size, 1)):
        if len(tasks) == size:
            return tasks
        task = module.generate(split_seed("eval", index), **params)
        if module.instance_key(task) not in keys:
            keys.add(module.instance_key(task))
            tasks.append(task)
    raise ValueError(f"{game}: fewer than {size} distinct eval instances in "
                     f"{_MAX_DRAWS_PER_TASK * size} seeds; lower the eval size")


def train_tasks(game: str, eval_size: int, start: int = 0, **params: Any) -> Iterator[dict]:
    """Train instances from TRAIN_SEEDS (index `start` on), skipping every instance of the
    eval set `eval_tasks(game, eval_size, **params)`: the paper's "verify there is no overlap"
    (AT-GRPO §5.1)."""
    module = _game(game)
    held_out = {module.instance_key(task) for task in eval_tasks(game, eval_size, **params)}
    for index in itertools.count(start):
        task = module.generate(split_seed("train", index), **params)
        if module.instance_key(task) not in held_out:
            yield task


def _game(game: str) -> Any:
    if game not in GAMES:
        raise ValueError(f"game {game!r}: registered ones are {sorted(GAMES)}")
    return GAMES[game]


def task_generator(game: str, **params: Any) -> Callable[[random.Random, int], Task]:
    """A `TaskSource` generator (`make_task(rng, index) -> Task`) for one game.

    The task's seed is drawn from TaskSource's per-task rng (itself split-keyed), so
    `generate(task.extra["task"]["seed"], **params)` rebuilds it. The prompt is the puzzle's
    rendering (TaskSource compares prompts to keep train off the eval set); `truth` is the
    oracle's solution as JSON; `extra["task"]` is the task dict `reset` takes.
    """
    module = _game(game)
    module.generate(0, **params)  # a bad parameter fails here, not in a rollout actor

    def make_task(rng: random.Random, index: int) -> Task:
        from actors.workflows.base import Task  # here: actors.workflows.base imports tasks

        task = module.generate(rng.randrange(SEEDS_PER_SPLIT), **params)
        return Task(task_id=f"{game}-{index}", prompt=module.describe(task),
                    truth=json.dumps(task["solution"]), extra={"game": game, "task": task})

    return make_task
