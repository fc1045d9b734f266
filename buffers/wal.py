"""Write-ahead log of a replay buffer: Arrow IPC segments it is rebuilt from after a crash.

The log holds the buffer's *calls*, not its state: each call that changes the state appends a
record, with the time it read, before it returns. Recovery loads the newest checkpoint and
replays the later records through the same `ReplayBuffer` methods, so readiness, ready order,
timeouts and counters come out as they were, with no second copy of that logic here. A replayed
call must retire exactly the rows its record names, or recovery stops (log and code disagree).

Files in the run's `buffer/<model>/` (DESIGN §10), each an Arrow IPC stream, one record batch
per record, its head (seq, kind, now, arguments) as JSON in the batch metadata `troupe.wal`:

    rows-000007.arrow       one batch per accepted `try_add` (ROW_LOG_SCHEMA: every STEP_SCHEMA
                            column but the derived status/rewarded_at; labels as strings)
    events-000007.arrow     every other call (EVENT_SCHEMA): reward commits (effect "commit"),
                            seals, episode drops, samples, drains, refusals, dropped-unit counts
                            taken, settles; and each row the call retired, effect = drop reason
                            or "trained" (what a sample handed out)
    checkpoint-<seq>.arrow  the state after record `seq`: held rows in STEP_SCHEMA (status and
                            rewards as they stand), units/ready order/counters as JSON on the
                            first batch, then one batch per sample still undoable; written to a
                            .tmp file, fsynced, renamed

One sequence number runs through both files of a segment; recovery merges them and requires it
unbroken. A record is flushed to the OS before its call returns (a killed process loses no
acknowledged call); files are fsynced when a segment closes (or every record, with
`wal_fsync_every_write`). At `wal_segment_bytes` the segment closes, a checkpoint is written and
every older file deleted: the folder holds one checkpoint and one segment. A partial last record
(a crash mid-write) is skipped and reported (`RecoveryReport.torn_bytes`); an unreadable whole
record, or a partial one anywhere else, raises naming the file (a damaged length field in the
newest segment reads as a torn tail). Recovery writes a checkpoint, its undo applied, and goes
on in a new segment. A failed write is fatal: memory is ahead of the files, later calls raise.

Undo: a learner resuming from its checkpoint at version L never applied the steps of samples
taken at current_version >= L, so recovery holds their rows again, ready and first in line.
Sampled rows are kept (in memory and checkpoints) for `wal_undo_versions` versions, or until
`ReplayBuffer.settle_samples(L)` says a learner checkpoint covers them.

This module reads and writes `ReplayBuffer`'s private state; the two are one component.
"""
from __future__ import annotations

import json
import logging
import os
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from buffers.api import RecoveryReport
from buffers.schema import (
    BODY_SCHEMA, DROP_REASONS, LABEL_NAMES, REWARD_COLUMNS, ROW_DTYPE, STEP_SCHEMA, RewardColumns,
    Status, StepBatch, WireRows, split_rows,
)

log = logging.getLogger(__name__)

_KEY = "troupe.wal"
_FORMAT = 1  # of the checkpoint state
_SCALARS = ("turn", "group_size", "candidate", "behavior_version")
ROW_LOG_SCHEMA = pa.schema(
    [STEP_SCHEMA.field("step_id")] + [pa.field(name, pa.string()) for name in LABEL_NAMES]
    + [STEP_SCHEMA.field(name) for name in (*_SCALARS, "group_key", "created_at", *REWARD_COLUMNS)]
    + list(BODY_SCHEMA))
EVENT_SCHEMA = pa.schema([pa.field("step_id", pa.string()), pa.field("effect", pa.string())]
                         + [pa.field(name, pa.float32()) for name in REWARD_COLUMNS]
                         + [pa.field("failed_reason", pa.string())])


