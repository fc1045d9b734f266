"""The code sandbox (actors/sandbox.py, DESIGN §14) against hostile code, in both isolation modes.

Every hostile case runs through a Sandbox hosted in a real Ray actor (a stand-in rollout
actor): it must be contained, come back as an observation, leave no process of the run alive
and leave the actor alive (same pid, answers a ping). Each case's wall time is printed, and a
table of all of them closes the module (`-s` shows both):

    .venv/bin/pytest tests/integration/test_sandbox.py -s
"""
from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest
import ray

from actors.sandbox import (RunResult, Sandbox, SandboxConfig, SandboxError, Workspace,
                            python_blocks)

REPO = Path(__file__).resolve().parents[2]
MODES = ("bwrap", "rlimits")
# Tight limits keep the hostile cases short on a small shared machine.
LIMITS = dict(timeout_s=5.0, cpu_s=10, memory_mb=512, file_mb=8, max_processes=16,
              max_concurrency=2)
WALL: dict[tuple[str, str], float] = {}  # (case, isolation) -> wall_s, for the closing table

# A fork bomb that checks the process cap is in force before it goes off, and that stops by
# itself: 13 doublings, at most 2**13 processes, if nothing stopped it.
FORK_BOMB = """
import os, resource, time
if os.getuid() == 0 or resource.getrlimit(resource.RLIMIT_NPROC)[0] > 1000:
    raise SystemExit("process cap not in force: the bomb was not set off")
for _ in range(13):
    os.fork()
time.sleep(1)
"""
# Counts how many children the cap lets it start (bounded, each child just sleeps).
CAP_PROBE = """
import os, time
started = 0
for _ in range(40):
    try:
        pid = os.fork()
    except OSError as exc:
        print("refused after", started, exc)
        break
    if pid == 0:
        time.sleep(5)
        os._exit(0)
    started += 1
print("started", started)
"""


class SandboxHost:
    """A stand-in rollout actor: one Sandbox per (isolation, variant)."""

    def __init__(self, limits: dict) -> None:
        self.sandboxes: dict[tuple[str, str], Sandbox] = {}
        self.missing: dict[str, str] = {}
        for isolation in MODES:
            try:
                for variant, extra in (("default", {}), ("cpu1", {"cpu_s": 1})):
                    cfg = SandboxConfig(isolation=isolation, **{**limits, **extra})
                    self.sandboxes[isolation, variant] = Sandbox(cfg)
            except SandboxError as exc:
                self.missing[isolation] = str(exc)

    async def ping(self) -> int:
        return os.getpid()

    async def describe(self) -> dict:
        return {"missing": self.missing,
                "unenforced": {iso: sb.unenforced for (iso, variant), sb in self.sandboxes.items()
                               if variant == "default"}}

    async def run(self, isolation: str, code: str, workspace: str, timeout_s: float | None = None,
                  variant: str = "default") -> RunResult:
        return await self.sandboxes[isolation, variant].run_python(code, Workspace(workspace),
                                                                    timeout_s)


@pytest.fixture(scope="module")
def host(ray_local):
    # Ray's workers cannot import this test module: ship SandboxHost by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    actor = ray.remote(SandboxHost).options(num_cpus=0).remote(LIMITS)
    info = ray.get(actor.describe.remote())
    info["pid"] = ray.get(actor.ping.remote())
    yield actor, info
    ray.kill(actor)


@pytest.fixture(scope="module", autouse=True)
def wall_table():
    yield
    if WALL:
        cases = sorted({case for case, _ in WALL})
        lines = [f"{'case':<26}{'bwrap':>10}{'rlimits':>10}"]
        for case in cases:
            cells = [f"{WALL[case, m]:>9.2f}s" if (case, m) in WALL else f"{'-':>10}"
                     for m in MODES]
            lines.append(f"{case:<26}{''.join(cells)}")
        print("\nsandbox wall times (s, as measured by the sandbox):\n" + "\n".join(lines))


