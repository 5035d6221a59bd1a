"""What a request is constrained to: a regex, a JSON schema, one of a list of strings, a
grammar (EBNF, as xgrammar and llama.cpp write it) or a structural tag.

Torch-free and xgrammar-free, so that :class:`~radixserve.sampling_params.SamplingParams`
validation, the router and the gateways can use it without the grammar library.
"""

from __future__ import annotations

import json
import re
import re._parser as _sre_parse  # the stdlib's regex parser: xgrammar's regexes share its syntax
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

ConstraintKind = Literal["regex", "json_schema", "choices", "tagged_json", "structural_tag", "ebnf"]

#: SamplingParams' constraint fields, in the order :func:`constraint_of` reads them.
CONSTRAINT_FIELDS: tuple[ConstraintKind, ...] = (
    "regex",
    "json_schema",
    "choices",
    "tagged_json",
    "structural_tag",
    "ebnf",
)

#: The most characters a regex, a JSON schema, a grammar or all choices together may have.
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


def constraint_errors(fields: Mapping[str, Any]) -> list[str]:
    """Cheap checks that need no grammar library (the compiler reports the rest).

    ``fields``: each of :data:`CONSTRAINT_FIELDS` to its value (``None``: not set). At most
    one set; each within :data:`MAX_CONSTRAINT_CHARS`; a non-empty regex whose bounded
    repetitions expand to at most :data:`MAX_REGEX_EXPANSION` positions; a schema that is
    JSON text of an object or a boolean; a non-empty list of non-empty choices; a
    non-empty grammar.
    """
    errors: list[str] = []
    given = [name for name in CONSTRAINT_FIELDS if fields.get(name) is not None]
    if len(given) > 1:
        errors.append(
            f"at most one of {', '.join(CONSTRAINT_FIELDS[:-1])} and {CONSTRAINT_FIELDS[-1]} "
            f"may be set, got {', '.join(given)}"
        )
    for name in given:
        value = fields[name]
        size = sum(len(c) for c in value) if name == "choices" else len(value)
        if size > MAX_CONSTRAINT_CHARS:
            errors.append(
                f"{name} has {size} characters, more than the limit of {MAX_CONSTRAINT_CHARS}"
            )
        else:
            errors += _CHECKS[name](value)
    return errors


def _regex_errors(regex: str) -> list[str]:
    if not regex:
        return ["regex must be non-empty"]
    expansion = regex_expansion(regex)
    if expansion is not None and expansion > MAX_REGEX_EXPANSION:
        return [
            f"regex is too complex to compile: its bounded repetitions expand to more than "
            f"{MAX_REGEX_EXPANSION} positions (use smaller bounds, or * and +)"
        ]
    return []


def _json_schema_errors(text: str) -> list[str]:
    try:
        schema: Any = json.loads(text)
    except ValueError as e:
        return [f"json_schema is not valid JSON text: {e}"]
    except RecursionError:  # a few KB of "[[[[..." is enough to hit it
        return ["json_schema is nested too deeply"]
    if not isinstance(schema, (dict, bool)):
        return [f"json_schema must be a JSON object (or a boolean), got {type(schema).__name__}"]
    return []


def _choices_errors(choices: list[str]) -> list[str]:
    if not choices:
        return ["choices must list at least one string"]
    if any(not c for c in choices):
        return ["choices must be non-empty strings"]
    return []


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


def _ebnf_errors(grammar: str) -> list[str]:
    return [] if grammar.strip() else ["ebnf must be a non-empty grammar"]


_CHECKS: dict[str, Any] = {
    "regex": _regex_errors,
    "json_schema": _json_schema_errors,
    "choices": _choices_errors,
    "tagged_json": _tagged_json_errors,
    "structural_tag": _structural_tag_errors,
    "ebnf": _ebnf_errors,
}


def constraint_of(fields: Mapping[str, Any]) -> Constraint | None:
    """The :class:`Constraint` of already validated fields (as :func:`constraint_errors`
    takes them), or None when unconstrained."""
    for name in CONSTRAINT_FIELDS:
        value = fields.get(name)
        if value is not None:
            return Constraint(name, tuple(value) if name == "choices" else value)
    return None


def structural_tag_text(spec: Any) -> str:
    """A structural tag as JSON text in xgrammar's current form, from either form clients
    send: ``{"type": "structural_tag", "format": {...}}``, or the older one SGLang's and
    vLLM's examples use, ``{"type": "structural_tag", "structures": [{"begin", "schema",
    "end"}], "triggers": [...]}`` (free text until a trigger, then one of the structures),
    rewritten as the ``triggered_tags`` format xgrammar itself reads it as. ``ValueError``
    when it is neither."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except (ValueError, RecursionError):
            raise ValueError("structural_tag is not valid JSON text") from None
    if not isinstance(spec, dict):
        raise ValueError("structural_tag must be a JSON object")
    if "format" in spec:
        return json.dumps({"type": "structural_tag", "format": spec["format"]})
    structures, triggers = spec.get("structures"), spec.get("triggers")
    if not (isinstance(structures, list) and structures and isinstance(triggers, list)):
        raise ValueError(
            'structural_tag must have a "format", or "structures" and "triggers" lists'
        )
    tags = []
    for s in structures:
        if not (
            isinstance(s, dict)
            and all(isinstance(s.get(k), str) for k in ("begin", "end"))
            and isinstance(s.get("schema"), (dict, bool))
        ):
            raise ValueError(
                'each of structural_tag.structures needs "begin" and "end" strings and a "schema"'
            )
        content = {"type": "json_schema", "json_schema": s["schema"]}
        tags.append({"type": "tag", "begin": s["begin"], "content": content, "end": s["end"]})
    fmt = {"type": "triggered_tags", "triggers": triggers, "tags": tags}
    return json.dumps({"type": "structural_tag", "format": fmt})


class CompiledGrammar(NamedTuple):
    """A constraint compiled for one tokenizer; immutable and shared by every request using it."""

    constraint: Constraint
    grammar: Any  # xgr.CompiledGrammar
    vocab_size: int
    stop_token_ids: tuple[int, ...]
    guard: Any = None  # utf8.SurrogateGuard of the tokenizer (None: no guard, e.g. test fakes)