# ----------------------------------------------------------------- stream files
class _Stream:
    """One Arrow IPC stream file being appended to: one record batch per record."""

    def __init__(self, path: Path, schema: pa.Schema, fsync_every_write: bool) -> None:
        self.path = path
        self._file = pa.OSFile(str(path), "wb")
        # buffered in C++ and flushed per record: one write() per record, not one per Arrow buffer
        self._sink = pa.BufferedOutputStream(self._file, 1 << 20)
        self._writer = pa.ipc.new_stream(self._sink, schema)
        self._fsync = fsync_every_write
        self._flush()

    def append(self, batch: pa.RecordBatch, head: dict) -> None:
        self._writer.write_batch(batch, custom_metadata={_KEY: json.dumps(head, default=_plain)})
        self._flush()

    def _flush(self) -> None:
        self._sink.flush()  # in the OS now: a killed process loses nothing
        if self._fsync:
            os.fsync(self._file.fileno())

    @property
    def nbytes(self) -> int:
        return self._sink.tell()

    def close(self) -> None:
        """Write the end-of-stream marker, fsync, close."""
        self._writer.close()
        self._sink.flush()
        os.fsync(self._file.fileno())
        self._sink.close()


def _plain(value):
    """JSON for numpy scalars (a caller's np.int64 version, say)."""
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} {value!r} cannot go into a log record head")


def read_stream(path: Path, tolerate_torn: bool) -> tuple[list[tuple[pa.RecordBatch, dict]], int]:
    """(batch, head) of every complete record of one stream file, and the torn bytes skipped.

    Raises ValueError naming the file for a complete record that cannot be read, and for an
    incomplete last record unless `tolerate_torn` (only the newest segment may have one).
    """
    data = pa.memory_map(str(path)).read_buffer()
    end = _complete_prefix(data)
    torn = data.size - end
    cut_short = torn > 0 and _is_torn(data.slice(end).to_pybytes())
    if torn and not (tolerate_torn and cut_short):
        what = "an incomplete record" if cut_short else "an unreadable record"
        raise ValueError(f"{path}: {what} at byte {end} of {data.size}; the file is damaged "
                         "(only the last segment may end in a torn record). Move it aside and "
                         "recover from the files before it, or start the buffer afresh")
    if end == 0:
        return [], torn  # not even the schema was written whole
    records = []
    try:
        reader = pa.ipc.open_stream(pa.BufferReader(data.slice(0, end)))
        while True:
            batch, meta = reader.read_next_batch_with_custom_metadata()
            records.append((batch, json.loads(meta[_KEY])))
    except StopIteration:
        return records, torn
    except (pa.ArrowInvalid, OSError, KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: record {len(records) + 1} cannot be read ({exc}); the file "
                         "is damaged in the middle. Move it aside and start the buffer afresh") from exc


def _complete_prefix(data: pa.Buffer) -> int:
    """Bytes from the start of `data` that hold whole IPC messages (the end marker included)."""
    source = pa.BufferReader(data)
    reader = pa.ipc.MessageReader.open_stream(source)
    end = 0
    while True:
        try:
            reader.read_next_message()
        except StopIteration:
            return source.tell()
        except (pa.ArrowInvalid, OSError):  # classified by the caller from the bytes left
            return end
        end = source.tell()


def _is_torn(tail: bytes) -> bool:
    """Whether `tail` is the start of a message cut short (or zero fill), not a damaged one."""
    if not tail.strip(b"\0") or len(tail) < 8:
        return True
    marker, length = struct.unpack_from("<Ii", tail)
    if marker != 0xFFFFFFFF or length < 0:
        return False
    if 8 + length > len(tail):
        return True
    meta = tail[8:8 + length]  # a flatbuffers Message table; field 3 is bodyLength
    try:
        table = struct.unpack_from("<I", meta)[0]
        vtable = table - struct.unpack_from("<i", meta, table)[0]
        vtable_size = struct.unpack_from("<H", meta, vtable)[0]
        slot = struct.unpack_from("<H", meta, vtable + 10)[0] if vtable_size > 10 else 0
        body = struct.unpack_from("<q", meta, table + slot)[0] if slot else 0
    except struct.error:
        return False
    return 8 + length + body > len(tail)


