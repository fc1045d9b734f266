"""From an engine response to a learner batch: the data path's cost per row, three wire forms.

Tiny CPU run (seconds):     python scripts/bench_datapath.py --episodes 50 --reps 1
Default (measured: about 1.5 min on a 2-core AMD EPYC shared with other jobs):
    python scripts/bench_datapath.py
Cluster (no GPU needed; one process on any node; longer prompts, more candidates):
    python scripts/bench_datapath.py --episodes 2000 --k 8 --prompt-len 1500 --response-len 600
Through a real local Ray (timing only; memory is always measured as below):
    python scripts/bench_datapath.py --ray

Input: recorded-looking SGLang `/generate` answers, one JSON body per engine call with K
results, as the engine client receives them (`meta_info.output_token_logprobs` as
[logprob, token_id, None] triples, `output_ids`, `weight_version`, `finish_reason`; a few
answers span two weight versions, as when an update lands mid-generation). An episode is
--acts engine calls of --k candidates each, every call with its own prompt; its rows go to
the buffer in one message, as the rollout actor ships an episode. About 5 % of the episodes
are older than the staleness bound, so the buffer drops them.

Every side goes through every hop, and every hop is timed the same way for all of them:
- parse (rollout): `_parse_output` of each result (the JSON decode before it, the same for
  every form, is printed apart and not summed);
- records (rollout): `Episode.act` + `Episode.records()`, as the rollout actor calls them
  (the engine and the tokenizer are stubs that answer from the recording; the response text
  the workflow decodes is a fixed string, so a real tokenizer's decode is not counted);
  Both run the same code on every side, so each is reported as its best pass on any side
  (one figure for all, without the noise of a shared machine between them);
- build (rollout): the message `RayRolloutPorts.add_rows` sends;
- send (rollout): Ray's serialiser. Ray pickles an actor call's arguments and results with
  its own cloudpickle, protocol 5, buffers out of band, then makes one copy of those buffers
  (into the object store, or into the receiver for a small argument) and unpickles over
  them without copying. This script does exactly that in one process: `ray.cloudpickle` with
  Ray's reducers registered, the copy charged to the receiving phase. What it leaves out is
  the raylet round trip, the same fixed cost per call for every side (`--ray` puts it back:
  `ray.get(ray.put(x))` in a local Ray with one CPU);
- insert (buffer actor): receive + add;
- commit (buffer actor): receive + apply the coach's 64-row lists of `RewardCommit` (the
  same messages for every side, serialised before timing);
- sample (buffer actor): the batch + serialising it for the learner;
- receive (learner): receive + the numpy arrays `build_train_batch` starts from (token values
  and offsets, reward, staleness, unit offsets and the columns advantages and metrics read).
A checksum asserts that every side hands the learner the same rows, batch by batch.

The three sides, from the same records:
- hand-rolled: `StepBatch.from_records`, the wire form of buffers/schema.py (scalars as one
  numpy structured array, labels as lists, variable-length columns as one Arrow IPC message);
- arrow: the rows as one plain `pa.RecordBatch` in STEP_SCHEMA (`records_to_table`), sent
  as is (Ray pickles Arrow arrays natively, their buffers out of band); the buffer splits it
  on arrival (`ReplayBuffer.try_add` takes a record batch);
- list-of-dicts: the strong plain baseline: each StepRecord's own `__dict__` (no copy: the
  same fields, the numpy arrays as the engine client made them, a group's prompt array
  shared and sent once), kept as they arrive and concatenated on sample (`DictBuffer`).
Memory is measured the same way for every side: bytes allocated (tracemalloc, which sees
Python objects and numpy data, plus pyarrow's memory pool) once every row is held and
rewarded, over the raw token bytes (4 B per prompt token, 12 B per response token).
The last line reads
`datapath vs list-of-dicts: <x>; arrow vs hand-rolled: <y>; memory overhead: <z>`: x is the
shipped form's end-to-end time over the baseline's, y the arrow side's over the hand-rolled
side's, z the shipped form's measured bytes over the raw token bytes.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import os
import pickle
import random
import sys
import time
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install
from ray import cloudpickle  # noqa: E402  (the pickler Ray serialises with)
from ray._private.serialization import SerializationContext  # noqa: E402

import actors.episode as episode_module  # noqa: E402
from actors.engines.client import _parse_output  # noqa: E402
from actors.episode import Episode, ModelRoute, SamplingParams  # noqa: E402
from bench_buffer import (  # noqa: E402
    INT_COLUMNS, LIST_COLUMNS, TOKEN_COLUMNS, checksum, learner_view,
)
from bench_env import HeldBytes, cpu_model  # noqa: E402
from buffers.replay import BufferConfig, ReplayBuffer  # noqa: E402
from buffers.schema import RewardCommit, StepBatch, StepRecord, records_to_table  # noqa: E402

VERSION, ETA = 3, 2  # learner version at sampling, staleness bound
PHASES = ("parse", "records", "build", "send", "insert", "commit", "sample", "receive")
ROLLOUT, ACTOR = PHASES[:4], PHASES[4:7]
SHARED = ("parse", "records")  # the same code for every side
SHIPPED = "hand-rolled"  # the form runtime/rollout_host.py add_rows sends
PADDING = bytes(64)  # Ray starts an out-of-band buffer at 64 bytes (2 KiB or more) or 8


# ----------------------------------------------------------------------------- input
@dataclass(frozen=True)
class Call:
    """One recorded engine call of an episode: what the workflow asked and what came back."""

    turn: int
    prompt: str  # the stub tokenizer's key for prompt_ids
    prompt_ids: list  # [P] int, as a tokenizer returns them
    body: bytes  # the /generate answer: a JSON list of K results


def engine_result(rng: np.random.Generator, prompt_tokens: int, length: int,
                  max_new_tokens: int, version: int, mixed: bool) -> dict:
    """One `/generate` result as SGLang 0.5 answers with return_logprob (no text in logprobs)."""
    ids = rng.integers(0, 49152, length).tolist()
    logprobs = (-rng.exponential(0.7, length)).tolist()
    meta = {"id": uuid.UUID(int=int(rng.integers(1 << 62))).hex,
            "finish_reason": {"type": "length", "length": max_new_tokens}
            if length == max_new_tokens else {"type": "stop", "matched": 2},
            "prompt_tokens": prompt_tokens, "weight_version": str(version), "num_retractions": 0,
            "reasoning_tokens": 0, "completion_tokens": length, "cached_tokens": 0,
            "output_token_logprobs": [[lp, i, None] for lp, i in zip(logprobs, ids)],
            "e2e_latency": 1.0}
    if mixed:  # a weight update landed mid-generation: the first part is one version older
        cut = length // 2
        meta["weight_versions"] = [{"version": str(version - 1), "start": 0, "end": cut},
                                   {"version": str(version), "start": cut, "end": length}]
    return {"text": "x" * (4 * length), "output_ids": ids, "meta_info": meta}


def make_episodes(args) -> list[list[Call]]:
    """--episodes episodes of --acts calls of --k candidates; lengths drawn around the means."""
    rng = np.random.default_rng(0)
    episodes = []
    for e in range(args.episodes):
        version = VERSION - (3 if e % 20 == 0 else e % 3)  # every 20th beyond the bound
        calls = []
        for a in range(args.acts):
            length = max(16, int(rng.normal(args.prompt_len, args.prompt_len / 4)))
            prompt = rng.integers(0, 49152, length)
            lengths = np.clip(rng.normal(args.response_len, args.response_len * 0.4, args.k),
                              1, args.max_new_tokens).astype(int)
            results = [engine_result(rng, len(prompt), int(r), args.max_new_tokens, version,
                                     mixed=rng.random() < 0.03) for r in lengths]
            calls.append(Call(a, f"episode {e} call {a}", prompt.tolist(),
                              json.dumps(results).encode()))
        episodes.append(calls)
    return episodes


# ----------------------------------------------------------------------------- rollout side
class RecordedTokenizer:
    """Answers the rollout side's tokenizer calls from the recording."""

    def __init__(self, episodes: list[list[Call]]) -> None:
        self.prompts = {c.prompt: c.prompt_ids for calls in episodes for c in calls}

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": self.prompts[text]}


