"""The run's structured config: component dataclasses merged with YAML and CLI overrides.

Each component owns its schema (`EngineConfig`, `LearnerConfig`, `BufferConfig`,
`RolloutConfig`, `CoachConfig`, `WorkflowConfig`); this module composes them, checks what
spans components, and turns OmegaConf's errors into ones that name the field and the fix.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from actors.coach import CoachConfig
from actors.coach.config import available_prompts
from actors.coach.prompts import workflow_prompt
from actors.engines.sglang import EngineConfig
from actors.rollout import RolloutConfig
from actors.workflows import WorkflowConfig, build_workflow, workflow_names
from buffers.replay import BufferConfig
from learners.config import LearnerConfig
from runtime.bus import BusConfig


class ConfigError(ValueError):
    """A config value is wrong; the message names the field, the value and the fix."""


@dataclass
class ModelConfig:
    path: str = "tiny"  # a provisioned model name (runtime.models.MODELS) or a HF folder
    engines: int = 1  # SGLang engine instances serving this model
    # engine flags and limits; dtype "auto": bf16 where native, else fp32 (runtime/dtype.py)
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(dtype="auto"))
    # estimator, loss, optimizer; dtype "auto" as the engine's
    learner: LearnerConfig = field(default_factory=lambda: LearnerConfig(dtype="auto"))
    buffer: BufferConfig = field(default_factory=BufferConfig)  # replay buffer capacity, readiness
    # extra arguments of this model's chat template, e.g. {enable_thinking: false} for Qwen3
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.engines < 1:
            raise ConfigError(f"engines={self.engines}: every model needs at least 1 engine")


@dataclass
class RunConfig:
    name: str = "troupe"  # run id prefix; the run directory is <runs_dir>/<name>-<time>
    run_id: str = ""  # explicit run id; empty generates one
    runs_dir: str = "runs"  # where run directories are created
    max_steps: int = 20  # learner steps per model; the run ends when every model reached it
    max_wall_s: float = 0.0  # stop after this many seconds as well (0: no limit)
    # stop with a diagnosis (the stuck stage) when no learner step came for this long; 0 = off
    stall_timeout_s: float = 900.0
    # a supervision call (an actor's stats, an engine's health check) unanswered this long is
    # slow: counted per actor, warned about, and the actor's last answer used for the round
    call_timeout_s: float = 10.0
    # a call still unanswered after this long stops the run naming the actor (slow is not
    # dead, but hung is a failure); an engine's health check also gets its restart time
    unanswered_timeout_s: float = 300.0
    ray_address: str = ""  # "" joins the cluster of a submitted job, else starts a local Ray
    num_cpus: int = 2  # CPUs of a locally started Ray instance
    learner_cpus: float = 0.5  # Ray CPUs reserved per learner actor
    rollout_cpus: float = 0.25  # Ray CPUs reserved per rollout actor
    keep_weights: int = 3  # published weight versions kept on disk per model
    # restarts of failed rollout actors allowed in any 60-minute window; one more stops the run
    actor_restarts_per_hour: int = 6
    buffer_restarts: int = 3  # restarts of a crashed buffer actor (it recovers from its log)
    # restarts of a crashed learner actor: it continues from its newest checkpoint, and its
    # buffer rolls back what the lost steps had trained (0: a learner crash stops the run)
    learner_restarts: int = 2
    checkpoint_every: int = 10  # learner steps between checkpoints (checkpoints/<model>/); 0 = off
    keep_checkpoints: int = 2  # checkpoints kept per model (older ones are deleted)
    # seconds a scaled-down rollout actor may take to finish its in-flight rounds; rounds still
    # running then are cancelled and their rows counted lost as "scaled_down"
    drain_timeout_s: float = 120.0
    seed: int = 0  # added to the task stream's, the learners' and the engines' seeds

    def __post_init__(self) -> None:
        if self.max_steps < 1:
            raise ConfigError(f"run.max_steps={self.max_steps}: must be >= 1")
        if self.stall_timeout_s < 0:
            raise ConfigError(f"run.stall_timeout_s={self.stall_timeout_s}: use seconds >= 0 "
                              "(0 turns the stall watchdog off)")
        if self.call_timeout_s <= 0:
            raise ConfigError(f"run.call_timeout_s={self.call_timeout_s}: use seconds > 0 (how "
                              "long a supervision round waits for an actor's answer)")
        if self.unanswered_timeout_s <= self.call_timeout_s:
            raise ConfigError(f"run.unanswered_timeout_s={self.unanswered_timeout_s}: must exceed "
                              f"run.call_timeout_s={self.call_timeout_s} (a call is slow first, "
                              "hung only later); use minutes, e.g. 300")
        if self.keep_weights < 1:
            raise ConfigError(f"run.keep_weights={self.keep_weights}: must be >= 1 "
                              "(engines load the newest version from disk)")
        if self.actor_restarts_per_hour < 0:
            raise ConfigError(f"run.actor_restarts_per_hour={self.actor_restarts_per_hour}: "
                              "must be >= 0 (0: the first rollout actor failure stops the run)")
        if self.checkpoint_every < 0:
            raise ConfigError(f"run.checkpoint_every={self.checkpoint_every}: use steps >= 0 "
                              "(0 turns periodic checkpoints off)")
        if self.keep_checkpoints < 1:
            raise ConfigError(f"run.keep_checkpoints={self.keep_checkpoints}: must be >= 1 "
                              "(a resume needs the newest one)")
        if self.drain_timeout_s < 0:
            raise ConfigError(f"run.drain_timeout_s={self.drain_timeout_s}: use seconds >= 0")


@dataclass
class TroupeConfig:
    run: RunConfig = field(default_factory=RunConfig)  # run directory, stop condition, Ray
    workflow: WorkflowConfig = field(default_factory=WorkflowConfig)  # what episodes play
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # rollout actors, sampling
    coach: CoachConfig = field(default_factory=CoachConfig)  # the per-action scorer
    models: dict[str, ModelConfig] = field(default_factory=dict)  # model id -> its parts
    bus: BusConfig = field(default_factory=BusConfig)  # the MQTT control bus (DESIGN §9)

    def __post_init__(self) -> None:
        if not self.models:
            raise ConfigError("models is empty: declare at least one model, e.g. "
                              "models: {policy: {path: tiny}}")
        if self.workflow.name not in workflow_names():
            raise ConfigError(f"workflow.name={self.workflow.name!r}: choose one of "
                              f"{workflow_names()}")
        workflow = build_workflow(self.workflow)
        roles = set(workflow.agents)
        mapped = set(self.workflow.agents)
        if mapped != roles:
            raise ConfigError(f"workflow.agents maps {sorted(mapped)} but {self.workflow.name} "
                              f"plays {sorted(roles)}: map every role to a model id")
        for agent, model_id in self.workflow.agents.items():
            if model_id not in self.models:
                raise ConfigError(f"workflow.agents.{agent}={model_id!r} is not a key of models "
                                  f"({sorted(self.models)})")
        self._check_team_lambda(workflow)
        self._check_estimators(workflow)
        unknown = set(self.rollout.agent_sampling) - roles
        if unknown:
            raise ConfigError(f"rollout.agent_sampling names {sorted(unknown)}, which "
                              f"{self.workflow.name} does not play ({sorted(roles)})")
        unused = set(self.models) - set(self.workflow.agents.values())
        if unused:
            raise ConfigError(f"models {sorted(unused)} are not used by any agent: remove them "
                              "or map an agent to them in workflow.agents")
        if self.coach.backprop.enabled and self.rollout.sync_coach:
            raise ConfigError("coach.backprop.enabled=true with rollout.sync_coach=true: the "
                              "backward chain needs the episode's outcome, known only after "
                              "the episode; set rollout.sync_coach=false")
        if self.coach.kind == "http" and not self.coach.prompt \
                and not workflow_prompt(self.workflow.name):
            raise ConfigError(f"coach.kind=http and coach.prompt is empty, but workflow "
                              f"{self.workflow.name!r} has no default coach template: set "
                              f"coach.prompt to one of {available_prompts()}")
        unknown = (set(self.coach.roles) | set(self.coach.truth_agents)) - roles
        if unknown:
            raise ConfigError(f"coach.roles/coach.truth_agents name {sorted(unknown)}, not roles "
                              f"of {self.workflow.name} ({sorted(roles)})")
        for model_id, model in self.models.items():
            undo = model.buffer.wal_undo_versions
            if self.run.checkpoint_every and undo < self.run.checkpoint_every:
                raise ConfigError(
                    f"models.{model_id}.buffer.wal_undo_versions={undo} < run.checkpoint_every="
                    f"{self.run.checkpoint_every}: a resume could not give back the rows "
                    "trained after the last checkpoint; raise wal_undo_versions")
            want = model.learner.readiness_unit
            if model.buffer.readiness != want:
                raise ConfigError(
                    f"models.{model_id}.buffer.readiness={model.buffer.readiness!r} but "
                    f"advantage {model.learner.advantage!r} needs {want!r}: set "
                    f"models.{model_id}.buffer.readiness={want}")
            self._check_sampling_temperature(model_id, model.learner.temperature)

    def _check_team_lambda(self, workflow) -> None:
        """A workflow that mixes rewards with a λ (AT-GRPO's appendix: the rows' `reward` and
        the kept candidates use it) and an `at_grpo` learner must mix with the same λ."""
        lam = getattr(workflow, "team_lambda", None)  # only the λ-mixing workflows have one
        if lam is None:
            return
        for model_id in sorted(set(self.workflow.agents.values())):
            learner = self.models[model_id].learner
            if learner.advantage == "at_grpo" and learner.team_lambda != lam:
                raise ConfigError(
                    f"models.{model_id}.learner.team_lambda={learner.team_lambda} but "
                    f"{self.workflow.name} mixes rewards with λ={lam}: set "
                    f"models.{model_id}.learner.team_lambda={lam}")

    def _check_estimators(self, workflow) -> None:
        """A workflow whose rows some estimator cannot train says why (`estimator_error`,
        e.g. magrpo_code's cross mode: rows of one joint action carry different rewards)."""
        check = getattr(workflow, "estimator_error", None)  # only such workflows have one
        if check is None:
            return
        for model_id in sorted(set(self.workflow.agents.values())):
            advantage = self.models[model_id].learner.advantage
            problem = check(advantage)
            if problem:
                raise ConfigError(f"models.{model_id}.learner.advantage={advantage!r} cannot "
                                  f"train {self.workflow.name}'s rows: {problem}")

    def _check_sampling_temperature(self, model_id: str, learner_temperature: float) -> None:
        """The learner divides a model's logits by one temperature: every agent that samples
        from the model must sample at it (rollout.temperature or its agent_sampling)."""
        agents = sorted(a for a, m in self.workflow.agents.items() if m == model_id)
        for agent in agents:
            temperature = self.rollout.sampling_for(agent).temperature
            if temperature != learner_temperature:
                own = self.rollout.agent_sampling.get(agent)
                where = (f"rollout.agent_sampling.{agent}.temperature"
                         if own is not None and own.temperature is not None
                         else "rollout.temperature")
                raise ConfigError(
                    f"models.{model_id}.learner.temperature={learner_temperature} differs from "
                    f"{where}={temperature} (agent {agent}): logprobs must be computed at the "
                    "sampling temperature; set them equal, or give agents that sample at "
                    "different temperatures separate models")


def load_config(path: str | Path | None, overrides: list[str] = ()) -> TroupeConfig:
    """YAML file (optional) + `key=value` overrides → validated `TroupeConfig`."""
    try:
        merged = OmegaConf.structured(TroupeConfig)
        if path is not None:
            merged = OmegaConf.merge(merged, OmegaConf.load(path))
        for override in overrides:
            merged = _apply_override(merged, override)
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        where = f" in {path}" if path else ""
        raise ConfigError(f"config error{where}: {exc}") from None
    except ValueError as exc:  # a component's __post_init__ names the field and the fix
        where = f" in {path}" if path else ""
        raise ConfigError(f"config error{where}: {exc}") from None
    assert isinstance(cfg, TroupeConfig)
    return cfg


def _apply_override(cfg, override: str):
    """One `key=value` (keys may index lists: `coach.endpoints[0].model=x` or `...endpoints.0...`)."""
    key, sep, raw = override.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {override!r}: expected key=value, e.g. run.max_steps=10")
    try:
        return OmegaConf.merge(cfg, OmegaConf.from_dotlist([override]))
    except TypeError:
        pass  # the key indexes a list: a dotlist merge cannot address one element
    value = OmegaConf.from_dotlist([f"value={raw}"])["value"]  # same value parsing as above
    try:
        OmegaConf.update(cfg, key, value, merge=True, force_add=False)
    except (TypeError, IndexError, KeyError) as exc:
        raise ConfigError(f"override {override!r}: {exc}") from None
    return cfg


def to_yaml(cfg: TroupeConfig) -> str:
    """The resolved config as YAML (written into the run directory and TensorBoard)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
