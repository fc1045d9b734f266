"""Evaluate a run's weights on its workflow's eval split: greedy or pass@k, per agent.

Tiny CPU check (a 4-step run of the tiny model first, then 8 greedy eval tasks; ~2 min):
    python scripts/launch_async.py --config configs/arith_duo_tiny.yaml
    python scripts/evaluate.py --run latest --max-tasks 8
The CPU default (`make run` ends with this: the untrained model, then the latest weights on
the same engine, and the difference):
    python scripts/evaluate.py --run latest --compare-base
MAPPA A.1's evaluation (every problem sampled 4 times at temperature 0.6; its mean accuracy
is the `success` column, pass@4 is reported beside it):
    python scripts/evaluate.py --run runs/<run_id> --samples 4
On a cluster: the same command on a node with the run's GPUs free, the run directory on the
shared filesystem (`--run /shared/runs/<run_id>`); the engines use the run's engine config.

Which weights: the newest `weights/<model>/v<N>/` of every model (default), `--version N`,
`--weights [MODEL=]PATH` (a published `v<N>` folder), or `--base` (the config's model paths).
Any config field can be overridden as key=value, e.g. `workflow.tasks.eval_size=50`.

Each task is played as one episode per sample (group size 1: a tree workflow asks for one
candidate per action), at most `--concurrency` at once; every action is scored by the run's
coach. Greedy replies depend on the server's batching only through rounding: in bf16 two
greedy evaluations of 16 tasks once differed on one task (`--concurrency 1` takes batching
out of it). A workflow that consults the advisor (magrpo_code with `turns` > 1) asks the run's
`coach.advisor` here as in training; its calls, failures and latency are printed and kept
under `advisor` in the JSON, and per episode as `advisor_calls` / `advisor_latency_s`.

Output: a table on stdout, `runs/<id>/eval/<label>.json` and TensorBoard scalars in
`runs/<id>/tensorboard` at step = the weights version (0 for the base model):
`eval/<workflow>/<metric>` (the means of what the workflow's episodes return, and
`pass_at_<K>`) and `eval/<agent>/<metric>` (actions, response_len in tokens, tool_call_rate,
tool_success, coach_score). The label is `base` or `v<N>`; a sampled evaluation (K samples at
a temperature > 0) appends `_k<K>` to the label and to every metric name but `pass_at_<K>`, so
it never lands on the greedy curves.

This script holds the evaluation loop itself (it is the only caller); it drives SGLangEngine
as a plain class, without Ray: one process, one engine per model.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import re
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a bare checkout

from actors.coach import CoachFailure, build_coach  # noqa: E402
from actors.coach.advisor import Advisor  # noqa: E402
from actors.engines.client import EngineClient  # noqa: E402
from actors.engines.sglang import SGLangEngine  # noqa: E402
from actors.episode import CoachRequest, Episode, ModelRoute, SamplingParams  # noqa: E402
from actors.tasks import TaskSource  # noqa: E402
from actors.workflows import Task, build_workflow  # noqa: E402
from buffers.schema import new_id  # noqa: E402
from runtime.config import ConfigError, RunConfig, TroupeConfig, load_config  # noqa: E402
from runtime.controller import resolve_dtypes  # noqa: E402
from runtime.metrics import MetricsWriter  # noqa: E402
from runtime.models import resolve_model  # noqa: E402

log = logging.getLogger("troupe.evaluate")

MAPPA_TEMPERATURE = 0.6  # MAPPA A.1 samples every evaluation problem at this temperature
PROGRESS_EVERY_S = 10.0  # at most one progress line this often (and one at the end)
_VERSION_DIR = re.compile(r"^v(\d+)$")


class EvalError(Exception):
    """The evaluation cannot start; the message names the problem and the fix."""


@dataclass(frozen=True)
class Target:
    """The weights one evaluation plays: per model a published folder, or None (the base)."""

    label: str  # "base" or "v<N>" (+ "_k<K>" when sampled)
    step: int  # TensorBoard step: the weights version, 0 for the base model
    weights: dict[str, tuple[int, Path | None]]  # model_id -> (version, folder; None = base)


@dataclass
class Played:
    """One episode of the evaluation: the task, which sample, and what it produced."""

    task_id: str
    sample: int
    result: dict[str, float]  # what workflow.run returned
    actions: list[dict[str, Any]]  # action_rows: agent, turn, response_len, annotations
    requests: list[CoachRequest]  # the episode's coach requests, one per action
    scores: list[tuple[str, float]] = field(default_factory=list)  # (agent, coach score)


# ---------------------------------------------------------------------------- the run, weights

def find_run(spec: str, overrides: list[str]) -> Path:
    """`runs/<id>`, or `latest`: the run under run.runs_dir whose config.yaml is newest."""
    if spec != "latest":
        run_dir = Path(spec)
        if not (run_dir / "config.yaml").is_file():
            raise EvalError(f"{run_dir} is not a run directory (no config.yaml in it): pass "
                            "--run runs/<run_id>, or --run latest")
        return run_dir
    runs_dir = Path(next((o.split("=", 1)[1] for o in overrides
                          if o.startswith("run.runs_dir=")), RunConfig().runs_dir))
    configs = sorted(runs_dir.glob("*/config.yaml"), key=lambda p: p.stat().st_mtime_ns)
    if not configs:
        raise EvalError(f"--run latest: no run directory under {runs_dir}/ (none holds a "
                        "config.yaml); train one first (make run), or pass run.runs_dir=<dir>")
    return configs[-1].parent


def published(run_dir: Path, model_id: str) -> dict[int, Path]:
    """version -> folder of every complete `weights/<model>/v<N>/` (staging folders skipped)."""
    folder = run_dir / "weights" / model_id
    found = {}
    for path in folder.glob("v*"):
        match = _VERSION_DIR.match(path.name)
        if match and (path / "config.json").is_file():
            found[int(match.group(1))] = path
    return found


def choose_weights(args: argparse.Namespace, run_dir: Path, models: list[str]) -> Target:
    """The trained weights asked for (latest, --version or --weights); see the docstring."""
    if args.weights:
        return _given_weights(args.weights, models)
    chosen = {}
    for model_id in models:
        versions = published(run_dir, model_id)
        if not versions:
            raise EvalError(
                f"{run_dir} has no published weights for model {model_id!r} (no "
                f"{run_dir / 'weights' / model_id}/v<N>/): let the run finish a learner step, "
                "or evaluate the untrained model with --base")
        version = args.version if args.version is not None else max(versions)
        if version not in versions:
            raise EvalError(f"--version {version}: model {model_id!r} has versions "
                            f"{sorted(versions)} in {run_dir / 'weights' / model_id} (older ones "
                            "are pruned: run.keep_weights)")
        chosen[model_id] = (version, versions[version])
    return _target(chosen)


def _given_weights(specs: list[str], models: list[str]) -> Target:
    """`--weights PATH` (one-model runs) or `--weights MODEL=PATH` for each model."""
    chosen = {}
    for spec in specs:
        model_id, _, path = spec.rpartition("=")
        model_id = model_id or (models[0] if len(models) == 1 else "")
        folder, match = Path(path), _VERSION_DIR.match(Path(path).name)
        if model_id not in models:
            raise EvalError(f"--weights {spec}: name one of this run's models {models} as "
                            "--weights MODEL=PATH")
        if not (folder / "config.json").is_file() or not match:
            raise EvalError(f"--weights {spec}: expected a published weights folder "
                            "weights/<model>/v<N>/ with a config.json (its N is the TensorBoard "
                            "step); use --version N for this run's own versions")
        chosen[model_id] = (int(match.group(1)), folder)
    if set(chosen) != set(models):
        raise EvalError(f"--weights gives {sorted(chosen)}; give every model of {models}")
    return _target(chosen)


def _target(chosen: dict[str, tuple[int, Path]]) -> Target:
    versions = {v for v, _ in chosen.values()}
    label = (f"v{versions.pop()}" if len(versions) == 1
             else "_".join(f"{m}-v{v}" for m, (v, _) in sorted(chosen.items())))
    return Target(label, max(v for v, _ in chosen.values()), chosen)


def base_target(models: list[str]) -> Target:
    return Target("base", 0, {m: (0, None) for m in models})


# ---------------------------------------------------------------------------- playing

def eval_tasks(cfg: TroupeConfig, workflow, max_tasks: int | None) -> list[Task]:
    """The eval split (generators use their own seed range), first `max_tasks` of it."""
    split = cfg.workflow.tasks.eval_split
    try:
        tasks = TaskSource(cfg.workflow.tasks, split, generator=workflow.make_task, shard=0,
                           num_shards=1, seed=0).all()
    except (ValueError, KeyError, FileNotFoundError) as exc:
        raise EvalError(f"eval split {split!r} (workflow.tasks.eval_split): {exc}") from None
    tasks = tasks[:max_tasks] if max_tasks else tasks
    if not tasks:
        raise EvalError(f"eval split {split!r} of workflow.tasks has no tasks; give it some "
                        "(workflow.tasks) or name another with workflow.tasks.eval_split")
    return tasks


class CoachScores:
    """Scores eval actions with the run's coach; a coach that breaks is reported, not fatal.

    Evaluation still has its numbers without the coach (say, an HTTP judge that is not up), so
    a coach that cannot be built or raises is marked unavailable with the reason; a judge
    failure on one action (CoachFailure) is counted per agent.
    """

    def __init__(self, cfg: TroupeConfig, workflow) -> None:
        self.kind = cfg.coach.kind
        self.failed: dict[str, int] = defaultdict(int)
        self.reason = ""
        # The rule coach's latency_s simulates a slow judge for the training benchmarks;
        # evaluation has nothing to measure there.
        coach_cfg = dataclasses.replace(cfg.coach, latency_s=0.0)
        try:
            self.coach = build_coach(coach_cfg, workflow)
        except Exception as exc:  # reported in the table and the JSON (see the class doc)
            self._unavailable("could not be built", exc)

    def _unavailable(self, what: str, exc: BaseException) -> None:
        self.coach = None
        self.reason = f"{what}: {type(exc).__name__}: {exc}"
        log.warning("coach (%s) %s; the coach column is unavailable", self.kind, self.reason)

    async def score(self, requests: list[CoachRequest]) -> list[tuple[str, float]]:
        if self.coach is None:
            return []
        results = await asyncio.gather(*(self.coach.score(r) for r in requests),
                                       return_exceptions=True)
        scores = []
        for request, result in zip(requests, results):
            if isinstance(result, CoachFailure):
                self.failed[request.agent] += 1
            elif isinstance(result, Exception):
                if self.coach is not None:
                    self._unavailable("failed while scoring", result)
                return []
            elif isinstance(result, BaseException):
                raise result
            else:
                scores.append((request.agent, float(result.score)))
        return scores

    async def close(self) -> None:
        if self.coach is not None:
            await self.coach.close()

    def summary(self) -> dict[str, Any]:
        return {"kind": self.kind, "available": self.coach is not None, "reason": self.reason,
                "failed": dict(self.failed)}


@dataclass
class Player:
    """Plays eval episodes on the engines through `routes`, at most `concurrency` at once."""

    cfg: TroupeConfig
    workflow: Any
    routes: dict[str, ModelRoute]
    coach: CoachScores
    sampling: SamplingParams
    concurrency: int
    run_id: str
    advisor: Advisor | None = None  # coach.advisor, for workflows that consult (MAGRPO H > 1)

    async def play_all(self, tasks: list[Task], samples: int, label: str) -> list[Played]:
        limit = asyncio.Semaphore(self.concurrency)
        total, done, started = len(tasks) * samples, 0, time.monotonic()
        last_line = started

        async def one(task: Task, sample: int) -> Played:
            nonlocal done, last_line
            async with limit:
                played = await self.play(task, sample)
            # scored outside the limit: a slow judge does not hold up generation
            played.scores = await self.coach.score(played.requests)
            done += 1
            now = time.monotonic()
            if done == total or now - last_line >= PROGRESS_EVERY_S:
                last_line = now
                log.info("eval %s: %d/%d episodes, %.0f s", label, done, total, now - started)
            return played

        return await asyncio.gather(*(one(t, s) for t in tasks for s in range(samples)))

    async def play(self, task: Task, sample: int) -> Played:
        # One episode per sample, a round of one: group_size 1 makes a tree workflow ask for
        # a single candidate per action, which is what the evaluated policy would answer.
        episode = Episode(
            run_id=self.run_id, workflow=self.workflow.name, task_id=task.task_id,
            round_id=new_id(), round_size=1, round_index=0, group_size=1,
            agent_models=dict(self.cfg.workflow.agents), routes=self.routes,
            sampling=self.sampling, truth=task.truth, problem=task.prompt,
            advisor=self.advisor.consult if self.advisor is not None else None)
        result = dict(await self.workflow.run(task, episode))
        if self.advisor is not None:
            result.update(episode.advisor_scalars())
        return Played(task.task_id, sample, result, action_rows(episode),
                      episode.coach_requests(result.get("success")))


def action_rows(episode: Episode) -> list[dict[str, Any]]:
    """agent, turn, response_len (tokens) and the workflow's annotations of every action.

    Read from the episode's rows (their `meta` holds the annotations, Episode.annotate).
    """
    return [dict(json.loads(row.meta), agent=row.agent, turn=row.turn,
                 response_len=len(row.response_ids))
            for rows in episode.records().values() for row in rows]


# ---------------------------------------------------------------------------- summaries

def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize(played: list[Played], agents: dict[str, str], samples: int) -> dict[str, Any]:
    """The workflow's metric means (+ pass@K) and each agent's behaviour."""
    keys = sorted({k for p in played for k in p.result})
    episode_metrics = {k: _mean([float(p.result[k]) for p in played if k in p.result])
                       for k in keys}
    if samples > 1 and "success" in keys:
        # pass@K with K samples per task: a task counts when any of its samples succeeded
        # (the best sample's success, which is the same thing for 0/1 success).
        best: dict[str, float] = defaultdict(float)
        for p in played:
            best[p.task_id] = max(best[p.task_id], float(p.result.get("success", 0.0)))
        episode_metrics[f"pass_at_{samples}"] = _mean(list(best.values()))
    by_agent = {}
    for agent, model_id in agents.items():
        metas = [m for p in played for m in p.actions if m["agent"] == agent]
        called = [bool(m["tool_called"]) for m in metas if "tool_called" in m]
        # tool success counts the actions that did call the tool
        ok = [bool(m["tool_ok"]) for m in metas if "tool_ok" in m and m.get("tool_called", True)]
        scores = [s for p in played for a, s in p.scores if a == agent]
        by_agent[agent] = {
            "model": model_id, "actions": len(metas),
            "response_len": _mean([float(m["response_len"]) for m in metas]),
            "tool_call_rate": _mean([float(c) for c in called]),
            "tool_success": _mean([float(o) for o in ok]),
            "coach_score": _mean(scores)}
    return {"workflow": episode_metrics, "agents": by_agent}


def format_table(headers: list[str], rows: list[list[Any]]) -> str:
    """Left-aligned columns; None shows as "-" (an agent without a tool), floats as 0.000."""
    cells = [headers] + [["-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)
                          for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
                     for row in cells)


def render(report: dict[str, Any]) -> str:
    """The plain-text tables of one evaluation."""
    weights = ", ".join(f"{m} {'base' if w['path'] is None else 'v' + str(w['version'])}"
                        for m, w in report["weights"].items())
    mode = ("greedy" if report["temperature"] == 0
            else f"{report['samples']} samples at temperature {report['temperature']}")
    lines = [f"== eval {report['label']} of {report['run_id']} ({weights}): "
             f"{report['workflow_name']}, split {report['split']!r}, {report['tasks']} tasks, "
             f"{mode}, {report['elapsed_s']:.0f} s"]
    metrics = report["metrics"]["workflow"]
    lines.append(format_table(["workflow", "episodes", *metrics],
                              [[report["workflow_name"], report["episodes"],
                                *metrics.values()]]))
    lines.append("")
    coach = report["coach"]
    rows = [[agent, a["model"], a["actions"], a["response_len"], a["tool_call_rate"],
             a["tool_success"], a["coach_score"] if coach["available"] else "n/a"]
            for agent, a in report["metrics"]["agents"].items()]
    lines.append(format_table(["agent", "model", "actions", "response_len", "tool_call_rate",
                               "tool_success", f"coach_score ({coach['kind']})"], rows))
    if "advisor" in report:
        adv = report["advisor"]
        lines.append(f"advisor: {adv['calls']:.0f} calls, {adv['failures']:.0f} failed, "
                     f"latency mean {adv['latency_s']:.2f} s, p95 {adv['latency_p95_s']:.2f} s")
    if not coach["available"]:
        lines.append(f"coach unavailable: {coach['reason']}")
    elif coach["failed"]:
        lines.append(f"coach failures per agent (not scored): {coach['failed']}")
    return "\n".join(lines)


def flat_metrics(report: dict[str, Any]) -> dict[str, float]:
    """`<workflow>/<metric>` and `<agent>/<metric>` -> value, numbers only."""
    metrics = report["metrics"]
    flat = {f"{report['workflow_name']}/{k}": v for k, v in metrics["workflow"].items()}
    for agent, values in metrics["agents"].items():
        flat.update({f"{agent}/{k}": v for k, v in values.items() if k != "model"})
    if not report["coach"]["available"]:
        flat = {k: v for k, v in flat.items() if not k.endswith("/coach_score")}
    return {k: float(v) for k, v in flat.items() if v is not None}


def render_deltas(base: dict[str, Any], trained: dict[str, Any]) -> tuple[str, dict]:
    before, after = flat_metrics(base), flat_metrics(trained)
    deltas = {k: after[k] - before[k] for k in after
              if k in before and not k.endswith("/actions")}
    rows = [[k, before[k], after[k], f"{deltas[k]:+.3f}"] for k in deltas]
    table = format_table(["metric", "base", trained["label"], "delta"], rows)
    return f"== {trained['label']} vs base\n{table}", deltas


def write_outputs(report: dict[str, Any], run_dir: Path, text: str) -> Path:
    """eval/<label>.json and the TensorBoard scalars at the weights version."""
    out = run_dir / "eval" / f"{report['label']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    writer = MetricsWriter(run_dir / "tensorboard")
    try:
        suffix = report["metric_suffix"]  # pass_at_<K> names its K already
        writer.scalars({f"eval/{k}{'' if '/pass_at_' in k else suffix}": v
                        for k, v in flat_metrics(report).items()}, step=report["step"])
        writer.text(f"eval/{report['label']}", "```\n" + text + "\n```", step=report["step"])
    finally:
        writer.close()
    return out


# ---------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, help="runs/<run_id>, or latest")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--version", type=int, help="evaluate weights/<model>/v<N> (default: "
                                                  "the newest of every model)")
    which.add_argument("--weights", action="append", metavar="[MODEL=]PATH",
                       help="a published weights folder v<N> (repeat per model)")
    which.add_argument("--base", action="store_true", help="the untrained model paths")
    parser.add_argument("--compare-base", action="store_true",
                        help="evaluate the base model first, then the weights; print the deltas")
    parser.add_argument("--samples", type=int, default=1, help="K samples per task (pass@K)")
    parser.add_argument("--temperature", type=float, default=None,
                        help=f"0 (greedy) for 1 sample, {MAPPA_TEMPERATURE} for K > 1")
    parser.add_argument("--max-tasks", type=int, default=None, help="first N eval tasks")
    # The server batches concurrent episodes: 16 SmolLM2 eval episodes on a loaded 2-core CPU
    # took 173 s at 16 at once and 524 s at 4 (training keeps 16 sequences in flight too).
    parser.add_argument("--concurrency", type=int, default=16, help="episodes played at once")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args(argv)
    if args.temperature is None:
        args.temperature = 0.0 if args.samples == 1 else MAPPA_TEMPERATURE
    if args.samples < 1 or args.concurrency < 1 or (args.max_tasks is not None
                                                    and args.max_tasks < 1):
        parser.error("--samples, --concurrency and --max-tasks must be >= 1")
    if args.samples > 1 and args.temperature == 0:
        parser.error(f"--samples {args.samples} at temperature 0 repeats the greedy reply; "
                     "pass --temperature > 0 (MAPPA uses 0.6)")
    if args.base and args.compare_base:
        parser.error("--compare-base already evaluates the base model; drop --base")
    return args


def start_engines(cfg: TroupeConfig, log_dir: Path) -> dict[str, SGLangEngine]:
    """One engine per model, with the run's engine config, on the base weights."""
    engines: dict[str, SGLangEngine] = {}
    try:
        for model_id, mc in cfg.models.items():
            engines[model_id] = SGLangEngine(model_id, resolve_model(mc.path), mc.engine, log_dir)
            engines[model_id].start()
    except BaseException:
        stop_engines(engines)
        raise
    return engines


