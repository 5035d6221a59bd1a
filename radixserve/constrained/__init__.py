"""Constrained decoding: a regex, a JSON schema or a list of choices as a per-step token mask.

- :mod:`~radixserve.constrained.spec` (torch-free): :class:`Constraint`, the cheap checks
  ``SamplingParams.validate`` runs, ``JSON_OBJECT_SCHEMA``.
- :mod:`~radixserve.constrained.grammar`: :class:`GrammarCompiler` (xgrammar, an LRU of
  compiled grammars per tokenizer) and :func:`compiler_for`.
- :mod:`~radixserve.constrained.matcher`: :class:`GrammarMatcher`, one per request: accept a
  token, the next-token bitmask, ``can_only_end`` / ``is_terminated``.
- :mod:`~radixserve.constrained.mask`: :func:`apply_token_masks` for the constrained rows of
  a step's logits.
- :mod:`~radixserve.constrained.thinking_budget`: :class:`ThinkingBudget`, a reasoning
  model's ``<think>`` block closed after ``thinking_token_budget`` tokens, through the
  matcher's interface (around the request's grammar, if any).
- :mod:`~radixserve.constrained.bits`: token bitmask helpers, without xgrammar.

It sits beside the scheduling layer: the engine compiles at ``add_request``, the sampler
masks, the scheduler advances the matcher with each sampled token. Importing this package
stays light; the xgrammar-backed names load on first use.
"""

from __future__ import annotations

from typing import Any

from radixserve.constrained.spec import (
    JSON_OBJECT_SCHEMA,
    CompiledGrammar,
    Constraint,
    constraint_errors,
    constraint_of,
)

__all__ = [
    "Constraint",
    "JSON_OBJECT_SCHEMA",
    "constraint_errors",
    "constraint_of",
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarMatcher",
    "apply_token_masks",
    "compiler_for",
]

_LAZY = {
    "GrammarCompiler": "radixserve.constrained.grammar",
    "compiler_for": "radixserve.constrained.grammar",
    "GrammarMatcher": "radixserve.constrained.matcher",
    "apply_token_masks": "radixserve.constrained.mask",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'radixserve.constrained' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
