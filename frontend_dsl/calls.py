"""Evaluating the two expressions that call the backend: ``gen`` and ``select``.

Both run on the state's runner thread (never concurrently for one state), read the
state's text so far as the prompt, stream or append their result, assign the variable
with its meta (finish reason, usage, select scores) and add the call's usage to the
program's meter. What they need of the state is the :class:`CallSite` protocol
(``ProgramState`` implements it), so this module does not import the state's.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from frontend_dsl.backend import Backend, BackendError
from frontend_dsl.chat_template import RoleFormat
from frontend_dsl.ir import Gen, Select
from frontend_dsl.scoring import score_choices
from frontend_dsl.tools import ToolMarkers, tool_markers
from frontend_dsl.usage import UsageMeter

__all__ = ["CallSite", "RunContext", "markers_of", "run_gen", "run_select"]


@dataclass
class RunContext:
    """What a program run shares with all of its forks."""

    backend: Backend
    program_id: str
    roles: RoleFormat
    defaults: dict[str, Any] = field(default_factory=dict)
    meter: UsageMeter = field(default_factory=UsageMeter)
    # The run's end closes its session (the program id): True for an id the run made up;
    # an id the caller passed may go on in a later run, so the caller (or the backend's
    # close) ends that one.
    owns_session: bool = True
    # Set once the run's first backend call has produced output (its prompt is then cached);
    # run_batch waits on it before starting the rest of a batch.
    first_output: threading.Event = field(default_factory=threading.Event)


class CallSite(Protocol):
    """The program state a call runs in: its run context, its text so far, how much of that
    text a backend has already seen, and how results are appended and assigned."""

    _ctx: RunContext
    _text: str
    _sent_upto: int

    def _append(self, text: str, var: str | None = None) -> None: ...

    def _assign(self, name: str | None, value: Any, meta: dict[str, Any] | None = None) -> None: ...


_INT_RE = re.compile(r"\s*[-+]?\d+")
_FLOAT_RE = re.compile(r"\s*[-+]?\d+(\.\d+)?")
_BOOL_RE = re.compile(r"\s*(true|false)", re.IGNORECASE)
_TYPED = {"int": "an integer", "float": "a number", "bool": "true or false"}  # appended once parsed


def _parse(op: Gen, text: str) -> tuple[Any, str | None]:
    """The variable's value and, for typed kinds, the text to append (the parsed part)."""
    if op.kind in _TYPED:
        pattern = {"int": _INT_RE, "float": _FLOAT_RE, "bool": _BOOL_RE}[op.kind]
        match = pattern.match(text)
        if match is None:
            raise ValueError(
                f"gen_{op.kind}({op.name!r}): the model generated {text!r}, not {_TYPED[op.kind]}"
            )
        raw = match.group(0)
        value: Any = (
            {"int": int, "float": float}[op.kind](raw)
            if op.kind != "bool"
            else match.group(1).lower() == "true"
        )
        return value, raw
    if op.kind == "json":
        try:
            return json.loads(text), None
        except ValueError as exc:
            raise ValueError(
                f"gen_json({op.name!r}): the model generated invalid JSON {text[:80]!r}"
            ) from exc
    return text, None


def markers_of(ctx: RunContext, tools: str) -> ToolMarkers:
    """The text around declared ``tools`` and tool results, from the backend's template."""
    info = ctx.backend.model_info()
    return tool_markers(info.chat_template, tools, tuple(sorted(info.special_tokens.items())))


def run_gen(state: CallSite, op: Gen) -> None:
    """Generate from the state's text; stream text kinds into the state as they arrive."""
    ctx = state._ctx
    params = op.params(ctx.defaults)
    fmt = None
    if op.tools is not None:  # the call's constraint, in the template's tool format
        fmt = op.tools.format(ctx.backend.model_info().chat_template)
        extra = op.tools.constraint(fmt)
        if extra:
            params = msgspec.structs.replace(params, **extra)
    live = op.kind not in _TYPED
    pieces: list[str] = []
    last = None
    with ctx.backend.generate(
        state._text, params, program_id=ctx.program_id, prediction=op.prediction
    ) as stream:
        for chunk in stream:
            ctx.first_output.set()
            if chunk.error is not None:
                raise BackendError(chunk.error)
            if chunk.text:
                pieces.append(chunk.text)
                if live:
                    state._append(chunk.text, op.name)
            if chunk.finished:
                last = chunk
                break
    if last is None:
        raise BackendError("the backend's stream ended without a final chunk")
    if last.usage is not None:
        ctx.meter.add(last.usage)
    if last.finish_reason in ("abort", "error"):
        raise BackendError(
            f"generation of {op.name!r} ended with finish_reason={last.finish_reason!r}"
        )
    text = "".join(pieces)
    if op.tools is not None and fmt is not None:
        value, parsed = op.tools.read(fmt, text), None
    else:
        value, parsed = _parse(op, text)
    if parsed is not None:
        state._append(parsed, op.name)
    state._sent_upto = len(state._text)
    state._assign(
        op.name,
        value,
        {
            "finish_reason": last.finish_reason,
            "usage": last.usage,
            "text": text,
            "worker_id": last.worker_id,
        },
    )


def run_select(state: CallSite, op: Select) -> None:
    """Score the choices after the state's text and append the best one."""
    ctx = state._ctx
    result = score_choices(
        ctx.backend,
        state._text,
        op.choices,
        op.method,
        program_id=ctx.program_id,
        prefix_is_cached=state._sent_upto >= len(state._text),
    )
    ctx.first_output.set()
    ctx.meter.add(result.usage, calls=len(op.choices))
    state._append(result.choice, op.name)
    state._sent_upto = len(state._text)
    state._assign(
        op.name,
        result.choice,
        {
            "index": result.index,
            "scores": result.scores,
            "token_logprobs": result.token_logprobs,
            "boundaries": result.boundaries,
            "usage": result.usage,
        },
    )
