"""The controller: creates and wires every actor, supervises them, stops the run.

It is the only place that calls `ray.remote` (STYLE §1). Order: dtype → run directory → control
bus (runtime/bus_service.py) → Ray → metrics → engines (wait for health) → buffers, clock,
coach pool → learners → rollout actors. It then watches: a learner failure or a coach
programming error stops the run with its cause; a failed rollout actor is replaced (it is
stateless) within `run.actor_restarts_per_hour`, its open rounds reconciled with the ledger;
commands from the bus are applied between supervision rounds (runtime/control.py), and every
learner step, version and status goes out as an event; engines are probed and restarted when dead (slow is not
dead: actors/engines/sglang.py); no learner step for `run.stall_timeout_s` stops the run
naming the stuck stage (runtime/stall.py). Every call to an actor has a timeout: a slow
part is counted and its last answer kept, a hung one stops the run (runtime/supervise.py).
When every learner reached `run.max_steps` it
stops the rollouts, drains the buffers and writes `summary.json` with the row accounting:
the ledger's generated rows (counted before shipping, buffers/ledger.py) must equal the
buffers' trained + dropped rows plus the ledger's lost rows.
"""
from __future__ import annotations

import dataclasses
import functools
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
from runtime.supervise import (ENGINE_STOP_TIMEOUT_S, LEARNER_STOP_TIMEOUT_S, READY_TIMEOUT_S,
                               SETUP_TIMEOUT_S, Answers, Calls, Poller, SlowCalls,
                               engine_restart_s, get_within)

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
        self.slow_calls = SlowCalls(cfg.run.call_timeout_s, cfg.run.unanswered_timeout_s)
        self.poller = Poller(self.slow_calls)  # every supervision call, with its timeout

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
        urls = {m: get_within([e.start.remote() for e in es],
                              engine_restart_s(cfg.models[m].engine), f"engines of {m} (start)")
                for m, es in self.engines.items()}
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
        # a restarting engine asks its learner for a folder of the newest weights
        get_within([e.set_weights_source.remote(self.learners[m])
                    for m, es in self.engines.items() for e in es], SETUP_TIMEOUT_S,
                   "engines (weights source)")
        self.urls = urls
        self.buffer_incarnations = {m: get_within(b.incarnation.remote(), SETUP_TIMEOUT_S,
                                                  f"buffer {m} (recovering its log)")
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
                        # re-raises a learner's error: the run stops
                        summary = get_within(ref, READY_TIMEOUT_S, f"learner {model_id} (result)")
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
                self._join_learners(pending_learners)
                break
            if self.exhausted and not self.rollout_refs:
                log.warning("every rollout actor played all workflow.tasks.epochs=%d: stopping "
                            "the learners (rows not yet trained are counted as run_stopped)",
                            self.cfg.workflow.tasks.epochs)
                for w in self.learners.values():
                    w.stop.remote()
                self._join_learners(pending_learners)
                break
            if time.time() - last_status > 5:
                self._watch_stall(self._status())
                last_status = time.time()
            wall = self.cfg.run.max_wall_s
            if wall and time.time() - self.started_at > wall:
                log.warning("run.max_wall_s=%s reached: stopping", wall)
                for w in self.learners.values():
                    w.stop.remote()
                self._join_learners(pending_learners)
                break

    def _join_learners(self, pending: dict) -> None:
        """Wait for the stopped learners' `run` calls (each ends its step, maybe writes a
        checkpoint); re-raises a learner's error."""
        get_within(list(pending), LEARNER_STOP_TIMEOUT_S,
                   f"learners {sorted(pending.values())} (stopping)")

    def _on_rollout_exit(self, ref) -> None:
        index = self.rollout_refs.pop(ref)
        if index in self.draining:
            self._retire(index, ref)
            return
        try:
            stats = get_within(ref, READY_TIMEOUT_S, f"rollout actor {index} (result)")
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
            self.poller.forget(self.owners[index])
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
        self.poller.wait(("clock", "rewind"),
                         lambda: self.clock.rewind.remote(model_id, version, held))
        # Ray is re-creating the learner (building a model takes a while)
        self.poller.wait_until_up(learner, "progress", what=f"learner-{model_id}",
                                  limit_s=deadline - time.monotonic())
        get_within(learner.restore.remote(str(self.run_dir / "checkpoints" / model_id /
                                              f"v{version}") if found else None),
                   SETUP_TIMEOUT_S, f"learner {model_id} (restoring v{version})")
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
            stats = get_within(ref, READY_TIMEOUT_S, f"rollout actor {index} (result)")
            self.retired_episodes += stats["episodes"]
            reason = "scaled_down"
        except ray.exceptions.RayError as exc:  # it died while draining: settled as a crash
            log.error("rollout actor %d failed while draining: %s", index, exc)
            reason = "actor_crashed"
        ray.kill(actor)
        self.poller.forget(self.owners[index])
        self._close_books(self.owners.pop(index), reason)
        log.info("rollout actor %d removed after %.1f s of draining", index, time.time() - since)

    def _close_books(self, owner: str | None, reason: str) -> None:
        freed = close_books(self.clock, self.buffers, self.readiness, owner, reason)
        self.crashed_units = _add_counts([self.crashed_units, freed])

    def _status(self) -> Snapshot:
        """One supervision round: the coach's health, buffer restarts, engine health, every
        part's counters and the periodic metrics; returns the counters. All its calls go out
        at once and are waited for together, at most `run.call_timeout_s` (runtime/supervise.py:
        a slow part's last answer stands)."""
        checks = {("coach", "check"): self.coach.check.remote,
                  ("coach", "histograms"): self.coach.histograms.remote,
                  **self._incarnation_calls(), **self._engine_calls("ensure_alive")}
        # A restarting engine's ensure_alive stays pending across rounds for up to its restart
        # time: the round does not wait for it, so learners and rollouts stay supervised.
        limits = {(f"engine-{name}", "ensure_alive"): max(
            engine_restart_s(self.cfg.models[m].engine), self.cfg.run.unanswered_timeout_s)
            for name, m, _ in self._named_engines()}
        answers = self.poller.poll({**checks, **self._snapshot_calls()}, limits)
        answers.get(("coach", "check"))  # a coach programming error stops the run here
        self._watch_buffer_restarts(answers)
        for call in self._engine_calls("ensure_alive"):
            answers.get(call)  # a dead engine actor, or one past its restart budget, stops it
        now = self._snapshot(answers)
        self._coach_metrics(answers)
        elapsed = max(time.time() - self.started_at, 1e-9)
        episodes = self.retired_episodes + sum(s["episodes"] for s in now.rollouts)
        rate = self.control.episodes_per_s(episodes, now.at)
        scalars = {
            "perf/episodes_per_s": episodes / elapsed,
            "perf/episodes_per_s_last_min": rate,
            "perf/rollout_actors": float(len(self.rollouts) - len(self.draining)),
            "perf/admission_waits": float(sum(s["admission_waits"] for s in now.rollouts)),
            **self.slow_calls.scalars(),
        }
        for name, stats in now.engines.items():
            for key in ("restarts", "behind_restarts", "busy_probes", "port_moves",
                        "last_progress_age_s"):
                scalars[f"perf/engines/{name}/{key}"] = float(stats[key])
        self.metrics.scalars.remote(scalars)
        self.control.publish_status(now, rate)
        return now

    def _named_engines(self) -> list[tuple[str, str, object]]:
        """(name, model id, actor) of every engine; names as in the summary, `policy-0`."""
        return [(f"{m}-{i}", m, e) for m, es in self.engines.items() for i, e in enumerate(es)]

    def _engine_calls(self, method: str) -> Calls:
        return {(f"engine-{name}", method): getattr(e, method).remote
                for name, _, e in self._named_engines()}

    def _incarnation_calls(self) -> Calls:
        return {(f"buffer-{m}", "incarnation"): b.incarnation.remote
                for m, b in self.buffers.items()}

    def _snapshot_calls(self) -> Calls:
        """The calls behind a `Snapshot`: every part's counters."""
        calls = {(f"learner-{m}", "progress"): w.progress.remote
                 for m, w in self.learners.items()}
        calls.update({(f"buffer-{m}", "stats"): b.stats.remote for m, b in self.buffers.items()})
        calls[("clock", "snapshot")] = self.clock.snapshot.remote
        calls[("coach", "stats")] = self.coach.stats.remote
        calls.update({(self.owners[i], "stats"): a.stats.remote for i, a in self.rollouts.items()})
        calls.update(self._engine_calls("stats"))
        return calls

    def _snapshot(self, answers: Answers | None = None) -> Snapshot:
        """Every part's counters (for the stall watchdog) from a round's `answers`: a slow
        part's last answer stands, a dead one is handled as its kind needs. Without `answers`
        every part is asked and waited for (the first snapshot: later rounds fall back on it)."""
        if answers is None:
            answers = self.poller.poll(self._snapshot_calls(), wait_all=True)
        buffers = {m: self._buffer_stats(m, answers) for m in self.buffers}
        return Snapshot(
            at=time.time(),
            learners={m: self._progress(m, answers) for m in self.learners},
            buffers={m: asdict(s) for m, s in buffers.items() if s is not None},
            clock=answers.get(("clock", "snapshot"), {}),
            coach=answers.get(("coach", "stats"), {}),
            rollouts=self._rollout_stats(answers),
            engines=self._engine_stats(answers))

    def _watch_buffer_restarts(self, answers: Answers) -> None:
        """A buffer Ray restarted came back from its log with rows still pending whose coach
        scores were lost with the old process: ask the coach for them again, once."""
        seen = self.buffer_incarnations
        current = {}
        for model_id in self.buffers:
            try:  # slow: the restart (if any) is seen in a later round
                current[model_id] = answers.get((f"buffer-{model_id}", "incarnation"),
                                                seen[model_id])
            except ACTOR_GONE:  # Ray is restarting it: wait for the new incarnation
                current[model_id] = self._buffer_call(model_id, "incarnation")
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
        return self.poller.wait_until_up(self.buffers[model_id], method, *args,
                                         what=f"buffer-{model_id}", limit_s=limit_s)

    def _buffer_stats(self, model_id: str, answers: Answers):
        """A buffer's stats; while Ray restarts it, waited for (`_buffer_call`)."""
        try:
            return answers.get((f"buffer-{model_id}", "stats"))
        except ACTOR_GONE:
            return self._buffer_call(model_id, "stats")

    def _progress(self, model_id: str, answers: Answers) -> dict:
        """A learner's progress; while its process is dead or restarting, the last one seen."""
        try:
            progress = answers.get((f"learner-{model_id}", "progress"))
        except ACTOR_GONE:
            progress = None
        if progress is None:
            return self.last_progress.get(model_id, {"version": 0, "in_step_s": 0.0})
        self.last_progress[model_id] = progress
        return progress

    def _rollout_stats(self, answers: Answers) -> list[dict]:
        """Stats of the live rollout actors; a dead one is skipped here (its `run` reference
        reports the death to `wait`, which replaces it and settles its rounds)."""
        stats = []
        for index in self.rollouts:
            try:
                one = answers.get((self.owners[index], "stats"))
            except ACTOR_GONE:
                log.info("rollout actor %d is dead; wait() replaces it", index)
                continue
            if one is not None:  # None: slow and never answered yet
                stats.append(one)
        return stats

    def _engine_stats(self, answers: Answers) -> dict[str, dict]:
        """Every engine's counters (a dead engine actor stops the run)."""
        stats = {name: answers.get((f"engine-{name}", "stats"))
                 for name, _, _ in self._named_engines()}
        return {name: s for name, s in stats.items() if s is not None}

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

    def _coach_metrics(self, answers: Answers) -> dict:
        """`coach/…` scalars and per-agent score histograms of a round's fresh answers;
        returns the pool's stats."""
        coach = answers.get(("coach", "stats"), {})
        if ("coach", "stats") not in answers.slow:
            self.metrics.scalars.remote({f"coach/{k}": v for k, v in coach.items()})
        if ("coach", "histograms") not in answers.slow:
            self.status_ticks += 1
            for key, values in answers.get(("coach", "histograms"), {}).items():
                self.metrics.histogram.remote(f"coach/{key}", values, self.status_ticks)
        return coach

    def finish(self) -> dict:
        """Stop rollouts, drain buffers, account for every row; returns the summary. Its calls
        are waited for up to `run.unanswered_timeout_s` each (counted slow meanwhile)."""
        self.state = "stopping"
        gather = self.poller.gather
        # one that restarted since the last status round
        self._watch_buffer_restarts(self.poller.poll(self._incarnation_calls(), wait_all=True))
        rollout_stats = gather({(self.owners[i], "stop"): r.stop.remote
                                for i, r in self.rollouts.items()})
        self._close_books(None, "run_stopped")  # rounds cut off while shipping
        learner = dict(zip(self.learners, gather({(f"learner-{m}", "summary"): w.summary.remote
                                                  for m, w in self.learners.items()})))
        drained = dict(zip(self.buffers, gather({
            (f"buffer-{m}", "drain"): functools.partial(b.drain.remote, "run_stopped")
            for m, b in self.buffers.items()})))
        buffers = {m: asdict(s) for m, s in zip(self.buffers, gather(
            {(f"buffer-{m}", "stats"): b.stats.remote for m, b in self.buffers.items()}))}
        ledger = asdict(self.poller.wait(("clock", "ledger_stats"), self.clock.ledger_stats.remote))
        engines = self._engine_stats(self.poller.poll(self._engine_calls("stats"), wait_all=True))
        coach = self._coach_metrics(self.poller.poll(
            {("coach", "stats"): self.coach.stats.remote,
             ("coach", "histograms"): self.coach.histograms.remote}, wait_all=True))
        summary = {
            "run_id": self.run_id, "run_dir": str(self.run_dir),
            "wall_s": time.time() - self.started_at, "learners": learner,
            "rollouts": rollout_stats, "buffers": buffers, "drained": drained,
            "coach": coach, "actor_restarts": self.restarts,
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
            "metrics": self.poller.wait(("metrics", "counts"), self.metrics.counts.remote),
            "tensorboard_keys": self.poller.wait(("metrics", "close"), self.metrics.close.remote),
        }
        summary["supervision"] = self.slow_calls.summary()  # after the calls above
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
                    ray.get(e.stop.remote(), timeout=ENGINE_STOP_TIMEOUT_S)
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