def _survivors(workspace: Path) -> list[int]:
    """Live processes of a run: every one has the workspace on its command line."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if str(workspace).encode() in f.read():
                    found.append(int(pid))
        except OSError:  # ended while we looked
            continue
    return found


def _mode(host, isolation: str) -> tuple[object, tuple[str, ...]]:
    actor, info = host
    if isolation in info["missing"]:
        pytest.skip(f"{isolation} mode unavailable here: {info['missing'][isolation]}")
    return actor, info["unenforced"][isolation]


def run_case(host, isolation: str, case: str, code: str, workspace: Workspace,
             timeout_s: float | None = None, variant: str = "default") -> RunResult:
    """Run `code` in the actor; check no process survives and the actor lives on."""
    actor, info = host
    result = ray.get(actor.run.remote(isolation, code, str(workspace.path), timeout_s, variant))
    deadline = time.monotonic() + 3.0  # SIGKILLed processes take a moment to leave /proc
    while _survivors(workspace.path) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _survivors(workspace.path) == [], f"{case}: processes outlived the run"
    assert ray.get(actor.ping.remote(), timeout=10) == info["pid"], "the actor was replaced"
    WALL[case, isolation] = result.wall_s
    print(f"\n[{isolation}] {case}: wall {result.wall_s:.2f} s, tripped={result.tripped}, "
          f"exit={result.exit_code}")
    assert result.isolation == isolation
    return result


# -- hostile cases, through the actor ---------------------------------------------------------


@pytest.mark.parametrize("isolation", MODES)
def test_infinite_loop_is_killed_at_the_wall_clock(host, isolation):
    _mode(host, isolation)
    with Workspace.create() as ws:
        result = run_case(host, isolation, "infinite loop", "while True:\n    pass\n", ws,
                          timeout_s=2.0)
    assert result.timed_out and result.tripped == "timeout" and result.exit_code is None
    assert 2.0 <= result.wall_s < 3.5
    assert "Execution timed out after 2 s (the process was killed)." in result.observation()


@pytest.mark.parametrize("isolation", MODES)
def test_children_left_behind_are_killed(host, isolation):
    code = ("import os, time\nfor _ in range(3):\n    if os.fork() == 0:\n"
            "        time.sleep(60)\nprint('parent done')\n")
    _mode(host, isolation)
    with Workspace.create() as ws:
        result = run_case(host, isolation, "orphans sleeping 60 s", code, ws)
    assert result.ok and result.stdout == "parent done\n" and result.wall_s < 3.0


@pytest.mark.parametrize("isolation", MODES)
def test_fork_bomb_is_contained(host, isolation):
    actor, unenforced = _mode(host, isolation)
    if "processes" in unenforced:
        pytest.skip(f"{isolation} mode here does not enforce the process limit (root, and "
                    "uid 65534 cannot run the interpreter): a bomb would only meet the wall "
                    "clock, which this shared machine should not be put through")
    tasks_before = len(os.listdir("/proc"))
    with Workspace.create() as ws:
        probe = run_case(host, isolation, "process cap probe", CAP_PROBE, ws)
        assert "refused after" in probe.stdout, probe.observation()
        assert int(probe.stdout.split()[2]) < LIMITS["max_processes"]
        result = run_case(host, isolation, "fork bomb", FORK_BOMB, ws)
    assert "cap not in force" not in result.observation()
    assert result.tripped in ("processes", "timeout"), result.observation()
    if result.tripped == "processes":
        assert "Process limit of 16 processes exceeded" in result.observation()
    assert len(os.listdir("/proc")) < tasks_before + 10  # the machine is back where it was


@pytest.mark.parametrize("isolation", MODES)
def test_memory_hog_trips_the_memory_limit(host, isolation):
    code = "hog = []\nwhile True:\n    hog.append(bytearray(50_000_000))\n"
    _mode(host, isolation)
    with Workspace.create() as ws:
        result = run_case(host, isolation, "memory hog", code, ws)
    assert result.tripped == "memory" and result.exit_code == 1
    assert "MemoryError" in result.stderr
    assert "Memory limit of 512 MB exceeded." in result.observation()


@pytest.mark.parametrize("isolation", MODES)
def test_one_gigabyte_file_trips_the_file_size_limit(host, isolation):
    code = ("block = b'0' * (1 << 20)\nwith open('big.bin', 'wb') as f:\n"
            "    for _ in range(1024):\n        f.write(block)\n")
    _mode(host, isolation)
    with Workspace.create() as ws:
        result = run_case(host, isolation, "1 GB file", code, ws)
        size = (ws.path / "big.bin").stat().st_size
    assert result.tripped == "file_size", result.observation()
    assert size <= LIMITS["file_mb"] << 20
    assert "File size limit of 8 MB exceeded" in result.observation()


class _CountingServer:
    """A loopback TCP server that counts the connections it accepts, on its own."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> int:
        time.sleep(0.3)  # let a connection made at the end be accepted and counted
        self._stop.set()
        self._thread.join()
        self.sock.close()
        return self.accepted


