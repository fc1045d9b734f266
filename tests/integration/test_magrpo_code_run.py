"""Acceptance: MAGRPO's code collaboration (magrpo_code, aligned joint mode) runs under
launch_async.py on CPU for 3 learner steps: single-turn (configs/magrpo_code_tiny.yaml) and
multi-turn with the advisor (configs/magrpo_code_multiturn_tiny.yaml, last test).

The run must reach version 3, balance its row books, and train what a MAGRPO round is: G = 4
episodes of one task, each with one `aux` and one `main` row that carry the same inline joint
reward (the learner's `magrpo` estimator refuses a joint action whose rows disagree), each
agent's 4 rows of a round one group of 4. The prefixes make every reply open with a
definition, so the tiny model's joint rewards reach the structure level (> 0).
"""
import importlib.util
import json
import sys
from collections import defaultdict
from pathlib import Path

import pyarrow.compute as pc
import pytest
from launch_helper import ROOT, buffered_rows, launch, scalars

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


def _load_evaluate():
    spec = importlib.util.spec_from_file_location("evaluate_script",
                                                  ROOT / "scripts" / "evaluate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_magrpo_multiturn_with_the_advisor_runs_three_steps_and_evaluates(
        tmp_path, tiny_engine, tiny_model_path):
    """configs/magrpo_code_multiturn_tiny.yaml, its advisor the session's SGLang server on the
    untrained tiny model (a real non-trained model behind the OpenAI chat API): the joint tree
    of every episode (1 + G nodes), an advice per expanded joint action, then evaluate.py asks
    the same advisor on a greedy path."""
    advisor = [f"coach.advisor.endpoints.0.base_url={tiny_engine.url}/v1",
               "coach.advisor.endpoints.0.model=tiny"]
    summary = launch("magrpo_code_multiturn_tiny.yaml", tmp_path, *advisor)
    assert summary["learners"]["policy"]["version"] == 3, summary["learners"]
    books = summary["rows"]
    assert books["unaccounted"] == 0, books
    run_dir = tmp_path / "r"
    rows = buffered_rows(run_dir, "policy").to_pylist()
    episodes = defaultdict(list)
    for r in rows:
        episodes[r["episode_id"]].append(r)
    assert episodes
    for tree in episodes.values():
        nodes = defaultdict(list)
        for r in tree:
            nodes[r["turn"], r["branch"], r["agent"]].append(r)
        # the root and one child per joint action (no termination threshold): 5 nodes x 2
        assert sorted({(t, b) for t, b, _ in nodes}) == [
            (0, ""), (1, "0"), (1, "1"), (1, "2"), (1, "3")], sorted(nodes)
        for node in nodes.values():
            assert sorted(r["candidate"] for r in node) == list(range(G))
            assert len({r["group_key"] for r in node}) == 1
            assert {r["group_size"] for r in node} == {G}
        # joint actions share their reward; a child's prompt holds the reply and the advice
        for t, b, _ in nodes:
            aux, main = nodes[t, b, "aux"], nodes[t, b, "main"]
            assert [r["reward"] for r in aux] == [r["reward"] for r in main]
        root = min(len(r["prompt_ids"]) for r in nodes[0, "", "main"])
        assert all(len(r["prompt_ids"]) > root for (t, _, a), node in nodes.items()
                   for r in node if t == 1 and a == "main")
    # one advice per turn-1 node, counted by the episodes and by the pool, none failed
    children = sum(len({r["branch"] for r in tree if r["turn"] == 1}) for tree in
                   episodes.values())
    calls = scalars(run_dir, "episode/magrpo_code/advisor_calls")
    assert calls and set(calls) == {float(G)}, calls
    assert set(scalars(run_dir, "episode/magrpo_code/advisor_failures")) == {0.0}
    assert min(scalars(run_dir, "episode/magrpo_code/advisor_latency_s")) > 0
    pool_calls = scalars(run_dir, "coach/advisor/calls")
    assert pool_calls and max(pool_calls) >= children, (pool_calls, children)
    for key in ("turn0/reward", "turn1/reward", "reward", "success", "nodes"):
        assert scalars(run_dir, f"episode/magrpo_code/{key}"), key

    evaluate = _load_evaluate()
    try:
        assert evaluate.main(["--run", str(run_dir), "--compare-base", "--max-tasks", "2",
                              *advisor], engines={"policy": tiny_engine}) == 0
    finally:
        if Path(tiny_engine.weights_path) != Path(tiny_model_path):
            tiny_engine.update_weights_from_disk(tiny_model_path, 0)
    for label in ("base", "v3"):
        report = json.loads((run_dir / "eval" / f"{label}.json").read_text())
        # a greedy path: one joint action a turn, one advice an episode
        assert report["advisor"]["calls"] == 2 and report["advisor"]["failures"] == 0, report
        assert report["metrics"]["workflow"]["advisor_calls"] == 1.0
        assert report["metrics"]["workflow"]["nodes"] == 2.0
        for episode in report["episodes_detail"]:
            assert sorted((a["agent"], a["turn"]) for a in episode["actions"]) == [
                ("aux", 0), ("aux", 1), ("main", 0), ("main", 1)]
