"""Insert-then-sample throughput and memory of ReplayBuffer against a list-of-dicts buffer.

Run (seconds on one CPU core):  python scripts/bench_buffer.py
Options: --rows 20000 --arrival-rows 16 --batch-units 64 --reps 2

Both buffers get the same rows (prompts ~300 tokens, responses ~200, groups of 4), generated
before timing, each in the form its producer hands over: the list-of-dicts buffer keeps the
token lists an engine's JSON gives; ReplayBuffer receives StepRecords whose token fields are
numpy arrays (the rollout side builds them; that conversion is timed separately and shown).
Both do the same job: reward commits by step_id, readiness by group, a staleness filter,
oldest-ready-first, and a learner-ready output (token columns as contiguous numpy arrays plus
offsets, rewards, staleness). Memory overhead is resident bytes over raw token bytes
(4 B per prompt token, 12 B per response token: id, logprob, version).
"""
from __future__ import annotations

import argparse
import itertools
import random
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install
from buffers.replay import BufferConfig, ReplayBuffer  # noqa: E402
from buffers.schema import RewardCommit, StepRecord, group_key, new_id  # noqa: E402

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
    """The same output from a ReadyBatch: zero-copy views of its single-chunk columns."""
    table = batch.table
    out = {"staleness": batch.staleness, "reward": table.column("reward").to_numpy()}
    for name, _ in TOKEN_COLUMNS:
        column = table.column(name).chunk(0)
        offsets = column.offsets.to_numpy()
        out[name] = (column.flatten().to_numpy(), offsets - offsets[0])
    return out


def run(buffer_add, buffer_commit, buffer_sample, arrivals, commits, batch_units):
    """Time the three phases; returns seconds per phase and a checksum of what was trained."""
    t0 = time.perf_counter()
    for batch in arrivals:
        buffer_add(batch)
    t1 = time.perf_counter()
    for batch in commits:
        buffer_commit(batch)
    t2 = time.perf_counter()
    rows = tokens = 0
    while (out := buffer_sample(batch_units)) is not None:
        rows += len(out["reward"])
        tokens += int(out["response_ids"][0].astype(np.int64).sum()) + len(out["prompt_ids"][0])
    t3 = time.perf_counter()
    return (t1 - t0, t2 - t1, t3 - t2), (rows, tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--arrival-rows", type=int, default=16)  # rows per try_add (a few groups)
    parser.add_argument("--batch-units", type=int, default=64)
    parser.add_argument("--reps", type=int, default=2)  # best of, to damp a shared machine
    args = parser.parse_args()

    rows = make_rows(args.rows)
    t0 = time.perf_counter()
    records = [to_record(r) for r in rows]
    convert_s = time.perf_counter() - t0
    rng = random.Random(0)
    order = list(range(args.rows))
    rng.shuffle(order)  # coach scores come back in no particular order
    rewards = [(rows[i]["step_id"], rng.random()) for i in order]
    reward_batches = [rewards[i:i + 64] for i in range(0, len(rewards), 64)]
    commit_batches = [[RewardCommit(s, reward=r) for s, r in b] for b in reward_batches]
    cuts = range(0, args.rows, args.arrival_rows)
    raw = sum(4 * len(r["prompt_ids"]) + 12 * len(r["response_ids"]) for r in rows)

    # warm-up: pyarrow and numpy load kernels lazily on first use; keep that out of the timings
    warm = ReplayBuffer("policy", BufferConfig(capacity_rows=args.arrival_rows))
    warm.try_add(records[:args.arrival_rows])
    warm.commit_rewards(commit_batches[0])
    warm.sample(1, VERSION, ETA)
    best = {"list-of-dicts": None, "ReplayBuffer": None}
    for _ in range(args.reps):
        base = ListBuffer()
        times, check_base = run(base.add, base.commit, lambda u: base.sample(u, VERSION, ETA),
                                [rows[i:i + args.arrival_rows] for i in cuts], reward_batches,
                                args.batch_units)
        best["list-of-dicts"] = min(best["list-of-dicts"] or times, times, key=sum)
        buf = ReplayBuffer("policy", BufferConfig(capacity_rows=args.rows))
        held = {}

        def add(batch):
            assert buf.try_add(batch)

        def sample(units):
            if "bytes" not in held:  # first sample: every row is held, measure memory once
                held["bytes"] = buf.stats().resident_bytes
            batch = buf.sample(units, VERSION, ETA)
            if batch is None and (left := buf.stats().ready_units):
                batch = buf.sample(left, VERSION, ETA)  # the last, smaller batch: run until empty
            return None if batch is None else learner_view(batch)

        start = time.perf_counter()
        times, check_buf = run(add, buf.commit_rewards, sample,
                               [records[i:i + args.arrival_rows] for i in cuts], commit_batches,
                               args.batch_units)
        stats_s = time.perf_counter() - start - sum(times)  # stats() is excluded from timings
        assert stats_s >= 0
        best["ReplayBuffer"] = min(best["ReplayBuffer"] or times, times, key=sum)
        assert check_buf == check_base, (check_buf, check_base)  # same rows, same tokens trained
        stats = buf.stats()
        assert stats.rows_added == stats.rows_trained + sum(stats.dropped.values())

    print(f"{args.rows} rows, groups of {GROUP}, {args.arrival_rows} rows per add, "
          f"{args.batch_units} units per sample, best of {args.reps}; trained {check_buf[0]} rows, "
          f"dropped stale {stats.dropped['stale']}")
    print(f"{'buffer':<16}{'insert s':>10}{'commit s':>10}{'sample s':>10}{'total s':>10}{'us/row':>9}")
    for name, times in best.items():
        print(f"{name:<16}" + "".join(f"{t:>10.3f}" for t in times)
              + f"{sum(times):>10.3f}{sum(times) / args.rows * 1e6:>9.1f}")
    speedup = sum(best["list-of-dicts"]) / sum(best["ReplayBuffer"])
    with_convert = sum(best["list-of-dicts"]) / (sum(best["ReplayBuffer"]) + convert_s)
    print(f"producer-side list->numpy conversion (rollout actors, not the buffer): {convert_s:.3f} s; "
          f"speedup if charged to the buffer: {with_convert:.1f}")
    print(f"resident bytes {held['bytes']:,} for raw token bytes {raw:,} (all rows held)")
    print(f"buffer vs list-of-dicts speedup: {speedup:.1f}; memory overhead: {held['bytes'] / raw:.2f}")


if __name__ == "__main__":
    main()
