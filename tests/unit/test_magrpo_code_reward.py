"""MAGRPO's level-based code reward (actors/workflows/magrpo_code_reward.py), worked by hand.

Pure: static checks on code strings and hand-written pass vectors; nothing runs in a sandbox.
Every expected total is structure (0.4 aux + 0.6 main) + syntax (0.5) + tests (1.0 x rate) +
cooperation (0.5 call + 1.0 beyond a wrapper - 0.5 discarded result), each level only when the
ones before it passed; each case writes out its sum.
"""
import pytest

from actors.workflows.humaneval import hidden_suite, load_humaneval
from actors.workflows.magrpo_code_reward import (MAX_REWARD, LevelReward, agent_code,
                                                 code_checks, compiles, defined_with_return,
                                                 joint_program, level_reward)

PROMPT = ('from typing import List\n\n\ndef sum_of_squares(numbers: List[int]) -> int:\n'
          '    """The sum of the squares of `numbers`."""\n')
ENTRY = "sum_of_squares"
AUX = "def aux(x):\n    return x * x\n"
MAIN = ("def sum_of_squares(numbers):\n    total = 0\n    for n in numbers:\n"
        "        total += aux(n)\n    return total\n")
ALL, NONE, TWO_OF_THREE = (True, True, True), (False, False, False), (True, False, True)


def reward(aux_code: str, main_code: str, passed=ALL, prompt=PROMPT, entry=ENTRY) -> LevelReward:
    return level_reward(code_checks(prompt, entry, aux_code, main_code), passed)


def levels(r: LevelReward) -> tuple:
    return (r.structure, r.syntax, pytest.approx(r.tests), r.cooperation, r.stopped_at)


def humaneval(entry_point: str) -> dict:
    return next(r for r in load_humaneval() if r["entry_point"] == entry_point)


# ------------------------------------------------------------------------------ paper's examples

# Appendix B "Cooperation Schemes", Listings 1, 3 and 4 (magrpo.txt lines 404-518), verbatim:
# the main agent as fallback, coordinator and strategy filter. Each calls aux, uses its value and
# does more than wrap it: the full cooperation bonus. The pass counts were measured once by
# running the joint program on the real hidden suite in the sandbox (humaneval.run_jobs);
# Listing 1 fails 2 of HumanEval/137's 8 tests (the paper: "may still be vulnerable").
LISTING_1_AUX = '''def aux(x, y):
    # Convert x to a float
    if isinstance(x, str):
        x = float(x.replace(",", "."))

    # Vulnerable if y in different types
    if x < y:
        return y
    else:
        return x
'''
LISTING_1_MAIN = '''def compare_one(a, b):
    try:
        return aux(a, b)
    except Exception:
        # Robust implementation
        if type(a) == type(b):
            if a > b:
                return a
            elif a < b:
                return b
            else:
                return None
        elif type(a) == float and type(b) == str:
            b_float = float(b.replace(",", "."))
            if a > b_float:
                return a
            elif a < b_float:
                return b_float
            else:
                return None
        elif type(a) == str and type(b) == float:
            a_str = str(a.replace(",", "."))
            a_float = float(a_str)
            if a_float > b:
                return a_str
            elif a_float < b:
                return b
            else:
                return None
        else:
            return None
'''
LISTING_3_AUX = '''def aux(string: str) -> str:
    result = ""
    for char in string:
        if char.islower():
            result += char.upper()
        elif char.isupper():
            result += char.lower()
        else:
            result += char
    return result
'''
LISTING_3_MAIN = '''def flip_case(string: str):
    flipped = ""
    for char in string:
        flipped += aux(char)
    return flipped
'''
LISTING_4_AUX = '''def aux(n):
    if n < 2:
        return False
    if n == 2:
        return True
    if n % 2 == 0:
        return False
    for i in range(3, int(n**0.5) + 1, 2):
        if n % i == 0:
            return False
    return True
'''
LISTING_4_MAIN = '''def x_or_y(n, x, y):
    # Check if n is prime
    if aux(n):
        return x
    else:
        return y
'''


@pytest.mark.parametrize("entry,aux_code,main_code,passed,total", [
    # fallback (HumanEval/137): .4 + .6 + .5 + 6/8 + (.5 + 1.0) = 3.75
    ("compare_one", LISTING_1_AUX, LISTING_1_MAIN, 6, 3.75),
    # coordinator (HumanEval/27): .4 + .6 + .5 + 3/3 + (.5 + 1.0) = 4.0, the maximum
    ("flip_case", LISTING_3_AUX, LISTING_3_MAIN, 3, 4.0),
    # strategy filter (HumanEval/150): .4 + .6 + .5 + 10/10 + (.5 + 1.0) = 4.0
    ("x_or_y", LISTING_4_AUX, LISTING_4_MAIN, 10, 4.0),
])
def test_the_papers_cooperation_schemes(entry, aux_code, main_code, passed, total):
    record = humaneval(entry)
    checks = code_checks(record["prompt"], entry, aux_code, main_code)
    assert (checks.aux_defined, checks.main_defined, checks.compiles) == (True, True, True)
    assert (checks.calls_aux, checks.discards_aux_result, checks.wraps_aux) == (True, False, False)
    num_tests = hidden_suite(record["test"], entry).num_tests
    r = level_reward(checks, [True] * passed + [False] * (num_tests - passed))
    assert levels(r) == (1.0, 0.5, passed / num_tests, 1.5, "")
    assert r.total == pytest.approx(total) and MAX_REWARD == 4.0


