"""The coach reply parser is strict: accepted forms map to N/10, anything else is refused."""
import pytest

from actors.coach.parse import Unparsable, parse_attribution, parse_verdict


@pytest.mark.parametrize("reply,score", [
    ("PROCESS_SCORE: 8", 0.8),
    ("Evaluation: fine.\n\nPROCESS_SCORE: **8**", 0.8),
    ("PROCESS_SCORE: 8/10", 0.8),
    ("PROCESS_SCORE: [8]", 0.8),
    ("**PROCESS_SCORE:** 7", 0.7),
    ("process_score: 0", 0.0),
    ("PROCESS_SCORE: 10", 1.0),
    ("PROCESS_SCORE: 7.5", 0.75),
    ("PROCESS_SCORE: 6\nnotes\nPROCESS_SCORE: 6", 0.6),  # repeated, same value
])
def test_accepted_forms(reply, score):
    assert parse_verdict(reply).score == pytest.approx(score)


@pytest.mark.parametrize("reply", [
    "",
    "The agent did well.",
    "PROCESS_SCORE: eight",
    "PROCESS_SCORE: 11",
    "PROCESS_SCORE: -1",
    "PROCESS_SCORE: 8/5",
    "PROCESS_SCORE: 0.8",  # MAPPA appendix D prints such values: 0-1 or 0-10? refused
    "PROCESS_SCORE: 1.0",
    "PROCESS_SCORE: 8 because it was good",
    "PROCESS_SCORE: [0 to 10]",  # the template echoed
    "PROCESS_SCORE: 3\nPROCESS_SCORE: 9",  # two different values
    "SCORE: 8",
    "**8**",  # a bare number is not a PROCESS_SCORE
])
def test_refused_replies(reply):
    with pytest.raises(Unparsable):
        parse_verdict(reply)


def test_answer_correct_optional_unless_required_and_strict_when_present():
    assert parse_verdict("PROCESS_SCORE: 9\nANSWER_CORRECT: 1").answer_correct == 1
    assert parse_verdict("PROCESS_SCORE: 9\nANSWER_CORRECT: 0", True).answer_correct == 0
    assert parse_verdict("PROCESS_SCORE: 9").answer_correct is None
    with pytest.raises(Unparsable, match="ANSWER_CORRECT"):
        parse_verdict("PROCESS_SCORE: 9", require_answer=True)
    with pytest.raises(Unparsable):
        parse_verdict("PROCESS_SCORE: 9\nANSWER_CORRECT: yes")


def test_attribution_needs_contribution_and_residual():
    a = parse_attribution("CONTRIBUTION: -3\nRESIDUAL: the solver's slip explains the rest")
    assert a.delta == pytest.approx(-0.3) and "solver" in a.residual
    assert parse_attribution("CONTRIBUTION: **10**\nRESIDUAL: none").delta == 1.0
    for bad in ("CONTRIBUTION: 4", "RESIDUAL: x", "CONTRIBUTION: 12\nRESIDUAL: x",
                "CONTRIBUTION: 3\nRESIDUAL:"):
        with pytest.raises(Unparsable):
            parse_attribution(bad)
