"""MAGRPO's level-based joint reward for an auxiliary coder and a main coder on HumanEval.

MAGRPO (Liu et al., "LLM Collaboration With Multi-Agent Reinforcement Learning"), §"Coding
Collaboration" / HumanEval and Appendix C "Reward Specifications / Coding Collaboration" (lines
203, 548 and 566-574 of /work/shared/papers/magrpo.txt). Two agents write Python at the same
time: the helper writes `aux` (line 211: an unconstrained auxiliary function "aux"; line 624:
"a helper function named aux"), the main agent writes the task's `entry_point` and may call
`aux` (lines 633-641). Their code, with the dataset's libraries, is one program (line 570), and
one joint reward scores it in four levels; "rewards are accumulated only when all requirements
at each preceding level are satisfied" (line 203):

  structure    0.4 if `aux` is defined with a return statement in the helper's code, plus 0.6
               if the entry point is, in the main agent's code (line 568). A missing main
               function ends the evaluation (line 568: "Failure to define the main function
               results in evaluation termination"); a missing `aux` does not.
  syntax       0.5 if the joint program compiles (line 570, "verified via static analysis, i.e.,
               Abstract Syntax Tree"); a syntax error ends the evaluation.
  tests        1.0 x the share of hidden tests passed (line 572, "assigned proportionally");
               no test passed ends the evaluation.
  cooperation  0.5 if the main function calls `aux`, + 1.0 if it is more than a wrapper around
               `aux` (line 574), - 0.5 if it discards some call's result (line 203: the bonus is
               for a main function that "properly invokes and utilizes" aux). Only with `aux`
               defined (structure) and at least one test passed.

The maximum is 1.0 + 0.5 + 1.0 + 1.5 = 4.0. The workflow runs the hidden tests: `code_checks`
gives the static part and the joint program; when `CodeChecks.needs_tests` it runs that program
on `humaneval.hidden_suite(test, entry_point)` in the sandbox (`humaneval.run_jobs`, 10 s a
test per line 572), and `level_reward(checks, result.passed)` gives the reward.

Where the paper is silent:
  - The points. The paper states no number for any level. We take those of the authors' released
    training code (its code reward, "Maximum reward: 4.0"): 0.4 + 0.6, 0.5, 1.0 x rate, 0.5 + 1.0 - 0.5. Table 2 (lines
    174-187) agrees: its Return column is the level columns weighted 1 : 0.5 : 1 : 1.5 over 4
    to within 1 point in all ten multi-agent rows, e.g. naive concatenation on HE (line 177),
    (96.1 + 0.5*90.6 + 42.5 + 1.5*22.7) / 4 = 54.5 against 53.9 (equal weights: 63.0).
  - Missing `aux` (or `aux` without a return statement): no 0.4 and no cooperation, but the
    evaluation goes on (line 568 stops only on the main function; the released code the same,
    though its bonus asks only that some `def aux` exists).
  - "Defined": a top-level `def` of the name (the last one, which is the one Python keeps);
    "include return statements": a `return` in the function's own body, not a nested def's.
    Found by lines when the code does not parse, so a syntax error is scored at the syntax
    level, not the structure level.
  - The joint program: the task prompt's statements other than the entry point's stub (its
    imports are line 570's "libraries provided in the dataset"; HumanEval/10, 32, 38, 50 and 64
    also define helpers or constants that the hidden tests or the task rely on), then the
    helper's whole code, then the main agent's whole code. The released code keeps only the
    prompt's import lines and the two named functions, which loses those helpers and an agent's
    own imports.
  - Syntax is `compile()`: the AST parse plus the compiler's static checks ('return' outside
    function, duplicate arguments), which a program must pass to run any test.
  - "Calls the auxiliary": a call `aux(...)` anywhere in the main function, nested lambdas and
    functions included, and only when the main agent's code does not bind `aux` itself (line
    639: "Do NOT redefine the aux() function"; its own `aux` is no cooperation).
  - A discarded result: the call is a bare expression statement, or its value is assigned to
    names that the main function never reads (the released code's AuxUsageAnalyzer, without its
    line ordering). The -0.5 applies once, however many calls discard their result.
  - A wrapper (the released code's `is_wrapper_function`): a main body that, besides its
    docstring, is `return <expression calling aux>` or `x = <expression calling aux>; return x`.
  - An agent's code is its reply's ```python blocks when it has any, else the whole reply (the
    paper's prompts ask for bare code, lines 620-621 and 635-636).
  - A test is one test of `humaneval.hidden_suite`: an assert of the record's `check` body that
    calls the function (a loop of asserts counts once), line 572's "successful assertions".
  - An empty pass vector past the syntax level is an error: a hidden suite holds >= 1 test.
"""
from __future__ import annotations

