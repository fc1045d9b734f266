"""ReplayBuffer readiness, ordering, drops and accounting (DESIGN §4-§5)."""
import dataclasses
import pickle
import time

import numpy as np
import pyarrow as pa
import pytest

from buffers.replay import BufferConfig, ReplayBuffer
from buffers.schema import (
    DROP_REASONS, RewardColumns, RewardCommit, Status, StepBatch, StepRecord, group_key, new_id,
    records_to_table,
)


def _rows(group="g0", size=4, version=0, episode=None, reward=None, created_at=None, n=None, turn=0):
    """`n` (default `size`) candidates of one group; all from `episode` unless None (one each)."""
    out = []
    for c in range(size if n is None else n):
        out.append(StepRecord(
            step_id=new_id(), run_id="run", model_id="m", agent="a", workflow="wf",
            task_id="t", episode_id=episode or f"{group}-e{c}", branch="", turn=turn,
            group_key=group_key("t", group, "", "a", turn), group_size=size, candidate=c,
            prompt_ids=np.arange(3, dtype=np.int32) + c,
            response_ids=np.arange(2, dtype=np.int32) + 10 * c,
            behavior_logprobs=np.full(2, -0.5, np.float32),
            token_versions=np.full(2, version, np.int32), finish_reason="stop", reward=reward,
            created_at=time.time() if created_at is None else created_at,
        ))
    return out


def _reward(buf, rows, value=1.0):
    buf.commit_rewards([RewardCommit(r.step_id, reward=value) for r in rows])


def _invariant(buf):
    s = buf.stats()
    assert set(s.dropped) == set(DROP_REASONS)
    assert s.rows_added == s.rows_trained + sum(s.dropped.values()) + s.pending_rows + s.ready_rows
    return s


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="readiness='turn'"):
        BufferConfig(readiness="turn")
    with pytest.raises(ValueError, match="capacity_rows=0"):
        BufferConfig(capacity_rows=0)
    with pytest.raises(ValueError, match="min_group_size"):
        BufferConfig(min_group_size=0)


def test_group_readiness_and_batch_contents():
    buf = ReplayBuffer("m", BufferConfig())
    rows = _rows("g0")
    assert buf.try_add(rows[:3])
    _reward(buf, rows[:3])
    assert buf.sample(1, current_version=0, max_staleness=0) is None  # 3 of 4 arrived
    assert buf.try_add(rows[3:])
    assert buf.sample(1, 0, 0) is None  # all arrived, one still unrewarded
    assert _invariant(buf).pending_rows == 1
    buf.commit_rewards([RewardCommit(rows[3].step_id, coach_score=0.7, reward=0.25)])
    batch = buf.sample(1, current_version=2, max_staleness=2)
    assert batch.unit_ids == [rows[0].group_key] and batch.version == 2
    table = batch.table.to_pylist()
    assert [r["step_id"] for r in table] == [r.step_id for r in rows]
    assert [r["reward"] for r in table] == [1.0, 1.0, 1.0, 0.25]
    assert table[3]["coach_score"] == pytest.approx(0.7) and table[0]["coach_score"] is None
    assert {r["status"] for r in table} == {Status.READY}
    assert all(r["rewarded_at"] is not None for r in table)
    assert table[2]["response_ids"] == [20, 21]
    assert batch.staleness.tolist() == [2, 2, 2, 2]
    assert batch.unit_offsets.tolist() == [0, 4]
    s = _invariant(buf)
    assert (s.rows_trained, s.pending_rows, s.ready_rows) == (4, 0, 0)


def test_episode_readiness_waits_for_seal():
    buf = ReplayBuffer("m", BufferConfig(readiness="episode"))
    turns = [_rows(f"t{t}", size=1, episode="ep", reward=1.0, turn=t)[0] for t in range(3)]
    buf.try_add(turns[:2])
    assert buf.sample(1, 0, 0) is None  # not sealed
    buf.seal_episode("ep", 3)
    assert buf.sample(1, 0, 0) is None  # sealed at 3, two arrived
    buf.try_add(turns[2:])
    batch = buf.sample(1, 0, 0)
    assert batch.unit_ids == ["ep"] and batch.table.num_rows == 3
    with pytest.raises(ValueError, match="readiness='episode'"):
        ReplayBuffer("m", BufferConfig()).seal_episode("ep", 1)


