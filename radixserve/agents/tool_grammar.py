"""The constraint that forces a call: ``tool_choice`` ``"required"`` or a named function.

A ``tagged_json`` constraint (see :mod:`radixserve.constrained.spec`): the format's own
markup around one call object whose ``name`` is one of the allowed functions and whose
arguments are valid against that function's parameter schema. The forced text is what
the model would write unforced (the same markup, the key order and ``", "``/``": "``
separators templates use when they render the call back), so the next turn's prompt can
reuse it from the cache. One call is forced; ``parallel_tool_calls`` lets an unforced
model write more, a forced one writes exactly one.
"""

from __future__ import annotations

import json
from typing import Any

from radixserve.agents.registry import ToolFormat


def call_schema(fmt: ToolFormat, functions: list[dict[str, Any]]) -> dict[str, Any]:
    """A JSON schema of one call of any of ``functions`` (OpenAI ``function`` objects)."""
    options = []
    for f in functions:
        params = f.get("parameters") or {"type": "object", "properties": {}}
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, fmt.args_key: params},
                "required": ["name", fmt.args_key],
                "additionalProperties": False,
            }
        )
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    if fmt.array:
        return {"type": "array", "items": schema, "minItems": 1, "maxItems": 1}
    return schema


def forced_call(fmt: ToolFormat, functions: list[dict[str, Any]]) -> str:
    """The ``tagged_json`` text forcing one call of one of ``functions`` in ``fmt``."""
    return json.dumps({"begin": fmt.begin, "schema": call_schema(fmt, functions), "end": fmt.end})
