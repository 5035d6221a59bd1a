"""A deterministic, model-free backend for fast tests of programs and of the DSL itself.

It behaves like a real backend where a program can tell: a word-piece tokenizer that
merges a leading space into the next word (so the select boundary matters), stop
strings and ``max_tokens`` applied on tokens, streaming one token per chunk, a
page-granular prefix cache that fills ``usage.cached_tokens``, and a record of every
call. What it generates and how it scores come from two plain functions the test gives.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Callable, Iterator
from typing import NamedTuple

from frontend_dsl.backend import (
    Backend,
    CallUsage,
    GenChunk,
    GenStream,
    ModelInfo,
    ScoreRequest,
    ScoreResult,
)
from radixserve.sampling_params import SamplingParams

__all__ = ["FakeBackend", "FakeCall", "CHATML_TEMPLATE"]

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_TOKEN_RE = re.compile(r"<\|[a-z_]+\|>| ?[A-Za-z]+| ?\d|\s+|[^\sA-Za-z\d]")


class FakeCall(NamedTuple):
    kind: str  # "generate" | "score"
    prompt: str | list[int]
    params: SamplingParams | None
    program_id: str | None


def _default_responder(prompt: str, params: SamplingParams) -> str:
    return "ok"


def _default_scorer(context: list[str], token: str) -> float:
    digest = hashlib.blake2b(
        f"{context[-1] if context else ''}|{token}".encode(), digest_size=4
    ).digest()
    return -0.1 - int.from_bytes(digest, "little") % 1000 / 100.0


class _FakeStream(GenStream):
    def __init__(self, chunks: list[GenChunk]) -> None:
        self._chunks = chunks
        self.closed = False

    def __iter__(self) -> Iterator[GenChunk]:
        for chunk in self._chunks:
            if self.closed:
                return
            yield chunk

    def close(self) -> None:
        self.closed = True


class FakeBackend(Backend):
    """``responder(prompt, params) -> text`` generates; ``scorer(context_tokens, token) -> logprob`` scores.

    A responder that raises makes the call fail with an error chunk (as an engine error would).
    """

    def __init__(
        self,
        responder: Callable[[str, SamplingParams], str] = _default_responder,
        scorer: Callable[[list[str], str], float] = _default_scorer,
        *,
        page_size: int = 4,
        chat_template: str | None = CHATML_TEMPLATE,
    ) -> None:
        self.responder, self.scorer, self.page_size = responder, scorer, page_size
        self.chat_template = chat_template
        self.calls: list[FakeCall] = []
        self.closed_sessions: list[str] = []  # close_session calls, in order
        self._lock = threading.Lock()
        self._vocab: dict[str, int] = {"<|im_start|>": 0, "<|im_end|>": 1}
        self._pieces: list[str] = ["<|im_start|>", "<|im_end|>"]
        self._cached_pages: set[bytes] = set()

    # ------------------------------------------------------------- tokenizer
    def _ids(self, text: str) -> list[int]:
        ids = []
        with self._lock:
            for piece in _TOKEN_RE.findall(text):
                if piece not in self._vocab:
                    self._vocab[piece] = len(self._pieces)
                    self._pieces.append(piece)
                ids.append(self._vocab[piece])
        return ids

    def decode(self, ids: list[int]) -> str:
        return "".join(self._pieces[i] for i in ids)

    def model_info(self) -> ModelInfo:
        return ModelInfo(
            model="fake",
            chat_template=self.chat_template,
            special_tokens={"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"},
            vocab_size=len(self._pieces),
            eos_token_ids=(1,),
        )

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return [self._ids(t) for t in texts]

    # ------------------------------------------------------------- prefix cache
    def _page_keys(self, ids: list[int]) -> list[bytes]:
        keys, h = [], b""
        for end in range(self.page_size, len(ids) + 1, self.page_size):
            h = hashlib.blake2b(
                h + repr(ids[end - self.page_size : end]).encode(), digest_size=8
            ).digest()
            keys.append(h)
        return keys

    def _use_cache(
        self, prompt_ids: list[int], total_ids: list[int], limit: int | None = None
    ) -> int:
        """Cached prompt tokens (whole pages, at most ``limit``); then cache ``total_ids``."""
        keys = self._page_keys(prompt_ids)
        with self._lock:
            hit = 0
            for key in keys:
                if key not in self._cached_pages:
                    break
                hit += self.page_size
            self._cached_pages.update(self._page_keys(total_ids))
        if limit is not None:
            hit = min(hit, limit // self.page_size * self.page_size)
        # As in the engine, the last prompt token is always computed (its logits are needed).
        return min(hit, (len(prompt_ids) - 1) // self.page_size * self.page_size)

    def flush_cache(self) -> None:
        with self._lock:
            self._cached_pages.clear()

    def close_session(self, program_id: str) -> bool:
        with self._lock:
            self.closed_sessions.append(program_id)
        return False

    # ------------------------------------------------------------- calls
    def generate(
        self,
        prompt: str,
        params: SamplingParams,
        *,
        program_id: str | None = None,
        prediction: str | None = None,
    ) -> GenStream:
        params.validate()
        with self._lock:
            self.calls.append(FakeCall("generate", prompt, params, program_id))
        prompt_ids = self._ids(prompt)
        try:
            text = self.responder(prompt, params)
        except Exception as exc:  # noqa: BLE001 - reported like an engine error
            return _FakeStream([GenChunk(finished=True, finish_reason="error", error=repr(exc))])
        all_ids = self._ids(text)
        out_ids = all_ids[: params.max_tokens]
        finish = "length" if len(all_ids) > params.max_tokens else "stop"
        full = self.decode(out_ids)
        # Stop strings are matched on the text and cut from it, like the engine's detokenizer.
        cut = min((full.find(s) for s in params.stop if s in full), default=-1)
        if cut >= 0:
            full, finish = full[:cut], "stop"
        chunks = [GenChunk(text=piece) for piece in _TOKEN_RE.findall(full)]  # one token per chunk
        n_out = len(self._ids(full)) if full else 0
        cached = self._use_cache(prompt_ids, prompt_ids + self._ids(full))
        usage = CallUsage(
            prompt_tokens=len(prompt_ids), cached_tokens=cached, completion_tokens=max(n_out, 1)
        )
        chunks.append(GenChunk(finished=True, finish_reason=finish, usage=usage))
        return _FakeStream(chunks)

    def score(
        self, requests: list[ScoreRequest], *, program_id: str | None = None
    ) -> list[ScoreResult]:
        results = []
        for req in requests:
            with self._lock:
                self.calls.append(FakeCall("score", list(req.token_ids), None, program_id))
                pieces = [self._pieces[i] for i in req.token_ids]
            logprobs = [
                self.scorer(pieces[:pos], pieces[pos]) for pos in range(req.start, len(pieces))
            ]
            cached = self._use_cache(req.token_ids, req.token_ids, limit=req.start - 1)
            results.append(
                ScoreResult(logprobs=logprobs, usage=CallUsage(len(req.token_ids), cached, 1))
            )
        return results
