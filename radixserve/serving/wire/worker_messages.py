"""Router <-> worker messages: token-level only, a worker never sees text.

:data:`RouterToWorker` is the union the router sends, :data:`WorkerToRouter` the one a
worker answers with; a worker's first message is its :class:`WorkerHello`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from radixserve.engine.memory_tags import MemoryTag
from radixserve.engine.outputs import StepOutput
from radixserve.sampling_params import SamplingParams
from radixserve.serving.wire.base import Msg, Part, PauseMode, WorkerLoad

# --------------------------------------------------------------------------- router <-> worker


class WorkerRequest(Part):
    """One request for a worker: tokens and parameters, never text. ``rid`` is router-global."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    namespace: str | None = None
    session_id: str | None = None  # the router's session (its KV is leased between turns)
    priority: int = 0
    lora: str | None = None  # the served LoRA adapter it runs with (None: the base model)


class WorkerAdd(Msg, tag="w_add"):
    """Router -> worker: start these requests."""

    requests: list[WorkerRequest]


class WorkerAbort(Msg, tag="w_abort"):
    """Router -> worker: abort these requests (free their KV)."""

    rids: list[str]


class WorkerPing(Msg, tag="w_ping"):
    """Router -> worker: liveness probe; the worker answers with a heartbeat."""


class WorkerStatsRequest(Msg, tag="w_stats"):
    """Router -> worker: send :class:`WorkerStatsReply` with this ``token``."""

    token: int


class WorkerFlush(Msg, tag="w_flush"):
    """Router -> worker: flush the radix cache; answer :class:`WorkerFlushReply`."""

    token: int


class WorkerCloseSession(Msg, tag="w_close_session"):
    """Router -> worker: release this session's lease; answer :class:`WorkerCloseSessionReply`."""

    token: int
    session_id: str
    namespace: str | None = None


class WorkerLoadLora(Msg, tag="w_load_lora"):
    """Router -> worker: serve the PEFT adapter at ``path`` as ``name``; answer
    :class:`WorkerLoraReply` (``token`` 0: the router replays a load to a worker that
    joined, and waits on no answer)."""

    token: int
    name: str
    path: str


class WorkerUnloadLora(Msg, tag="w_unload_lora"):
    """Router -> worker: stop serving adapter ``name``; answer :class:`WorkerLoraReply`."""

    token: int
    name: str


class WorkerUpdateWeights(Msg, tag="w_update_weights"):
    """Router -> worker: serve the weights at ``path`` once the requests running finish
    (those that come meanwhile wait); answer :class:`WorkerWeightsReply` (``token`` 0: the
    router replays an update to a worker that joined)."""

    token: int
    path: str
    weight_version: str | None = None


class WorkerPause(Msg, tag="w_pause"):
    """Router -> worker: stop generating until :class:`WorkerContinue`; requests that come
    meanwhile are held. ``mode``: what becomes of the running ones (:data:`PauseMode`);
    ``clear_cache``: then drop the cached prefixes (with ``abort`` and ``wait``, which
    leave nothing running; ignored otherwise). Answer :class:`WorkerPauseReply` once
    paused (``wait``: once they finished); ``token`` 0: the router pauses a worker that
    joins while the others are paused."""

    token: int
    mode: PauseMode = "abort"
    clear_cache: bool = False


class WorkerContinue(Msg, tag="w_continue"):
    """Router -> worker: generate again, the requests held and kept starting; answer
    :class:`WorkerPauseReply`."""

    token: int


class WorkerReleaseMemory(Msg, tag="w_release_memory"):
    """Router -> worker: give the memory of ``tags`` back to the OS and hold the requests
    that come until none is released; answer :class:`WorkerMemoryReply`. ``token`` 0: the
    router releases a worker that joins while the others sleep."""

    token: int
    tags: list[MemoryTag]


class WorkerResumeMemory(Msg, tag="w_resume_memory"):
    """Router -> worker: take the memory of ``tags`` again; answer :class:`WorkerMemoryReply`."""

    token: int
    tags: list[MemoryTag]


class WorkerShutdown(Msg, tag="w_shutdown"):
    """Router -> worker: abort everything, say goodbye and exit."""


class WorkerRejoin(Msg, tag="w_rejoin"):
    """Router -> worker: you were declared dead (silent past the heartbeat timeout, e.g.
    during a very long step) and your requests failed; abort everything and say hello again.

    ``join``: the :attr:`WorkerHello.join` of the hello the router gave up on. A worker that
    has said hello again since (it reconnected on its own, and the ask crossed its new hello)
    ignores it: the router already holds what it sent after that hello, and a second rejoin
    would abort those requests for nothing. -1: whichever join (obey)."""

    join: int = -1


