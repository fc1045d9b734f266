"""Runs model-written Python in a sandbox (DESIGN §14): bubblewrap plus rlimits.

Each run is a fresh interpreter (`sys.executable`, so the venv's numpy/pandas/scikit-learn
import read-only) in its own process group, with the per-episode `Workspace` as cwd, HOME and
TMPDIR, a minimal environment (no parent secrets, no proxies) and one BLAS thread. A run ends
when its main process exits or at `timeout_s`; either way its whole group (under bubblewrap,
its pid namespace) is then killed, so nothing it started outlives it (in rlimits mode, a
process that left the group with setsid() does). Enforced in each mode:

    limit / property         | "bwrap" mode                      | "rlimits" mode
    -------------------------+-----------------------------------+----------------------------
    wall clock (timeout_s)   | SIGKILL to the group; the pid     | SIGKILL to the group (a
                             | namespace dies with its init      | setsid() child escapes it)
    CPU (cpu_s)              | RLIMIT_CPU                        | RLIMIT_CPU
    memory (memory_mb)       | RLIMIT_AS                         | RLIMIT_AS
    file size (file_mb)      | RLIMIT_FSIZE; /tmp and /dev/shm   | RLIMIT_FSIZE
                             | are private tmpfs of file_mb      |
    processes (max_processes)| RLIMIT_NPROC, as an unprivileged  | RLIMIT_NPROC; as root only
                             | uid (as root: uid 65534)          | if uid 65534 can run the
                             |                                   | interpreter, else NOT enforced
    network                  | none (own namespace, loopback of  | NOT isolated
                             | the host unreachable)             |
    filesystem               | read-only; the workspace is the   | NOT isolated (as uid 65534:
                             | only writable path; /tmp private  | what that uid may write)
    other processes          | own pid, ipc, uts namespaces      | visible

RLIMIT_NPROC counts all processes of a uid and does not bind root, so a root parent runs the
code as uid 65534: bwrap starts as root, a bootstrap sets the limits, drops to 65534 and execs
(directories closed to others on the interpreter's path, e.g. /root, become an empty tmpfs with
only the interpreter bound back); the limit is that uid's tasks at start + max_processes. A
non-root parent gets a fresh user namespace from bubblewrap, where the count starts at zero.

`auto` uses bubblewrap when a trial run works (probed once per process) and otherwise runs
with rlimits only, warning once, loudly, what is not enforced. Model code that fails or trips
a limit is an observation (`RunResult.observation()`); a failure of the sandbox itself (bwrap
cannot start, the workspace is gone) raises `SandboxError` and the caller marks the row
FAILED `sandbox`.
"""
from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

NOBODY = 65534  # the uid/gid a root parent runs model code as
_ISOLATIONS = ("auto", "bwrap", "rlimits")

# Runs inside the sandbox before the model's code: limits, privilege drop, exec. Its first byte
# on `fd` says whether the sandbox came up: b"1" before the exec, or b"E<error>". Nothing the
# model's code can do comes before that byte (it may reach the pipe through /proc/1/fd in a
# user namespace), so it cannot pass its own failure off as the sandbox's. A failed exec after
# b"1" is reported on stderr instead.
_BOOTSTRAP = """
import os, resource, sys
fd, started = int(sys.argv[1]), False
try:
    cpu, mem, fsize, nproc, uid = map(int, sys.argv[2:7])
    for name, soft, hard in (("CPU", cpu, cpu + 1), ("AS", mem, mem), ("FSIZE", fsize, fsize),
                             ("NPROC", nproc, nproc), ("CORE", 0, 0)):
        kind = getattr(resource, "RLIMIT_" + name)
        cap = resource.getrlimit(kind)[1]
        hard = hard if cap == resource.RLIM_INFINITY else min(hard, cap)
        resource.setrlimit(kind, (min(soft, hard), hard))
    if uid >= 0:
        os.setgroups([]); os.setgid(uid); os.setuid(uid)
    os.write(fd, b"1")
    started = True
    os.set_inheritable(fd, False)
    os.execv(sys.executable, [sys.executable, "-E", "-s", "-B", "-u"] + sys.argv[7:])
except BaseException as exc:
    message = repr(exc).encode()
    if started:
        os.write(2, b"sandbox: the interpreter did not start: " + message + b"\\n")
    else:
        os.write(fd, b"E" + message)
    os._exit(125)
"""

