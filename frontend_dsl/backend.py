"""The interface every DSL backend implements, and the small typed values it exchanges.

A backend is what a program's ``gen`` and ``select`` calls reach: an in-process
``Engine`` (``engine_backend.EngineBackend``), a radixserve router over ZeroMQ
(``remote_backend.RemoteBackend``) or the deterministic ``FakeBackend`` of the unit tests.

Every method may be called from many threads at once (one per running program state):
backends are thread-safe. Prompts cross this interface as *text* for generation (the
backend tokenizes it exactly the way its ``tokenize`` does, so the prompt of a program's
next call extends the token ids of its previous call and hits the radix cache) and as
*token ids* for scoring (``select`` needs to know where each choice's tokens begin).

Torch-free: this module imports only msgspec and radixserve.sampling_params.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Iterator

import msgspec

from radixserve.sampling_params import SamplingParams

__all__ = [
    "Backend",
    "BackendError",
    "CallUsage",
    "GenChunk",
    "GenStream",
    "ModelInfo",
    "OpenSessions",
    "ScoreRequest",
    "ScoreResult",
]


class BackendError(RuntimeError):
    """A call failed in the backend (engine error, router error reply, lost connection)."""


class ModelInfo(msgspec.Struct, frozen=True):
    """What a program needs to know about the served model.

    ``chat_template`` is the raw Jinja template of the tokenizer (or ``None`` for a base
    model); ``special_tokens`` holds the names the template may use (``bos_token``,
    ``eos_token``, ...). Both backends hand the same two values to
    ``chat_template.RoleFormat.from_template``, so role markers — and therefore the
    prompt text and its token ids — are identical whichever backend runs the program.
    """

    model: str
    chat_template: str | None = None
    special_tokens: dict[str, str] = {}
    vocab_size: int = 0
    eos_token_ids: tuple[int, ...] = ()
    max_context: int | None = None


class CallUsage(msgspec.Struct, frozen=True):
    """Token accounting of one backend call (from the engine's ``usage``)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


class GenChunk(msgspec.Struct, frozen=True):
    """One streamed piece of a generation.

    ``text`` is the new text since the previous chunk (stop strings already removed).
    The last chunk has ``finished=True``, a ``finish_reason`` ("stop", "length", "abort",
    "error") and the call's ``usage``; ``error`` is set when the call failed;
    ``worker_id`` names the worker that ran it (remote backends; ``None`` in process).
    """

    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    usage: CallUsage | None = None
    error: str | None = None
    worker_id: int | None = None


class GenStream(abc.ABC):
    """An iterator over the chunks of one generation; ``close()`` aborts it early."""

    @abc.abstractmethod
    def __iter__(self) -> Iterator[GenChunk]: ...

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the call (abort it in the engine) if it has not finished; idempotent."""

    def __enter__(self) -> GenStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ScoreRequest(msgspec.Struct, frozen=True):
    """Score the tokens of ``token_ids`` from position ``start`` on (prompt logprobs)."""

    token_ids: list[int]
    start: int


class ScoreResult(msgspec.Struct, frozen=True):
    """``logprobs[i]`` is log P(token_ids[start + i] | token_ids[:start + i])."""

    logprobs: list[float]
    usage: CallUsage = CallUsage()


class OpenSessions:
    """The program ids a backend sent calls for and has not closed yet (thread-safe): what
    it closes when it is closed itself."""

    def __init__(self) -> None:
        self._ids: set[str] = set()
        self._lock = threading.Lock()

    def add(self, program_id: str | None) -> None:
        if program_id is not None:
            with self._lock:
                self._ids.add(program_id)

    def discard(self, program_id: str) -> bool:
        """Whether ``program_id`` was open (it is not any more)."""
        with self._lock:
            if program_id not in self._ids:
                return False
            self._ids.discard(program_id)
            return True

    def drain(self) -> list[str]:
        with self._lock:
            ids, self._ids = sorted(self._ids), set()
        return ids


class Backend(abc.ABC):
    """Where a program's calls run. Implementations are thread-safe.

    A program's calls carry its program id as their session: between two calls the engine
    keeps the program's context leased (radixserve.memory.leases), and when the program
    ends :meth:`close_session` releases that lease instead of letting it run out.
    """

    @abc.abstractmethod
    def model_info(self) -> ModelInfo:
        """The served model's name, chat template and special tokens (cached by callers)."""

    @abc.abstractmethod
    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, tokenized exactly as ``generate`` tokenizes a prompt."""

    @abc.abstractmethod
    def generate(
        self,
        prompt: str,
        params: SamplingParams,
        *,
        program_id: str | None = None,
        prediction: str | None = None,
    ) -> GenStream:
        """Start generating a continuation of ``prompt`` and stream it back.

        ``program_id`` names the program run the call belongs to; a router keeps all calls
        of one program (and of its forks) on one worker, where their shared prefix is cached.
        ``prediction``: text the output is expected to repeat, drafted from (it changes how
        fast the output comes, never what it is).
        Raises ``ValueError`` for invalid parameters; failures after the start arrive as a
        chunk with ``error`` set.
        """

    @abc.abstractmethod
    def score(
        self, requests: list[ScoreRequest], *, program_id: str | None = None
    ) -> list[ScoreResult]:
        """Prompt logprobs of many token sequences in one batched call.

        The requests of one ``select`` share the program's prefix; the backend submits them
        together so the engine computes that prefix once (or finds it in the radix cache).
        """

    def close_session(self, program_id: str) -> bool:
        """The program ``program_id`` ended: release its session (its leased context becomes
        ordinary cache). Returns whether the engine held a lease for it. Never raises for a
        session that is unknown or already closed.

        Not abstract: a backend without sessions (the fake one) has nothing to release."""
        return False

    def close(self) -> None:
        """Release connections / stop background threads. Idempotent.

        Not abstract: a backend that holds nothing (the fake one) keeps this no-op."""
        return

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
