"""The learner actor of one model: pull ready units, train, publish, bump the version.

Each step: read η from the clock (its one live copy, DESIGN §5), await the oldest ready units
under that bound from the buffer (no polling: `BufferActor.sample_for_learner` waits for
arrivals and also hands back the dropped units and its counters), compute advantages
(§6), run the backend's `train_step` (proximal logprobs + decoupled PPO with the behaviour
correction), bring every engine of the model to version v+1 (a HF safetensors folder they
load, or the tensors through shared memory where they share this host: `weight_sync`), and
tell the clock. Every `checkpoint_every` steps (or on request) the learner's state goes to
`checkpoints/<model>/v<N>/` with the clock's counters (DESIGN §10); `restore` resumes from one.
Blocking compute runs in a worker thread so the actor keeps answering while it trains.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
from collections import Counter, defaultdict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray

from learners.prepare import prepare_batch
from learners.config import LearnerConfig
from learners.protocol import build_learner
from actors.engines.sglang import serialize_weights
from runtime.failures import ACTOR_GONE
from runtime.logs import configure_logging

log = logging.getLogger("troupe.learner")

BUFFER_RESTART_S = 180.0  # how long calls to a buffer being restarted by Ray are retried


SYNC_TRIALS = 2  # weight_sync auto: timed syncs per path before the faster one is kept


class SyncTrial:
    """`weight_sync: auto` with every engine local: which path brings weights over faster.

    The first syncs alternate disk and tensor (disk first) until each has `trials` timings
    (syncs that had to write a folder count for disk); then the faster median is `choice`
    for the rest of the run.
    """

    def __init__(self, trials: int = SYNC_TRIALS) -> None:
        self.trials = trials
        self.seconds: dict[str, list[float]] = {"disk": [], "tensor": []}
        self.choice: str | None = None

    def use_tensor(self) -> bool:
        """Whether the next sync goes as tensors (decides once both paths have their trials)."""
        if self.choice is None and min(map(len, self.seconds.values())) >= self.trials:
            medians = self.medians()
            self.choice = "tensor" if medians["tensor"] < medians["disk"] else "disk"
        if self.choice is not None:
            return self.choice == "tensor"
        return len(self.seconds["tensor"]) < len(self.seconds["disk"])

    def record(self, tensor: bool, seconds: float) -> None:
        self.seconds["tensor" if tensor else "disk"].append(seconds)

    def medians(self) -> dict[str, float]:
        return {path: float(np.median(t)) for path, t in self.seconds.items() if t}

    def summary(self) -> dict:
        return {"path": self.choice, "trials": self.trials,
                **{f"{p}_s": round(m, 4) for p, m in self.medians().items()}}


@dataclass(frozen=True)
class LearnerPeers:
    """The actor handles one learner talks to (STYLE §2: one typed bundle, not a list)."""

    buffer: Any  # this model's BufferActor (runtime/buffer_actor.py)
    clock: Any  # the run's VersionClock actor (buffers/clock.py)
    engines: list  # SGLangEngine actors serving this model (actors/engines/sglang.py)
    metrics: Any  # the run's MetricsWriter actor (runtime/metrics.py)


@dataclass(frozen=True)
class LearnerFiles:
    """Where a learner writes and how much it keeps."""

    run_dir: str  # runs/<run_id>: weights/, checkpoints/, logs/ of the run
    pad_id: int  # the tokenizer's pad id (batches are padded with it)
    keep_weights: int = 3  # published weight versions kept on disk
    checkpoint_every: int = 0  # learner steps between checkpoints (0: only on request / stop)
    keep_checkpoints: int = 2  # checkpoints kept (older ones are deleted)


class LearnerWorker:
    """Drives one model's learner; `runtime.controller` wraps it as a Ray actor."""

    def __init__(self, model_id: str, cfg: LearnerConfig, model_path: str,
                 peers: LearnerPeers, files: LearnerFiles) -> None:
        configure_logging()  # this actor's process: the first call in it configures
        self.model_id = model_id
        self.cfg = cfg
        self.buffer = peers.buffer
        self.clock = peers.clock
        self.engines = peers.engines
        self.metrics = peers.metrics
        self.keep_weights = files.keep_weights
        self.pad_id = files.pad_id
        run_dir = files.run_dir
        self.weights_dir = Path(run_dir) / "weights" / model_id
        self.checkpoints_dir = Path(run_dir) / "checkpoints" / model_id
        self.checkpoint_every = files.checkpoint_every
        self.keep_checkpoints = files.keep_checkpoints
        self._checkpoint_requested = False
        self.checkpoints: list[dict] = []  # (version, seconds, path) of checkpoints written
        # one line per step: the step_ids it trained (and a marker at each resume), so "no row
        # is trained twice" can be counted from the run directory (runtime/resume.py)
        self.audit_path = Path(run_dir) / "logs" / f"trained_{model_id}.jsonl"
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # the per-step progress line says what matters
        self.learner = build_learner(cfg, model_id, model_path, str(self.weights_dir))
        self.max_staleness = cfg.initial_staleness  # the clock's value at the last sample (logged)
        self.version = 0
        self.rows_trained = 0
        self.busy_s = 0.0
        self.wait_s = 0.0
        self.last_wait_s = 0.0  # the wait for the batch of the step in progress
        self.last_sync_s = 0.0  # weights written + loaded by the engines, last step
        self.disk_version = 0  # the newest version published as a folder
        self.tensor_syncs = 0  # steps whose weights went as shared-memory tensors
        self.restart_folders = 0  # folders written for a restarting engine (weights_folder)
        # held while the parameters change (a train step) or a folder is written: a folder
        # asked for by a restarting engine never holds half a step
        self._weights_lock = asyncio.Lock()
        # "disk", "tensor", or "trial" while auto times both; None until the first sync
        self._sync_path: str | None = None
        self._sync_trial: SyncTrial | None = None  # auto with local engines: the timing
        self.staleness_sum = 0  # Σ staleness over every trained row (the run's mean)
        self.started_at = time.time()
        self.last_weights: str | None = None
        self.history: list[tuple[float, int, float]] = []  # (step end time, rows, busy s)
        self.steps: deque[dict] = deque(maxlen=256)  # recent step records (events/step)
        self.buffer_retries = 0  # buffer calls retried while Ray restarted the buffer
        self.calls: Counter[str] = Counter()  # remote calls this learner made, by callee
        self.buffer_stats = None  # the buffer's counters as of the last sample
        self._stop = False
        self._step_started: float | None = None  # wall time the running step began

    def stop(self, checkpoint: bool = False) -> None:
        """End `run` after the step in progress; with `checkpoint`, write one first."""
        self._stop = True
        self._checkpoint_requested = self._checkpoint_requested or checkpoint

    def request_checkpoint(self) -> None:
        """Checkpoint after the step in progress (or the next one when idle)."""
        self._checkpoint_requested = True

    async def run(self, max_steps: int) -> dict:
        """Train until `max_steps` learner steps (or `stop`); returns the summary."""
        self.started_at = time.time()
        while self.version < max_steps and not self._stop:
            batch = await self._next_batch()
            if batch is None:
                break
            await self._step(batch)
            due = self.checkpoint_every and self.version % self.checkpoint_every == 0
            if due or self._checkpoint_requested or self.version == max_steps:
                await self.checkpoint()
        if self._checkpoint_requested:  # a stop with checkpoint arrived between steps
            await self.checkpoint()
        await self.finish_weights()  # the run's last weights exist as a folder
        return self.summary()

    async def _next_batch(self):
        waited = time.perf_counter()
        while not self._stop:
            if self._checkpoint_requested:
                await self.checkpoint()
                continue  # a stop may have come in meanwhile
            # η is read from the clock each time: a live change applies to this sampling
            self.calls["clock"] += 1
            self.max_staleness = await self.clock.max_staleness.remote(self.model_id)
            sample = await self._buffer("sample_for_learner", self.cfg.batch_units,
                                        self.version, self.max_staleness, 1.0)
            batch, self.buffer_stats = sample.batch, sample.stats
            if sample.dropped_units:
                self.calls["clock"] += 1
                await self.clock.release.remote(self.model_id, sample.dropped_units)
            if batch is not None:
                self.last_wait_s = time.perf_counter() - waited
                self.wait_s += self.last_wait_s
                return batch
        return None

    async def checkpoint(self) -> str:
        """Write `checkpoints/<model>/v<version>/` (learner state + clock counters), atomically.

        The folder is built under a temporary name and renamed when complete, and
        `checkpoint.json` is written last inside it, so a crash mid-save leaves the previous
        checkpoint the newest complete one. Older checkpoints beyond `keep_checkpoints` go.
        """
        self._checkpoint_requested = False
        started = time.perf_counter()
        final = self.checkpoints_dir / f"v{self.version}"
        tmp = self.checkpoints_dir / f".v{self.version}.partial"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        await asyncio.to_thread(self.learner.save, str(tmp / "learner"))
        self.calls["clock"] += 1
        clock = await self.clock.state.remote()
        meta = {"model_id": self.model_id, "version": self.version,
                "rows_trained": self.rows_trained, "busy_s": self.busy_s,
                "wait_s": self.wait_s, "staleness_sum": self.staleness_sum,
                "written_at": time.time(), "clock": clock}
        (tmp / "checkpoint.json").write_text(json.dumps(meta, indent=2))
        if final.exists():  # the same version again (a requested checkpoint at a due step)
            shutil.rmtree(final)
        os.replace(tmp, final)
        # samples below this version are final now: the buffer's log stops keeping them for undo
        await self._buffer("settle_samples", self.version)
        seconds = time.perf_counter() - started
        self.checkpoints.append({"version": self.version, "seconds": seconds,
                                 "path": str(final)})
        self.calls["metrics"] += 1
        self.metrics.scalars.remote({f"perf/{self.model_id}/checkpoint_s": seconds},
                                    self.version)
        log.info("[%s] checkpoint v%d written in %.1f s: %s", self.model_id, self.version,
                 seconds, final)
        for old in sorted(complete_checkpoints(self.checkpoints_dir))[:-self.keep_checkpoints]:
            shutil.rmtree(self.checkpoints_dir / f"v{old}")
        return str(final)

    async def restore(self, path: str | None) -> dict:
        """Resume from a checkpoint folder written by `checkpoint` (None: from the initial
        weights, version 0); engines get its weights.

        Returns the checkpoint's metadata (the controller restores the clock from it).
        """
        if path is None:
            meta = {"version": 0}
        else:
            meta = json.loads((Path(path) / "checkpoint.json").read_text())
            if meta["model_id"] != self.model_id:
                raise ValueError(f"checkpoint {path} belongs to model {meta['model_id']!r}, "
                                 f"not {self.model_id!r}")
            await asyncio.to_thread(self.learner.load, str(Path(path) / "learner"))
            self.rows_trained = int(meta["rows_trained"])
            self.busy_s, self.wait_s = float(meta["busy_s"]), float(meta["wait_s"])
            self.staleness_sum = int(meta["staleness_sum"])
        self.version = int(meta["version"])
        # published versions from the checkpoint's on died with the run (or are republished
        # now): the resumed lineage writes them afresh
        for old in self.weights_dir.glob("v*"):
            if old.name[1:].isdigit() and int(old.name[1:]) >= self.version:
                shutil.rmtree(old)
        # engines restart from the base weights: they must serve the checkpoint's version
        self.last_weights = None  # its folder, if any, was removed above
        await self._sync_weights(to_disk=True)
        self._audit({"resumed_from": self.version, "at": time.time()})
        log.info("[%s] restored v%d from %s", self.model_id, self.version, path)
        return meta

    async def _step(self, batch) -> None:
        start = time.perf_counter()
        self._step_started = time.time()
        table = batch.table
        # advantages (with the reference KL in the reward when reward_kl_beta > 0) and tensors
        train_batch, advantages, extra = await asyncio.to_thread(
            prepare_batch, self.learner, self.cfg, table, self.pad_id)
        async with self._weights_lock:
            train = await asyncio.to_thread(self.learner.train_step, train_batch)
            self.version += 1
        train.update(extra)
        sync_start = time.perf_counter()
        publish_s = await self._sync_weights(
            to_disk=self.version % self.cfg.weights_to_disk_every == 0)
        self.last_sync_s = time.perf_counter() - sync_start  # write or send, + load
        self.calls["clock"] += 1
        await self.clock.set_version.remote(self.model_id, self.version)
        step_s = time.perf_counter() - start
        self.busy_s += step_s
        self.rows_trained += table.num_rows
        self.staleness_sum += int(np.sum(batch.staleness))
        self._audit({"version": self.version, "at": time.time(),
                     "max_staleness": self.max_staleness,
                     "staleness_max": int(np.max(batch.staleness)),
                     "step_ids": table.column("step_id").to_pylist()})
        self.history.append((time.time(), table.num_rows, step_s))
        self._step_started = None
        self._prune_weights()
        await self._log(batch, advantages, train, step_s, publish_s)

    async def _sync_weights(self, to_disk: bool) -> float:
        """Bring this model's engines to `self.version`; returns the engines' load seconds.

        By folder (`publish_weights`, then every engine loads it), or, where tensor sync is
        on, as shared-memory tensors, with a folder anyway when `to_disk`.
        """
        started = time.perf_counter()
        tensor = not to_disk and await self._tensor_sync()
        if tensor:
            state = await asyncio.to_thread(self.learner.hf_state_dict)
            payload = await asyncio.to_thread(serialize_weights, state.items())
            load_start = time.perf_counter()
            self.calls["engines"] += len(self.engines)
            await asyncio.gather(*(e.update_weights_from_payload.remote(payload, self.version)
                                   for e in self.engines))
            del state  # the engines copied the tensors: the shared memory may go now
            self.tensor_syncs += 1
        else:
            path, _, _ = await self._write_folder()
            load_start = time.perf_counter()
            self.calls["engines"] += len(self.engines)
            await asyncio.gather(*(e.update_weights_from_disk.remote(path, self.version)
                                   for e in self.engines))
        done = time.perf_counter()
        if self._sync_path == "trial":
            self._sync_trial.record(tensor, done - started)
        return done - load_start

    async def _write_folder(self) -> tuple[str, int, bool]:
        """The folder of the current version, that version, and whether this call wrote it:
        published unless it is already (versions are immutable); one writer at a time,
        never mid-step."""
        async with self._weights_lock:
            if self.disk_version == self.version and self.last_weights is not None:
                return self.last_weights, self.version, False
            ref = await asyncio.to_thread(self.learner.publish_weights, self.version)
            self.last_weights, self.disk_version = ref.path, self.version
            return ref.path, self.version, True

    async def weights_folder(self) -> tuple[str, int]:
        """The folder of this learner's current weights and its version, written now if
        tensor sync left them only in memory.

        A restarting engine asks for it (`SGLangEngine.set_weights_source`): its server
        loads weights from a folder, and the last folder may be `weights_to_disk_every`
        steps old; rows sampled on those would come back too stale to train.
        """
        path, version, wrote = await self._write_folder()
        if wrote:
            self.restart_folders += 1
            log.info("[%s] v%d written for a restarting engine", self.model_id, version)
        return path, version

    async def _tensor_sync(self) -> bool:
        """Whether this step's weights go as tensors.

        `weight_sync: tensor` or `disk` decide. "auto": disk unless every engine runs on
        this learner's host (asked once); if they do, `SyncTrial` times both paths on the
        first steps and keeps the faster. Which is faster depends on the model size and what
        the engines are doing: on the tiny model in a run the folder wins, on SmolLM2-135M
        with an idle engine the tensors (scripts/bench_weights.py).
        """
        if self._sync_path is None:
            self._sync_path = await self._first_sync_path()
        if self._sync_path != "trial":
            return self._sync_path == "tensor"
        trial = self._sync_trial
        tensor = trial.use_tensor()
        if trial.choice is not None:
            self._sync_path = trial.choice
            medians = trial.medians()
            log.info("[%s] weight sync: %s (median of %d steps each: tensor %.3f s, disk "
                     "%.3f s)", self.model_id, trial.choice, trial.trials, medians["tensor"],
                     medians["disk"])
        return tensor

    async def _first_sync_path(self) -> str:
        """"disk" or "tensor" as configured; for "auto", "disk" unless every engine runs on
        this learner's host, else "trial" (a fresh `SyncTrial`)."""
        if self.cfg.weight_sync != "auto":
            return self.cfg.weight_sync
        here = ray.get_runtime_context().get_node_id()
        self.calls["engines"] += len(self.engines)
        nodes = await asyncio.gather(*(e.node_id.remote() for e in self.engines))
        local = bool(self.engines) and all(n == here for n in nodes)
        log.info("[%s] weight sync: %s (engines on %s, learner on %s)", self.model_id,
                 "trying disk and tensor" if local else "disk", sorted(set(nodes)), here)
        if not local:
            return "disk"
        self._sync_trial = SyncTrial()
        return "trial"

    async def finish_weights(self) -> None:
        """Write the folder of the last version if tensor sync left it only in memory."""
        if self.disk_version != self.version:
            await self._sync_weights(to_disk=True)

    async def _buffer(self, method: str, *args):
        """Call the buffer, retrying while Ray restarts it after a crash of its process (it
        rebuilds itself from its log, runtime/buffer_actor.py); a buffer that stays down for
        BUFFER_RESTART_S, or is dead for good, fails the learner and with it the run."""
        deadline = time.monotonic() + BUFFER_RESTART_S
        while True:
            try:
                self.calls["buffer"] += 1
                return await getattr(self.buffer, method).remote(*args)
            except ACTOR_GONE as exc:
                if time.monotonic() > deadline:
                    raise
                self.buffer_retries += 1  # counted in the summary
                log.warning("[%s] buffer unavailable (%s); retrying %s", self.model_id,
                            type(exc).__name__, method)
                await asyncio.sleep(1.0)

    def _audit(self, record: dict) -> None:
        self.audit_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.audit_path, "a", encoding="utf-8") as out:
            out.write(json.dumps(record) + "\n")

    def _prune_weights(self) -> None:
        versions = sorted((int(p.name[1:]), p) for p in self.weights_dir.glob("v*")
                          if p.name[1:].isdigit())
        for _, path in versions[:-self.keep_weights]:
            shutil.rmtree(path, ignore_errors=False)

    async def _log(self, batch, advantages, train: dict, step_s: float,
                   publish_s: float) -> None:
        m, v = self.model_id, self.version
        table = batch.table
        scalars = {f"train/{m}/{k}": float(val) for k, val in train.items()}
        staleness = np.asarray(batch.staleness)
        scalars.update({
            f"staleness/{m}/mean": float(staleness.mean()),
            f"staleness/{m}/max": float(staleness.max()),
            f"staleness/{m}/max_staleness": float(self.max_staleness),
            f"train/{m}/advantage_abs_mean": float(np.abs(advantages).mean()),
            f"train/{m}/rows": float(table.num_rows),
            f"train/{m}/version": float(v),
            f"perf/{m}/learner_step_s": step_s,
            f"perf/{m}/weight_publish_s": publish_s,
            f"perf/{m}/weight_sync_s": self.last_sync_s,
            f"perf/{m}/learner_busy_fraction": self.busy_fraction(),
            f"perf/{m}/rows_trained_per_s": self.rows_trained / self.elapsed(),
        })
        rewards = table.column("reward").to_numpy(zero_copy_only=False)
        agents = table.column("agent").to_pylist()
        per_agent: dict[str, list[float]] = defaultdict(list)
        for agent, reward in zip(agents, rewards):
            per_agent[agent].append(float(reward))
        for agent, values in per_agent.items():
            scalars[f"reward/{agent}/mean"] = float(np.mean(values))
        # train["tokens"] is the batch's response-token count (the loss mask's sum).
        scalars[f"behavior/{m}/response_len_mean"] = train["tokens"] / table.num_rows
        stats = self.buffer_stats  # as the sample that fed this step left the buffer
        scalars.update({
            f"buffer/{m}/pending_rows": float(stats.pending_rows),
            f"buffer/{m}/ready_rows": float(stats.ready_rows),
            f"buffer/{m}/rows_trained": float(stats.rows_trained),
            **{f"buffer/{m}/dropped_{k}": float(n) for k, n in stats.dropped.items()},
        })
        self.calls["metrics"] += 2  # the scalars and the histogram below
        self.metrics.scalars.remote(scalars, v)
        self.steps.append({
            "model": m, "version": v, "loss": round(float(train.get("loss", float("nan"))), 5),
            "rows": table.num_rows, "staleness_mean": round(float(staleness.mean()), 3),
            "staleness_max": int(staleness.max()), "max_staleness": self.max_staleness,
            "step_s": round(step_s, 3), "sync_s": round(self.last_sync_s, 3),
            "wait_s": round(self.last_wait_s, 3),
            "ready_wait_s": round(unit_ready_wait_s(batch), 3), "at": time.time(),
            **{f"reward/{a}": round(float(np.mean(x)), 4) for a, x in sorted(per_agent.items())}})
        self.metrics.histogram.remote(f"staleness/{m}/histogram", staleness.tolist(), v)
        reward_text = " ".join(f"{a}={np.mean(x):.3f}" for a, x in sorted(per_agent.items()))
        log.info("[%s] step %d | loss %.4f | %s | stale mean %.2f | clip %.3f | w %.3f | "
                 "busy %.0f%% | %.1fs", m, v, train.get("loss", float("nan")), reward_text,
                 staleness.mean(), train.get("clip_fraction", float("nan")),
                 train.get("importance_weight_mean", float("nan")),
                 100 * self.busy_fraction(), step_s)

    def elapsed(self) -> float:
        return max(time.time() - self.started_at, 1e-9)

    def busy_fraction(self) -> float:
        return self.busy_s / self.elapsed()

    def progress(self) -> dict:
        """Version and how long the current step has run (0 between steps): the stall watch."""
        started = self._step_started
        return {"version": self.version, "pid": os.getpid(),
                "in_step_s": 0.0 if started is None else time.time() - started}

    def steps_since(self, version: int) -> list[dict]:
        """Step records newer than `version` (the controller publishes them on events/step)."""
        return [s for s in self.steps if s["version"] > version]

    def summary(self) -> dict:
        return {"model_id": self.model_id, "version": self.version,
                "rows_trained": self.rows_trained, "busy_s": self.busy_s,
                "wait_s": self.wait_s, "elapsed_s": self.elapsed(),
                "busy_fraction": self.busy_fraction(), "weights": self.last_weights,
                "tensor_syncs": self.tensor_syncs, "restart_folders": self.restart_folders,
                "weight_sync": (self._sync_trial.summary() if self._sync_trial is not None
                                and self._sync_trial.choice is not None else None),
                "staleness_mean": self.staleness_sum / max(self.rows_trained, 1),
                "actor_calls": dict(self.calls),
                "actor_calls_per_step": sum(self.calls.values()) / max(self.version, 1),
                "checkpoints": list(self.checkpoints), "buffer_retries": self.buffer_retries,
                "history": list(self.history)}


