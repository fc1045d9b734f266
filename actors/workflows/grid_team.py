"""sudoku, plan_path, sokoban: AT-GRPO's Tool Agent and Plan Agent on the grid games.

AT-GRPO appendix A.1.3-A.1.5 (rewards, in actors/envs), A.2.2 and A.3 (prompts, in
actors/workflows/grid_prompts.py), §4.1 and Algorithm 1 (tree sampling). One module
registers the three games; they differ only in their environment and prompt texts.

A turn k = 1..T (T = `horizon`, the paper's K = 4 turns; actors/envs documents the turn model):
  1. tool: K = `workflow.group_size` candidates from one prompt (the task, the current state,
     the env context as JSON, the history of earlier turns). Each candidate's ```python block
     runs in the sandbox, in a fresh workspace holding the env context as `state.json`; its
     printed output (stdout) is stepped on a clone of the environment: `step("tool", stdout)`
     simulates the proposal and changes nothing.
  2. planner: K candidates from one prompt holding the kept tool candidate's code, its
     execution output and the environment's verdict on its proposal; each is stepped on its
     own clone, which commits the answer given after `####`.
Each step continues from its best candidate (highest λ-mixed reward r^i_k, ties to the first:
Alg. 1 line 13): `episode.keep(best)`, the next group's `parent_branch` is the dotted path of
kept candidates (DESIGN §4: "0.2" = tool candidate 0, then planner candidate 2), and the kept
planner candidate's clone becomes the environment. The episode ends when the planner's answer
solves the game, or after turn T. A round has at most T groups per agent (`groups_per_round`);
an episode solved early releases the rest (DESIGN §14).

Rewards. Every candidate's row gets reward_team = r^team_k and reward_local = r^{i,loc}_k, or
null where the mask m^i_k = 0 (the components `at_grpo` with `team_lambda` mixes,
learners/advantages.py), and its meta the step's figures (`env_reward`, `env_mask`, `kept`).
`reward_source` decides who writes the row's `reward`, and so makes it READY, exactly once:
  inline (default): the workflow writes reward = r^i_k, the environment's λ-mix. The row is
      READY when it reaches the buffer and is never sent to the coach (only `Episode.coach`
      sends rows there), so `coach.kind` plays no part in training.
  coach: no inline `reward`; every candidate goes to the coach with the step's figures in its
      context. `rule_score` (coach.kind: rule) returns the recorded r^i_k, so the rule coach
      makes up no score of its own; an LLM coach's score lands in `reward` and `coach_score`
      (`advantage: grpo` trains on it; `at_grpo` still mixes the components).
A row whose sandbox failed (not the model's code) is FAILED `sandbox` by CodeTool, gets no
reward and is never kept. Every row's `outcome` is the episode's success.

Small models: `tool_prefix: "```python\\n"` opens the code block (prompt tokens, not trained),
`planner_prefix: "#### "` opens the answer.

    python scripts/launch_async.py --config configs/sudoku_cpu.yaml
"""
from __future__ import annotations

import asyncio
import json
import math
import random
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

from actors.envs import (AGENTS, GAMES, GridGameEnv, StepResult, answer_text,
                         build_environment, task_generator)
from actors.episode import Action
from actors.sandbox import SandboxConfig, python_blocks
from actors.workflows import grid_prompts as prompts
from actors.workflows.base import Task
from actors.workflows.registry import register
from actors.workflows.tools import CodeTool, ToolResult
from buffers.schema import tree_path

REWARD_SOURCES = ("inline", "coach")
_ANSWER_CHARS = 300  # of each earlier answer shown in the history


