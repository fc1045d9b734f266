"""Per-model replay buffer: rows wait for rewards, units become ready, learners sample them.

The buffer owns the rows of one model (DESIGN §2-§5) and is one actor that every rollout
actor writes to and every learner reads from, so its per-row cost is the system's serial
bottleneck, and with messages of a few rows that cost is mostly a count of calls. Producers
therefore send rows already split the way the buffer keeps them (`StepBatch`, built in
parallel on the rollout side): per-row scalars as one numpy structured array, which lands
in the buffer's numpy state with one assignment per column, and the variable-length columns
(strings, tokens) as one Arrow message, kept as an immutable chunk without copying a token
(`buffers/store.py`). Everything that changes after arrival (status, reward components,
rewarded_at) lives in numpy arrays indexed by row id too; row ids are absolute and never
renumbered, so the step_id index and the units' row lists stay valid while memory is
reclaimed. `sample` copies the handed-out rows once, into one contiguous batch: a slice per
unit of the few chunk columns, one fancy index per numpy column.

With a `wal_dir` each call that changes the state is logged before it returns; `recover`
replays the log through these methods at the logged times (`_clock`): buffers/wal.py.

A plain class: `runtime/` wraps it as an actor; unit tests build it directly.
"""
from __future__ import annotations

import heapq
import logging
import sys
import time
from collections import Counter, OrderedDict
from itertools import chain

import numpy as np
import pyarrow as pa

from buffers.schema import (
    DROP_REASONS, REWARD_COLUMNS, STEP_SCHEMA, RewardColumns, RewardCommit, Status, StepBatch,
    StepRecord, WireRows,
)

from buffers import wal
from buffers.api import BufferConfig, BufferStats, ReadyBatch, RecoveryReport  # noqa: F401 (public here too)
from buffers.ingest import (
    FIXED_COLUMNS, LABEL_COLUMNS, STORED_SCHEMA, Arrival, LabelCodes, as_wire, read_arrival,
)
from buffers.store import ChunkStore, StoreConfig

log = logging.getLogger(__name__)

_PENDING, _READY, _FAILED, _DROPPED = (int(s) for s in Status)  # plain ints: enum lookups are slow in hot loops
_FIXED_TYPES = {name: STEP_SCHEMA.field(name).type for name in FIXED_COLUMNS}


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


