"""Rows from the episode to the learner: ReplayBuffer against a dict-of-lists buffer.

Tiny CPU run (seconds):     python scripts/bench_buffer.py --rows 2000 --reps 1
Default (measured: 47 s on a 2-core AMD EPYC, load average 3-7 from other jobs):
    python scripts/bench_buffer.py
Cluster (no GPU or Ray needed; one process on any node):
    python scripts/bench_buffer.py --rows 200000 --arrival-rows 20 --batch-units 256

Both sides start from the same input, the rows exactly as `Episode.records()` makes them
(StepRecords holding np.int32 / np.float32 arrays from the engine client; the K candidates
of one action share one prompt array), and end at the same output, the arrays the learner
reads (token values + offsets, reward, staleness, unit offsets and the columns advantages
and metrics read: group_key, episode_id, agent, turn, branch, candidate; a checksum
asserts both hand out the same rows, batch by batch, byte for byte). Every phase is timed the
same way for both, and all of them count:
- produce (rollout process): pickling the message (pickle protocol 5, in-band, standing in
  for Ray's serialiser). The ReplayBuffer's message is `StepBatch.from_records(records)`
  as `runtime/rollout_host.py add_rows` builds it (straight into wire form); the
  baseline's is the list of records itself. scripts/bench_datapath.py measures the whole
  path from the engine's answer, through Ray's own serialiser.
- insert (buffer actor): unpickle + add.
- commit (buffer actor): unpickle + apply 64 `RewardCommit`s, the form the coach pool and
  the rollout actor send (an extra line gives the ReplayBuffer `RewardColumns` instead).
  The commit messages are the same for both sides and pickled before timing.
- sample (buffer actor): build the batch + pickle it for the learner.
- receive (learner): unpickle + the numpy arrays `build_train_batch` starts from.
Memory is measured, the same way for both: bytes still allocated (tracemalloc, which sees
Python objects and numpy data, plus pyarrow's memory pool) once every row is held and
rewarded, over the raw token bytes (4 B per prompt token, 12 B per response token).
The last line reads `buffer vs list-of-dicts speedup: <x>; memory overhead: <y>`
(end-to-end time, and the ReplayBuffer's measured bytes over raw token bytes).

"+ WAL" is the same ReplayBuffer with a write-ahead log (buffers/wal.py) in a fresh folder
under --wal-dir (default: the system temp folder; put it on the disk a run would use): every
call is appended and flushed to the OS, defaults otherwise (64 MiB segments, no per-call
fsync). Its learner settles every sample at once (`settle_samples`), as if checkpointing every
step; a real run keeps up to `wal_undo_versions` sampled batches more in memory. Its rows/s and
peak memory are printed beside the plain buffer's.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import pickle
import random
import shutil
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install
from bench_env import HeldBytes, dtype_header  # noqa: E402
from buffers.replay import BufferConfig, ReplayBuffer  # noqa: E402
from buffers.schema import (  # noqa: E402
    RewardColumns, RewardCommit, StepBatch, StepRecord, group_key, new_id,
)

TOKEN_COLUMNS = (("prompt_ids", np.int32), ("response_ids", np.int32),
                 ("behavior_logprobs", np.float32), ("token_versions", np.int32))
# The per-row columns the learner reads besides tokens and reward: advantages
# (learners/advantages.py: group_key, or episode_id/agent/turn/branch/candidate) and the
# per-agent reward metrics (runtime/learner_worker.py: agent).
INT_COLUMNS = ("turn", "candidate")
LIST_COLUMNS = ("group_key", "episode_id", "agent", "branch")
VERSION, ETA, GROUP = 3, 2, 4
PHASES = ("produce", "insert", "commit", "sample", "receive")


def make_records(n: int, seed: int = 0) -> list[StepRecord]:
    """Rows as `Episode.act` + `Episode.records()` build them; about 5% beyond the staleness bound.

    Groups of K=4 tree candidates share one prompt array (Episode.act makes it once per call);
    responses are the engine client's np.int32 / np.float32 arrays.
    """
    rng = np.random.default_rng(seed)
    records = []
    for g in range(-(-n // GROUP)):
        task_id, episode_id = f"task{g // 8}", new_id()
        key = group_key(task_id, f"round{g}", "", "solver", 0)
        prompt = rng.integers(0, 49152, max(16, int(rng.normal(300, 40)))).astype(np.int32)
        version = VERSION - (3 if g % 20 == 0 else g % 3)
        for candidate in range(min(GROUP, n - g * GROUP)):
            r = max(1, int(rng.normal(200, 50)))
            meta = {"response_len": r, "text": "x" * min(200, 4 * r)}  # as Episode.act's row_meta
            records.append(StepRecord(
                step_id=new_id(), run_id="bench", model_id="policy", agent="solver",
                workflow="math", task_id=task_id, episode_id=episode_id, branch="", turn=0,
                group_key=key, group_size=GROUP, candidate=candidate, prompt_ids=prompt,
                response_ids=rng.integers(0, 49152, r).astype(np.int32),
                behavior_logprobs=(-rng.random(r)).astype(np.float32),
                token_versions=np.full(r, version, np.int32), finish_reason="stop",
                meta=json.dumps(meta)))
    return records


class ListBuffer:
    """The strong plain-Python alternative: records kept as they arrive, concatenated on sample.

    A step_id index, groups as lists with a rewarded count, ready groups in a deque; sampling
    concatenates each token column with one np.concatenate. It does none of ReplayBuffer's
    checks or accounting (capacity, repeated ids, group sizes, timeouts, failed rows).
    """

    def __init__(self) -> None:
        self.rows: dict[str, list] = {}  # step_id -> [record, behavior_version, reward]
        self.groups: dict[bytes, list] = {}  # group_key -> [entries, rewarded count]
        self.ready: deque = deque()  # group keys in the order they became complete

    def add(self, records: list[StepRecord]) -> None:
        for rec in records:
            entry = [rec, int(rec.token_versions.min()), None]
            self.rows[rec.step_id] = entry
            self.groups.setdefault(rec.group_key, [[], 0])[0].append(entry)

    def commit_rewards(self, commits: list[RewardCommit]) -> None:
        for commit in commits:
            entry = self.rows[commit.step_id]
            entry[2] = commit.reward
            rec = entry[0]
            group = self.groups[rec.group_key]
            group[1] += 1
            if group[1] == rec.group_size == len(group[0]):
                self.ready.append(rec.group_key)

    def sample(self, num_units: int, version: int, eta: int) -> dict | None:
        taken = []
        while self.ready and len(taken) < num_units:
            entries = self.groups.pop(self.ready.popleft())[0]
            for entry in entries:
                del self.rows[entry[0].step_id]
            fresh = [e for e in entries if version - e[1] <= eta]
            if fresh:
                taken.append(fresh)
        if not taken:
            return None
        entries = [e for group in taken for e in group]
        records = [e[0] for e in entries]
        out = {"reward": np.array([e[2] for e in entries], np.float32),
               "staleness": np.array([version - e[1] for e in entries], np.int32),
               "unit_offsets": np.cumsum([0] + [len(group) for group in taken]),
               **{name: np.array([getattr(r, name) for r in records], np.int16)
                  for name in INT_COLUMNS},
               **{name: [getattr(r, name) for r in records] for name in LIST_COLUMNS}}
        for name, dtype in TOKEN_COLUMNS:
            arrays = [getattr(rec, name) for rec in records]
            offsets = np.zeros(len(arrays) + 1, np.int64)
            np.cumsum([len(a) for a in arrays], out=offsets[1:])
            out[name] = (np.concatenate(arrays).astype(dtype, copy=False), offsets)
        return out


def learner_view(batch) -> dict:
    """The learner's numpy view of a ReadyBatch: zero-copy views of its single-chunk columns."""
    table = batch.table
    out = {"reward": table.column("reward").to_numpy(), "staleness": batch.staleness,
           "unit_offsets": batch.unit_offsets,
           **{name: table.column(name).to_numpy() for name in INT_COLUMNS},
           **{name: table.column(name).to_pylist() for name in LIST_COLUMNS}}
    for name, _ in TOKEN_COLUMNS:
        column = table.column(name).chunk(0)
        offsets = column.offsets.to_numpy()
        out[name] = (column.flatten().to_numpy(), offsets - offsets[0])
    return out