@pytest.mark.parametrize("isolation", MODES)
def test_network_connect_to_a_loopback_server(host, isolation):
    _, unenforced = _mode(host, isolation)
    server = _CountingServer()
    code = ("import socket\ns = socket.create_connection(('127.0.0.1', %d), timeout=2)\n"
            "s.sendall(b'hello')\nprint('connected')\n" % server.port)
    try:
        with Workspace.create() as ws:
            result = run_case(host, isolation, "loopback connect", code, ws)
    finally:
        accepted = server.close()
    if "network" in unenforced:  # documented: rlimits mode does not isolate the network
        assert accepted == 1 and result.stdout == "connected\n"
        return
    assert accepted == 0, "the sandboxed code reached the host's loopback server"
    assert not result.ok and "ConnectionRefusedError" in result.observation()


@pytest.mark.parametrize("isolation", MODES)
def test_writes_outside_the_workspace(host, isolation):
    _, unenforced = _mode(host, isolation)
    tag = f"troupe-escape-{uuid.uuid4().hex[:8]}"
    targets = [Path("/tmp") / tag, REPO / tag, Path.home() / tag]
    if "filesystem" in unenforced:
        # Documented lack: here the code may write wherever its uid may. Only the host's /tmp
        # is tried (writing into the repo or $HOME would only prove the same on the real tree).
        targets = targets[:1]
    code = ("for path in %r:\n    try:\n"
            "        open(path, 'w').write('escaped')\n        print('wrote', path)\n"
            "    except OSError as exc:\n        print('refused', path, exc)\n"
            % [str(t) for t in targets])
    try:
        with Workspace.create() as ws:
            result = run_case(host, isolation, "writes outside", code, ws)
        landed = [t for t in targets if t.exists()]
    finally:
        for target in targets:
            target.unlink(missing_ok=True)
    if "filesystem" in unenforced:
        assert landed == targets and f"wrote {targets[0]}" in result.stdout
        return
    assert landed == [], f"escaped the sandbox: {landed}"
    # the private /tmp takes the first write; the repo and $HOME refuse theirs
    assert result.stdout.count("refused") == 2, result.observation()


@pytest.mark.parametrize("isolation", MODES)
def test_cpu_limit(host, isolation):
    _mode(host, isolation)
    with Workspace.create() as ws:
        result = run_case(host, isolation, "cpu spin (cpu_s=1)", "while True:\n    pass\n", ws,
                          variant="cpu1")
    assert result.tripped == "cpu" and not result.timed_out, result
    assert "CPU time limit of 1 s exceeded" in result.observation()


# -- ordinary runs, in this process --------------------------------------------------------


def _sandbox(isolation: str, **overrides) -> Sandbox:
    try:
        return Sandbox(SandboxConfig(isolation=isolation, **{**LIMITS, **overrides}))
    except SandboxError as exc:
        pytest.skip(f"{isolation} mode unavailable here: {exc}")