def test_oldest_ready_first_and_units_contiguous():
    buf = ReplayBuffer("m", BufferConfig())
    groups = {g: _rows(g, size=2) for g in ("a", "b", "c")}
    # interleave arrivals so rows of one unit are not adjacent in the buffer
    buf.try_add([groups["a"][0], groups["b"][0], groups["c"][0]])
    buf.try_add([groups["c"][1], groups["b"][1], groups["a"][1]])
    for g in ("c", "a", "b"):  # readiness order differs from arrival order
        _reward(buf, groups[g])
    assert buf.sample(4, 0, 0) is None  # only 3 ready: nothing handed out
    batch = buf.sample(2, 0, 0)
    assert batch.unit_ids == [groups["c"][0].group_key, groups["a"][0].group_key]
    ids = [r["step_id"] for r in batch.table.to_pylist()]
    assert ids == [r.step_id for g in ("c", "a") for r in groups[g]]
    assert batch.unit_ready_at[0] <= batch.unit_ready_at[1]
    assert buf.sample(1, 0, 0).unit_ids == [groups["b"][0].group_key]


@pytest.mark.parametrize("eta", [0, 1])
def test_staleness_drop(eta):
    buf = ReplayBuffer("m", BufferConfig(min_group_size=1))
    old, mid, new = _rows("old", 2, version=3), _rows("mid", 2, version=4), _rows("new", 2, version=5)
    buf.try_add(old + mid + new)
    _reward(buf, old + new)  # mid stays pending: stale pending rows are dropped too
    batch = buf.sample(1, current_version=5, max_staleness=eta)
    s = _invariant(buf)
    if eta == 0:  # everything below version 5 goes
        assert s.dropped["stale"] == 4 and batch.unit_ids == [new[0].group_key]
    else:  # version 4 survives, version 3 goes
        assert s.dropped["stale"] == 2 and s.pending_rows == 2
        assert batch.unit_ids == [new[0].group_key] and batch.staleness.tolist() == [0, 0]
    assert buf.take_dropped_units() == (2 if eta == 0 else 1)
    assert buf.take_dropped_units() == 0


def test_mixed_versions_in_a_group_leave_a_smaller_group():
    buf = ReplayBuffer("m", BufferConfig(min_group_size=2))
    rows = _rows("g", 3, version=2)
    rows[0] = _rows("g", 3, version=0, n=1)[0]
    buf.try_add(rows)
    _reward(buf, rows)
    batch = buf.sample(1, current_version=2, max_staleness=1)
    assert batch.table.num_rows == 2 and _invariant(buf).dropped["stale"] == 1


def test_failed_rows_and_incomplete_groups():
    buf = ReplayBuffer("m", BufferConfig(min_group_size=3))
    ok, bad = _rows("ok", 4), _rows("bad", 4)
    buf.try_add(ok + bad)
    _reward(buf, ok[1:] + bad[2:])
    buf.commit_rewards([RewardCommit(ok[0].step_id, failed_reason="coach unparsable")])
    buf.commit_rewards([RewardCommit(r.step_id, failed_reason="sandbox crash") for r in bad[:2]])
    s = _invariant(buf)
    assert s.dropped["failed"] == 3 and s.dropped["incomplete"] == 2
    assert buf.take_dropped_units() == 1
    batch = buf.sample(1, 0, 0)  # the surviving 3 of "ok" form a unit
    assert [r["step_id"] for r in batch.table.to_pylist()] == [r.step_id for r in ok[1:]]


def test_unit_timeout():
    buf = ReplayBuffer("m", BufferConfig(unit_timeout_s=60))
    t0 = time.time()
    slow, fresh = _rows("slow", 2, created_at=t0 - 100), _rows("fresh", 2, created_at=t0)
    buf.try_add(slow + fresh)
    assert buf.sample(1, 0, 0, now=t0) is None
    assert _invariant(buf).dropped["timeout"] == 2
    _reward(buf, fresh)
    assert buf.sample(1, 0, 0, now=t0 + 59).unit_ids == [fresh[0].group_key]
    assert buf.take_dropped_units() == 1


def test_capacity_backpressure_all_or_nothing():
    buf = ReplayBuffer("m", BufferConfig(capacity_rows=6))
    assert buf.try_add(_rows("a", 4))
    b = _rows("b", 4)
    assert not buf.try_add(b)  # 8 > 6: refused whole
    s = _invariant(buf)
    assert (s.backpressure_refusals, s.rows_added, s.pending_rows) == (1, 4, 4)
    assert buf.try_add(b[:2])
    with pytest.raises(ValueError, match="already added"):
        buf.try_add(b[:1])
    with pytest.raises(ValueError, match="capacity_rows"):
        buf.try_add(_rows("big", 7))
    with pytest.raises(ValueError, match="model 'other'"):
        buf.try_add([StepRecord(**{**b[3].__dict__, "model_id": "other"})])


