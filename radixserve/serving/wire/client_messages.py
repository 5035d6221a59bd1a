"""Client <-> router messages: text-level requests and replies.

Clients use a DEALER socket; every request carries a client-chosen ``request_id`` that the
replies echo, so many requests multiplex on one socket. :data:`ClientMessage` is the union a
client sends, :data:`ServerMessage` the one the router answers with.
"""

from __future__ import annotations

from typing import Any

import msgspec

from radixserve.engine.memory_tags import MemoryTag

# The engine's outputs are torch-free Structs: token-level results travel as they are.
from radixserve.engine.outputs import FinishReason, TokenLogprob, Usage
from radixserve.sampling_params import SamplingParams
from radixserve.serving.wire.base import ErrorCode, Msg, Part, PauseMode, WorkerLoad

# --------------------------------------------------------------------------- parts


class ToolCallPart(Part):
    """A tool call of an earlier assistant turn (``arguments``: JSON text, as OpenAI's)."""

    id: str
    name: str
    arguments: str


class ChatMessage(Part):
    """One chat turn, rendered by the model's chat template in the router. An assistant
    turn may carry ``tool_calls`` (and its ``reasoning_content``); a ``tool`` turn names
    the call it answers (``tool_call_id``) and maybe the function (``name``)."""

    role: str
    content: str
    tool_calls: list[ToolCallPart] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    reasoning_content: str | None = None


class Timings(Part):
    """Seconds measured at the router: queueing until dispatch, first token, whole request."""

    queue_s: float = 0.0
    ttft_s: float = 0.0
    total_s: float = 0.0


# --------------------------------------------------------------------------- client -> router


class GenerateRequest(Msg, tag="generate"):
    """Generate a completion for exactly one of ``text``, ``input_ids`` or ``messages``.

    ``messages`` are rendered with the model's chat template (``add_generation_prompt``;
    or ``continue_final_message``: the last message left open for the model to go on with,
    an assistant's reply prefilled, as vLLM's and transformers' option), with ``tools``
    (JSON text of OpenAI's tool list) and ``chat_template_kwargs`` (JSON text of an object:
    extra template variables, e.g. ``enable_thinking``) when given.
    Logprob options live in ``params`` (``logprobs``: top-k, ``prompt_logprobs_start``).
    ``prediction``: the text the output is expected to repeat, drafted from (a file an edit
    mostly keeps); it changes how fast the output comes, not what it is.
    ``lora``: the served LoRA adapter to run with (None: the base model).
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
    continue_final_message: bool = False
    tools: str | None = None
    chat_template_kwargs: str | None = None
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    stream: bool = False
    session_id: str | None = None
    namespace: str | None = None
    cache_salt: str | None = None
    priority: int = 0  # higher: its cached prefixes leave the worker's cache later
    # The output expected, as text (OpenAI's predicted outputs): the router encodes it into
    # ``params.prediction``, which token-level callers may set instead.
    prediction: str | None = None
    lora: str | None = None
    # The request's own chat template for ``messages`` (vLLM's ``chat_template``), where the
    # router takes them (RequestLimits.request_chat_templates).
    chat_template: str | None = None


class Abort(Msg, tag="abort"):
    """Abort an in-flight request of this connection (its KV is freed in the worker)."""

    request_id: str


class Health(Msg, tag="health"):
    """Liveness probe; answered by :class:`HealthReply`."""

    request_id: str


class ModelInfoRequest(Msg, tag="model_info"):
    """Ask for :class:`ModelInfo`."""

    request_id: str


class FlushCache(Msg, tag="flush_cache"):
    """Drop every worker's unreferenced radix-cache pages; answered by :class:`FlushCacheReply`."""

    request_id: str


class LoadLoraAdapter(Msg, tag="load_lora"):
    """Every worker loads the PEFT adapter at ``path`` (a directory on the workers' hosts) as
    ``name`` and serves it from then on; answered by :class:`LoraAdapterReply`. Like a
    cache flush, only an authenticated client may ask."""

    request_id: str
    name: str
    path: str


class UnloadLoraAdapter(Msg, tag="unload_lora"):
    """Every worker stops serving adapter ``name`` (its running requests finish with it);
    answered by :class:`LoraAdapterReply`."""

    request_id: str
    name: str


class UpdateWeights(Msg, tag="update_weights"):
    """Every worker serves the weights of the checkpoint at ``model_path`` (a directory on
    the workers' hosts, of the served architecture) from then on, its running requests
    finished first and new ones held meanwhile (SGLang's ``update_weights_from_disk``);
    ``weight_version`` names them (None: unchanged). Answered by
    :class:`UpdateWeightsReply`; like a cache flush, only an authenticated client may ask."""

    request_id: str
    model_path: str
    weight_version: str | None = None


class PauseGeneration(Msg, tag="pause_generation"):
    """Every worker stops generating until :class:`ContinueGeneration` (SGLang's
    ``pause_generation``, vLLM's ``/pause``; what an RL loop does around a weight update):
    requests that come meanwhile wait, and ``mode`` says what becomes of the running ones
    (:data:`~radixserve.serving.wire.base.PauseMode`). ``clear_cache``: then drop every
    cached prefix (with ``abort`` and ``wait``). Answered by :class:`PauseReply` once every
    worker paused; like a weight update, only an authenticated client may ask."""

    request_id: str
    mode: PauseMode = "abort"
    clear_cache: bool = False