def checksum(out: dict, digest) -> int:
    """Feed everything the learner reads of one batch into `digest`; returns its row count."""
    for name in ("reward", "staleness", "unit_offsets", *INT_COLUMNS):
        digest.update(np.ascontiguousarray(out[name]).tobytes())
    for name in LIST_COLUMNS:
        digest.update(repr(out[name]).encode())
    for name, dtype in TOKEN_COLUMNS:
        values, offsets = out[name]
        digest.update(np.ascontiguousarray(values, dtype).tobytes())
        digest.update(np.ascontiguousarray(offsets, np.int64).tobytes())
    return len(out["reward"])


@dataclass(frozen=True)
class Side:
    """How one buffer is fed and read; everything else is shared."""

    new: Callable  # () -> buffer
    message: Callable  # records -> what the rollout process pickles
    add: Callable  # (buffer, unpickled message) -> None
    sample: Callable  # (buffer, num_units) -> batch or None
    view: Callable  # unpickled batch -> learner arrays (the `checksum` input)


def replay_sample(buf: ReplayBuffer, num_units: int):
    batch = buf.sample(num_units, VERSION, ETA)
    if batch is None and (left := len(buf._ready)):
        batch = buf.sample(left, VERSION, ETA)  # the last, smaller batch: run until empty
    return batch