# ------------------------------------------------------------------------------ structure

def test_full_marks():
    r = reward(AUX, MAIN)
    assert levels(r) == (1.0, 0.5, 1.0, 1.5, "") and r.total == 4.0  # 1.0 + .5 + 1.0 + 1.5


def test_missing_aux_loses_its_points_and_the_bonus_but_the_evaluation_goes_on():
    own = "def sum_of_squares(numbers):\n    return sum(n * n for n in numbers)\n"
    r = reward("def helper(x):\n    return x * x\n", own)
    assert levels(r) == (0.6, 0.5, 1.0, 0.0, "") and r.total == pytest.approx(2.1)  # .6+.5+1
    # a main that counts on the missing aux fails every test (NameError): .6 + .5 + 0
    r = reward("", MAIN, NONE)
    assert levels(r) == (0.6, 0.5, 0.0, 0.0, "tests") and r.total == pytest.approx(1.1)


def test_aux_without_a_return_statement_is_not_defined():
    printing = "def aux(x):\n    print(x * x)\n"
    assert not defined_with_return(printing, "aux")
    # tests partly pass (the hand-written vector says 1 of 3); no bonus without a defined aux:
    # .6 + .5 + 1/3 + 0
    r = reward(printing, MAIN, (True, False, False))
    assert levels(r) == (0.6, 0.5, 1 / 3, 0.0, "")
    # a return inside a nested function is not the function's own
    nested = "def aux(x):\n    def inner():\n        return x\n    inner()\n"
    assert not defined_with_return(nested, "aux")


def test_wrong_main_name_ends_the_evaluation_at_structure():
    wrong = MAIN.replace("def sum_of_squares", "def sum_squares")
    checks = code_checks(PROMPT, ENTRY, AUX, wrong)
    assert not checks.main_defined and not checks.needs_tests
    r = level_reward(checks, ())  # the pass vector is not read: no test run needed
    assert levels(r) == (0.4, 0.0, 0.0, 0.0, "structure") and r.total == 0.4
    # a main without a return statement, or none at all, is the same
    no_return = "def sum_of_squares(numbers):\n    total = sum(aux(n) for n in numbers)\n"
    assert reward(AUX, no_return, ()).total == 0.4
    assert levels(reward("", "", ())) == (0.0, 0.0, 0.0, 0.0, "structure")


def test_only_a_top_level_def_counts_and_the_last_one_wins():
    indented = "class Solution:\n    def sum_of_squares(self, numbers):\n        return 0\n"
    assert not defined_with_return(indented, ENTRY)
    redefined = MAIN + "\n\ndef sum_of_squares(numbers):\n    pass\n"
    assert not defined_with_return(redefined, ENTRY)


# ------------------------------------------------------------------------------ syntax

def test_a_syntax_error_ends_the_evaluation_at_syntax():
    unclosed = "def sum_of_squares(numbers):\n    return sum(aux(n) for n in numbers\n"
    checks = code_checks(PROMPT, ENTRY, AUX, unclosed)
    assert checks.main_defined and not checks.compiles and not checks.needs_tests
    r = level_reward(checks, ())
    assert levels(r) == (1.0, 0.0, 0.0, 0.0, "syntax") and r.total == 1.0  # .4 + .6
    # in the helper's code too: the joint program is what compiles or not
    broken_aux = "def aux(x):\n    return x *\n"
    assert levels(reward(broken_aux, MAIN, ())) == (1.0, 0.0, 0.0, 0.0, "syntax")


def test_syntax_is_what_the_compiler_accepts_not_only_the_parser():
    # parses (ast.parse accepts it) but does not compile: 'break' outside loop
    breaks = ("def sum_of_squares(numbers):\n    if not numbers:\n        break\n"
              "    return sum(aux(n) for n in numbers)\n")
    assert not compiles(breaks)
    assert levels(reward(AUX, breaks, ())) == (1.0, 0.0, 0.0, 0.0, "syntax")


# ------------------------------------------------------------------------------ tests

def test_no_test_passed_ends_the_evaluation_at_tests():
    r = reward(AUX, MAIN, NONE)
    assert levels(r) == (1.0, 0.5, 0.0, 0.0, "tests") and r.total == 1.5  # no bonus either


def test_two_of_three_tests():
    r = reward(AUX, MAIN, TWO_OF_THREE)
    # .4 + .6 + .5 + 2/3 + 1.5 = 3.667
    assert levels(r) == (1.0, 0.5, 2 / 3, 1.5, "") and r.total == pytest.approx(11 / 3)


