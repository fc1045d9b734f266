"""Durable replay buffers: the write-ahead log, recovery, undo of lost samples (buffers/wal.py).

Pure Python, no Ray. A buffer's calls read the time through `_clock`; the round-trip tests
give the logged buffer and its never-crashed twin the same fake clock so that their states
(ready times, rewarded_at) can be compared exactly.
"""
import os
import pickle
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from buffers.api import BufferConfig
from buffers.replay import ReplayBuffer
from buffers.schema import DROP_REASONS, RewardColumns, RewardCommit, StepBatch, records_to_table
from test_buffer import _reward, _rows

REPO = Path(__file__).resolve().parents[2]


class FakeClock:
    """Seconds that advance by one per call, from the same start for every buffer given one."""

    def __init__(self, start: float = 1.7e9) -> None:
        self.now = start

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def _invariant(buf):
    s = buf.stats()
    assert s.rows_added == s.rows_trained + sum(s.dropped.values()) + s.pending_rows + s.ready_rows
    return s


def _same_state(a, b):
    """Every counter, the held rows awaiting rewards and the units held."""
    sa, sb = _invariant(a), _invariant(b)
    assert {**sa.__dict__, "resident_bytes": 0} == {**sb.__dict__, "resident_bytes": 0}
    assert a.pending_step_ids() == b.pending_step_ids()
    assert a.held_units() == b.held_units()


def _same_batch(x, y):
    assert (x is None) == (y is None)
    if x is None:
        return
    assert x.table.to_pylist() == y.table.to_pylist()  # every STEP_SCHEMA column, rewarded_at too
    assert x.unit_ids == y.unit_ids and x.version == y.version
    assert x.staleness.tolist() == y.staleness.tolist()
    assert x.unit_offsets.tolist() == y.unit_offsets.tolist()
    assert x.unit_ready_at.tolist() == y.unit_ready_at.tolist()


def _twins(tmp_path, cfg):
    """A logging buffer and a never-crashing one, on identical clocks."""
    logged, plain = ReplayBuffer("m", cfg, str(tmp_path / "wal")), ReplayBuffer("m", cfg)
    logged._clock, plain._clock = FakeClock(), FakeClock()
    return logged, plain


def _group_script(bufs, t0):
    """Mixed history in group mode: every kind of call, rows left pending, ready, trained, dropped."""
    g = {k: _rows(k, 4, version=v, created_at=t0) for k, v in
         [("a", 1), ("b", 1), ("c", 2), ("d", 0), ("e", 2), ("f", 2)]}
    g["r"] = _rows("r", 2, version=2, reward=0.5, created_at=t0)  # rewarded on arrival
    g["old"] = _rows("old", 2, version=2, created_at=t0 - 10_000)  # will time out
    g["late"] = _rows("old", 2, version=2, n=1, created_at=t0)  # arrives after its unit timed out
    for buf in bufs:
        assert buf.try_add(pickle.loads(pickle.dumps(StepBatch(records_to_table(g["a"] + g["b"])), protocol=5)),
                           origin="ep1")
        assert buf.try_add(g["c"] + g["d"] + g["r"] + g["old"], origin="ep2")
        assert not buf.try_add(_rows("big", 16))  # 20 held + 16 > 32: refused
        _reward(buf, g["a"], 0.25)
        buf.commit_rewards(RewardColumns([r.step_id for r in g["b"][:3]] + ["unknown"],
                                         reward=np.array([0.1, 0.2, 0.3, 1.0], np.float32),
                                         coach_score=np.array([0.9, np.nan, 0.7, 0.0], np.float32)))
        buf.commit_rewards([RewardCommit(g["b"][3].step_id, failed_reason="coach unparsable")])
        buf.commit_rewards([RewardCommit(g["a"][0].step_id, reward=0.99)])  # repeat: refused
        assert buf.sample(1, current_version=1, max_staleness=1) is not None  # "r": trained
        buf.drop_episode(g["c"][0].episode_id, "actor_crashed")
        _reward(buf, g["d"] + g["c"][1:2])
        buf.sample(1, current_version=2, max_staleness=1)  # d is stale; "a" trained
        buf.take_dropped_units()
        assert buf.try_add(g["e"] + g["f"], origin="ep3")
        _reward(buf, g["e"])
        buf.commit_rewards([RewardCommit(r.step_id, reward_local=0.5) for r in g["f"][:2]])
        _reward(buf, g["f"][:1])
        buf.sample(5, current_version=2, max_staleness=1)  # not enough ready: "old" times out
        assert buf.try_add(g["late"], origin="ep4")  # dropped at once, as its unit was
        _reward(buf, g["a"])  # late commits
    return g