import ast
import re
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from actors.sandbox import python_blocks

AUX_NAME = "aux"  # lines 211 and 624
STRUCTURE_AUX = 0.4  # `aux` defined with a return statement
STRUCTURE_MAIN = 0.6  # the entry point defined with a return statement
SYNTAX = 0.5  # the joint program compiles
TESTS = 1.0  # times the share of hidden tests passed
COOPERATION_CALL = 0.5  # the main function calls aux
COOPERATION_BEYOND_WRAPPER = 1.0  # ... and is more than a wrapper around it
COOPERATION_DISCARDED = 0.5  # taken off when some aux call's result is discarded
MAX_REWARD = STRUCTURE_AUX + STRUCTURE_MAIN + SYNTAX + TESTS + COOPERATION_CALL \
    + COOPERATION_BEYOND_WRAPPER  # 4.0
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


@dataclass(frozen=True)
class CodeChecks:
    """The static checks of one (aux code, main code) pair; `program` is what the tests run."""

    program: str  # prompt's imports and helpers + the helper's code + the main agent's code
    aux_defined: bool  # top-level `def aux` with a return statement in the helper's code
    main_defined: bool  # top-level `def <entry_point>` with a return statement, main's code
    compiles: bool  # `program` compiles
    calls_aux: bool  # the main function calls the helper's aux (see the module docstring)
    discards_aux_result: bool  # some aux call's result is never used
    wraps_aux: bool  # the main function is only a wrapper around aux

    @property
    def needs_tests(self) -> bool:
        """Whether `level_reward` reads the pass vector (structure and syntax passed)."""
        return self.main_defined and self.compiles


@dataclass(frozen=True)
class LevelReward:
    """The reward by level; `stopped_at` names the level that ended the evaluation
    ("structure", "syntax" or "tests"), "" when the cooperation level was reached."""

    structure: float  # 0, 0.4, 0.6 or 1.0
    syntax: float  # 0 or 0.5
    tests: float  # 0 .. 1.0
    cooperation: float  # 0, 0.5, 1.0 or 1.5
    stopped_at: str

    @property
    def total(self) -> float:
        return self.structure + self.syntax + self.tests + self.cooperation


# ------------------------------------------------------------------------------ code

def agent_code(reply: str) -> str:
    """An agent's code: its ```python blocks joined, or the whole reply when it has none."""
    blocks = python_blocks(reply)
    return "\n\n".join(blocks) if blocks else reply.strip("\n")


def _dataset_part(prompt: str, entry_point: str) -> str:
    """The prompt's top-level statements but the entry point's stub: imports and helpers."""
    try:
        body = ast.parse(prompt).body
    except SyntaxError as exc:
        raise ValueError(f"prompt of {entry_point}: does not parse ({exc.msg})") from None
    kept = [node for node in body
            if not (isinstance(node, ast.FunctionDef) and node.name == entry_point)]
    return ast.unparse(ast.Module(body=kept, type_ignores=[]))


def _joint(prompt: str, entry_point: str, aux_code: str, main_code: str) -> tuple[str, int]:
    """The joint program and the line (1-based) where the main agent's code starts in it."""
    head = "\n\n".join(part for part in (_dataset_part(prompt, entry_point),
                                         aux_code.strip("\n")) if part)
    head = f"{head}\n\n" if head else ""
    main = main_code.strip("\n")
    return f"{head}{main}\n", head.count("\n") + 1