# ----------------------------------------------------------------- record bodies
def _rows_batch(rows: WireRows) -> pa.RecordBatch:
    """ROW_LOG_SCHEMA batch of accepted rows: the wire form's columns, no copy of the tokens."""
    s, n = rows.scalars, len(rows.step_ids)
    keys = pa.py_buffer(np.ascontiguousarray(s["group_key"]))
    columns = [pa.array(rows.step_ids, pa.string())]
    columns += [pa.array(rows.labels[name], pa.string()) for name in LABEL_NAMES]
    columns += [pa.array(np.ascontiguousarray(s[name])) for name in _SCALARS]
    columns += [pa.FixedSizeBinaryArray.from_buffers(pa.binary(16), n, [None, keys]),
                pa.array(np.ascontiguousarray(s["created_at"]), pa.timestamp("us"))]
    for k in range(len(REWARD_COLUMNS)):
        values = np.ascontiguousarray(s["rewards"][:, k])
        columns.append(pa.array(values, pa.float32(), mask=np.isnan(values)))
    return pa.RecordBatch.from_arrays(columns + rows.body.columns, schema=ROW_LOG_SCHEMA)


def _rows_of(batch: pa.RecordBatch) -> WireRows:
    """Inverse of `_rows_batch`."""
    n = batch.num_rows
    s = np.empty(n, ROW_DTYPE)
    for name in _SCALARS:
        s[name] = batch.column(name).to_numpy()
    s["created_at"] = batch.column("created_at").to_numpy().view(np.int64)
    keys = batch.column("group_key")
    s["group_key"] = np.frombuffer(keys.buffers()[1], "V16", n, 16 * keys.offset)
    for k, name in enumerate(REWARD_COLUMNS):
        s["rewards"][:, k] = batch.column(name).to_numpy(zero_copy_only=False)  # null -> NaN
    body = pa.RecordBatch.from_arrays([batch.column(name) for name in BODY_SCHEMA.names], schema=BODY_SCHEMA)
    return WireRows(batch.column("step_id").to_pylist(), s,
                    {name: batch.column(name).to_pylist() for name in LABEL_NAMES}, body)


def _event_batch(commits: RewardColumns | None, retired: list) -> pa.RecordBatch:
    """EVENT_SCHEMA batch: the commits (effect "commit"), then each retired row with its effect."""
    ids = list(commits.step_ids) if commits is not None else []
    k = len(ids)
    effects = ["commit"] * k
    for reason, step_ids in retired:
        ids += step_ids
        effects += [reason or "trained"] * len(step_ids)
    columns = [pa.array(ids, pa.string()), pa.array(effects, pa.string())]
    for name in REWARD_COLUMNS:
        values = np.full(len(ids), np.nan, np.float32)
        if commits is not None and getattr(commits, name) is not None:
            values[:k] = getattr(commits, name)
        columns.append(pa.array(values, pa.float32(), mask=np.isnan(values)))
    failed = (commits.failed_reason if commits is not None and commits.failed_reason else [None] * k)
    columns.append(pa.array(list(failed) + [None] * (len(ids) - k), pa.string()))
    return pa.RecordBatch.from_arrays(columns, schema=EVENT_SCHEMA)


def _commits_of(batch: pa.RecordBatch, k: int) -> RewardColumns:
    """The RewardColumns of an event's first `k` entries (a null component: left unchanged)."""
    batch = batch.slice(0, k)
    arrays = {name: batch.column(name) for name in REWARD_COLUMNS}
    given = {name: a.to_numpy(zero_copy_only=False).astype(np.float32)
             for name, a in arrays.items() if a.null_count < k}
    failed = batch.column("failed_reason")
    return RewardColumns(batch.column("step_id").to_pylist(), **given,
                         failed_reason=failed.to_pylist() if failed.null_count < k else None)


