"""The wire protocol: every message that crosses a radixserve socket.

Torch-free on purpose (clients and the DSL import it). All messages are ``msgspec.Struct``
types in two tagged unions (tag field ``"type"``), encoded as msgpack, one message per
ZeroMQ frame:

* client <-> router: text-level requests and replies (:data:`ClientMessage`,
  :data:`ServerMessage`). Clients use a DEALER socket; every request carries a
  client-chosen ``request_id`` that the replies echo, so many requests multiplex on one
  socket.
* router <-> worker: token-level only (:data:`RouterToWorker`, :data:`WorkerToRouter`);
  a worker never sees text.

Decoding validates (types, unknown fields, the protocol version, sampling parameter
values) and never raises: a bad frame becomes an :class:`Error` the caller sends back.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

# The engine's outputs are torch-free Structs: token-level results travel as they are.
from radixserve.engine.outputs import FinishReason, StepOutput, TokenLogprob, Usage
from radixserve.sampling_params import SamplingParams
from radixserve.serving.limits import invalid_utf8_path

PROTOCOL_VERSION = 1
MAX_CACHE_SALT_CHARS = 256
"""Bumped on any incompatible change; a message with another version gets an Error."""

ErrorCode = Literal[
    "malformed",  # not msgpack / not a map / wrong frame count
    "unknown_type",  # the "type" tag names no message
    "version_mismatch",  # the "version" field is not PROTOCOL_VERSION
    "invalid_message",  # wrong field types, missing or unknown fields
    "invalid_params",  # values out of range (SamplingParams.validate, token ids, ...)
    "duplicate_request",  # a request id already in flight on this connection
    "context_length",  # the prompt does not fit the model's context
    "request_too_large",  # the frame is larger than the router's request-size limit
    "no_workers",  # no live worker to run the request
    "worker_died",  # the worker running the request went away
    "shutdown",  # the server is stopping
    "timeout",  # the server gave up waiting (e.g. for workers to answer)
    "internal",  # a bug; the message says what
]


class _Msg(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, kw_only=True):
    """Base of every tagged message. ``version`` is always encoded (no omit_defaults)."""

    version: int = PROTOCOL_VERSION


class _Part(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Base of nested (untagged) structs."""


# --------------------------------------------------------------------------- shared parts


class ChatMessage(_Part):
    """One chat turn, rendered by the model's chat template in the router."""

    role: str
    content: str


class Timings(_Part):
    """Seconds measured at the router: queueing until dispatch, first token, whole request."""

    queue_s: float = 0.0
    ttft_s: float = 0.0
    total_s: float = 0.0


class WorkerLoad(_Part):
    """A worker's load, piggybacked on its outputs and heartbeats."""

    running: int = 0
    waiting: int = 0
    num_pages: int = 0
    free_pages: int = 0
    evictable_pages: int = 0
    in_use_pages: int = 0


# --------------------------------------------------------------------------- client -> router


class GenerateRequest(_Msg, tag="generate"):
    """Generate a completion for exactly one of ``text``, ``input_ids`` or ``messages``.

    ``messages`` are rendered with the model's chat template (``add_generation_prompt``).
    Logprob options live in ``params`` (``logprobs``: top-k, ``prompt_logprobs_start``).
    ``session_id`` keeps a program's calls on one worker (its cache); ``namespace``
    isolates radix-cache sharing, and so does ``cache_salt`` (vLLM's name: a tenant's
    secret; the router hashes it into the namespace, workers never see it).
    With ``stream`` the router sends :class:`GenerateChunk`
    messages before the :class:`GenerateFinal`; without it only the final.
    """

    request_id: str
    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    stream: bool = False
    session_id: str | None = None
    namespace: str | None = None
    cache_salt: str | None = None


class Abort(_Msg, tag="abort"):
    """Abort an in-flight request of this connection (its KV is freed in the worker)."""

    request_id: str


class Health(_Msg, tag="health"):
    """Liveness probe; answered by :class:`HealthReply`."""

    request_id: str


class ModelInfoRequest(_Msg, tag="model_info"):
    """Ask for :class:`ModelInfo`."""

    request_id: str


class FlushCache(_Msg, tag="flush_cache"):
    """Drop every worker's unreferenced radix-cache pages; answered by :class:`FlushCacheReply`."""

    request_id: str


