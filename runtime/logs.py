"""Process-wide logging setup: one function, called once in each process that logs.

Logging is a property of the process, not of an object in it, so no constructor of a plain
class (`actors/`, `buffers/`, `learners/`) touches it. The processes that log are the driver
(`scripts/launch_async.py`) and the Ray actors the runtime spawns whose progress lines
matter (`LearnerWorker`, `RolloutHost`). Ray gives every actor its own worker process, so the
first thing such an actor's constructor does is call `configure_logging()`; any later call in
the same process (a second actor class, a test that builds one twice) does nothing.

Why not Ray's job-level `worker_process_setup_hook`: it would configure every worker, and the
actors that are silent at INFO today (buffers, clock, coach, metrics) would start printing.
"""
from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(name)s %(message)s"
# Libraries whose INFO lines are noise beside the runtime's own progress lines.
QUIET_LOGGERS = {
    "httpx": logging.WARNING,  # one line per request
    "megatron": logging.WARNING,  # its bucket layout and config; the learner's step line says more
}


def configure_logging() -> None:
    """Log INFO and above to stderr with timestamps, libraries' chatter quieted.

    Idempotent without a flag: `logging.basicConfig` does nothing once the root logger has a
    handler (this function's from an earlier call, or a test runner's), and setting a
    library's level again changes nothing.
    """
    logging.basicConfig(level=logging.INFO, format=FORMAT)
    for name, level in QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(level)