def _retired_of(kind: str, head: dict, batch: pa.RecordBatch) -> list:
    """(effect, step_id) of each row a logged call retired, in the order it retired them."""
    if kind == "add":
        return [(reason or "trained", s) for reason, ids in head.get("retired", []) for s in ids]
    k = head.get("commits", 0)
    return list(zip(batch.column("effect").to_pylist()[k:], batch.column("step_id").to_pylist()[k:]))


# ----------------------------------------------------------------- undo
@dataclass
class _Sample:
    """A sample's rows, kept while a recovery may still undo it."""

    seq: int
    version: int  # current_version it was sampled for
    table: pa.Table  # its ReadyBatch table: STEP_SCHEMA, READY rows, unit by unit
    offsets: list  # unit u spans rows offsets[u]:offsets[u + 1]
    units: list  # per unit [uid (JSON form), first_at, expected, received, ready_at]


@dataclass
class _Undo:
    """The samples recovery may still undo; newest sample versions and settles release them."""

    versions: int  # BufferConfig.wal_undo_versions
    samples: list = field(default_factory=list)
    settled: int = -1  # samples below this version are final (a learner checkpoint covers them)
    released_max: int = -1  # newest version of a sample no longer kept

    def note(self, buf, kind: str, seq: int, args: dict) -> None:
        """Keep a sample's rows, or apply a settle, then release what is no longer undoable."""
        if kind == "sample" and args.get("units"):
            batch = args["batch"]
            units = [[_uid_out(buf, u.uid), u.first_at, u.expected, u.received, u.ready_at]
                     for u in args["units"]]
            self.samples.append(_Sample(seq, int(batch.version), batch.table,
                                        batch.unit_offsets.tolist(), units))
        elif kind == "settle":
            self.settled = max(self.settled, int(args["version"]))
        else:
            return
        newest = max((s.version for s in self.samples), default=self.settled)
        self.release(max(self.settled, newest - self.versions + 1))

    def release(self, floor: int) -> None:
        released = [s.version for s in self.samples if s.version < floor]
        if released:
            self.released_max = max(self.released_max, *released)
            self.samples = [s for s in self.samples if s.version >= floor]


