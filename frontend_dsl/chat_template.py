"""Chat roles as plain text markers, derived from the model's own Jinja chat template.

A program's prompt grows by appending: ``system(...)``, ``user(...)``, ``assistant(...)``
each add a role prefix, the content and a role suffix. Appending (instead of re-rendering
the whole message list before every call) keeps every earlier prompt a prefix of every
later one, which is what lets the radix cache reuse a program's history token for token.

The markers come from rendering the tokenizer's template with sentinel contents, so a
conversation built from roles has exactly the text ``tokenizer.apply_chat_template``
gives for ``state.messages()``. The renderer mirrors transformers' sandboxed Jinja setup
(trim_blocks, lstrip_blocks, ``raise_exception``, ``tojson``, ``strftime_now``) without
importing transformers, so a remote client stays light and both backends derive the same
markers from the same ``ModelInfo``.
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ROLES", "RoleFormat", "render_chat_template"]

ROLES = ("system", "user", "assistant")
# Distinct, whitespace-free sentinels survive `| trim` and similar filters in templates.
_SENT = {"system": "XSYSSENTX", "user": "XUSRSENTX", "assistant": "XASTSENTX"}


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: Any = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)


def render_chat_template(
    template: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = False,
    special_tokens: Mapping[str, str] | None = None,
    tools: list[Any] | None = None,
) -> str:
    """Render ``messages`` with a Hugging Face chat template, as ``apply_chat_template(tokenize=False)`` does."""
    extra: dict[str, Any] = dict(special_tokens or {})
    if tools is not None:  # absent, not None: as transformers renders a call without tools
        extra["tools"] = tools
    return _compile(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **extra
    )


@dataclass(frozen=True)
class RoleFormat:
    """The text around each role's content.

    ``first_prefix[role]`` opens a role when it is the conversation's first message (a
    template may put a BOS token or a default system prompt there); ``prefix[role]`` opens
    it later; ``suffix[role]`` closes it. ``generation_prompt`` is what
    ``add_generation_prompt`` appends (normally ``prefix["assistant"]``).
    """

    prefix: dict[str, str]
    suffix: dict[str, str]
    first_prefix: dict[str, str] = field(default_factory=dict)
    generation_prompt: str = ""
    templated: bool = False  # derived from a real chat template (not the plain fallback)

    def open(self, role: str, first: bool) -> str:
        """Text that opens ``role``; ``first`` when nothing has been written yet."""
        if role not in self.prefix:
            raise ValueError(f"unknown role {role!r}; expected one of {ROLES}")
        return self.first_prefix.get(role, self.prefix[role]) if first else self.prefix[role]

    def close(self, role: str) -> str:
        return self.suffix[role]

    @classmethod
    def plain(cls) -> RoleFormat:
        """Markers for a model without a chat template (base models, tests)."""
        prefix = {"system": "System: ", "user": "User: ", "assistant": "Assistant: "}
        suffix = {r: "\n" for r in ROLES}
        return cls(prefix=prefix, suffix=suffix, generation_prompt=prefix["assistant"])

    @classmethod
    def from_template(
        cls, template: str | None, special_tokens: Mapping[str, str] | None = None
    ) -> RoleFormat:
        """Derive the markers by rendering ``template`` around sentinel contents.

        For each role, render a valid conversation ``base`` and ``base + [role: SENTINEL]``;
        the second extends the first by exactly ``prefix + SENTINEL + suffix``. Templates that
        reject a role in some position (e.g. a system message after the first) fall back to
        the user markers with the role name substituted.
        """
        if not template:
            return cls.plain()
        special = dict(special_tokens or {})

        def render(msgs: list[dict[str, str]], gen: bool = False) -> str:
            return render_chat_template(
                template, msgs, add_generation_prompt=gen, special_tokens=special
            )

        def split(before: str, after: str, sentinel: str) -> tuple[str, str] | None:
            if not after.startswith(before) or after.count(sentinel) != 1:
                return None
            head, tail = after[len(before) :].split(sentinel)
            return head, tail

        u0, a0 = {"role": "user", "content": "XU0X"}, {"role": "assistant", "content": "XA0X"}
        bases = {"assistant": [u0], "user": [u0, a0], "system": [u0, a0]}
        prefix: dict[str, str] = {}
        suffix: dict[str, str] = {}
        first_prefix: dict[str, str] = {}
        for role in ROLES:
            msg = {"role": role, "content": _SENT[role]}
            try:
                parts = split(render(bases[role]), render(bases[role] + [msg]), _SENT[role])
            except Exception:  # the template rejects this position
                parts = None
            if parts is not None:
                prefix[role], suffix[role] = parts
            try:
                first = render([msg])
                if first.count(_SENT[role]) == 1:
                    first_prefix[role] = first.split(_SENT[role])[0]
            except Exception:
                pass
        if "user" not in prefix or "assistant" not in prefix:
            return cls.plain()
        if "system" not in prefix:
            prefix["system"] = prefix["user"].replace("user", "system")
            suffix["system"] = suffix["user"]
        # A first prefix that equals the later one is no special case.
        first_prefix = {r: p for r, p in first_prefix.items() if p != prefix[r]}
        try:
            gen_prompt = render([u0], gen=True)[len(render([u0])) :]
        except Exception:
            gen_prompt = prefix["assistant"]
        return cls(
            prefix=prefix,
            suffix=suffix,
            first_prefix=first_prefix,
            generation_prompt=gen_prompt,
            templated=True,
        )
