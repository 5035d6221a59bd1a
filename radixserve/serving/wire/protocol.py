"""The wire protocol: every message that crosses a radixserve socket.

Torch-free on purpose (clients and the DSL import it). All messages are ``msgspec.Struct``
types in tagged unions (tag field ``"type"``), encoded as msgpack, one message per ZeroMQ
frame:

* client <-> router: text-level requests and replies (:data:`ClientMessage`,
  :data:`ServerMessage`). Clients use a DEALER socket; every request carries a
  client-chosen ``request_id`` that the replies echo, so many requests multiplex on one
  socket.
* router <-> worker: token-level only (:data:`RouterToWorker`, :data:`WorkerToRouter`);
  a worker never sees text.

Decoding validates (types, unknown fields, the protocol version, sampling parameter
values) and never raises: a bad frame becomes an :class:`Error` the caller sends back.

This module is the one to import (``from radixserve.serving.wire import protocol as p``): it
names every message (:mod:`~radixserve.serving.wire.client_messages` and
:mod:`~radixserve.serving.wire.worker_messages` define them, on the bases of
:mod:`~radixserve.serving.wire.base`) and holds the encoder and the validating decoders.
"""

from __future__ import annotations

from typing import Any

import msgspec

from radixserve.engine.memory_tags import MEMORY_TAGS, MemoryTag

# The engine's outputs are torch-free Structs: token-level results travel as they are.
from radixserve.engine.outputs import CacheReport, FinishReason, StepOutput, TokenLogprob, Usage
from radixserve.sampling_params import SamplingParams
from radixserve.serving.wire.base import (
    PAUSE_MODES,
    PROTOCOL_VERSION,
    ErrorCode,
    PauseMode,
    WorkerLoad,
)
from radixserve.serving.wire.client_messages import (
    Abort,
    ChatMessage,
    ClientMessage,
    CloseSession,
    CloseSessionReply,
    ContinueGeneration,
    DetokenizeReply,
    DetokenizeRequest,
    Error,
    FlushCache,
    FlushCacheReply,
    GenerateChunk,
    GenerateFinal,
    GenerateRequest,
    Health,
    HealthReply,
    KeepAlive,
    LoadLoraAdapter,
    LoraAdapterReply,
    MemoryReply,
    ModelInfo,
    ModelInfoRequest,
    PauseGeneration,
    PauseReply,
    ReleaseMemory,
    ResumeMemory,
    ServerMessage,
    StatsReply,
    StatsRequest,
    Timings,
    TokenizeReply,
    TokenizeRequest,
    ToolCallPart,
    UnloadLoraAdapter,
    UpdateWeights,
    UpdateWeightsReply,
    WorkerStats,
)
from radixserve.serving.wire.disagg_messages import (
    WorkerAdmit,
    WorkerPrefill,
    WorkerPrefilled,
    WorkerRelease,
    WorkerReleased,
    WorkerReserve,
    WorkerReserved,
)
from radixserve.serving.wire.limits import invalid_utf8_path
from radixserve.serving.wire.worker_messages import (
    RouterToWorker as _RouterToWorker,
)
from radixserve.serving.wire.worker_messages import (
    WorkerAbort,
    WorkerAdd,
    WorkerCloseSession,
    WorkerCloseSessionReply,
    WorkerContinue,
    WorkerFlush,
    WorkerFlushReply,
    WorkerGoodbye,
    WorkerHeartbeat,
    WorkerHello,
    WorkerKVEvents,
    WorkerKVSubscribe,
    WorkerLoadLora,
    WorkerLoraReply,
    WorkerMemoryReply,
    WorkerOutputs,
    WorkerPause,
    WorkerPauseReply,
    WorkerPing,
    WorkerRejected,
    WorkerRejoin,
    WorkerReleaseMemory,
    WorkerRequest,
    WorkerResumeMemory,
    WorkerShutdown,
    WorkerStatsReply,
    WorkerStatsRequest,
    WorkerUnloadLora,
    WorkerUpdateWeights,
    WorkerWeightsReply,
)
from radixserve.serving.wire.worker_messages import WorkerToRouter as _WorkerToRouter

# Prefill/decode disaggregation's messages (disagg_messages.py) join the worker unions here.
RouterToWorker = _RouterToWorker | WorkerReserve | WorkerPrefill | WorkerAdmit | WorkerRelease
WorkerToRouter = _WorkerToRouter | WorkerReserved | WorkerPrefilled | WorkerReleased

