"""What the buffer actor pays per row: ReplayBuffer against a list-of-dicts buffer.

Run (about half a minute on one CPU core):  python scripts/bench_buffer.py
Options: --rows 20000 --arrival-rows 20 --batch-units 64 --reps 3

In production the buffer is ONE actor that every rollout actor sends rows to and every
learner pulls from, so its per-row cost is the system's serial bottleneck, while work on the
producer side is spread over many rollout actors. Both buffers are therefore charged exactly
what that actor does, measured the same way:
- insert: pickle.loads of each producer message + the insert. The messages are pickled
  (protocol 5) BEFORE timing: that is the producer's / the transport's sender side. The
  list-of-dicts message is the rows as an engine's JSON gives them (Python int lists); the
  ReplayBuffer message is a StepBatch built with records_to_table (it travels as numpy
  scalars, label lists and one Arrow IPC message). Messages hold 20 rows by default, five
  groups of 4: what a rollout actor sends after a round (a tree round of K=4 sends
  K + K*K = 20 rows; try --arrival-rows 8 or 16). An extra line feeds the same
  ReplayBuffer bare pickled pa.Tables, which it must split itself.
- commit: pickle.loads of each batch of 64 reward commits + applying them. The baseline gets
  (step_id, reward) tuples; the ReplayBuffer gets one RewardColumns message (step_ids + a
  float32 array), and an extra line gives it lists of RewardCommit instead.
- sample: building the learner-ready output (contiguous numpy token arrays + offsets for the
  baseline, the ReadyBatch's Arrow table for ReplayBuffer) + pickle.dumps (protocol 5) of it
  for the trip to the learner. The learner's unpickling and the checksum are not timed.
NOT charged to the buffer, printed separately: building and pickling each StepBatch from
Python lists (lists -> numpy -> records_to_table -> wire form), which the rollout actors do
in parallel.
Memory overhead is resident bytes (all rows held) over raw token bytes (4 B per prompt token,
12 B per response token: id, logprob, version).
"""
from __future__ import annotations

import argparse
import hashlib
import itertools
import pickle
import random
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install
from buffers.replay import BufferConfig, ReplayBuffer  # noqa: E402
from buffers.schema import (  # noqa: E402
    RewardColumns, RewardCommit, StepBatch, StepRecord, group_key, new_id, records_to_table,
)

TOKEN_COLUMNS = (("prompt_ids", np.int32), ("response_ids", np.int32),
                 ("behavior_logprobs", np.float32), ("token_versions", np.int32))
VERSION, ETA, GROUP = 3, 2, 4


