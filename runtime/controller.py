"""The controller: creates and wires every actor, supervises them, stops the run.

It is the only place that calls `ray.remote` (STYLE §1). Order: dtype → run directory → control
bus (runtime/bus_service.py) → Ray → metrics → engines (wait for health) → buffers, clock,
coach pool → learners → rollout actors. It then watches: a learner failure or a coach
programming error stops the run with its cause; a failed rollout actor is replaced (it is
stateless) within `run.actor_restarts_per_hour`, its open rounds reconciled with the ledger;
commands from the bus are applied between supervision rounds (runtime/control.py), and every
learner step, version and status goes out as an event; engines are probed and restarted when dead (slow is not
dead: actors/engines/sglang.py); no learner step for `run.stall_timeout_s` stops the run
naming the stuck stage (runtime/stall.py). When every learner reached `run.max_steps` it
stops the rollouts, drains the buffers and writes `summary.json` with the row accounting:
the ledger's generated rows (counted before shipping, buffers/ledger.py) must equal the
buffers' trained + dropped rows plus the ledger's lost rows.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections import deque
from dataclasses import asdict
from pathlib import Path

import ray

from actors.coach import CoachPool, build_coach
from actors.engines.sglang import SGLangEngine
from actors.workflows import build_workflow
from buffers.clock import VersionClock
from runtime.accounting import _add_counts, close_books, row_accounting
from runtime.buffer_actor import BufferActor, leave_resume_file
from runtime.bus_service import BusService
from runtime.config import TroupeConfig, to_yaml
from runtime.control import RunControl
from runtime.failures import ACTOR_GONE
from runtime.dtype import resolve_dtype
from runtime.learner_worker import (LearnerFiles, LearnerPeers, LearnerWorker,
                                    complete_checkpoints)
from runtime.metrics import MetricsWriter
from runtime.models import resolve_model
from runtime.rollout_host import BufferCommit, RayRolloutPorts, RolloutHost, RolloutSetup
from runtime.resume import (ResumePlan, leave_resume_files, plan_resume, resend_coach_requests,
                            restore_parts)
from runtime.stall import Snapshot, diagnose

log = logging.getLogger("troupe")


def make_run_dir(cfg: TroupeConfig) -> Path:
    run_id = cfg.run.run_id or f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    cfg.run.run_id = run_id
    run_dir = Path(cfg.run.runs_dir) / run_id
    for sub in ("tensorboard", "weights", "logs", "checkpoints"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    return run_dir


def init_ray(cfg: TroupeConfig) -> None:
    if ray.is_initialized():
        return
    # Inside `ray job submit` RAY_ADDRESS names the cluster; otherwise start a private one.
    address = cfg.run.ray_address or os.environ.get("RAY_ADDRESS", "")
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep sockets on loopback
        ray.init(address="local", num_cpus=cfg.run.num_cpus, include_dashboard=False,
                 log_to_driver=True)


class Run:
    """One training run; `start`, then `wait`, then `shutdown` (always)."""

    def __init__(self, cfg: TroupeConfig, resume: bool = False) -> None:
        """`resume`: continue the run in <runs_dir>/<run_id> from its files (runtime/resume.py);
        its config.yaml already holds the seeds with run.seed applied."""
        self.cfg = cfg
        self.resume = resume
        self.resume_plan: ResumePlan | None = None
        resolve_dtypes(cfg)
        if not resume:
            apply_run_seed(cfg)
        self.run_dir = make_run_dir(cfg)
        self.run_id = cfg.run.run_id
        self.model_paths = {m: str(resolve_model(mc.path)) for m, mc in cfg.models.items()}
        self.engines: dict[str, list] = {}
        self.rollouts: dict[int, object] = {}
        self.rollout_refs: dict = {}
        self.exhausted: set[int] = set()  # rollout actors that played every epoch of their tasks
        self.draining: dict[int, float] = {}  # scaled-down actors finishing their rounds -> since
        self.retired_episodes = 0  # episodes played by actors removed by a scale-down
        self.restarts = 0
        self.spawned = 0  # rollout actors ever started (their owner names stay unique)
        self.restart_times: deque[float] = deque()  # failures within the last hour (the budget)
        self.state = "starting"  # starting | running | stopping | finished | failed (events/status)
        self.bus: BusService | None = None
        self.buffer_restarts: dict[str, int] = {}  # model -> restarts of its buffer actor
        self.learner_restarts: dict[str, int] = {}  # model -> restarts of its learner actor
        self.learner_recoveries: list[dict] = []  # what each learner restart restored
        self.last_progress: dict[str, dict] = {}  # model -> the learner's last progress seen
        self.status_ticks = 0  # supervision rounds (the step of coach score histograms)
        self.owners: dict[int, str] = {}
        self.crashed_units: dict[str, int] = {}  # admitted units lost with crashed actors
        self.stall_base: Snapshot | None = None  # counters at the last learner step

    def start(self) -> None:
        cfg = self.cfg
        # the bus first: `ctl.py status` answers while engines start
        self.bus = BusService(cfg.bus, self.run_dir, self.run_id)
        self.bus.start()
        self.control = RunControl(self, self.bus)
        self.control.publish_status()
        init_ray(cfg)
        self.metrics = ray.remote(MetricsWriter).options(num_cpus=0).remote(
            str(self.run_dir / "tensorboard"))
        self.metrics.text.remote("config", "```\n" + to_yaml(cfg) + "\n```")
        for model_id, mc in cfg.models.items():
            # A GPU run (engine.device=cuda) reserves the GPUs each engine's server uses.
            gpus = mc.engine.tp_size if mc.engine.device == "cuda" else 0
            self.engines[model_id] = [
                ray.remote(SGLangEngine).options(
                    num_cpus=0, num_gpus=gpus, max_concurrency=4).remote(
                    f"{model_id}-{i}", self.model_paths[model_id], mc.engine,
                    str(self.run_dir / "logs"))
                for i in range(mc.engines)]
        log.info("starting %d engine server(s)…", sum(map(len, self.engines.values())))
        urls = {m: ray.get([e.start.remote() for e in es]) for m, es in self.engines.items()}
        log.info("engines ready: %s", urls)
        self.buffer_incarnations = None  # set once the buffers exist (restart detection)
        if self.resume:
            self.resume_plan = plan_resume(cfg, self.run_dir)
            leave_resume_files(self.resume_plan)
        # A buffer whose process dies is restarted by Ray over its write-ahead log; calls in
        # flight fail (a rollout's round is then settled, a learner retries).
        self.buffers = {m: ray.remote(BufferActor).options(
            num_cpus=0, max_restarts=cfg.run.buffer_restarts, max_task_retries=0).remote(
            m, mc.buffer, str(self.run_dir / "buffer" / m)) for m, mc in cfg.models.items()}
        self.clock = ray.remote(VersionClock).options(num_cpus=0).remote(
            {m: (mc.learner.batch_units, mc.learner.initial_staleness)
             for m, mc in cfg.models.items()})
        coach = build_coach(cfg.coach, build_workflow(cfg.workflow),
                            str(self.run_dir / "coach_cache.jsonl"))
        self.coach = ray.remote(CoachPool).options(num_cpus=0, max_concurrency=1000).remote(
            cfg.coach, coach, BufferCommit(self.buffers), str(self.run_dir / "coach_requests.jsonl"))
        self.learners = {}
        for model_id, mc in cfg.models.items():
            pad_id = _pad_id(self.model_paths[model_id])
            # On GPUs the learner actor holds one GPU per megatron rank (TP x PP; its follower
            # ranks are processes of this actor, DESIGN §6).
            gpus = (mc.learner.tensor_parallel * mc.learner.pipeline_parallel
                    if mc.engine.device == "cuda" else 0)
            self.learners[model_id] = ray.remote(LearnerWorker).options(
                num_cpus=cfg.run.learner_cpus, num_gpus=gpus, max_concurrency=8,
                max_restarts=cfg.run.learner_restarts, max_task_retries=0).remote(
                model_id, mc.learner, self.model_paths[model_id],
                LearnerPeers(self.buffers[model_id], self.clock, self.engines[model_id],
                             self.metrics),
                LearnerFiles(str(self.run_dir), pad_id, cfg.run.keep_weights,
                             cfg.run.checkpoint_every, cfg.run.keep_checkpoints))
        self.urls = urls
        self.buffer_incarnations = {m: ray.get(b.incarnation.remote())
                                    for m, b in self.buffers.items()}
        if self.resume_plan is not None:
            restore_parts(self, self.resume_plan)
        self.ports = RayRolloutPorts(self.clock, self.buffers, self.coach, self.metrics)
        self.readiness = {m: mc.buffer.readiness for m, mc in cfg.models.items()}
        for i in range(cfg.rollout.actors):
            self.spawn_rollout(i)
        self.learner_refs = {w.run.remote(cfg.run.max_steps): m
                             for m, w in self.learners.items()}
        self.started_at = time.time()
        self.state = "running"

    def spawn_rollout(self, index: int) -> None:
        cfg = self.cfg
        self.spawned += 1
        owner = f"rollout-{index}-{self.spawned}"  # unique per actor ever started
        setup = RolloutSetup(self.run_id, index, owner, self.urls, self.model_paths,
                             self.readiness,
                             {m: dict(mc.chat_template_kwargs) for m, mc in cfg.models.items()})
        actor = ray.remote(RolloutHost).options(
            num_cpus=cfg.run.rollout_cpus, max_concurrency=1000).remote(
            cfg.rollout, cfg.workflow, setup, self.ports)
        self.rollouts[index] = actor
        self.owners[index] = owner
        self.rollout_refs[actor.run.remote()] = index

    def restarts_last_hour(self) -> int:
        while self.restart_times and time.time() - self.restart_times[0] > 3600:
            self.restart_times.popleft()
        return len(self.restart_times)

    def wait(self) -> None:
        """Supervise until every learner is done; raises the cause of a fatal failure."""
        try:
            self._supervise()
        except BaseException as exc:
            self.state = "failed"
            self.control.publish_error("run_failed", f"{type(exc).__name__}: {exc}")
            self.control.publish_status()
            raise

    def _supervise(self) -> None:
        pending_learners = dict(self.learner_refs)
        last_status = 0.0
        self.stall_base = self._snapshot()
        while pending_learners:
            refs = list(pending_learners) + list(self.rollout_refs)
            done, _ = ray.wait(refs, num_returns=1, timeout=0.25)
            for ref in done:
                if ref in pending_learners:
                    model_id = pending_learners.pop(ref)
                    try:
                        summary = ray.get(ref)  # re-raises a learner's error: the run stops
                    except ACTOR_GONE as exc:  # its process died
                        pending_learners[self._restart_learner(model_id, exc)] = model_id
                        continue
                    log.info("learner %s finished: v%d", model_id, summary["version"])
                else:
                    self._on_rollout_exit(ref)
            self.control.apply_pending()
            self.control.publish_steps()
            if self.control.stop_reason is not None:
                log.warning("stopping: %s (learners checkpoint first)", self.control.stop_reason)
                self.state = "stopping"
                for w in self.learners.values():
                    w.stop.remote(checkpoint=True)
                ray.get(list(pending_learners))
                break
            if self.exhausted and not self.rollout_refs:
                log.warning("every rollout actor played all workflow.tasks.epochs=%d: stopping "
                            "the learners (rows not yet trained are counted as run_stopped)",
                            self.cfg.workflow.tasks.epochs)
                for w in self.learners.values():
                    w.stop.remote()
                ray.get(list(pending_learners))
                break
            if time.time() - last_status > 5:
                self._watch_stall(self._status())
                last_status = time.time()
            wall = self.cfg.run.max_wall_s
            if wall and time.time() - self.started_at > wall:
                log.warning("run.max_wall_s=%s reached: stopping", wall)
                for w in self.learners.values():
                    w.stop.remote()
                ray.get(list(pending_learners))
                break

    def _on_rollout_exit(self, ref) -> None:
        index = self.rollout_refs.pop(ref)
        if index in self.draining:
            self._retire(index, ref)
            return
        try:
            stats = ray.get(ref)
        except ray.exceptions.RayError as exc:
            budget = self.cfg.run.actor_restarts_per_hour
            recent = self.restarts_last_hour()
            log.error("rollout actor %d failed (%d restarts in the last hour, budget %d): %s",
                      index, recent, budget, exc)
            self.control.publish_error("rollout_actor_failed", f"rollout actor {index}: {exc}")
            if recent >= budget:
                raise RuntimeError(f"rollout actor {index} failed and {recent} restarts in the "
                                   f"last hour used run.actor_restarts_per_hour={budget}") from exc
            self.restarts += 1
            self.restart_times.append(time.time())
            ray.kill(self.rollouts[index])
            self._close_books(self.owners[index], "actor_crashed")
            self.spawn_rollout(index)
            return
        if not stats.get("tasks_exhausted"):
            raise RuntimeError(f"rollout actor {index} returned before stop: {stats}")
        log.info("rollout actor %d played every epoch of its tasks (%d rounds)", index,
                 stats["rounds"])
        self.exhausted.add(index)

    def _restart_learner(self, model_id: str, cause: Exception):
        """A learner's process died: Ray restarts the actor (fresh, at v0); it continues from
        its newest checkpoint, its buffer rolls back the samples the lost steps had taken
        (restarted over its log), the clock goes back to that version. Returns the new `run`."""
        self.learner_restarts[model_id] = self.learner_restarts.get(model_id, 0) + 1
        if self.learner_restarts[model_id] > self.cfg.run.learner_restarts:
            raise RuntimeError(f"learner {model_id} died again after "
                               f"run.learner_restarts={self.cfg.run.learner_restarts} "
                               "restarts") from cause
        started = time.time()
        log.error("learner %s died (%s); restarting it from its newest checkpoint", model_id,
                  cause)
        self.control.publish_error("learner_restarted", f"learner {model_id}: {cause}")
        learner, buffer = self.learners[model_id], self.buffers[model_id]
        found = complete_checkpoints(self.run_dir / "checkpoints" / model_id)
        version = found[-1] if found else 0
        leave_resume_file(self.run_dir / "buffer" / model_id, version)
        before = self.buffer_incarnations[model_id]
        ray.kill(buffer, no_restart=False)  # Ray restarts it over its log, rolling back
        deadline = time.monotonic() + 300
        while self._buffer_call(model_id, "incarnation") == before:
            if time.monotonic() > deadline:
                raise RuntimeError(f"buffer {model_id} did not restart for the learner's "
                                   "rollback within 300 s") from cause
            time.sleep(0.5)
        self.buffer_incarnations[model_id] = self._buffer_call(model_id, "incarnation")
        held = self._buffer_call(model_id, "held_units")
        ray.get(self.clock.rewind.remote(model_id, version, held))
        # Ray is re-creating the learner (building a model takes a while)
        self._call_until_up(learner, "progress", what=f"learner {model_id}",
                            limit_s=deadline - time.monotonic())
        ray.get(learner.restore.remote(str(self.run_dir / "checkpoints" / model_id /
                                           f"v{version}") if found else None))
        self.control.rewound(model_id, version)
        resend_coach_requests(self.run_dir, self.coach,
                              set(self._buffer_call(model_id, "pending_step_ids")), resend=True)
        self.learner_recoveries.append({"model": model_id, "version": version,
                                        "seconds": time.time() - started,
                                        "recovery": self._buffer_call(model_id, "recovery")})
        log.warning("learner %s continues from v%d (%.1f s)", model_id, version,
                    time.time() - started)
        return learner.run.remote(self.cfg.run.max_steps)

    def _retire(self, index: int, ref) -> None:
        """A scaled-down actor finished draining: settle its rounds, end the actor."""
        since = self.draining.pop(index)
        actor = self.rollouts.pop(index)
        try:
            stats = ray.get(ref)
            self.retired_episodes += stats["episodes"]
            reason = "scaled_down"
        except ray.exceptions.RayError as exc:  # it died while draining: settled as a crash
            log.error("rollout actor %d failed while draining: %s", index, exc)
            reason = "actor_crashed"
        ray.kill(actor)
        self._close_books(self.owners.pop(index), reason)
        log.info("rollout actor %d removed after %.1f s of draining", index, time.time() - since)

    def _close_books(self, owner: str | None, reason: str) -> None:
        freed = close_books(self.clock, self.buffers, self.readiness, owner, reason)
        self.crashed_units = _add_counts([self.crashed_units, freed])

    def _status(self) -> Snapshot:
        """Coach and engine supervision plus the periodic metrics; returns the counters."""
        ray.get(self.coach.check.remote())  # a coach programming error stops the run here
        self._watch_buffer_restarts()
        for es in self.engines.values():
            ray.get([e.ensure_alive.remote() for e in es])
        now = self._snapshot(coach=self._coach_metrics())
        elapsed = max(time.time() - self.started_at, 1e-9)
        episodes = self.retired_episodes + sum(s["episodes"] for s in now.rollouts)
        rate = self.control.episodes_per_s(episodes, now.at)
        scalars = {
            "perf/episodes_per_s": episodes / elapsed,
            "perf/episodes_per_s_last_min": rate,
            "perf/rollout_actors": float(len(self.rollouts) - len(self.draining)),
            "perf/admission_waits": float(sum(s["admission_waits"] for s in now.rollouts)),
        }
        for name, stats in now.engines.items():
            for key in ("restarts", "busy_probes", "port_moves", "last_progress_age_s"):
                scalars[f"perf/engines/{name}/{key}"] = float(stats[key])
        self.metrics.scalars.remote(scalars)
        self.control.publish_status(now, rate)
        return now

    def _snapshot(self, coach: dict | None = None) -> Snapshot:
        """Every part's counters now (for the stall watchdog); `coach` if already fetched."""
        learners = [self._progress(m) for m in self.learners]
        return Snapshot(
            at=time.time(),
            learners=dict(zip(self.learners, learners)),
            buffers={m: asdict(self._buffer_call(m, "stats")) for m in self.buffers},
            clock=ray.get(self.clock.snapshot.remote()),
            coach=coach if coach is not None else ray.get(self.coach.stats.remote()),
            rollouts=self._rollout_stats(),
            engines=self._engine_stats())

    def _watch_buffer_restarts(self) -> None:
        """A buffer Ray restarted came back from its log with rows still pending whose coach
        scores were lost with the old process: ask the coach for them again, once."""
        seen = self.buffer_incarnations
        current = {m: self._buffer_call(m, "incarnation") for m in self.buffers}
        self.buffer_incarnations = current
        for model_id, incarnation in current.items():
            if incarnation == seen[model_id]:
                continue
            self.buffer_restarts[model_id] = self.buffer_restarts.get(model_id, 0) + 1
            pending = set(self._buffer_call(model_id, "pending_step_ids"))
            sent = resend_coach_requests(self.run_dir, self.coach, pending, resend=True)
            log.warning("buffer %s was restarted and recovered from its log: %s; %d of %d "
                        "pending rows sent to the coach again", model_id,
                        self._buffer_call(model_id, "recovery"), sent, len(pending))
            self.control.publish_error("buffer_restarted", f"buffer {model_id} recovered "
                                       f"from its log; {sent} coach requests re-sent")

    def _buffer_call(self, model_id: str, method: str, *args, limit_s: float = 180.0):
        """Call a buffer, waiting while Ray restarts it (a call in flight at its crash
        fails; later ones queue until it has recovered from its log)."""
        return self._call_until_up(self.buffers[model_id], method, *args,
                                   what=f"buffer {model_id}", limit_s=limit_s)

    @staticmethod
    def _call_until_up(actor, method: str, *args, what: str, limit_s: float):
        """`ray.get(actor.method(*args))`, retried every second for `limit_s` while the
        actor's process is dead and Ray restarts it; then the actor's error is raised."""
        deadline = time.monotonic() + limit_s
        while True:
            try:
                return ray.get(getattr(actor, method).remote(*args))
            except ACTOR_GONE as exc:
                if time.monotonic() > deadline:
                    raise
                log.warning("%s unavailable (%s); waiting for its restart", what,
                            type(exc).__name__)
                time.sleep(1.0)

    def _progress(self, model_id: str) -> dict:
        """A learner's progress; while its process is dead or restarting, the last one seen."""
        try:
            progress = ray.get(self.learners[model_id].progress.remote())
        except ACTOR_GONE:
            return self.last_progress.get(model_id, {"version": 0, "in_step_s": 0.0})
        self.last_progress[model_id] = progress
        return progress

    def _rollout_stats(self) -> list[dict]:
        """Stats of the live rollout actors; a dead one is skipped here (its `run` reference
        reports the death to `wait`, which replaces it and settles its rounds)."""
        stats = []
        for index, actor in self.rollouts.items():
            try:
                stats.append(ray.get(actor.stats.remote()))
            except ACTOR_GONE:
                log.info("rollout actor %d is dead; wait() replaces it", index)
        return stats

    def _engine_stats(self) -> dict[str, dict]:
        names = [f"{m}-{i}" for m, es in self.engines.items() for i in range(len(es))]
        stats = ray.get([e.stats.remote() for es in self.engines.values() for e in es])
        return dict(zip(names, stats))

    def _watch_stall(self, now: Snapshot) -> None:
        """Stop the run with a diagnosis when no learner stepped for run.stall_timeout_s."""
        timeout = self.cfg.run.stall_timeout_s
        if not timeout:
            return
        if now.versions() != self.stall_base.versions() or self.control.paused:
            self.stall_base = now
            return
        if now.at - self.stall_base.at < timeout:
            return
        batch_units = {m: mc.learner.batch_units for m, mc in self.cfg.models.items()}
        message = diagnose(self.stall_base, now, batch_units)
        log.error("run stalled: %s", message)
        raise RuntimeError(f"run stalled ({self.cfg.run.stall_timeout_s:.0f} s, "
                           f"run.stall_timeout_s): {message}")

    def _coach_metrics(self) -> dict:
        """`coach/…` scalars and per-agent score histograms; returns the pool's stats."""
        coach, histograms = ray.get([self.coach.stats.remote(), self.coach.histograms.remote()])
        self.metrics.scalars.remote({f"coach/{k}": v for k, v in coach.items()})
        self.status_ticks += 1
        for key, values in histograms.items():
            self.metrics.histogram.remote(f"coach/{key}", values, self.status_ticks)
        return coach

    def finish(self) -> dict:
        """Stop rollouts, drain buffers, account for every row; returns the summary."""
        self.state = "stopping"
        self._watch_buffer_restarts()  # one that restarted since the last status round
        rollout_stats = ray.get([r.stop.remote() for r in self.rollouts.values()])
        self._close_books(None, "run_stopped")  # rounds cut off while shipping
        learner = {m: ray.get(w.summary.remote()) for m, w in self.learners.items()}
        drained = {m: ray.get(b.drain.remote("run_stopped")) for m, b in self.buffers.items()}
        buffers = {m: asdict(ray.get(b.stats.remote())) for m, b in self.buffers.items()}
        ledger = asdict(ray.get(self.clock.ledger_stats.remote()))
        engines = self._engine_stats()
        summary = {
            "run_id": self.run_id, "run_dir": str(self.run_dir),
            "wall_s": time.time() - self.started_at, "learners": learner,
            "rollouts": rollout_stats, "buffers": buffers, "drained": drained,
            "coach": self._coach_metrics(), "actor_restarts": self.restarts,
            "control": {"commands": self.control.commands, "refused": self.control.refused,
                        "scaling": self.control.scaling, "stop_reason": self.control.stop_reason,
                        "staleness_changes": self.control.staleness_changes,
                        "staleness_windows": self.control.pilot.windows,
                        "bus": self.bus.stats() if self.bus else {}},
            "engines": engines,
            "engine_restarts": sum(e["restarts"] for e in engines.values()),
            "buffer_restarts": dict(self.buffer_restarts),
            "learner_restarts": dict(self.learner_restarts),
            "learner_recoveries": self.learner_recoveries,
            "resumed": asdict(self.resume_plan) if self.resume_plan else None,
            "dtypes": {m: {"engine": mc.engine.dtype, "learner": mc.learner.dtype}
                       for m, mc in self.cfg.models.items()},
            "rows": {**row_accounting(ledger, buffers),
                     "crashed_actor_units": self.crashed_units},
            "ledger": ledger,
            "metrics": ray.get(self.metrics.counts.remote()),
            "tensorboard_keys": ray.get(self.metrics.close.remote()),
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        self.state = "finished"
        self.control.publish_steps(force=True)  # steps of the last second before the stop
        self.control.publish_status()
        return summary

    def shutdown(self) -> None:
        """Stop engine servers, then end every actor of this run (the Ray session stays)."""
        for es in self.engines.values():
            for e in es:
                try:
                    ray.get(e.stop.remote(), timeout=30)
                except ray.exceptions.RayError as exc:  # logged: the server may already be gone
                    log.warning("engine stop failed: %s", exc)
        actors = [e for es in self.engines.values() for e in es]
        actors += list(self.rollouts.values())
        for name in ("learners", "buffers"):
            actors += list(getattr(self, name, {}).values())
        actors += [getattr(self, name) for name in ("coach", "clock", "metrics")
                   if hasattr(self, name)]
        for actor in actors:
            ray.kill(actor)
        if self.bus is not None:
            self.bus.stop()


def resolve_dtypes(cfg: TroupeConfig) -> None:
    """Turn every `dtype: auto` into this machine's choice (runtime/dtype.py), logged once."""
    for model_id, mc in cfg.models.items():
        device = mc.engine.device
        mc.engine = dataclasses.replace(
            mc.engine, dtype=resolve_dtype(mc.engine.dtype, device, f"{model_id} engine"))
        if mc.learner.backend == "torch" and mc.learner.dtype == "auto":
            # The plain torch learner steps AdamW on the weights themselves: in bf16 most
            # updates at RL learning rates round away (megatron keeps fp32 main weights).
            log.info("dtype auto for %s learner -> float32: the torch backend has no fp32 "
                     "main weights", model_id)
            mc.learner.dtype = "float32"
        mc.learner.dtype = resolve_dtype(mc.learner.dtype, device, f"{model_id} learner")


def apply_run_seed(cfg: TroupeConfig) -> None:
    """`run.seed` offsets every part's own seed: task streams, learners, engine sampling."""
    seed = cfg.run.seed
    if not seed:
        return
    cfg.rollout.seed += seed
    for mc in cfg.models.values():
        mc.learner.seed += seed
        mc.engine = dataclasses.replace(mc.engine, random_seed=(mc.engine.random_seed or 0) + seed)


def _pad_id(model_path: str) -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id


def run(cfg: TroupeConfig, resume: bool = False) -> dict:
    """Run training to completion (or continue one, `resume`); returns the summary (also in
    runs/<id>/summary.json)."""
    run_ = Run(cfg, resume)
    try:
        run_.start()
        run_.wait()
        return run_.finish()
    finally:
        run_.shutdown()
