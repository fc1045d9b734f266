"""The step row: one row per candidate of one agent action (DESIGN §3), declared once.

Everything that reads or writes rows (buffers, learners, metrics, exports) uses the names
declared here. Token columns travel as numpy arrays inside `StepRecord` so a batch of records
becomes Arrow columns with one concatenate per column (no per-token Python objects).
"""
from __future__ import annotations

import enum
import hashlib
import operator
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
DROP_REASONS = ("stale", "incomplete", "failed", "timeout", "capacity", "run_stopped",
                "actor_crashed", "scaled_down")

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


def tree_path(branch: str, candidate: int) -> str:
    """The tree position of a candidate: its branch with its own index appended.

    "" and 2 give "2"; "0" and 2 give "0.2" (DESIGN §3's dotted "tree path of chosen
    candidates"). It is the `parent_branch` a workflow passes to the actions that continue
    from this candidate, and the path the learner's returns follow (reinforce_pp).
    """
    return f"{branch}.{candidate}" if branch else str(candidate)


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


@dataclass(frozen=True, eq=False)
class RewardColumns:
    """Rewards of many rows in one message: the columnar form of a list of `RewardCommit`.

    Every array holds one float32 per entry of `step_ids` [N]; NaN leaves that component
    unchanged (a None in `RewardCommit`), an array left None leaves it unchanged for every
    row. A row whose `failed_reason` is set is marked FAILED. A reward source that scores
    many rows at once (the coach pool) sends this: it pickles as a few arrays, where a list
    of commits pickles (and unpickles, on the buffer's serial path) one object per row.
    """

    step_ids: list  # [N] str
    reward: np.ndarray | None = None  # float32 [N]; set completes the row
    reward_local: np.ndarray | None = None  # float32 [N]
    reward_team: np.ndarray | None = None  # float32 [N]
    coach_score: np.ndarray | None = None  # float32 [N]
    outcome: np.ndarray | None = None  # float32 [N]
    failed_reason: list | None = None  # [N] str or None

    def __post_init__(self) -> None:
        n = len(self.step_ids)
        for name in REWARD_COLUMNS:
            values = getattr(self, name)
            if values is None:
                continue
            if len(values) != n:
                raise ValueError(f"RewardColumns.{name} has {len(values)} values for {n} step_ids")
            if np.isinf(values).any():
                bad = self.step_ids[int(np.flatnonzero(np.isinf(values))[0])]
                raise ValueError(f"commit for {bad}: {name} must be finite or NaN (unchanged)")
        if self.failed_reason is not None and len(self.failed_reason) != n:
            raise ValueError(f"RewardColumns.failed_reason has {len(self.failed_reason)} entries for {n} step_ids")

    @classmethod
    def from_commits(cls, commits: list[RewardCommit]) -> RewardColumns:
        """The same commits as columns; raises ValueError for a NaN or infinite component."""
        columns = {}
        for name in REWARD_COLUMNS:
            given = [getattr(c, name) for c in commits]
            if all(v is None for v in given):
                continue
            values = np.array([np.nan if v is None else v for v in given], np.float64)
            bad = np.flatnonzero(~np.isfinite(values) & np.fromiter((v is not None for v in given), bool, len(given)))
            if len(bad):
                raise ValueError(f"commit for {commits[bad[0]].step_id}: rewards must be finite, got {given[bad[0]]}")
            columns[name] = values.astype(np.float32)
        failed = [c.failed_reason for c in commits]
        return cls([c.step_id for c in commits], **columns,
                   failed_reason=failed if any(f is not None for f in failed) else None)

    def take(self, positions: list[int]) -> RewardColumns:
        """The entries at `positions`, in that order."""
        picked = {name: None if getattr(self, name) is None else getattr(self, name)[positions]
                  for name in REWARD_COLUMNS}
        failed = None if self.failed_reason is None else [self.failed_reason[i] for i in positions]
        return RewardColumns([self.step_ids[i] for i in positions], **picked, failed_reason=failed)


