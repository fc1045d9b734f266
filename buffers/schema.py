"""The step row: one row per candidate of one agent action (DESIGN §3), declared once.

Everything that reads or writes rows (buffers, learners, metrics, exports) uses the names
declared here. Token columns travel as numpy arrays inside `StepRecord` so a batch of records
becomes Arrow columns with one concatenate per column (no per-token Python objects).
"""
from __future__ import annotations

import enum
import hashlib
import time
import uuid
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa


class Status(enum.IntEnum):
    """Lifecycle of a row; stored in the int8 `status` column."""

    PENDING = 0  # waiting for at least one reward component
    READY = 1  # rewarded; its unit may still wait for siblings
    FAILED = 2  # a reward source gave up (coach unparsable, sandbox crash)
    DROPPED = 3  # removed before training, with a counted reason


# Reasons a row leaves the buffer without being trained. Counters are keyed by these names.
DROP_REASONS = ("stale", "incomplete", "failed", "timeout", "capacity", "run_stopped")

_dict_str = pa.dictionary(pa.int32(), pa.string())

STEP_SCHEMA = pa.schema(
    [
        pa.field("step_id", pa.string(), nullable=False),
        pa.field("run_id", _dict_str),
        pa.field("model_id", _dict_str),
        pa.field("agent", _dict_str),
        pa.field("workflow", _dict_str),
        pa.field("task_id", pa.string()),
        pa.field("episode_id", pa.string()),
        pa.field("branch", pa.string()),
        pa.field("turn", pa.int16()),
        pa.field("group_key", pa.binary(16)),
        pa.field("group_size", pa.int16()),
        pa.field("candidate", pa.int16()),
        pa.field("prompt_ids", pa.large_list(pa.int32())),
        pa.field("response_ids", pa.large_list(pa.int32())),
        pa.field("behavior_logprobs", pa.large_list(pa.float32())),
        pa.field("token_versions", pa.large_list(pa.int32())),
        pa.field("behavior_version", pa.int32()),
        pa.field("finish_reason", _dict_str),
        pa.field("reward_local", pa.float32()),
        pa.field("reward_team", pa.float32()),
        pa.field("coach_score", pa.float32()),
        pa.field("outcome", pa.float32()),
        pa.field("reward", pa.float32()),
        pa.field("status", pa.int8()),
        pa.field("created_at", pa.timestamp("us")),
        pa.field("rewarded_at", pa.timestamp("us")),
        pa.field("meta", pa.string()),
    ]
)

REWARD_COLUMNS = ("reward_local", "reward_team", "coach_score", "outcome", "reward")


def group_key(task_id: str, round_id: str, parent_branch: str, agent: str, turn: int) -> bytes:
    """blake2b-128 of the named fields (DESIGN §4); never built from row positions.

    Fields are joined with a separator byte that cannot appear in them, so ("a", "bc") and
    ("ab", "c") hash differently.
    """
    h = hashlib.blake2b(digest_size=16)
    for part in (task_id, round_id, parent_branch, agent, str(int(turn))):
        h.update(part.encode("utf-8"))
        h.update(b"\x1f")
    return h.digest()