class RecordedRoute(ModelRoute):
    """A model route whose decode is a fixed text: the workflow's text costs what its
    tokenizer costs, whatever the wire form, so it is left out of every side."""

    TEXT = "x" * 800

    def decode(self, ids: np.ndarray) -> str:
        return self.TEXT


class RecordedEngine:
    """The engine client's part in `Episode.act`: the generations parsed just before."""

    generations: list = []

    async def generate(self, prompt_ids, n, max_new_tokens, temperature=1.0, top_p=1.0,
                       stop_token_ids=None, stop=None) -> list:
        return self.generations


def finish(coroutine):
    """Run a coroutine that never waits (the recorded engine answers at once)."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    raise RuntimeError("Episode.act waited on something the recording does not provide")


@contextlib.contextmanager
def seeded_ids():
    """Step and episode ids from a seeded generator, so every side makes the same rows (same
    group keys, same episode ids); each costs what a uuid4 costs."""
    draw = random.Random(0).getrandbits
    original = episode_module.new_id
    episode_module.new_id = lambda: uuid.UUID(int=draw(128), version=4).hex
    try:
        yield
    finally:
        episode_module.new_id = original


def play(calls: list[Call], route: ModelRoute, engine: RecordedEngine, k: int,
         times: dict, clock) -> list[StepRecord]:
    """One episode's parse and records phases; returns its rows."""
    bodies = [json.loads(c.body) for c in calls]  # httpx's response.json(), timed apart
    start = clock()
    parsed = [[_parse_output(result) for result in body] for body in bodies]
    parsed_at = clock()
    episode = Episode(run_id="bench", workflow="tree", task_id=calls[0].prompt, round_id="r",
                      round_size=1, round_index=0, group_size=k,
                      agent_models={"solver": "policy"}, routes={"policy": route},
                      sampling=SamplingParams())
    for call, generations in zip(calls, parsed):
        engine.generations = generations
        finish(episode.act("solver", call.prompt, turn=call.turn, n=k, max_new_tokens=1024))
    records = episode.records(episode.group_counts())["policy"]
    times["parse"] += parsed_at - start
    times["records"] += clock() - parsed_at
    return records