def joint_program(prompt: str, entry_point: str, aux_code: str, main_code: str) -> str:
    """The program the hidden tests run on (module docstring, "The joint program")."""
    return _joint(prompt, entry_point, aux_code, main_code)[0]


# ------------------------------------------------------------------------------ structure

def _own_nodes(function: ast.FunctionDef) -> Iterator[ast.AST]:
    """The nodes of a function's body, not descending into nested functions or classes."""
    stack = list(function.body)
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, _SCOPES):
            stack.extend(ast.iter_child_nodes(node))


def _returns(function: ast.FunctionDef) -> bool:
    return any(isinstance(node, ast.Return) for node in _own_nodes(function))


def _parses(source: str) -> ast.Module | None:
    try:
        return ast.parse(source)
    except (SyntaxError, ValueError, RecursionError):  # ValueError: a null byte
        return None


def _defined_by_lines(code: str, name: str) -> bool:
    """`defined_with_return` for code that does not parse: the last `def name(` at column 0
    and the indented lines after it; the block parsed alone, or else searched for `return`."""
    lines = code.splitlines()
    starts = [i for i, line in enumerate(lines) if re.match(rf"def\s+{re.escape(name)}\s*\(", line)]
    if not starts:
        return False
    block = [lines[starts[-1]]]
    for line in lines[starts[-1] + 1:]:
        if line.strip() and not line[0].isspace() and not line.startswith((")", "#")):
            break  # back at column 0: the function ended (")" closes a long signature)
        block.append(line)
    tree = _parses("\n".join(block))
    if tree is not None and tree.body and isinstance(tree.body[0], ast.FunctionDef):
        return _returns(tree.body[0])
    return any(re.match(r"\s+return\b", line) for line in block[1:])


def defined_with_return(code: str, name: str) -> bool:
    """Whether `code` defines function `name` at top level with a return statement in its
    own body (Appendix C, Structural Integrity: "properly defined and include return
    statements"); the last definition counts, as in Python."""
    tree = _parses(code)
    if tree is None:
        return _defined_by_lines(code, name)
    functions = [node for node in tree.body
                 if isinstance(node, ast.FunctionDef) and node.name == name]
    return bool(functions) and _returns(functions[-1])


def compiles(program: str) -> bool:
    """Appendix C, Syntactical Correctness: the joint program compiles (nothing runs)."""
    with warnings.catch_warnings():  # a SyntaxWarning ("is" with a literal) is no error
        warnings.simplefilter("ignore")
        try:
            compile(program, "<magrpo_code>", "exec", dont_inherit=True)
        except (SyntaxError, ValueError, RecursionError):  # ValueError: a null byte
            return False
    return True


# ------------------------------------------------------------------------------ cooperation

def _is_aux_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
        and node.func.id == AUX_NAME


def _calls_aux(node: ast.AST) -> bool:
    return any(_is_aux_call(n) for n in ast.walk(node))