def new_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class StepRecord:
    """One candidate of one agent action, as the rollout side hands it to a buffer.

    `response_ids`, `behavior_logprobs` and `token_versions` share one length (the number of
    generated tokens); `prompt_ids` is the exact prompt fed to the engine. Reward fields that
    are already known (rule rewards computed inline) may be set; `reward` set means the row
    needs nothing more.
    """

    step_id: str
    run_id: str
    model_id: str
    agent: str
    workflow: str
    task_id: str
    episode_id: str
    branch: str
    turn: int
    group_key: bytes
    group_size: int
    candidate: int
    prompt_ids: np.ndarray  # int32 [P]
    response_ids: np.ndarray  # int32 [R]
    behavior_logprobs: np.ndarray  # float32 [R]
    token_versions: np.ndarray  # int32 [R]
    finish_reason: str
    reward_local: float | None = None
    reward_team: float | None = None
    coach_score: float | None = None
    outcome: float | None = None
    reward: float | None = None
    created_at: float = field(default_factory=time.time)
    meta: str = "{}"

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        if len(self.behavior_logprobs) != n or len(self.token_versions) != n:
            raise ValueError(
                f"StepRecord {self.step_id}: response_ids ({n}), behavior_logprobs "
                f"({len(self.behavior_logprobs)}) and token_versions ({len(self.token_versions)}) "
                "must have the same length"
            )
        if len(self.group_key) != 16:
            raise ValueError(f"StepRecord {self.step_id}: group_key must be 16 bytes")

    @property
    def behavior_version(self) -> int:
        """The oldest weight version that produced any token of this response."""
        return int(self.token_versions.min()) if len(self.token_versions) else -1


@dataclass(frozen=True)
class RewardCommit:
    """A reward (or a failure) for one row, sent by a reward source after the fact.

    Components left None are not changed. `reward` set completes the row. `failed_reason`
    set marks the row FAILED (it is removed from its unit and counted under that reason).
    """

    step_id: str
    reward: float | None = None
    reward_local: float | None = None
    reward_team: float | None = None
    coach_score: float | None = None
    outcome: float | None = None
    failed_reason: str | None = None


def records_to_table(records: list[StepRecord]) -> pa.Table:
    """Build an Arrow table in STEP_SCHEMA from records: one concatenate per token column."""
    n = len(records)

    def token_column(name: str, dtype) -> pa.Array:
        arrays = [np.asarray(getattr(r, name), dtype=dtype) for r in records]
        lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=n)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        values = np.concatenate(arrays) if n else np.zeros(0, dtype=dtype)
        return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values))

    def col(name: str):
        return [getattr(r, name) for r in records]

    def ts(values: list[float | None]) -> pa.Array:
        return pa.array(
            [None if v is None else int(v * 1e6) for v in values], type=pa.timestamp("us")
        )

    behavior_version = [r.behavior_version for r in records]
    status = [int(Status.READY if r.reward is not None else Status.PENDING) for r in records]
    rewarded_at = [r.created_at if r.reward is not None else None for r in records]
    arrays = {
        "step_id": pa.array(col("step_id"), pa.string()),
        "run_id": pa.array(col("run_id")).dictionary_encode(),
        "model_id": pa.array(col("model_id")).dictionary_encode(),
        "agent": pa.array(col("agent")).dictionary_encode(),
        "workflow": pa.array(col("workflow")).dictionary_encode(),
        "task_id": pa.array(col("task_id"), pa.string()),
        "episode_id": pa.array(col("episode_id"), pa.string()),
        "branch": pa.array(col("branch"), pa.string()),
        "turn": pa.array(col("turn"), pa.int16()),
        "group_key": pa.array(col("group_key"), pa.binary(16)),
        "group_size": pa.array(col("group_size"), pa.int16()),
        "candidate": pa.array(col("candidate"), pa.int16()),
        "prompt_ids": token_column("prompt_ids", np.int32),
        "response_ids": token_column("response_ids", np.int32),
        "behavior_logprobs": token_column("behavior_logprobs", np.float32),
        "token_versions": token_column("token_versions", np.int32),
        "behavior_version": pa.array(behavior_version, pa.int32()),
        "finish_reason": pa.array(col("finish_reason"), pa.string()).dictionary_encode(),
        **{name: pa.array(col(name), pa.float32()) for name in REWARD_COLUMNS},
        "status": pa.array(status, pa.int8()),
        "created_at": ts(col("created_at")),
        "rewarded_at": ts(rewarded_at),
        "meta": pa.array(col("meta"), pa.string()),
    }
    # dictionary_encode yields int32 indices over string values, matching STEP_SCHEMA.
    return pa.Table.from_arrays([arrays[f.name] for f in STEP_SCHEMA], schema=STEP_SCHEMA)