def replay_side(capacity: int, wal_root: str | None = None) -> Side:
    """The ReplayBuffer; with `wal_root`, logging to a fresh folder there (the last one removed)."""
    folders: list[str] = []

    def new():
        if wal_root is None:
            return ReplayBuffer("policy", BufferConfig(capacity_rows=capacity))
        while folders:
            shutil.rmtree(folders.pop())
        folders.append(tempfile.mkdtemp(prefix="bench-wal-", dir=wal_root))
        return ReplayBuffer("policy", BufferConfig(capacity_rows=capacity), folders[-1])

    def add(buf, message):
        assert buf.try_add(message)

    def sample(buf, num_units):
        batch = replay_sample(buf, num_units)
        if batch is not None and wal_root is not None:
            buf.settle_samples(VERSION + 1)  # the learner checkpointed: nothing kept for an undo
        return batch
    return Side(new, StepBatch.from_records, add, sample, learner_view)


LIST_SIDE = Side(ListBuffer, lambda records: records, ListBuffer.add,
                 lambda buf, units: buf.sample(units, VERSION, ETA), lambda out: out)


def run(side: Side, cuts: list, commit_messages: list, batch_units: int,
        measure_memory: bool = False):
    """One pass from the episode's rows to the learner's arrays.

    Returns (seconds per phase, (rows trained, digest), buffer, memory). memory is None, or
    with `measure_memory` (bytes held with every row rewarded, the buffer's own estimate of
    them or None, peak bytes held). With `measure_memory` tracemalloc runs from after the
    messages are built until the last batch is received, and Arrow's pool is read after every
    message for the peak; that pass's times are not comparable.
    """
    clock = time.perf_counter
    times = dict.fromkeys(PHASES, 0.0)
    buf = side.new()
    start = clock()
    messages = [pickle.dumps(side.message(records), protocol=5) for records in cuts]
    times["produce"] = clock() - start
    memory, meter = None, HeldBytes(measure_memory)
    meter.start()
    start = clock()
    for message in messages:
        side.add(buf, pickle.loads(message))
        meter.note()
    times["insert"] = clock() - start
    start = clock()
    for message in commit_messages:
        buf.commit_rewards(pickle.loads(message))
        meter.note()
    times["commit"] = clock() - start
    if measure_memory:
        memory = meter.held(), buf.stats().resident_bytes if isinstance(buf, ReplayBuffer) else None
    rows, digest = 0, hashlib.blake2b(digest_size=16)
    while True:
        start = clock()
        batch = side.sample(buf, batch_units)
        if batch is None:
            break
        blob = pickle.dumps(batch, protocol=5)
        received = clock()
        out = side.view(pickle.loads(blob))
        done = clock()
        times["sample"] += received - start
        times["receive"] += done - received
        rows += checksum(out, digest)  # untimed
        meter.note()
    if measure_memory:
        memory = (*memory, meter.stop())
    return tuple(times.values()), (rows, digest.hexdigest()), buf, memory


def commit_messages(records: list[StepRecord]) -> tuple[list[bytes], list[bytes]]:
    """Coach scores in no particular order, 64 per message: as RewardCommit lists (what the
    coach pool sends) and as RewardColumns."""
    rng = random.Random(0)
    order = list(range(len(records)))
    rng.shuffle(order)
    rewards = [(records[i].step_id, rng.random()) for i in order]
    batches = [rewards[i:i + 64] for i in range(0, len(rewards), 64)]
    lists = [pickle.dumps([RewardCommit(s, reward=r) for s, r in b], protocol=5) for b in batches]
    columns = [pickle.dumps(RewardColumns([s for s, _ in b],
                                          reward=np.array([r for _, r in b], np.float32)),
                            protocol=5) for b in batches]
    return lists, columns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20000)
    # rows per producer message: K + K*K for a tree round of K=4
    parser.add_argument("--arrival-rows", type=int, default=20)
    parser.add_argument("--batch-units", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)  # best of, per phase: a shared machine
    parser.add_argument("--wal-dir", default=tempfile.gettempdir())  # where "+ WAL" logs
    args = parser.parse_args()
    _, header = dtype_header("cpu")
    print(header + "\n(unused here: the buffer holds int32 token ids and float32 logprobs)")

    records = make_records(args.rows)
    cuts = [records[i:i + args.arrival_rows] for i in range(0, args.rows, args.arrival_rows)]
    commit_lists, commit_columns = commit_messages(records)
    raw = sum(4 * len(r.prompt_ids) + 12 * len(r.response_ids) for r in records)
    wal_root = tempfile.mkdtemp(prefix="bench-buffer-", dir=args.wal_dir)
    sides = {"dict-of-lists": (LIST_SIDE, commit_lists),
             "ReplayBuffer": (replay_side(args.rows), commit_lists),
             "  RewardColumns": (replay_side(args.rows), commit_columns),
             "  + WAL": (replay_side(args.rows, wal_root), commit_lists)}
    run(sides["ReplayBuffer"][0], cuts[:2], commit_lists[:1], 1)  # warm-up: lazy kernel loading
    best: dict = dict.fromkeys(sides)
    checks = {}
    for _ in range(args.reps):
        for name, (side, commits) in sides.items():
            times, checks[name], buf, _ = run(side, cuts, commits, args.batch_units)
            best[name] = tuple(map(min, zip(best[name] or times, times)))  # per phase
            if isinstance(buf, ReplayBuffer):
                stats = buf.stats()
                assert stats.rows_added == stats.rows_trained + sum(stats.dropped.values())
    assert len(set(checks.values())) == 1, checks  # same batches, byte for byte
    memory = {name: run(sides[name][0], cuts, sides[name][1], args.batch_units, True)[3]
              for name in ("dict-of-lists", "ReplayBuffer", "  + WAL")}  # (held, own estimate, peak)
    shutil.rmtree(wal_root)
    print(f"{args.rows} rows, groups of {GROUP}, {args.arrival_rows} rows per producer message, "
          f"{args.batch_units} units per sample, each phase the best of {args.reps}; "
          f"trained {checks['ReplayBuffer'][0]} rows, dropped stale {stats.dropped['stale']}")
    report(args.rows, best, memory, raw)