# ----------------------------------------------------------------------------- the wire
class Wire:
    """Ray's serialisation of one call's argument or result, in this process (see docstring)."""

    def __init__(self) -> None:
        SerializationContext(None)  # registers Ray's reducers (pa.Table, ...) on its pickler

    def send(self, obj) -> tuple:
        buffers: list = []
        inband = cloudpickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
        return inband, buffers

    def receive(self, sent: tuple):
        """The one copy of the out-of-band buffers, then unpickling over views of it."""
        inband, buffers = sent
        pieces, spans, at = [], [], 0
        for buffer in buffers:
            raw = buffer.raw()
            pad = -at % (64 if raw.nbytes >= 2048 else 8)  # where Ray's writer places it
            pieces += (PADDING[:pad], raw)
            at += pad
            spans.append((at, at + raw.nbytes))
            at += raw.nbytes
        block = memoryview(b"".join(pieces))  # read-only, as an object in Ray's store
        return pickle.loads(inband, buffers=[block[start:end] for start, end in spans])


class RayWire:
    """The same through a local Ray: `ray.put` on the sender, `ray.get` on the receiver."""

    def __init__(self) -> None:
        import ray

        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
        self.ray = ray

    def send(self, obj):
        return self.ray.put(obj)

    def receive(self, ref):
        return self.ray.get(ref)


