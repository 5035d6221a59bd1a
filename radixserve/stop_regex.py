"""``stop_regex``: stop a request's output where a regular expression matches it (SGLang's field).

A stop string ends the output where it occurs; a stop regex where its pattern first matches
the output text (Python's ``re`` syntax, as SGLang reads it). The matched text is cut off,
like a stop string's (kept with ``include_stop_str_in_output`` / ``no_stop_trim``), and
the finish reason's ``matched`` names the pattern, as SGLang reports it.

The router matches patterns from anyone who can send a request, so each bound here is
checked before anything proportional to it runs:

* at most :data:`MAX_PATTERNS` patterns of at most :data:`MAX_PATTERN_CHARS` characters;
* a pattern's program is bounded before it is compiled (:func:`pattern_size`): the
  ``regex`` module expands bounded repeats, so ``(?:(?:a{1000}){1000}){1000}`` would take
  tens of gigabytes to compile;
* matching a request's output takes at most :data:`CPU_LIMIT_S` of the router's CPU in
  all, a call cut off by ``regex``'s own timeout at what is left: a backtracking pattern
  such as ``(a|a)*$`` fails its request with :class:`StopRegexTimeout` instead of stalling
  every request the router serves.

Matching uses the ``regex`` module (a superset of ``re``) for two things ``re`` lacks: the
timeout, and partial matches, which say how much of the streamed text could still become a
match and so must be held back until it is decided.

Torch-free, like :mod:`radixserve.sampling_params`.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import regex

#: At most this many patterns per request, each at most this many characters.
MAX_PATTERNS = 16
MAX_PATTERN_CHARS = 1024
#: The most nodes a pattern's program may have once bounded repeats are expanded.
MAX_PATTERN_SIZE = 10_000
#: The router CPU one request's patterns may take to match its whole output.
CPU_LIMIT_S = 0.25

_REPEATS = {"MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"}
# Python's own parser of ``re`` syntax (private, but the one parser of the syntax we accept).
_parser: Any = re._parser
_SubPattern = _parser.SubPattern
_MAXREPEAT = re._constants.MAXREPEAT  # type: ignore[attr-defined]


class StopRegexTimeout(RuntimeError):
    """A request's stop patterns took more than :data:`CPU_LIMIT_S` to match its output."""


class Match(NamedTuple):
    """Where a stop pattern matched the output text."""

    start: int
    end: int
    pattern: str


def pattern_size(parsed: Any) -> int:
    """Nodes of a parsed pattern's program (``re._parser``'s tree) with each bounded repeat
    counted as many times as it may repeat: what compiling it with ``regex`` builds."""
    size = 0
    for op, arg in parsed:
        if str(op) in _REPEATS:
            low, high, sub = arg
            times = low if high == _MAXREPEAT else high
            size += max(1, times) * pattern_size(sub)
        else:  # groups, branches, assertions, conditionals: their subpatterns, and one node
            size += 1 + sum(pattern_size(sub) for sub in _subpatterns(arg))
    return size


def _subpatterns(arg: Any) -> list[Any]:
    """The subpatterns inside one node's argument (nested in tuples and lists)."""
    if isinstance(arg, _SubPattern):
        return [arg]
    if isinstance(arg, (tuple, list)):
        return [sub for item in arg for sub in _subpatterns(item)]
    return []


def pattern_errors(patterns: Sequence[str]) -> list[str]:
    """Why ``patterns`` are refused as stop patterns (none: all may be used)."""
    if len(patterns) > MAX_PATTERNS:
        return [f"stop_regex has {len(patterns)} patterns, more than {MAX_PATTERNS}"]
    errors = []
    for pattern in patterns:
        shown = pattern[:64] + ("..." if len(pattern) > 64 else "")
        if not pattern:
            errors.append("stop_regex patterns must be non-empty")
        elif len(pattern) > MAX_PATTERN_CHARS:
            errors.append(
                f"stop_regex pattern {shown!r} has {len(pattern)} characters, "
                f"more than {MAX_PATTERN_CHARS}"
            )
        elif (why := _pattern_error(pattern)) is not None:
            errors.append(f"stop_regex pattern {shown!r} {why}")
    return errors


def _pattern_error(pattern: str) -> str | None:
    try:
        parsed = _parser.parse(pattern)
    except (re.error, RecursionError, OverflowError) as exc:
        return f"is not a valid regular expression: {exc}"
    size = pattern_size(parsed)
    if size > MAX_PATTERN_SIZE:
        return f"expands to {size} nodes once its repeats are counted, more than {MAX_PATTERN_SIZE}"
    try:
        compiled = _compile(pattern)
    except regex.error as exc:  # the few spellings ``re`` reads and ``regex`` does not
        return f"is not a valid regular expression: {exc}"
    if compiled.fullmatch("") is not None:
        return "matches the empty string, so it would end every output before it began"
    return None


@functools.lru_cache(maxsize=256)
def _compile(pattern: str) -> Any:
    """``pattern`` compiled by ``regex`` (call after :func:`pattern_errors` accepted it)."""
    return regex.compile(pattern)


class StopPatterns:
    """A request's stop patterns, matched against its output text within a CPU budget."""

    def __init__(self, patterns: Sequence[str]) -> None:
        self._compiled = [(p, _compile(p)) for p in patterns]
        self._cpu_left = CPU_LIMIT_S

    def __bool__(self) -> bool:
        return bool(self._compiled)

    def first_match(self, text: str, pos: int) -> Match | None:
        """The match that starts first at or after ``pos`` (ties: the longest), or None."""
        best: Match | None = None
        for pattern, compiled in self._compiled:
            m = self._search(compiled, text, pos, partial=False)
            if m is not None and (best is None or (m.start(), -m.end()) < (best.start, -best.end)):
                best = Match(m.start(), m.end(), pattern)
        return best

    def undecided_from(self, text: str, pos: int) -> int:
        """Where, at or after ``pos``, the text that more output could still make a match
        begins (``len(text)``: none could): streamed text from there on is held back."""
        start = len(text)
        for _, compiled in self._compiled:
            m = self._search(compiled, text, pos, partial=True)
            if m is not None:
                start = min(start, m.start())
        return start

    def _search(self, compiled: Any, text: str, pos: int, partial: bool) -> Any:
        if self._cpu_left <= 0:
            raise StopRegexTimeout(self._timeout_message())
        began = time.thread_time()
        try:
            # regex's timeout is wall-clock time: it cuts off one call, the CPU the calls
            # took is what is counted (a search takes microseconds: descheduling within one
            # for the whole budget is not a case to serve).
            return compiled.search(text, pos, partial=partial, timeout=self._cpu_left)
        except TimeoutError:
            self._cpu_left = 0.0
            raise StopRegexTimeout(self._timeout_message()) from None
        finally:
            self._cpu_left -= time.thread_time() - began

    @staticmethod
    def _timeout_message() -> str:
        return (
            f"matching stop_regex took more than {CPU_LIMIT_S} s of CPU: "
            "a pattern that backtracks this much cannot be served; simplify it"
        )
