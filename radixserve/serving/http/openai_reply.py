"""An OpenAI answer's parts, whole or streamed: usage, logprobs in both APIs' shapes, vLLM's
``stop_reason``, and the streamed chat completion (:class:`ChatStream`).

A streamed chat completion turns the router's events of ``n`` choices into OpenAI's chunks:
each choice opens with a role delta, then content (or, with a tool plan or a reasoning
parser, what its parser reads: content, ``reasoning_content``, ``tool_calls`` deltas), then
one chunk with its ``finish_reason`` (``tool_calls`` when the parser found calls) and
``stop_reason``. An optional usage chunk (``stream_options.include_usage``) and
``data: [DONE]`` end the stream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Any, NamedTuple

import msgspec

from radixserve.serving.http import chat_tools
from radixserve.serving.http.cache_report import report_json
from radixserve.serving.http.chunk_usage import ChunkUsage
from radixserve.serving.http.gateway import Gateway
from radixserve.serving.http.sse import DONE, event
from radixserve.serving.http.streams import logprob, stop_reason
from radixserve.serving.wire import protocol as p


def usage(groups: list[list[p.GenerateFinal]], g: Gateway | None = None) -> dict[str, Any]:
    """OpenAI usage over prompt groups (the ``n`` finals of one prompt each), with the
    first prompt's cache report when it asked for one (decoded by ``g``)."""
    prompt = sum(grp[0].usage.prompt_tokens for grp in groups)
    cached = sum(grp[0].usage.cached_tokens for grp in groups)
    host = sum(grp[0].usage.cached_host_tokens for grp in groups)
    disk = sum(grp[0].usage.cached_disk_tokens for grp in groups)
    completion = sum(f.usage.completion_tokens for group in groups for f in group)
    details: dict[str, Any] = {
        "cached_tokens": cached,
        # radixserve: where the cached tokens came from (hierarchical cache tiers)
        "cached_tokens_by_tier": {"device": cached - host - disk, "host": host, "disk": disk},
    }
    reports = [grp[0].usage.cache_report for grp in groups]
    if g is not None and any(r is not msgspec.UNSET for r in reports):
        # radixserve: where each prompt left the cached path, and why (return_cache_report)
        js = [None if r is msgspec.UNSET else report_json(g, r) for r in reports]
        details["cache_report"] = js[0] if len(js) == 1 else js
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": details,
    }
    drafted = sum(f.usage.spec_drafted_tokens for group in groups for f in group)
    if drafted:  # speculative decoding's drafts (OpenAI's predicted-output fields), if any
        accepted = sum(f.usage.spec_accepted_tokens for group in groups for f in group)
        out["completion_tokens_details"] = {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": drafted - accepted,
        }
    return out


def token_name(g: Gateway, token_id: int, as_id: bool) -> str:
    """A token as logprobs name it: its text, or with vLLM's ``return_tokens_as_token_ids``
    ``"token_id:<id>"`` (every token told apart, whatever its text: what RL trainers read)."""
    return f"token_id:{token_id}" if as_id else g.token_text(token_id)


def _token_entry(g: Gateway, token_id: int, value: float, as_id: bool) -> dict[str, Any]:
    if not as_id:
        return {
            "token": g.token_text(token_id),
            "logprob": logprob(value),
            "bytes": list(g.token_bytes(token_id)),
        }
    name = token_name(g, token_id, True)
    return {"token": name, "logprob": logprob(value), "bytes": list(name.encode())}


def chat_logprobs(
    g: Gateway, lps: list[p.TokenLogprob] | None, as_ids: bool = False
) -> list[dict[str, Any]]:
    """Chat logprobs of output tokens (``as_ids``: named by id, :func:`token_name`)."""
    out = []
    for lp in lps or []:
        top = [_token_entry(g, tid, value, as_ids) for tid, value in lp.top or []]
        out.append({**_token_entry(g, lp.token_id, lp.logprob, as_ids), "top_logprobs": top})
    return out


