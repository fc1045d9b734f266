"""Strict parsing of coach replies (DESIGN §8, MAPPA appendix B.4).

A reply must state `PROCESS_SCORE: N` with N in 0–10; the value may be written `8`, `**8**`,
`8/10` or `[8]`, and the label may be bold (`**PROCESS_SCORE:** 8`). Every occurrence of the
label must carry a readable value and all must agree. A decimal at or below 1 (`0.8`, `1.0`)
is refused: MAPPA's own example replies (appendix D) print such values, and whether `0.8`
means 0.8/10 or 8/10 cannot be told, so reading either would invent a score.
`ANSWER_CORRECT: 0|1` is optional unless the caller requires it; a present but unreadable
one makes the reply unparsable. The backward chain of reward backpropagation (MAPPA
appendix F) answers `CONTRIBUTION: D` with D in −10..10 and `RESIDUAL: <text>`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

# label, then a value in one of the accepted wrappings; the value group is checked after
_LABEL = r"^[ \t>*_#-]*{name}[*_ \t]*[:=][*_ \t]*(?P<value>[^\n]*)$"
_VALUE = re.compile(
    r"^(?:\*\*(?P<bold>[-+]?\d+(?:\.\d+)?)\*\*"
    r"|\[(?P<bracket>[-+]?\d+(?:\.\d+)?)\]"
    r"|(?P<plain>[-+]?\d+(?:\.\d+)?)(?:\s*/\s*(?P<denominator>\d+))?)"
    r"[*_ \t.]*$")


class Unparsable(ValueError):
    """The reply does not follow the required format; the message says what is wrong."""


@dataclass(frozen=True)
class Verdict:
    """A coach's reading of one action: `score` = N/10 in [0, 1] (MAPPA §2.3)."""

    score: float
    answer_correct: int | None = None


@dataclass(frozen=True)
class Attribution:
    """One backward step (MAPPA F.2): contribution Δ = D/10 in [−1, 1] and the residual."""

    delta: float
    residual: str


def _label(name: str) -> re.Pattern:
    return re.compile(_LABEL.format(name=name), re.IGNORECASE | re.MULTILINE)


_SCORE, _ANSWER = _label("PROCESS_SCORE"), _label("ANSWER_CORRECT")
_CONTRIBUTION, _RESIDUAL = _label("CONTRIBUTION"), _label("RESIDUAL")


def _number(raw: str, label: str, low: int, high: int) -> float:
    match = _VALUE.match(raw.strip())
    if not match:
        raise Unparsable(f"{label} value {raw.strip()!r} is not N, **N**, N/10 or [N]")
    text = match.group("bold") or match.group("bracket") or match.group("plain")
    denominator = match.group("denominator")
    if denominator is not None and denominator != "10":
        raise Unparsable(f"{label} {text}/{denominator}: only /10 is accepted")
    value = float(text)
    if "." in text and abs(value) <= 1:
        raise Unparsable(f"{label} {text}: a decimal at or below 1 is ambiguous between the "
                         "0-1 and 0-10 scales")
    if not low <= value <= high:
        raise Unparsable(f"{label} {text} is outside {low}..{high}")
    return value


def _single(pattern: re.Pattern, reply: str, label: str, low: int, high: int) -> float | None:
    values = {_number(m.group("value"), label, low, high) for m in pattern.finditer(reply)}
    if len(values) > 1:
        raise Unparsable(f"{label} given {len(values)} different values: {sorted(values)}")
    return values.pop() if values else None


def parse_verdict(reply: str, require_answer: bool = False) -> Verdict:
    """`PROCESS_SCORE` (required) and `ANSWER_CORRECT` (required when `require_answer`)."""
    score = _single(_SCORE, reply, "PROCESS_SCORE", 0, 10)
    if score is None:
        raise Unparsable("no PROCESS_SCORE line")
    answer = _single(_ANSWER, reply, "ANSWER_CORRECT", 0, 1)
    if answer is not None and answer not in (0, 1):
        raise Unparsable(f"ANSWER_CORRECT {answer}: must be 0 or 1")
    if require_answer and answer is None:
        raise Unparsable("no ANSWER_CORRECT line, required for this agent")
    return Verdict(score / 10.0, None if answer is None else int(answer))


def parse_attribution(reply: str) -> Attribution:
    """`CONTRIBUTION: D` (−10..10, required) and a non-empty `RESIDUAL:` line."""
    delta = _single(_CONTRIBUTION, reply, "CONTRIBUTION", -10, 10)
    if delta is None:
        raise Unparsable("no CONTRIBUTION line")
    residuals = [m.group("value").strip() for m in _RESIDUAL.finditer(reply)]
    if not residuals or not residuals[-1]:
        raise Unparsable("no RESIDUAL line with text")
    return Attribution(delta / 10.0, residuals[-1])