@dataclass
class GridTeamConfig:
    """Settings every grid game shares (`workflow.params`)."""

    horizon: int = 4  # T: turns per episode, each one tool step then one planner step (§5.1)
    tool_tokens: int = 4096  # max new tokens of a tool reply (A.2.1: 4096 response tokens)
    planner_tokens: int = 4096  # max new tokens of a planner reply
    # opens every tool reply (prompt tokens, never trained); "```python\n" makes a small model
    # write code at once (the closing fence then ends the reply)
    tool_prefix: str = ""
    planner_prefix: str = ""  # opens every planner reply, e.g. "#### " for a small model
    observation_chars: int = 1500  # tool output and the proposal's verdict shown to the planner
    history_chars: int = 3000  # earlier turns shown in later prompts (oldest dropped first)
    reward_source: str = "inline"  # "inline": rows carry r^i_k; "coach": the coach scores them
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)  # where the tool's code runs

    def __post_init__(self) -> None:
        for name in ("horizon", "tool_tokens", "planner_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"workflow.params.{name}={getattr(self, name)}: must be >= 1")
        for name in ("observation_chars", "history_chars"):
            if getattr(self, name) < 40:
                raise ValueError(f"workflow.params.{name}={getattr(self, name)}: must be >= 40 "
                                 "characters (a verdict line needs that much)")
        if self.reward_source not in REWARD_SOURCES:
            raise ValueError(f"workflow.params.reward_source={self.reward_source!r}: use one of "
                             f"{list(REWARD_SOURCES)}")

    def game_params(self) -> dict[str, Any]:
        """Keyword arguments of the game's `generate(seed, **params)`."""
        return {}

    def _check_game(self, game: str) -> None:
        """Generate one instance now, so a bad game parameter fails at config load."""
        try:
            GAMES[game].generate(0, **self.game_params())
        except ValueError as exc:
            raise ValueError(f"workflow.params of {game}: {exc}") from None


@dataclass
class SudokuConfig(GridTeamConfig):
    size: int = 4  # N of the N×N board (a square: 4, 9)
    blanks: int = 8  # blank cells per puzzle; 4 is the easy setting (envs.sudoku.EASY_BLANKS)
    unique: bool = True  # only puzzles with exactly one solution

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.blanks < self.size * self.size:
            raise ValueError(f"workflow.params.blanks={self.blanks}: use 1..{self.size ** 2 - 1}"
                             f" for a {self.size}x{self.size} board")
        self._check_game("sudoku")

    def game_params(self) -> dict[str, Any]:
        return {"size": self.size, "blanks": self.blanks, "unique": self.unique}


@dataclass
class PlanPathConfig(GridTeamConfig):
    height: int = 10  # rows of the map
    width: int = 10  # columns of the map
    obstacle_ratio: float = 0.2  # share of cells that are obstacles
    min_path_length: int = 4  # maps whose shortest path is shorter are redrawn

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.obstacle_ratio < 1:
            raise ValueError(f"workflow.params.obstacle_ratio={self.obstacle_ratio}: use [0, 1)")
        self._check_game("plan_path")

    def game_params(self) -> dict[str, Any]:
        return {"height": self.height, "width": self.width,
                "obstacle_ratio": self.obstacle_ratio, "min_path_length": self.min_path_length}


@dataclass
class SokobanConfig(GridTeamConfig):
    height: int = 6  # rows of the room, walled border included
    width: int = 6  # columns of the room
    boxes: int = 1  # boxes (and as many goals)
    max_inner_walls: int = 2  # walls inside the border, drawn from 0..this
    min_moves: int = 3  # rooms solved in fewer moves are redrawn

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.boxes < 1:
            raise ValueError(f"workflow.params.boxes={self.boxes}: must be >= 1")
        self._check_game("sokoban")

    def game_params(self) -> dict[str, Any]:
        return {"height": self.height, "width": self.width, "boxes": self.boxes,
                "max_inner_walls": self.max_inner_walls, "min_moves": self.min_moves}


@dataclass
class Candidate:
    """One of the K candidates of a step, stepped on its own clone of the environment."""

    action: Action
    env: GridGameEnv  # the clone the candidate was stepped on
    result: StepResult
    tool: ToolResult | None = None  # the tool's run (None for the planner)
    failed: bool = False  # the sandbox itself failed: the row is FAILED and never kept

    @property
    def score(self) -> float:
        """The selection score: r^i_k, the λ-mix the learner trains on (Alg. 1 line 13)."""
        return -math.inf if self.failed else self.result.reward


def select(candidates: list[Candidate]) -> Candidate:
    """The candidate with the highest λ-mixed reward; ties go to the first (Alg. 1 line 13)."""
    best = candidates[0]
    for candidate in candidates[1:]:
        if candidate.score > best.score:
            best = candidate
    return best


def row_rewards(result: StepResult) -> dict[str, float | None]:
    """A candidate row's reward components: the mask m = 0 is a null local reward."""
    return {"reward_team": result.team_reward,
            "reward_local": result.local_reward if result.mask else None}


@dataclass
class _Trace:
    """What the episode's candidates did, for the behaviour metrics."""

    tokens: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    rewards: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    tool_calls: int = 0
    tool_clean: int = 0
    step_ids: list[str] = field(default_factory=list)

    def metrics(self, solved: bool, turns: int, team_reward: float) -> dict[str, float]:
        out = {"success": float(solved), "turns": float(turns), "team_reward": team_reward}
        if solved:
            out["turns_to_solve"] = float(turns)  # averaged over solved episodes only
        for agent, tokens in self.tokens.items():
            out[f"behavior/{agent}/response_tokens"] = sum(tokens) / len(tokens)
            rewards = self.rewards[agent]
            if rewards:
                out[f"behavior/{agent}/reward"] = sum(rewards) / len(rewards)
        tool_actions = len(self.tokens.get("tool", ()))
        if tool_actions:
            out["behavior/tool/tool_call_rate"] = self.tool_calls / tool_actions
        if self.tool_calls:
            out["behavior/tool/tool_success"] = self.tool_clean / self.tool_calls
        return out


class GridTeam:
    """The tool + planner team on one grid game; see the module docstring."""

    name = ""  # the game, set by each registered class
    agents = AGENTS  # ("tool", "planner")
    sampling = "tree"
    coach_prompt = ""  # no LLM-coach template: rewards come from the environment

    def __init__(self, cfg: GridTeamConfig) -> None:
        self.cfg = cfg
        self.tool = CodeTool(cfg.sandbox, cfg.observation_chars)
        self.text = prompts.TEXTS[self.name]
        self._task_maker: Callable[[random.Random, int], Task] | None = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_task_maker"] = None  # a closure: rebuilt on first use after unpickling
        return state

    # ------------------------------------------------------------------ tasks
    def make_task(self, rng: random.Random, index: int) -> Task:
        """A task of the env's generator (actors.envs.task_generator); TaskSource keys `rng`
        by split, so train and eval instances never share a seed or a prompt."""
        if self._task_maker is None:
            self._task_maker = task_generator(self.name, **self.cfg.game_params())
        return self._task_maker(rng, index)

    def groups_per_round(self, agent: str, group_size: int) -> int:
        return self.cfg.horizon  # one K-candidate group per agent per turn, at most T turns

    @property
    def team_lambda(self) -> float:
        """The game's λ (A.1.3–A.1.5): rows' rewards and the kept candidates use it, so a
        model trained with `at_grpo` must mix with the same (runtime.config checks)."""
        return GAMES[self.name].LAMBDA

    # ------------------------------------------------------------------ rewards
    def rule_score(self, agent, task, output_text, finish_reason, context) -> float:
        """The rule coach's score: the λ-mixed r^i_k the environment gave this action.

        With `reward_source: coach` each request's context carries it (`step_reward`); a
        request without it was not made by this workflow, and no score is made up for it.
        """
        if "step_reward" not in context:
            raise ValueError(f"{self.name}: no step_reward in the coach request's context; "
                             "rewards come from the environment step (reward_source)")
        return float(context["step_reward"])

    async def _settle(self, episode, candidates: list[Candidate], prompt: str,
                      trace: _Trace) -> Candidate:
        """Record every candidate's rewards and figures, keep the best one, return it."""
        best = select(candidates)
        episode.keep(best.action)
        for candidate in candidates:
            action, result = candidate.action, candidate.result
            trace.step_ids.append(action.step_id)
            trace.tokens[action.agent].append(len(action.response_ids))
            episode.annotate(action.step_id, env_reward=result.reward,
                             env_team=result.team_reward, env_local=result.local_reward,
                             env_mask=result.mask, kept=candidate is best)
            if candidate.failed:
                continue  # FAILED `sandbox`: neither rewarded nor coached
            trace.rewards[action.agent].append(result.reward)
            if self.cfg.reward_source == "inline":
                episode.reward(action.step_id, reward=result.reward, **row_rewards(result))
            else:
                episode.reward(action.step_id, **row_rewards(result))
                await episode.coach([action], input_text=prompt, context={
                    "step_reward": result.reward, "team_reward": result.team_reward,
                    "local_reward": result.local_reward, "mask": result.mask,
                    "tool_observation": candidate.tool.observation if candidate.tool else ""})
        return best

    # ------------------------------------------------------------------ the episode
    async def _run_code(self, episode, action: Action, context: dict) -> ToolResult:
        """Run a tool reply's code in a fresh workspace holding the env context."""
        with self.tool.workspace() as workspace:
            workspace.write(prompts.STATE_FILE, json.dumps(context))
            return await self.tool.call(episode, action, workspace)

    async def _tool_step(self, episode, env: GridGameEnv, turn: int, path: str,
                         history: str, task: Task, trace: _Trace) -> Candidate:
        cfg, context = self.cfg, self.text.context(env.state)
        prompt = prompts.tool_prompt(self.text, task.prompt, env.observation, context, history)
        actions = await episode.act(
            "tool", [{"role": "user", "content": prompt}], turn=turn, n=episode.group_size,
            max_new_tokens=cfg.tool_tokens, parent_branch=path, prefix=cfg.tool_prefix,
            stop=self.tool.stop_strings(cfg.tool_prefix))
        runs = await asyncio.gather(*(self._run_code(episode, a, context) for a in actions))
        candidates = []
        for action, run in zip(actions, runs):
            trace.tool_calls += run.called
            trace.tool_clean += run.called and run.ok
            branch = env.clone()
            printed = run.stdout if run.called and not run.infra_error else ""
            candidates.append(Candidate(action, branch, branch.step("tool", printed), run,
                                        failed=bool(run.infra_error)))
        return await self._settle(episode, candidates, prompt, trace)

    async def _planner_step(self, episode, env: GridGameEnv, turn: int, path: str,
                            history: str, task: Task, tool: Candidate,
                            trace: _Trace) -> Candidate:
        cfg = self.cfg
        blocks = python_blocks(tool.action.text)
        code = "```python\n" + "\n\n".join(blocks) + "\n```" if blocks else "(no code block)"
        output = tool.tool.observation if tool.tool and tool.tool.called else "(no code ran)"
        prompt = prompts.planner_prompt(
            self.text, task.prompt, env.observation, code, output,
            prompts.clip(tool.result.observation, cfg.observation_chars), history)
        actions = await episode.act(
            "planner", [{"role": "user", "content": prompt}], turn=turn, n=episode.group_size,
            max_new_tokens=cfg.planner_tokens, parent_branch=path, prefix=cfg.planner_prefix)
        candidates = []
        for action in actions:
            branch = env.clone()
            candidates.append(Candidate(action, branch, branch.step("planner", action.text)))
        return await self._settle(episode, candidates, prompt, trace)

    async def run(self, task: Task, episode) -> dict[str, float]:
        env = build_environment(self.name, self.cfg.horizon)
        env.reset(self._task_dict(task))
        trace, path, lines, turn, team = _Trace(), "", [], 0, 0.0
        while not env.done:
            turn = env.turn
            history = prompts.history_block(lines, self.cfg.history_chars)
            tool = await self._tool_step(episode, env, turn, path, history, task, trace)
            path = tree_path(path, tool.action.candidate)
            plan = await self._planner_step(episode, env, turn, path, history, task, tool,
                                            trace)
            path = tree_path(path, plan.action.candidate)
            env, team = plan.env, plan.result.team_reward
            lines.append(self._history_line(turn, tool, plan))
        for step_id in trace.step_ids:
            episode.reward(step_id, outcome=float(env.solved))
        return trace.metrics(env.solved, turn, team)

    def _history_line(self, turn: int, tool: Candidate, plan: Candidate) -> str:
        """One earlier turn as the prompts show it (A.3.1's action/state history)."""
        printed = tool.tool.stdout.strip() if tool.tool and tool.tool.called else ""
        answer = answer_text(plan.action.text, "planner")
        answer = prompts.clip(answer.strip(), _ANSWER_CHARS) if answer else "(no #### answer)"
        verdict = plan.result.observation.splitlines()  # what the answer did ... where play is
        return (f"Turn {turn}: the tool printed "
                f"{prompts.clip(printed, _ANSWER_CHARS) or '(nothing)'}; the planner "
                f"answered {answer}; {verdict[0]} {verdict[-1]}")

    def _task_dict(self, task: Task) -> dict:
        found = task.extra.get("task")
        if not isinstance(found, dict) or found.get("game") != self.name:
            raise ValueError(f"task {task.task_id}: extra['task'] must hold a {self.name} task "
                             "dict (actors.envs.task_generator makes them; a task file needs a "
                             "'task' column with one)")
        return found


@register("sudoku", SudokuConfig)
class SudokuTeam(GridTeam):
    """4×4 Sudoku (A.1.3; λ = 0.6): the tool prints a grid or fill steps, the planner answers."""

    name = "sudoku"


@register("plan_path", PlanPathConfig)
class PlanPathTeam(GridTeam):
    """10×10 Plan-Path (A.1.4; λ = 0.5): both agents give move lists such as [U,R,D,L]."""

    name = "plan_path"


@register("sokoban", SokobanConfig)
class SokobanTeam(GridTeam):
    """6×6 Sokoban (A.1.5; λ = 0.4): both agents give move lists such as [U,R,D,L]."""

    name = "sokoban"