def make_rows(n: int, seed: int = 0) -> list[dict]:
    """Engine-style rows: token lists as parsed from JSON, about 5% beyond the staleness bound."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        g = i // GROUP
        p, r = max(16, int(rng.normal(300, 40))), max(1, int(rng.normal(200, 50)))
        version = VERSION - (3 if g % 20 == 0 else g % 3)
        rows.append({
            "step_id": new_id(), "task_id": f"task{g // 8}", "episode_id": new_id(), "group": g,
            "group_key": group_key(f"task{g // 8}", f"round{g}", "", "solver", 0),
            "candidate": i % GROUP, "created_at": time.time(),
            "prompt_ids": rng.integers(0, 49152, p).tolist(),
            "response_ids": rng.integers(0, 49152, r).tolist(),
            "behavior_logprobs": (-rng.random(r)).astype(np.float32).tolist(),
            "token_versions": [version] * r,
        })
    return rows


def to_record(row: dict) -> StepRecord:
    """What a rollout actor does before sending a row: token lists become numpy arrays."""
    return StepRecord(
        step_id=row["step_id"], run_id="bench", model_id="policy", agent="solver", workflow="math",
        task_id=row["task_id"], episode_id=row["episode_id"], branch="", turn=0,
        group_key=row["group_key"], group_size=GROUP, candidate=row["candidate"],
        prompt_ids=np.asarray(row["prompt_ids"], np.int32),
        response_ids=np.asarray(row["response_ids"], np.int32),
        behavior_logprobs=np.asarray(row["behavior_logprobs"], np.float32),
        token_versions=np.asarray(row["token_versions"], np.int32), finish_reason="stop",
        created_at=row["created_at"],
    )


class ListBuffer:
    """The straightforward alternative: dict rows, a step_id index, groups as lists."""

    def __init__(self) -> None:
        self.by_step: dict[str, dict] = {}
        self.groups: dict[bytes, list[dict]] = {}
        self.ready: deque = deque()  # group keys in the order they became complete

    def add(self, rows: list[dict]) -> None:
        for row in rows:
            row = dict(row, reward=None, behavior_version=min(row["token_versions"]))
            self.by_step[row["step_id"]] = row
            self.groups.setdefault(row["group_key"], []).append(row)

    def commit(self, commits: list[tuple[str, float]]) -> None:
        for step_id, reward in commits:
            row = self.by_step[step_id]
            row["reward"] = reward
            group = self.groups[row["group_key"]]
            if len(group) == GROUP and all(r["reward"] is not None for r in group):
                self.ready.append(row["group_key"])

    def sample(self, num_units: int, version: int, eta: int) -> dict | None:
        taken = []
        while self.ready and len(taken) < num_units:
            group = self.groups.pop(self.ready.popleft())
            for row in group:
                del self.by_step[row["step_id"]]
            fresh = [r for r in group if version - r["behavior_version"] <= eta]
            if fresh:
                taken.append(fresh)
        if not taken:
            return None
        rows = [r for group in taken for r in group]
        out = {"staleness": np.array([version - r["behavior_version"] for r in rows], np.int32),
               "reward": np.array([r["reward"] for r in rows], np.float32)}
        for name, dtype in TOKEN_COLUMNS:
            lists = [r[name] for r in rows]
            offsets = np.zeros(len(rows) + 1, np.int64)
            np.cumsum([len(t) for t in lists], out=offsets[1:])
            out[name] = (np.fromiter(itertools.chain.from_iterable(lists), dtype, int(offsets[-1])), offsets)
        return out


def learner_view(batch) -> dict:
    """The learner's numpy view of a ReadyBatch: zero-copy views of its single-chunk columns."""
    table = batch.table
    out = {"staleness": batch.staleness, "reward": table.column("reward").to_numpy()}
    for name, _ in TOKEN_COLUMNS:
        column = table.column(name).chunk(0)
        offsets = column.offsets.to_numpy()
        out[name] = (column.flatten().to_numpy(), offsets - offsets[0])
    return out


def checksum(out: dict, digest) -> int:
    """Feed everything the learner reads of one batch into `digest`; returns its row count.

    Both buffers must hand out the same rows in the same order, batch by batch: same rewards,
    staleness and token values and offsets, byte for byte.
    """
    for name in ("reward", "staleness"):
        digest.update(np.ascontiguousarray(out[name]).tobytes())
    for name, dtype in TOKEN_COLUMNS:
        values, offsets = out[name]
        digest.update(np.ascontiguousarray(values, dtype).tobytes())
        digest.update(np.ascontiguousarray(offsets, np.int64).tobytes())
    return len(out["reward"])