def _episode_script(bufs, t0):
    """Mixed history in episode mode: seals before and after rows, drops, timeouts, a drain-free end."""
    eps = {e: [_rows(f"{e}{t}", 1, episode=e, version=1, turn=t, created_at=t0)[0] for t in range(3)]
           for e in ("e1", "e2", "e3", "e4", "e5")}
    stale = [_rows("s", 1, episode="stale", version=0, created_at=t0)[0]]
    for buf in bufs:
        assert buf.try_add(eps["e1"] + eps["e2"][:2] + stale, origin="w1")
        buf.seal_episode("e1", 3)
        buf.seal_episode("e4", 3)  # sealed before any of its rows
        _reward(buf, eps["e1"] + eps["e2"][:1] + stale)
        buf.seal_episode("stale", 1)
        assert buf.sample(1, current_version=1, max_staleness=0) is not None  # stale dropped, e1 trained
        assert buf.try_add(eps["e3"] + eps["e4"][:2] + eps["e5"], origin="w2")
        buf.drop_episode("e3", "actor_crashed")
        buf.seal_episode("e5", 3)
        _reward(buf, eps["e5"] + eps["e4"][:1])
        buf.commit_rewards([RewardCommit(eps["e2"][1].step_id, failed_reason="sandbox crash")])
        buf.take_dropped_units()
        buf.seal_episode("e6", 2)  # a unit without rows yet
    return eps


@pytest.mark.parametrize("readiness", ["group", "episode"])
def test_recovered_buffer_equals_the_one_that_never_crashed(tmp_path, readiness):
    cfg = BufferConfig(readiness=readiness, capacity_rows=32, unit_timeout_s=600)
    logged, plain = _twins(tmp_path, cfg)
    t0 = logged._clock.now
    (_group_script if readiness == "group" else _episode_script)((logged, plain), t0)
    s = _invariant(plain)
    assert s.pending_rows and s.ready_rows and s.rows_trained and sum(s.dropped.values())  # all kinds held
    if readiness == "group":  # the late row followed its timed-out unit; commits late and repeated
        assert (s.dropped["timeout"], s.late_commits, s.repeat_commits, s.backpressure_refusals) == (3, 5, 1, 1)
    del logged  # the crash: nothing is closed or flushed beyond what each call did

    back = ReplayBuffer.recover("m", cfg, str(tmp_path / "wal"), learner_version=10)
    report = back.recovery_report()
    assert report.samples_undone == 0 and report.torn_bytes == 0 and report.records_replayed > 10
    assert (report.rows_pending, report.rows_ready) == (s.pending_rows, s.ready_rows)
    back._clock = FakeClock(plain._clock.now)
    _same_state(back, plain)
    origins = ["ep1", "ep2", "ep3", "ep4", "w1", "w2", "nobody"]
    assert back.received_rows(origins) == plain.received_rows(origins)
    assert back.take_dropped_units() == plain.take_dropped_units()
    _same_batch(back.sample(1, 2, 1), plain.sample(1, 2, 1))
    # it keeps logging to the same folder: recovered twice, it still matches
    for buf in (back, plain):
        buf.commit_rewards([RewardCommit(step_id, reward=0.75) for step_id in buf.pending_step_ids()])
        if readiness == "episode":
            buf.seal_episode("e2", 2)
    again = ReplayBuffer.recover("m", cfg, str(tmp_path / "wal"), learner_version=10)
    again._clock = FakeClock(plain._clock.now)
    assert again.recovery_report().checkpoint is not None
    _same_state(again, plain)
    for _ in range(3):
        _same_batch(again.sample(1, 2, 2), plain.sample(1, 2, 2))
    _same_state(again, plain)


def test_a_replay_that_diverges_from_the_log_stops_recovery(tmp_path):
    """Records say which rows each call retired; a replay that disagrees (here: the config
    changed between the crash and the resume) stops recovery instead of guessing."""
    cfg = BufferConfig()
    buf = ReplayBuffer("m", cfg, str(tmp_path))
    rows = _rows("g", 2)
    buf.try_add(rows)
    _reward(buf, rows)
    buf.sample(1, 0, 0)
    buf.close()
    with pytest.raises(RuntimeError, match="replays differently"):
        ReplayBuffer.recover("m", BufferConfig(min_group_size=3), str(tmp_path), 5)