_SCALAR_NAMES = (
    "step_id", "run_id", "model_id", "agent", "workflow", "task_id", "episode_id", "branch",
    "turn", "group_key", "group_size", "candidate", "finish_reason", *REWARD_COLUMNS,
    "created_at", "meta",
)
_TOKEN_NAMES = ("prompt_ids", "response_ids", "behavior_logprobs", "token_versions")
_TOKEN_DTYPES = (np.int32, np.int32, np.float32, np.int32)
# The few-valued string columns: dictionary-encoded in STEP_SCHEMA, lists on the wire.
LABEL_NAMES = ("run_id", "model_id", "agent", "workflow", "finish_reason")
_PLAIN_TYPES = {
    "step_id": pa.string(), "task_id": pa.string(), "episode_id": pa.string(),
    "branch": pa.string(), "turn": pa.int16(), "group_key": pa.binary(16),
    "group_size": pa.int16(), "candidate": pa.int16(), "meta": pa.string(),
    **{name: pa.float32() for name in REWARD_COLUMNS},
}
# attrgetter pulls every field of a record in one C call; zip(*) then transposes rows into
# columns, so the per-row Python cost is two calls instead of one getattr per field.
_get_scalars = operator.attrgetter(*_SCALAR_NAMES)
_get_tokens = operator.attrgetter(*_TOKEN_NAMES)


def _token_column(arrays: tuple, dtype, offsets: pa.Array | None = None
                  ) -> tuple[pa.Array, pa.Array, np.ndarray]:
    """One large_list column from per-row numpy arrays; returns (column, offsets, values).

    `offsets` of another column whose rows have the same lengths are reused as they are.
    """
    n = len(arrays)
    if offsets is None:
        ends = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.fromiter(map(len, arrays), dtype=np.int64, count=n), out=ends[1:])
        offsets = pa.array(ends)
    values = np.concatenate(arrays).astype(dtype, copy=False) if n else np.zeros(0, dtype)
    return pa.LargeListArray.from_arrays(offsets, pa.array(values)), offsets, values


