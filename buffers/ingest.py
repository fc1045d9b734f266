"""Turning a producer's message into checked Arrow rows for a replay buffer."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from buffers.schema import STEP_SCHEMA, StepBatch, records_to_table


def as_table(rows) -> tuple[pa.Table, int]:
    """A producer's message as a STEP_SCHEMA table (no copy) and its received size in bytes."""
    wire_nbytes = 0
    if isinstance(rows, StepBatch):
        rows, wire_nbytes = rows.table, rows.wire_nbytes
    if isinstance(rows, pa.RecordBatch):
        rows = pa.Table.from_batches([rows])
    elif not isinstance(rows, pa.Table):
        rows = records_to_table(list(rows))
    if not rows.schema.equals(STEP_SCHEMA):
        raise ValueError(f"rows must be in STEP_SCHEMA (build them with records_to_table); got\n{rows.schema}")
    return rows, wire_nbytes


@dataclass(frozen=True)
class Arrival:
    """Per-row and per-unit arrays of one validated arrival; unit u is `uids[u]`."""

    step_ids: np.ndarray  # object [N]
    codes: np.ndarray  # int [N]: unit index of each row
    uids: list  # [U] unit ids in order of first appearance
    first: np.ndarray  # int [U]: first row of each unit
    counts: np.ndarray  # int [U]: rows of each unit in this arrival
    group_size: np.ndarray  # int16 [N]
    rewards: np.ndarray  # float32 [N, len(REWARD_COLUMNS)], NaN = null
    created_at: np.ndarray  # float64 [N] seconds


def other_values(column: pa.ChunkedArray, expected: str) -> list:
    """Values of a dictionary column other than `expected`, read from its dictionaries only."""
    others = []
    for chunk in column.chunks:
        values = chunk.dictionary.to_pylist()
        if values != [expected] or chunk.null_count:
            used = pc.unique(chunk.indices).to_pylist()
            others += [values[i] if i is not None else None for i in used if i is None or values[i] != expected]
    return others