def report(rows: int, best: dict, memory: dict, raw: int) -> None:
    print("seconds per phase, from the rows Episode.records() makes to the arrays the learner "
          "reads\n(produce: rollout process; insert, commit, sample: buffer actor; "
          "receive: learner):")
    print(f"{'buffer':<16}" + "".join(f"{p:>9}" for p in PHASES)
          + f"{'actor s':>9}{'total s':>9}{'us/row':>8}")
    for name, times in best.items():
        print(f"{name:<16}" + "".join(f"{t:>9.3f}" for t in times)
              + f"{sum(times[1:4]):>9.3f}{sum(times):>9.3f}{sum(times) / rows * 1e6:>8.1f}")
    print("  (RewardColumns: the same ReplayBuffer given RewardColumns commit messages, which no\n"
          "   caller in actors/ or runtime/ sends today: they send lists of RewardCommit)")
    base, arrow = best["dict-of-lists"], best["ReplayBuffer"]
    print(f"buffer actor only (insert + commit + sample, the serial part): "
          f"{sum(base[1:4]) / sum(arrow[1:4]):.1f}x; "
          f"producer side alone: {base[0] / arrow[0]:.2f}x "
          "(ReplayBuffer's rollout process pays StepBatch.from_records)")
    print("what differs:\n"
          "- messages: dict-of-lists gets the pickled StepRecords (4 numpy arrays per row, a\n"
          "  group's shared prompt pickled once); ReplayBuffer a StepBatch (the wire form\n"
          "  copies the prompt into every row)\n"
          "- batches: dict-of-lists hands out what the learner reads (12 per-row columns + unit\n"
          "  offsets); ReplayBuffer the whole STEP_SCHEMA table (27 columns)\n"
          "- dict-of-lists checks nothing (capacity, repeated ids, group sizes, timeouts, failed\n"
          "  rows, drop counts)")
    for name, (nbytes, _, _) in memory.items():
        print(f"{name:<14} holds {nbytes:>13,} bytes for raw token bytes {raw:,}: "
              f"{nbytes / raw:.2f} (tracemalloc + Arrow pool, every row held and rewarded)")
    print("write-ahead log (same input; rows/s = rows through insert + commit + sample, the "
          "buffer actor's serial part; peak = most bytes held during the pass):")
    for name in ("ReplayBuffer", "  + WAL"):
        actor_s = sum(best[name][1:4])
        print(f"{name:<16}{rows / actor_s:>12,.0f} rows/s{memory[name][2]:>16,} bytes peak")
    plain, logged = best["ReplayBuffer"], best["  + WAL"]
    print(f"write-ahead log cost: {sum(logged[1:4]) / sum(plain[1:4]):.2f}x the buffer actor's "
          f"time, {memory['  + WAL'][2] / memory['ReplayBuffer'][2]:.2f}x its peak memory")
    print(f"ReplayBuffer's own estimate (stats().resident_bytes, held rows): "
          f"{memory['ReplayBuffer'][1]:,}")
    speedup = sum(base) / sum(arrow)
    print(f"buffer vs list-of-dicts speedup: {speedup:.1f}; "
          f"memory overhead: {memory['ReplayBuffer'][0] / raw:.2f}")


if __name__ == "__main__":
    main()
