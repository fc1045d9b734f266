"""Public dataclasses of a replay buffer: its config and what it hands to learners and metrics."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from buffers.schema import STEP_SCHEMA

READINESS_MODES = ("group", "episode")


@dataclass(frozen=True)
class BufferConfig:
    """Capacity and readiness rules of one model's buffer."""

    capacity_rows: int = 4096  # rows held at most (pending+ready); try_add beyond it is refused (backpressure)
    readiness: str = "group"  # "group" (unit = group_key, complete at group_size rows) or "episode" (unit = episode_id, complete when sealed)
    min_group_size: int = 1  # a unit whose surviving rows (after FAILED/stale removal) fall below this is dropped as "incomplete"
    unit_timeout_s: float = 600.0  # a unit not complete this long after its first row is dropped as "timeout"
    coalesce_after: int = 0  # merge this many small producer batches (< 256 rows) into one chunk; 0 = never
    # write-ahead log (buffers/wal.py; only for a buffer given a wal_dir)
    wal_segment_bytes: int = 64 << 20  # a log segment this large is closed and a checkpoint of the held rows replaces every older file
    wal_fsync_every_write: bool = False  # fsync each logged call (survives power loss, costs a disk flush per call); off: flushed to the OS per call (survives a killed process), fsynced per segment
    wal_undo_versions: int = 16  # sampled rows stay restorable this many learner versions (or until settle_samples) so a resume from an older learner checkpoint can undo them; keep it >= the learner's checkpoint interval

    def __post_init__(self) -> None:
        if self.capacity_rows < 1:
            raise ValueError(f"capacity_rows={self.capacity_rows}: must be >= 1; raise it")
        if self.readiness not in READINESS_MODES:
            raise ValueError(
                f"readiness={self.readiness!r}: must be one of {READINESS_MODES}; use 'group' "
                "for group-relative estimators, 'episode' for return-to-go ones"
            )
        if self.min_group_size < 1:
            raise ValueError(f"min_group_size={self.min_group_size}: must be >= 1; set it to 1 or more")
        if not self.unit_timeout_s > 0:
            raise ValueError(f"unit_timeout_s={self.unit_timeout_s}: must be > 0 seconds; give a positive timeout")
        if self.wal_segment_bytes < 4096:
            raise ValueError(f"wal_segment_bytes={self.wal_segment_bytes}: must be >= 4096; the default is {64 << 20}")
        if self.wal_undo_versions < 0:
            raise ValueError(f"wal_undo_versions={self.wal_undo_versions}: must be >= 0 (0: samples are never undone)")


@dataclass(frozen=True)
class ReadyBatch:
    """Rows of complete units handed to a learner.

    `table` holds N rows in STEP_SCHEMA, one chunk, every row READY with `reward` set, rows
    of one unit contiguous; unit u spans rows `unit_offsets[u]:unit_offsets[u + 1]`.
    """

    table: pa.Table  # STEP_SCHEMA rows, status READY, ordered unit by unit
    unit_ids: list  # unit id per unit (group_key bytes or episode_id str), [U]
    staleness: np.ndarray  # int32 [N]: version - behavior_version per row
    version: int  # the learner version the batch was sampled for
    unit_offsets: np.ndarray  # int64 [U + 1]: row range of each unit in `table`
    unit_ready_at: np.ndarray  # float64 [U]: wall time each unit became complete

    def __reduce__(self):
        # the table is one chunk: pickling that record batch sends each Arrow buffer as is
        # (out-of-band under protocol 5), several times cheaper than pickling the Table
        batches = self.table.to_batches() or [pa.RecordBatch.from_pylist([], schema=STEP_SCHEMA)]
        return _ready_batch_from_record_batch, (batches[0], self.unit_ids,
                                                self.staleness, self.version, self.unit_offsets,
                                                self.unit_ready_at)


def _ready_batch_from_record_batch(batch: pa.RecordBatch, *fields) -> ReadyBatch:
    return ReadyBatch(pa.Table.from_batches([batch]), *fields)


@dataclass(frozen=True)
class BufferStats:
    """Counters of one buffer; the accounting identity is
    rows_added == rows_trained + sum(dropped.values()) + pending_rows + ready_rows."""

    pending_rows: int  # held rows still waiting for a reward
    ready_rows: int  # held rows rewarded (their unit may still wait for siblings)
    ready_units: int  # complete units waiting for a learner
    rows_added: int  # rows ever accepted by try_add
    rows_trained: int  # rows handed out by sample
    dropped: dict  # reason -> rows dropped, every DROP_REASONS key present
    late_commits: int  # commits for rows no longer held (already trained or dropped)
    repeat_commits: int  # commits refused because the row already had its reward
    backpressure_refusals: int  # try_add calls refused for capacity
    resident_bytes: int  # Arrow buffers + numpy state + index structures


@dataclass(frozen=True)
class LearnerSample:
    """One learner call's answer: a batch (or None when none came ready in time), the units
    dropped since the last answer (their admission budget goes back to the clock) and the
    buffer's counters after sampling -- one round trip instead of three."""

    batch: ReadyBatch | None
    dropped_units: int
    stats: BufferStats


@dataclass(frozen=True)
class RecoveryReport:
    """What `ReplayBuffer.recover` rebuilt from a write-ahead log, for the runtime to log."""

    rows_pending: int  # held rows waiting for a reward (their ids: `pending_step_ids()`)
    rows_ready: int  # held rows rewarded, the undone ones included
    rows_untrained: int  # rows of undone samples (taken at current_version >= learner_version), held again
    samples_undone: int  # samples undone
    undo_complete: bool  # False: some sample at a version >= learner_version was no longer kept (wal_undo_versions); its rows stay trained
    records_replayed: int  # logged calls replayed on top of the checkpoint
    segments_read: int  # files read: the checkpoint and the segment files after it
    torn_bytes: int  # bytes of an incomplete last record skipped (a write cut short by the crash)
    checkpoint: str | None  # the checkpoint file recovery started from; None: the log from its start
    seconds: float  # wall time of the recovery
