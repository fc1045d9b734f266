"""An actor killed by Ray's memory monitor reads as a dead actor to supervision.

Ray raises `OutOfMemoryError` for a call whose actor its memory monitor killed, and that is
not a `RayActorError`: the driver's supervision caught only the latter, so one memory kill
of a learner ended a run with a traceback instead of a restart (seen in a role-specialised
SmolLM2 run on this 24 GiB machine). This test causes a real memory kill: a private Ray
instance whose monitor threshold sits a little above the machine's current memory use, and
an actor that touches more memory than that margin. It runs in its own process so the
threshold never reaches another test's Ray.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = textwrap.dedent("""
    import json, sys, time
    import ray
    from runtime.failures import ACTOR_GONE

    @ray.remote(max_restarts=0, num_cpus=0)
    class Hog:
        def __init__(self):
            self.blocks = []

        def grow(self, mib: int, limit_mib: int) -> int:
            # touch every page, so the memory is resident, until killed or at the limit
            while len(self.blocks) * mib < limit_mib:
                self.blocks.append(bytearray(b"x" * (mib << 20)))
                time.sleep(0.05)
            return len(self.blocks) * mib

    ray.init(num_cpus=1, include_dashboard=False, _temp_dir=sys.argv[1])
    hog = Hog.remote()
    out = {}
    try:
        out["grew_mib"] = ray.get(hog.grow.remote(64, int(sys.argv[2])), timeout=180)
    except ACTOR_GONE as exc:
        out["error"] = type(exc).__name__
        out["is_actor_error"] = isinstance(exc, ray.exceptions.RayActorError)
    ray.shutdown()
    print("RESULT " + json.dumps(out))
""")


def test_a_memory_killed_actor_is_caught_as_gone():
    mem = psutil.virtual_memory()
    used = (mem.total - mem.available) / mem.total
    margin_mib = 1024  # the threshold sits this far above what the machine uses now
    threshold = used + margin_mib * 2**20 / mem.total
    assert threshold < 0.9, f"the machine already uses {used:.0%} of its memory"
    env = dict(os.environ, RAY_memory_usage_threshold=f"{threshold:.4f}",
               RAY_memory_monitor_refresh_ms="100", PYTHONPATH=str(ROOT))
    limit_mib = 4 * margin_mib  # four times the margin: the monitor must act before this
    ray_dir = tempfile.mkdtemp(prefix="troupe-oom-")  # short: Ray's socket paths are bounded
    try:
        proc = subprocess.run([sys.executable, "-c", _SCRIPT, ray_dir, str(limit_mib)],
                              env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    # The monitor killed the actor before it reached the limit, and the call's error is one
    # ACTOR_GONE catches; it is not a RayActorError, which is why ACTOR_GONE exists.
    assert "grew_mib" not in result, f"no memory kill: the actor grew to {result}"
    assert result["error"] == "OutOfMemoryError", result
    assert result["is_actor_error"] is False, result