def stop_engines(engines: dict[str, SGLangEngine]) -> None:
    for engine in engines.values():
        engine.close()


async def load_weights(engines: dict[str, SGLangEngine], target: Target) -> None:
    """Load the target's folders into the running engines (the base: the model paths).

    Loading into the running server instead of starting another keeps one server per model:
    a start costs 30-60 s on a CPU, a load from disk well under a second for small models.
    """
    for model_id, (version, path) in target.weights.items():
        engine = engines[model_id]
        folder = engine.model_path if path is None else path
        if Path(engine.weights_path) == Path(folder):
            continue  # an engine starts on the base weights
        log.info("loading %s v%d from %s", model_id, version, folder)
        await asyncio.to_thread(engine.update_weights_from_disk, folder, version)


async def evaluate(args: argparse.Namespace, cfg: TroupeConfig, run_dir: Path,
                   targets: list[Target], tasks: list[Task],
                   engines: dict[str, SGLangEngine]) -> list[dict[str, Any]]:
    """Play every target on the engines, its weights loaded first; writes and prints each."""
    from transformers import AutoTokenizer

    workflow = build_workflow(cfg.workflow)
    clients = {m: EngineClient(e.url) for m, e in engines.items()}
    routes = {m: ModelRoute(m, [clients[m]], AutoTokenizer.from_pretrained(e.model_path),
                            cfg.models[m].chat_template_kwargs)
              for m, e in engines.items()}
    coach = CoachScores(cfg, workflow)
    # the run's advisor, as its episodes consulted it in training (its own endpoints, or the
    # coach's judges); unlike the coach column it is part of the episode, so it must build
    advisor = (Advisor(cfg.coach, getattr(coach.coach, "members", None))
               if cfg.coach.advisor.enabled else None)
    player = Player(cfg, workflow, routes, coach, SamplingParams(args.temperature, 1.0),
                    args.concurrency, run_dir.name, advisor)
    reports: list[dict[str, Any]] = []
    try:
        for target in targets:
            await load_weights(engines, target)
            started = time.monotonic()
            before = ((advisor.calls, sum(advisor.failures.values()))
                      if advisor is not None else (0, 0))
            played = await player.play_all(tasks, args.samples, target.label)
            report = make_report(args, cfg, run_dir, target, tasks, played, coach,
                                 time.monotonic() - started)
            if advisor is not None:
                report["advisor"] = advisor_summary(advisor, before)
            text = render(report)
            if reports and args.compare_base:  # base first, then these weights
                deltas_text, report["delta_vs_base"] = render_deltas(reports[0], report)
                text += "\n\n" + deltas_text
            path = write_outputs(report, run_dir, text)
            print(f"{text}\n(written: {path}; TensorBoard eval/ at step {report['step']})\n",
                  flush=True)
            reports.append(report)
    finally:
        await coach.close()
        if advisor is not None:
            await advisor.close()
        for client in clients.values():
            await client.aclose()
    return reports