def unit_ready_wait_s(batch) -> float:
    """Mean over the batch's units of (unit READY − its last row's creation): what a unit
    waited for rewards (the coach) after its round had generated it. 0 for an empty batch."""
    if not len(batch.unit_ready_at):
        return 0.0
    created = batch.table.column("created_at").to_numpy().view(np.int64) / 1e6
    last_created = np.maximum.reduceat(created, batch.unit_offsets[:-1])
    return float(np.mean(np.maximum(batch.unit_ready_at - last_created, 0.0)))


def complete_checkpoints(folder: Path) -> list[int]:
    """Versions of the complete checkpoints in `folder` (with their checkpoint.json)."""
    if not folder.is_dir():
        return []
    return sorted(int(p.name[1:]) for p in folder.glob("v*")
                  if p.name[1:].isdigit() and (p / "checkpoint.json").is_file())


def trained_twice(audit_path: str | Path) -> tuple[int, int]:
    """(rows trained, rows trained more than once) along the run's surviving lineage.

    Steps logged after a checkpoint and before a crash died with the run: at each resume
    marker the steps above its version are discarded, then every step_id is counted once per
    surviving step that trained it.
    """
    steps: list[tuple[int, list[str]]] = []
    with open(audit_path, encoding="utf-8") as audit:
        for line in audit:
            if not line.endswith("\n"):
                break  # torn by a kill: that step's publish never completed either
            record = json.loads(line)
            if "resumed_from" in record:
                steps = [(v, ids) for v, ids in steps if v <= record["resumed_from"]]
            else:
                steps.append((record["version"], record["step_ids"]))
    seen: dict[str, int] = {}
    for _, ids in steps:
        for step_id in ids:
            seen[step_id] = seen.get(step_id, 0) + 1
    return len(seen), sum(1 for n in seen.values() if n > 1)
