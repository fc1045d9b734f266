"""Continuing a stopped or crashed run from its run directory (DESIGN §10).

`python scripts/launch_async.py --resume runs/<id>` reads the run's resolved `config.yaml`
(overrides on the command line still apply, e.g. a larger run.max_steps) and restarts every
part from what the run left on disk:
- each learner from its newest complete checkpoint (`checkpoints/<model>/v<N>/`, weights,
  optimizer, version; the engines are given that version's weights);
- each buffer from its write-ahead segments (`buffer/<model>/`); samples taken at or after
  the checkpoint's version are rolled back (their training step died with the run), so every
  row is trained exactly once by the surviving lineage of learner versions;
- the clock from the checkpoint (η, the task stream's cursor, the ledger's counts) with its
  issued units re-derived: `version x batch_units` consumed plus the units the recovered buffer
  holds, so the staleness bound holds across the resume;
- the coach requests of rows still pending a score are sent again, once, from the coach
  journal (`coach_requests.jsonl`).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from runtime.config import TroupeConfig, load_config
from runtime.learner_worker import complete_checkpoints

log = logging.getLogger("troupe")


@dataclass
class ResumePlan:
    """What a resumed run starts from; filled by `plan_resume`, logged and kept in the summary."""

    run_dir: str
    checkpoints: dict[str, str | None]  # model -> newest complete checkpoint folder (None: v0)
    versions: dict[str, int]  # model -> the learner version the run continues from
    meta: dict[str, dict] = field(default_factory=dict)  # model -> checkpoint.json
    recovered: dict[str, dict] = field(default_factory=dict)  # model -> buffer RecoveryReport
    coach_resent: int = 0  # coach requests sent again for rows still pending
    seconds: float = 0.0  # from the start of the restore until rollouts run


def load_resume_config(run_dir: str | Path, overrides: list[str] = ()) -> TroupeConfig:
    """The run's own resolved config, with `overrides` on top; run_id and runs_dir its own."""
    run_dir = Path(run_dir).resolve()
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"--resume {run_dir}: no config.yaml there; name a run "
                                "directory created by launch_async.py (runs/<run_id>)")
    cfg = load_config(path, list(overrides))
    cfg.run.run_id = run_dir.name
    cfg.run.runs_dir = str(run_dir.parent)
    return cfg


def plan_resume(cfg: TroupeConfig, run_dir: Path) -> ResumePlan:
    """Find each model's newest complete checkpoint (a run may have none yet: version 0)."""
    checkpoints: dict[str, str | None] = {}
    versions: dict[str, int] = {}
    meta: dict[str, dict] = {}
    for model_id in cfg.models:
        folder = run_dir / "checkpoints" / model_id
        found = complete_checkpoints(folder)
        if not found:
            checkpoints[model_id], versions[model_id] = None, 0
            log.warning("resume: %s has no complete checkpoint; its learner starts at v0 and "
                        "every buffered row is trained again from there", model_id)
            continue
        path = folder / f"v{found[-1]}"
        checkpoints[model_id], versions[model_id] = str(path), found[-1]
        meta[model_id] = json.loads((path / "checkpoint.json").read_text())
    return ResumePlan(str(run_dir), checkpoints, versions, meta)


def restored_ledger(plan: ResumePlan, rows_added: dict[str, int]) -> dict:
    """The ledger's counts after a resume.

    Rows generated before the crash are those the buffers' segments hold (every accepted row
    is in them) plus the rows the checkpointed ledger had counted lost; rows of rounds that
    were in flight when the run died never reached a buffer or a file, so they are not
    counted (the clock, which knew them, died with the run).
    """
    lost: dict[str, int] = {}
    closed = abandoned = 0
    for meta in plan.meta.values():  # every model's checkpoint holds the same (shared) clock
        ledger = meta["clock"]["ledger"]
        for reason, n in ledger["lost"].items():
            lost[reason] = max(lost.get(reason, 0), int(n))
        closed = max(closed, int(ledger["closed_rounds"]))
        abandoned = max(abandoned, int(ledger["abandoned_rounds"]))
    generated = sum(rows_added.values()) + sum(lost.values())
    return {"generated": generated, "lost": lost, "closed_rounds": closed,
            "abandoned_rounds": abandoned}


