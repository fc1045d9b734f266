"""Reading a producer's message: its rows as one WIRE_SCHEMA record batch, checked in one pass.

The buffer is one actor on everyone's path, and a message is a handful of rows, so what it
pays per message is a count of Arrow/numpy calls, not a volume of bytes. This module reads
the few columns the buffer needs by position, each with one call, and does the checks that
need only the message itself; the buffer adds the checks against its own state.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from buffers.schema import REWARD_COLUMNS, WIRE_SCHEMA, StepBatch, records_to_table, to_wire

_AT = {name: i for i, name in enumerate(WIRE_SCHEMA.names)}
_REWARD_AT = [_AT[name] for name in REWARD_COLUMNS]
# Fixed-width columns and low-cardinality labels live in the buffer's numpy state, one
# array per column indexed by row, so `sample` gathers each with one fancy index; a column
# kept in the chunks instead costs `sample` a slice and a concatenate per unit, touching
# that chunk's column metadata cold (measured: about 0.25 us per row per column, against
# about 0.1 us per row per column to read it into numpy state on arrival).
FIXED_COLUMNS = {"turn": np.int16, "group_size": np.int16, "candidate": np.int16,
                 "created_at": np.int64, "group_key": "V16"}  # created_at in microseconds
LABEL_COLUMNS = ("run_id", "agent", "workflow", "finish_reason")  # held as int32 codes
# The chunks keep the rest, less what the buffer holds anyway (step_id, behavior_version),
# what is the same for every row (model_id: the buffer's own) and what changes after
# arrival (rewards, status, rewarded_at).
_NOT_STORED = {"step_id", "model_id", "behavior_version", *REWARD_COLUMNS, "status", "rewarded_at",
               *FIXED_COLUMNS, *LABEL_COLUMNS}
STORED_POSITIONS = [i for i, name in enumerate(WIRE_SCHEMA.names) if name not in _NOT_STORED]
STORED_SCHEMA = pa.schema([WIRE_SCHEMA.field(i) for i in STORED_POSITIONS])
# columns read as numpy here: a null in them is a malformed message
_REQUIRED = [_AT[name] for name in ("step_id", "behavior_version", "group_key", *FIXED_COLUMNS)]


def as_wire(rows) -> tuple[pa.RecordBatch, int]:
    """A producer's message as one WIRE_SCHEMA record batch and its received size in bytes.

    A received `StepBatch` is used as it arrived; a table, record batch or StepRecords in
    the same process are converted (token buffers are not copied).
    """
    if isinstance(rows, StepBatch):
        return rows.wire, rows.wire_nbytes
    if isinstance(rows, pa.RecordBatch):
        rows = pa.Table.from_batches([rows])
    elif not isinstance(rows, pa.Table):
        rows = records_to_table(list(rows))
    return to_wire(rows), 0


@dataclass(frozen=True)
class Arrival:
    """What the buffer keeps of one message's rows, read and checked; N rows."""

    step_ids: list  # [N] str
    units: dict  # unit id -> positions of its rows in the message, units in order of first appearance
    unit_size: dict  # unit id -> group_size of its rows (group readiness only)
    rewards: np.ndarray | None  # float32 [N, len(REWARD_COLUMNS)], NaN = null; None: all null
    behavior_version: np.ndarray  # int32 [N]
    created_at: np.ndarray  # float64 [N] seconds
    fixed: dict  # FIXED_COLUMNS name -> numpy [N]
    labels: dict  # LABEL_COLUMNS name -> [N] str or None


def read_arrival(batch: pa.RecordBatch, model_id: str, group_mode: bool) -> Arrival:
    """Read and check a message's rows (model, repeated ids, group sizes, rewards, nulls).

    Raises ValueError naming the first offending row; nothing is changed anywhere.
    """
    n = batch.num_rows
    models = batch.column(_AT["model_id"]).to_pylist()
    if models.count(model_id) != n:
        other = next(m for m in models if m != model_id)
        raise ValueError(f"rows for model {other!r} sent to the buffer of {model_id!r}")
    for i in _REQUIRED:
        if batch.column(i).null_count:
            raise ValueError(f"column {WIRE_SCHEMA.names[i]} has nulls; every row needs one")
    step_ids = batch.column(_AT["step_id"]).to_pylist()
    if len(set(step_ids)) != n:
        raise ValueError("try_add got the same step_id twice in one call")
    keys = batch.column(_AT["group_key"])
    raw = keys.buffers()[1].to_pybytes()[16 * keys.offset:16 * (keys.offset + n)]  # one copy of the keys
    if group_mode:
        uids = [raw[i:i + 16] for i in range(0, 16 * n, 16)]
    else:
        uids = batch.column(_AT["episode_id"]).to_pylist()
    units: dict = {}
    for i, uid in enumerate(uids):
        members = units.get(uid)
        if members is None:
            units[uid] = [i]
        else:
            members.append(i)
    fixed = {name: batch.column(_AT[name]).to_numpy() for name in ("turn", "group_size", "candidate")}
    fixed["created_at"] = batch.column(_AT["created_at"]).to_numpy().view(np.int64)
    fixed["group_key"] = np.frombuffer(raw, "V16")
    unit_size = {}
    if group_mode:
        sizes = fixed["group_size"].tolist()
        for uid, members in units.items():
            size = unit_size[uid] = sizes[members[0]]
            for i in members:
                if sizes[i] != size:
                    raise ValueError(f"row {step_ids[i]}: group_size {sizes[i]} differs from its group's {size}")
    return Arrival(step_ids, units, unit_size, _rewards(batch, n),
                   batch.column(_AT["behavior_version"]).to_numpy(), fixed["created_at"] / 1e6,
                   fixed, {name: batch.column(_AT[name]).to_pylist() for name in LABEL_COLUMNS})


def _rewards(batch: pa.RecordBatch, n: int) -> np.ndarray | None:
    """Reward components as float32 [N, 5] with NaN for null; None when every one is null."""
    rewards = None
    for k, i in enumerate(_REWARD_AT):
        column = batch.column(i)
        if column.null_count == n:  # the usual case: rewards come later
            continue
        values = column.to_numpy(zero_copy_only=False)  # nulls become NaN
        if not np.isfinite(values[~np.isnan(values)]).all():
            raise ValueError("rewards must be finite or null")
        if rewards is None:
            rewards = np.full((n, len(REWARD_COLUMNS)), np.nan, np.float32)
        rewards[:, k] = values
    return rewards