# ----------------------------------------------------------------- the log
class WriteAheadLog:
    """The open log of one buffer: appends records, rolls segments, writes checkpoints."""

    def __init__(self, folder: Path, cfg, seq: int, segment: int, undo: _Undo) -> None:
        self.folder, self.cfg, self.seq, self.segment, self.undo = folder, cfg, seq, segment, undo
        self.failed: BaseException | None = None
        self._rows = self._events = None

    def record(self, buf, kind: str, now: float, args: dict) -> None:
        """Append the call `kind` the buffer just made (see ReplayBuffer._log), then roll if full."""
        if self.failed is not None:
            raise RuntimeError(f"the write-ahead log in {self.folder} is unusable ({self.failed!r}): "
                               "rebuild the buffer from its files with ReplayBuffer.recover") from self.failed
        retired, buf._retired = buf._retired, []
        try:
            self.seq += 1
            head = {"seq": self.seq, "kind": kind, "now": now}
            if kind == "add":
                head.update(origin=args["origin"], **({"retired": retired} if retired else {}))
                self._rows.append(_rows_batch(args["rows"]), head)
            else:
                commits = args.pop("commits", None)
                head.update({k: v for k, v in args.items() if k not in ("batch", "units")})
                if commits is not None:
                    head["commits"] = len(commits.step_ids)
                if args.get("units"):
                    head["units"] = [_uid_out(buf, u.uid) for u in args["units"]]
                self._events.append(_event_batch(commits, retired), head)
                self.undo.note(buf, kind, self.seq, args)
            if self._rows.nbytes + self._events.nbytes >= self.cfg.wal_segment_bytes:
                self._rows.close()
                self._events.close()
                self.segment += 1
                self.start(buf)
        except BaseException as exc:  # noqa: B036 -- recorded, then re-raised: memory is now ahead of the files
            self.failed = exc
            raise

    def start(self, buf) -> None:
        """Checkpoint the buffer, open segment `self.segment`, delete every older file."""
        self.folder.mkdir(parents=True, exist_ok=True)
        if self.seq or self.segment > 1:  # a fresh log needs none: no checkpoint is the empty state
            self._checkpoint(buf)
        fsync = self.cfg.wal_fsync_every_write
        self._rows = _Stream(self.folder / f"rows-{self.segment:06d}.arrow", ROW_LOG_SCHEMA, fsync)
        self._events = _Stream(self.folder / f"events-{self.segment:06d}.arrow", EVENT_SCHEMA, fsync)
        _fsync_dir(self.folder)
        checkpoints, segments = _listing(self.folder)
        for path in checkpoints[:-1] + [p for n, p in segments if n < self.segment]:
            path.unlink()
        for path in self.folder.glob("*.tmp"):
            path.unlink()

    def close(self) -> None:
        if self.failed is None:
            self._rows.close()
            self._events.close()
            self.failed = RuntimeError("closed by ReplayBuffer.close")

    def _checkpoint(self, buf) -> None:
        rows, state = _capture(buf)
        state.update(format=_FORMAT, seq=self.seq, next_segment=self.segment,
                     settled=self.undo.settled, released_max=self.undo.released_max)
        path = self.folder / f"checkpoint-{self.seq:012d}.arrow"
        tmp = path.with_name(path.name + ".tmp")
        stream = _Stream(tmp, STEP_SCHEMA, fsync_every_write=False)
        stream.append(rows, {"state": state})
        for s in self.undo.samples:
            stream.append(s.table.combine_chunks().to_batches()[0],
                          {"sample": [s.seq, s.version, s.offsets, s.units]})
        stream.close()
        os.replace(tmp, path)
        _fsync_dir(self.folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _listing(folder: Path) -> tuple[list[Path], list[tuple[int, Path]]]:
    """Checkpoints oldest first, and (segment number, path) of segment files in order."""
    checkpoints = sorted(folder.glob("checkpoint-*.arrow"))
    segments = sorted((int(p.stem.split("-")[1]), p) for pattern in ("rows-*.arrow", "events-*.arrow")
                      for p in folder.glob(pattern))
    return checkpoints, segments


# ----------------------------------------------------------------- state capture and restore
def _uid_out(buf, uid):
    return uid.hex() if buf._group_mode else uid


def _uid_in(buf, uid):
    return bytes.fromhex(uid) if buf._group_mode else uid


def _capture(buf) -> tuple[pa.RecordBatch, dict]:
    """Held rows (STEP_SCHEMA, status and rewards as they stand) and the rest of the state."""
    rows = np.flatnonzero(buf._alive[:buf._end - buf._base]) + buf._base
    with np.errstate(invalid="ignore"):  # pending rows' NaN rewarded_at, replaced just below
        table = buf._assemble(rows)
    slots = rows - buf._base
    at = buf._rewarded_at[slots]
    pending = np.isnan(at)
    micros = pa.array(np.where(pending, 0, at * 1e6).astype(np.int64), pa.timestamp("us"), mask=pending)
    table = table.set_column(STEP_SCHEMA.get_field_index("status"), "status", pa.array(buf._status[slots]))
    table = table.set_column(STEP_SCHEMA.get_field_index("rewarded_at"), "rewarded_at", micros)
    batches = table.combine_chunks().to_batches()
    state = {
        "model_id": buf.model_id, "readiness": buf.cfg.readiness,
        "counters": [buf._rows_added, buf._rows_trained, buf._late, buf._repeats, buf._refusals,
                     buf._dropped_units, dict(buf._dropped)],
        "units": [[_uid_out(buf, u.uid), u.expected, u.received, u.first_at, u.ready_at]
                  for u in buf._units.values()],
        "ready": [_uid_out(buf, uid) for uid in buf._ready],
        "closed": [[_uid_out(buf, uid), reason] for uid, reason in buf._closed.items()],
        "received": list(buf._received.items()),
    }
    return (batches[0] if batches else pa.RecordBatch.from_pylist([], schema=STEP_SCHEMA)), state


def _restore(buf, rows: pa.RecordBatch, state: dict, path: Path) -> None:
    """Set a fresh buffer to a checkpoint's state."""
    if state["format"] != _FORMAT:
        raise ValueError(f"{path} is in checkpoint format {state['format']}; this code reads {_FORMAT}")
    if (state["model_id"], state["readiness"]) != (buf.model_id, buf.cfg.readiness):
        raise ValueError(f"{path} holds model {state['model_id']!r} with readiness {state['readiness']!r}; "
                         f"this buffer is {buf.model_id!r} with readiness {buf.cfg.readiness!r}: "
                         "pass the model's own wal_dir and its configured readiness")
    (buf._rows_added, buf._rows_trained, buf._late, buf._repeats, buf._refusals,
     buf._dropped_units, dropped) = state["counters"]
    unknown = set(dropped) - set(DROP_REASONS)
    if unknown:
        raise ValueError(f"{path} counts drop reasons {sorted(unknown)} this code does not know; "
                         "resume with the code that wrote it, or add them to DROP_REASONS")
    for reason, count in dropped.items():
        buf._dropped[reason] = count
    for uid, expected, received, first_at, ready_at in state["units"]:
        unit = buf._new_unit(_uid_in(buf, uid), expected, first_at)
        unit.received, unit.ready_at = received, ready_at
    _place(buf, pa.Table.from_batches([rows]), None)
    ready = [_uid_in(buf, uid) for uid in state["ready"]]
    buf._ready = OrderedDict((uid, buf._units[uid]) for uid in ready)
    buf._closed = OrderedDict((_uid_in(buf, uid), reason) for uid, reason in state["closed"])
    buf._received = OrderedDict((origin, n) for origin, n in state["received"])


def _place(buf, table: pa.Table, units: list | None) -> None:
    """Hold STEP_SCHEMA rows with their status, rewards and rewarded_at, in their units.

    `units`: one new unit per run of rows (an undone sample); None: rows join the units
    already restored, by group_key or episode_id.
    """
    n = table.num_rows
    if n == 0:
        return
    start = buf._end
    # one row first: ChunkStore._ensure shifts its base past the new rows when a store holding
    # no live row gets one append larger than its slot array (a bug in buffers/store.py)
    wires = [split_rows(piece) for piece in (table.slice(0, 1), table.slice(1)) if piece.num_rows]
    for wire in wires:
        buf._write_rows(wire, 0)
    lo, hi = start - buf._base, buf._end - buf._base  # after both: the second may shift the base
    scalars = np.concatenate([wire.scalars for wire in wires])
    buf._rewards[lo:hi] = scalars["rewards"]
    buf._status[lo:hi] = table.column("status").to_numpy()
    micros = table.column("rewarded_at").cast(pa.int64()).to_numpy(zero_copy_only=False)
    # half a microsecond in: ReplayBuffer._assemble truncates to microseconds, so the row
    # reads back the very timestamp it was written with
    buf._rewarded_at[lo:hi] = (micros + 0.5) / 1e6
    if units is None:
        uids = scalars["group_key"].tolist() if buf._group_mode else table.column("episode_id").to_pylist()
        owners = [buf._units[uid] for uid in uids]
    else:
        owners = [unit for unit, size in units for _ in range(size)]
    ready = (buf._status[lo:hi] == Status.READY).tolist()
    for row, unit, is_ready in zip(range(start, start + n), owners, ready):
        unit.rows.append(row)
        unit.rewarded += is_ready
    buf._row_unit[lo:hi] = owners


def _reinstate(buf, sample: _Sample) -> list:
    """Undo a sample: its units held again, complete and ready; returns their ids in order."""
    units = []
    for (uid, first_at, expected, received, ready_at), lo, hi in zip(sample.units, sample.offsets, sample.offsets[1:]):
        uid = _uid_in(buf, uid)
        if uid in buf._units:
            raise RuntimeError(f"cannot undo sample {sample.seq}: its unit {uid!r} is held again "
                               "(rows arrived for it after its training); the log is inconsistent")
        unit = buf._new_unit(uid, expected, first_at)
        unit.received, unit.ready_at = received, ready_at
        buf._closed.pop(uid, None)
        units.append((unit, hi - lo))
    _place(buf, sample.table, units)
    buf._rows_trained -= sample.table.num_rows
    return [unit.uid for unit, _ in units]


# ----------------------------------------------------------------- recovery
class _Replayer:
    """Stands in for the log while it is replayed: keeps each call a record makes again."""

    def __init__(self) -> None:
        self.calls: list = []  # (kind, rows retired, args)

    def record(self, buf, kind: str, now: float, args: dict) -> None:
        self.calls.append((kind, buf._retired, args))
        buf._retired = []


def attach(buf, wal_dir: str | None, resume_from_version: int | None):
    """(log, recovery report) for a buffer being built: none, a fresh log, or a recovered one."""
    if wal_dir is None:
        if resume_from_version is not None:
            raise ValueError(f"resume_from_version={resume_from_version} needs the wal_dir to recover from")
        return None, None
    folder = Path(wal_dir)
    if resume_from_version is None:
        if folder.is_dir() and any(_listing(folder)):
            raise ValueError(f"wal_dir={wal_dir} already holds a write-ahead log; resume it with "
                             "ReplayBuffer.recover(model_id, cfg, wal_dir, learner_version), or give "
                             "an empty folder")
        log_ = WriteAheadLog(folder, buf.cfg, 0, 1, _Undo(buf.cfg.wal_undo_versions))
        log_.start(buf)
        buf._retired = []
        return log_, None
    if not folder.is_dir():
        raise FileNotFoundError(f"wal_dir={wal_dir}: no such folder to recover from; build a fresh "
                                "buffer with ReplayBuffer(model_id, cfg, wal_dir) instead")
    return _recover(buf, folder, int(resume_from_version))


def _recover(buf, folder: Path, learner_version: int) -> tuple[WriteAheadLog, RecoveryReport]:
    """Checkpoint, then the records after it, then the undo; the log goes on in a new segment."""
    started = time.perf_counter()
    undo = _Undo(buf.cfg.wal_undo_versions)
    seq, segment, checkpoints, files = 0, 1, *_listing(folder)
    if checkpoints:
        records, _ = read_stream(checkpoints[-1], tolerate_torn=False)
        (rows, head), *samples = records
        state = head["state"]
        _restore(buf, rows, state, checkpoints[-1])
        seq, segment = state["seq"], state["next_segment"]
        undo.settled, undo.released_max = state["settled"], state["released_max"]
        undo.samples = [_Sample(*h["sample"][:2], pa.Table.from_batches([b]), *h["sample"][2:])
                        for b, h in samples]
    files = [(n, p) for n, p in files if n >= segment]
    last = files[-1][0] if files else segment
    pending, torn = [], 0
    for n, path in files:
        got, skipped = read_stream(path, tolerate_torn=n == last)
        if skipped:
            log.warning("%s: skipped a torn last record of %d bytes (a write cut short)", path, skipped)
        torn += skipped
        pending += [(head["seq"], head, batch, path) for batch, head in got if head["seq"] > seq]
    pending.sort(key=lambda record: record[0])
    for expected, (got_seq, _, _, path) in enumerate(pending, start=seq + 1):
        if got_seq != expected:
            raise ValueError(f"{path}: record {got_seq} follows record {expected - 1}; records in between "
                             f"are missing from {folder} (a segment file was lost or damaged)")
    _replay(buf, pending, undo)
    seq = pending[-1][0] if pending else seq
    complete = learner_version > undo.released_max
    if not complete:
        log.warning("%s: samples taken at versions >= %d were no longer kept (wal_undo_versions=%d); "
                    "their rows stay trained and the resumed learner will not see them again",
                    folder, learner_version, buf.cfg.wal_undo_versions)
    undone = [s for s in undo.samples if s.version >= learner_version]
    undo.samples = [s for s in undo.samples if s.version < learner_version]
    uids = [uid for s in undone for uid in _reinstate(buf, s)]
    for uid in reversed(uids):  # oldest first, ahead of every unit that became ready later
        buf._ready[uid] = buf._units[uid]
        buf._ready.move_to_end(uid, last=False)
    # samples below learner_version stay kept until released as usual: a caller recovering with
    # a version no sample reaches (a buffer restarted while its learner lives on) undoes nothing
    # and gives up nothing a later resume from an older learner checkpoint may need
    wal = WriteAheadLog(folder, buf.cfg, seq, max(last, segment) + 1, undo)
    wal.start(buf)
    buf._retired = []
    stats = buf.stats()
    report = RecoveryReport(
        rows_pending=stats.pending_rows, rows_ready=stats.ready_rows,
        rows_untrained=sum(s.table.num_rows for s in undone), samples_undone=len(undone),
        undo_complete=complete, records_replayed=len(pending),
        segments_read=len(files) + bool(checkpoints), torn_bytes=torn,
        checkpoint=str(checkpoints[-1]) if checkpoints else None,
        seconds=time.perf_counter() - started)
    log.info("%s: recovered %s", folder, report)
    return wal, report


_REPLAY = {  # kind -> the call again: (ReplayBuffer, buffer, head, batch)
    "add": lambda B, buf, h, b: B.try_add(buf, StepBatch.received(_rows_of(b), 0), h["origin"]),
    "commit": lambda B, buf, h, b: B.commit_rewards(buf, _commits_of(b, h["commits"])),
    "seal": lambda B, buf, h, b: B.seal_episode(buf, h["episode_id"], h["num_rows"]),
    "drop_episode": lambda B, buf, h, b: B.drop_episode(buf, h["episode_id"], h["reason"]),
    "sample": lambda B, buf, h, b: B.sample(buf, h["num_units"], h["current_version"], h["max_staleness"]),
    "drain": lambda B, buf, h, b: B.drain(buf, h["reason"]),
    "take_dropped_units": lambda B, buf, h, b: B.take_dropped_units(buf),
    "settle": lambda B, buf, h, b: B.settle_samples(buf, h["version"]),
}


def _replay(buf, records: list, undo: _Undo) -> None:
    """Run each logged call again through ReplayBuffer's own methods, at its logged time."""
    from buffers.replay import ReplayBuffer as base  # the class, not a subclass's overrides

    replayer = _Replayer()
    buf._wal, buf._retired = replayer, []
    for seq, head, batch, path in records:
        kind, now = head["kind"], head["now"]
        if kind == "refused":
            buf._refusals += 1  # a refused call's rows are not logged, only its count
            continue
        if kind not in _REPLAY:
            raise ValueError(f"{path}: record {seq} has kind {kind!r}, which this code does not know")
        buf._clock = lambda now=now: now
        _REPLAY[kind](base, buf, head, batch)
        made, replayer.calls = replayer.calls, []
        replayed = [(r or "trained", s) for _, retired, _ in made for r, ids in retired for s in ids]
        same_args = all(head.get(k) == v for k, v in (made[0][2] if made else {}).items()
                        if k not in ("rows", "commits", "batch", "units"))
        if [c[0] for c in made] != [kind] or not same_args or replayed != _retired_of(kind, head, batch):
            raise RuntimeError(f"{path}: record {seq} ({kind}) replays differently from how it ran "
                               f"(calls {[c[0] for c in made]}, {len(replayed)} rows retired); the log "
                               "and this code's buffer logic disagree")
        undo.note(buf, kind, seq, made[0][2])
    buf._clock, buf._wal = time.time, None