# Every message and the parts it carries is ``protocol.<Name>``, whichever module defines it.
__all__ = [
    "CacheReport",
    "FinishReason",
    "StepOutput",
    "TokenLogprob",
    "Usage",
    "SamplingParams",
    "PROTOCOL_VERSION",
    "ErrorCode",
    "WorkerLoad",
    "ChatMessage",
    "ToolCallPart",
    "Timings",
    "GenerateRequest",
    "Abort",
    "Health",
    "ModelInfoRequest",
    "FlushCache",
    "UnloadLoraAdapter",
    "UpdateWeights",
    "UpdateWeightsReply",
    "LoadLoraAdapter",
    "CloseSession",
    "StatsRequest",
    "TokenizeRequest",
    "DetokenizeRequest",
    "ClientMessage",
    "GenerateChunk",
    "GenerateFinal",
    "Error",
    "HealthReply",
    "ModelInfo",
    "TokenizeReply",
    "DetokenizeReply",
    "FlushCacheReply",
    "LoraAdapterReply",
    "CloseSessionReply",
    "WorkerStats",
    "StatsReply",
    "KeepAlive",
    "ServerMessage",
    "WorkerRequest",
    "WorkerAdd",
    "WorkerAbort",
    "WorkerPing",
    "WorkerStatsRequest",
    "WorkerFlush",
    "WorkerUnloadLora",
    "WorkerUpdateWeights",
    "WorkerWeightsReply",
    "WorkerPause",
    "WorkerContinue",
    "WorkerPauseReply",
    "PauseMode",
    "PAUSE_MODES",
    "PauseGeneration",
    "ContinueGeneration",
    "PauseReply",
    "MemoryTag",
    "MEMORY_TAGS",
    "ReleaseMemory",
    "ResumeMemory",
    "MemoryReply",
    "WorkerReleaseMemory",
    "WorkerResumeMemory",
    "WorkerMemoryReply",
    "WorkerLoadLora",
    "WorkerCloseSession",
    "WorkerShutdown",
    "WorkerRejoin",
    "WorkerKVSubscribe",
    "RouterToWorker",
    "WorkerHello",
    "WorkerOutputs",
    "WorkerHeartbeat",
    "WorkerStatsReply",
    "WorkerFlushReply",
    "WorkerLoraReply",
    "WorkerCloseSessionReply",
    "WorkerRejected",
    "WorkerGoodbye",
    "WorkerKVEvents",
    "WorkerToRouter",
    "WorkerReserve",
    "WorkerPrefill",
    "WorkerAdmit",
    "WorkerRelease",
    "WorkerReserved",
    "WorkerPrefilled",
    "WorkerReleased",
    "MAX_CACHE_SALT_CHARS",
    "decode_client",
    "decode_from_worker",
    "decode_server",
    "decode_to_worker",
    "encode",
    "request_id_of",
    "validate_generate",
]

MAX_CACHE_SALT_CHARS = 256

# --------------------------------------------------------------------------- encode / decode


class _Envelope(msgspec.Struct):
    """Lenient view of a frame, read only to explain why the strict decode failed."""

    type: Any = None
    version: Any = None
    request_id: Any = None


_encoder = msgspec.msgpack.Encoder()
_client_decoder = msgspec.msgpack.Decoder(ClientMessage)
_server_decoder = msgspec.msgpack.Decoder(ServerMessage)
_to_worker_decoder = msgspec.msgpack.Decoder(RouterToWorker)
_from_worker_decoder = msgspec.msgpack.Decoder(WorkerToRouter)
_envelope_decoder = msgspec.msgpack.Decoder(_Envelope)

_TAGS: dict[str, frozenset[str]] = {}


def _tags(union: Any) -> frozenset[str]:
    key = repr(union)
    if key not in _TAGS:
        infos = [msgspec.inspect.type_info(t) for t in union.__args__]
        _TAGS[key] = frozenset(
            str(i.tag) for i in infos if isinstance(i, msgspec.inspect.StructType)
        )
    return _TAGS[key]


def request_id_of(data: bytes) -> str | None:
    """The ``request_id`` of a frame, if it has a readable one (to tie an error to it)."""
    try:
        rid = _envelope_decoder.decode(data).request_id
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return rid if isinstance(rid, str) and rid else None


