"""Reading a producer's message: its rows in wire form (`WireRows`), checked in one pass.

The buffer is one actor on everyone's path and a message is a handful of rows, so what it
pays per message is a count of calls, not a volume of bytes. The wire form already holds
the per-row scalars as one numpy structured array and the ids and labels as lists, so the
checks here are a few numpy and set operations; the buffer adds the checks against its own
state.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from buffers.schema import (
    BODY_SCHEMA, LABEL_NAMES, StepBatch, WireRows, records_to_wire, split_rows,
)

# Per-row scalars the buffer keeps in numpy state, one array per column indexed by row, so
# `sample` gathers each with one fancy index. A column kept in the Arrow chunks instead
# costs `sample` a slice and a concatenate per unit, touching that chunk's metadata cold.
FIXED_COLUMNS = {"turn": np.int16, "group_size": np.int16, "candidate": np.int16,
                 "created_at": np.int64, "group_key": "V16"}  # created_at in microseconds
# Held as int32 codes; model_id is not: a buffer holds one model (checked on arrival).
LABEL_COLUMNS = tuple(name for name in LABEL_NAMES if name != "model_id")
# The chunks keep only the variable-length columns: the wire form's Arrow part, as it came.
STORED_SCHEMA = BODY_SCHEMA
_EPISODE_AT = BODY_SCHEMA.get_field_index("episode_id")


def as_wire(rows) -> tuple[WireRows, int]:
    """A producer's message in wire form and the size of its received Arrow part in bytes.

    A received `StepBatch` is used as it arrived; a table, record batch or StepRecords in
    the same process are split here (token buffers are not copied).
    """
    if isinstance(rows, StepBatch):
        return rows.wire, rows.wire_nbytes
    if isinstance(rows, pa.RecordBatch):
        rows = pa.Table.from_batches([rows])
    elif not isinstance(rows, pa.Table):
        return records_to_wire(list(rows)), 0
    return split_rows(rows), 0


@dataclass(frozen=True)
class Arrival:
    """What the buffer keeps of one message's rows, read and checked; N rows."""

    rows: WireRows
    units: dict  # unit id -> positions of its rows in the message, units in order of first appearance
    unit_size: dict  # unit id -> group_size of its rows (group readiness only)
    rewards: np.ndarray | None  # float32 [N, len(REWARD_COLUMNS)], NaN = null; None: all null
    created_at: np.ndarray  # float64 [N] seconds


def read_arrival(rows: WireRows, model_id: str, group_mode: bool) -> Arrival:
    """Check a message's rows (model, repeated ids, group sizes, rewards) and group them.

    Raises ValueError naming the first offending row; nothing is changed anywhere.
    """
    n = len(rows.step_ids)
    if len(rows.scalars) != n or rows.body.num_rows != n:
        raise ValueError(f"a message of {n} step ids carries {len(rows.scalars)} scalar rows "
                         f"and {rows.body.num_rows} Arrow rows; they must match")
    models = rows.labels["model_id"]
    if models.count(model_id) != n:
        other = next(m for m in models if m != model_id)
        raise ValueError(f"rows for model {other!r} sent to the buffer of {model_id!r}")
    if len(set(rows.step_ids)) != n:
        raise ValueError("try_add got the same step_id twice in one call")
    s = rows.scalars
    uids = s["group_key"].tolist() if group_mode else rows.body.column(_EPISODE_AT).to_pylist()
    units: dict = {}
    for i, uid in enumerate(uids):
        members = units.get(uid)
        if members is None:
            units[uid] = [i]
        else:
            members.append(i)
    unit_size = {}
    if group_mode:
        sizes = s["group_size"].tolist()
        for uid, members in units.items():
            size = unit_size[uid] = sizes[members[0]]
            for i in members:
                if sizes[i] != size:
                    raise ValueError(f"row {rows.step_ids[i]}: group_size {sizes[i]} differs from its group's {size}")
    rewards = s["rewards"]
    given = ~np.isnan(rewards)
    if not given.any():
        rewards = None  # the usual case: rewards come later
    elif not np.isfinite(rewards[given]).all():
        raise ValueError("rewards must be finite or null")
    return Arrival(rows, units, unit_size, rewards, s["created_at"] / 1e6)


class LabelCodes:
    """Value -> int32 code of each label column; a column has a few values over a run."""

    def __init__(self) -> None:
        self._codes = {name: {None: -1} for name in LABEL_COLUMNS}  # -1: null
        self._dictionaries: dict = {}  # name -> its values as an Arrow array, built on use

    def encode(self, name: str, values: list) -> list[int]:
        """Codes of `values`, a value never seen before numbered as it first appears."""
        codes = self._codes[name]
        new = set(values).difference(codes)
        if new:
            for value in new:
                codes[value] = len(codes) - 1
            self._dictionaries.pop(name, None)
        return [codes[v] for v in values]

    def column(self, name: str, codes: np.ndarray) -> pa.DictionaryArray:
        """The dictionary column of `codes` (int32 [N], -1 = null), one dictionary: nothing to merge."""
        dictionary = self._dictionaries.get(name)
        if dictionary is None:
            dictionary = self._dictionaries[name] = pa.array(list(self._codes[name])[1:], pa.string())
        nulls = codes < 0
        return pa.DictionaryArray.from_arrays(pa.array(codes, mask=nulls if nulls.any() else None), dictionary)
