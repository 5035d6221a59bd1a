"""What a request is constrained to: one regex, one JSON schema, or one of a list of strings.

Torch-free and xgrammar-free, so that :class:`~radixserve.sampling_params.SamplingParams`
validation, the router and the gateways can use it without the grammar library.
"""

from __future__ import annotations

import json
import re
import re._parser as _sre_parse  # the stdlib's regex parser: xgrammar's regexes share its syntax
from typing import Any, Literal, NamedTuple

ConstraintKind = Literal["regex", "json_schema", "choices", "tagged_json", "structural_tag"]

#: The most characters a regex, a JSON schema or all choices together may have.
MAX_CONSTRAINT_CHARS = 64 << 10
#: The most positions a regex may expand to, its bounded repetitions multiplied out
#: (``(.{1,100}){1,100}`` is 10,000 and takes ~0.8 s to compile against a 49k vocabulary;
#: compile time grows with this count times the vocabulary). Past it, a clear error before
#: any compiling; :class:`~radixserve.constrained.grammar.GrammarCompiler` also bounds the
#: compile time of what passes.
MAX_REGEX_EXPANSION = 50_000

#: What OpenAI's ``response_format: {"type": "json_object"}`` means: any JSON object.
JSON_OBJECT_SCHEMA = '{"type": "object"}'


class Constraint(NamedTuple):
    """A hashable constraint: the key of the compiled-grammar cache.

    ``value`` is the regex, the JSON schema text, or the tuple of allowed strings.
    """

    kind: ConstraintKind
    value: str | tuple[str, ...]

    def describe(self) -> str:
        """A short human-readable form for error messages."""
        text = repr(self.value) if self.kind != "choices" else repr(list(self.value))
        return f"{self.kind} {text[:120]}{'...' if len(text) > 120 else ''}"


def regex_expansion(regex: str, cap: int = MAX_REGEX_EXPANSION) -> int | None:
    """How many positions ``regex`` spells out with its bounded repetitions expanded
    (an unbounded ``*``/``+`` counts its body once: it is a loop, not copies); stops
    counting past ``cap``. ``None`` when Python's parser cannot read it (the grammar
    library then reports its own error)."""
    try:
        tree = _sre_parse.parse(regex)
    except (re.error, RecursionError, OverflowError, ValueError):
        return None
    return min(_size(tree, cap), cap + 1)


def _size(items: Any, cap: int) -> int:
    total = 0
    for op, av in items:
        name = str(op)
        if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            lo, hi, sub = av
            copies = lo if hi == _sre_parse.MAXREPEAT else hi
            total += _size(sub, cap) * max(1, copies)
        elif name == "SUBPATTERN":
            total += _size(av[-1], cap)
        elif name == "BRANCH":
            total += sum(_size(b, cap) for b in av[1])
        elif name in ("ASSERT", "ASSERT_NOT"):
            total += _size(av[1], cap)
        else:
            total += 1
        if total > cap:
            return total
    return total


def constraint_errors(
    regex: str | None,
    json_schema: str | None,
    choices: list[str] | None,
    tagged_json: str | None = None,
    structural_tag: str | None = None,
) -> list[str]:
    """Cheap checks that need no grammar library (the compiler reports the rest).

    At most one constraint; a non-empty regex; a schema that is JSON text of an object or
    a boolean; a non-empty list of non-empty choices.
    """
    errors: list[str] = []
    named = (
        ("regex", regex),
        ("json_schema", json_schema),
        ("choices", choices),
        ("tagged_json", tagged_json),
        ("structural_tag", structural_tag),
    )
    given = [name for name, v in named if v is not None]
    if len(given) > 1:
        errors.append(
            "at most one of regex, json_schema, choices, tagged_json and structural_tag may "
            f"be set, got {', '.join(given)}"
        )
    if regex is not None and not regex:
        errors.append("regex must be non-empty")
    sizes = (
        ("regex", len(regex or "")),
        ("json_schema", len(json_schema or "")),
        ("choices", sum(len(c) for c in choices or ())),
        ("tagged_json", len(tagged_json or "")),
        ("structural_tag", len(structural_tag or "")),
    )
    for name, size in sizes:
        if size > MAX_CONSTRAINT_CHARS:
            errors.append(
                f"{name} has {size} characters, more than the limit of {MAX_CONSTRAINT_CHARS}"
            )
    if regex and len(regex) <= MAX_CONSTRAINT_CHARS:
        expansion = regex_expansion(regex)
        if expansion is not None and expansion > MAX_REGEX_EXPANSION:
            errors.append(
                f"regex is too complex to compile: its bounded repetitions expand to more than "
                f"{MAX_REGEX_EXPANSION} positions (use smaller bounds, or * and +)"
            )
    if json_schema is not None:
        try:
            schema: Any = json.loads(json_schema)
        except ValueError as e:
            errors.append(f"json_schema is not valid JSON text: {e}")
        except RecursionError:  # a few KB of "[[[[..." is enough to hit it
            errors.append("json_schema is nested too deeply")
        else:
            if not isinstance(schema, (dict, bool)):
                errors.append(
                    f"json_schema must be a JSON object (or a boolean), got {type(schema).__name__}"
                )
    if tagged_json is not None and len(tagged_json) <= MAX_CONSTRAINT_CHARS:
        errors += _tagged_json_errors(tagged_json)
    if structural_tag is not None and len(structural_tag) <= MAX_CONSTRAINT_CHARS:
        errors += _structural_tag_errors(structural_tag)
    if choices is not None:
        if not choices:
            errors.append("choices must list at least one string")
        elif any(not c for c in choices):
            errors.append("choices must be non-empty strings")
    return errors


def _tagged_json_errors(text: str) -> list[str]:
    try:
        spec: Any = json.loads(text)
    except (ValueError, RecursionError):
        return ["tagged_json is not valid JSON text"]
    if (
        not isinstance(spec, dict)
        or not isinstance(spec.get("begin", ""), str)
        or not isinstance(spec.get("end", ""), str)
        or not isinstance(spec.get("schema"), (dict, bool))
    ):
        return ['tagged_json must be {"begin": str, "schema": object, "end": str}']
    return []


def _structural_tag_errors(text: str) -> list[str]:
    try:
        spec: Any = json.loads(text)
    except (ValueError, RecursionError):
        return ["structural_tag is not valid JSON text"]
    if not isinstance(spec, dict) or not isinstance(spec.get("format"), dict):
        return ['structural_tag must be {"type": "structural_tag", "format": {...}} (xgrammar\'s)']
    return []


def constraint_of(
    regex: str | None,
    json_schema: str | None,
    choices: list[str] | None,
    tagged_json: str | None = None,
    structural_tag: str | None = None,
) -> Constraint | None:
    """The :class:`Constraint` of already validated parameters, or None when unconstrained."""
    if regex is not None:
        return Constraint("regex", regex)
    if json_schema is not None:
        return Constraint("json_schema", json_schema)
    if choices is not None:
        return Constraint("choices", tuple(choices))
    if tagged_json is not None:
        return Constraint("tagged_json", tagged_json)
    if structural_tag is not None:
        return Constraint("structural_tag", structural_tag)
    return None


class CompiledGrammar(NamedTuple):
    """A constraint compiled for one tokenizer; immutable and shared by every request using it."""

    constraint: Constraint
    grammar: Any  # xgr.CompiledGrammar
    vocab_size: int
    stop_token_ids: tuple[int, ...]
    guard: Any = None  # utf8.SurrogateGuard of the tokenizer (None: no guard, e.g. test fakes)
