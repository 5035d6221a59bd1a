"""What rank 0 tells the other tensor-parallel ranks: msgspec messages, one per broadcast.

The scheduler runs only on rank 0, so the other ranks never see a ``Request``: rank 0 sends
each step's plan (host lists) together with what its sampler's host half staged for it (per-row
temperatures, penalties' new tokens, grammar masks, the uniform draws) and that half's
:class:`~radixserve.engine.sampler.SamplingPlan`. Every rank then runs the same device half on
the same inputs: the same forward over its own heads, the same page-table patches, the same
sampled tokens (each rank keeps them for overlap scheduling's device-side inputs)::

    rank 0: schedule -> StepPlan -> stage + sampler.prepare ─┬─> StepMessage ──broadcast──> ranks 1..N-1
                                                             └─> device half (forward, sample)
    ranks 1..N-1: StepMessage -> device half (forward, sample) -> result dropped

``RankInit`` is the first message (the KV pool rank 0 sized, the runner's shape), ``Shutdown``
the last. ``KVWrite`` (prefill/decode disaggregation) has every rank write its share of a
prompt's KV into the decode engine's pools (:mod:`radixserve.distributed.disagg.rank_transfer`).
"""

from __future__ import annotations

import msgspec

from radixserve.distributed.disagg.kv_layout import PoolDescriptor, Segment
from radixserve.engine.config import EngineConfig
from radixserve.engine.sampler import SamplingPlan
from radixserve.engine.staging import LayoutFields, StagingLayout
from radixserve.scheduling.plan import StepPlan

__all__ = [
    "Audit",
    "KVWrite",
    "LoadLora",
    "Ping",
    "RankInit",
    "Shutdown",
    "StepMessage",
    "UnloadLora",
    "decode",
    "encode",
    "plan_of",
    "step_message",
]


class RankInit(msgspec.Struct, tag="init", array_like=True):
    """Rank 0's sizing: every rank builds the same pool (its own heads) and runner shape."""

    num_pages: int  # pool pages, the scratch page included
    max_rows: int
    max_pages: int
    scratch_page: int
    max_total_len: int  # for the warm-up
    # The settings every rank must share (another host's ranks take theirs from their own
    # command line): rank_settings(cfg) of rank 0, compared by each rank with its own.
    settings: list[str] = []
    # A sliding-window model's window pool (engine.window_setup), which every rank builds the
    # same over its own heads: its layers (empty: none), its pages (the scratch page
    # included) and the window.
    window_layers: list[int] = []
    num_window_pages: int = 0
    window: int = 0


def rank_settings(cfg: EngineConfig) -> list[str]:
    """The engine settings that must be equal on every rank, as ``name=value`` strings."""
    names = [
        *("page_size", "kv_cache_dtype", "dtype", "attention_backend", "quantization"),
        *("quant_group_size", "seed", "decode_graphs", "tensor_parallel_size", "nnodes"),
        *("tp_graph_capture", "expert_parallel"),
    ]
    return [f"{n}={getattr(cfg, n)}" for n in names]


class StepMessage(msgspec.Struct, tag="step", array_like=True):
    """One step: the plan's lists (no requests) and the sampler's staged inputs."""

    input_ids: list[int]
    positions: list[int]
    out_slots: list[int]
    table_rows: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    seq_lens: list[int]
    page_lists: list[list[int]]
    write_rows: list[int]
    write_cols: list[int]
    write_pages: list[int]
    logits_indices: list[int]
    prompt_targets: list[int]
    future_rows: list[int]
    future_src: list[int]
    num_sample: int
    sampling: LayoutFields | None
    sampling_plan: SamplingPlan | None
    # The window map entries the scheduler changed for this step (global pages, window pages
    # or -1); every rank applies them to its own map before the forward (memory.window_pool).
    window_writes: tuple[list[int], list[int]] | None = None
    prompt_top_k: int = 0
    # Each sequence's LoRA slot (StepPlan.lora_slots; None: every row the base model's).
    lora_slots: list[int] | None = None


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    """The worker is stopping: leave the rank loop."""

    reason: str


