"""Per-model replay buffer: rows wait for rewards, units become ready, learners sample them.

The buffer owns the rows of one model (DESIGN §2-§5). Token columns live in Arrow record
batches ("chunks") built once per batch of arrivals and never mutated; everything that
changes after arrival (status, reward components, rewarded_at) lives in numpy arrays indexed
by row id. Row ids are absolute and never renumbered, so the step_id index and the units'
row lists stay valid while memory is reclaimed: a chunk whose rows are all gone is freed, a
chunk that is mostly gone is rewritten with its live rows, and the state arrays drop their
dead prefix when they need room.

A plain class: `runtime/` wraps it as an actor; unit tests build it directly.
"""
from __future__ import annotations

import heapq
import math
import sys
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from buffers.schema import (
    DROP_REASONS, REWARD_COLUMNS, STEP_SCHEMA, RewardCommit, Status, StepRecord,
    records_to_table,
)

READINESS_MODES = ("group", "episode")
# Columns that change after arrival; the chunks store every other column of STEP_SCHEMA.
_MUTABLE_COLUMNS = (*REWARD_COLUMNS, "status", "rewarded_at")
_STORED_SCHEMA = pa.schema([f for f in STEP_SCHEMA if f.name not in _MUTABLE_COLUMNS])
_PENDING, _READY, _FAILED, _DROPPED = (int(s) for s in Status)  # plain ints: enum lookups are slow in hot loops
_STAGE_ROWS = 512  # arrivals are converted to Arrow in batches of about this many rows
# A chunk with more dead rows than this fraction is rewritten with its live rows. At 1/2 a row
# is copied about once more over its life (rewrites shrink geometrically) while resident bytes
# stay under twice the live bytes; lower values trade copies for memory.
_REWRITE_DEAD_FRACTION = 0.5


@dataclass(frozen=True)
class BufferConfig:
    """Capacity and readiness rules of one model's buffer."""

    capacity_rows: int = 4096  # rows held at most (pending+ready); try_add beyond it is refused (backpressure)
    readiness: str = "group"  # "group" (unit = group_key, complete at group_size rows) or "episode" (unit = episode_id, complete when sealed)
    min_group_size: int = 1  # a unit whose surviving rows (after FAILED/stale removal) fall below this is dropped as "incomplete"
    unit_timeout_s: float = 600.0  # a unit not complete this long after its first row is dropped as "timeout"

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
    backpressure_refusals: int  # try_add calls refused for capacity
    resident_bytes: int  # Arrow buffers + numpy state + index structures


class _Unit:
    """Rows sharing a readiness unit; `rows` lists the live row ids in arrival order."""

    __slots__ = ("uid", "rows", "expected", "received", "rewarded", "first_at", "ready_at", "closed")

    def __init__(self, uid, expected: int | None, first_at: float) -> None:
        self.uid = uid
        self.rows: list[int] = []
        self.expected = expected  # rows this unit will receive in total; None until sealed
        self.received = 0  # rows ever received, including removed ones
        self.rewarded = 0  # live rows with status READY
        self.first_at = first_at
        self.ready_at: float | None = None
        self.closed = False


class _Chunk:
    """One immutable Arrow batch holding rows [start, stop); `row_ids` is set once rewritten."""

    __slots__ = ("start", "stop", "batch", "row_ids")

    def __init__(self, start: int, stop: int, batch: pa.RecordBatch) -> None:
        self.start, self.stop, self.batch = start, stop, batch
        self.row_ids: np.ndarray | None = None  # sorted ids of the rows kept by a rewrite


