"""The acceptance tests' launcher: a config run under launch_async.py as a user would, and
what the run left behind (summary, TensorBoard scalars, the rows its buffers logged)."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from buffers.wal import read_stream

ROOT = Path(__file__).resolve().parents[2]


def launch(config: str, tmp_path: Path, *overrides: str) -> dict:
    """Run `configs/<config>` for 3 learner steps in `tmp_path/r`; returns its summary (plus
    `test_wall_s`). Fails unless it exits 0 and removed every episode's workspace."""
    workspaces = tmp_path / "workspaces"
    workspaces.mkdir()
    cmd = [sys.executable, str(ROOT / "scripts" / "launch_async.py"), "--config",
           str(ROOT / "configs" / config), f"run.runs_dir={tmp_path}", "run.run_id=r",
           "run.max_steps=3", f"workflow.params.sandbox.workspace_root={workspaces}",
           *overrides]
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert list(workspaces.iterdir()) == []  # every episode's workspace was removed
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    summary["test_wall_s"] = time.monotonic() - started
    return summary


def scalars(run_dir: Path, key: str) -> list[float]:
    """The values a run logged under a TensorBoard scalar key ([] if it never did)."""
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return [e.value for e in acc.Scalars(key)] if key in acc.Tags()["scalars"] else []


def buffered_rows(run_dir: Path, model: str) -> pa.Table:
    """Every row a model's buffer accepted (its write-ahead log's row segments; a 3-step run
    stays far below one segment's 64 MiB, so none was rotated away)."""
    batches = [batch for segment in sorted((run_dir / "buffer" / model).glob("rows-*.arrow"))
               for batch, _ in read_stream(segment, tolerate_torn=True)[0]]
    assert batches, f"no rows logged under {run_dir / 'buffer' / model}"
    return pa.Table.from_batches(batches)