def run(add, commit, sample, messages, commit_messages, view, before_sample=lambda: None):
    """Time what the buffer actor pays; returns seconds per phase and a digest of what was trained.

    insert: unpickle each producer message + insert. commit: unpickle each commit message +
    apply. sample: produce the learner-ready output + pickle it for the trip to the learner.
    """
    t0 = time.perf_counter()
    for message in messages:
        add(pickle.loads(message))
    t1 = time.perf_counter()
    for message in commit_messages:
        commit(pickle.loads(message))
    t2 = time.perf_counter()
    before_sample()  # untimed: e.g. reading resident bytes while every row is held
    sample_s, rows, digest = 0.0, 0, hashlib.blake2b(digest_size=16)
    while True:
        start = time.perf_counter()
        out = sample()
        if out is None:
            break
        pickle.dumps(out, protocol=5)
        sample_s += time.perf_counter() - start
        rows += checksum(view(out), digest)  # the learner's side, untimed
    return (t1 - t0, t2 - t1, sample_s), (rows, digest.hexdigest())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--arrival-rows", type=int, default=20)  # rows per producer message: K + K*K for a tree round of K=4
    parser.add_argument("--batch-units", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)  # best of, to damp a shared machine
    args = parser.parse_args()

    rows = make_rows(args.rows)
    cuts = [rows[i:i + args.arrival_rows] for i in range(0, args.rows, args.arrival_rows)]
    # producer side (parallel rollout actors), timed only to be shown: build each message
    t0 = time.perf_counter()
    step_batches = [StepBatch(records_to_table([to_record(r) for r in cut])) for cut in cuts]
    arrow_messages = [pickle.dumps(b, protocol=5) for b in step_batches]
    build_s = time.perf_counter() - t0
    # sender side (Ray serialises the call's argument before it reaches the buffer): untimed
    base_messages = [pickle.dumps(cut, protocol=5) for cut in cuts]
    table_messages = [pickle.dumps(b.table, protocol=5) for b in step_batches]
    rng = random.Random(0)
    order = list(range(args.rows))
    rng.shuffle(order)  # coach scores come back in no particular order
    rewards = [(rows[i]["step_id"], rng.random()) for i in order]
    reward_batches = [rewards[i:i + 64] for i in range(0, len(rewards), 64)]
    base_commits = [pickle.dumps(b, protocol=5) for b in reward_batches]
    column_commits = [pickle.dumps(RewardColumns([s for s, _ in b], reward=np.array([r for _, r in b], np.float32)),
                                   protocol=5) for b in reward_batches]
    list_commits = [pickle.dumps([RewardCommit(s, reward=r) for s, r in b], protocol=5)
                    for b in reward_batches]
    raw = sum(4 * len(r["prompt_ids"]) + 12 * len(r["response_ids"]) for r in rows)

    # warm-up: pyarrow and numpy load kernels lazily on first use; keep that out of the timings
    warm = ReplayBuffer("policy", BufferConfig(capacity_rows=args.arrival_rows))
    warm.try_add(pickle.loads(arrow_messages[0]))
    warm.commit_rewards(pickle.loads(column_commits[0]))
    pickle.dumps(warm.sample(1, VERSION, ETA), protocol=5)
    variants = {"list-of-dicts": (base_messages, base_commits),
                "ReplayBuffer": (arrow_messages, column_commits),
                "  commit lists": (arrow_messages, list_commits),
                "  bare pa.Table": (table_messages, column_commits)}
    best: dict = {name: None for name in variants}
    for _ in range(args.reps):
        base = ListBuffer()
        times, check_base = run(base.add, base.commit, lambda: base.sample(args.batch_units, VERSION, ETA),
                                *variants["list-of-dicts"], lambda out: out)
        best["list-of-dicts"] = min(best["list-of-dicts"] or times, times, key=sum)
        for name in list(variants)[1:]:
            buf = ReplayBuffer("policy", BufferConfig(capacity_rows=args.rows))
            held = {}

            def add(message):
                assert buf.try_add(message)

            def sample():
                batch = buf.sample(args.batch_units, VERSION, ETA)
                if batch is None and (left := len(buf._ready)):
                    batch = buf.sample(left, VERSION, ETA)  # the last, smaller batch: run until empty
                return batch

            def before_sample():
                held["bytes"] = buf.stats().resident_bytes

            times, check_buf = run(add, buf.commit_rewards, sample, *variants[name], learner_view,
                                   before_sample)
            best[name] = min(best[name] or times, times, key=sum)
            assert check_buf == check_base, (check_buf, check_base)  # same batches, byte for byte
            stats = buf.stats()
            assert stats.rows_added == stats.rows_trained + sum(stats.dropped.values())
            if name == "ReplayBuffer":
                memory = held["bytes"]

    print(f"{args.rows} rows, groups of {GROUP}, {args.arrival_rows} rows per producer message, "
          f"{args.batch_units} units per sample, best of {args.reps}; trained {check_buf[0]} rows, "
          f"dropped stale {stats.dropped['stale']}")
    print("buffer actor's cost (insert = unpickle + add; commit = unpickle + apply; "
          "sample = build learner batch + pickle it):")
    print(f"{'buffer':<16}{'insert s':>10}{'commit s':>10}{'sample s':>10}{'total s':>10}{'us/row':>9}")
    for name, times in best.items():
        print(f"{name:<16}" + "".join(f"{t:>10.3f}" for t in times)
              + f"{sum(times):>10.3f}{sum(times) / args.rows * 1e6:>9.1f}")
    print("  (commit lists: the same ReplayBuffer given lists of RewardCommit instead of RewardColumns;\n"
          "   bare pa.Table: given pickled pa.Table messages instead of StepBatch)")
    print(f"producer side, NOT charged to the buffer (spread over the rollout actors): building each "
          f"StepBatch (lists -> numpy -> records_to_table -> wire form, pickled) {build_s / args.rows * 1e6:.1f} us/row; "
          f"the list-of-dicts producer builds nothing")
    speedup = sum(best["list-of-dicts"]) / sum(best["ReplayBuffer"])
    print(f"resident bytes {memory:,} for raw token bytes {raw:,} (all rows held)")
    print(f"buffer vs list-of-dicts speedup: {speedup:.1f}; memory overhead: {memory / raw:.2f}")


if __name__ == "__main__":
    main()
