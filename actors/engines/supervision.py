"""Telling a slow server from a dead one, a restart budget that is a rate, and a free port.

`SGLangEngine.ensure_alive` probes `/health`; when a probe fails on a live process it asks
`ProgressWatch` whether the server's processes still make progress. Progress is measured out
of band, from CPU time in /proc, because the HTTP server is exactly what is too slow to
answer when this matters: a 2-core CPU decoding a big batch misses 5 s probes for minutes.
A stopped (SIGSTOP) or deadlocked server uses no CPU; a decoding one uses cores.
Known blind spot: a server spinning in a busy loop without serving looks busy.

`free_port` is the one place a loopback port is picked for a server to bind (engines, the
loopback coach, torch.distributed's rendezvous); it imports nothing beyond the standard
library, so learners and tests use it too. It picks below the kernel's ephemeral range:
a port the OS hands out for `bind(0)` is one it also hands to outgoing connections, and an
SGLang server binds its port some 10-30 s after we pick it, long enough on a busy machine
for a Ray worker's connection to take it (a CI run lost a test to exactly that).
"""
from __future__ import annotations

import os
import random
import socket
import threading
import time
from collections import deque
from contextlib import contextmanager
from typing import Iterator

# Progress = the group used at least this share of one core between two CPU samples. An
# idle server with --sleep-on-idle uses ~0.03 (that matters only when its probes fail); a
# decoding one, even beside two CPU hogs on 2 cores, far more than 0.1.
BUSY_CORES = 0.1
# CPU time moves in 10 ms ticks: shorter spans cannot tell busy from stopped.
MIN_SAMPLE_S = 1.0
RESTART_WINDOW_S = 3600.0  # RestartBudget counts restarts this far back


# Ray's workers listen on 10002-19999 by default; below that are well-known services.
_PORTS_FROM = 20000
_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
# Not the `random` module's state: processes seeded alike would pick the same ports.
_PORT_RNG = random.SystemRandom()


def _ephemeral_low(default: int = 32768) -> int:
    """First port of the kernel's range for outgoing connections (Linux; else the default)."""
    try:
        with open(_EPHEMERAL_RANGE) as file:
            return int(file.read().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def port_is_free(port: int) -> bool:
    """Whether `port` can be bound on loopback (SO_REUSEADDR, as the servers bind it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(tries: int = 64) -> int:
    """A loopback port nobody listens on right now, outside the ephemeral range.

    Random in [20000, ephemeral low); the OS's own pick when that range is too narrow
    (under 1000 ports) or `tries` random ports were all taken.
    """
    low = _ephemeral_low()
    if low - _PORTS_FROM >= 1000:
        for _ in range(tries):
            port = _PORT_RNG.randrange(_PORTS_FROM, low)
            if port_is_free(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stat_fields(pid: str | int) -> list[bytes] | None:
    """Fields 3 onwards of /proc/<pid>/stat (state first); None if the process is gone.

    The command name (field 2) may hold spaces and parentheses: split after its ')'.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            stat = file.read()
    except OSError:
        return None
    return stat[stat.rindex(b")") + 2:].split()


def is_zombie(pid: int) -> bool:
    """Whether /proc shows `pid` as exited (zombie or dead) but not yet reaped."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] in (b"Z", b"X")  # None: poll() is the authority


def group_cpu_seconds(pgid: int) -> float | None:
    """User + system CPU seconds of the live processes in group `pgid`; None without /proc.

    Fields of /proc/<pid>/stat: pgrp is the 5th, utime and stime the 14th and 15th.
    """
    if not os.path.isdir("/proc"):
        return None
    ticks = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        fields = _stat_fields(name)
        if fields is None:
            continue  # that process exited after listdir: it is in no group any more
        if int(fields[2]) == pgid:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


class ProgressWatch:
    """When a server's process group last made progress: answered, or used CPU.

    Not thread-safe: the engine calls it under its lifecycle lock. `last_progress` is a
    float, so other threads may read it for stats.
    """

    def __init__(self) -> None:
        now = time.monotonic()
        self.last_progress = now  # monotonic time of the last progress seen
        self.busy = False  # verdict of the last CPU sample
        self._mark = (now, 0.0)  # (monotonic time, group CPU seconds) of the last sample

    def answered(self, pgid: int | None) -> None:
        """The server answered a probe or a request: progress; re-base the CPU clock."""
        now = time.monotonic()
        cpu = group_cpu_seconds(pgid) if pgid is not None else None
        self.last_progress, self._mark = now, (now, cpu or 0.0)

    def sample(self, pgid: int, now: float) -> tuple[float, float] | None:
        """Compare the group's CPU time with the last sample and update `busy`.

        Returns (CPU seconds used, over seconds) when it sampled; None when the last sample
        is under `MIN_SAMPLE_S` old or there is no /proc, and `busy` keeps its verdict.
        """
        mark_time, mark_cpu = self._mark
        if now - mark_time < MIN_SAMPLE_S:
            return None
        cpu = group_cpu_seconds(pgid)
        if cpu is None:
            return None  # no /proc (not Linux): only an answer counts as progress
        used, span = cpu - mark_cpu, now - mark_time
        self._mark = (now, cpu)
        self.busy = used >= BUSY_CORES * span
        if self.busy:
            self.last_progress = now
        return used, span


class RestartBudget:
    """Restart times within the last hour, so the limit is a rate, not a lifetime count.

    Thread-safe: restarts and `stats()` happen on different actor threads.
    """

    def __init__(self) -> None:
        self._times: deque[float] = deque()
        self._lock = threading.Lock()

    def recent(self, now: float | None = None) -> int:
        """Restarts within `RESTART_WINDOW_S` before `now` (default: the monotonic clock)."""
        with self._lock:
            return self._prune(now)

    def take(self, per_hour: int, now: float | None = None) -> bool:
        """Record a restart at `now` if fewer than `per_hour` happened in the last hour."""
        with self._lock:
            if self._prune(now) >= per_hour:
                return False
            self._times.append(time.monotonic() if now is None else now)
            return True

    def _prune(self, now: float | None) -> int:
        """Forget restarts older than the window; returns how many remain (holds `_lock`)."""
        now = time.monotonic() if now is None else now
        while self._times and self._times[0] <= now - RESTART_WINDOW_S:
            self._times.popleft()
        return len(self._times)


class UpdateGate:
    """Lets supervision pass over a server that is loading weights instead of queueing.

    A weight update holds the engine's lifecycle lock for its whole HTTP call, during which
    the server is legitimately unresponsive: a probe must neither wait for it nor judge it.
    An update registers before it waits for the lock, so no probe slips in between.
    """

    def __init__(self, lifecycle: threading.RLock) -> None:
        self._lifecycle = lifecycle
        self._lock = threading.Lock()  # never held across I/O
        self.in_flight = 0  # weight updates registered and not finished

    @contextmanager
    def updating(self) -> Iterator[None]:
        """Hold the lifecycle lock for one weight update, announced to supervision."""
        with self._lock:
            self.in_flight += 1
        try:
            with self._lifecycle:
                yield
        finally:
            with self._lock:
                self.in_flight -= 1

    def acquire_unless_updating(self) -> bool:
        """Take the lifecycle lock; False (not taken) as soon as an update is in flight."""
        while True:
            with self._lock:
                if self.in_flight:
                    return False
            if self._lifecycle.acquire(timeout=0.1):
                with self._lock:
                    if not self.in_flight:
                        return True
                self._lifecycle.release()  # an update arrived while we waited: it goes first