def _binds_aux(node: ast.AST) -> bool:
    """Whether a node binds the name `aux` (a def, class, argument, assignment or import)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name == AUX_NAME
    if isinstance(node, ast.arg):
        return node.arg == AUX_NAME
    if isinstance(node, ast.Name):
        return node.id == AUX_NAME and not isinstance(node.ctx, ast.Load)
    if isinstance(node, ast.alias):
        return (node.asname or node.name.split(".")[0]) == AUX_NAME
    return False


def _discards(call: ast.Call, parents: dict[ast.AST, ast.AST], read: set[str]) -> bool:
    """Whether an aux call's value is thrown away: a bare statement, or assigned to names the
    main function never reads."""
    parent = parents[call]
    if isinstance(parent, ast.Expr):
        return True
    if isinstance(parent, (ast.Assign, ast.AnnAssign)) and parent.value is call:
        targets = parent.targets if isinstance(parent, ast.Assign) else [parent.target]
        return all(isinstance(t, ast.Name) and t.id not in read for t in targets)
    return False


def _is_wrapper(main: ast.FunctionDef) -> bool:
    """`return <aux call expression>`, or `x = <aux call expression>; return x`, and nothing
    else but a docstring."""
    body = main.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    if len(body) == 1 and isinstance(body[0], ast.Return):
        return body[0].value is not None and _calls_aux(body[0].value)
    if len(body) == 2 and isinstance(body[0], ast.Assign) and isinstance(body[1], ast.Return):
        targets, returned = body[0].targets, body[1].value
        return len(targets) == 1 and isinstance(targets[0], ast.Name) \
            and _calls_aux(body[0].value) \
            and isinstance(returned, ast.Name) and returned.id == targets[0].id
    return False


def _cooperation(program: str, main_first_line: int, entry_point: str) -> tuple[bool, bool, bool]:
    """(calls_aux, discards_aux_result, wraps_aux) of the main function in a compiled program."""
    main_part = [node for node in ast.parse(program).body if node.lineno >= main_first_line]
    mains = [node for node in main_part
             if isinstance(node, ast.FunctionDef) and node.name == entry_point]
    if not mains or any(_binds_aux(n) for node in main_part for n in ast.walk(node)):
        return False, False, False  # the main agent's own aux is not the helper's
    main = mains[-1]
    calls = [node for node in ast.walk(main) if _is_aux_call(node)]
    if not calls:
        return False, False, False
    parents = {child: parent for parent in ast.walk(main)
               for child in ast.iter_child_nodes(parent)}
    read = {node.id for node in ast.walk(main)
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
    return True, any(_discards(call, parents, read) for call in calls), _is_wrapper(main)


# ------------------------------------------------------------------------------ reward

def code_checks(prompt: str, entry_point: str, aux_code: str, main_code: str) -> CodeChecks:
    """The static checks of the pair and the joint program (nothing runs).

    Args:
        prompt: the task's prompt (HumanEval: imports, signature, docstring, maybe helpers).
        entry_point: the name of the main function.
        aux_code, main_code: the helper's and the main agent's code (`agent_code` of a reply).

    Raises:
        ValueError: the prompt itself does not parse.
    """
    program, main_first_line = _joint(prompt, entry_point, aux_code, main_code)
    main_defined = defined_with_return(main_code, entry_point)
    ok = compiles(program)
    calls, discards, wraps = _cooperation(program, main_first_line, entry_point) \
        if main_defined and ok else (False, False, False)
    return CodeChecks(program, defined_with_return(aux_code, AUX_NAME), main_defined, ok,
                      calls, discards, wraps)


def level_reward(checks: CodeChecks, passed: Sequence[bool]) -> LevelReward:
    """MAGRPO's level-based joint reward (module docstring), each level gated on the earlier.

    Args:
        checks: `code_checks` of the pair.
        passed: one bool per hidden test, from running `checks.program` on the hidden suite;
            read only when `checks.needs_tests` (pass () otherwise).

    Raises:
        ValueError: `passed` is empty although the tests level is reached.
    """
    structure = STRUCTURE_AUX * checks.aux_defined + STRUCTURE_MAIN * checks.main_defined
    if not checks.main_defined:
        return LevelReward(structure, 0.0, 0.0, 0.0, "structure")
    if not checks.compiles:
        return LevelReward(structure, 0.0, 0.0, 0.0, "syntax")
    if not passed:
        raise ValueError("level_reward: empty pass vector; run checks.program on the hidden "
                         "suite (humaneval.hidden_suite always holds at least one test)")
    tests = TESTS * sum(map(bool, passed)) / len(passed)
    if tests == 0:
        return LevelReward(structure, SYNTAX, 0.0, 0.0, "tests")
    cooperation = 0.0
    if checks.aux_defined and checks.calls_aux:
        cooperation = COOPERATION_CALL \
            + COOPERATION_BEYOND_WRAPPER * (not checks.wraps_aux) \
            - COOPERATION_DISCARDED * checks.discards_aux_result
    return LevelReward(structure, SYNTAX, tests, cooperation, "")
