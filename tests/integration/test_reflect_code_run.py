"""Acceptance: UnityMAS-O's reflective code loop (reflect_code, Workflow D) runs under
launch_async.py on CPU for 3 learner steps with each agent-model mapping of the paper (§4.2):
full sharing (configs/reflect_code_tiny_shared.yaml, one model), partial sharing
(configs/reflect_code_tiny.yaml: planner and reflector on one model, the coder on another) and
no sharing (configs/reflect_code_tiny_specialised.yaml, three models).

Each run must bring every model to version 3, balance its row books, and keep every model's
rows its own: a model's buffer holds, and its learner trains, only the rows of the agents
mapped to it (the trained rows are read back from the buffer's write-ahead log, whose
`events-*` records name every row a sample handed to the learner). Across the buffers each
episode is the loop of unitymas-o.txt lines 229-231: planner and coder act in rounds 1..R, the
reflector in rounds 1..R−1, R = 3 unless the code passed every test; every row carries its
round's score delta inline (the reflector of round t the delta of round t + 1), so the
planner's and coder's rewards of an episode telescope to its last score.
"""
import json
from collections import defaultdict
from pathlib import Path

import pyarrow as pa
import pytest
from launch_helper import buffered_rows, launch, scalars

from buffers.wal import read_stream

AGENTS = ("planner", "coder", "reflector")
MAPPINGS = {
    "reflect_code_tiny_shared.yaml": {"planner": "policy", "coder": "policy",
                                      "reflector": "policy"},
    "reflect_code_tiny.yaml": {"planner": "reasoner", "reflector": "reasoner", "coder": "coder"},
    "reflect_code_tiny_specialised.yaml": {"planner": "planner", "coder": "coder",
                                           "reflector": "reflector"},
}


def trained_step_ids(run_dir: Path, model: str) -> set[str]:
    """Rows a model's buffer handed to its learner: the log's events with effect "trained"."""
    found = set()
    for segment in sorted((run_dir / "buffer" / model).glob("events-*.arrow")):
        for batch, _ in read_stream(segment, tolerate_torn=True)[0]:
            table = pa.Table.from_batches([batch])
            found.update(s for s, effect in zip(table.column("step_id").to_pylist(),
                                                table.column("effect").to_pylist())
                         if effect == "trained")
    return found


def check_episodes(rows: list[dict], models: set[str]) -> None:
    """Every episode's rows, gathered across the buffers, are the loop with line 231's credits.

    An episode is checked when every model's rows of it reached a buffer (a round cut off by
    the run's stop while shipping may have delivered only some models' rows: counted lost).
    """
    episodes = defaultdict(list)
    for row in rows:
        episodes[row["episode_id"]].append(row)
    whole = [e for e in episodes.values() if {r["model_id"] for r in e} == models]
    assert whole
    for episode in whole:
        turns = {a: sorted(r["turn"] for r in episode if r["agent"] == a) for a in AGENTS}
        last = max(turns["coder"])
        assert turns["planner"] == turns["coder"] == list(range(1, last + 1)), turns
        assert turns["reflector"] == list(range(1, last)), turns
        meta = {(r["agent"], r["turn"]): json.loads(r["meta"]) for r in episode}
        by_round = defaultdict(set)
        for r in episode:
            credited = meta[r["agent"], r["turn"]]["credited_round"]
            assert credited == r["turn"] + (r["agent"] == "reflector"), (r["agent"], credited)
            assert r["reward"] == pytest.approx(meta[r["agent"], r["turn"]]["reward_delta"])
            by_round[credited].add(round(r["reward"], 6))
        assert all(len(rewards) == 1 for rewards in by_round.values()), by_round  # one d_t
        score = meta["coder", last]["score"]
        coder = sum(r["reward"] for r in episode if r["agent"] == "coder")
        assert coder == pytest.approx(score, abs=1e-5)  # the deltas telescope to s_R
        solved = score == 1.0
        assert last == 3 or solved
        assert {r["outcome"] for r in episode} == {float(solved)}


@pytest.mark.slow
@pytest.mark.parametrize("config", list(MAPPINGS))
def test_reflect_code_runs_three_steps_and_each_learner_trains_its_own_agents(config, tmp_path):
    agents = MAPPINGS[config]
    models = set(agents.values())
    summary = launch(config, tmp_path)
    assert set(summary["learners"]) == models
    assert all(s["version"] == 3 for s in summary["learners"].values()), summary["learners"]
    books = summary["rows"]
    assert books["generated"] > 0 and books["trained"] > 0
    assert books["unaccounted"] == 0, books

    run_dir = tmp_path / "r"
    every_row = []
    for model in models:
        mine = {a for a, m in agents.items() if m == model}
        rows = buffered_rows(run_dir, model).to_pylist()
        assert {r["agent"] for r in rows} == mine, model
        assert {r["model_id"] for r in rows} == {model}
        assert all(r["reward"] is not None for r in rows)  # inline: READY on arrival
        trained = trained_step_ids(run_dir, model)
        assert trained and summary["buffers"][model]["rows_trained"] == len(trained), model
        by_id = {r["step_id"]: r for r in rows}
        assert trained <= set(by_id), model  # the learner saw only its own buffer's rows
        # its learner trained every agent mapped to it (an episode unit holds all of them)
        assert {by_id[s]["agent"] for s in trained} == mine, model
        assert scalars(run_dir, f"train/{model}/rows"), model
        every_row += rows
    check_episodes(every_row, models)

    for key in ("success", "rounds", "pass_rate_first", "pass_rate_last", "improvement"):
        assert scalars(run_dir, f"episode/reflect_code/{key}"), key
    for agent in AGENTS:
        assert scalars(run_dir, f"behavior/{agent}/response_tokens"), agent
    calls = scalars(run_dir, "behavior/coder/tool_call_rate")
    assert calls and max(calls) > 0  # the verifier ran the coder's code in the sandbox
