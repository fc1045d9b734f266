"""STEP_SCHEMA round trip and group keys built from named fields (DESIGN §3-§4)."""
import numpy as np
import pyarrow as pa

from buffers.schema import STEP_SCHEMA, Status, StepRecord, group_key, new_id, records_to_table


def _record(task="t", round_id="r0", parent="", agent="coder", turn=0, candidate=0, size=4,
            episode="e0", reward=None, versions=(3, 2, 3)):
    n = len(versions)
    return StepRecord(
        step_id=new_id(), run_id="run", model_id="m", agent=agent, workflow="wf", task_id=task,
        episode_id=episode, branch=parent, turn=turn,
        group_key=group_key(task, round_id, parent, agent, turn), group_size=size,
        candidate=candidate, prompt_ids=np.arange(5, dtype=np.int32),
        response_ids=np.arange(n, dtype=np.int32) + 7,
        behavior_logprobs=np.linspace(-1, 0, n, dtype=np.float32),
        token_versions=np.asarray(versions, np.int32), finish_reason="stop", reward=reward,
        created_at=1_700_000_000.25,
    )


def test_round_trip_keeps_tokens_and_derives_columns():
    records = [_record(reward=0.5), _record(candidate=1, versions=()), _record(candidate=2)]
    table = records_to_table(records)
    assert table.schema == STEP_SCHEMA
    rows = table.to_pylist()
    assert rows[0]["response_ids"] == [7, 8, 9]
    assert rows[0]["token_versions"] == [3, 2, 3]
    np.testing.assert_allclose(rows[0]["behavior_logprobs"], [-1, -0.5, 0])
    assert [r["behavior_version"] for r in rows] == [2, -1, 2]  # min version; -1 = no tokens
    assert [r["status"] for r in rows] == [Status.READY, Status.PENDING, Status.PENDING]
    assert rows[0]["rewarded_at"] is not None and rows[1]["rewarded_at"] is None
    assert rows[0]["step_id"] == records[0].step_id
    # Arrow IPC round trip keeps everything, dictionaries included
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, STEP_SCHEMA) as writer:
        writer.write_table(table)
    assert pa.ipc.open_stream(sink.getvalue()).read_all().equals(table)
    assert records_to_table([]).num_rows == 0


def _sizes(records):
    keys = records_to_table(records).column("group_key").to_pylist()
    return sorted(keys.count(k) for k in set(keys))


def test_tree_candidates_share_a_key():
    # K=4 candidates from one identical prompt (same task, round, parent, agent, turn)
    tree = [_record(parent="0.2", candidate=c) for c in range(4)]
    # the sibling node (another parent branch) and the next turn form their own groups
    tree += [_record(parent="0.1", candidate=c) for c in range(4)]
    tree += [_record(parent="0.2.3", turn=1, candidate=c) for c in range(4)]
    assert _sizes(tree) == [4, 4, 4]


def test_joint_rollouts_of_a_round_share_a_key():
    # G=3 joint rollouts of one round: at each (agent, turn) the 3 actions form one group
    rows = [_record(episode=f"e{g}", agent=a, turn=t, candidate=g, size=3)
            for g in range(3) for a in ("planner", "coder") for t in range(2)]
    assert _sizes(rows) == [3, 3, 3, 3]
    # the same task launched again (a new round) forms new groups
    again = [_record(round_id="r1", episode=f"f{g}", candidate=g, size=3) for g in range(3)]
    assert _sizes(rows[:1] + again) == [1, 3]


def test_keys_differ_by_every_field_and_are_unambiguous():
    base = ("t", "r", "", "a", 0)
    variants = [("u", "r", "", "a", 0), ("t", "s", "", "a", 0), ("t", "r", "0", "a", 0),
                ("t", "r", "", "b", 0), ("t", "r", "", "a", 1)]
    keys = {group_key(*base)} | {group_key(*v) for v in variants}
    assert len(keys) == 6
    assert group_key("ab", "c", "", "a", 0) != group_key("a", "bc", "", "a", 0)
    assert len(group_key(*base)) == 16


def test_wire_form_round_trip():
    """A StepBatch travels as numpy scalars + label lists + one Arrow message, losslessly."""
    import pickle

    from buffers.schema import ROW_DTYPE, StepBatch, split_rows

    records = [_record(reward=0.5), _record(candidate=1, versions=(), agent="critic"), _record(candidate=2)]
    table = records_to_table(records)
    wire = split_rows(table)
    assert wire.scalars.dtype == ROW_DTYPE and wire.body.num_rows == 3
    assert wire.scalars["group_key"].tolist()[0] == records[0].group_key
    assert np.isnan(wire.scalars["rewards"][1, -1]) and wire.scalars["rewards"][0, -1] == 0.5
    received = pickle.loads(pickle.dumps(StepBatch(table), protocol=5))
    assert received.table.equals(table) and received.wire_nbytes > 0
    empty = pickle.loads(pickle.dumps(StepBatch(records_to_table([])), protocol=5))
    assert empty.table.num_rows == 0 and empty.table.schema == STEP_SCHEMA


def test_records_go_straight_into_the_wire_form_that_splitting_their_table_gives():
    """`records_to_wire` (what the rollout side sends) equals `split_rows(records_to_table)`."""
    import dataclasses
    import pickle

    import pytest

    from buffers.schema import BODY_SCHEMA, StepBatch, records_to_wire, split_rows

    records = [_record(reward=0.5), _record(candidate=1, versions=(), agent="critic"),
               _record(candidate=2, parent="0.1", turn=1), _record(candidate=3, versions=(4,))]
    records[2] = dataclasses.replace(records[2], reward_local=-1.5, coach_score=0.25,
                                     finish_reason="length", meta='{"tool": "run"}')
    for rows in (records, records[:1], records[1:2]):
        direct, split = records_to_wire(rows), split_rows(records_to_table(rows))
        assert direct.step_ids == split.step_ids and direct.labels == split.labels
        assert direct.scalars.tobytes() == split.scalars.tobytes()  # NaN for null rewards too
        assert direct.body.schema.equals(BODY_SCHEMA) and direct.body.equals(split.body)
        received = pickle.loads(pickle.dumps(StepBatch.from_records(rows), protocol=5))
        assert received.table.equals(records_to_table(rows)) and received.wire_nbytes > 0
    assert records_to_wire(records).scalars["behavior_version"].tolist() == [2, -1, 2, 4]
    assert records_to_wire([]).body.num_rows == 0
    with pytest.raises(ValueError, match="turn has nulls"):
        records_to_wire([dataclasses.replace(records[0], turn=None)])
