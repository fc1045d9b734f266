"""One SGLang server process per engine: launch, supervision, restart, weight updates (DESIGN §7).

`SGLangEngine` is a plain class; `runtime` wraps it as a Ray actor. It owns the server
subprocess (its own process group, so the scheduler and detokenizer children die with it),
the log file, and the version of the weights the server holds. Rollout actors never talk to
this class on the hot path: they call the server's HTTP API through `EngineClient`.
`ensure_alive` tells a slow server from a dead one with `actors.engines.supervision`.

Tiny CPU check (starts a server on the tiny model, prints its URL, stops it):
    python -c "from runtime.models import provision_tiny; \
from actors.engines.sglang import SGLangEngine, EngineConfig; \
e = SGLangEngine('tiny', provision_tiny(), EngineConfig(max_total_tokens=4096)); \
print(e.start()); e.stop()"
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import httpx

from actors.engines.supervision import (
    ProgressWatch, RestartBudget, UpdateGate, free_port, is_zombie, port_is_free,
)

log = logging.getLogger(__name__)

_DEVICES = ("cpu", "cuda")
_DTYPES = ("float32", "bfloat16", "float16", "auto")
# How a weight update meets the requests in flight. "continue": pause them in place, load,
# continue them on the new weights (their `weight_versions` spans record the switch; the
# load takes ~0.1 s). "drain": SGLang's plain update, which waits until every request in
# flight has finished and holds new ones meanwhile (measured: 7.4 s with 8 long requests).
_WEIGHT_UPDATES = ("continue", "drain")
_LOG_TAIL_CHARS = 4000
_BUSY_LOG_EVERY_S = 30.0  # rate limit of each failed-probe warning (busy / no progress)

# Linux: the server gets SIGKILL when the thread that launched it dies, even by SIGKILL (a
# Ray actor killed by its node), so no server outlives its engine. Set in a small launcher
# that then execs the server (the setting survives exec), which avoids an unsafe preexec_fn
# in a threaded actor. argv[1] is the launcher's expected parent pid: if that parent died
# before prctl ran, the launcher exits instead of serving an orphan.
_REAP_WAIT_S = 10.0  # a dying server's threads unwind before it can be reaped


_LAUNCHER = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit('launcher: parent died before the server started')\n"
    "os.execv(sys.executable, [sys.executable, '-m', 'sglang.launch_server', *sys.argv[2:]])\n"
)


@dataclass(frozen=True)
class EngineConfig:
    """How one SGLang server is launched and supervised."""

    device: str = "cpu"  # "cpu" (transformers model impl, torch attention) or "cuda"
    # serving dtype; float32 keeps logprobs within ~1e-5 of the learner; "auto" (the run
    # default) is resolved by the runtime to bf16 where the machine has it natively
    dtype: str = "float32"
    max_total_tokens: int = 8192  # KV-cache token slots; bounds server memory (~GBs if unset)
    context_length: int | None = None  # prompt + response limit; None = the model's config
    mem_fraction_static: float | None = None  # cuda only: GPU memory share for weights + KV
    tp_size: int = 1  # cuda only: tensor-parallel GPUs per server
    random_seed: int | None = None  # server sampling seed; None lets SGLang choose
    startup_timeout_s: float = 240.0  # launch until /health answers 200 (CPU: 30-60 s)
    weight_update_timeout_s: float = 600.0  # one /update_weights_from_disk call
    weight_update: str = "continue"  # "continue" or "drain": see _WEIGHT_UPDATES
    extra_args: list[str] = field(default_factory=list)  # appended verbatim to launch_server
    log_dir: str | None = None  # server logs; None = a fresh temp dir per engine
    probe_timeout_s: float = 5.0  # one /health probe of ensure_alive (SGLang answers in >= 1 s)
    # A live server whose probes fail is restarted only after this long without progress
    # (CPU time of its processes): a 2-core CPU decoding a big batch can miss probes for
    # minutes, and restarting it then fails every request in flight.
    unresponsive_s: float = 180.0
    max_restarts_per_hour: int = 3  # ensure_alive raises on a restart beyond this rate
    # Block the idle scheduler on its sockets instead of spinning: an idle server otherwise
    # keeps one core at 100 % (measured: 31 s of CPU in 30 s idle, 1 s with the flag), which
    # on a 2-core machine starves every other process of the run.
    sleep_on_idle: bool = True

    def __post_init__(self) -> None:
        if self.device not in _DEVICES:
            raise ValueError(f"EngineConfig.device={self.device!r}; use one of {_DEVICES}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"EngineConfig.dtype={self.dtype!r}; use one of {_DTYPES}")
        if self.max_total_tokens < 64:
            raise ValueError(
                f"EngineConfig.max_total_tokens={self.max_total_tokens} cannot hold a request; "
                "use at least the longest prompt + response (thousands in practice)"
            )
        if self.context_length is not None and self.context_length > self.max_total_tokens:
            raise ValueError(
                f"EngineConfig.context_length={self.context_length} exceeds max_total_tokens="
                f"{self.max_total_tokens}; raise max_total_tokens or lower context_length"
            )
        if self.device == "cpu" and (self.mem_fraction_static is not None or self.tp_size != 1):
            raise ValueError(
                "EngineConfig.mem_fraction_static / tp_size apply to device='cuda' only; "
                f"got mem_fraction_static={self.mem_fraction_static}, tp_size={self.tp_size} "
                "with device='cpu': remove them"
            )
        if self.weight_update not in _WEIGHT_UPDATES:
            raise ValueError(f"EngineConfig.weight_update={self.weight_update!r}; use one of "
                             f"{_WEIGHT_UPDATES} ('continue' keeps requests running across "
                             "an update, 'drain' waits for them to finish first)")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(
                f"EngineConfig.mem_fraction_static={self.mem_fraction_static}; use (0, 1)"
            )
        for name in ("startup_timeout_s", "weight_update_timeout_s", "probe_timeout_s",
                     "unresponsive_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"EngineConfig.{name}={getattr(self, name)}; use positive "
                                 "seconds")
        if self.max_restarts_per_hour < 0:
            raise ValueError(f"EngineConfig.max_restarts_per_hour={self.max_restarts_per_hour}"
                             "; use >= 0 (0 = never restart)")


# What the server's HTTP front (uvicorn) logs when its port is taken, before it exits.
_BIND_FAILED = "address already in use"
_PORT_ATTEMPTS = 3  # starts in a row, each on a fresh port, before a taken port is an error


def serialize_weights(named_tensors) -> str:
    """HF-named CPU tensors as a `/update_weights_from_tensor` payload of shared-memory handles.

    Sets torch's "file_system" sharing strategy in the calling process (the default one
    crashes the server's scheduler on CPU). Keep the tensors alive until the load returns.
    """
    import torch.multiprocessing
    from sglang.srt.utils import MultiprocessingSerializer

    torch.multiprocessing.set_sharing_strategy("file_system")
    return MultiprocessingSerializer.serialize(list(named_tensors), output_str=True)


class _PortTaken(RuntimeError):
    """The server exited during startup because another process held its port."""


def _kill_process_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM (then SIGCONT) the server's process group, wait, then SIGKILL what is left.

    A module-level function (not a method) so `weakref.finalize` can call it without
    keeping the engine alive.
    """
    pgid = proc.pid  # start_new_session=True made the server its own group leader
    try:
        os.killpg(pgid, signal.SIGTERM)
        os.killpg(pgid, signal.SIGCONT)  # a stopped server handles SIGTERM only once resumed
    except ProcessLookupError:
        return  # the whole group is already gone
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        log.warning("server pid %d ignored SIGTERM for %.0f s; killing", pgid, grace_s)
    # Children (scheduler, detokenizer) can outlive the parent; kill the group regardless.
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # every member exited on SIGTERM: nothing left to kill
    proc.wait()