class WorkerKVSubscribe(Msg, tag="w_kv_subscribe"):
    """Router -> worker: send your KV events over this connection from now on, starting with
    a snapshot of what your cache holds (:class:`WorkerKVEvents`); sent again after a gap."""


RouterToWorker = (
    WorkerKVSubscribe
    | WorkerAdd
    | WorkerAbort
    | WorkerPing
    | WorkerStatsRequest
    | WorkerFlush
    | WorkerCloseSession
    | WorkerLoadLora
    | WorkerUnloadLora
    | WorkerUpdateWeights
    | WorkerPause
    | WorkerContinue
    | WorkerReleaseMemory
    | WorkerResumeMemory
    | WorkerShutdown
    | WorkerRejoin
)


class WorkerHello(Msg, tag="w_hello"):
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
    weight_version: str = "default"  # what its weights are called (SGLang's weight_version)
    disaggregation_mode: str = (
        ""  # "prefill" / "decode" (serving.wire.disagg_messages); "": colocated
    )
    join: int = 0  # how many hellos this worker process said before this one (WorkerRejoin)
    # The LoRA adapters it serves: name -> the key their cache namespace is split by (the
    # router routes an adapter's prompts by it: radixserve.prefix.lora_namespace).
    lora_adapters: dict[str, str] = {}
    # Its pause and released memory (a router that started since they were asked for learns
    # them here: router/pause_ops.py, router/memory_ops.py).
    paused: PauseMode | None = None
    memory_released: list[MemoryTag] = []
    # The model's hidden size: what a request's hidden states (return_hidden_states) weigh,
    # which the router bounds over the requests in flight (0: unknown, not bounded).
    hidden_size: int = 0
    # A sequence classifier's label names in class order (ModelConfig.classifier); empty: the
    # model is not one. The gateway's /v1/classify names the argmax's label from them.
    labels: list[str] = []
    problem_type: str = ""  # its head's problem_type ("": none said; classifier.class_probs)


class WorkerOutputs(Msg, tag="w_outputs"):
    """Worker -> router: the outputs of one step, with the load after it."""

    outputs: list[StepOutput]  # the engine's step outputs, as they are
    load: WorkerLoad


class WorkerHeartbeat(Msg, tag="w_heartbeat"):
    """Worker -> router: alive, with its load."""

    load: WorkerLoad


class WorkerStatsReply(Msg, tag="w_stats_reply"):
    """Worker -> router: the engine's stats as a plain map."""

    token: int
    load: WorkerLoad
    engine: dict[str, Any]


class WorkerFlushReply(Msg, tag="w_flush_reply"):
    """Worker -> router: whether the flush happened."""

    token: int
    ok: bool


class WorkerLoraReply(Msg, tag="w_lora_reply"):
    """Worker -> router: ``error``, why a load or unload failed (None: done); ``adapters``,
    the adapters it serves now (name -> cache key)."""

    token: int
    error: str | None
    adapters: dict[str, str]


class WorkerWeightsReply(Msg, tag="w_weights_reply"):
    """Worker -> router: ``error``, why an update failed (None: done; the weights are then
    unchanged); the checkpoint and version it serves now."""

    token: int
    error: str | None
    model_path: str
    weight_version: str


class WorkerPauseReply(Msg, tag="w_pause_reply"):
    """Worker -> router: ``error``, why a pause or continue failed (None: done); whether it
    is paused now, and how many running requests the pause ended (``abort``) or sent back
    to the queue (``retract``)."""

    token: int
    error: str | None = None
    paused: bool = False
    stopped: int = 0


class WorkerMemoryReply(Msg, tag="w_memory_reply"):
    """Worker -> router: ``error``, why a release or resume failed (None: done); the tags
    released now, and the bytes the release gave back."""

    token: int
    error: str | None = None
    released: list[MemoryTag] = []
    freed_bytes: int = 0


class WorkerCloseSessionReply(Msg, tag="w_close_session_reply"):
    """Worker -> router: whether it held a lease for the session (now released)."""

    token: int
    released: bool


class WorkerRejected(Msg, tag="w_rejected"):
    """Worker -> router: the engine refused a request (its ``add_request`` raised)."""

    rid: str
    message: str


class WorkerGoodbye(Msg, tag="w_goodbye"):
    """Worker -> router: exiting; everything it ran is gone."""

    reason: str = ""


class WorkerKVEvents(Msg, tag="w_kv_events"):
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
    | WorkerLoraReply
    | WorkerWeightsReply
    | WorkerPauseReply
    | WorkerMemoryReply
    | WorkerCloseSessionReply
    | WorkerRejected
    | WorkerGoodbye
)