def test_an_empty_pass_vector_past_syntax_is_an_error():
    with pytest.raises(ValueError, match="empty pass vector"):
        reward(AUX, MAIN, ())


# ------------------------------------------------------------------------------ cooperation

def test_main_that_defines_itself_but_never_calls_aux_gets_no_bonus():
    own = "def sum_of_squares(numbers):\n    return sum(n * n for n in numbers)\n"
    checks = code_checks(PROMPT, ENTRY, AUX, own)
    assert not checks.calls_aux
    assert levels(level_reward(checks, ALL)) == (1.0, 0.5, 1.0, 0.0, "")  # 2.5
    # "aux(" in a comment or a string is no call
    mention = own.replace("    return", "    # could use aux(n)\n    return")
    assert not code_checks(PROMPT, ENTRY, AUX, mention).calls_aux


def test_main_that_calls_aux_but_ignores_its_result_loses_half():
    bare = ("def sum_of_squares(numbers):\n    aux(0)\n"
            "    return sum(n * n for n in numbers)\n")
    checks = code_checks(PROMPT, ENTRY, AUX, bare)
    assert (checks.calls_aux, checks.discards_aux_result, checks.wraps_aux) == (True, True, False)
    r = level_reward(checks, ALL)
    assert levels(r) == (1.0, 0.5, 1.0, 1.0, "") and r.total == 3.5  # coop .5 + 1.0 - .5
    unread = bare.replace("    aux(0)", "    unused = aux(0)")
    assert levels(reward(AUX, unread)) == (1.0, 0.5, 1.0, 1.0, "")
    # its value read later, or used in an expression, condition or argument: not discarded
    for used in ("    total = aux(2)\n    return total + sum(numbers)\n",
                 "    if aux(len(numbers)) > 4:\n        return 0\n    return 1\n",
                 "    return sum(map(lambda n: aux(n), numbers))\n"):
        checks = code_checks(PROMPT, ENTRY, AUX, f"def sum_of_squares(numbers):\n{used}")
        assert checks.calls_aux and not checks.discards_aux_result, used


def test_a_wrapper_gets_only_the_base_bonus():
    aux_all = "def aux(numbers):\n    return sum(n * n for n in numbers)\n"
    for body in ('    """Delegates."""\n    return aux(numbers)\n',
                 "    return aux(numbers) + 0\n",
                 "    result = aux(numbers)\n    return result\n"):
        checks = code_checks(PROMPT, ENTRY, aux_all, f"def sum_of_squares(numbers):\n{body}")
        assert checks.calls_aux and checks.wraps_aux, body
        r = level_reward(checks, ALL)
        assert levels(r) == (1.0, 0.5, 1.0, 0.5, "") and r.total == 3.0  # coop .5 only
    # an edge case handled before the call: more than a wrapper
    guarded = ("def sum_of_squares(numbers):\n    if not numbers:\n        return 0\n"
               "    return aux(numbers)\n")
    assert levels(reward(aux_all, guarded)) == (1.0, 0.5, 1.0, 1.5, "")


def test_main_that_brings_its_own_aux_does_not_cooperate():
    own_aux = "def aux(x):\n    return x ** 2\n\n\n" + MAIN  # line 639: "Do NOT redefine"
    assert levels(reward(AUX, own_aux)) == (1.0, 0.5, 1.0, 0.0, "")
    shadowed = MAIN.replace("    total = 0\n", "    aux = abs\n    total = 0\n")
    assert not code_checks(PROMPT, ENTRY, AUX, shadowed).calls_aux
    parameter = MAIN.replace("(numbers):", "(numbers, aux=abs):")
    assert not code_checks(PROMPT, ENTRY, AUX, parameter).calls_aux


# ------------------------------------------------------------------------------ code and program

def test_agent_code_reads_python_blocks_or_the_bare_reply():
    assert agent_code(f"Here it is:\n```python\n{AUX}```\nDone.") == AUX.rstrip("\n")
    assert agent_code(f"\n{AUX}") == AUX.rstrip("\n")  # the paper's prompts ask for bare code


def test_the_joint_program_keeps_the_prompts_imports_and_helpers_but_not_the_stub():
    record = humaneval("decode_cyclic")  # HumanEval/38: its tests call encode_cyclic
    main = "def decode_cyclic(s: str):\n    return aux(aux(s))\n"
    aux_code = ("def aux(s):\n    groups = [s[3 * i:min(3 * i + 3, len(s))] "
                "for i in range((len(s) + 2) // 3)]\n"
                "    groups = [(g[1:] + g[0]) if len(g) == 3 else g for g in groups]\n"
                "    return ''.join(groups)\n")
    program = joint_program(record["prompt"], "decode_cyclic", aux_code, main)
    assert "def encode_cyclic" in program and program.count("def decode_cyclic") == 1
    assert program.index("def aux") < program.index("def decode_cyclic") and compiles(program)
    program = joint_program(PROMPT, ENTRY, AUX, MAIN)
    assert program.startswith("from typing import List\n\ndef aux(x):")
    assert program.endswith("        total += aux(n)\n    return total\n")