def restored_etas(cfg: TroupeConfig, plan: ResumePlan) -> dict[str, int]:
    """η per model as the checkpoint's clock had it (a live change survives the resume)."""
    etas = {}
    for model_id, mc in cfg.models.items():
        meta = plan.meta.get(model_id)
        etas[model_id] = (int(meta["clock"]["models"][model_id]["max_staleness"])
                          if meta else mc.learner.initial_staleness)
    return etas


def restored_task_cursor(plan: ResumePlan) -> int:
    """Where the shared task stream continues: the furthest any checkpoint saw."""
    return max((int(m["clock"].get("task_cursor", 0)) for m in plan.meta.values()), default=0)


def leave_resume_files(plan: ResumePlan) -> None:
    """Tell each model's buffer, before it is created, which version the learner resumes at."""
    from runtime.buffer_actor import leave_resume_file

    for model_id, version in plan.versions.items():
        wal_dir = Path(plan.run_dir) / "buffer" / model_id
        if wal_dir.is_dir():
            leave_resume_file(wal_dir, version)


def resend_coach_requests(run_dir: str | Path, coach, pending: set[str], resend: bool) -> int:
    """Send the coach again the journaled requests of the rows `pending` a score (their
    scores died with a process); returns how many were sent. `resend`: the pool has seen
    these step_ids before (a restarted buffer or learner in a live run)."""
    from actors.coach.pool import journaled_requests
    from runtime.supervise import SETUP_TIMEOUT_S, get_within

    journal = Path(run_dir) / "coach_requests.jsonl"
    if not pending or not journal.is_file():
        return 0
    requests = journaled_requests(str(journal), pending)
    if len(requests) < len(pending):
        log.warning("%d pending rows have no journaled coach request; they time out "
                    "(counted) in their buffer", len(pending) - len(requests))
    if requests:
        get_within(coach.submit.remote(requests, resend), SETUP_TIMEOUT_S,
                   f"the coach pool (resending {len(requests)} requests)")
    return len(requests)


def restore_parts(run, plan: ResumePlan) -> None:
    """After the buffers recovered: restore the clock, resend pending coach requests, restore
    the learners (engines get the checkpoint's weights). `run` is the `Run` being started."""
    import time

    from runtime.supervise import SETUP_TIMEOUT_S, get_within

    def get(refs, what: str):  # one-time calls that may load: long, but bounded
        return get_within(refs, SETUP_TIMEOUT_S, f"{what} (resume)")

    started = time.perf_counter()
    cfg = run.cfg
    models = list(cfg.models)
    stats = dict(zip(models, get([run.buffers[m].stats.remote() for m in models],
                                 "buffers' stats")))
    held = dict(zip(models, get([run.buffers[m].held_units.remote() for m in models],
                                "buffers' held_units")))
    for model_id, report in zip(models, get([run.buffers[m].recovery.remote()
                                             for m in models], "buffers' recovery")):
        plan.recovered[model_id] = report or {}
    issued = {m: plan.versions[m] * cfg.models[m].learner.batch_units + held[m] for m in models}
    get(run.clock.restore.remote(
        plan.versions, restored_etas(cfg, plan), issued,
        restored_ledger(plan, {m: s.rows_added for m, s in stats.items()}),
        restored_task_cursor(plan)), "the clock's restore")
    pending = set()
    for model_id in models:
        pending.update(get(run.buffers[model_id].pending_step_ids.remote(),
                           f"buffer {model_id}'s pending_step_ids"))
    plan.coach_resent = resend_coach_requests(plan.run_dir, run.coach, pending, resend=False)
    get([run.learners[m].restore.remote(path) for m, path in plan.checkpoints.items()
         if path is not None], "learners' restore")
    plan.seconds = time.perf_counter() - started
    log.info("resume: learners at %s, buffers %s, %d coach requests re-sent, %.1f s",
             plan.versions, {m: {k: r.get(k) for k in ("rows_pending", "rows_ready",
                                                      "rows_untrained")}
                             for m, r in plan.recovered.items()}, plan.coach_resent,
             plan.seconds)
