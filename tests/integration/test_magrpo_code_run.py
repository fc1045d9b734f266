"""Acceptance: MAGRPO's code collaboration (magrpo_code, aligned joint mode) runs under
launch_async.py on CPU for 3 learner steps (configs/magrpo_code_tiny.yaml).

The run must reach version 3, balance its row books, and train what a MAGRPO round is: G = 4
episodes of one task, each with one `aux` and one `main` row that carry the same inline joint
reward (the learner's `magrpo` estimator refuses a joint action whose rows disagree), each
agent's 4 rows of a round one group of 4. The prefixes make every reply open with a
definition, so the tiny model's joint rewards reach the structure level (> 0).
"""
from collections import defaultdict

import pyarrow.compute as pc
import pytest
from launch_helper import buffered_rows, launch, scalars

G = 4  # workflow.group_size of the config
BATCH_EPISODES = 4  # models.policy.learner.batch_units (episode readiness)


@pytest.mark.slow
def test_magrpo_code_tiny_runs_three_steps(tmp_path):
    summary = launch("magrpo_code_tiny.yaml", tmp_path)
    assert set(summary["learners"]) == {"policy"}
    assert summary["learners"]["policy"]["version"] == 3, summary["learners"]
    books = summary["rows"]
    assert books["unaccounted"] == 0, books
    # each step trains 4 episodes of 2 rows (aux, main), fewer only if a stale row was dropped
    assert 0 < books["trained"] <= 3 * BATCH_EPISODES * 2, books

    run_dir = tmp_path / "r"
    rows = buffered_rows(run_dir, "policy").to_pylist()
    assert {r["agent"] for r in rows} == {"aux", "main"}
    assert all(r["reward"] is not None for r in rows)  # inline: READY on arrival
    assert max(r["reward"] for r in rows) >= 1.0  # aux 0.4 + main 0.6 at least

    # a joint action (episode, turn, branch, candidate) is one aux row and one main row that
    # share the joint reward, also in `reward_team`
    joint = defaultdict(list)
    for r in rows:
        joint[r["episode_id"], r["turn"], r["branch"], r["candidate"]].append(r)
    for action in joint.values():
        assert sorted(r["agent"] for r in action) == ["aux", "main"]
        assert len({r["reward"] for r in action}) == 1
        assert {r["reward_team"] for r in action} == {action[0]["reward"]}

    # groups: an agent's G rows of a round (one per episode, candidates 0..G-1)
    groups = defaultdict(list)
    for r in rows:
        groups[r["group_key"]].append(r)
    for group in groups.values():
        assert len(group) == G and {r["group_size"] for r in group} == {G}
        assert len({r["agent"] for r in group}) == 1 and len({r["task_id"] for r in group}) == 1
        assert sorted(r["candidate"] for r in group) == list(range(G))
        assert len({r["episode_id"] for r in group}) == G

    # what the episodes reported: the level breakdown and the agents' behaviour
    for key in ("reward", "structure", "syntax", "success", "pass_rate"):
        assert scalars(run_dir, f"episode/magrpo_code/{key}"), key
    structure = scalars(run_dir, "episode/magrpo_code/structure")  # round means
    assert max(structure) == pytest.approx(1.0) and min(structure) >= 0.6  # the prefixes
    for key in ("behavior/aux/response_tokens", "behavior/main/response_tokens",
                "behavior/aux/defines_aux", "behavior/main/calls_aux"):
        assert scalars(run_dir, key), key
    assert pc.all(pc.equal(buffered_rows(run_dir, "policy").column("turn"), 0)).as_py()