# ----------------------------------------------------------------------------- buffers
class DictBuffer:
    """The list-of-dicts baseline: rows kept as they arrive, concatenated on sample.

    A step_id index, groups as lists with a rewarded count, ready groups in a deque; sampling
    concatenates each token column once. It does none of ReplayBuffer's checks or accounting
    (capacity, repeated ids, group sizes, timeouts, failed rows, drop counts).
    """

    def __init__(self) -> None:
        self.rows: dict[str, list] = {}  # step_id -> [row, behavior_version, reward]
        self.groups: dict[bytes, list] = {}  # group_key -> [entries, rewarded count]
        self.ready: deque = deque()  # group keys in the order they became complete

    def add(self, rows: list[dict]) -> None:
        for row in rows:
            entry = [row, int(row["token_versions"].min()), None]
            self.rows[row["step_id"]] = entry
            self.groups.setdefault(row["group_key"], [[], 0])[0].append(entry)

    def commit_rewards(self, commits: list[RewardCommit]) -> None:
        for commit in commits:
            entry = self.rows[commit.step_id]
            entry[2] = commit.reward
            row = entry[0]
            group = self.groups[row["group_key"]]
            group[1] += 1
            if group[1] == row["group_size"] == len(group[0]):
                self.ready.append(row["group_key"])

    def sample(self, num_units: int) -> dict | None:
        taken = []
        while self.ready and len(taken) < num_units:
            entries = self.groups.pop(self.ready.popleft())[0]
            for entry in entries:
                del self.rows[entry[0]["step_id"]]
            fresh = [e for e in entries if VERSION - e[1] <= ETA]
            if fresh:
                taken.append(fresh)
        if not taken:
            return None
        entries = [e for group in taken for e in group]
        rows = [e[0] for e in entries]
        out = {"reward": np.array([e[2] for e in entries], np.float32),
               "staleness": np.array([VERSION - e[1] for e in entries], np.int32),
               "unit_offsets": np.cumsum([0] + [len(group) for group in taken]),
               **{name: np.array([r[name] for r in rows], np.int16) for name in INT_COLUMNS},
               **{name: [r[name] for r in rows] for name in LIST_COLUMNS}}
        for name, dtype in TOKEN_COLUMNS:
            arrays = [r[name] for r in rows]
            offsets = np.zeros(len(arrays) + 1, np.int64)
            np.cumsum([len(a) for a in arrays], out=offsets[1:])
            out[name] = (np.concatenate(arrays).astype(dtype, copy=False), offsets)
        return out


def replay_sample(buf: ReplayBuffer, num_units: int):
    batch = buf.sample(num_units, VERSION, ETA)
    if batch is None and (left := len(buf._ready)):
        batch = buf.sample(left, VERSION, ETA)  # the last, smaller batch: run until empty
    return batch


def replay_add(buf: ReplayBuffer, message) -> None:
    assert buf.try_add(message)


@dataclass(frozen=True)
class Side:
    """How one wire form is built, held and read; everything else is shared."""

    new: Callable  # (rows) -> an empty buffer
    message: Callable  # records -> what the rollout process sends
    add: Callable  # (buffer, received message) -> None
    sample: Callable  # (buffer, num_units) -> batch or None
    view: Callable  # received batch -> learner arrays (the `checksum` input)


def replay_buffer(rows: int) -> ReplayBuffer:
    return ReplayBuffer("policy", BufferConfig(capacity_rows=rows))


SIDES = {
    "hand-rolled": Side(replay_buffer, StepBatch.from_records, replay_add, replay_sample,
                        learner_view),
    "arrow": Side(replay_buffer, lambda records: records_to_table(records).to_batches()[0],
                  replay_add, replay_sample, learner_view),
    "list-of-dicts": Side(lambda rows: DictBuffer(), lambda records: [vars(r) for r in records],
                          DictBuffer.add, DictBuffer.sample, lambda out: out),
}