class ContinueGeneration(Msg, tag="continue_generation"):
    """Every worker generates again, the requests kept and held going on; answered by
    :class:`PauseReply`."""

    request_id: str


class ReleaseMemory(Msg, tag="release_memory"):
    """Every worker gives the memory of ``tags`` back to the OS (SGLang's
    ``release_memory_occupation``, vLLM's ``/sleep``; None: every tag) and holds the
    requests that come until :class:`ResumeMemory`; refused while a request runs (pause with
    ``retract`` or ``abort`` first). Released weights are undefined until an
    :class:`UpdateWeights` after the resume. Answered by :class:`MemoryReply`; like a weight
    update, only an authenticated client may ask."""

    request_id: str
    tags: list[MemoryTag] | None = None


class ResumeMemory(Msg, tag="resume_memory"):
    """Every worker takes the memory of ``tags`` again (None: every tag); requests run once
    none is released. Answered by :class:`MemoryReply`."""

    request_id: str
    tags: list[MemoryTag] | None = None


class CloseSession(Msg, tag="close_session"):
    """The session ended: every worker releases its lease (its cached path becomes ordinary
    cache) and the router forgets where it ran; answered by :class:`CloseSessionReply`.
    ``namespace`` / ``cache_salt`` name the tenant's namespace, as on a generate request."""

    request_id: str
    session_id: str
    namespace: str | None = None
    cache_salt: str | None = None


class StatsRequest(Msg, tag="stats"):
    """Ask for :class:`StatsReply`."""

    request_id: str


class TokenizeRequest(Msg, tag="tokenize"):
    """Token ids of each text, encoded exactly as a ``text`` prompt of :class:`GenerateRequest`
    is; or, with ``messages`` (and no texts), of the one chat prompt those messages render to,
    exactly as a ``messages`` prompt is (the chat fields as :class:`GenerateRequest`'s).
    Answered by :class:`TokenizeReply`. (The DSL's ``select`` needs the ids to find where each
    choice's tokens begin after the prompt's; ``/v1/messages/count_tokens`` and ``/tokenize``
    count a conversation's.)"""

    request_id: str
    texts: list[str] = []
    add_special_tokens: bool = True  # texts: the tokenizer's BOS added as for a text prompt
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: str | None = None
    chat_template_kwargs: str | None = None
    chat_template: str | None = None

    def chat(self) -> GenerateRequest | None:
        """The generate request whose prompt the chat fields describe (None: texts)."""
        if self.messages is None:
            return None
        return GenerateRequest(
            request_id=self.request_id,
            messages=self.messages,
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            tools=self.tools,
            chat_template_kwargs=self.chat_template_kwargs,
            chat_template=self.chat_template,
        )


class DetokenizeRequest(Msg, tag="detokenize"):
    """The text of token ids, decoded by the router's tokenizer (a gateway or client without
    the model's own: ``/detokenize``, a remote tokenizer's ``decode``). Answered by
    :class:`DetokenizeReply`; ids past the vocabulary are an ``invalid_params`` error."""

    request_id: str
    token_ids: list[int]
    skip_special_tokens: bool = False


ClientMessage = (
    GenerateRequest
    | Abort
    | Health
    | ModelInfoRequest
    | FlushCache
    | LoadLoraAdapter
    | UnloadLoraAdapter
    | UpdateWeights
    | PauseGeneration
    | ContinueGeneration
    | ReleaseMemory
    | ResumeMemory
    | CloseSession
    | StatsRequest
    | TokenizeRequest
    | DetokenizeRequest
)


# --------------------------------------------------------------------------- router -> client


class GenerateChunk(Msg, tag="chunk"):
    """An increment of a streamed request; ``index`` counts chunks from 0 (order check)."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    prompt_tokens: int | None = None  # on the first chunk (index 0): the prompt's length in tokens
    # On the first chunk, when ``params.return_prompt_token_ids`` asks: the prompt's token ids.
    prompt_token_ids: list[int] | None = None


class GenerateFinal(Msg, tag="final"):
    """The last message of a request: full text and tokens, why it ended, usage, timings.

    ``prompt_logprobs`` holds one entry per prompt position from ``prompt_logprobs_start``
    (``None`` where undefined, i.e. position 0); ``prompt_top_logprobs`` (with ``logprobs``
    k > 0) each position's k likeliest ``(token_id, logprob)``; ``prompt_logprob_ranks``
    each scored token's rank in its position's distribution (1: the likeliest);
    ``prompt_token_ids`` (with prompt logprobs) the whole prompt as the model read it, so
    that a client that sent text can name the tokens scored.
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
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_token_ids: list[int] | None = None
    # The stop string that ended the text (None: none did; a stop token shows in token_ids):
    # SGLang's finish_reason.matched, vLLM's stop_reason, Anthropic's stop_sequence.
    matched_stop: str | None = None
    prompt_logprob_ranks: list[int | None] | None = None
    # params.return_embedding: the final norm's output at the prompt's last token.
    embedding: list[float] | None = None
    # The weights that answered (SGLang's meta_info.weight_version: an RL rollout's policy).
    weight_version: str = "default"
    # With params.logprob_token_ids (SGLang's token_ids_logprob) and prompt logprobs: each
    # prompt position's logprobs of those tokens, in their order (empty for position 0).
    prompt_asked_logprobs: list[list[float]] | None = None
    # params.return_hidden_states: the final norm's output at every position the model read
    # (the prompt's, then each output token's but the last).
    hidden_states: list[list[float]] | None = None


