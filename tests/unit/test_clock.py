"""VersionClock admission numbers (DESIGN §5.1)."""
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
    assert snap == {"batch_units": 2, "max_staleness": 1, "version": 1, "issued_units": 6, "limit": 6}


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


def test_a_dead_owner_gives_its_in_flight_units_back():
    clock = VersionClock({"a": (2, 0), "b": (2, 0)})
    assert clock.try_admit({"a": 1, "b": 1}, owner="r0")
    assert clock.try_admit({"a": 1, "b": 1}, owner="r1")
    assert not clock.try_admit({"a": 1}, owner="r0")  # full at v=0
    clock.shipped({"a": 1, "b": 1}, owner="r0")  # r0's round reached the buffers
    assert clock.release_owner("r0") == {}
    assert clock.release_owner("r1") == {"a": 1, "b": 1}  # r1 died mid-round
    assert clock.try_admit({"a": 1, "b": 1}, owner="r2")
    with pytest.raises(ValueError):
        clock.shipped({"a": 5}, owner="r2")