# ----------------------------------------------------------------------------- one pass
def run(side: Side, episodes: list[list[Call]], commits: list, wire, args, rows: int,
        measure_memory: bool = False):
    """One pass from the engine's answers to the learner's arrays.

    Returns (seconds per phase, seconds of JSON decode, (rows trained, digest), memory):
    memory is None, or with `measure_memory` (bytes held with every row rewarded, peak
    bytes). With `measure_memory` tracemalloc runs from after the messages are sent until
    the last batch is received, and that pass's times are not comparable.
    """
    clock = time.perf_counter
    times = dict.fromkeys(PHASES, 0.0)
    route = RecordedRoute("policy", [RecordedEngine()], RecordedTokenizer(episodes))
    engine = route.next_client()
    sent = []
    start = clock()
    with seeded_ids():
        for calls in episodes:
            records = play(calls, route, engine, args.k, times, clock)
            built_at = clock()
            message = side.message(records)
            sent_at = clock()
            sent.append(wire.send(message))
            times["build"] += sent_at - built_at
            times["send"] += clock() - sent_at
    json_s = clock() - start - sum(times.values())
    # `sent` lives to the end: the sender's buffers predate tracemalloc, and freeing them
    # (some are in Arrow's pool) would lower the pool's count under the buffer's feet
    del records, message
    buf = side.new(rows)
    meter = HeldBytes(measure_memory)
    meter.start()
    start = clock()
    for message in sent:
        side.add(buf, wire.receive(message))
        meter.note()
    times["insert"] = clock() - start
    start = clock()
    for message in commits:
        buf.commit_rewards(wire.receive(message))
        meter.note()
    times["commit"] = clock() - start
    memory = meter.held()
    trained, digest = 0, hashlib.blake2b(digest_size=16)
    while True:
        start = clock()
        batch = side.sample(buf, args.batch_units)
        if batch is None:
            break
        message = wire.send(batch)
        received = clock()
        out = side.view(wire.receive(message))
        done = clock()
        times["sample"] += received - start
        times["receive"] += done - received
        trained += checksum(out, digest)  # untimed
        meter.note()
    if measure_memory:
        memory = (memory, meter.stop())
    return times, json_s, (trained, digest.hexdigest()), memory


def commit_messages(episodes, args, wire) -> tuple[list, int, int]:
    """The coach's scores for every row, in no particular order, 64 per message, sent once.

    Returns (messages, rows, raw token bytes): the rows are played once to learn their ids.
    """
    route = RecordedRoute("policy", [RecordedEngine()], RecordedTokenizer(episodes))
    times = dict.fromkeys(PHASES, 0.0)
    with seeded_ids():
        records = [r for calls in episodes for r in
                   play(calls, route, route.next_client(), args.k, times, time.perf_counter)]
    rng = random.Random(0)
    order = list(range(len(records)))
    rng.shuffle(order)
    scores = [RewardCommit(records[i].step_id, reward=rng.random()) for i in order]
    messages = [wire.send(scores[i:i + 64]) for i in range(0, len(scores), 64)]
    raw = sum(4 * len(r.prompt_ids) + 12 * len(r.response_ids) for r in records)
    return messages, len(records), raw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=500)  # each one buffer message
    parser.add_argument("--acts", type=int, default=5)  # engine calls per episode
    parser.add_argument("--k", type=int, default=4)  # candidates per call (one group)
    parser.add_argument("--prompt-len", type=int, default=400)  # mean prompt tokens
    parser.add_argument("--response-len", type=int, default=250)  # mean response tokens
    parser.add_argument("--max-new-tokens", type=int, default=1024)  # longer ones end "length"
    parser.add_argument("--batch-units", type=int, default=64)  # groups per learner batch
    parser.add_argument("--reps", type=int, default=5)  # best of, per phase: a shared machine
    parser.add_argument("--ray", action="store_true", help="time the hops through a local Ray")
    args = parser.parse_args()
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"cpu: {cpu_model()}, {os.cpu_count()} cores, load average {load} "
          "(other jobs share them)")

    episodes = make_episodes(args)
    wire = RayWire() if args.ray else Wire()
    commits, rows, raw = commit_messages(episodes, args, wire)
    # The recording is this script's, not the rollout process's: kept out of the garbage
    # collector's view, it does not make every full collection of a timed phase slower.
    gc.collect()
    gc.freeze()
    best = {name: None for name in SIDES}
    json_s, checks = [], {}
    for rep in range(args.reps + 1):  # the first pass warms up (lazy imports and kernels)
        for name, side in SIDES.items():
            gc.collect()
            times, decode_s, checks[name], _ = run(side, episodes, commits, wire, args, rows)
            if rep:
                best[name] = {p: min(t, (best[name] or times)[p]) for p, t in times.items()}
                json_s.append(decode_s)
    assert len(set(checks.values())) == 1, checks  # the same batches, byte for byte
    for phase in SHARED:  # the same code on the same input: its best pass on any side
        fastest = min(times[phase] for times in best.values())
        for times in best.values():
            times[phase] = fastest
    plain = Wire()  # memory: always in this process, where tracemalloc sees the received copies
    if args.ray:
        commits = commit_messages(episodes, args, plain)[0]
    memory = {name: run(side, episodes, commits, plain, args, rows, True)[3]
              for name, side in SIDES.items()}
    print(f"{args.episodes} episodes x {args.acts} calls x {args.k} candidates = {rows} rows "
          f"(prompts ~{args.prompt_len}, responses ~{args.response_len} tokens); "
          f"{args.batch_units} groups per batch; trained {checks[SHIPPED][0]} rows; "
          f"each phase the best of {args.reps}; wire: "
          + ("local Ray (ray.put / ray.get)" if args.ray
             else "Ray's pickler, out-of-band buffers, one copy"))
    report(best, memory, rows, raw, min(json_s), checks[SHIPPED][1])