def advisor_summary(advisor: Advisor, before: tuple[int, int]) -> dict[str, float]:
    """The advisor's calls, failures and latency (seconds, per consult, answered or failed)
    during one target's evaluation: what happened since `before` (calls, failures)."""
    calls = advisor.calls - before[0]
    recent = list(advisor.latencies)[-calls:] if calls else []  # the window keeps 4096
    lat = np.asarray(recent) if recent else np.zeros(1)
    return {"calls": float(calls),
            "failures": float(sum(advisor.failures.values()) - before[1]),
            "latency_s": float(lat.mean()), "latency_p50_s": float(np.percentile(lat, 50)),
            "latency_p95_s": float(np.percentile(lat, 95)), "latency_max_s": float(lat.max())}


def make_report(args: argparse.Namespace, cfg: TroupeConfig, run_dir: Path, target: Target,
                tasks: list[Task], played: list[Played], coach: CoachScores,
                elapsed_s: float) -> dict[str, Any]:
    return {
        "label": target.label, "step": target.step, "run_id": run_dir.name,
        "run_dir": str(run_dir), "workflow_name": cfg.workflow.name,
        "split": cfg.workflow.tasks.eval_split, "tasks": len(tasks), "samples": args.samples,
        "episodes": len(played), "temperature": args.temperature,
        "metric_suffix": f"_k{args.samples}" if args.temperature > 0 else "",
        "weights": {m: {"version": v, "path": None if p is None else str(p)}
                    for m, (v, p) in target.weights.items()},
        "metrics": summarize(played, dict(cfg.workflow.agents), args.samples),
        "coach": coach.summary(), "elapsed_s": elapsed_s,
        "episodes_detail": [{"task_id": p.task_id, "sample": p.sample, "result": p.result,
                             "actions": p.actions} for p in played],
    }