def _train_loop(buf, steps, start_version, handed, settle_every=0):
    """A learner and producers taking turns: one group in, its rewards, one unit out per version."""
    for step in range(steps):
        version = start_version + step
        rows = _rows(f"v{version}-{len(handed)}", 2, version=version)
        assert buf.try_add(rows)
        _reward(buf, rows)
        batch = buf.sample(1, current_version=version, max_staleness=4)
        handed.append((version, batch.table.column("step_id").to_pylist()))
        if settle_every and version % settle_every == 0:
            buf.settle_samples(version)


@pytest.mark.parametrize("segment_bytes", [64 << 20, 8192])  # one segment; many rolls and checkpoints
def test_samples_at_or_after_the_learner_checkpoint_are_undone(tmp_path, segment_bytes):
    cfg = BufferConfig(wal_segment_bytes=segment_bytes, wal_undo_versions=16)
    buf = ReplayBuffer("m", cfg, str(tmp_path))
    before = []
    _train_loop(buf, 30, 0, before, settle_every=5)  # versions 0..29; settled below 25
    lost_rows = sum(len(ids) for v, ids in before if v >= 25)
    trained_before = _invariant(buf).rows_trained
    del buf  # crash; the learner's newest checkpoint is version 25
    back = ReplayBuffer.recover("m", cfg, str(tmp_path), learner_version=25)
    s = _invariant(back)
    after = []
    while (batch := back.sample(1, current_version=25, max_staleness=100)) is not None:
        after.append((25, batch.table.column("step_id").to_pylist()))
    # what the resumed learner is trained on: the samples its checkpoint covers, then everything
    # after, counted from the batches themselves
    trained = [s for v, ids in before if v < 25 for s in ids] + [s for _, ids in after for s in ids]
    assert len(trained) == len(set(trained)) == 60  # every row once, none twice
    assert [ids for _, ids in after] == [ids for v, ids in before if v >= 25]  # oldest first
    report = back.recovery_report()
    assert report.undo_complete and report.samples_undone == 5 and report.rows_untrained == lost_rows
    assert s.rows_trained == trained_before - lost_rows and s.ready_rows == lost_rows
    assert _invariant(back).rows_trained == len(trained)
    # crashed again before a newer learner checkpoint: what the resumed learner took is lost too
    del back
    again = ReplayBuffer.recover("m", cfg, str(tmp_path), learner_version=25)
    assert again.recovery_report().samples_undone == 5
    assert _invariant(again).rows_trained == 50 and again.stats().ready_rows == 10


def test_undo_beyond_what_was_kept_is_reported(tmp_path):
    cfg = BufferConfig(wal_undo_versions=3)
    buf = ReplayBuffer("m", cfg, str(tmp_path))
    _train_loop(buf, 10, 0, [])
    del buf
    back = ReplayBuffer.recover("m", cfg, str(tmp_path), learner_version=5)
    report = back.recovery_report()
    assert not report.undo_complete and report.samples_undone == 3  # versions 7, 8, 9 kept
    _invariant(back)


def _log_files(folder):
    return sorted(p for p in Path(folder).iterdir() if p.suffix == ".arrow")


def test_torn_tail_is_skipped_and_reported(tmp_path):
    cfg = BufferConfig()
    buf = ReplayBuffer("m", cfg, str(tmp_path))
    first, last = _rows("a", 4), _rows("b", 4)
    buf.try_add(first)
    _reward(buf, first)
    buf.try_add(last)  # the last call: its record is torn below
    del buf
    rows_file = tmp_path / "rows-000001.arrow"
    size = rows_file.stat().st_size
    os.truncate(rows_file, size - 5)
    back = ReplayBuffer.recover("m", cfg, str(tmp_path), learner_version=0)
    report = back.recovery_report()
    assert report.torn_bytes > 0 and report.records_replayed == 2  # add + commit
    assert back.stats().ready_rows == 4 and back.stats().rows_added == 4
    assert back.try_add(last)  # the lost call can be made again, and is logged on
    del back
    assert ReplayBuffer.recover("m", cfg, str(tmp_path), 0).stats().rows_added == 8


def test_damage_in_the_middle_raises_naming_the_file(tmp_path):
    cfg = BufferConfig()
    buf = ReplayBuffer("m", cfg, str(tmp_path))
    for k in range(3):
        buf.try_add(_rows(f"g{k}", 2))
    del buf
    path = tmp_path / "rows-000001.arrow"
    data = bytearray(path.read_bytes())
    source = pa.BufferReader(pa.py_buffer(bytes(data)))
    reader = pa.ipc.MessageReader.open_stream(source)
    reader.read_next_message()  # the schema
    reader.read_next_message()  # the first record
    second = source.tell()
    data[second:second + 4] = b"\x13\x37\x13\x37"  # the second record's marker; a third follows
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"rows-000001\.arrow: an unreadable record"):
        ReplayBuffer.recover("m", cfg, str(tmp_path), learner_version=0)