# stderr text -> the limit it reveals (the last match in stderr wins: it ended the run).
_ERROR_MARKS = {
    "memory": ("MemoryError", "Cannot allocate memory", "std::bad_alloc", "Unable to allocate"),
    "file_size": ("File too large",),
    "processes": ("BlockingIOError", "Resource temporarily unavailable",
                  "can't start new thread"),
}


@dataclass
class SandboxConfig:
    timeout_s: float = 10.0  # wall clock per run; the whole process group is killed after it
    cpu_s: int = 10  # RLIMIT_CPU seconds (per process)
    memory_mb: int = 1024  # RLIMIT_AS: address space per process
    file_mb: int = 64  # RLIMIT_FSIZE: largest file a run may write (and private /tmp size)
    max_processes: int = 32  # processes/threads a run may have (fork bombs)
    max_concurrency: int = 2  # runs at once per Sandbox (per rollout actor)
    output_chars: int = 4000  # stdout/stderr kept per stream (head and tail; the middle is cut)
    isolation: str = "auto"  # auto: bwrap if usable else rlimits (warn once); bwrap; rlimits
    workspace_root: str = ""  # where per-episode workspaces are created ("" = system temp dir)

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"sandbox.timeout_s={self.timeout_s}: must be > 0")
        for name in ("cpu_s", "memory_mb", "file_mb", "max_processes", "max_concurrency"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"sandbox.{name}={value!r}: must be an integer >= 1")
        if self.memory_mb < 64:
            raise ValueError(f"sandbox.memory_mb={self.memory_mb}: must be >= 64 "
                             "(the interpreter alone needs tens of MB)")
        if self.output_chars < 100:
            raise ValueError(f"sandbox.output_chars={self.output_chars}: must be >= 100")
        if self.isolation not in _ISOLATIONS:
            raise ValueError(f"sandbox.isolation={self.isolation!r}: must be one of "
                             f"{', '.join(_ISOLATIONS)}")


@dataclass(frozen=True)
class RunResult:
    stdout: str
    stderr: str
    exit_code: int | None  # None when killed by the wall clock; -N when killed by signal N
    timed_out: bool
    tripped: str | None  # timeout, cpu, memory, file_size, processes, or None
    wall_s: float
    isolation: str  # "bwrap" or "rlimits"
    note: str = ""  # how the run ended, phrased for the model ("" after a clean exit 0)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def observation(self, max_chars: int = 2000) -> str:
        """What the agent sees: stdout, then stderr, then how the run ended; never empty."""
        body = "\n".join(s.rstrip("\n") for s in (self.stdout, self.stderr) if s.strip())
        room = max(max_chars - len(self.note) - 1, 40)
        body = _cut_middle(body, room)
        text = "\n".join(part for part in (body, self.note) if part)
        return text or "(no output)"


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the model's code): the row is FAILED `sandbox`."""


class Workspace:
    """A per-episode directory; the only writable path of a run."""

    def __init__(self, path: str | Path, prefix: str = "ws-") -> None:
        self.path = Path(path)
        self.prefix = prefix

    @classmethod
    def create(cls, root: str | Path | None = None, prefix: str = "ws-") -> "Workspace":
        base = Path(root) if root else Path(tempfile.gettempdir())
        try:
            base.mkdir(parents=True, exist_ok=True)
            return cls(tempfile.mkdtemp(prefix=prefix, dir=base), prefix)
        except OSError as exc:
            raise SandboxError(f"cannot create a workspace under {base}: {exc}") from exc

    def fork(self) -> "Workspace":
        """A copy in a new directory beside this one (for tree branches); symlinks stay links."""
        copy = Workspace.create(self.path.parent, self.prefix)
        shutil.copytree(self.path, copy.path, symlinks=True, dirs_exist_ok=True)
        return copy

    def files(self) -> list[str]:
        """Relative paths of the regular files (symlinks are not followed), sorted."""
        found = []
        for folder, _, names in os.walk(self.path):
            for name in names:
                full = Path(folder, name)
                if stat.S_ISREG(full.lstat().st_mode):
                    found.append(str(full.relative_to(self.path)))
        return sorted(found)

    def write(self, name: str, data: str | bytes) -> Path:
        """Write a file for the model to use (e.g. train.csv); `name` is relative."""
        rel = Path(name)
        if rel.is_absolute() or ".." in rel.parts:
            raise ValueError(f"workspace file name {name!r} must be relative, without '..'")
        target = self.path / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data.encode() if isinstance(data, str) else data)
        return target

    def cleanup(self) -> None:
        """Remove the directory and everything in it (idempotent)."""
        if self.path.exists():
            shutil.rmtree(self.path, onerror=_make_writable_and_retry)

    def __enter__(self) -> "Workspace":
        return self

    def __exit__(self, *exc_info) -> None:
        self.cleanup()