class StatsRequest(_Msg, tag="stats"):
    """Ask for :class:`StatsReply`."""

    request_id: str


class TokenizeRequest(_Msg, tag="tokenize"):
    """Token ids of each text, encoded exactly as a ``text`` prompt of :class:`GenerateRequest`
    is; answered by :class:`TokenizeReply`. (The DSL's ``select`` needs the ids to find where
    each choice's tokens begin after the prompt's.)"""

    request_id: str
    texts: list[str]


ClientMessage = (
    GenerateRequest
    | Abort
    | Health
    | ModelInfoRequest
    | FlushCache
    | StatsRequest
    | TokenizeRequest
)


# --------------------------------------------------------------------------- router -> client


class GenerateChunk(_Msg, tag="chunk"):
    """An increment of a streamed request; ``index`` counts chunks from 0 (order check)."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    prompt_tokens: int | None = None  # on the first chunk (index 0): the prompt's length in tokens


class GenerateFinal(_Msg, tag="final"):
    """The last message of a request: full text and tokens, why it ended, usage, timings.

    ``prompt_logprobs`` holds one entry per prompt position from ``prompt_logprobs_start``
    (``None`` where undefined, i.e. position 0).
    """

    request_id: str
    finish_reason: FinishReason
    text: str
    token_ids: list[int]
    usage: Usage
    timings: Timings
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[float | None] | None = None
    worker_id: int = -1


class Error(_Msg, tag="error"):
    """A request failed or a frame was bad; ``request_id`` is set when it was known."""

    code: ErrorCode
    message: str
    request_id: str | None = None


class HealthReply(_Msg, tag="health_reply"):
    """``ok`` when at least one worker is alive."""

    request_id: str
    ok: bool
    workers_alive: int
    uptime_s: float


class ModelInfo(_Msg, tag="model_info_reply"):
    """What a client needs to know about the served model."""

    request_id: str
    model: str
    context_length: int
    vocab_size: int
    eos_token_ids: list[int]
    bos_token_id: int | None = None
    chat_template: str | None = None
    page_size: int = 1
    num_workers: int = 0
    model_path: str = ""  # the directory the model was loaded from ("" when unknown)
    # The tokenizer's special tokens by name (bos_token, eos_token, ...): chat templates use
    # them, and a client rendering roles itself needs the same values as the router.
    special_tokens: dict[str, str] = {}


class TokenizeReply(_Msg, tag="tokenize_reply"):
    """The token ids of each text of a :class:`TokenizeRequest`, in order."""

    request_id: str
    input_ids: list[list[int]]


class FlushCacheReply(_Msg, tag="flush_cache_reply"):
    """``ok`` when every live worker flushed (a worker with running requests refuses)."""

    request_id: str
    ok: bool


class WorkerStats(_Part):
    """One worker as the router sees it, plus the engine's own stats (``engine``)."""

    worker_id: int
    alive: bool  # False as soon as it is found gone (its death is settled within EXIT_GRACE_S)
    pid: int | None
    inflight: int
    requests: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    load: WorkerLoad
    engine: dict[str, Any] = {}
    death: str | None = None  # why the router declared it dead
    prefill_tokens: int = 0  # prompt tokens sent and not yet prefilled (the router's estimate)


class StatsReply(_Msg, tag="stats_reply"):
    """Router counters and one :class:`WorkerStats` per worker ever registered."""

    request_id: str
    routing: str
    requests: int
    active: int
    aborted: int
    errors: int
    clients: int
    workers: list[WorkerStats]


class KeepAlive(_Msg, tag="keepalive"):
    """Probe the router sends to clients with requests in flight; clients ignore it.

    The ROUTER socket is ``ROUTER_MANDATORY``: sending to a client that went away fails,
    which is how the router learns to abort its requests.
    """


ServerMessage = (
    GenerateChunk
    | GenerateFinal
    | Error
    | HealthReply
    | ModelInfo
    | FlushCacheReply
    | StatsReply
    | KeepAlive
    | TokenizeReply
)


# --------------------------------------------------------------------------- router <-> worker