def test_a_fresh_buffer_refuses_a_used_folder_and_recovery_needs_one(tmp_path):
    ReplayBuffer("m", BufferConfig(), str(tmp_path / "w")).try_add(_rows("g", 2))
    with pytest.raises(ValueError, match="already holds a write-ahead log"):
        ReplayBuffer("m", BufferConfig(), str(tmp_path / "w"))
    with pytest.raises(FileNotFoundError, match="no such folder"):
        ReplayBuffer.recover("m", BufferConfig(), str(tmp_path / "missing"), 0)
    ReplayBuffer.recover("m", BufferConfig(), str(tmp_path / "w"), 0)  # leaves a checkpoint
    with pytest.raises(ValueError, match="readiness 'group'.*readiness 'episode'"):
        ReplayBuffer.recover("m", BufferConfig(readiness="episode"), str(tmp_path / "w"), 0)
    with pytest.raises(ValueError, match="wal_segment_bytes=10"):
        BufferConfig(wal_segment_bytes=10)


def test_folder_stays_bounded_over_a_long_run(tmp_path):
    cfg = BufferConfig(capacity_rows=64, wal_segment_bytes=32 << 10, wal_undo_versions=2)
    buf = ReplayBuffer("m", cfg, str(tmp_path))
    sizes, previous = [], []
    for step in range(600):
        rows = _rows(f"g{step}", 4, version=step)
        assert buf.try_add(rows)
        _reward(buf, rows[:3] + previous)  # each unit completes one step late
        previous = rows[3:]
        buf.sample(1, current_version=step, max_staleness=4)
        sizes.append(sum(p.stat().st_size for p in Path(tmp_path).iterdir()))
    files = _log_files(tmp_path)
    assert [p.name.split("-")[0] for p in files] == ["checkpoint", "events", "rows"]
    segments = int(files[-1].stem.split("-")[1])
    assert segments > 20  # the log went through more than 20 segments of 32 KiB...
    assert max(sizes) < 3 * cfg.wal_segment_bytes  # ...and the folder never held more than 3
    del buf
    back = ReplayBuffer.recover("m", cfg, str(tmp_path), learner_version=600)
    _invariant(back)
    assert back.stats().rows_added == 2400


def test_kill_9_loses_no_acknowledged_call(tmp_path):
    """A writer process adds rows and acknowledges each returned call; SIGKILL it mid-stream."""
    writer = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(REPO)!r}, {str(REPO / 'tests' / 'unit')!r}]
        from buffers.api import BufferConfig
        from buffers.replay import ReplayBuffer
        from test_buffer import _reward, _rows
        buf = ReplayBuffer("m", BufferConfig(capacity_rows=1_000_000, wal_segment_bytes=256 << 10),
                           {str(tmp_path)!r})
        for call in range(1_000_000):
            rows = _rows(f"g{{call}}", 4)
            buf.try_add(rows, origin=f"call{{call}}")
            _reward(buf, rows[:2])
            print(call, flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", writer], stdout=subprocess.PIPE, text=True)
    acked = -1
    for line in proc.stdout:
        acked = int(line)
        if acked >= 400:  # well past a few segment rolls
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    acked = max([acked] + [int(line) for line in proc.stdout.read().split()])
    back = ReplayBuffer.recover("m", BufferConfig(capacity_rows=1_000_000), str(tmp_path), 0)
    origins = [f"call{k}" for k in range(acked + 1)]
    assert set(back.received_rows(origins).values()) == {4}  # every acknowledged row is held
    s = _invariant(back)
    assert s.rows_added >= 4 * (acked + 1) and s.ready_rows >= 2 * (acked + 1)
    assert s.dropped == dict.fromkeys(DROP_REASONS, 0)


def test_a_drained_buffer_recovers_empty_with_its_counters(tmp_path):
    cfg = BufferConfig(readiness="episode", wal_fsync_every_write=True)
    buf = ReplayBuffer("m", cfg, str(tmp_path))
    buf.try_add(_rows("g", 3, episode="e"))
    buf.seal_episode("e", 3)
    assert buf.drain() == 3
    del buf
    for untaken in (1, 0):  # from the segment, then from the checkpoint the first recovery wrote
        back = ReplayBuffer.recover("m", cfg, str(tmp_path), learner_version=0)
        s = _invariant(back)
        assert (s.rows_added, s.dropped["run_stopped"], back.held_units()) == (3, 3, 0)
        assert back.take_dropped_units() == untaken  # taken once: the take is logged too
        del back
