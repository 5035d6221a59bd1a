"""The expressions a program appends to its state: text, roles, ``gen`` and ``select``.

``s += expr`` queues an expression on the state; the state's runner evaluates queued
expressions in order while the program's Python code carries on (so the forks of a
state generate in parallel). Expressions are immutable values; ``a + b`` chains them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from frontend_dsl.tools import ToolUse, tools_json
from radixserve import logit_bias as bias_rules
from radixserve.sampling_params import SamplingParams

__all__ = [
    "Expr",
    "Text",
    "Gen",
    "Select",
    "Role",
    "RoleBegin",
    "RoleEnd",
    "Seq",
    "gen",
    "gen_bool",
    "gen_float",
    "gen_int",
    "gen_json",
    "gen_str",
    "select",
    "system",
    "user",
    "assistant",
    "role",
    "tool_result",
    "ToolResult",
    "to_expr",
    "SAMPLING_FIELDS",
    "normalize_sampling",
]

# The SamplingParams fields a `gen` call may set (prompt_logprobs_start is select's business).
SAMPLING_FIELDS = (
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "ignore_eos",
    "regex",
    "json_schema",
    "ebnf",
    "logit_bias",
    "thinking_token_budget",
)


def normalize_sampling(values: Mapping[str, Any]) -> dict[str, Any]:
    """Sampling parameters as ``gen`` and the run ``defaults`` take them, in SamplingParams'
    own form: ``max_new_tokens`` is ``max_tokens``, one ``stop`` string (or ``stop_regex``
    pattern) is a list of one, a
    ``json_schema`` dict is JSON text. Unknown names and values of the wrong type raise
    ``ValueError`` (the same checks the router's decoder makes), so a run behaves the same
    on every backend."""
    out = dict(values)
    if "max_new_tokens" in out:
        alias = out.pop("max_new_tokens")
        out.setdefault("max_tokens", alias)
    unknown = sorted(set(out) - set(SAMPLING_FIELDS))
    if unknown:
        raise ValueError(
            f"unknown sampling parameters {unknown}; expected some of {list(SAMPLING_FIELDS)}"
        )
    for name in ("stop", "stop_regex"):
        if isinstance(out.get(name), str):
            out[name] = [out[name]]
    if isinstance(out.get("json_schema"), dict):
        out["json_schema"] = json.dumps(out["json_schema"])
    for name in ("stop", "stop_token_ids", "stop_regex"):
        if isinstance(out.get(name), tuple):
            out[name] = list(out[name])
    try:
        if out.get("logit_bias") is not None:  # token ids as ints or decimal strings
            out["logit_bias"] = bias_rules.from_json(out["logit_bias"])
        msgspec.convert(out, SamplingParams)
    except (msgspec.ValidationError, ValueError) as exc:
        raise ValueError(f"invalid sampling parameters: {exc}") from None
    return out


class Expr:
    """Base of all expressions; ``+`` builds a sequence."""

    def __add__(self, other: ExprLike) -> Seq:
        return Seq((self, to_expr(other)))

    def __radd__(self, other: ExprLike) -> Seq:
        return Seq((to_expr(other), self))


ExprLike = Expr | str


def to_expr(value: ExprLike | Sequence[ExprLike]) -> Expr:
    """Strings become ``Text``; lists/tuples become ``Seq``."""
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Text(value)
    if isinstance(value, (list, tuple)):
        return Seq(tuple(to_expr(v) for v in value))
    raise TypeError(
        f"cannot append {type(value).__name__} to a program state; use str, gen(), select() or a role"
    )


@dataclass(frozen=True)
class Text(Expr):
    text: str


@dataclass(frozen=True)
class Seq(Expr):
    items: tuple[Expr, ...]

    def __add__(self, other: ExprLike) -> Seq:
        return Seq(self.items + (to_expr(other),))


@dataclass(frozen=True)
class Gen(Expr):
    """Generate a continuation; store it under ``name`` (parsed by ``kind``)."""

    name: str | None
    sampling: dict[str, Any] = field(default_factory=dict)  # only the fields the caller set
    kind: str = "text"  # "text" | "int" | "float" | "bool" | "str" | "json" | "tools"
    tools: ToolUse | None = None  # kind "tools": the tools it may call (frontend_dsl.tools)
    prediction: str | None = None  # the text the output is expected to repeat (drafted from)

    def params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        """The SamplingParams of this call: program-run defaults overridden by the call's own
        (both already in :func:`normalize_sampling`'s form)."""
        return msgspec.convert({**(defaults or {}), **self.sampling}, SamplingParams).validate()


@dataclass(frozen=True)
class Select(Expr):
    """Choose one of ``choices`` by the model's logprobs of each continuation."""

    name: str | None
    choices: tuple[str, ...]
    method: str | Callable[[list[list[float]]], int] = "mean"


@dataclass(frozen=True)
class RoleBegin(Expr):
    role: str
    tools: str | None = None  # a system turn declaring tools (their JSON text)


@dataclass(frozen=True)
class RoleEnd(Expr):
    role: str
    tools: str | None = None


@dataclass(frozen=True)
class Role(Expr):
    role: str
    body: Expr
    tools: str | None = None


@dataclass(frozen=True)
class ToolResult(Expr):
    """A tool's result, appended as the chat template writes a ``tool`` turn."""

    content: str
    call_id: str | None = None
    name: str | None = None


def gen(
    name: str | None = None,
    *,
    max_tokens: int | None = None,
    stop: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    stop_regex: str | Sequence[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    repetition_penalty: float | None = None,
    seed: int | None = None,
    min_tokens: int | None = None,
    ignore_eos: bool | None = None,
    regex: str | None = None,
    json_schema: str | dict[str, Any] | None = None,
    ebnf: str | None = None,
    choices: Sequence[str] | None = None,
    choices_method: str | Callable[[list[list[float]]], int] = "mean",
    max_new_tokens: int | None = None,
    logit_bias: Mapping[int | str, float] | None = None,
    thinking_token_budget: int | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_choice: str = "auto",
    parallel_tool_calls: bool = True,
    tool_parser: str | None = None,
    prediction: str | None = None,
) -> Expr:
    """Generate text into variable ``name``.

    Unset parameters take the run's defaults (``program.run(..., defaults={...})``), then
    SamplingParams' own. ``stop`` strings end the generation and are not kept in the text;
    ``stop_regex`` patterns (SGLang's) end it where one first matches, likewise.
    ``regex`` / ``json_schema`` (a dict or JSON text) / ``ebnf`` (a grammar, as xgrammar
    reads it: ``root ::= ...``) constrain the output with the engine's grammar-constrained
    decoding. With ``choices``, this is
    ``select(name, choices, method=choices_method)`` (scored by logprobs, not constrained).
    ``max_new_tokens`` is accepted as an alias of ``max_tokens``. ``logit_bias``: token id
    -> bias in [-100, 100] added to the logits before the draw (OpenAI's semantics).
    ``thinking_token_budget``: a reasoning model's ``<think>`` block is closed after that
    many tokens (docs/agents.md).

    ``tools`` (see :mod:`frontend_dsl.tools`): the model may call them; the variable holds a
    :class:`~frontend_dsl.tools.ToolReply`. ``tool_choice``: ``"auto"``, ``"required"`` or
    a function's name (forced); ``parallel_tool_calls=False``: one call at most;
    ``tool_parser`` overrides the format guessed from the chat template.

    ``prediction`` (OpenAI's predicted outputs): text the output is expected to repeat, such
    as the file an edit mostly keeps. The engine drafts from it and verifies the drafts, so
    it changes how fast the output comes, never what it is.
    """
    if max_tokens is None:
        max_tokens = max_new_tokens
    given = dict(
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        repetition_penalty=repetition_penalty,
        seed=seed,
        ignore_eos=ignore_eos,
        regex=regex,
        json_schema=json_schema,
        ebnf=ebnf,
        stop=stop,
        stop_token_ids=None if stop_token_ids is None else list(stop_token_ids),
        stop_regex=stop_regex,
        logit_bias=None if logit_bias is None else dict(logit_bias),
        thinking_token_budget=thinking_token_budget,
    )
    sampling = {k: v for k, v in given.items() if v is not None}
    if choices is not None:
        if sampling:  # select scores the choices: it samples nothing these could apply to
            raise ValueError(
                f"gen(choices=...) is a select: it takes no sampling parameters, got {sorted(sampling)}"
            )
        return select(name, choices, method=choices_method)
    if tools is not None:
        use = ToolUse(tools_json(tools), tool_choice, parallel_tool_calls, tool_parser)
        if tool_choice not in ("auto", "required") and tool_choice not in {
            f["name"] for f in use.functions()
        }:
            raise ValueError(f"tool_choice {tool_choice!r} is not one of the tools")
        expr = Gen(
            name, normalize_sampling(sampling), kind="tools", tools=use, prediction=prediction
        )
    else:
        expr = Gen(name, normalize_sampling(sampling), prediction=prediction)
    expr.params()  # fail early, in the program's own thread, on invalid values
    return expr


# Characters that end an integer. Not " ": a leading space is how many tokenizers spell the
# integer's first token (" 42"); whatever follows the integer is cut off when parsing.
_INT_STOPS = ["\n", ",", ".", ";", ")", "]", "}", '"', "'"]


# An optional leading space: after "is" a tokenizer spells the number " 42". The optional
# terminator lets the model end the number the way it would in prose (" 4 legs", "4.")
# instead of being forced to add digits when it does not want the end of sequence there;
# it is cut off when parsing.
_END = r"[ \n,;:)!?]"
INT_REGEX = r" ?-?[0-9]{1,18}(" + _END[:-1] + r".])?"


def gen_int(
    name: str | None = None,
    *,
    max_tokens: int = 16,
    stop: Sequence[str] | None = None,
    constrained: bool = True,
    **kw: Any,
) -> Expr:
    """Generate an integer into ``name`` (stored as ``int``).

    ``constrained``: the engine may only sample an integer (regex ``INT_REGEX``). Stop
    sequences end the generation at the first non-integer character in any case, and the
    text is parsed: what is kept in the prompt is the integer itself. A generation that
    does not begin with an integer fails the state with ``ValueError``.
    """
    if constrained:
        kw.setdefault("regex", INT_REGEX)
    expr = gen(
        name, max_tokens=max_tokens, stop=list(stop) if stop is not None else _INT_STOPS, **kw
    )
    assert isinstance(expr, Gen)
    return Gen(expr.name, expr.sampling, kind="int")


FLOAT_REGEX = r" ?-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,15})?(" + _END + ")?"
BOOL_REGEX = r" ?(true|false)"
_FLOAT_STOPS = [s for s in _INT_STOPS if s != "."]


def gen_float(
    name: str | None = None,
    *,
    max_tokens: int = 24,
    stop: Sequence[str] | None = None,
    constrained: bool = True,
    **kw: Any,
) -> Expr:
    """Generate a decimal number into ``name`` (stored as ``float``).

    ``constrained``: the engine may only sample a number (regex ``FLOAT_REGEX``); else stop
    sequences end it. Parsed like :func:`gen_int`: the number itself is kept in the prompt.
    """
    if constrained:
        kw.setdefault("regex", FLOAT_REGEX)
    expr = gen(
        name, max_tokens=max_tokens, stop=list(stop) if stop is not None else _FLOAT_STOPS, **kw
    )
    assert isinstance(expr, Gen)
    return Gen(expr.name, expr.sampling, kind="float")


def gen_bool(
    name: str | None = None,
    *,
    max_tokens: int = 8,
    stop: Sequence[str] | None = None,
    constrained: bool = True,
    **kw: Any,
) -> Expr:
    """Generate ``true`` or ``false`` into ``name`` (stored as ``bool``).

    ``constrained``: the engine may only sample those (regex ``BOOL_REGEX``); else stop
    sequences end the word and the text must begin with one of them.
    """
    if constrained:
        kw.setdefault("regex", BOOL_REGEX)
        # The grammar ends the word; a run's default stop strings must not cut it.
        stop = [] if stop is None else stop
    elif stop is None:
        stop = ["\n", ",", ".", '"']
    expr = gen(name, max_tokens=max_tokens, stop=list(stop), **kw)
    assert isinstance(expr, Gen)
    return Gen(expr.name, expr.sampling, kind="bool")


def gen_str(
    name: str | None = None, *, max_tokens: int = 64, stop: Sequence[str] | None = None, **kw: Any
) -> Expr:
    """Generate a short single-line string (ends at a newline or a double quote).

    Those stop sequences end it; pass ``regex=`` for a grammar.
    """
    expr = gen(
        name, max_tokens=max_tokens, stop=list(stop) if stop is not None else ["\n", '"'], **kw
    )
    assert isinstance(expr, Gen)
    return Gen(expr.name, expr.sampling, kind="str")


def gen_json(
    name: str | None = None,
    schema: str | dict[str, Any] | None = None,
    *,
    max_tokens: int = 256,
    stop: Sequence[str] | None = None,
    **kw: Any,
) -> Expr:
    """Generate JSON valid against ``schema`` (any JSON object when None); stored parsed.

    Needs the engine's grammar-constrained decoding (both backends have it). The grammar
    ends the value: a run's default stop strings do not apply (a "." would cut ``0.5``).
    """
    expr = gen(
        name,
        max_tokens=max_tokens,
        json_schema=schema if schema is not None else '{"type": "object"}',
        stop=[] if stop is None else list(stop),
        **kw,
    )
    assert isinstance(expr, Gen)
    return Gen(expr.name, expr.sampling, kind="json")


def select(
    name: str | None = None,
    choices: Sequence[str] = (),
    *,
    method: str | Callable[[list[list[float]]], int] = "mean",
) -> Expr:
    """Append the choice the model finds most likely and store it under ``name``.

    ``method``: "mean" (length-normalized mean token logprob, the default), "sum" (total
    logprob), "first" (logprob of the first differing token), or a callable taking each
    choice's token logprobs and returning the chosen index. All choices are scored in one
    batched prompt-logprob call that shares the program's cached prefix.
    """
    if not choices:
        raise ValueError("select() needs at least one choice")
    if isinstance(method, str) and method not in ("mean", "sum", "first"):
        raise ValueError(
            f"unknown select method {method!r}; use 'mean', 'sum', 'first' or a callable"
        )
    return Select(name, tuple(str(c) for c in choices), method)


def role(name: str, *content: ExprLike) -> Expr:
    """``role("user", "text", gen(...))``: a whole message; with no content, a bare opening."""
    body = to_expr(list(content))
    return Role(name, body)


def system(*content: ExprLike, tools: Sequence[Mapping[str, Any]] | None = None) -> Expr:
    """A system message (prefix and suffix from the model's chat template); with ``tools``,
    the template's rendering of them around it (see :mod:`frontend_dsl.tools`)."""
    if tools is None:
        return role("system", *content)
    return Role("system", to_expr(list(content)), tools_json(tools))


def tool_result(call: Any, content: str | Mapping[str, Any] | Sequence[Any]) -> Expr:
    """A tool's result for ``call`` (a :class:`~radixserve.agents.types.ToolCall`, or its
    id), as a ``tool`` turn; a non-string ``content`` is sent as JSON."""
    text = content if isinstance(content, str) else json.dumps(content)
    call_id = getattr(call, "id", call if isinstance(call, str) else None)
    return ToolResult(text, call_id, getattr(call, "name", None))


def user(*content: ExprLike) -> Expr:
    """A user message."""
    return role("user", *content)


def assistant(*content: ExprLike) -> Expr:
    """An assistant message, typically ``assistant(gen("answer"))``."""
    return role("assistant", *content)