def test_late_commits_drain_and_drop_episode():
    buf = ReplayBuffer("m", BufferConfig(readiness="episode"))
    lost, kept = _rows("x", 2, episode="lost"), _rows("y", 3, episode="kept")
    buf.try_add(lost + kept)
    buf.seal_episode("kept", 3)
    _reward(buf, kept)
    assert buf.drop_episode("lost", "timeout") == 2
    _reward(buf, lost)  # their commits arrive after the drop
    batch = buf.sample(1, 0, 0)
    _reward(buf, kept[:1])  # and after training
    s = _invariant(buf)
    assert s.late_commits == 3 and s.rows_trained == 3 and batch.unit_ids == ["kept"]
    buf.try_add(_rows("z", 2, episode="open"))
    assert buf.drain() == 2
    s = _invariant(buf)
    assert s.dropped["run_stopped"] == 2 and s.pending_rows == s.ready_rows == 0
    with pytest.raises(ValueError, match="drop reason"):
        buf.drain("bored")


def test_drop_episode_in_group_mode_keeps_other_episodes():
    buf = ReplayBuffer("m", BufferConfig(min_group_size=2))
    rows = _rows("joint", 3)  # 3 joint rollouts, one row each
    tree = _rows("tree", 2, episode="e-tree")
    buf.try_add(rows + tree)
    _reward(buf, rows)
    assert buf.drop_episode(rows[0].episode_id, "incomplete") == 1
    assert buf.drop_episode("e-tree", "incomplete") == 2
    assert buf.take_dropped_units() == 1  # the tree group emptied; the joint group lives on
    assert buf.sample(1, 0, 0).table.num_rows == 2
    _invariant(buf)