class Ping(msgspec.Struct, tag="ping", array_like=True):
    """Health check while the worker is idle: every rank answers with one all-reduce."""


class Audit(msgspec.Struct, tag="audit", array_like=True):
    """Invariant check: every rank contributes its pool size and page-table digest to one
    all-gather (rank 0 asserts they agree)."""


class KVWrite(msgspec.Struct, tag="kv_write", array_like=True):
    """Every rank writes ``shares[its rank]`` of pages ``src`` of its pool into pages ``dst``
    of the decode ranks' pools ``peers``, then all ranks all-gather the bytes each wrote
    (-1: its write failed)."""

    peers: list[PoolDescriptor]
    shares: list[list[Segment]]  # per prefill rank: heads into which decode rank
    src: list[int]
    dst: list[int]


class UpdateWeights(msgspec.Struct, tag="update_weights", array_like=True):
    """New weights (``Engine.update_weights_from_disk``): every rank loads its share of the
    checkpoint at ``path`` and checks it, all all-gather whether they could (1) or not (0),
    and only if every rank could does each copy its share in."""

    path: str


class LoadLora(msgspec.Struct, tag="load_lora", array_like=True):
    """A LoRA adapter loaded while serving (``Engine.add_lora_adapter``): every rank reads
    its share of the adapter at ``path`` and checks it, all all-gather whether they could,
    and only if every rank could does each serve it as ``name`` in ``slot`` (rank 0's
    choice, so that a step's slots name the same adapter on every rank)."""

    name: str
    path: str
    slot: int
    digest: str  # of the files rank 0 read: a rank reading other files refuses them


class UnloadLora(msgspec.Struct, tag="unload_lora", array_like=True):
    """Adapter ``name`` takes no new request (``Engine.unload_lora_adapter``); its slot
    drains on every rank until rank 0 gives it to the next adapter it loads."""

    name: str


Message = (
    RankInit
    | StepMessage
    | Shutdown
    | Ping
    | Audit
    | KVWrite
    | UpdateWeights
    | LoadLora
    | UnloadLora
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes | memoryview) -> Message:
    return _decoder.decode(data)


def step_message(
    plan: StepPlan, sampling: StagingLayout | None, splan: SamplingPlan | None
) -> StepMessage:
    """``plan`` as sent to the other ranks, with the sampler's staged fields and plan."""
    return StepMessage(
        plan.input_ids,
        plan.positions,
        plan.out_slots,
        plan.table_rows,
        plan.prefix_lens,
        plan.extend_lens,
        plan.seq_lens,
        plan.page_lists,
        plan.write_rows,
        plan.write_cols,
        plan.write_pages,
        plan.logits_indices,
        plan.prompt_targets,
        plan.future_rows,
        plan.future_src,
        len(plan.sample_rows),
        None if sampling is None else sampling.export(),
        splan,
        plan.window_writes,
        plan.prompt_top_k,
        plan.lora_slots,
    )


def plan_of(msg: StepMessage) -> StepPlan:
    """The :class:`StepPlan` of ``msg`` (``sample_rows`` empty: the device half needs only the
    count, ``msg.num_sample``)."""
    return StepPlan(
        input_ids=msg.input_ids,
        positions=msg.positions,
        out_slots=msg.out_slots,
        table_rows=msg.table_rows,
        prefix_lens=msg.prefix_lens,
        extend_lens=msg.extend_lens,
        seq_lens=msg.seq_lens,
        page_lists=msg.page_lists,
        write_rows=msg.write_rows,
        write_cols=msg.write_cols,
        write_pages=msg.write_pages,
        logits_indices=msg.logits_indices,
        sample_rows=[],
        prompt_targets=msg.prompt_targets,
        future_rows=msg.future_rows,
        future_src=msg.future_src,
        window_writes=msg.window_writes,
        prompt_top_k=msg.prompt_top_k,
        lora_slots=msg.lora_slots,
    )