@pytest.mark.parametrize("isolation", MODES)
def test_normal_run_and_syntax_error(isolation):
    sandbox = _sandbox(isolation)
    with Workspace.create() as ws:
        ws.write("data/train.csv", "x,y\n1,2\n3,4\n")
        code = ("import pandas as pd\nframe = pd.read_csv('data/train.csv')\n"
                "print(int(frame.y.sum()))\nopen('out.txt', 'w').write('done')\n")
        result = asyncio.run(sandbox.run_python(code, ws))
        assert result.ok and result.stdout == "6\n" and result.tripped is None, result
        assert result.observation() == "6"
        assert ws.files() == ["data/train.csv", "out.txt"]  # the run's script is gone
        broken = asyncio.run(sandbox.run_python("def f(:\n    pass\n", ws))
        silent = asyncio.run(sandbox.run_python("x = 1\n", ws))
    assert broken.exit_code == 1 and broken.tripped is None
    assert "SyntaxError" in broken.observation()
    assert broken.observation().endswith("The process exited with code 1.")
    assert silent.observation() == "(no output)"
    assert sandbox.stats()["runs"] == 3


def test_output_is_bounded_and_says_it_was_cut():
    sandbox = _sandbox("rlimits", output_chars=1000)
    with Workspace.create() as ws:
        code = "import sys\nsys.stdout.write('a' * 5_000_000 + 'END')\n"
        result = asyncio.run(sandbox.run_python(code, ws))
    assert len(result.stdout) < 1200 and result.stdout.endswith("END")
    assert "output cut: 5000003 bytes in all" in result.stdout
    assert len(result.observation(300)) <= 300


def test_concurrency_is_bounded_per_sandbox():
    sandbox = _sandbox("bwrap")

    async def three_sleeps() -> list[RunResult]:
        with Workspace.create() as ws:
            return await asyncio.gather(*[sandbox.run_python("import time; time.sleep(1)", ws)
                                          for _ in range(3)])

    start = time.monotonic()
    results = asyncio.run(three_sleeps())
    elapsed = time.monotonic() - start
    print(f"\n3 runs of 1 s with max_concurrency=2: {elapsed:.2f} s")
    assert all(r.ok for r in results)
    assert 2.0 <= elapsed < 3.5


def test_sandbox_failures_raise_and_model_failures_do_not():
    sandbox = _sandbox("bwrap")
    ws = Workspace.create()
    ws.cleanup()
    with pytest.raises(SandboxError, match="does not exist"):
        asyncio.run(sandbox.run_python("print(1)", ws))

    class BrokenBwrap(Sandbox):  # bwrap itself refusing to start (cannot be caused otherwise)
        def _command(self, *args, **kwargs):
            argv = super()._command(*args, **kwargs)
            return [argv[0], "--no-such-option", *argv[1:]]

    broken = BrokenBwrap(sandbox.cfg)
    with Workspace.create() as ws:
        with pytest.raises(SandboxError, match="failed before the code ran"):
            asyncio.run(broken.run_python("print(1)", ws))
        # model code that imitates a bwrap error, and writes "E" into every pipe of the
        # sandbox's init it can reach, is still just an observation
        fake = ("import os, sys\nfor fd in os.listdir('/proc/1/fd') if os.access('/proc/1/fd', "
                "os.R_OK) else []:\n    try:\n        os.write(os.open(f'/proc/1/fd/{fd}', "
                "os.O_WRONLY), b'E')\n    except OSError:\n        pass\n"
                "sys.stderr.write('bwrap: Can\\'t mount\\n')\nsys.exit(1)\n")
        result = asyncio.run(sandbox.run_python(fake, ws))
    assert result.exit_code == 1 and "bwrap: Can't mount" in result.observation()
    assert sandbox.stats()["infra_failures"] == 1 and broken.stats()["infra_failures"] == 1