class ReplayBuffer:
    """Rows of one model, grouped into readiness units, sampled oldest-ready-first."""

    def __init__(self, model_id: str, cfg: BufferConfig, wal_dir: str | None = None, *,
                 resume_from_version: int | None = None) -> None:
        """Logging to `wal_dir` (new or empty) unless None; with `resume_from_version`, rebuilt
        from it instead (`recover`, in a form a Ray actor's constructor can take)."""
        self.model_id = model_id
        self.cfg = cfg
        self._group_mode = cfg.readiness == "group"
        self._base = 0  # row id stored at slot 0 of the state arrays
        self._end = 0  # next row id
        slots = 256  # grows by doubling; the dead prefix is dropped first
        self._status = np.zeros(slots, np.int8)
        self._alive = np.zeros(slots, bool)
        self._rewards = np.full((slots, len(REWARD_COLUMNS)), np.nan, np.float32)  # NaN = null
        self._rewarded_at = np.full(slots, np.nan)
        self._behavior_version = np.zeros(slots, np.int32)
        self._row_unit = np.full(slots, None, object)  # slot -> _Unit
        self._row_step = np.full(slots, None, object)  # slot -> step_id
        # immutable columns held per slot (see buffers/ingest.py); labels as codes into _labels
        self._fixed = {name: np.zeros(slots, dtype) for name, dtype in FIXED_COLUMNS.items()}
        self._fixed.update({name: np.zeros(slots, np.int32) for name in LABEL_COLUMNS})
        self._labels = LabelCodes()
        self._index: dict[str, int] = {}  # step_id -> row id, live rows only
        self._store = ChunkStore(STORED_SCHEMA, StoreConfig(coalesce_after=cfg.coalesce_after))
        self._units: dict = {}
        self._ready: OrderedDict = OrderedDict()  # complete units in the order they became ready
        self._deadlines: list = []  # heap of (first_at, seq, unit) for timeouts
        self._seq = 0
        self._closed: OrderedDict = OrderedDict()  # recently closed unit id -> reason or None
        self._received: OrderedDict = OrderedDict()  # recent origin (episode id) -> rows accepted
        self._live = 0
        self._rows_added = self._rows_trained = self._late = self._refusals = self._repeats = 0
        self._dropped = Counter({reason: 0 for reason in DROP_REASONS})
        self._dropped_units = 0
        self._clock = time.time  # the one time source of every call; a log replay pins it
        self._retired: list | None = None  # (reason or None, step_ids) retired by this call, for the log
        self._wal, self._recovery = wal.attach(self, wal_dir, resume_from_version)

    @classmethod
    def recover(cls, model_id: str, cfg: BufferConfig, wal_dir: str, learner_version: int) -> ReplayBuffer:
        """The buffer the log in `wal_dir` describes, logging on there. Samples taken at
        `current_version >= learner_version` (the resumed learner checkpoint predates their step)
        are undone: their rows are ready again, first in line. See `recovery_report()`."""
        return cls(model_id, cfg, wal_dir, resume_from_version=learner_version)

    def recovery_report(self) -> RecoveryReport | None:
        """What the recovery that built this buffer found; None for a buffer built fresh."""
        return self._recovery

    def settle_samples(self, learner_version: int) -> None:
        """A learner checkpoint at `learner_version` is durable: samples below it are final."""
        self._log("settle", self._clock(), version=int(learner_version))

    def close(self) -> None:
        """Close the write-ahead log (fsynced); calls that change the buffer raise afterwards."""
        if self._wal is not None:
            self._wal.close()

    def _log(self, kind: str, now: float, **args) -> None:
        """Append this call to the write-ahead log, when there is one (buffers/wal.py)."""
        if self._wal is not None:
            self._wal.record(self, kind, now, args)

    # ----------------------------------------------------------------- arrivals
    def try_add(self, rows: StepBatch | pa.Table | pa.RecordBatch | list[StepRecord],
                origin: str | None = None) -> bool:
        """Accept all rows or none; False (a counted refusal) when capacity would be exceeded.

        `rows` is what a producer sends: a `StepBatch` (any number of rows, e.g. every episode
        of a round), or an Arrow table / record batch in STEP_SCHEMA, or StepRecords (both
        split here; token buffers are kept without copying). A row is READY on arrival when
        its `reward` is set, PENDING otherwise.

        `origin` (the episode the rows come from) is counted in `received_rows`, which the
        controller reads to reconcile a dead rollout actor's rounds with the ledger.

        Raises ValueError for rows that can never be accepted (another schema or model, a
        repeated step_id, a group_size that differs within a group, more rows than the unit
        expects, a batch larger than the whole capacity).
        """
        wire, wire_nbytes = as_wire(rows)
        n = len(wire.step_ids)
        if n == 0:
            return True
        if n > self.cfg.capacity_rows:
            raise ValueError(f"{n} rows in one try_add exceed capacity_rows={self.cfg.capacity_rows}; raise capacity_rows")
        arrival = read_arrival(wire, self.model_id, self._group_mode)
        self._validate(arrival)  # everything is checked before anything moves
        now = self._clock()
        if self._live + n > self.cfg.capacity_rows:  # refused only after validation
            self._refusals += 1
            self._log("refused", now)
            return False
        self._insert(arrival, wire_nbytes, now)
        if origin is not None:
            self._received[origin] = self._received.get(origin, 0) + n
            while len(self._received) > 4 * self.cfg.capacity_rows:  # bounded, as _closed
                self._received.popitem(last=False)
        self._log("add", now, rows=wire, origin=origin)
        return True

    def received_rows(self, origins: list[str]) -> dict[str, int]:
        """Rows accepted so far from each origin (0 for one never seen), trained ones included."""
        return {origin: self._received.get(origin, 0) for origin in origins}

    def _validate(self, a: Arrival) -> None:
        """The checks of an arrival against what the buffer holds (ids, units)."""
        step_ids = a.rows.step_ids
        if not self._index.keys().isdisjoint(step_ids):
            repeated = next(s for s in step_ids if s in self._index)
            raise ValueError(f"row {repeated} was already added")
        for uid, members in a.units.items():
            unit = self._units.get(uid)
            first = step_ids[members[0]]
            if self._group_mode and unit is not None and unit.expected != a.unit_size[uid]:
                raise ValueError(f"row {first}: group_size {a.unit_size[uid]} differs from its group's {unit.expected}")
            if self._closed.get(uid, "") is None:
                raise ValueError(f"row {first} arrived for a unit that was already trained")
            expected = a.unit_size[uid] if self._group_mode else (unit.expected if unit else None)
            if expected is not None and (unit.received if unit else 0) + len(members) > expected:
                raise ValueError(f"row {first}: its unit {uid!r} expects {expected} rows and got more")

    def _insert(self, a: Arrival, wire_nbytes: int, now: float) -> None:
        n, start = len(a.rows.step_ids), self._end
        lo, hi = self._write_rows(a.rows, wire_nbytes)
        rewarded = None
        if a.rewards is not None:
            rewarded = ~np.isnan(a.rewards[:, -1])
            self._rewards[lo:hi] = a.rewards
            self._status[lo:hi] = np.where(rewarded, _READY, _PENDING)
            self._rewarded_at[lo:hi] = np.where(rewarded, a.created_at, np.nan)
            rewarded = rewarded.tolist()
        self._rows_added += n
        # per unit (a handful per arrival), then per row only to point it at its unit
        row_unit = [None] * n
        late, touched = [], []
        for uid, members in a.units.items():
            rows = [start + i for i in members]
            if uid in self._closed:  # its unit was dropped: the rows follow it at once
                late.append((rows, self._closed[uid]))
                continue
            unit = self._units.get(uid)
            if unit is None:
                expected = a.unit_size[uid] if self._group_mode else None
                unit = self._new_unit(uid, expected, float(a.created_at[members[0]]))
            unit.received += len(members)
            unit.rows += rows
            if rewarded is not None:
                unit.rewarded += sum(rewarded[i] for i in members)
            for i in members:
                row_unit[i] = unit
            touched.append(unit)
        self._row_unit[lo:hi] = row_unit
        for rows, reason in late:
            self._kill(np.array(rows, np.int64), reason)
        for unit in touched:
            self._check(unit, now)

    def _write_rows(self, rows: WireRows, wire_nbytes: int) -> tuple[int, int]:
        """Hold `rows` as live rows numbered from `_end`, PENDING with null rewards and no unit
        yet; returns their slot range. The caller sets rewards, status, units and counters."""
        n, start = len(rows.step_ids), self._end
        self._ensure_slots(n)
        lo, hi = start - self._base, start - self._base + n
        # fresh slots already read PENDING / NaN / not alive: write only what differs
        self._alive[lo:hi] = True
        self._behavior_version[lo:hi] = rows.scalars["behavior_version"]
        self._row_step[lo:hi] = rows.step_ids
        for name, values in self._fixed.items():
            values[lo:hi] = rows.scalars[name] if name in FIXED_COLUMNS else self._labels.encode(name, rows.labels[name])
        self._index.update(zip(rows.step_ids, range(start, start + n)))
        self._store.append(rows.body, start, wire_nbytes)
        self._end += n
        self._live += n
        return lo, hi

    def commit_rewards(self, commits: list[RewardCommit] | RewardColumns) -> None:
        """Apply reward components by step_id; unknown ids count as late commits.

        `commits` is a list of `RewardCommit` or the same as one `RewardColumns` message
        (cheaper to send and to apply). Commits naming one step_id twice apply in order.
        """
        columns = commits if isinstance(commits, RewardColumns) else RewardColumns.from_commits(commits)
        now = self._clock()
        if len(set(columns.step_ids)) == len(columns.step_ids):
            self._apply(columns, now)
        else:  # a repeated id: later entries must see earlier ones, so one at a time
            for i in range(len(columns.step_ids)):
                self._apply(columns.take([i]), now)
        self._log("commit", now, commits=columns)

    def _apply(self, c: RewardColumns, now: float) -> None:
        """Apply commits whose step_ids are distinct (so their order does not matter)."""
        status = self._status
        found = list(map(self._index.get, c.step_ids))
        known = [i for i, row in enumerate(found) if row is not None]
        self._late += len(found) - len(known)
        # A row's reward is written once: a second `reward` for a row that already has one is
        # refused and counted (the coach pool enforces exactly-once; this guards every other
        # writer). Other components (reward_local, coach_score, ...) still apply.
        if c.reward is not None:
            again = [i for i in known if status[found[i] - self._base] != _PENDING
                     and not np.isnan(c.reward[i])]
            if again:
                self._repeats += len(again)
                log.warning("%s: refused %d reward commit(s) for rows already rewarded",
                            self.model_id, len(again))
                skip = set(again)
                known = [i for i in known if i not in skip]
        if not known:
            return
        if len(known) < len(found):
            c = c.take(known)
            found = [found[i] for i in known]
        rows = np.array(found, np.int64)
        slots = rows - self._base
        failed = None if c.failed_reason is None else \
            np.fromiter((f is not None for f in c.failed_reason), bool, len(rows))
        for k, name in enumerate(REWARD_COLUMNS):
            values = getattr(c, name)
            if values is not None:
                given = ~np.isnan(values) if failed is None else ~np.isnan(values) & ~failed
                self._rewards[slots[given], k] = values[given]
        if c.reward is not None:
            done = ~np.isnan(c.reward) & (status[slots] == _PENDING)
            if failed is not None:
                done &= ~failed
            done_slots = slots[done]
            status[done_slots] = _READY
            self._rewarded_at[done_slots] = now
            # in commit order, so units become ready in the order their last row was rewarded
            for unit in self._row_unit[done_slots].tolist():
                unit.rewarded += 1
                if unit.rewarded == len(unit.rows):
                    self._check(unit, now)
        if failed is not None and failed.any():
            status[slots[failed]] = _FAILED
            self._remove_rows(rows[failed], "failed", now)

    def seal_episode(self, episode_id: str, num_rows: int) -> None:
        """Episode readiness: this buffer will receive `num_rows` rows of the episode in total."""
        if self.cfg.readiness != "episode":
            raise ValueError(f"seal_episode needs readiness='episode'; this buffer uses {self.cfg.readiness!r}")
        if episode_id in self._closed or num_rows == 0:
            return  # already dropped (e.g. timed out) or nothing of it goes to this model
        unit, now = self._units.get(episode_id), self._clock()
        if num_rows < (unit.received if unit else 0):
            raise ValueError(f"episode {episode_id}: sealed at {num_rows} rows but {unit.received} arrived")
        unit = unit or self._new_unit(episode_id, None, now)
        unit.expected = num_rows
        self._check(unit, now)
        self._log("seal", now, episode_id=episode_id, num_rows=num_rows)

    def drop_episode(self, episode_id: str, reason: str) -> int:
        """Drop every held row of an episode (a lost rollout) under `reason`; returns rows dropped.

        In group mode the episode's rows leave their groups like FAILED rows; a group left empty
        is closed, other groups still missing rows of the lost episode end by timeout.
        """
        _check_reason(reason)
        now = self._clock()
        if self.cfg.readiness == "episode":
            unit = self._units.get(episode_id)
            dropped = self._drop_unit(unit, reason) if unit is not None else 0
        else:
            rows = self._store.find("episode_id", episode_id)
            self._remove_rows(rows, reason, now, empty_unit_reason=reason)
            dropped = len(rows)
        self._store.compact()
        self._log("drop_episode", now, episode_id=episode_id, reason=reason)
        return dropped

    # ----------------------------------------------------------------- learner side
    def sample(self, num_units: int, current_version: int, max_staleness: int,
               now: float | None = None) -> ReadyBatch | None:
        """Drop stale rows and expired units, then hand out the `num_units` oldest-ready units.

        Returns None (and keeps every ready unit) when fewer than `num_units` are complete.
        """
        now = self._clock() if now is None else now
        args, units_dropped = dict(num_units=num_units, current_version=current_version,
                                   max_staleness=max_staleness), self._dropped_units
        self._drop_stale(current_version - max_staleness, now)
        while self._deadlines and self._deadlines[0][0] + self.cfg.unit_timeout_s < now:
            unit = heapq.heappop(self._deadlines)[2]
            if not unit.closed and unit.ready_at is None:
                self._drop_unit(unit, "timeout")
        if len(self._ready) < num_units:
            self._store.compact()
            if self._retired or self._dropped_units != units_dropped:  # a call that changed nothing is not logged
                self._log("sample", now, **args)
            return None
        units = [self._ready.popitem(last=False)[1] for _ in range(num_units)]
        sizes = np.fromiter(map(len, (u.rows for u in units)), np.int64, count=num_units)
        offsets = np.zeros(num_units + 1, np.int64)
        np.cumsum(sizes, out=offsets[1:])
        rows = np.fromiter(chain.from_iterable(u.rows for u in units), np.int64, count=int(offsets[-1]))
        table = self._assemble(rows)
        staleness = (current_version - self._behavior_version[rows - self._base]).astype(np.int32)
        for unit in units:
            self._close(unit, None)
        self._kill(rows, None)
        self._rows_trained += len(rows)
        self._store.compact()
        ready_at = np.array([u.ready_at for u in units], np.float64)
        batch = ReadyBatch(table, [u.uid for u in units], staleness, current_version, offsets, ready_at)
        self._log("sample", now, **args, batch=batch, units=units)
        return batch

    def drain(self, reason: str = "run_stopped") -> int:
        """Drop every held row under `reason` (end-of-run accounting); returns rows dropped."""
        _check_reason(reason)
        held = self._live
        for unit in list(self._units.values()):
            self._drop_unit(unit, reason)
        self._store.compact()
        self._log("drain", self._clock(), reason=reason)
        return held

    def take_dropped_units(self) -> int:
        """Units dropped since the last call (the clock gives their budget back)."""
        count, self._dropped_units = self._dropped_units, 0
        if count:
            self._log("take_dropped_units", self._clock(), count=count)
        return count

    def pending_step_ids(self) -> list[str]:
        """Held rows waiting for their reward, oldest first (after a recovery: coach requests to resend)."""
        slots = self._end - self._base
        pending = np.flatnonzero(self._alive[:slots] & (self._status[:slots] == _PENDING))
        return self._row_step[pending].tolist()

    def held_units(self) -> int:
        """Units held, ready or still waiting for rows or rewards (issued and not yet settled)."""
        return len(self._units)

    def stats(self) -> BufferStats:
        """Counters and resident bytes (Arrow chunks, numpy state, index structures)."""
        slots = self._end - self._base
        live = self._alive[:slots]
        ready_rows = int(np.count_nonzero(live & (self._status[:slots] == _READY)))
        arrays = (self._status, self._alive, self._rewards, self._rewarded_at, self._behavior_version,
                  self._row_unit, self._row_step, *self._fixed.values())
        index = sys.getsizeof(self._index) + sum(sys.getsizeof(k) for k in self._index)
        units = sum(sys.getsizeof(u) + sys.getsizeof(u.rows) for u in self._units.values())
        return BufferStats(
            pending_rows=self._live - ready_rows, ready_rows=ready_rows, ready_units=len(self._ready),
            rows_added=self._rows_added, rows_trained=self._rows_trained, dropped=dict(self._dropped),
            late_commits=self._late, repeat_commits=self._repeats,
            backpressure_refusals=self._refusals,
            resident_bytes=int(self._store.nbytes + sum(a.nbytes for a in arrays) + index + units),
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

    def _remove_rows(self, rows: np.ndarray, reason: str, now: float,
                     empty_unit_reason: str = "incomplete") -> None:
        """Drop live rows under `reason`; their units carry on without them, re-checked after.

        A unit left empty is closed under `empty_unit_reason`.
        """
        if len(rows) == 0:
            return
        slots = rows - self._base
        units = {id(u): u for u in self._row_unit[slots]}
        gone = set(rows.tolist())
        ready = self._status[slots] == _READY
        for unit, was_ready in zip(self._row_unit[slots], ready.tolist()):
            unit.rewarded -= was_ready
        for unit in units.values():
            unit.rows = [r for r in unit.rows if r not in gone]
        self._kill(rows, reason)  # every row goes under `reason` before any unit is re-checked
        for unit in units.values():
            if not unit.rows:
                self._drop_unit(unit, empty_unit_reason)
            else:
                self._check(unit, now)

    def _drop_unit(self, unit: _Unit, reason: str) -> int:
        rows = np.array(unit.rows, np.int64)
        self._kill(rows, reason)
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
        self._remove_rows(np.flatnonzero(stale) + self._base, "stale", now)

    # ----------------------------------------------------------------- rows and memory
    def _kill(self, rows: np.ndarray, reason: str | None) -> None:
        """Retire live rows: trained (reason None) or dropped under `reason`."""
        if len(rows) == 0:
            return
        slots = rows - self._base
        self._alive[slots] = False
        if reason is not None:
            status = self._status[slots]
            self._status[slots] = np.where(status == _FAILED, _FAILED, _DROPPED)
            self._dropped[reason] += len(rows)
        pop, step_ids = self._index.pop, self._row_step[slots].tolist()
        for step_id in step_ids:
            pop(step_id)
        if self._retired is not None:
            self._retired.append((reason, step_ids))
        self._row_step[slots] = None
        self._row_unit[slots] = None
        self._live -= len(rows)
        self._store.retire(rows)

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
                 "_behavior_version": 0, "_row_unit": None, "_row_step": None}
        for name, fill in fills.items():
            old = getattr(self, name)
            new = np.full((size,) + old.shape[1:], fill, old.dtype)
            new[: used - shift] = old[shift:used]
            setattr(self, name, new)
        for name, old in self._fixed.items():
            self._fixed[name] = new = np.zeros(size, old.dtype)
            new[: used - shift] = old[shift:used]
        self._base += shift

    def _assemble(self, rows: np.ndarray) -> pa.Table:
        """STEP_SCHEMA table of `rows` in the given order, one chunk, one copy of the tokens."""
        stored = self._store.take(rows)
        slots = rows - self._base
        columns = dict(zip(STORED_SCHEMA.names, stored.columns))
        fixed = {name: values[slots] for name, values in self._fixed.items()}
        for name, pa_type in _FIXED_TYPES.items():
            columns[name] = pa.array(fixed[name], pa_type) if name != "group_key" else \
                pa.FixedSizeBinaryArray.from_buffers(pa_type, len(rows), [None, pa.py_buffer(fixed[name])])
        for name in LABEL_COLUMNS:
            columns[name] = self._labels.column(name, fixed[name])
        columns["model_id"] = pa.DictionaryArray.from_arrays(np.zeros(len(rows), np.int32), [self.model_id])
        columns["step_id"] = pa.array(self._row_step[slots], pa.string())
        columns["behavior_version"] = pa.array(self._behavior_version[slots])
        rewards = np.ascontiguousarray(self._rewards[slots].T)  # [5, N]
        for name, values, null in zip(REWARD_COLUMNS, rewards, np.isnan(rewards)):
            columns[name] = pa.nulls(len(rows), pa.float32()) if null.all() else \
                pa.array(values, pa.float32(), mask=null if null.any() else None)
        columns["status"] = pa.array(np.full(len(rows), _READY, np.int8))
        micros = (self._rewarded_at[slots] * 1e6).astype(np.int64)
        columns["rewarded_at"] = pa.array(micros, pa.timestamp("us"))
        return pa.Table.from_arrays([columns[f.name] for f in STEP_SCHEMA], schema=STEP_SCHEMA)


def _check_reason(reason: str) -> None:
    if reason not in DROP_REASONS:
        raise ValueError(f"drop reason {reason!r} is not one of {DROP_REASONS}; add it to DROP_REASONS or use one of them")
