"""Every way an OpenAI-shaped body asks for structured output, read into one constraint.

Clients written for different servers spell the same request differently, and each
spelling is a constraint radixserve's engine has (:mod:`radixserve.constrained`):

- OpenAI's ``response_format``: ``text``, ``json_object``, ``json_schema``; and vLLM's and
  SGLang's ``structural_tag`` type (xgrammar's ``format``, or the older ``structures`` and
  ``triggers``).
- vLLM's ``structured_outputs``: one of ``json``, ``regex``, ``choice``, ``grammar``,
  ``json_object``, ``structural_tag``.
- vLLM's older top-level fields: ``guided_json``, ``guided_regex``, ``guided_choice``,
  ``guided_grammar`` (``guided_decoding_backend`` is accepted: xgrammar serves them all).
- SGLang's extra fields: ``regex`` and ``ebnf``.

At most one may constrain a request: two are a 400 naming both, as is any option whose
output radixserve would not honour (a ``whitespace_pattern``: its JSON is always compact).
A grammar is EBNF as xgrammar reads it (llama.cpp's GBNF); vLLM's Lark grammars are not
(xgrammar's parser reports where one fails, a 400).
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from pydantic import BaseModel

from radixserve.constrained.spec import JSON_OBJECT_SCHEMA, structural_tag_text
from radixserve.serving.http.errors import invalid

#: vLLM's ``structured_outputs`` keys that choose the constraint.
_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
#: vLLM's options that radixserve's output already satisfies whatever their value: its JSON
#: is compact (no free whitespace), its schemas allow no properties they do not name, and
#: xgrammar is the one backend (nothing to fall back from).
_ACCEPTED_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "disable_fallback")
#: The top-level fields of vLLM's older API and SGLang's, and the kind each names.
_FIELDS = (
    ("guided_json", "json"),
    ("guided_regex", "regex"),
    ("guided_choice", "choice"),
    ("guided_grammar", "grammar"),
    ("regex", "regex"),
    ("ebnf", "grammar"),
)


class StructuredOutputFields(BaseModel):
    """The body fields that constrain the output; chat and text completions inherit them."""

    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    def constraint(self) -> dict[str, Any]:
        """The :class:`~radixserve.sampling_params.SamplingParams` constraint field the
        body asks for (``{}`` when none): a 400 for two at once or a malformed one."""
        if self.guided_whitespace_pattern is not None:
            raise invalid(
                "guided_whitespace_pattern is not supported: JSON output is compact",
                param="guided_whitespace_pattern",
            )
        asked = [a for a in self._asked() if a is not None]
        if len(asked) > 1:
            raise invalid(
                f"{asked[0].param} and {asked[1].param} both constrain the output; send one",
                param=asked[1].param,
            )
        return asked[0].fields() if asked else {}

    def _asked(self) -> list[_Asked | None]:
        out = [_response_format(self.response_format), _structured(self.structured_outputs)]
        for name, kind in _FIELDS:
            value = getattr(self, name)
            out.append(None if value is None else _Asked(name, kind, value))
        return out


class _Asked(NamedTuple):
    """One constraint as a body spelled it: the field, the kind (vLLM's names), the value."""

    param: str
    kind: str
    value: Any

    def fields(self) -> dict[str, Any]:
        """The constraint as SamplingParams' field (its checks, the compiler's errors come
        later, as for every other request)."""
        kind, value = self.kind, self.value
        if kind == "json":
            if isinstance(value, (dict, bool)):
                return {"json_schema": json.dumps(value)}
            if isinstance(value, str):
                return {"json_schema": value}
        elif kind == "json_object":
            if value is True:
                return {"json_schema": JSON_OBJECT_SCHEMA}
        elif kind in ("regex", "grammar"):
            if isinstance(value, str):
                return {"regex" if kind == "regex" else "ebnf": value}
        elif kind == "choice":
            if isinstance(value, list) and all(isinstance(c, str) for c in value):
                return {"choices": value}
        elif kind == "structural_tag":
            try:
                return {"structural_tag": structural_tag_text(value)}
            except ValueError as exc:
                raise invalid(f"{self.param}: {exc}", param=self.param) from None
        raise invalid(f"{self.param} has the wrong type for a {kind} constraint", param=self.param)


def _response_format(fmt: dict[str, Any] | None) -> _Asked | None:
    """OpenAI's ``response_format`` (and the ``structural_tag`` type vLLM and SGLang add)."""
    kind = None if fmt is None else fmt.get("type", "text")
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return _Asked("response_format", "json_object", True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, (dict, bool)):
            raise invalid(
                "response_format.json_schema.schema must be a JSON schema object",
                param="response_format",
            )
        return _Asked("response_format", "json", schema)
    if kind == "structural_tag":
        return _Asked("response_format", "structural_tag", fmt)
    raise invalid(
        f"response_format type {kind!r} is not supported "
        "(text, json_object, json_schema, structural_tag)",
        param="response_format",
    )


def _structured(spec: dict[str, Any] | None) -> _Asked | None:
    """vLLM's ``structured_outputs``: exactly one kind, and only options it honours."""
    if spec is None:
        return None
    unknown = sorted(set(spec) - {*_KINDS, *_ACCEPTED_OPTIONS})
    if unknown:
        raise invalid(
            f"structured_outputs.{unknown[0]} is not supported "
            f"(one of {', '.join(_KINDS)}; options {', '.join(_ACCEPTED_OPTIONS)})",
            param="structured_outputs",
        )
    kinds = [k for k in _KINDS if spec.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise invalid(
            f"structured_outputs must set exactly one of {', '.join(_KINDS)}, "
            f"got {', '.join(kinds) or 'none'}",
            param="structured_outputs",
        )
    return _Asked(f"structured_outputs.{kinds[0]}", kinds[0], spec[kinds[0]])