def test_without_bubblewrap_auto_falls_back_and_warns_once():
    script = """
import asyncio, logging
logging.basicConfig(format="%(levelname)s %(message)s")
from actors.sandbox import Sandbox, SandboxConfig, SandboxError, Workspace
try:
    Sandbox(SandboxConfig(isolation="bwrap"))
except SandboxError as exc:
    print("refused:", exc)
first, second = Sandbox(), Sandbox()
with Workspace.create() as ws:
    result = asyncio.run(first.run_python("print(6 * 7)", ws))
print(first.isolation, second.isolation, result.isolation, result.stdout.strip())
"""
    env = {"PATH": "/nonexistent", "HOME": os.environ.get("HOME", "/")}  # no bwrap on PATH
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, text=True,
                          capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "refused: sandbox.isolation='bwrap' but bubblewrap is not usable here" in done.stdout
    assert "apt-get install bubblewrap" in done.stdout
    assert done.stdout.strip().endswith("rlimits rlimits rlimits 42")
    assert done.stderr.count("SANDBOX WITHOUT ISOLATION") == 1, done.stderr
    assert "NOT enforced: network, filesystem" in done.stderr


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match=r"sandbox.timeout_s=0: must be > 0"):
        SandboxConfig(timeout_s=0)
    with pytest.raises(ValueError, match=r"sandbox.max_processes=0"):
        SandboxConfig(max_processes=0)
    with pytest.raises(ValueError, match=r"sandbox.isolation='docker'"):
        SandboxConfig(isolation="docker")


def test_workspace_fork_copies_and_is_independent(tmp_path):
    with Workspace.create(tmp_path / "spaces") as ws:
        ws.write("a.txt", "one")
        ws.write("sub/b.bin", b"\x00\x01")
        with pytest.raises(ValueError):
            ws.write("../outside.txt", "no")
        branch = ws.fork()
        assert branch.path != ws.path and branch.path.parent == ws.path.parent
        assert branch.files() == ws.files() == ["a.txt", "sub/b.bin"]
        branch.write("a.txt", "two")
        branch.write("c.txt", "three")
        assert (ws.path / "a.txt").read_text() == "one" and ws.files() == ["a.txt", "sub/b.bin"]
        branch.cleanup()
        branch.cleanup()  # idempotent
        assert not branch.path.exists()
    assert not ws.path.exists()


def test_python_blocks():
    reply = ("Plan first.\n```python\nprint(1)\n```\nthen\n```py\nx = 2\nprint(x)\n```\n"
             "```bash\nls\n```\n```Python\n```\nand the last one was cut:\n```python\nimport os\n")
    assert python_blocks(reply) == ["print(1)", "x = 2\nprint(x)", "", "import os"]
    assert python_blocks("no code here") == []
    assert python_blocks("```python\nprint('a ``` inside')\n```") == ["print('a ``` inside')"]


def test_bwrap_runs_an_interpreter_that_lives_under_tmp():
    """A virtual environment in an open folder under /tmp (a clone there, say) is hidden by
    the sandbox's private /tmp unless it is bound in, with parents that uid 65534 may
    traverse: bwrap must still run it. (pytest's own tmp folders are closed, 0700, which
    takes another path through the sandbox, so this one is made open.)"""
    _sandbox("bwrap")  # skips where bwrap is unusable
    top = Path(tempfile.mkdtemp(prefix="troupe-venv-", dir="/tmp"))
    try:
        top.chmod(0o755)
        venv = top / "clone" / ".venv"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        paths = os.pathsep.join([str(REPO), *[p for p in sys.path if p.endswith("site-packages")]])
        probe = ("import asyncio\n"
                 "from actors.sandbox import Sandbox, SandboxConfig, Workspace\n"
                 "sandbox = Sandbox(SandboxConfig(isolation='bwrap'))\n"
                 "with Workspace.create() as ws:\n"
                 "    result = asyncio.run(sandbox.run_python('import sys; print(sys.prefix)', ws))\n"
                 "print(result.ok, result.stdout.strip())\n")
        done = subprocess.run([str(venv / "bin" / "python"), "-c", probe], capture_output=True,
                              text=True, timeout=120, env=dict(os.environ, PYTHONPATH=paths))
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.split() == ["True", str(venv)]
    finally:
        shutil.rmtree(top)