class ReplayBuffer:
    """Rows of one model, grouped into readiness units, sampled oldest-ready-first."""

    def __init__(self, model_id: str, cfg: BufferConfig) -> None:
        self.model_id = model_id
        self.cfg = cfg
        self._base = 0  # row id stored at slot 0 of the state arrays
        self._end = 0  # next row id
        slots = 1024
        self._status = np.zeros(slots, np.int8)
        self._alive = np.zeros(slots, bool)
        self._rewards = np.full((slots, len(REWARD_COLUMNS)), np.nan, np.float32)  # NaN = null
        self._rewarded_at = np.full(slots, np.nan)
        self._behavior_version = np.zeros(slots, np.int32)
        self._row_unit: list[_Unit | None] = []  # slot -> unit
        self._row_step: list[str | None] = []  # slot -> step_id
        self._index: dict[str, int] = {}  # step_id -> row id, live rows only
        self._chunks: list[_Chunk] = []
        self._staged: list[StepRecord] = []  # accepted rows not yet converted to Arrow
        self._units: dict = {}
        self._ready: OrderedDict = OrderedDict()  # complete units in the order they became ready
        self._deadlines: list = []  # heap of (first_at, seq, unit) for timeouts
        self._seq = 0
        self._closed: OrderedDict = OrderedDict()  # recently closed unit id -> reason or None
        self._live = 0
        self._rows_added = self._rows_trained = self._late = self._refusals = 0
        self._dropped = Counter({reason: 0 for reason in DROP_REASONS})
        self._dropped_units = 0

    # ----------------------------------------------------------------- arrivals
    def try_add(self, records: list[StepRecord]) -> bool:
        """Accept all records or none; False (a counted refusal) when capacity would be exceeded.

        Raises ValueError for rows that can never be accepted (another model's rows, a repeated
        step_id, more rows than the unit expects, a batch larger than the whole capacity).
        """
        n = len(records)
        if n == 0:
            return True
        if n > self.cfg.capacity_rows:
            raise ValueError(f"{n} rows in one try_add exceed capacity_rows={self.cfg.capacity_rows}; raise capacity_rows")
        group_mode = self.cfg.readiness == "group"
        arriving: Counter = Counter()
        for r in records:  # validate everything before mutating anything (all-or-nothing)
            if r.model_id != self.model_id:
                raise ValueError(f"row {r.step_id} is for model {r.model_id!r}, this buffer holds {self.model_id!r}")
            if r.step_id in self._index:
                raise ValueError(f"row {r.step_id} was already added")
            uid = r.group_key if group_mode else r.episode_id
            arriving[uid] += 1
            unit = self._units.get(uid)
            expected = r.group_size if group_mode else (unit.expected if unit else None)
            if group_mode and unit is not None and unit.expected != r.group_size:
                raise ValueError(f"row {r.step_id}: group_size {r.group_size} differs from its group's {unit.expected}")
            if self._closed.get(uid, "") is None:
                raise ValueError(f"row {r.step_id} arrived for a unit that was already trained")
            if expected is not None and (unit.received if unit else 0) + arriving[uid] > expected:
                raise ValueError(f"row {r.step_id}: its unit {uid!r} expects {expected} rows and got more")
        if len({r.step_id for r in records}) != n:
            raise ValueError("try_add got the same step_id twice in one call")
        # refused only after validation, so a malformed batch fails loudly even when full
        if self._live + n > self.cfg.capacity_rows:
            self._refusals += 1
            return False
        self._ensure_slots(n)
        now = time.time()
        late: list[tuple[int, str]] = []
        for r in records:
            row, slot = self._end, self._end - self._base
            self._end += 1
            uid = r.group_key if group_mode else r.episode_id
            self._index[r.step_id] = row
            self._row_step.append(r.step_id)
            self._alive[slot] = True
            if uid in self._closed:  # its unit was dropped: the row follows it at once
                self._row_unit.append(None)
                late.append((row, self._closed[uid]))
                continue
            unit = self._units.get(uid)
            if unit is None:
                unit = self._new_unit(uid, r.group_size if group_mode else None, r.created_at)
            unit.received += 1
            unit.rows.append(row)
            self._row_unit.append(unit)
            if r.reward is not None:
                self._status[slot] = _READY
                self._rewarded_at[slot] = r.created_at
                unit.rewarded += 1
            else:
                self._status[slot] = _PENDING
            self._rewards[slot] = [math.nan if v is None else v for v in
                                   (r.reward_local, r.reward_team, r.coach_score, r.outcome, r.reward)]
        self._staged.extend(records)
        self._live += n
        self._rows_added += n
        for row, reason in late:
            self._kill(row, reason)
        for unit in {id(u): u for u in self._row_unit[-n:] if u is not None}.values():
            self._check(unit, now)
        if len(self._staged) >= _STAGE_ROWS:
            self._materialize()
        return True

    def commit_rewards(self, commits: list[RewardCommit]) -> None:
        """Apply reward components by step_id; unknown ids count as late commits."""
        for c in commits:
            values = (c.reward_local, c.reward_team, c.coach_score, c.outcome, c.reward)
            if any(v is not None and not math.isfinite(v) for v in values):
                raise ValueError(f"commit for {c.step_id}: rewards must be finite, got {values}")
        now = time.time()
        for c in commits:
            row = self._index.get(c.step_id)
            if row is None:
                self._late += 1
                continue
            slot, unit = row - self._base, self._row_unit[row - self._base]
            if c.failed_reason is not None:
                self._status[slot] = _FAILED
                self._remove_from_unit(row, "failed", now)
                continue
            current = self._rewards[slot]
            for k, v in enumerate((c.reward_local, c.reward_team, c.coach_score, c.outcome, c.reward)):
                if v is not None:
                    current[k] = v
            if c.reward is not None and self._status[slot] == _PENDING:
                self._status[slot] = _READY
                self._rewarded_at[slot] = now
                unit.rewarded += 1
                self._check(unit, now)

    def seal_episode(self, episode_id: str, num_rows: int) -> None:
        """Episode readiness: this buffer will receive `num_rows` rows of the episode in total."""
        if self.cfg.readiness != "episode":
            raise ValueError(f"seal_episode needs readiness='episode'; this buffer uses {self.cfg.readiness!r}")
        if episode_id in self._closed or num_rows == 0:
            return  # already dropped (e.g. timed out) or nothing of it goes to this model
        unit = self._units.get(episode_id) or self._new_unit(episode_id, None, time.time())
        if num_rows < unit.received:
            raise ValueError(f"episode {episode_id}: sealed at {num_rows} rows but {unit.received} arrived")
        unit.expected = num_rows
        self._check(unit, time.time())

    def drop_episode(self, episode_id: str, reason: str) -> int:
        """Drop every held row of an episode (a lost rollout) under `reason`; returns rows dropped.

        In group mode the episode's rows leave their groups like FAILED rows; a group left empty
        is closed, other groups still missing rows of the lost episode end by timeout.
        """
        _check_reason(reason)
        self._materialize()
        now = time.time()
        if self.cfg.readiness == "episode":
            unit = self._units.get(episode_id)
            dropped = self._drop_unit(unit, reason) if unit is not None else 0
            self._reclaim()
            return dropped
        rows = self._rows_of_episode(episode_id)
        touched = {}
        for row in rows:  # every row goes under `reason` before any unit is re-evaluated
            unit = self._row_unit[row - self._base]
            touched[id(unit)] = unit
            self._detach(row)
            self._kill(row, reason)
        for unit in touched.values():
            if not unit.rows:
                self._drop_unit(unit, reason)
            else:
                self._check(unit, now)
        self._reclaim()
        return len(rows)

    # ----------------------------------------------------------------- learner side
    def sample(self, num_units: int, current_version: int, max_staleness: int,
               now: float | None = None) -> ReadyBatch | None:
        """Drop stale rows and expired units, then hand out the `num_units` oldest-ready units.

        Returns None (and keeps every ready unit) when fewer than `num_units` are complete.
        """
        now = time.time() if now is None else now
        self._materialize()
        self._drop_stale(current_version - max_staleness, now)
        while self._deadlines and self._deadlines[0][0] + self.cfg.unit_timeout_s < now:
            unit = heapq.heappop(self._deadlines)[2]
            if not unit.closed and unit.ready_at is None:
                self._drop_unit(unit, "timeout")
        if len(self._ready) < num_units:
            self._reclaim()
            return None
        units = [self._ready.popitem(last=False)[1] for _ in range(num_units)]
        sizes = np.fromiter((len(u.rows) for u in units), np.int64, count=num_units)
        offsets = np.zeros(num_units + 1, np.int64)
        np.cumsum(sizes, out=offsets[1:])
        rows = np.fromiter((r for u in units for r in u.rows), np.int64, count=int(offsets[-1]))
        table = self._assemble(rows)
        staleness = (current_version - self._behavior_version[rows - self._base]).astype(np.int32)
        for unit in units:
            self._close(unit, None)
        for row in rows.tolist():
            self._kill(row, None)
        self._rows_trained += len(rows)
        self._reclaim()
        ready_at = np.array([u.ready_at for u in units], np.float64)
        return ReadyBatch(table, [u.uid for u in units], staleness, current_version, offsets, ready_at)

    def drain(self, reason: str = "run_stopped") -> int:
        """Drop every held row under `reason` (end-of-run accounting); returns rows dropped."""
        _check_reason(reason)
        held = self._live
        for unit in list(self._units.values()):
            self._drop_unit(unit, reason)
        self._materialize()
        self._reclaim()
        return held

    def take_dropped_units(self) -> int:
        """Units dropped since the last call (the clock gives their budget back)."""
        count, self._dropped_units = self._dropped_units, 0
        return count

    def stats(self) -> BufferStats:
        """Counters and resident bytes; converts staged rows so the bytes are accurate."""
        self._materialize()
        slots = self._end - self._base
        live = self._alive[:slots]
        ready_rows = int(np.count_nonzero(live & (self._status[:slots] == _READY)))
        arrow = sum(c.batch.get_total_buffer_size() for c in self._chunks if c.batch is not None)
        arrays = (self._status, self._alive, self._rewards, self._rewarded_at, self._behavior_version)
        index = sys.getsizeof(self._index) + sum(sys.getsizeof(k) for k in self._index)
        lists = sys.getsizeof(self._row_unit) + sys.getsizeof(self._row_step)
        units = sum(sys.getsizeof(u) + sys.getsizeof(u.rows) for u in self._units.values())
        return BufferStats(
            pending_rows=self._live - ready_rows, ready_rows=ready_rows, ready_units=len(self._ready),
            rows_added=self._rows_added, rows_trained=self._rows_trained, dropped=dict(self._dropped),
            late_commits=self._late, backpressure_refusals=self._refusals,
            resident_bytes=int(arrow + sum(a.nbytes for a in arrays) + index + lists + units),
        )

    # ----------------------------------------------------------------- units
    def _new_unit(self, uid, expected: int | None, first_at: float) -> _Unit:
        unit = _Unit(uid, expected, first_at)
        self._units[uid] = unit
        self._seq += 1
        heapq.heappush(self._deadlines, (first_at, self._seq, unit))
        return unit

    def _check(self, unit: _Unit, now: float) -> None:
        """Re-evaluate a unit after a change: mark it ready, or drop it as incomplete."""
        if unit.closed or unit.expected is None or unit.received < unit.expected:
            return
        if len(unit.rows) < self.cfg.min_group_size:
            self._drop_unit(unit, "incomplete")
        elif unit.ready_at is None and unit.rewarded == len(unit.rows):
            unit.ready_at = now
            self._ready[unit.uid] = unit

    def _remove_from_unit(self, row: int, reason: str, now: float) -> None:
        """Drop one row and leave its unit to carry on without it."""
        unit = self._row_unit[row - self._base]
        self._detach(row)
        self._kill(row, reason)
        self._check(unit, now)

    def _detach(self, row: int) -> None:
        """Take a live row out of its unit's counts (the unit keeps its `received`)."""
        unit = self._row_unit[row - self._base]
        if self._status[row - self._base] == _READY:
            unit.rewarded -= 1
        unit.rows.remove(row)

    def _drop_unit(self, unit: _Unit, reason: str) -> int:
        rows = list(unit.rows)
        for row in rows:
            self._kill(row, reason)
        self._close(unit, reason)
        self._dropped_units += 1
        return len(rows)

    def _close(self, unit: _Unit, reason: str | None) -> None:
        """Forget a unit, remembering for a while how it ended (None = trained)."""
        unit.closed = True
        del self._units[unit.uid]
        self._ready.pop(unit.uid, None)
        self._closed[unit.uid] = reason
        # bounded memory: a row arriving later than this many closures is treated as new
        while len(self._closed) > 4 * self.cfg.capacity_rows:
            self._closed.popitem(last=False)

    def _drop_stale(self, oldest_allowed: int, now: float) -> None:
        slots = self._end - self._base
        stale = self._alive[:slots] & (self._behavior_version[:slots] < oldest_allowed)
        for row in (np.flatnonzero(stale) + self._base).tolist():
            if not self._alive[row - self._base]:
                continue  # its whole unit was dropped by an earlier stale row
            self._remove_from_unit(row, "stale", now)

    # ----------------------------------------------------------------- rows and memory
    def _kill(self, row: int, reason: str | None) -> None:
        """Retire a live row: trained (reason None) or dropped under `reason`."""
        slot = row - self._base
        self._alive[slot] = False
        if reason is not None:
            if self._status[slot] != _FAILED:
                self._status[slot] = _DROPPED
            self._dropped[reason] += 1
        del self._index[self._row_step[slot]]
        self._row_step[slot] = None
        self._row_unit[slot] = None
        self._live -= 1

    def _ensure_slots(self, n: int) -> None:
        """Room for n more rows: first drop the dead prefix, then grow by doubling."""
        used = self._end - self._base
        if used + n <= len(self._status):
            return
        live_slots = np.flatnonzero(self._alive[:used])
        shift = int(live_slots[0]) if len(live_slots) else used
        size = len(self._status)
        while used - shift + n > size:
            size *= 2
        # null rewards and timestamps are NaN, so fresh slots must start as NaN
        fills = {"_status": 0, "_alive": False, "_rewards": np.nan, "_rewarded_at": np.nan,
                 "_behavior_version": 0}
        for name, fill in fills.items():
            old = getattr(self, name)
            new = np.full((size,) + old.shape[1:], fill, old.dtype)
            new[: used - shift] = old[shift:used]
            setattr(self, name, new)
        del self._row_unit[:shift], self._row_step[:shift]
        self._base += shift

    def _materialize(self) -> None:
        """Convert staged records into one Arrow chunk (one conversion per many arrivals)."""
        if not self._staged:
            return
        table = records_to_table(self._staged).select(_STORED_SCHEMA.names)
        start, stop = self._end - len(self._staged), self._end  # staged rows are the newest
        bv = table.column("behavior_version").to_numpy()
        self._behavior_version[start - self._base: stop - self._base] = bv
        batch = table.combine_chunks().to_batches()[0]
        self._chunks.append(_Chunk(start, stop, batch))
        self._staged = []

    def _reclaim(self) -> None:
        """Free chunks whose rows are all gone; rewrite chunks that are mostly gone."""
        kept = []
        for chunk in self._chunks:
            lo, hi = chunk.start - self._base, chunk.stop - self._base
            alive = np.flatnonzero(self._alive[max(lo, 0):hi]) + max(lo, 0) + self._base
            if len(alive) == 0:
                continue
            held = chunk.batch.num_rows
            if held - len(alive) > _REWRITE_DEAD_FRACTION * held:
                chunk.batch = chunk.batch.take(pa.array(self._locals(chunk, alive)))
                chunk.row_ids = alive
            kept.append(chunk)
        self._chunks = kept

    def _locals(self, chunk: _Chunk, rows: np.ndarray) -> np.ndarray:
        return rows - chunk.start if chunk.row_ids is None else np.searchsorted(chunk.row_ids, rows)

    def _assemble(self, rows: np.ndarray) -> pa.Table:
        """STEP_SCHEMA table of `rows` in the given order, one chunk.

        Rows arrive in runs of consecutive ids (a unit's candidates are sent together), so each
        run becomes a zero-copy slice and a single concatenate makes the result contiguous.
        """
        starts = np.fromiter((c.start for c in self._chunks), np.int64, count=len(self._chunks))
        which = np.searchsorted(starts, rows, side="right") - 1
        local = np.empty_like(rows)
        for k in np.unique(which).tolist():
            mask = which == k
            local[mask] = self._locals(self._chunks[k], rows[mask])
        breaks = np.flatnonzero((np.diff(which) != 0) | (np.diff(local) != 1)) + 1
        bounds = np.concatenate(([0], breaks, [len(rows)])).tolist()
        pieces = [self._chunks[which[a]].batch.slice(int(local[a]), b - a)
                  for a, b in zip(bounds[:-1], bounds[1:])]
        stored = pa.Table.from_batches(pieces, schema=_STORED_SCHEMA).combine_chunks()
        slots = rows - self._base
        columns = {name: stored.column(name) for name in _STORED_SCHEMA.names}
        rewards = self._rewards[slots]
        for k, name in enumerate(REWARD_COLUMNS):
            columns[name] = pa.array(rewards[:, k], pa.float32(), mask=np.isnan(rewards[:, k]))
        columns["status"] = pa.array(np.full(len(rows), _READY, np.int8))
        micros = (self._rewarded_at[slots] * 1e6).astype(np.int64)
        columns["rewarded_at"] = pa.array(micros, pa.timestamp("us"))
        return pa.Table.from_arrays([columns[f.name] for f in STEP_SCHEMA], schema=STEP_SCHEMA)

    def _rows_of_episode(self, episode_id: str) -> list[int]:
        """Live row ids of an episode, found with a vectorized scan of the episode_id column."""
        found = []
        for chunk in self._chunks:
            hits = np.flatnonzero(pc.equal(chunk.batch.column("episode_id"), episode_id).to_numpy(zero_copy_only=False))
            rows = hits + chunk.start if chunk.row_ids is None else chunk.row_ids[hits]
            found.extend(r for r in rows.tolist() if r >= self._base and self._alive[r - self._base])
        return found


def _check_reason(reason: str) -> None:
    if reason not in DROP_REASONS:
        raise ValueError(f"drop reason {reason!r} is not one of {DROP_REASONS}; add it to DROP_REASONS or use one of them")