def test_many_rounds_reclaim_memory_and_keep_accounting():
    rng = np.random.default_rng(0)
    buf = ReplayBuffer("m", BufferConfig(capacity_rows=64, min_group_size=2))
    trained = 0
    for step in range(60):
        rows = _rows(f"g{step}", 4, version=step // 3)
        while not buf.try_add(rows):
            batch = buf.sample(1, current_version=step // 3, max_staleness=2)
            assert batch is not None, "buffer full and nothing ready"
            trained += batch.table.num_rows
            assert batch.staleness.max() <= 2
        commits = [RewardCommit(r.step_id, reward=float(rng.random())) for r in rows]
        if step % 7 == 0:
            commits[0] = RewardCommit(rows[0].step_id, failed_reason="parse")
        buf.commit_rewards(commits)
        _invariant(buf)
    s = _invariant(buf)
    assert s.rows_trained == trained and s.rows_added == 240
    assert s.resident_bytes < 80_000  # dead rows were released, not kept around


def test_table_ingest_keeps_producer_buffers():
    """A producer's Arrow rows become a chunk without copying a token buffer."""
    buf = ReplayBuffer("m", BufferConfig())
    rows = _rows("g", 4)
    table = records_to_table(rows)
    assert buf.try_add(table)
    chunk = next(iter(buf._store._chunks.values()))
    for name in ("prompt_ids", "response_ids", "behavior_logprobs", "token_versions"):
        sent, kept = table.column(name).chunk(0), chunk.batch.column(name)
        assert kept.values.buffers()[1].address == sent.values.buffers()[1].address
    _reward(buf, rows)
    batch = buf.sample(1, 0, 0)
    assert [r["step_id"] for r in batch.table.to_pylist()] == [r.step_id for r in rows]
    assert batch.table.column("prompt_ids").num_chunks == 1
    _invariant(buf)


def test_step_batch_pickles_as_arrow_and_is_read_in_place():
    rows = _rows("g", 4, reward=0.5)
    received = pickle.loads(pickle.dumps(StepBatch(records_to_table(rows)), protocol=5))
    assert received.table.equals(records_to_table(rows)) and received.wire_nbytes > 0
    buf = ReplayBuffer("m", BufferConfig())
    assert buf.try_add(received)
    assert buf.sample(1, 0, 0).table.num_rows == 4  # rewards set on arrival: READY at once
    s = _invariant(buf)
    assert s.rows_trained == 4 and s.pending_rows == 0
    empty = buf.sample(0, 0, 0)  # a ReadyBatch of no units still crosses to a learner
    assert pickle.loads(pickle.dumps(empty, protocol=5)).table.num_rows == 0


def test_table_validation_is_all_or_nothing():
    buf = ReplayBuffer("m", BufferConfig())
    good = _rows("a", 4)
    other = [StepRecord(**{**r.__dict__, "model_id": "other"}) for r in _rows("b", 2)]
    with pytest.raises(ValueError, match="model 'other'"):
        buf.try_add(records_to_table(good[:2] + other))
    with pytest.raises(ValueError, match="same step_id twice"):
        buf.try_add(records_to_table([good[0], good[0]]))
    mixed = _rows("c", 4)
    mixed[1] = StepRecord(**{**mixed[1].__dict__, "group_size": 3})
    with pytest.raises(ValueError, match="group_size 3 differs"):
        buf.try_add(records_to_table(mixed))
    with pytest.raises(ValueError, match="expects 4 rows and got more"):
        buf.try_add(records_to_table(good + _rows("a", 4, n=1)))
    with pytest.raises(ValueError, match="STEP_SCHEMA"):
        buf.try_add(records_to_table(good).drop_columns(["meta"]))
    s = _invariant(buf)
    assert s.rows_added == 0 and s.pending_rows == 0  # nothing moved
    assert buf.try_add(records_to_table(good[:2]))
    with pytest.raises(ValueError, match="already added"):
        buf.try_add(records_to_table(good[1:3]))
    with pytest.raises(ValueError, match="group_size 2 differs from its group's 4"):
        buf.try_add(records_to_table(_rows("a", 2, n=1)))
    assert _invariant(buf).rows_added == 2


def test_coalescing_small_batches_keeps_rows_and_accounting():
    buf = ReplayBuffer("m", BufferConfig(capacity_rows=256, coalesce_after=4))
    groups = [_rows(f"g{k}", 2) for k in range(12)]
    for rows in groups:
        assert buf.try_add(records_to_table(rows))
    for rows in groups[::2]:
        _reward(buf, rows)
    first = buf.sample(6, 0, 0)  # compaction runs after a sample
    assert buf._store.num_chunks < 12
    for rows in groups[1::2]:
        _reward(buf, rows)
    second = buf.sample(6, 0, 0)
    got = [r["step_id"] for b in (first, second) for r in b.table.to_pylist()]
    assert got == [r.step_id for rows in groups[::2] + groups[1::2] for r in rows]
    s = _invariant(buf)
    assert s.rows_trained == 24 and s.pending_rows == s.ready_rows == 0


def test_reward_columns_match_commit_lists():
    """The columnar commit message applies exactly what the list of RewardCommit would."""
    rows = _rows("g", 4) + _rows("h", 4)
    bufs = [ReplayBuffer("m", BufferConfig(min_group_size=3)) for _ in range(2)]
    commits = [RewardCommit(r.step_id, reward=0.5 * k, coach_score=0.1 if k % 2 else None)
               for k, r in enumerate(rows[:7])]
    commits += [RewardCommit(rows[7].step_id, failed_reason="parse"), RewardCommit("gone", reward=1.0)]
    columns = pickle.loads(pickle.dumps(RewardColumns.from_commits(commits), protocol=5))
    assert columns.coach_score is not None and np.isnan(columns.coach_score[0])
    for buf, message in zip(bufs, (commits, columns)):
        assert buf.try_add(pickle.loads(pickle.dumps(StepBatch(records_to_table(rows)), protocol=5)))
        buf.commit_rewards(message)
    tables = [buf.sample(2, 0, 0).table.drop_columns(["rewarded_at"]) for buf in bufs]
    assert tables[0].equals(tables[1])  # rewarded_at is each buffer's own clock
    assert tables[0].column("reward").to_pylist() == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0]
    assert [_invariant(buf).dropped["failed"] for buf in bufs] == [1, 1]
    assert [buf.stats().late_commits for buf in bufs] == [1, 1]


def test_reward_columns_repeated_ids_first_reward_wins_and_bad_values_raise():
    buf = ReplayBuffer("m", BufferConfig())
    rows = _rows("g", 2)
    buf.try_add(rows)
    ids = [rows[0].step_id, rows[0].step_id, rows[1].step_id]
    buf.commit_rewards(RewardColumns(ids, reward=np.array([0.1, 0.9, 0.3], np.float32),
                                     reward_local=np.array([0.2, np.nan, np.nan], np.float32)))
    table = buf.sample(1, 0, 0).table
    # in order: the first reward makes the row READY, the second is refused and counted
    assert table.column("reward").to_numpy().tolist() == pytest.approx([0.1, 0.3])
    assert buf.stats().repeat_commits == 1
    assert table.column("reward_local").to_pylist()[0] == pytest.approx(0.2)  # NaN left it as it was
    with pytest.raises(ValueError, match="must be finite"):
        RewardColumns(ids[:1], reward=np.array([np.inf], np.float32))
    with pytest.raises(ValueError, match="must be finite"):
        buf.commit_rewards([RewardCommit(rows[0].step_id, reward=float("nan"))])
    with pytest.raises(ValueError, match="2 values for 1 step_ids"):
        RewardColumns(ids[:1], reward=np.zeros(2, np.float32))


def test_sampled_rows_keep_every_column_of_a_multi_episode_message():
    """One message carrying several episodes and groups; labels differ between rows."""
    rows = _rows("a", 2, reward=1.0) + _rows("b", 3, reward=0.5, turn=1)
    rows[1] = StepRecord(**{**rows[1].__dict__, "agent": "critic", "finish_reason": "length",
                            "meta": '{"tool": "run"}', "branch": "0.1"})
    buf = ReplayBuffer("m", BufferConfig())
    assert buf.try_add(pickle.loads(pickle.dumps(StepBatch(records_to_table(rows)), protocol=5)))
    batch = buf.sample(2, 0, 0)
    sent = records_to_table(rows)
    for name in batch.table.schema.names:
        if name != "rewarded_at":
            assert batch.table.column(name).to_pylist() == sent.column(name).to_pylist(), name
    assert batch.table.schema == sent.schema
    assert batch.table.column("agent").to_pylist()[:2] == ["a", "critic"]
    assert batch.unit_offsets.tolist() == [0, 2, 5]


def test_null_in_a_required_column_is_refused():
    table = records_to_table(_rows("g", 2))
    column = table.schema.get_field_index("group_size")
    table = table.set_column(column, "group_size", pa.array([4, None], pa.int16()))
    with pytest.raises(ValueError, match="group_size has nulls"):
        ReplayBuffer("m", BufferConfig()).try_add(table)


def test_a_second_reward_for_a_rewarded_row_is_refused_and_counted():
    buf = ReplayBuffer("m", BufferConfig())
    rows = _rows(size=2)
    assert buf.try_add(rows)
    buf.commit_rewards([RewardCommit(rows[0].step_id, reward=0.25)])
    buf.commit_rewards([RewardCommit(rows[0].step_id, reward=0.75),
                        RewardCommit(rows[1].step_id, reward=0.5)])
    assert buf.stats().repeat_commits == 1
    batch = buf.sample(1, current_version=0, max_staleness=4)
    rewards = dict(zip(batch.table.column("step_id").to_pylist(),
                       batch.table.column("reward").to_pylist()))
    assert rewards == {rows[0].step_id: 0.25, rows[1].step_id: 0.5}
    _invariant(buf)


def test_a_first_arrival_larger_than_the_initial_slots_is_held():
    """An empty buffer given more rows at once than its initial 256 slots (the chunk store
    used to move its base past the new rows and fail to place them)."""
    buf = ReplayBuffer("m", BufferConfig(capacity_rows=4096))
    rows = [r for g in range(75) for r in _rows(group=f"g{g}", reward=1.0)]  # 300 rows
    assert buf.try_add(rows)
    batch = buf.sample(75, current_version=0, max_staleness=0)
    assert batch is not None and batch.table.num_rows == 300
    assert sorted(batch.table.column("step_id").to_pylist()) == sorted(r.step_id for r in rows)
    _invariant(buf)


def test_unit_ready_wait_is_the_wait_from_a_units_last_row_to_ready():
    """What the learner reports as the coach's share of a unit's latency (auto staleness)."""
    from runtime.learner_worker import unit_ready_wait_s

    now = [1000.0]
    buf = ReplayBuffer("m", BufferConfig())
    buf._clock = lambda: now[0]
    early = _rows("g0", size=2, created_at=990.0)
    late = _rows("g1", size=2, created_at=995.0)
    late[1] = dataclasses.replace(late[1], created_at=998.0)
    assert buf.try_add(early + late)
    now[0] = 1001.0
    _reward(buf, early)  # g0 ready at 1001: 11 s after its last row
    now[0] = 1004.0
    _reward(buf, late)  # g1 ready at 1004: 6 s after its last row (998), not its first
    batch = buf.sample(2, current_version=0, max_staleness=0)
    assert unit_ready_wait_s(batch) == pytest.approx((11.0 + 6.0) / 2)
