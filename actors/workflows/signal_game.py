"""Lewis signalling game: a sender sees a target, a receiver sees only the sender's message.

Two agents on two separate models. A round is G joint rollouts of one target (MAGRPO §4:
parallel joint sampling, the G actions of an agent at a turn form one group). Team reward 1
when the receiver names the target (shared by both agents); the receiver also gets a small
local reward for naming *any* target, mixed as r = α·r_team + r_local (AT-GRPO eq. 4).
Success starts near chance and must climb to ≥ 0.9 — the spine's learning test.
"""
from __future__ import annotations

import random
import re

from actors.workflows.base import SignalGameConfig, Task

_WORD = re.compile(r"\S+")


class SignalGame:
    name = "signal_game"
    agents = ("sender", "receiver")
    sampling = "joint"

    def __init__(self, cfg: SignalGameConfig) -> None:
        self.cfg = cfg

    def make_task(self, rng: random.Random, index: int) -> Task:
        target = rng.randrange(self.cfg.num_targets)
        return Task(task_id=f"signal-{index}", prompt=f"target {target}", truth=str(target))

    def units_per_round(self, agent_models: dict[str, str], group_size: int) -> dict[str, int]:
        units: dict[str, int] = {}
        for agent in self.agents:  # one turn per agent → one group per agent per round
            units[agent_models[agent]] = units.get(agent_models[agent], 0) + 1
        return units

    def parse_answer(self, text: str) -> int | None:
        """The receiver's answer as a target index, or None when it names no target."""
        match = _WORD.search(text)
        if match and match.group(0).isdigit() and int(match.group(0)) < self.cfg.num_targets:
            return int(match.group(0))
        return None

    async def run(self, task: Task, episode) -> dict[str, float]:
        (message,) = await episode.act(
            "sender", [{"role": "user", "content": task.prompt}], turn=0,
            max_new_tokens=self.cfg.message_tokens)
        words = _WORD.findall(message.text)
        heard = " ".join(words) if words else "nothing"
        (answer,) = await episode.act(
            "receiver", [{"role": "user", "content": f"message {heard}"}], turn=0,
            max_new_tokens=self.cfg.answer_tokens)
        guess = self.parse_answer(answer.text)
        success = float(guess is not None and str(guess) == task.truth)
        valid = float(guess is not None)
        episode.reward(message.step_id, reward_team=success, reward_local=0.0,
                       reward=success, outcome=success)
        local = self.cfg.valid_answer_bonus * valid
        episode.reward(answer.step_id, reward_team=success, reward_local=local,
                       reward=success + local, outcome=success)
        return {"success": success, "valid_answer": valid}

    def rule_score(self, agent, task, output_text, finish_reason, context) -> float:
        # Only used when a coach is asked to score this workflow: the team outcome.
        return float(context.get("success", 0.0))
