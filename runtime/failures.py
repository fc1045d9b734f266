"""What a failed actor call means for supervision.

`ACTOR_GONE`: the call failed because the actor's process is gone or restarting. Ray raises
`RayActorError` (and its subclasses) for a crash, a kill or a restart in progress, but
`OutOfMemoryError`, which is not one of them, when its memory monitor killed the process to
relieve the node. Both mean the same to the supervision loops: the process died, Ray restarts
it (or the restart budget runs out and the run stops with the cause). Catching only
`RayActorError` let one memory kill of a learner escape the driver's supervision and end the
run with a traceback.
"""
from __future__ import annotations

import ray.exceptions

ACTOR_GONE: tuple[type[BaseException], ...] = (ray.exceptions.RayActorError,
                                               ray.exceptions.OutOfMemoryError)
