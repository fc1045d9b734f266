"""VersionClock admission numbers (DESIGN §5.1)."""
import asyncio

import pytest

from buffers.clock import VersionClock


def test_admission_follows_version_and_eta():
    clock = VersionClock({"policy": (2, 1)})  # batch_units=2, eta=1: limit (0+1+1)*2 = 4 at v=0
    assert all(clock.try_admit({"policy": 1}) for _ in range(4))
    assert not clock.try_admit({"policy": 1})
    clock.set_version("policy", 1)  # limit 6: two more
    assert clock.try_admit({"policy": 1}) and clock.try_admit({"policy": 1})
    assert not clock.try_admit({"policy": 1})
    clock.release("policy", 1)  # a dropped unit gives its budget back
    assert clock.try_admit({"policy": 1})
    assert not clock.try_admit({"policy": 1})
    snap = clock.snapshot()["policy"]
    assert snap == {"batch_units": 2, "max_staleness": 1, "version": 1, "issued_units": 6, "limit": 6,
                    "released_surplus": 0}


def test_eta_zero_is_on_policy_and_live_tunable():
    clock = VersionClock({"policy": (2, 0)})
    assert clock.try_admit({"policy": 2})
    assert not clock.try_admit({"policy": 1})
    clock.set_max_staleness("policy", 2)
    assert clock.try_admit({"policy": 1})
    with pytest.raises(ValueError, match="max_staleness"):
        clock.set_max_staleness("policy", -1)


def test_multi_model_refusal_changes_nothing():
    clock = VersionClock({"actor": (1, 0), "critic": (4, 0)})
    assert clock.try_admit({"actor": 1, "critic": 1})
    assert not clock.try_admit({"actor": 1, "critic": 1})  # actor is full
    assert clock.snapshot()["critic"]["issued_units"] == 1
    assert clock.try_admit({"critic": 3})


def test_unknown_model_names_known_ones():
    clock = VersionClock({"actor": (1, 0)})
    with pytest.raises(KeyError, match="'ghost'.*actor"):
        clock.try_admit({"ghost": 1})
    with pytest.raises(KeyError, match="ghost"):
        clock.set_version("ghost", 1)


def test_a_dead_owner_gives_back_only_the_units_of_rounds_that_made_no_rows():
    clock = VersionClock({"a": (3, 0), "b": (3, 0)})
    assert clock.try_admit({"a": 1, "b": 1}, owner="r0", round_id="played")
    assert clock.try_admit({"a": 1, "b": 1}, owner="r1", round_id="playing")
    assert clock.try_admit({"a": 1, "b": 1}, owner="r1", round_id="shipping")
    assert not clock.try_admit({"a": 1}, owner="r0", round_id="refused")  # full at v=0
    clock.generated("played", {"e0": {"a": 2, "b": 1}})
    clock.shipped("played")  # r0's round reached the buffers
    clock.generated("shipping", {"e1": {"a": 2}, "e2": {"b": 3}})
    # r1 died: "playing" had no rows yet, so its units come back now; "shipping" may be in
    # the buffers, so it goes to the controller to reconcile and keeps its units.
    freed, with_rows = clock.take_owner("r1")
    assert freed == {"a": 1, "b": 1}
    assert list(with_rows) == ["shipping"] and with_rows["shipping"].rows == 5
    assert clock.snapshot()["a"]["issued_units"] == 2
    assert clock.take_owner("r0") == ({}, {})
    stats = clock.ledger_stats()
    assert stats.generated == 8 and stats.closed_rounds == 1 and stats.open_rounds == 0


def test_an_abandoned_round_counts_its_rows_lost_and_frees_its_units():
    clock = VersionClock({"a": (1, 0)})
    assert clock.try_admit({"a": 1}, owner="r0", round_id="x")
    clock.abandon("x", rows=4, reason="episode_error")
    assert clock.try_admit({"a": 1}, owner="r0", round_id="y")
    clock.generated("y", {"e": {"a": 2}})
    with pytest.raises(ValueError, match="reconciles"):
        clock.abandon("y", rows=2, reason="run_stopped")  # rows may be in a buffer already
    with pytest.raises(ValueError, match="loss reason"):
        clock.count_lost(1, "vanished")
    stats = clock.ledger_stats()
    assert stats.generated == 6 and stats.lost["episode_error"] == 4 and stats.open_rounds == 1
    with pytest.raises(KeyError, match="not open"):
        clock.shipped("x")