class Error(Msg, tag="error"):
    """A request failed or a frame was bad; ``request_id`` is set when it was known."""

    code: ErrorCode
    message: str
    request_id: str | None = None


class HealthReply(Msg, tag="health_reply"):
    """``ok`` when at least one worker is alive."""

    request_id: str
    ok: bool
    workers_alive: int
    uptime_s: float


class ModelInfo(Msg, tag="model_info_reply"):
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
    model_path: str = ""  # the directory the weights were loaded from ("" when unknown)
    # The tokenizer's special tokens by name (bos_token, eos_token, ...): chat templates use
    # them, and a client rendering roles itself needs the same values as the router.
    special_tokens: dict[str, str] = {}
    lora_adapters: list[str] = []  # the LoRA adapters served, by name (docs/lora.md)
    # What the served weights are called (SGLang's weight_version; update_weights_from_disk).
    weight_version: str = "default"
    paused: PauseMode | None = None  # the pause in force (PauseGeneration), None: generating
    memory_released: list[MemoryTag] = []  # the memory given back (ReleaseMemory): asleep
    # A sequence classifier's label names in class order (empty: not a classifier), and the
    # problem_type its probabilities are read by ("": none said).
    labels: list[str] = []
    problem_type: str = ""


class TokenizeReply(Msg, tag="tokenize_reply"):
    """The token ids of each text of a :class:`TokenizeRequest`, in order."""

    request_id: str
    input_ids: list[list[int]]


class DetokenizeReply(Msg, tag="detokenize_reply"):
    """The text of a :class:`DetokenizeRequest`'s ids."""

    request_id: str
    text: str


class CloseSessionReply(Msg, tag="close_session_reply"):
    """``released``: some worker held a lease for the session and released it."""

    request_id: str
    released: bool


class LoraAdapterReply(Msg, tag="lora_reply"):
    """``ok`` when every live worker serves the adapter afterwards (a load) or none does (an
    unload); else ``code`` says why (``invalid_params``: a worker refused the adapter,
    ``not_found``: no worker served the name, ``unavailable``: no worker answered) and
    ``error`` what the workers said; ``adapters``: the adapters every live worker serves now
    (name -> cache key)."""

    request_id: str
    ok: bool
    code: str | None = None
    error: str | None = None
    adapters: dict[str, str] = {}


class UpdateWeightsReply(Msg, tag="update_weights_reply"):
    """``ok`` when every live worker serves the new weights; else ``code``
    (``invalid_params``: a worker refused them, ``unavailable``: no worker answered) and
    ``error``, what the workers said. ``model_path`` and ``weight_version``: what the
    workers serve now."""

    request_id: str
    ok: bool
    code: str | None = None
    error: str | None = None
    model_path: str = ""
    weight_version: str = "default"


class PauseReply(Msg, tag="pause_reply"):
    """``ok`` when every live worker paused (or generates again); else ``code``
    (``invalid_params``: a worker refused, ``unavailable``: no worker answered) and
    ``error``, what the workers said. ``paused``: whether generation is paused now;
    ``stopped``: the running requests the pause aborted or retracted."""

    request_id: str
    ok: bool
    code: str | None = None
    error: str | None = None
    paused: bool = False
    stopped: int = 0


class MemoryReply(Msg, tag="memory_reply"):
    """``ok`` when every live worker released (or resumed) the memory asked; else ``code``
    (``invalid_params``: a worker refused, ``unavailable``: no worker answered) and
    ``error``, what the workers said. ``released``: the tags released now; ``freed_bytes``:
    what the workers gave back."""

    request_id: str
    ok: bool
    code: str | None = None
    error: str | None = None
    released: list[MemoryTag] = []
    freed_bytes: int = 0


class FlushCacheReply(Msg, tag="flush_cache_reply"):
    """``ok`` when every live worker flushed (a worker with running requests refuses)."""

    request_id: str
    ok: bool


class WorkerStats(Part):
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


class StatsReply(Msg, tag="stats_reply"):
    """Router counters and one :class:`WorkerStats` per worker ever registered."""

    request_id: str
    routing: str
    requests: int
    active: int
    aborted: int
    errors: int
    clients: int
    workers: list[WorkerStats]


class KeepAlive(Msg, tag="keepalive"):
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
    | LoraAdapterReply
    | UpdateWeightsReply
    | PauseReply
    | MemoryReply
    | CloseSessionReply
    | StatsReply
    | KeepAlive
    | TokenizeReply
    | DetokenizeReply
)