class WorkerRequest(_Part):
    """One request for a worker: tokens and parameters, never text. ``rid`` is router-global."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    namespace: str | None = None


class WorkerAdd(_Msg, tag="w_add"):
    """Router -> worker: start these requests."""

    requests: list[WorkerRequest]


class WorkerAbort(_Msg, tag="w_abort"):
    """Router -> worker: abort these requests (free their KV)."""

    rids: list[str]


class WorkerPing(_Msg, tag="w_ping"):
    """Router -> worker: liveness probe; the worker answers with a heartbeat."""


class WorkerStatsRequest(_Msg, tag="w_stats"):
    """Router -> worker: send :class:`WorkerStatsReply` with this ``token``."""

    token: int


class WorkerFlush(_Msg, tag="w_flush"):
    """Router -> worker: flush the radix cache; answer :class:`WorkerFlushReply`."""

    token: int


class WorkerShutdown(_Msg, tag="w_shutdown"):
    """Router -> worker: abort everything, say goodbye and exit."""


class WorkerRejoin(_Msg, tag="w_rejoin"):
    """Router -> worker: you were declared dead (silent past the heartbeat timeout, e.g.
    during a very long step) and your requests failed; abort everything and say hello again."""


class WorkerKVSubscribe(_Msg, tag="w_kv_subscribe"):
    """Router -> worker: send your KV events over this connection from now on, starting with
    a snapshot of what your cache holds (:class:`WorkerKVEvents`); sent again after a gap."""


RouterToWorker = (
    WorkerKVSubscribe
    | WorkerAdd
    | WorkerAbort
    | WorkerPing
    | WorkerStatsRequest
    | WorkerFlush
    | WorkerShutdown
    | WorkerRejoin
)


class WorkerHello(_Msg, tag="w_hello"):
    """Worker -> router, first message: who it is and what model it serves."""

    worker_id: int
    pid: int
    model: str
    context_length: int
    vocab_size: int
    eos_token_ids: list[int]
    bos_token_id: int | None = None
    page_size: int = 1
    load: WorkerLoad = msgspec.field(default_factory=WorkerLoad)
    model_path: str = ""  # where the weights and tokenizer were loaded from


class WorkerOutputs(_Msg, tag="w_outputs"):
    """Worker -> router: the outputs of one step, with the load after it."""

    outputs: list[StepOutput]  # the engine's step outputs, as they are
    load: WorkerLoad


class WorkerHeartbeat(_Msg, tag="w_heartbeat"):
    """Worker -> router: alive, with its load."""

    load: WorkerLoad


class WorkerStatsReply(_Msg, tag="w_stats_reply"):
    """Worker -> router: the engine's stats as a plain map."""

    token: int
    load: WorkerLoad
    engine: dict[str, Any]


class WorkerFlushReply(_Msg, tag="w_flush_reply"):
    """Worker -> router: whether the flush happened."""

    token: int
    ok: bool


class WorkerRejected(_Msg, tag="w_rejected"):
    """Worker -> router: the engine refused a request (its ``add_request`` raised)."""

    rid: str
    message: str


class WorkerGoodbye(_Msg, tag="w_goodbye"):
    """Worker -> router: exiting; everything it ran is gone."""

    reason: str = ""


class WorkerKVEvents(_Msg, tag="w_kv_events"):
    """Worker -> router: one batch of its KV events (after :class:`WorkerKVSubscribe`).

    ``batch`` is the vLLM-format msgpack ``KVEventBatch`` the worker's XPUB publishes, and
    ``seq`` its number on this connection, from 0 at each snapshot. A snapshot (``snapshot``)
    begins with ``AllBlocksCleared`` and stores what the cache holds (L1 blocks, L2 blocks),
    and says how to hash a prompt the worker's way: the page-key ``hash_identity`` (model and
    KV layout, :class:`~radixserve.memory.page_hash.PrefixHasher`), ``page_size``, and the
    event ``medium`` of L1."""

    seq: int
    batch: bytes
    snapshot: bool = False
    hash_identity: str = ""
    page_size: int = 0
    medium: str = ""


WorkerToRouter = (
    WorkerKVEvents
    | WorkerHello
    | WorkerOutputs
    | WorkerHeartbeat
    | WorkerStatsReply
    | WorkerFlushReply
    | WorkerRejected
    | WorkerGoodbye
)


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