def test_waiting_admission_wakes_on_a_new_version_and_times_out_otherwise():
    clock = VersionClock({"a": (1, 0)})

    async def go():
        assert await clock.wait_admit({"a": 1}, timeout_s=0.01)
        started = asyncio.get_running_loop().time()
        assert not await clock.wait_admit({"a": 1}, timeout_s=0.2)  # full: times out
        assert asyncio.get_running_loop().time() - started >= 0.19
        waiter = asyncio.create_task(clock.wait_admit({"a": 1}, timeout_s=30))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        started = asyncio.get_running_loop().time()
        clock.set_version("a", 1)  # the learner stepped: one more unit may start
        assert await waiter
        assert asyncio.get_running_loop().time() - started < 1.0  # woken, not polled

    asyncio.run(go())


def test_pause_refuses_admission_until_resume_and_eta_changes_live():
    clock = VersionClock({"a": (1, 0)})
    clock.pause()
    assert not clock.try_admit({"a": 1})
    clock.resume()
    assert clock.try_admit({"a": 1}) and not clock.try_admit({"a": 1})
    clock.set_max_staleness("a", 2)  # two more versions of lead allowed
    assert clock.max_staleness("a") == 2
    assert clock.try_admit({"a": 1}) and clock.try_admit({"a": 1})
    assert not clock.try_admit({"a": 1})
    with pytest.raises(ValueError, match="max_staleness=-1"):
        clock.set_max_staleness("a", -1)


def test_state_and_restore_carry_versions_eta_ledger_and_the_task_cursor():
    clock = VersionClock({"a": (2, 1)})
    assert clock.try_admit({"a": 2}, owner="r", round_id="x")
    clock.generated("x", {"e": {"a": 3}})
    clock.shipped("x")
    clock.set_version("a", 3)
    clock.set_max_staleness("a", 0)
    assert [clock.next_task_index() for _ in range(5)] == [0, 1, 2, 3, 4]
    state = clock.state()
    fresh = VersionClock({"a": (2, 1)})
    fresh.restore({"a": 3}, {"a": state["models"]["a"]["max_staleness"]}, {"a": 1},
                  state["ledger"], state["task_cursor"])
    assert fresh.snapshot()["a"]["version"] == 3 and fresh.max_staleness("a") == 0
    assert fresh.snapshot()["a"]["issued_units"] == 1
    assert fresh.ledger_stats().generated == 3 and fresh.ledger_stats().closed_rounds == 1
    assert fresh.next_task_index() == 5


def test_an_admission_still_waiting_when_its_owner_is_settled_is_refused():
    """A rollout actor that dies (or is stopped) while waiting for admission leaves its wait
    running in the clock: it must not open a round after the controller settled the owner."""
    clock = VersionClock({"a": (1, 0)})

    async def go():
        assert clock.try_admit({"a": 1}, owner="r0", round_id="first")
        waiting = asyncio.create_task(clock.wait_admit({"a": 1}, "r0", "orphan", timeout_s=30))
        await asyncio.sleep(0.05)
        clock.take_owner("r0")  # the controller settles the dead actor: "first" is freed
        assert not await waiting  # woken and refused, although a unit is free now
        assert clock.ledger_stats().open_rounds == 0
        assert clock.try_admit({"a": 1}, owner="r1", round_id="new")  # its replacement plays
        clock.take_owner(None)  # end of run
        assert not clock.try_admit({"a": 1}, owner="r2", round_id="late")

    asyncio.run(go())


def test_rewind_re_derives_issued_units_and_only_goes_back():
    clock = VersionClock({"a": (2, 1)})
    clock.set_version("a", 5)
    assert clock.try_admit({"a": 2}, owner="r", round_id="open")  # in flight: 2 units
    clock.rewind("a", 4, held_units=3)  # checkpoint v4; the recovered buffer holds 3 units
    assert clock.snapshot()["a"]["version"] == 4
    assert clock.snapshot()["a"]["issued_units"] == 4 * 2 + 3 + 2
    with pytest.raises(ValueError, match="only goes back"):
        clock.rewind("a", 6, held_units=0)


def test_round_seconds_average_admission_to_generated_per_model(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("buffers.ledger.time.monotonic", lambda: now[0])
    monkeypatch.setattr("buffers.clock.time.monotonic", lambda: now[0])
    clock = VersionClock({"a": (4, 2), "b": (4, 2)})
    assert clock.round_seconds("a") is None
    assert clock.try_admit({"a": 2, "b": 0}, "r", "round-1")
    assert clock.try_admit({"a": 1, "b": 1}, "r", "round-2")
    now[0] = 103.0
    clock.generated("round-1", {"e1": {"a": 4}}, {"a": 2, "b": 0})
    now[0] = 107.0
    clock.generated("round-2", {"e2": {"a": 2, "b": 2}}, {"a": 1, "b": 1})
    assert clock.round_seconds("a") == pytest.approx((3.0 + 7.0) / 2)
    assert clock.round_seconds("b") == pytest.approx(7.0)  # round-1 made no unit of b
    with pytest.raises(KeyError, match="unknown model 'c'"):
        clock.round_seconds("c")