def report(best: dict, memory: dict, rows: int, raw: int, json_s: float, digest: str) -> None:
    per_row = {name: {p: t / rows * 1e6 for p, t in times.items()} for name, times in best.items()}
    total = {name: sum(us.values()) for name, us in per_row.items()}
    base = total["list-of-dicts"]
    print("us per row, from the engine's answer to the learner's arrays (parse ... send: rollout "
          "process; insert, commit, sample: buffer actor; receive: learner):")
    print(f"{'side':<14}" + "".join(f"{p:>9}" for p in PHASES)
          + f"{'rollout':>9}{'actor':>8}{'total':>8}{'vs dicts':>9}")
    for name, us in per_row.items():
        print(f"{name:<14}" + "".join(f"{us[p]:>9.1f}" for p in PHASES)
              + f"{sum(us[p] for p in ROLLOUT):>9.1f}{sum(us[p] for p in ACTOR):>8.1f}"
              + f"{total[name]:>8.1f}{total[name] / base:>9.2f}")
    print(f"(not summed: the JSON decode before parse, httpx's response.json(), the same for "
          f"every side: {json_s / rows * 1e6:.1f} us/row)")
    differ = {name: sum(us[p] for p in PHASES if p not in SHARED) for name, us in per_row.items()}
    print("where the forms differ (build ... receive): "
          + ", ".join(f"{name} {us:.1f}" for name, us in differ.items())
          + f" us/row; {SHIPPED} / list-of-dicts there: "
          f"{differ[SHIPPED] / differ['list-of-dicts']:.2f}")
    print(f"same rows to the learner on every side: checksum {digest}")
    for name, (held, peak) in memory.items():
        print(f"{name:<14} holds {held:>12,} bytes for raw token bytes {raw:,}: {held / raw:.2f} "
              f"(peak {peak / raw:.2f}; tracemalloc + Arrow pool, every row held and rewarded)")
    speed = total["arrow"] / total["hand-rolled"]
    print(f"arrow / hand-rolled end to end: {speed:.2f} ("
          + ("hand-rolled" if speed > 1 else "arrow")
          + f" faster by {(max(speed, 1 / speed) - 1) * 100:.0f} %: the slower side's time over "
          "the faster's)")
    print(f"datapath vs list-of-dicts: {total[SHIPPED] / base:.2f}; arrow vs hand-rolled: "
          f"{speed:.2f}; memory overhead: {memory[SHIPPED][0] / raw:.2f}")


if __name__ == "__main__":
    main()
