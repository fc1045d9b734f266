"""One joint rollout: routes each agent action to its model's engine and records step rows.

`Episode.act(agent, messages, n=K)` is the only way a workflow generates text. Each of the K
candidates becomes one row (DESIGN §3) whose group key is built from named fields (§4):
tree sampling (n=K) groups the K candidates of one prompt; joint sampling (n=1 inside a round
of G episodes) groups the G actions of an agent at a turn across the round.
Rewards are attached later: rule rewards inline through `reward`, coach scores through
`coach` (the rollout actor ships them to the coach pool after the rows are buffered).
`consult(messages)` asks a non-trained advisor model through the coach pool (MAGRPO's
external feedback, DESIGN §14): its reply is an observation, never a row.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol

import numpy as np

from buffers.schema import RewardCommit, StepRecord, group_key, new_id

CHAT_ROLES = ("system", "user", "assistant")
_PURPOSE = re.compile(r"[A-Za-z0-9_.-]+")  # a metric-key segment (coach/advisor/purpose/<p>)


class Generator(Protocol):
    """What an episode needs from an engine client (actors.engines.client.EngineClient)."""

    async def generate(self, prompt_ids, n: int, max_new_tokens: int, temperature: float = 1.0,
                       top_p: float = 1.0, stop_token_ids=None, stop=None) -> list: ...


@dataclass(frozen=True)
class Action:
    """One generated candidate as the workflow sees it."""

    step_id: str
    agent: str
    turn: int
    candidate: int
    text: str
    response_ids: np.ndarray
    finish_reason: str


@dataclass(frozen=True)
class CoachRequest:
    """Everything a coach needs to score one action (MAPPA §2.2: role, input, output, tools).

    `context` may carry `tool_observation` (the tool feedback the action got). `on_path` is
    False for a tree candidate the episode did not continue from; `outcome` is the episode's
    final outcome in [0, 1], attached when the episode ends (never shown to the process-score
    prompt; used for reward backpropagation, MAPPA appendix F, and score-vs-outcome metrics).
    """

    step_id: str
    model_id: str
    agent: str
    workflow: str
    task_id: str
    input_text: str
    output_text: str
    finish_reason: str
    truth: str | None = None
    context: dict[str, Any] = field(default_factory=dict)
    problem: str = ""  # the task statement the whole team works on
    episode_id: str = ""
    turn: int = 0
    on_path: bool = True
    outcome: float | None = None


@dataclass(frozen=True)
class AdviceRequest:
    """One question to the advisor: chat `messages` sent as they are (the workflow owns the
    prompt), a `purpose` label for metrics and logs, and optionally the advisor `endpoint`
    (its config name) that must answer; None lets the pool choose."""

    messages: list[dict[str, str]]
    purpose: str = "advisor"
    endpoint: str | None = None
    episode_id: str = ""
    workflow: str = ""
    task_id: str = ""


@dataclass(frozen=True)
class Advice:
    """The advisor's reply. `latency_s` is the whole consult (retries and breaker pauses
    included); `endpoint` names the endpoint that answered (or failed). A failed consult
    carries `failed_reason` (e.g. "server_error", "unavailable") and no text; the Advice
    that `Episode.consult` returns always has `failed_reason` None."""

    text: str | None
    endpoint: str
    latency_s: float
    purpose: str = "advisor"
    failed_reason: str | None = None
    detail: str = ""


class AdvisorFailure(Exception):
    """The pool gave up on one advice (retries exhausted, breaker open past the deadline, a
    4xx). The workflow may catch it and go on without feedback; it is already logged and
    counted (per episode, per rollout actor, and under coach/advisor/ in the pool)."""

    def __init__(self, advice: Advice) -> None:
        super().__init__(f"advisor {advice.endpoint!r} gave up ({advice.failed_reason}) after "
                         f"{advice.latency_s:.1f} s: {advice.detail}")
        self.advice = advice
        self.reason = advice.failed_reason
        self.endpoint = advice.endpoint
        self.latency_s = advice.latency_s

    def __reduce__(self):  # rebuilt from its Advice when a Ray error carries it across
        return (AdvisorFailure, (self.advice,))


AdviceFn = Callable[[AdviceRequest], Awaitable[Advice]]


@dataclass
class _Draft:
    """A row under construction; becomes a StepRecord when the episode finishes."""

    fields: dict[str, Any]
    rewards: dict[str, float | None] = field(default_factory=dict)


class ModelRoute:
    """An agent's route to its model: engine clients (round-robin) and the tokenizer."""

    def __init__(self, model_id: str, clients: list[Generator], tokenizer,
                 template_kwargs: dict[str, Any] | None = None) -> None:
        """`template_kwargs` go to the model's chat template (ModelConfig.chat_template_kwargs),
        e.g. `{"enable_thinking": False}`, Qwen3's switch that AT-GRPO turns off (§5)."""
        if not clients:
            raise ValueError(f"model {model_id!r} has no engine client")
        self.model_id = model_id
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        self._clients = itertools.cycle(clients)

    def next_client(self) -> Generator:
        return next(self._clients)

    def encode(self, messages: list[dict[str, str]] | str, prefix: str = "") -> list[int]:
        """Chat messages through the model's template, or a raw completion prompt as is.

        `prefix` opens the reply (e.g. "The final answer is \\boxed{"): it is part of the
        prompt, so its tokens are conditioned on and never trained.
        """
        if isinstance(messages, str):
            text = messages
        else:  # render then encode once: the exact ids sent to the engine are the ones stored
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      tokenize=False, **self.template_kwargs)
        return list(self.tokenizer(text + prefix, add_special_tokens=False)["input_ids"])

    def decode(self, ids: np.ndarray) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0