def completion_logprobs(
    g: Gateway, lps: list[p.TokenLogprob] | None, offset: int, as_ids: bool = False
) -> dict[str, list[Any]]:
    """Legacy completions logprobs of output tokens, their offsets from ``offset`` on
    (``as_ids``: named by id, :func:`token_name`; the offsets still count the text)."""
    return _legacy_logprobs(
        g, ((lp.token_id, lp.logprob, lp.top or []) for lp in lps or []), offset, as_ids
    )


def prompt_logprobs_part(
    g: Gateway, final: p.GenerateFinal, k: int, as_ids: bool = False
) -> dict[str, list[Any]]:
    """The echoed prompt's part of legacy completions logprobs (echo with logprobs, as vLLM
    answers it): each prompt token, its logprob and ``k`` likeliest tokens (``None`` for the
    first, which nothing predicts), offsets from the text's start."""
    ids, values = final.prompt_token_ids or [], final.prompt_logprobs or []
    tops = [top[:k] for top in final.prompt_top_logprobs or [[] for _ in values]]
    return _legacy_logprobs(g, zip(ids[len(ids) - len(values) :], values, tops), 0, as_ids)


def vllm_prompt_logprobs(
    g: Gateway, final: p.GenerateFinal, k: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token (``None`` for the first, which nothing
    predicts) a map of token id to its logprob, rank and text: the prompt token's, then its
    position's ``k`` likeliest (ranks 1 to k; the prompt token once, if among them)."""
    ids, values = final.prompt_token_ids or [], final.prompt_logprobs or []
    ranks = final.prompt_logprob_ranks or [None for _ in values]
    tops = final.prompt_top_logprobs or [[] for _ in values]

    def entry(token_id: int, value: float, rank: int | None) -> dict[str, Any]:
        return {"logprob": logprob(value), "rank": rank, "decoded_token": g.token_text(token_id)}

    out: list[dict[str, dict[str, Any]] | None] = []
    for tid, value, rank, top in zip(ids[len(ids) - len(values) :], values, ranks, tops):
        if value is None:
            out.append(None)
            continue
        position = {str(tid): entry(tid, value, rank)}
        for r, (t, v) in enumerate(top[:k], 1):
            position.setdefault(str(t), entry(t, v, r))
        out.append(position)
    return out


def _legacy_logprobs(
    g: Gateway,
    entries: Iterable[tuple[int, float | None, list[tuple[int, float]]]],
    offset: int,
    as_ids: bool,
) -> dict[str, list[Any]]:
    """Legacy completions logprobs (tokens, token_logprobs, top_logprobs, text_offset) of
    ``(token_id, logprob, top)`` entries; a ``None`` logprob (a text's first token) has no
    top either."""
    out: dict[str, list[Any]] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for tid, value, top in entries:
        text = g.token_text(tid)
        out["tokens"].append(token_name(g, tid, as_ids))
        out["token_logprobs"].append(None if value is None else logprob(value))
        out["top_logprobs"].append(
            None if value is None else {token_name(g, t, as_ids): logprob(v) for t, v in top}
        )
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def last_hidden_state(final: p.GenerateFinal) -> list[float]:
    """SGLang's ``hidden_states`` of an OpenAI choice: the final norm's output at the
    position that gave its last token, [] when that was the prompt's last (one token)."""
    hidden = final.hidden_states or []
    return hidden[-1] if len(final.token_ids) > 1 and hidden else []


class ChatHead(NamedTuple):
    """What every chunk of one streamed completion repeats, and what shapes its choices."""

    rid: str
    created: int
    model: str
    want_logprobs: bool
    stop_token_ids: list[int] | None
    prompt_logprobs: int | None = None  # vLLM's: k of the prompt's logprobs (chat: top level)
    token_ids: bool = False  # vLLM's return_token_ids: the prompt's and each choice's
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name ids
    hidden_states: bool = False  # SGLang's return_hidden_states: each choice's last


class ChatStream:
    """Turns one chat completion's merged events into its chunks (:meth:`chunks`)."""

    def __init__(
        self, g: Gateway, head: ChatHead, usage_of: ChunkUsage, tools: chat_tools.ToolPlan
    ) -> None:
        self.g, self.head, self.usage_of, self.tools = g, head, usage_of, tools
        self.parsers: dict[int, Any] = {}
        self.done: dict[int, p.GenerateFinal] = {}

    async def chunks(self, events: AsyncIterator[tuple[int, Any]]) -> AsyncIterator[bytes]:
        async for i, ev in events:
            if i not in self.parsers:
                self.usage_of.started(i, ev)
                self.parsers[i] = chat_tools.output_parser(self.tools)
                first = {"prompt_token_ids": ev.prompt_token_ids} if self.head.token_ids else {}
                yield self._body([self._choice(i, {"role": "assistant", "content": ""})], **first)
            self.usage_of.add(i, ev)
            if isinstance(ev, p.GenerateChunk):
                out = self._content(i, ev)
                if out is not None:
                    yield out
            else:
                for out in self._finish(i, ev):
                    yield out
        if self.usage_of.include:
            done = [self.done[i] for i in sorted(self.done)]
            yield self._body([], usage=usage([done], self.g) if done else None)
        yield DONE

    def _content(self, i: int, ev: p.GenerateChunk) -> bytes | None:
        """The chunk of a choice's new text (and logprobs), if it holds anything."""
        parser = self.parsers[i]
        delta: dict[str, Any] = {"content": ev.text}
        if parser is not None:
            delta = chat_tools.stream_delta(parser.feed(ev.text))
        want_lp, want_ids = self.head.want_logprobs, self.head.token_ids
        if not delta and not (want_lp and ev.logprobs) and not (want_ids and ev.token_ids):
            return None
        lps = (
            {"content": chat_logprobs(self.g, ev.logprobs, self.head.tokens_as_ids)}
            if want_lp
            else None
        )
        ids = {"token_ids": ev.token_ids} if want_ids else {}
        return self._chunk(i, delta, logprobs=lps, **ids)

    def _finish(self, i: int, final: p.GenerateFinal) -> list[bytes]:
        """A choice's last chunks: what its parser still held, then its finish reason, then
        its hidden state when asked for (SGLang's order)."""
        self.done[i] = final
        parser, out = self.parsers[i], []
        reason: Any = final.finish_reason
        if parser is not None:
            rest = chat_tools.stream_delta(parser.finish())
            if rest:
                out.append(self._chunk(i, rest))
            if parser.calls and reason == "stop":
                reason = "tool_calls"
        why = stop_reason(final, self.head.stop_token_ids)
        out.append(self._chunk(i, {}, finish_reason=reason, stop_reason=why))
        if self.head.hidden_states:
            out.append(self._chunk(i, {"hidden_states": last_hidden_state(final)}))
        return out

    def _chunk(
        self,
        i: int,
        delta: dict[str, Any],
        logprobs: dict[str, Any] | None = None,
        finish_reason: Any = None,
        **extra: Any,
    ) -> bytes:
        return self._body([self._choice(i, delta, logprobs, finish_reason, **extra)])

    @staticmethod
    def _choice(
        i: int,
        delta: dict[str, Any],
        logprobs: dict[str, Any] | None = None,
        finish_reason: Any = None,
        **extra: Any,
    ) -> dict[str, Any]:
        choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return {**choice, **extra}

    def _body(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        h = self.head
        body = {
            "id": h.rid,
            "object": "chat.completion.chunk",
            "created": h.created,
            "model": h.model,
            "system_fingerprint": None,
            "choices": choices,
            **self.usage_of.field(choices),
        }
        body.update(extra)
        return event(body)
