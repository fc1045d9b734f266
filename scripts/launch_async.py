"""Launch an asynchronous troupe training run.

Tiny CPU run (local Ray, started for you):
    python scripts/launch_async.py --config configs/signal_game_tiny.yaml run.max_steps=20
The CPU default (`make run`):
    python scripts/launch_async.py --config configs/arith_duo_cpu.yaml
Continue a stopped or crashed run from its checkpoints and buffer logs (overrides still apply):
    python scripts/launch_async.py --resume runs/<run_id> [run.max_steps=40]
On a cluster (start it with the project venv active):
    ray start --head
    ray job submit --working-dir . -- python scripts/launch_async.py --config configs/<x>.yaml

Any config field can be overridden as key=value (e.g. models.policy.learner.lr=1e-5).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a bare checkout

from runtime.config import ConfigError, load_config  # noqa: E402
from runtime.controller import run  # noqa: E402
from runtime.logs import configure_logging  # noqa: E402
from runtime.resume import load_resume_config  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="YAML config under configs/")
    parser.add_argument("--resume", metavar="RUN_DIR",
                        help="continue the run in this directory (runs/<run_id>) instead")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args(argv)
    configure_logging()
    if (args.config is None) == (args.resume is None):
        parser.error("give exactly one of --config (a new run) or --resume (an existing run)")
    try:
        cfg = (load_resume_config(args.resume, args.overrides) if args.resume
               else load_config(args.config, args.overrides))
    except (ConfigError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    runs_dir = Path(cfg.run.runs_dir)
    if not runs_dir.is_absolute() and "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ:
        logging.warning("running as a Ray job: run.runs_dir=%s lands in the job's copy of the "
                        "working directory (%s); pass run.runs_dir=<absolute path> to keep it",
                        runs_dir, Path.cwd())
    cfg.run.runs_dir = str(runs_dir.resolve())
    summary = run(cfg, resume=args.resume is not None)
    rows = summary["rows"]
    print(json.dumps({"rows": rows, "learners": summary["learners"]}, indent=2, default=str))
    print(f"run directory: {summary['run_dir']}")
    print(f"TensorBoard:   tensorboard --logdir {Path(summary['run_dir']) / 'tensorboard'}")
    for model_id, learner in summary["learners"].items():
        print(f"weights of {model_id} (v{learner['version']}): {learner['weights']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
