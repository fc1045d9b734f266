"""kill -9 of the driver mid-run, then `launch_async.py --resume` (DESIGN §10).

The driver runs as its own process, as `make run` starts it, and is killed with SIGKILL once
its learner has written a checkpoint and trained past it. The resumed run must continue from
that checkpoint and reach its step target. What is checked comes from the run directory,
counted here rather than read from the controller:
- no row is trained twice along the surviving lineage of learner versions (the learner's
  audit log lists the step_ids of every step; steps after the checkpoint died with the run);
- every step, before and after the crash, trained rows within the η in force;
- the resumed learner starts at the checkpoint's version and its first step comes within the
  recovery limit; the buffer's log was replayed (recovered rows reported).

    python -m pytest -q tests/integration/test_resume.py
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from runtime.learner_worker import complete_checkpoints, trained_twice

ROOT = Path(__file__).resolve().parents[2]
LIMIT_S = 600.0


def launch(*args: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(ROOT / "scripts" / "launch_async.py"), *args],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT,
                            start_new_session=True)


def kill_session(sid: int) -> None:
    """SIGKILL every process of session `sid` until none is left (Ray's node processes and
    actors live in the driver's session, in process groups of their own)."""
    for _ in range(50):
        found = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:  # the process ended meanwhile
                continue
            # fields after the name: state ppid pgrp session ...; a zombie is already dead
            if int(fields[3]) == sid and fields[0] != "Z":
                found.append(int(stat.parent.name))
        if not found:
            return
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # already gone
        time.sleep(0.2)
    raise AssertionError(f"processes of session {sid} survived SIGKILL: {found}")


def audit(run_dir: Path) -> list[dict]:
    path = run_dir / "logs" / "trained_policy.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines(keepends=True)
            if line.endswith("\n")]


def killable(run_dir: Path) -> bool:
    """A checkpoint exists and the learner trained one or two steps past it (of the
    `checkpoint_every=4` before the next)."""
    checkpoints = complete_checkpoints(run_dir / "checkpoints" / "policy")
    return bool(checkpoints) and checkpoints[-1] < len(audit(run_dir)) <= checkpoints[-1] + 2


def test_a_killed_driver_resumes_from_its_checkpoint_without_training_a_row_twice(tmp_path):
    run_dir = tmp_path / "crash"
    overrides = [f"run.runs_dir={tmp_path}", "run.run_id=crash", "run.max_steps=100000",
                 "run.checkpoint_every=4", "coach.latency_s=0.2"]
    first = launch("--config", str(ROOT / "configs" / "arith_duo_tiny.yaml"), *overrides,
                   log=tmp_path / "first.log")
    try:
        deadline = time.time() + LIMIT_S
        # Kill one or two steps past a checkpoint, never nearer the next one: the audit line
        # of step c+4 is written before checkpoint c+4, so a kill there can race its write and
        # leave nothing lost (seen once in CI). Missed windows wait for the next checkpoint.
        while not killable(run_dir):
            assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.time() < deadline, "no checkpoint within the limit"
            time.sleep(0.2)
        seen_at_kill = complete_checkpoints(run_dir / "checkpoints" / "policy")[-1]
        killed_at = time.time()
        kill_session(first.pid)  # the driver, its Ray node and every actor: a machine crash
        first.wait(60)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    # Ray ends the dead driver's actors itself, a few seconds later: until then they go on
    # (steps, checkpoints, buffer appends). Wait until nothing in the run directory moves.
    quiet_since, last = time.time(), None
    while time.time() - quiet_since < 10:
        now = sorted((str(p), p.stat().st_size) for p in run_dir.rglob("*") if p.is_file()
                     and "tensorboard" not in p.parts)
        if now != last:
            quiet_since, last = time.time(), now
        assert time.time() - killed_at < LIMIT_S, "the killed run's actors kept running"
        time.sleep(1)
    checkpoint = complete_checkpoints(run_dir / "checkpoints" / "policy")[-1]
    assert checkpoint >= seen_at_kill
    before = audit(run_dir)
    lost_steps = [r["version"] for r in before if r["version"] > checkpoint]
    assert lost_steps, "the crash must come after steps the checkpoint does not hold"

    target = checkpoint + 6
    resume_started = time.time()
    second = launch("--resume", str(run_dir), f"run.max_steps={target}",
                    log=tmp_path / "second.log")
    try:
        assert second.wait(LIMIT_S) == 0, (tmp_path / "second.log").read_text()[-4000:]
    finally:
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGKILL)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed"]["versions"] == {"policy": checkpoint}
    assert summary["learners"]["policy"]["version"] == target
    records = audit(run_dir)
    marker = next(r for r in records if "resumed_from" in r)
    assert marker["resumed_from"] == checkpoint
    after = [r for r in records[records.index(marker) + 1:]]
    assert [r["version"] for r in after] == list(range(checkpoint + 1, target + 1))
    # counted from the audit: no row trained twice; every step within its η
    rows, twice = trained_twice(run_dir / "logs" / "trained_policy.jsonl")
    assert rows > 0 and twice == 0
    assert all(r["staleness_max"] <= r["max_staleness"] for r in records if "version" in r)
    # the rows of the steps that died with the driver were rolled back and trained again
    lost_ids = {i for r in before if r["version"] > checkpoint for i in r["step_ids"]}
    again = {i for r in after for i in r["step_ids"]}
    recovered = summary["resumed"]["recovered"]["policy"]
    assert recovered["rows_untrained"] >= len(lost_ids & again) > 0
    recovery_s = after[0]["at"] - killed_at
    print(f"resume: checkpoint v{checkpoint}, {len(lost_steps)} steps lost with the driver, "
          f"{recovered['rows_untrained']} rows rolled back; first step {recovery_s:.0f} s "
          f"after the kill, {after[0]['at'] - resume_started:.0f} s after the resume command "
          f"(restore done {marker['at'] - resume_started:.0f} s after it)")
    assert summary["rows"]["unaccounted"] == 0, summary["rows"]
