"""Lewis signalling game: a sender sees a target, a receiver sees only the sender's message.

Two agents on two separate models. A round is G joint rollouts of one target (MAGRPO §4:
parallel joint sampling; with group estimators the G actions of an agent at a turn form one
group). Team reward 1 when the receiver names the target, shared by both agents; the
receiver may also get a local reward for naming any target, mixed as r = α·r_team + r_local
(AT-GRPO eq. 4), off by default.

Prompts are raw completions ("target 3", "message b"), not chat: on a tiny random model the
chat template puts the same suffix after every prompt, so the last position barely sees the
content and both agents learn one answer for all inputs; with the content as the last token
the inputs are told apart from the first step. The learning configuration
(configs/signal_game_tiny.yaml) trains both models with REINFORCE++'s global normalisation
(MAPPA eq. 1): group-relative advantages vanish once a group's answers agree, which freezes
the pair in a pooling convention, while a batch-wide baseline keeps punishing a wrong
convention. Success starts near chance and must climb to ≥ 0.9.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

from actors.workflows.base import Task
from actors.workflows.registry import register

_WORD = re.compile(r"\S+")


@dataclass
class SignalGameConfig:
    num_targets: int = 4  # V: how many targets the sender can see (chance success = 1/V)
    message_tokens: int = 1  # tokens the sender may emit
    answer_tokens: int = 1  # tokens the receiver may emit
    # receiver's local reward for naming any target (AT-GRPO eq. 4 r_local); 0 by default:
    # it pulls every message toward whichever target the receiver happens to name first
    valid_answer_bonus: float = 0.0

    def __post_init__(self) -> None:
        if not 2 <= self.num_targets <= 10:
            raise ValueError(
                f"workflow.params.num_targets={self.num_targets}: use 2..10 "
                "(targets are the digits 0..V-1)"
            )


@register("signal_game", SignalGameConfig)
class SignalGame:
    name = "signal_game"
    agents = ("sender", "receiver")
    sampling = "joint"
    coach_prompt = ""  # no LLM-coach template: the rule coach scores it

    def __init__(self, cfg: SignalGameConfig) -> None:
        self.cfg = cfg

    def make_task(self, rng: random.Random, index: int) -> Task:
        target = rng.randrange(self.cfg.num_targets)
        return Task(task_id=f"signal-{index}", prompt=f"target {target}", truth=str(target))

    def groups_per_round(self, agent: str, group_size: int) -> int:
        return 1  # the G actions of an agent at turn 0 across the round

    def parse_answer(self, text: str) -> int | None:
        """The receiver's answer as a target index, or None when it names no target."""
        match = _WORD.search(text)
        if match and match.group(0).isdigit() and int(match.group(0)) < self.cfg.num_targets:
            return int(match.group(0))
        return None

    async def run(self, task: Task, episode) -> dict[str, float]:
        (message,) = await episode.act("sender", task.prompt, turn=0,
                                       max_new_tokens=self.cfg.message_tokens)
        words = _WORD.findall(message.text)
        heard = " ".join(words) if words else "nothing"
        (answer,) = await episode.act("receiver", f"message {heard}", turn=0,
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
        # The game's rewards are set inline from the team outcome; it never asks the coach.
        # Raising (the pool marks the row FAILED) beats inventing a score for a request
        # that carries no outcome.
        raise ValueError("signal_game has no per-action coach rule: rewards are set inline")