def python_blocks(text: str) -> list[str]:
    """Contents of ```python / ```py fenced blocks in `text`, in order.

    An unclosed last fence counts as a block: a stop string may have cut the closing fence.
    """
    pattern = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)(?:^[ \t]*```|\Z)",
                         re.S | re.M | re.I)
    return [m.group(1).rstrip("\n") for m in pattern.finditer(text)]


class Sandbox:
    """Runs code under the configured isolation; at most `max_concurrency` runs at once."""

    def __init__(self, cfg: SandboxConfig | None = None) -> None:
        self.cfg = cfg or SandboxConfig()
        self._root = os.geteuid() == 0
        self.isolation, self._drop_uid, self.unenforced = self._resolve()
        self._semaphore: asyncio.Semaphore | None = None
        self._semaphore_loop: asyncio.AbstractEventLoop | None = None
        self._runs = 0
        self._timeouts = 0
        self._tripped: Counter[str] = Counter()
        self._infra_failures = 0
        self._wall_total = 0.0

    async def run_python(self, code: str, workspace: Workspace,
                         timeout_s: float | None = None) -> RunResult:
        """Run `code` in `workspace`; raises SandboxError only if the sandbox itself fails."""
        timeout = self.cfg.timeout_s if timeout_s is None else timeout_s
        if timeout <= 0:
            raise ValueError(f"run_python timeout_s={timeout}: must be > 0")
        async with self._slots():
            try:
                result = await self._run(code, workspace, timeout)
            except SandboxError:
                self._infra_failures += 1
                raise
        self._runs += 1
        self._timeouts += result.timed_out
        self._wall_total += result.wall_s
        if result.tripped:
            self._tripped[result.tripped] += 1
        return result

    def stats(self) -> dict:
        return {"runs": self._runs, "timeouts": self._timeouts, "tripped": dict(self._tripped),
                "infra_failures": self._infra_failures,
                "mean_wall_s": self._wall_total / self._runs if self._runs else 0.0,
                "isolation": self.isolation}

    # -- setup ---------------------------------------------------------------------------------

    def _resolve(self) -> tuple[str, int, tuple[str, ...]]:
        """The isolation in force, the uid to drop to (-1: none) and what is not enforced."""
        if self.cfg.isolation != "rlimits":
            drop = NOBODY if self._root else -1
            works, why = _probe(self, "bwrap", drop)
            if works:
                return "bwrap", drop, ()
            if self.cfg.isolation == "bwrap":
                raise SandboxError(
                    f"sandbox.isolation='bwrap' but bubblewrap is not usable here ({why}): "
                    "install it (apt-get install bubblewrap; `make install` does so as root) "
                    "or set sandbox.isolation=auto to run with rlimits only")
        else:
            why = "sandbox.isolation=rlimits"
        unenforced = ["network", "filesystem"]
        drop = -1
        if self._root:
            drop = NOBODY if _probe(self, "rlimits", NOBODY)[0] else -1
            if drop < 0:
                unenforced.append("processes")
        _warn_once(why, unenforced, drop)
        return "rlimits", drop, tuple(unenforced)

    def _slots(self) -> asyncio.Semaphore:
        # A semaphore belongs to one event loop; a Sandbox may outlive one (tests, asyncio.run).
        loop = asyncio.get_running_loop()
        if self._semaphore is None or self._semaphore_loop is not loop:
            self._semaphore = asyncio.Semaphore(self.cfg.max_concurrency)
            self._semaphore_loop = loop
        return self._semaphore

    def _command(self, isolation: str, drop_uid: int, workspace: Path, script: Path,
                 status_fd: int) -> list[str]:
        cfg = self.cfg
        if isolation == "bwrap" and not self._root:
            nproc = cfg.max_processes + 1  # a fresh user namespace: bwrap's init + the run
        else:
            nproc = _tasks_of(drop_uid if drop_uid >= 0 else os.getuid()) + cfg.max_processes
        boot = [sys.executable, "-I", "-S", "-c", _BOOTSTRAP, str(status_fd), str(cfg.cpu_s),
                str(cfg.memory_mb << 20), str(cfg.file_mb << 20), str(nproc), str(drop_uid),
                str(script)]
        if isolation == "rlimits":
            return boot
        scratch = str(cfg.file_mb << 20)
        args = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
                "--perms", "1777", "--size", scratch, "--tmpfs", "/tmp",
                "--perms", "1777", "--size", scratch, "--tmpfs", "/dev/shm"]
        needed = [(workspace, "--bind")]
        # As root the interpreter must be reachable for uid 65534; otherwise only where the
        # private /tmp or /dev/shm would hide it (a virtual environment under /tmp).
        needed += [(p, "--ro-bind") for p in _interpreter_dirs()
                   if drop_uid >= 0 or _under_private_tmp(p)]
        if drop_uid >= 0:
            args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        args += _reachable(needed, masked=drop_uid >= 0)
        args += ["--chdir", str(workspace), "--unshare-net", "--unshare-pid", "--unshare-ipc",
                 "--unshare-uts", "--die-with-parent", "--new-session", "--"]
        return args + boot

    def _environment(self, workspace: Path) -> dict[str, str]:
        bin_dir = str(Path(sys.executable).parent)
        return {"PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin", "HOME": str(workspace),
                "TMPDIR": str(workspace), "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
                "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1"}

    # -- one run -------------------------------------------------------------------------------

    async def _run(self, code: str, workspace: Workspace, timeout: float) -> RunResult:
        ws = workspace.path.resolve()
        script = ws / f".troupe-run-{uuid.uuid4().hex[:12]}.py"
        try:
            if not ws.is_dir():
                raise SandboxError(f"workspace {ws} does not exist")
            script.write_text(code)
            if self._drop_uid >= 0:
                _chown_tree(ws, self._drop_uid)
        except OSError as exc:
            raise SandboxError(f"cannot prepare workspace {ws}: {exc}") from exc
        fds = list(os.pipe())
        status_read, status_write = fds
        try:
            argv = self._command(self.isolation, self._drop_uid, ws, script, status_write)
            start = time.monotonic()
            try:
                proc = await asyncio.create_subprocess_exec(
                    *argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, cwd=ws, env=self._environment(ws),
                    start_new_session=True, pass_fds=(status_write,))
            except OSError as exc:
                raise SandboxError(f"cannot start {argv[0]}: {exc}") from exc
            finally:  # our copy closed, so the status pipe ends when the run's copies do
                os.close(status_write)
                fds.remove(status_write)
            stdout, stderr, code_, timed_out = await self._supervise(proc, timeout)
            wall = time.monotonic() - start
            status = _read_all(status_read)
        finally:
            for fd in fds:
                os.close(fd)
            script.unlink(missing_ok=True)
        if status[:1] != b"1":
            why = status[1:].decode(errors="replace") if status[:1] == b"E" else stderr[-600:]
            raise SandboxError(f"{self.isolation} sandbox failed before the code ran "
                               f"(exit {code_}): {why.strip() or 'no message'}")
        if self.isolation == "bwrap" and code_ is not None and 128 < code_ < 128 + 65:
            code_ = 128 - code_  # bwrap reports death by signal N as 128+N (a model's
            # sys.exit(129..192) reads as a signal too; rare, and harmless)
        tripped = _tripped(timed_out, code_, stderr)
        return RunResult(stdout, stderr, None if timed_out else code_, timed_out, tripped,
                         wall, self.isolation, self._note(tripped, code_, timeout))

    async def _supervise(self, proc, timeout: float) -> tuple[str, str, int | None, bool]:
        """Wait for the run (or the wall clock), kill its group, collect bounded output."""
        out, err = _Tail(self.cfg.output_chars), _Tail(self.cfg.output_chars)
        readers = [asyncio.create_task(out.drain(proc.stdout)),
                   asyncio.create_task(err.drain(proc.stderr))]
        timed_out = False
        try:
            await asyncio.wait_for(proc.wait(), timeout)
        except asyncio.TimeoutError:
            timed_out = True
        finally:  # also on cancellation: nothing of the run may outlive it
            _kill_group(proc.pid)
        await proc.wait()
        # Readers end at EOF; a process that escaped the group (rlimits mode) could hold a pipe.
        _, stuck = await asyncio.wait(readers, timeout=2.0)
        for task in stuck:
            task.cancel()
        return out.text(), err.text(), proc.returncode, timed_out

    def _note(self, tripped: str | None, code: int | None, timeout: float) -> str:
        cfg = self.cfg
        notes = {
            "timeout": f"Execution timed out after {timeout:g} s (the process was killed).",
            "cpu": f"CPU time limit of {cfg.cpu_s} s exceeded (the process was killed).",
            "memory": f"Memory limit of {cfg.memory_mb} MB exceeded.",
            "file_size": f"File size limit of {cfg.file_mb} MB exceeded (the write failed).",
            "processes": f"Process limit of {cfg.max_processes} processes exceeded "
                         "(a fork or thread start was refused).",
        }
        if tripped:
            return notes[tripped]
        if code is not None and code < 0:
            return f"The process was killed by signal {-code} ({signal.strsignal(-code)})."
        return "" if code == 0 else f"The process exited with code {code}."


# -- helpers ---------------------------------------------------------------------------------


class _Tail:
    """One output stream, bounded: the first and last `chars` bytes and the total size."""

    def __init__(self, chars: int) -> None:
        self.chars = chars
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    async def drain(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(1 << 16):
            self.total += len(chunk)
            room = self.chars - len(self.head)
            self.head += chunk[:max(room, 0)]
            self.tail += chunk[max(room, 0):]
            del self.tail[:-self.chars]

    def text(self) -> str:
        kept = len(self.head) + len(self.tail)
        joined = (self.head + self.tail).decode(errors="replace")
        if kept == self.total and len(joined) <= self.chars:
            return joined
        half = self.chars // 2
        return (self.head.decode(errors="replace")[:half]
                + f"\n[... output cut: {self.total} bytes in all ...]\n"
                + self.tail.decode(errors="replace")[-half:])


def _cut_middle(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    half = max((limit - 40) // 2, 10)  # 40: room for the mark
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"


def _tripped(timed_out: bool, code: int | None, stderr: str) -> str | None:
    if timed_out:
        return "timeout"
    if code == -signal.SIGXCPU:
        return "cpu"
    if code == -signal.SIGXFSZ:
        return "file_size"
    if not code:
        return None
    last = {kind: max(stderr.rfind(mark) for mark in marks)
            for kind, marks in _ERROR_MARKS.items()}
    kind = max(last, key=last.get)
    return kind if last[kind] >= 0 else None


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:  # the group is already empty
        pass


def _read_all(fd: int) -> bytes:
    os.set_blocking(fd, False)
    data = b""
    try:
        while chunk := os.read(fd, 4096):
            data += chunk
    except BlockingIOError:  # a writer is still open: whatever arrived is the answer
        pass
    return data


def _tasks_of(uid: int) -> int:
    """Processes and threads of `uid` now (what RLIMIT_NPROC counts)."""
    count = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status") as status:
                fields = dict(line.split(":", 1) for line in status if ":" in line)
        except OSError:  # the process ended while we looked
            continue
        if int(fields["Uid"].split()[0]) == uid:
            count += int(fields["Threads"])
    return count


_PRIVATE_TMP = (Path("/tmp"), Path("/dev/shm"))  # empty tmpfs inside the sandbox


def _under_private_tmp(path: Path) -> bool:
    """Whether the sandbox's private /tmp or /dev/shm hides `path`."""
    return any(path == top or top in path.parents for top in _PRIVATE_TMP)


def _interpreter_dirs() -> list[Path]:
    dirs = {Path(os.path.realpath(p)) for p in (sys.base_prefix, sys.prefix)}
    dirs.add(Path(os.path.realpath(sys.executable)).parent)
    return sorted(d for d in dirs if not any(o in d.parents for o in dirs))


def _reachable(needed: list[tuple[Path, str]], masked: bool) -> list[str]:
    """bwrap arguments binding `needed` paths, reachable for an unprivileged uid if `masked`.

    An ancestor closed to other users (no o+x, e.g. /root) becomes an empty tmpfs holding
    only the needed paths, which also hides the rest of it from the model's code.
    """
    masks: set[Path] = set()
    if masked:
        for path, _ in needed:
            closed = [a for a in reversed(path.parents)
                      if not os.stat(a).st_mode & stat.S_IXOTH]
            if closed:
                masks.add(closed[0])
    args: list[str] = []
    for mask in sorted(masks, key=lambda m: len(m.parts)):
        args += ["--perms", "0755", "--tmpfs", str(mask)]
    for path, how in needed:
        # Under the private /tmp, bwrap would create the missing parents 0700: make them too.
        mask = next((m for m in masks if m in path.parents),
                    next((t for t in _PRIVATE_TMP if t in path.parents), None))
        if mask is not None:
            for folder in reversed([p for p in path.parents if mask in p.parents]):
                args += ["--perms", "0755", "--dir", str(folder)]
        if mask is not None or how == "--bind":
            args += [how, str(path), str(path)]
    return args


def _chown_tree(root: Path, uid: int) -> None:
    # Never follow links, and leave hard-linked files alone: the model could have linked a
    # host file into the workspace, and chown must not hand that file to it.
    for folder, dirs, names in os.walk(root):
        for name in [*dirs, *names]:
            path = os.path.join(folder, name)
            info = os.lstat(path)
            if info.st_uid != uid and not (stat.S_ISREG(info.st_mode) and info.st_nlink > 1):
                os.chown(path, uid, uid, follow_symlinks=False)
    os.chown(root, uid, uid, follow_symlinks=False)


def _make_writable_and_retry(func, path, exc_info) -> None:
    os.chmod(os.path.dirname(path), 0o700)  # the model may have removed its own permissions
    func(path)


# Per-process facts (each actor process probes and warns once), not state shared by actors.
_probes: dict[tuple[str, int], tuple[bool, str]] = {}
_warned = False


def _probe(sandbox: Sandbox, isolation: str, drop_uid: int) -> tuple[bool, str]:
    """Whether a trivial run works in this mode (cached per process): (works, why not)."""
    key = (isolation, drop_uid)
    if key in _probes:
        return _probes[key]
    if isolation == "bwrap" and shutil.which("bwrap") is None:
        _probes[key] = (False, "bwrap is not installed")
        return _probes[key]
    with Workspace.create(sandbox.cfg.workspace_root or None, "probe-") as ws:
        script = ws.write("probe.py", "print('ok')")
        if drop_uid >= 0:
            _chown_tree(ws.path, drop_uid)
        fds = list(os.pipe())
        read, write = fds
        try:
            argv = sandbox._command(isolation, drop_uid, ws.path.resolve(), script, write)
            done = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                                  cwd=ws.path, env=sandbox._environment(ws.path),
                                  pass_fds=(write,), start_new_session=True)
            os.close(write)
            fds.remove(write)
            works = done.returncode == 0 and _read_all(read)[:1] == b"1" and done.stdout == "ok\n"
            why = "" if works else f"trial run: exit {done.returncode}, {done.stderr.strip()}"
        except (OSError, subprocess.TimeoutExpired) as exc:
            works, why = False, f"trial run: {exc}"
        finally:
            for fd in fds:
                os.close(fd)
    _probes[key] = (works, why[-400:])
    return _probes[key]


def _warn_once(why: str, unenforced: list[str], drop_uid: int) -> None:
    global _warned
    if not _warned:
        _warned = True
        who = f"uid {drop_uid if drop_uid >= 0 else os.getuid()}"
        log.warning("SANDBOX WITHOUT ISOLATION (%s): model code runs with rlimits only, as %s. "
                    "NOT enforced: %s. It can reach the network (the host's loopback included)"
                    " and write wherever %s may%s. Install bubblewrap (apt-get install "
                    "bubblewrap; `make install` does so as root) to isolate it.",
                    why, who, ", ".join(unenforced), who,
                    "; as root the process limit does not bind: fork bombs meet only the wall "
                    "clock" if "processes" in unenforced else "")
