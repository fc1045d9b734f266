"""The learner's structured config (DESIGN §6): one dataclass, validated on construction.

`LearnerConfig` is an OmegaConf structured-config schema: plain field types with defaults, so
`OmegaConf.structured(LearnerConfig)` merges with YAML and CLI overrides and
`OmegaConf.to_object` yields a validated instance (`__post_init__` runs there).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

# Which unit of rows must be fully rewarded before an estimator can use any of them (DESIGN §4):
# group-relative estimators need every candidate of a group, return-to-go estimators need every
# action of an episode. MAGRPO's joint tree of one round lives in one episode, and a joint
# action's return needs every descendant rewarded, so it completes per episode. The keys are
# the valid values of `LearnerConfig.advantage`; the registry in learners/advantages.py holds
# exactly these names (a unit test checks it).
READINESS_UNITS: dict[str, str] = {
    "grpo": "group",
    "at_grpo": "group",
    "reinforce_pp": "episode",
    "magrpo": "episode",
}

# The valid `LearnerConfig.behavior_correction` values; `learners.losses.decoupled_ppo_loss`
# implements each (kept here so the config validates without importing torch).
BEHAVIOR_CORRECTIONS = ("tis", "mask")
# "auto" is resolved by the runtime before a learner is built (runtime/dtype.py): bf16 where
# the machine computes it natively, fp32 elsewhere.
DTYPES = ("float32", "bfloat16", "auto")
WEIGHT_SYNCS = ("auto", "disk", "tensor")  # LearnerConfig.weight_sync
AUTO = "auto"  # `max_staleness: auto`: η follows the measured rates (runtime/staleness.py)


def readiness_unit(advantage: str) -> str:
    """Return "group" or "episode": the unit the buffer must complete for this estimator.

    Args:
        advantage: an advantage estimator name (a key of `READINESS_UNITS`).

    Raises:
        ValueError: for an unknown estimator name.
    """
    if advantage not in READINESS_UNITS:
        raise ValueError(
            f"advantage={advantage!r} is not a known estimator; "
            f"use one of {sorted(READINESS_UNITS)}"
        )
    return READINESS_UNITS[advantage]


@dataclass
class LearnerConfig:
    """Everything one model's learner needs: estimator, loss, optimizer, batching, runtime."""

    backend: str = "megatron"  # learner backend, a key of learners.protocol.LEARNERS
    advantage: str = "grpo"  # estimator: "grpo" | "at_grpo" | "reinforce_pp" | "magrpo"
    std_normalize: bool = True  # divide group advantages by the group std (False = Dr.GRPO)
    team_alpha: float = 1.0  # AT-GRPO eq. 4 weight α of the team reward: r = α·r_team + r_local
    # AT-GRPO appendix λ-mix r = λ·r_team + (1−λ)·m·r_local instead of eq. 4 (null = eq. 4)
    team_lambda: float | None = None
    reward_kl_beta: float = 0.0  # MAPPA eq. 1 β: KL penalty folded into reinforce_pp rewards
    magrpo_gamma: float = 1.0  # MAGRPO discount γ over joint-tree turns (1.0 in its appendix C)
    entropy_coef: float = 0.0  # weight of the entropy bonus subtracted from the loss (exploration)
    kl_beta: float = 0.0  # weight of the k3 KL(π_θ‖π_ref) term in the loss; > 0 loads a reference
    lr: float = 1e-5  # AdamW learning rate
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping (the norm is still logged)
    ppo_epochs: int = 1  # optimizer steps over the same batch per train_step
    micro_batch_tokens: int = 4096  # padded tokens (rows × padded length) per micro-batch
    clip_eps_low: float = 0.2  # PPO ratio clip below: u ≥ 1 − ε_lo
    clip_eps_high: float = 0.28  # PPO ratio clip above: u ≤ 1 + ε_hi (clip-higher)
    behavior_correction: str = "tis"  # "tis": w′ = min(w, c); "mask": w′ = w·1[1/c ≤ w ≤ c]
    behavior_cap: float = 2.0  # c, the cap on the behaviour importance weight w
    temperature: float = 1.0  # rollout sampling temperature; logits are divided by it
    dtype: str = "float32"  # parameter dtype: "float32" | "bfloat16" | "auto" (runs default to auto)
    num_threads: int = 1  # torch intra-op threads of the learner process
    seed: int = 0  # torch RNG seed set when the learner is built
    tensor_parallel: int = 1  # megatron: ranks each layer is split over (divides the KV heads)
    pipeline_parallel: int = 1  # megatron: pipeline stages (divides the layer count)
    batch_units: int = 8  # readiness units (groups or episodes) per learner step
    # η: rows with v_m − behavior_version > η are dropped (DESIGN §5); an integer ≥ 0, or
    # "auto": the run picks the smallest η that keeps this learner's wait under
    # staleness_target_wait, from measured rates, up to staleness_cap (runtime/staleness.py)
    max_staleness: int | str = 1
    staleness_cap: int = 8  # auto: the largest η it may choose (the hard bound on staleness)
    staleness_target_wait: float = 0.1  # auto: the learner's waiting share to stay under
    staleness_window_steps: int = 2  # auto: learner steps per measurement window
    # auto: η before anything is measured: "cap" (default), or an integer ≤ staleness_cap.
    # At the cap the first units already fill the pipeline; the pilot then lowers η to what
    # the measured rates need (runtime/staleness.py)
    staleness_start: int | str = "cap"
    # How new weights reach this model's engines after a step: "disk" (a safetensors folder
    # the engines load), "tensor" (shared memory; engines on the learner's host only), or
    # "auto": disk unless every engine is on the learner's host; then the first 4 steps try
    # both and the faster is kept (runtime/learner_worker.py). With tensors the folder is
    # still written every weights_to_disk_every steps and at the end: a restarted engine
    # loads the folder (and reports its older version until the next step's tensors).
    weight_sync: str = "auto"
    weights_to_disk_every: int = 10

    def __post_init__(self) -> None:
        # Imported here, not at module top: protocol.py imports this module for its annotations.
        from learners.protocol import LEARNERS

        _check(self.backend in LEARNERS, "backend", self.backend, f"use one of {sorted(LEARNERS)}")
        _check(
            self.advantage in READINESS_UNITS,
            "advantage",
            self.advantage,
            f"use one of {sorted(READINESS_UNITS)}",
        )
        for name in ("team_alpha", "reward_kl_beta", "kl_beta", "entropy_coef", "weight_decay",
                     "grad_clip"):
            value = getattr(self, name)
            _check(math.isfinite(value) and value >= 0, name, value, "use a finite value ≥ 0")
        if self.team_lambda is not None:
            _check(math.isfinite(self.team_lambda) and 0 <= self.team_lambda <= 1,
                   "team_lambda", self.team_lambda, "use a value in [0, 1], or null for eq. 4")
            _check(self.advantage == "at_grpo", "team_lambda", self.team_lambda,
                   "it only applies to advantage='at_grpo'; set it to null")
            _check(self.team_alpha == 1.0, "team_alpha", self.team_alpha,
                   "team_lambda replaces eq. 4's α; leave team_alpha at 1.0 or team_lambda null")
        _check(
            self.reward_kl_beta == 0 or self.advantage == "reinforce_pp",
            "reward_kl_beta",
            self.reward_kl_beta,
            "it only applies to advantage='reinforce_pp'; set it to 0 or use kl_beta (in the loss)",
        )
        _check(math.isfinite(self.magrpo_gamma) and 0 <= self.magrpo_gamma <= 1, "magrpo_gamma",
               self.magrpo_gamma, "use a discount in [0, 1] (1.0: the paper's undiscounted R)")
        _check(self.magrpo_gamma == 1.0 or self.advantage == "magrpo", "magrpo_gamma",
               self.magrpo_gamma, "it only applies to advantage='magrpo'; leave it at 1.0")
        _check(math.isfinite(self.lr) and self.lr > 0, "lr", self.lr, "use a finite value > 0")
        _check(self.ppo_epochs >= 1, "ppo_epochs", self.ppo_epochs, "use an integer ≥ 1")
        _check(
            self.micro_batch_tokens >= 1,
            "micro_batch_tokens",
            self.micro_batch_tokens,
            "use an integer ≥ 1",
        )
        _check(
            0 <= self.clip_eps_low < 1, "clip_eps_low", self.clip_eps_low, "use 0 ≤ value < 1"
        )
        _check(
            math.isfinite(self.clip_eps_high) and self.clip_eps_high >= 0,
            "clip_eps_high",
            self.clip_eps_high,
            "use a finite value ≥ 0",
        )
        _check(
            self.behavior_correction in BEHAVIOR_CORRECTIONS,
            "behavior_correction",
            self.behavior_correction,
            f"use one of {list(BEHAVIOR_CORRECTIONS)}",
        )
        # c < 1 would make the mask window [1/c, c] empty and cap every on-policy weight of 1.
        _check(
            math.isfinite(self.behavior_cap) and self.behavior_cap >= 1,
            "behavior_cap",
            self.behavior_cap,
            "use a finite value ≥ 1",
        )
        _check(
            math.isfinite(self.temperature) and self.temperature > 0,
            "temperature",
            self.temperature,
            "use the rollout sampling temperature, a finite value > 0",
        )
        _check(self.dtype in DTYPES, "dtype", self.dtype, f"use one of {list(DTYPES)}")
        _check(self.num_threads >= 1, "num_threads", self.num_threads, "use an integer ≥ 1")
        for name in ("tensor_parallel", "pipeline_parallel"):
            value = getattr(self, name)
            _check(value >= 1, name, value, "use an integer ≥ 1")
            _check(value == 1 or self.backend == "megatron", name, value,
                   "only backend='megatron' splits a model; use 1 with this backend")
        _check(self.batch_units >= 1, "batch_units", self.batch_units, "use an integer ≥ 1")
        _check(
            self.max_staleness == AUTO
            or (isinstance(self.max_staleness, int) and self.max_staleness >= 0),
            "max_staleness",
            self.max_staleness,
            f"use an integer ≥ 0 (0 = synchronous on-policy) or {AUTO!r}",
        )
        _check(self.staleness_cap >= 0, "staleness_cap", self.staleness_cap,
               "use an integer ≥ 0: the largest η max_staleness='auto' may choose")
        _check(0 <= self.staleness_target_wait < 1, "staleness_target_wait",
               self.staleness_target_wait, "use a share of the learner's time in [0, 1)")
        _check(self.staleness_window_steps >= 1, "staleness_window_steps",
               self.staleness_window_steps, "use an integer ≥ 1")
        _check(self.staleness_start == "cap" or (
            isinstance(self.staleness_start, int) and 0 <= self.staleness_start
            <= self.staleness_cap), "staleness_start", self.staleness_start,
            f"use 'cap' or an integer in [0, staleness_cap={self.staleness_cap}]")
        _check(self.weight_sync in WEIGHT_SYNCS, "weight_sync", self.weight_sync,
               f"use one of {WEIGHT_SYNCS}")
        _check(self.weights_to_disk_every >= 1, "weights_to_disk_every",
               self.weights_to_disk_every, "use an integer ≥ 1 (1 = a folder every step)")

    @property
    def auto_staleness(self) -> bool:
        """True when η is chosen by the run from measured rates (`max_staleness: auto`)."""
        return self.max_staleness == AUTO

    @property
    def initial_staleness(self) -> int:
        """η at the start of a run: the fixed value, or for "auto" `staleness_start` (the cap
        by default) until measured windows say otherwise."""
        if not self.auto_staleness:
            return int(self.max_staleness)
        return self.staleness_cap if self.staleness_start == "cap" else int(self.staleness_start)

    @property
    def readiness_unit(self) -> str:
        """"group" or "episode" for this config's estimator (see `readiness_unit`)."""
        return readiness_unit(self.advantage)


def _check(ok: bool, field: str, value: object, fix: str) -> None:
    if not ok:
        raise ValueError(f"LearnerConfig.{field}={value!r} is invalid: {fix}")
