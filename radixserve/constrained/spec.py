"""What a request is constrained to: one regex, one JSON schema, or one of a list of strings.

Torch-free and xgrammar-free, so that :class:`~radixserve.sampling_params.SamplingParams`
validation, the router and the gateways can use it without the grammar library.
"""

from __future__ import annotations

import json
from typing import Any, Literal, NamedTuple

ConstraintKind = Literal["regex", "json_schema", "choices"]

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


def constraint_errors(regex: str | None, json_schema: str | None, choices: list[str] | None) -> list[str]:
    """Cheap checks that need no grammar library (the compiler reports the rest).

    At most one constraint; a non-empty regex; a schema that is JSON text of an object or
    a boolean; a non-empty list of non-empty choices.
    """
    errors: list[str] = []
    named = (("regex", regex), ("json_schema", json_schema), ("choices", choices))
    given = [name for name, v in named if v is not None]
    if len(given) > 1:
        errors.append(f"at most one of regex, json_schema and choices may be set, got {', '.join(given)}")
    if regex is not None and not regex:
        errors.append("regex must be non-empty")
    if json_schema is not None:
        try:
            schema: Any = json.loads(json_schema)
        except ValueError as e:
            errors.append(f"json_schema is not valid JSON text: {e}")
        except RecursionError:  # a few KB of "[[[[..." is enough to hit it
            errors.append("json_schema is nested too deeply")
        else:
            if not isinstance(schema, (dict, bool)):
                errors.append(f"json_schema must be a JSON object (or a boolean), got {type(schema).__name__}")
    if choices is not None:
        if not choices:
            errors.append("choices must list at least one string")
        elif any(not c for c in choices):
            errors.append("choices must be non-empty strings")
    return errors


def constraint_of(regex: str | None, json_schema: str | None, choices: list[str] | None) -> Constraint | None:
    """The :class:`Constraint` of already validated parameters, or None when unconstrained."""
    if regex is not None:
        return Constraint("regex", regex)
    if json_schema is not None:
        return Constraint("json_schema", json_schema)
    if choices is not None:
        return Constraint("choices", tuple(choices))
    return None


class CompiledGrammar(NamedTuple):
    """A constraint compiled for one tokenizer; immutable and shared by every request using it."""

    constraint: Constraint
    grammar: Any  # xgr.CompiledGrammar
    vocab_size: int
    stop_token_ids: tuple[int, ...]