def encode(msg: msgspec.Struct) -> bytes:
    """Encode any protocol message to one msgpack frame."""
    return _encoder.encode(msg)


def _explain(data: bytes, union: Any, exc: Exception) -> Error:
    """Turn a failed strict decode into the most specific :class:`Error`."""
    try:
        env = _envelope_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return Error(code="malformed", message=f"frame is not a msgpack map: {exc}")
    rid = env.request_id if isinstance(env.request_id, str) else None
    if env.version is not None and env.version != PROTOCOL_VERSION:
        return Error(
            code="version_mismatch",
            message=f"protocol version {env.version!r} is not supported (server speaks {PROTOCOL_VERSION})",
            request_id=rid,
        )
    if env.type is None:
        return Error(code="invalid_message", message="message has no 'type' field", request_id=rid)
    if not isinstance(env.type, str) or env.type not in _tags(union):
        return Error(
            code="unknown_type",
            message=f"unknown message type {env.type!r}; expected one of {sorted(_tags(union))}",
            request_id=rid,
        )
    bad_text = invalid_utf8_path(data) if "UTF-8" in str(exc) else None
    if bad_text is not None:
        return Error(
            code="invalid_params",
            request_id=rid,
            message=f"{bad_text}: not valid Unicode (invalid UTF-8, e.g. a lone surrogate)",
        )
    return Error(
        code="invalid_message", message=f"invalid {env.type!r} message: {exc}", request_id=rid
    )


def _decode(data: bytes, decoder: msgspec.msgpack.Decoder, union: Any) -> Any:
    try:
        msg = decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return _explain(data, union, exc)
    if msg.version != PROTOCOL_VERSION:
        return Error(
            code="version_mismatch",
            message=f"protocol version {msg.version} is not supported (server speaks {PROTOCOL_VERSION})",
            request_id=getattr(msg, "request_id", None),
        )
    return msg


def validate_generate(req: GenerateRequest, vocab_size: int | None = None) -> Error | None:
    """Check the values of a generate request; return an :class:`Error` or ``None``."""
    problems: list[str] = []
    if not req.request_id:
        problems.append("request_id must be non-empty")
    given = [name for name in ("text", "input_ids", "messages") if getattr(req, name) is not None]
    if len(given) != 1:
        problems.append(
            f"exactly one of text, input_ids, messages must be given (got {given or 'none'})"
        )
    if req.input_ids is not None:
        if not req.input_ids:
            problems.append("input_ids must be non-empty")
        elif min(req.input_ids) < 0 or (
            vocab_size is not None and max(req.input_ids) >= vocab_size
        ):
            problems.append(f"input_ids must be token ids in [0, {vocab_size})")
    if req.messages is not None and not req.messages:
        problems.append("messages must be non-empty")
    if req.continue_final_message and (req.messages is None or req.add_generation_prompt):
        problems.append(
            "continue_final_message goes on with the last of messages: it needs messages and "
            "add_generation_prompt false"
        )
    if req.prediction is not None and req.params.prediction is not None:
        problems.append("give the prediction as text or as params.prediction ids, not both")
    if req.cache_salt is not None and not 0 < len(req.cache_salt) <= MAX_CACHE_SALT_CHARS:
        problems.append(f"cache_salt must have 1 to {MAX_CACHE_SALT_CHARS} characters")
    try:
        req.params.validate(vocab_size)
    except ValueError as exc:
        problems.append(str(exc))
    if problems:
        return Error(
            code="invalid_params", message="; ".join(problems), request_id=req.request_id or None
        )
    return None


def decode_client(data: bytes) -> ClientMessage | Error:
    """Decode and validate a client frame; an invalid frame returns an :class:`Error`."""
    msg = _decode(data, _client_decoder, ClientMessage)
    if isinstance(msg, GenerateRequest):
        err = validate_generate(msg)
        if err is not None:
            return err
    return msg


def decode_server(data: bytes) -> ServerMessage | Error:
    """Decode a router reply (client side); an undecodable frame returns an :class:`Error`."""
    return _decode(data, _server_decoder, ServerMessage)


def decode_to_worker(data: bytes) -> RouterToWorker | Error:
    """Decode a router -> worker frame."""
    return _decode(data, _to_worker_decoder, RouterToWorker)


def decode_from_worker(data: bytes) -> WorkerToRouter | Error:
    """Decode a worker -> router frame."""
    return _decode(data, _from_worker_decoder, WorkerToRouter)