def plan(args: argparse.Namespace, run_dir: Path, models: list[str]) -> list[Target]:
    """The weights to evaluate, in order: the base first when asked for."""
    targets = [] if args.base else [choose_weights(args, run_dir, models)]
    if args.base or args.compare_base:
        targets.insert(0, base_target(models))
    if args.temperature > 0:  # a sampled evaluation never lands on the greedy curves
        targets = [dataclasses.replace(t, label=f"{t.label}_k{args.samples}") for t in targets]
    return targets


def main(argv: list[str] | None = None,
         engines: dict[str, SGLangEngine] | None = None) -> int:
    """Run the evaluation; `engines` (model_id -> started engine) are reused, not stopped."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is noise
    try:
        run_dir = find_run(args.run, args.overrides)
        cfg = load_config(run_dir / "config.yaml", args.overrides)
        targets = plan(args, run_dir, list(cfg.models))
        tasks = eval_tasks(cfg, build_workflow(cfg.workflow), args.max_tasks)
    except (EvalError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    log.info("evaluating %s on %d %s tasks: %s", run_dir, len(tasks),
             cfg.workflow.tasks.eval_split, ", ".join(t.label for t in targets))
    owned = engines is None
    if owned:
        resolve_dtypes(cfg)  # a run's config.yaml is resolved already; an override may not be
        engines = start_engines(cfg, run_dir / "eval" / "logs")
    try:
        asyncio.run(evaluate(args, cfg, run_dir, targets, tasks, engines))
    finally:
        if owned:
            stop_engines(engines)  # also on Ctrl-C: no server outlives the evaluation
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the engines were stopped on the way out (main's finally)
        print("interrupted: nothing written for the evaluation in progress", file=sys.stderr)
        sys.exit(130)