class SGLangEngine:
    """Supervises one `sglang.launch_server` subprocess serving one model.

    Args:
        model_id: physical model name (DESIGN §3 `model_id`), used in logs and file names.
        model_path: HF folder with config, safetensors and tokenizer (see runtime.models).
        cfg: launch and supervision settings.
        log_dir: where the server log goes; overrides `cfg.log_dir`.

    The tokenizer always comes from `model_path`; weights come from the last folder loaded
    with `update_weights_from_disk`, so a restart resumes the same weights and version.
    """

    def __init__(self, model_id: str, model_path: str | Path, cfg: EngineConfig,
                 log_dir: str | Path | None = None) -> None:
        self.model_id = model_id
        self.model_path = Path(model_path)
        self.cfg = cfg
        chosen = log_dir or cfg.log_dir
        self.log_dir = Path(chosen) if chosen else Path(tempfile.mkdtemp(prefix="troupe-engine-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.log_dir / f"sglang-{model_id}.log"
        self.weights_path = self.model_path  # folder of the weights a (re)start loads
        self.disk_version = 0  # the version of that folder
        self.weight_version = 0  # the version served (newer after a tensor update)
        self.restarts = 0  # total over the engine's life
        self.busy_probes = 0  # failed probes of a live server that was making progress
        # weight updates applied while requests ran, whose prefix cache the server could not
        # flush then (flushed later): cached prefixes of the old weights may serve a while
        self.unflushed_updates = 0
        self.startup_seconds: float | None = None  # duration of the last successful start
        self.port_moves = 0  # starts that found their port taken and moved to another
        self.updates = 0  # weight updates answered by the server (restarts not counted)
        self.update_seconds = 0.0  # their total time, pause and continue included
        # restarts that asked the weights source for a folder of the served version, and
        # those that got none and came back on older weights (a logged error each)
        self.restart_folders = 0
        self.behind_restarts = 0
        self._weights_source = None  # the learner actor of this model (set_weights_source)
        self._port: int | None = None
        self._proc: subprocess.Popen | None = None
        self._finalizer: weakref.finalize | None = None
        self._http = httpx.Client(timeout=httpx.Timeout(10.0))
        # The runtime's actor runs methods on several threads (health checks beside weight
        # updates); lifecycle changes take this lock so two callers never restart twice.
        self._lifecycle = threading.RLock()
        self._gate = UpdateGate(self._lifecycle)  # weight updates vs. supervision
        self._restart_budget = RestartBudget()
        self._progress = ProgressWatch()  # of a server whose probes fail (ensure_alive)
        self._last_log = {"busy": -_BUSY_LOG_EVERY_S, "idle": -_BUSY_LOG_EVERY_S}

    # ------------------------------------------------------------------ lifecycle

    @property
    def url(self) -> str:
        """Base URL of the running server, e.g. `http://127.0.0.1:31234`."""
        if self._port is None:
            raise RuntimeError(f"engine {self.model_id} has not been started; call start()")
        return f"http://127.0.0.1:{self._port}"

    @property
    def pid(self) -> int | None:
        """Pid of the server's main process (its process group id), None when stopped."""
        return self._proc.pid if self._proc is not None else None

    def start(self) -> str:
        """Launch the server and block until `/health` answers; returns the base URL."""
        with self._lifecycle:
            return self._start()

    def _start(self) -> str:
        if self.cfg.dtype == "auto":  # SGLang's own "auto" would serve fp32 weights in fp16
            raise ValueError(
                f"engine {self.model_id}: EngineConfig.dtype='auto' reached the engine "
                "unresolved; the runtime resolves it (runtime.dtype.resolve_dtype) — outside "
                "a run pass 'float32' or 'bfloat16'")
        if self._proc is not None and self._proc.poll() is None:
            raise RuntimeError(f"engine {self.model_id} already running at {self.url}")
        if self._port is None:
            self._port = free_port()
        for attempt in range(1, _PORT_ATTEMPTS + 1):
            try:
                return self._launch()
            except _PortTaken as taken:
                if attempt == _PORT_ATTEMPTS:
                    raise RuntimeError(
                        f"engine {self.model_id}: {_PORT_ATTEMPTS} ports in a row were taken "
                        f"by another process before the server bound them (last "
                        f"{self._port}); log tail ({self.log_path}):\n{taken}") from None
                old, self._port = self._port, free_port()
                self.port_moves += 1
                log.warning("engine %s: port %d was taken before the server bound it; "
                            "starting again on port %d (move %d)", self.model_id, old,
                            self._port, self.port_moves)
        raise AssertionError("unreachable")

    def _launch(self) -> str:
        """Start the server process on `self._port` and wait until it answers."""
        args = self._server_args()
        shown = "python -m sglang.launch_server " + " ".join(args)
        if sys.platform == "linux":
            cmd = [sys.executable, "-c", _LAUNCHER, str(os.getpid()), *args]
        else:
            cmd = [sys.executable, "-m", "sglang.launch_server", *args]
        env = dict(os.environ, HF_HUB_OFFLINE="1")  # models are local; never reach a hub
        log.info("starting %s: %s (log %s)", self.model_id, shown, self.log_path)
        with open(self.log_path, "ab") as log_file:
            log_file.write(f"\n==== start {time.strftime('%F %T')} {shown}\n".encode())
            log_file.flush()
            log_from = log_file.tell()
            self._proc = subprocess.Popen(
                cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )
        # Runs on stop(), garbage collection or interpreter exit, whichever comes first.
        self._finalizer = weakref.finalize(self, _kill_process_group, self._proc)
        started = time.perf_counter()
        self._wait_healthy(log_from)
        self.weight_version = self.disk_version
        self.startup_seconds = time.perf_counter() - started
        self._progress.answered(self.pid)
        log.info("%s ready at %s in %.1f s", self.model_id, self.url, self.startup_seconds)
        return self.url

    def stop(self) -> None:
        """Terminate the server and all its children; safe to call twice."""
        with self._lifecycle:
            if self._finalizer is not None:
                self._finalizer()  # calls _kill_process_group once, then detaches
                self._finalizer = None
            self._proc = None

    def close(self) -> None:
        """Stop the server and release the HTTP client."""
        self.stop()
        self._http.close()

    def is_alive(self) -> bool:
        """Whether the process runs and `/health` answers 200 within `cfg.probe_timeout_s`."""
        if self._proc is None or self._proc.poll() is not None:
            return False
        failure = self._probe()
        if failure is not None:
            log.warning("%s %s", self.model_id, failure)
        return failure is None

    def ensure_alive(self) -> str:
        """Restart the server if it is dead; returns the (maybe new) URL.

        Dead means: the process exited (restart at once), or its probes fail and its
        processes made no progress for `cfg.unresponsive_s` (a slow, busy server is left
        alone). While a weight update is in flight this returns at once: the server is busy
        loading, and the update restarts it itself if it died. The restart reuses the port
        when it is free again, so clients keep their URL, and reloads the last weights with
        their version. Raises beyond `cfg.max_restarts_per_hour`.
        """
        if not self._gate.acquire_unless_updating():
            log.debug("%s: weight update in flight: busy, not probed", self.model_id)
            return self.url
        try:
            return self._ensure_alive()
        finally:
            self._lifecycle.release()

    def set_weights_source(self, learner) -> None:
        """The learner actor (`runtime.learner_worker.LearnerWorker`) a restart asks for a
        folder of the newest weights.

        The server loads weights at start from a folder, but tensor updates leave the
        served version only in memory: without a source a restart would come back on the
        last folder, up to `weights_to_disk_every` versions old.
        """
        self._weights_source = learner

    def stats(self) -> dict:
        """Supervision counters for the run summary and TensorBoard (all numbers)."""
        return {"restarts": self.restarts, "restarts_last_hour": self._restart_budget.recent(),
                "busy_probes": self.busy_probes, "port_moves": self.port_moves,
                "unflushed_updates": self.unflushed_updates, "updates": self.updates,
                "restart_folders": self.restart_folders,
                "behind_restarts": self.behind_restarts,
                "update_seconds": self.update_seconds,
                "last_progress_age_s": time.monotonic() - self._progress.last_progress,
                "weight_version": self.weight_version,
                "pid": self.pid or 0}  # the server's process group (0 when stopped)

    def _ensure_alive(self) -> str:
        if self._proc is None:
            return self._restart("is not running")
        code = self._exit_code()
        if code is not None:
            return self._restart(f"exited with code {code}")
        failure = self._probe()
        if failure is None:
            self._progress.answered(self.pid)
            return self.url
        code = self._exit_code()
        if code is not None:  # it died (or is dying) while we probed
            return self._restart(f"exited with code {code} ({failure})")
        if self._is_stalled(failure):
            idle_s = time.monotonic() - self._progress.last_progress
            return self._restart(f"{failure}; no progress for {idle_s:.0f} s")
        return self.url

    def _exit_code(self) -> int | None:
        """The server's exit code, waiting briefly for one that is already dying.

        A killed multi-threaded process shows as a zombie in /proc while its other threads
        still unwind, and only then can it be reaped: `poll()` alone would call such a
        server live-but-unresponsive and leave it for `cfg.unresponsive_s`.
        """
        code = self._proc.poll()
        if code is not None or not is_zombie(self._proc.pid):
            return code
        try:
            return self._proc.wait(timeout=_REAP_WAIT_S)
        except subprocess.TimeoutExpired:
            log.warning("engine %s: main process is a zombie but not reapable after %.0f s",
                        self.model_id, _REAP_WAIT_S)
            return -1

    def _is_stalled(self, failure: str) -> bool:
        """After a failed probe of a live process: whether it made no progress for too long.

        A probe that fails while the server is busy (uses CPU) counts in `busy_probes`.
        """
        now = time.monotonic()
        sampled = self._progress.sample(self.pid, now)
        idle_s = now - self._progress.last_progress
        if idle_s >= self.cfg.unresponsive_s:
            log.error("engine %s: %s; no progress for %.0f s: restarting", self.model_id,
                      failure, idle_s)
            return True
        if self._progress.busy:
            self.busy_probes += 1
        if sampled is None:
            return False
        # Each verdict has its own rate limit, so a switch between them is always logged.
        verdict = "busy" if self._progress.busy else "idle"
        if now - self._last_log[verdict] >= _BUSY_LOG_EVERY_S:
            self._last_log[verdict] = now
            if verdict == "busy":
                log.warning("engine %s: probe timed out but server is busy (cpu +%.1f s in "
                            "%.1f s): %s", self.model_id, *sampled, failure)
            else:
                log.warning("engine %s: %s; no progress for %.0f s (restart after %.0f s)",
                            self.model_id, failure, idle_s, self.cfg.unresponsive_s)
        return False

    def _restart(self, reason: str, served: int | None = None) -> str:
        """Stop what is left of the server and start it on the newest weights: the last
        folder, or, when the server served a newer version (`served`: the one being loaded
        when it died) from memory, a folder of it asked from the weights source."""
        if not self._restart_budget.take(self.cfg.max_restarts_per_hour):
            raise RuntimeError(
                f"engine {self.model_id} is down ({reason}) and was already restarted "
                f"{self._restart_budget.recent()} times in the last hour "
                f"(EngineConfig.max_restarts_per_hour={self.cfg.max_restarts_per_hour}); "
                f"log tail ({self.log_path}):\n{self.log_tail()}"
            )
        log.warning("engine %s %s; restart %d (%d in the last hour, at most %d)",
                    self.model_id, reason, self.restarts + 1, self._restart_budget.recent(),
                    self.cfg.max_restarts_per_hour)
        self.stop()
        self.restarts += 1
        self._newest_folder(max(self.weight_version, served or 0))
        if not self._wait_port_free(self._port, timeout_s=15.0):
            old = self._port
            self._port = free_port()
            log.warning("port %s still taken; %s moves to port %d", old, self.model_id,
                        self._port)
        return self._start()

    def _newest_folder(self, served: int) -> None:
        """Point the next start at a folder of version `served` or newer when the last
        folder is older: asked of the weights source (which writes it), waiting at most
        `cfg.weight_update_timeout_s`. Without one, the restart serves the older folder: a
        logged, counted outcome (`behind_restarts`), whose rows may come back too stale."""
        if served <= self.disk_version:
            return
        import ray

        try:
            if self._weights_source is None:
                raise LookupError("no weights source is set (set_weights_source)")
            path, version = ray.get(self._weights_source.weights_folder.remote(),
                                    timeout=self.cfg.weight_update_timeout_s)
        except (LookupError, ray.exceptions.RayError) as err:
            self.behind_restarts += 1
            log.error("engine %s: served v%d from memory, but restarts on the folder of "
                      "v%d: no newer folder (%r)", self.model_id, served, self.disk_version,
                      err)
            return
        self.restart_folders += 1
        self.weights_path, self.disk_version = Path(path), int(version)
        log.warning("engine %s: served v%d from memory; restarts on the folder of v%d (%s)",
                    self.model_id, served, self.disk_version, path)

    # ------------------------------------------------------------------ weights

    def update_weights_from_disk(self, path: str | Path, version: int) -> dict:
        """Load HF safetensors from `path` into the running server and stamp `version`.

        Args:
            path: complete HF model folder (config.json + safetensors) readable by the server.
            version: learner version; responses report it as `weight_version`.

        Returns:
            The server's answer: `success`, `message`, `num_paused_requests`.
        """
        with self._gate.updating():  # takes `_lifecycle`; ensure_alive passes over it
            return self._load_weights(Path(path), version)

    def update_weights_from_tensor(self, named_tensors: list[tuple[str, "torch.Tensor"]],
                                   version: int) -> dict:
        """Load HF-named tensors from this process's memory into the running server.

        `serialize_weights` turns them into shared-memory handles; see
        `update_weights_from_payload`, which the learner calls from its own process.
        """
        return self.update_weights_from_payload(serialize_weights(named_tensors), version)

    def update_weights_from_payload(self, payload: str, version: int) -> dict:
        """Load weights sent as `serialize_weights(...)` from a process on this host.

        The tensors travel as shared-memory handles (torch's "file_system" sharing, the one
        strategy that does not crash the server's scheduler on CPU), between the server's
        `/begin_weight_update` and `/end_weight_update`; the sender keeps them alive until
        this returns. The server keeps no folder of these weights: a restart serves the last
        folder and says so with its version (`disk_version`).
        `scripts/bench_weights.py` measures it against `update_weights_from_disk`.
        """
        def send() -> httpx.Response:
            self._control("begin_weight_update", {})
            try:
                return self._paused_post("update_weights_from_tensor", {
                    "serialized_named_tensors": [payload], "weight_version": str(version)})
            finally:
                self._control("end_weight_update", {})

        with self._gate.updating():
            return self._apply_update(send, None, version)

    def node_id(self) -> str:
        """The Ray node this engine runs on ("" outside Ray): tensor sync needs the same host."""
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""

    def _paused_post(self, endpoint: str, payload: dict) -> httpx.Response:
        """POST an update; in "continue" mode with generation paused in place around it."""
        paused = self.cfg.weight_update == "continue" and self._control(
            "pause_generation", {"mode": "in_place"})
        try:
            return self._http.post(f"{self.url}/{endpoint}", json=payload,
                                   timeout=self.cfg.weight_update_timeout_s)
        finally:
            if paused:  # never leave a server paused, whatever the update did
                self._control("continue_generation", {})

    def _load_weights(self, path: Path, version: int) -> dict:
        """update_weights_from_disk under the lifecycle lock (paused around it in "continue")."""
        return self._apply_update(lambda: self._paused_post("update_weights_from_disk", {
            "model_path": str(path), "weight_version": str(version)}), path, version)

    def _apply_update(self, send: Callable[[], httpx.Response], path: Path | None,
                      version: int) -> dict:
        """One weight update (`send` posts it): the server's answer checked and counted.

        A server found dead meanwhile is restarted instead of failing the learner step: on
        folder `path` as `version` when the update was one, else on its last folder.
        """
        started = time.perf_counter()
        try:
            response = send()
        except httpx.TransportError as err:
            if self.is_alive():
                raise
            if path is not None:
                self.weights_path = path
                self.disk_version = self.weight_version = version
            self._restart(f"unreachable during weight update ({err!r})", served=version)
            return {"success": True, "num_paused_requests": 0,
                    "message": f"restarted on the folder of v{self.disk_version}",
                    "update_s": time.perf_counter() - started}
        body = self._update_answer(response, path, version)
        body["update_s"] = time.perf_counter() - started
        self.updates += 1
        self.update_seconds += body["update_s"]
        return body

    def _control(self, endpoint: str, payload: dict) -> bool:
        """POST a pause/continue control call; True, or RuntimeError naming the answer."""
        response = self._http.post(f"{self.url}/{endpoint}", json=payload,
                                   timeout=self.cfg.weight_update_timeout_s)
        if response.status_code != 200:
            raise RuntimeError(f"engine {self.model_id}: /{endpoint} answered HTTP "
                               f"{response.status_code}: {response.text[:500]}")
        return True

    def _update_answer(self, response: httpx.Response, path: Path | None, version: int) -> dict:
        """The server's answer to an update, checked; the engine then serves `version`
        (from folder `path`; None: from memory, and a restart serves the last folder)."""
        self._progress.answered(self.pid)  # it answered, whatever it said
        body = response.json() if response.headers.get("content-type", "").startswith(
            "application/json") else {"message": response.text}
        if "cache was not flushed" in str(body.get("message", "")):
            # The server loaded the weights but kept its prefix cache because requests were
            # running (always so in "continue" mode under load): cached prompt prefixes of
            # older weights may serve new requests until they are evicted or a flush finds
            # the server idle. The rows still carry the logprobs they were sampled with, so
            # the behaviour correction stays exact.
            self.unflushed_updates += 1
            if self.unflushed_updates in (1, 10) or self.unflushed_updates % 100 == 0:
                log.warning("engine %s: v%d loaded, prefix cache not flushed (requests "
                            "running); %d such updates", self.model_id, version,
                            self.unflushed_updates)
            flushed = self._http.post(f"{self.url}/flush_cache", timeout=30)
            body = {"success": True, "message": body.get("message"),
                    "cache_flushed": flushed.status_code == 200}
        elif response.status_code != 200 or not body.get("success", False):
            raise RuntimeError(
                f"engine {self.model_id} refused weights {path} (version {version}): "
                f"HTTP {response.status_code}: {body.get('message', body)}"
            )
        if path is not None:
            self.weights_path, self.disk_version = path, version
        self.weight_version = version
        return body

    # ------------------------------------------------------------------ internals

    def _server_args(self) -> list[str]:
        """launch_server arguments for the current weights, version and port."""
        cfg = self.cfg
        cmd = [
            "--model-path", str(self.weights_path),
            "--tokenizer-path", str(self.model_path),
            "--host", "127.0.0.1", "--port", str(self._port),
            "--dtype", cfg.dtype,
            "--max-total-tokens", str(cfg.max_total_tokens),
            "--weight-version", str(self.disk_version),
            "--served-model-name", self.model_id,
        ]
        if cfg.device == "cpu":
            # The only combination that serves on CPU with PyPI wheels: the native model
            # path needs vllm, the default attention and sampling backends need CUDA kernels.
            cmd += ["--device", "cpu", "--model-impl", "transformers",
                    "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
                    "--disable-cuda-graph", "--skip-server-warmup"]
        else:
            cmd += ["--device", "cuda", "--tp-size", str(cfg.tp_size)]
            if cfg.mem_fraction_static is not None:
                cmd += ["--mem-fraction-static", str(cfg.mem_fraction_static)]
        if cfg.sleep_on_idle:
            cmd += ["--sleep-on-idle"]
        if cfg.context_length is not None:
            cmd += ["--context-length", str(cfg.context_length)]
        if cfg.random_seed is not None:
            cmd += ["--random-seed", str(cfg.random_seed)]
        return cmd + list(cfg.extra_args)

    def _probe(self, timeout_s: float | None = None) -> str | None:
        """None when `/health` answers 200 in time (`cfg.probe_timeout_s`), else what failed."""
        try:
            response = self._http.get(f"{self.url}/health",
                                      timeout=timeout_s or self.cfg.probe_timeout_s)
        except httpx.TransportError as err:  # the caller counts it as a failed probe
            return f"health probe failed: {err!r}"
        return None if response.status_code == 200 else (
            f"health probe answered HTTP {response.status_code}")

    def _wait_healthy(self, log_from: int = 0) -> None:
        """Poll `/health` until 200; on exit or timeout, kill and raise with the log tail.

        An exit whose log (from byte `log_from`, this start's output) says the port was
        taken raises `_PortTaken`, which `_start` answers with a new port.
        """
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while time.monotonic() < deadline:
            code = self._proc.poll()
            if code is not None:
                self.stop()
                if _BIND_FAILED in self._log_since(log_from):
                    raise _PortTaken(self.log_tail())
                raise RuntimeError(
                    f"engine {self.model_id} exited with code {code} during startup; "
                    f"log tail ({self.log_path}):\n{self.log_tail()}"
                )
            # Failing (not listening yet) is the normal state of the first seconds. Not
            # cfg.probe_timeout_s: SGLang's /health takes >= 1 s and tests set that lower.
            if self._probe(timeout_s=5.0) is None:
                return
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(
            f"engine {self.model_id} not healthy after {self.cfg.startup_timeout_s:.0f} s "
            f"(raise EngineConfig.startup_timeout_s if the machine is busy); "
            f"log tail ({self.log_path}):\n{self.log_tail()}"
        )

    @staticmethod
    def _wait_port_free(port: int | None, timeout_s: float) -> bool:
        """Wait until `port` can be bound again after the old server released it."""
        if port is None:
            return False
        deadline = time.monotonic() + timeout_s
        while not port_is_free(port):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.5)
        return True

    def _log_since(self, offset: int) -> str:
        """The server log from byte `offset` on (one start's output)."""
        try:
            with open(self.log_path, "rb") as file:
                file.seek(offset)
                return file.read().decode(errors="replace")
        except OSError as err:
            return f"<log unreadable: {err}>"

    def log_tail(self, chars: int = _LOG_TAIL_CHARS) -> str:
        """Last `chars` characters of the server log (for error messages)."""
        if not self.log_path.exists():
            return "<no log written>"
        with open(self.log_path, "rb") as file:
            file.seek(max(0, self.log_path.stat().st_size - chars))
            return file.read().decode(errors="replace")