def _min_versions(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """behavior_version of each row: the min of its token versions, -1 for a row without any."""
    lengths = np.diff(offsets)
    if lengths.all():  # the usual case: every row has tokens
        return np.minimum.reduceat(values, offsets[:-1]).astype(np.int32, copy=False)
    behavior_version = np.full(len(lengths), -1, dtype=np.int32)
    nonempty = lengths > 0
    if nonempty.any():
        # reduceat over the starts of non-empty rows only: an empty row would otherwise
        # yield the value at its start position instead of "no tokens".
        behavior_version[nonempty] = np.minimum.reduceat(values, offsets[:-1][nonempty])
    return behavior_version


def _timestamps(seconds: np.ndarray, valid: np.ndarray | None = None) -> pa.Array:
    micros = (seconds * 1e6).astype(np.int64)
    mask = None if valid is None else ~valid
    return pa.array(micros, type=pa.timestamp("us"), mask=mask)


def records_to_table(records: list[StepRecord]) -> pa.Table:
    """Build an Arrow table in STEP_SCHEMA from records: one concatenate per token column.

    Per-row Python work is limited to pulling attributes; token arrays are concatenated once
    per column and `behavior_version` is a segmented min over the concatenated versions.
    """
    n = len(records)
    scalars = dict(zip(_SCALAR_NAMES, zip(*map(_get_scalars, records)))) if n else {
        name: () for name in _SCALAR_NAMES
    }
    tokens = list(zip(*map(_get_tokens, records))) if n else [()] * len(_TOKEN_NAMES)
    arrays: dict[str, pa.Array] = {}
    for name, per_row, dtype in zip(_TOKEN_NAMES, tokens, _TOKEN_DTYPES):
        arrays[name], offsets, values = _token_column(per_row, dtype)
    # token_versions was built last: its offsets/values give min version per row.
    behavior_version = _min_versions(values, offsets.to_numpy())
    rewarded = np.fromiter((r is not None for r in scalars["reward"]), dtype=bool, count=n)
    created_at = np.asarray(scalars["created_at"], dtype=np.float64).reshape(n)
    for name, pa_type in _PLAIN_TYPES.items():
        arrays[name] = pa.array(scalars[name], pa_type)
    for name in LABEL_NAMES:
        # dictionary_encode yields int32 indices over string values, matching STEP_SCHEMA.
        arrays[name] = pa.array(scalars[name], pa.string()).dictionary_encode()
    arrays["behavior_version"] = pa.array(behavior_version)
    arrays["status"] = pa.array(np.where(rewarded, Status.READY, Status.PENDING).astype(np.int8))
    arrays["created_at"] = _timestamps(created_at)
    arrays["rewarded_at"] = _timestamps(created_at, rewarded)
    return pa.Table.from_arrays([arrays[f.name] for f in STEP_SCHEMA], schema=STEP_SCHEMA)


# How rows travel from a producer to a buffer (one `StepBatch`). The buffer is one actor on
# everyone's path and a message is a handful of rows, so it pays per Arrow call, not per
# byte: the per-row scalars travel as ONE numpy structured array (read into the buffer's
# numpy state with one assignment), step ids and the few-valued label columns as Python
# lists, and only the variable-length columns as one Arrow IPC message, read against the
# known BODY_SCHEMA in one call. Everything else the buffer would otherwise pull out of an
# Arrow message column by column (about 1 us a call).
ROW_DTYPE = np.dtype([
    ("turn", np.int16), ("group_size", np.int16), ("candidate", np.int16),
    ("behavior_version", np.int32), ("created_at", np.int64),  # created_at in microseconds
    ("group_key", "V16"), ("rewards", np.float32, (len(REWARD_COLUMNS),)),  # NaN = null
])
BODY_SCHEMA = pa.schema([STEP_SCHEMA.field(name) for name in (
    "task_id", "episode_id", "branch", "prompt_ids", "response_ids", "behavior_logprobs",
    "token_versions", "meta")])
_BODY_NAMES = BODY_SCHEMA.names
_NOT_NULL = ("step_id", "turn", "group_size", "candidate", "behavior_version", "created_at", "group_key")


@dataclass(frozen=True)
class WireRows:
    """N rows in the form they travel in: every STEP_SCHEMA column once, status and
    rewarded_at derived (READY with rewarded_at = created_at where `reward` is set)."""

    step_ids: list  # [N] str
    scalars: np.ndarray  # ROW_DTYPE [N]
    labels: dict  # LABEL_NAMES name -> [N] str or None
    body: pa.RecordBatch  # BODY_SCHEMA, N rows


def split_rows(table: pa.Table) -> WireRows:
    """STEP_SCHEMA rows in wire form; token buffers are not copied (for a one-chunk table)."""
    if not table.schema.equals(STEP_SCHEMA):
        raise ValueError(f"rows must be in STEP_SCHEMA (build them with records_to_table); got\n{table.schema}")
    for name in _NOT_NULL:
        if table.column(name).null_count:
            raise ValueError(f"column {name} has nulls; every row needs one")
    n = table.num_rows
    scalars = np.empty(n, ROW_DTYPE)
    for name in ("turn", "group_size", "candidate", "behavior_version"):
        scalars[name] = table.column(name).to_numpy()
    scalars["created_at"] = table.column("created_at").to_numpy().view(np.int64)
    keys = table.column("group_key").combine_chunks()
    scalars["group_key"] = np.frombuffer(keys.buffers()[1], "V16", n, 16 * keys.offset) if n else []
    for k, name in enumerate(REWARD_COLUMNS):
        scalars["rewards"][:, k] = table.column(name).to_numpy()  # nulls become NaN
    body = table.select(BODY_SCHEMA.names).to_batches()
    if len(body) != 1:
        body = [pa.concat_batches(body) if body else pa.RecordBatch.from_pylist([], schema=BODY_SCHEMA)]
    return WireRows(table.column("step_id").to_pylist(), scalars,
                    {name: _shared(table.column(name).to_pylist()) for name in LABEL_NAMES}, body[0])


def _shared(values: list) -> list:
    """`values` with equal strings as one object: pickle then sends each distinct value once
    and the receiver unpickles a reference per row instead of a new string."""
    first: dict = {}
    return [first.setdefault(v, v) for v in values]


def records_to_wire(records: list[StepRecord]) -> WireRows:
    """Records in wire form, built from them directly: equal to
    `split_rows(records_to_table(records))` without the STEP_SCHEMA table in between.

    That table has 27 columns, and building it then taking it apart again cost about 30 us a
    row more than this at 20 rows a message (a call per column each way; measured by
    scripts/bench_datapath.py); here the scalars go straight into ROW_DTYPE and only the
    body's 8 columns are Arrow arrays. The three response columns share one offsets array
    (StepRecord checks their lengths agree).
    """
    if not records:
        return split_rows(records_to_table([]))
    scalars = dict(zip(_SCALAR_NAMES, zip(*map(_get_scalars, records))))
    prompts, responses, logprobs, versions = zip(*map(_get_tokens, records))
    for name in ("step_id", "turn", "group_size", "candidate", "group_key"):
        if None in scalars[name]:
            raise ValueError(f"column {name} has nulls; every row needs one")
    n = len(records)
    rows = np.empty(n, ROW_DTYPE)
    for name in ("turn", "group_size", "candidate"):
        rows[name] = np.array(scalars[name], np.int16)  # raises for a value int16 cannot hold
    rows["created_at"] = (np.asarray(scalars["created_at"], np.float64) * 1e6).astype(np.int64)
    rows["group_key"] = np.frombuffer(b"".join(scalars["group_key"]), "V16")
    for k, name in enumerate(REWARD_COLUMNS):
        given = scalars[name]
        rows["rewards"][:, k] = np.nan if given.count(None) == n else \
            np.array([np.nan if v is None else v for v in given], np.float32)
    body = dict(prompt_ids=_token_column(prompts, np.int32)[0])
    body["response_ids"], offsets, _ = _token_column(responses, np.int32)
    body["behavior_logprobs"] = _token_column(logprobs, np.float32, offsets)[0]
    body["token_versions"], _, values = _token_column(versions, np.int32, offsets)
    rows["behavior_version"] = _min_versions(values, offsets.to_numpy())
    for name in ("task_id", "episode_id", "branch", "meta"):
        body[name] = pa.array(scalars[name], pa.string())
    return WireRows(list(scalars["step_id"]), rows,
                    {name: _shared(list(scalars[name])) for name in LABEL_NAMES},
                    # by names: the arrays have BODY_SCHEMA's types already, and passing the
                    # schema itself costs a check per column (~20 us a message)
                    pa.RecordBatch.from_arrays([body[name] for name in _BODY_NAMES],
                                               names=_BODY_NAMES))


def join_rows(rows: WireRows) -> pa.Table:
    """Inverse of `split_rows`: the rows as a STEP_SCHEMA table."""
    s, n = rows.scalars, len(rows.step_ids)
    columns = dict(zip(BODY_SCHEMA.names, rows.body.columns))
    columns["step_id"] = pa.array(rows.step_ids, pa.string())
    for name in LABEL_NAMES:
        columns[name] = pa.array(rows.labels[name], pa.string()).dictionary_encode()
    for name in ("turn", "group_size", "candidate", "behavior_version"):
        columns[name] = pa.array(s[name])
    keys = np.ascontiguousarray(s["group_key"])
    columns["group_key"] = pa.FixedSizeBinaryArray.from_buffers(pa.binary(16), n, [None, pa.py_buffer(keys)])
    for k, name in enumerate(REWARD_COLUMNS):
        values = np.ascontiguousarray(s["rewards"][:, k])
        columns[name] = pa.array(values, pa.float32(), mask=np.isnan(values))
    rewarded = ~np.isnan(s["rewards"][:, -1])
    columns["status"] = pa.array(np.where(rewarded, Status.READY, Status.PENDING).astype(np.int8))
    columns["created_at"] = pa.array(s["created_at"], pa.timestamp("us"))
    columns["rewarded_at"] = pa.array(s["created_at"], pa.timestamp("us"), mask=~rewarded)
    return pa.Table.from_arrays([columns[f.name] for f in STEP_SCHEMA], schema=STEP_SCHEMA)


class StepBatch:
    """A producer's rows, as sent to a buffer (one call of `try_add`).

    Built by the rollout side with `StepBatch.from_records(records)`, in wire form
    (`WireRows`), in parallel with every other producer, so the buffer receives the rows
    ready to keep; a batch made from a table is split when it is pickled. The Arrow part
    travels as one buffer (out-of-band under pickle protocol 5) and is read without copying.
    The two views, `table` (STEP_SCHEMA) and `wire`, are each built on first use, so neither
    side pays for the view it does not read; hence a small class, not a frozen dataclass.
    """

    __slots__ = ("_table", "_wire", "wire_nbytes")

    def __init__(self, table: pa.Table, wire_nbytes: int = 0) -> None:
        self._table = table  # STEP_SCHEMA rows, or None until asked for
        self._wire: WireRows | None = None
        self.wire_nbytes = wire_nbytes  # size of the Arrow message it was received as (0 = built in-process)

    @classmethod
    def from_records(cls, records: list[StepRecord]) -> StepBatch:
        """The batch of `records`, built straight into wire form (`records_to_wire`)."""
        return cls.received(records_to_wire(records), 0)

    @classmethod
    def received(cls, wire: WireRows, wire_nbytes: int) -> StepBatch:
        batch = cls(None, wire_nbytes)
        batch._wire = wire
        return batch

    @property
    def table(self) -> pa.Table:
        """The rows in STEP_SCHEMA."""
        if self._table is None:
            self._table = join_rows(self._wire)
        return self._table

    @property
    def wire(self) -> WireRows:
        """The rows in wire form."""
        if self._wire is None:
            self._wire = split_rows(self._table)
        return self._wire

    def __reduce__(self):
        w = self.wire
        return _step_batch_from_wire, (w.step_ids, w.scalars, w.labels, w.body.serialize())


def _step_batch_from_wire(step_ids: list, scalars: np.ndarray, labels: dict, body: pa.Buffer) -> StepBatch:
    rows = WireRows(step_ids, scalars, labels, pa.ipc.read_record_batch(body, BODY_SCHEMA))
    return StepBatch.received(rows, body.size)