class Episode:
    """Records the actions of one episode; see the module docstring."""

    def __init__(self, *, run_id: str, workflow: str, task_id: str, round_id: str,
                 round_size: int, round_index: int, group_size: int,
                 agent_models: dict[str, str],
                 routes: dict[str, ModelRoute], sampling: SamplingParams,
                 agent_sampling: dict[str, SamplingParams] | None = None,
                 truth: str | None = None, problem: str = "",
                 sync_scorer: Callable[[list[CoachRequest]], Awaitable[dict[str, Any]]]
                 | None = None, advisor: AdviceFn | None = None) -> None:
        """`advisor` answers `consult` (the coach pool's, through the rollout actor); None
        when the run has no advisor, and then `consult` is an error."""
        self.run_id = run_id
        self.workflow = workflow
        self.task_id = task_id
        self.round_id = round_id
        self.round_size = round_size
        self.round_index = round_index
        self.group_size = group_size  # K, for workflows that tree-sample
        self.episode_id = new_id()
        self.agent_models = agent_models
        self.routes = routes
        self.sampling = sampling  # every agent's, unless `agent_sampling` names the agent
        self.agent_sampling = dict(agent_sampling or {})
        self.truth = truth
        self.problem = problem
        self.sync_scorer = sync_scorer
        self.advisor = advisor
        self._drafts: dict[str, _Draft] = {}
        self._coach: list[CoachRequest] = []
        self._coached: set[str] = set()  # step_ids already sent to the coach (at most once)
        self._tree_steps: set[str] = set()  # candidates of n > 1 actions
        self._chosen: set[str] = set()  # tree candidates the episode continued from
        self._failures: dict[str, list] = {}  # model_id -> FAILED RewardCommits to send
        self._failed: set[str] = set()  # rows failed by the episode itself (Episode.fail)
        self.generated_tokens = 0
        self.advisor_calls = 0  # consults answered or failed (none of them is a row)
        self.advisor_failures = 0
        self.advisor_latency_s = 0.0  # total time this episode waited for advice

    async def act(self, agent: str, messages: list[dict[str, str]] | str, *, turn: int,
                  n: int = 1,
                  max_new_tokens: int, parent_branch: str = "", prefix: str = "",
                  stop: list[str] | None = None,
                  meta: dict[str, Any] | None = None) -> list[Action]:
        """Generate n candidates for `agent` and record one row per candidate.

        `messages` is a chat (rendered with the model's template) or a raw completion prompt;
        `prefix` opens the reply (prompt tokens, not trained) and starts each `Action.text`.
        `stop` strings end a reply (e.g. a closing code fence, DESIGN §14); the text that
        completed one stays in `Action.text` and in the row.
        Returns the candidates in order; `Action.candidate` is the row's index in its group.
        """
        if agent not in self.agent_models:
            raise KeyError(f"agent {agent!r} has no model; known agents: {sorted(self.agent_models)}")
        model_id = self.agent_models[agent]
        route = self.routes[model_id]
        prompt_ids = route.encode(messages, prefix)
        sampling = self.agent_sampling.get(agent, self.sampling)
        generations = await route.next_client().generate(
            prompt_ids, n=n, max_new_tokens=max_new_tokens,
            temperature=sampling.temperature, top_p=sampling.top_p, stop=stop)
        if len(generations) != n:
            raise RuntimeError(f"engine of {model_id} returned {len(generations)} candidates, "
                               f"asked for {n}")
        # Tree sampling groups the n candidates; joint sampling groups the round's G episodes.
        tree = n > 1
        size = n if tree else self.round_size
        key = group_key(self.task_id, self.round_id, parent_branch, agent, turn)
        prompt = np.asarray(prompt_ids, dtype=np.int32)
        actions = []
        for i, gen in enumerate(generations):
            step_id = new_id()
            candidate = i if tree else self.round_index
            text = prefix + route.decode(gen.response_ids)
            self.generated_tokens += len(gen.response_ids)
            row_meta = {"response_len": int(len(gen.response_ids)), "text": text[:200]}
            row_meta.update(meta or {})
            self._drafts[step_id] = _Draft(fields=dict(
                step_id=step_id, run_id=self.run_id, model_id=model_id, agent=agent,
                workflow=self.workflow, task_id=self.task_id, episode_id=self.episode_id,
                branch=parent_branch, turn=turn, group_key=key, group_size=size,
                candidate=candidate, prompt_ids=prompt,
                response_ids=np.asarray(gen.response_ids, dtype=np.int32),
                behavior_logprobs=np.asarray(gen.logprobs, dtype=np.float32),
                token_versions=np.asarray(gen.versions, dtype=np.int32),
                finish_reason=gen.finish_reason, created_at=time.time(), meta=row_meta))
            if tree:
                self._tree_steps.add(step_id)
            actions.append(Action(step_id, agent, turn, candidate, text,
                                  np.asarray(gen.response_ids, dtype=np.int32),
                                  gen.finish_reason))
        return actions

    async def consult(self, messages: list[dict[str, str]], *, purpose: str = "advisor",
                      endpoint: str | None = None) -> Advice:
        """Ask the advisor model (not trained) and return its reply; no row is recorded.

        `messages` are sent as they are (MAGRPO's advisor prompt is the workflow's own);
        `purpose` labels the call in metrics (`coach/advisor/purpose/<purpose>/…`);
        `endpoint` names one of `coach.advisor.endpoints` (None: the pool picks one whose
        breaker is closed, in turn). The call goes through the coach pool's concurrency and
        rate limits, retries and breaker, waiting at most `coach.advisor.give_up_after_s`.

        Raises:
            AdvisorFailure: the pool gave up; the episode may go on without feedback.
            RuntimeError: the run has no advisor (`coach.advisor.enabled=false`).
            ValueError: malformed `messages` or `purpose` (a workflow bug).
        """
        if self.advisor is None:
            raise RuntimeError("Episode.consult: this run has no advisor; set "
                               "coach.advisor.enabled=true (with coach.advisor.endpoints, or "
                               "coach.kind=http to share the judges)")
        _check_chat(messages)
        if not _PURPOSE.fullmatch(purpose):
            raise ValueError(f"consult(purpose={purpose!r}): use letters, digits, '_', '.', '-' "
                             "(it becomes a metric key)")
        advice = await self.advisor(AdviceRequest(
            messages=[dict(m) for m in messages], purpose=purpose, endpoint=endpoint,
            episode_id=self.episode_id, workflow=self.workflow, task_id=self.task_id))
        self.advisor_calls += 1
        self.advisor_latency_s += advice.latency_s
        if advice.failed_reason is not None:
            self.advisor_failures += 1
            raise AdvisorFailure(advice)
        return advice

    def advisor_scalars(self) -> dict[str, float]:
        """This episode's advisor counters (`episode/<workflow>/advisor_…` once averaged over a
        round, `eval/<workflow>/advisor_…` in evaluation): calls and failures, and the mean
        wait of one advice (only where the episode asked)."""
        out = {"advisor_calls": float(self.advisor_calls),
               "advisor_failures": float(self.advisor_failures)}
        if self.advisor_calls:
            out["advisor_latency_s"] = self.advisor_latency_s / self.advisor_calls
        return out

    def reward(self, step_id: str, *, reward: float | None = None,
               reward_local: float | None = None, reward_team: float | None = None,
               outcome: float | None = None) -> None:
        """Attach rule reward components now (DESIGN §2: rule rewards inline)."""
        values = dict(reward=reward, reward_local=reward_local, reward_team=reward_team,
                      outcome=outcome)
        self._drafts[step_id].rewards.update({k: v for k, v in values.items() if v is not None})

    def annotate(self, step_id: str, **meta: Any) -> None:
        """Add facts about an action to its row's `meta` (tool called, tool ok, tests passed).

        Values must be JSON-serialisable (they travel in the row as JSON); evaluation and
        metrics read them back (scripts/evaluate.py).
        """
        draft = self._drafts.get(step_id)
        if draft is None:
            raise KeyError(f"annotate({step_id!r}): no action of this episode has that step_id")
        json.dumps(meta)  # fail here, at the workflow's line, not when the row is shipped
        draft.fields["meta"].update(meta)

    def fail(self, step_id: str, reason: str) -> None:
        """Mark an action's row FAILED under `reason` (e.g. "sandbox": the tool's
        infrastructure failed, not the model): it ships, is counted as dropped, and is never
        trained or sent to the coach."""
        draft = self._drafts.get(step_id)
        if draft is None:
            raise KeyError(f"fail({step_id!r}): no action of this episode has that step_id")
        if step_id in self._coached:
            raise ValueError(f"fail({step_id!r}): the row was already sent to the coach")
        self._failed.add(step_id)
        self._failures.setdefault(draft.fields["model_id"], []).append(
            RewardCommit(step_id, failed_reason=reason))

    def keep(self, action: Action) -> None:
        """Mark the tree candidate the episode continues from (its trajectory, MAPPA F.2)."""
        self._chosen.add(action.step_id)

    async def coach(self, actions: list[Action], *, input_text: str,
                    context: dict[str, Any] | None = None, truth: str | None = None) -> None:
        """Ask the coach to score these actions (the training reward of each), once each.

        `truth` replaces the task's ground truth for these requests: what the harness measured
        (e.g. DSBench's held-out metrics, MAPPA appendix A.1), shown to the agents in
        `coach.truth_agents`.

        Asynchronous mode (default): the requests leave with the rows and the scores arrive
        in the buffer later by step_id; the episode does not wait. Synchronous baseline
        (`sync_scorer` set, DESIGN §12): the scores are awaited here, inside the trajectory,
        as MAPPA's loop does, and travel in the rows; a row the coach failed on ships
        without a reward and its failure is committed right after (`failures`).
        """
        actions = [a for a in actions if a.step_id not in self._failed]  # never scored
        if not actions:
            return
        repeated = [a.step_id for a in actions if a.step_id in self._coached]
        if repeated:
            raise ValueError(f"actions {repeated} were already sent to the coach: a row's "
                             "reward is committed exactly once")
        # An inline `reward` completes a row; a coach score would overwrite it (synchronous
        # mode) or be refused by the buffer (asynchronous mode).
        rewarded = [a.step_id for a in actions if "reward" in self._drafts[a.step_id].rewards]
        if rewarded:
            raise ValueError(f"actions {rewarded} already have an inline reward "
                             "(Episode.reward): a row's reward is committed exactly once")
        self._coached.update(a.step_id for a in actions)
        requests = [CoachRequest(
            step_id=a.step_id, model_id=self.agent_models[a.agent], agent=a.agent,
            workflow=self.workflow, task_id=self.task_id, input_text=input_text,
            output_text=a.text, finish_reason=a.finish_reason,
            truth=self.truth if truth is None else truth,
            context=context or {}, problem=self.problem, episode_id=self.episode_id,
            turn=a.turn) for a in actions]
        if self.sync_scorer is None:
            self._coach.extend(requests)
            return
        results = await self.sync_scorer(requests)
        for request in requests:
            result = results[request.step_id]
            if result.failed_reason is None:
                self._drafts[request.step_id].rewards.update(coach_score=result.coach_score,
                                                             reward=result.reward)
            else:
                self._failures.setdefault(request.model_id, []).append(result.commit())

    def coach_requests(self, outcome: float | None = None) -> list[CoachRequest]:
        """The pending coach requests, with the episode's outcome and trajectory marks."""
        return [dataclasses.replace(r, outcome=outcome,
                                    on_path=r.step_id not in self._tree_steps
                                    or r.step_id in self._chosen)
                for r in self._coach]

    @property
    def failures(self) -> dict[str, list]:
        """FAILED commits per model, sent once the rows are buffered: rows the inline coach
        failed on (synchronous mode) and rows the episode failed (`fail`)."""
        return {m: list(c) for m, c in self._failures.items()}

    @property
    def num_rows(self) -> int:
        return len(self._drafts)

    def group_counts(self) -> Counter[str]:
        """Rows this episode produced per group key (the round seals its groups at these)."""
        return Counter(d.fields["group_key"] for d in self._drafts.values())

    def records(self, group_sizes: dict[str, int] | None = None) -> dict[str, list[StepRecord]]:
        """The episode's rows, grouped by model id (each model has its own buffer).

        `group_sizes` (group key -> rows the whole round produced for it) seals each group at
        what was actually produced: in a joint round an episode that stopped early adds no
        row to later turns' groups, and those groups must not wait for it (DESIGN §14).
        """
        by_model: dict[str, list[StepRecord]] = {}
        for draft in self._drafts.values():
            f = dict(draft.fields)
            f["meta"] = json.dumps(f["meta"])
            if group_sizes is not None:
                f["group_size"] = group_sizes[f["group_key"]]
            rec = StepRecord(**f, **draft.rewards)
            by_model.setdefault(rec.model_id, []).append(rec)
        return by_model


def _check_chat(messages: list[dict[str, str]]) -> None:
    """An OpenAI chat: a non-empty list of {role, content} with a known role and text."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"consult(messages=...): expected a non-empty list of "
                         f"{{role, content}} dicts, got {type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or set(message) != {"role", "content"} \
                or message["role"] not in CHAT_ROLES or not isinstance(message["content"], str):
            raise ValueError(f"consult(messages[{i}]={message!r}): each message must be "
                             f"{{'role': one of {list(CHAT_ROLES)}, 'content': str}}")
