"""KV memory arithmetic: bytes per token, pages that fit a budget, and memory snapshots.

The KV cache of one token is, for K and V, in every layer, for every KV head, ``head_dim``
values::

    bytes/token = 2 (K, V) × num_layers × kv_heads × (head_dim × storage bytes + scale bytes)

The per-head term comes from :class:`radixkernels.kv_format.KVFormat` (the same object the
pool allocates from and the kernels read), so the planner's numbers are the pool's numbers:
int8/int4 pay a float32 scale per (token, KV head), fp8 a static per-head scale per layer
(a constant, counted in the pool's fixed bytes). GQA enters through ``kv_heads``: Llama-2-70B
keeps 8 KV heads for 64 query heads, an 8× smaller cache than multi-head attention.

The budget::

    budget     = --memory-budget, or device memory × --memory-utilization
                 (on CPU also capped by the memory available right now: the RAM is shared)
    kv budget  = budget − weights − activation reserve − fixed scale bytes
    num_pages  = kv budget // (bytes/token × page_size)
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Protocol

import torch

from radixkernels.kv_format import SCALE_DTYPE, KVCacheDtype, KVFormat
from radixserve.memory.sharding import (
    WHOLE_MODEL,
    DeviceShard,
    kv_heads_per_rank,
    q_heads_per_rank,
)


class ModelConfig(Protocol):
    """The model dimensions the planner sizes memory from. Memory sits below the model layer,
    so this names what it reads; ``radixserve.model.config.ModelConfig`` provides it."""

    @property
    def num_layers(self) -> int: ...
    @property
    def num_q_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def q_size(self) -> int: ...
    @property
    def kv_size(self) -> int: ...
    @property
    def num_params(self) -> int: ...
    @property
    def attention_bias(self) -> bool: ...
    @property
    def o_proj_bias(self) -> bool: ...
    @property
    def mlp_bias(self) -> bool: ...
    @property
    def tie_word_embeddings(self) -> bool: ...


GiB = 1 << 30
MiB = 1 << 20


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def kv_format(
    cfg: ModelConfig, kv_dtype: KVCacheDtype | str = "auto", act_dtype: torch.dtype = torch.float16
) -> KVFormat:
    """The pool's storage format for this model's head_dim."""
    return KVFormat.create(kv_dtype, act_dtype, cfg.head_dim)


def kv_bytes_per_token(
    cfg: ModelConfig,
    kv_dtype: KVCacheDtype | str = "auto",
    act_dtype: torch.dtype = torch.float16,
    shard: DeviceShard = WHOLE_MODEL,
) -> int:
    """Bytes one token's K and V occupy in the pool, per-token scales included: all layers, or
    with ``shard`` those one device of a TP × PP worker keeps (its layers, its KV heads)."""
    return kv_format(cfg, kv_dtype, act_dtype).bytes_per_token(
        shard.layers(cfg.num_layers), kv_heads_per_rank(cfg.num_kv_heads, shard.tp_size)
    )


def kv_bytes_per_sequence(
    cfg: ModelConfig,
    seq_len: int,
    kv_dtype: KVCacheDtype | str = "auto",
    act_dtype: torch.dtype = torch.float16,
) -> int:
    """KV bytes of one sequence of ``seq_len`` tokens."""
    return seq_len * kv_bytes_per_token(cfg, kv_dtype, act_dtype)


def kv_fixed_bytes(
    cfg: ModelConfig, kv_dtype: KVCacheDtype | str = "auto", shard: DeviceShard = WHOLE_MODEL
) -> int:
    """Bytes of the pool that do not grow with tokens: fp8's static per-(layer, head) scales."""
    if KVCacheDtype(kv_dtype).has_head_scales:
        heads = kv_heads_per_rank(cfg.num_kv_heads, shard.tp_size)
        return 2 * shard.layers(cfg.num_layers) * heads * SCALE_DTYPE.itemsize
    return 0


def weight_bytes(
    cfg: ModelConfig,
    dtype: torch.dtype,
    quantization: str | None = None,
    group_size: int | None = None,
    quantize_embeddings: bool = False,
    quant_dense_cache: bool = False,
    shard: DeviceShard = WHOLE_MODEL,
) -> int:
    """Bytes of the model's weights when run in ``dtype`` (tied embeddings counted once).

    With ``quantization`` (int8 | int4 | fp8, radixserve.model.quant's formats) the decoder
    linears cost, per ``[N, K]`` weight: int8 ``N K + 2 N`` (bf16 scale per channel), int4
    ``N K / 2 + 4 N K / group`` (bf16 scale and zero per group), fp8 ``N K + 4 N``. With
    ``quantize_embeddings`` the embedding is int8 rows (``V H + 4 V``) and the LM head a
    quantized linear of its own (also when tied); otherwise both stay in ``dtype``.
    ``quant_dense_cache`` adds a bf16 copy (``2 N K``) of every int8/int4 decoder linear.

    With ``shard`` (one device of a TP × PP worker, :mod:`radixserve.memory.sharding`): its
    stage's layers, each linear a ``1/tp`` slice (query heads, KV heads or their replica,
    intermediate rows), the vocabulary-parallel embedding on the first stage and LM head on
    the last (a tied head is a copy there when the stages differ), norms whole.
    """
    act = _dtype_bytes(dtype)
    if quantization is None and shard.is_whole_model:
        return cfg.num_params * act
    tp = shard.tp_size
    h, v = cfg.hidden_size, math.ceil(cfg.vocab_size / tp)
    q = q_heads_per_rank(cfg.num_q_heads, cfg.num_kv_heads, tp) * cfg.head_dim
    kv = kv_heads_per_rank(cfg.num_kv_heads, tp) * cfg.head_dim
    i = math.ceil(cfg.intermediate_size / tp)
    shapes = [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)]
    if quantization == "int4" and group_size is None:
        group_size = next((g for g in (128, 64, 32) if all(k % g == 0 for _, k in shapes)), 32)

    def linear(n: int, k: int) -> int:
        if quantization is None:
            return n * k * act
        if quantization == "int8":
            return n * k + 2 * n
        if quantization == "int4":
            assert group_size is not None
            return n * k // 2 + 4 * n * (k // group_size)
        if quantization == "fp8":
            return n * k + 4 * n
        raise ValueError(f"unknown quantization {quantization!r}")

    def linear_with_copy(n: int, k: int) -> int:
        dense_copy = quant_dense_cache and quantization not in (None, "fp8")
        return linear(n, k) + (2 * n * k if dense_copy else 0)

    quantize_embeddings = quantize_embeddings and quantization is not None
    per_layer = sum(linear_with_copy(n, k) for n, k in shapes) + 2 * h * act  # + the two norms
    per_layer += act * (
        (q + 2 * kv if cfg.attention_bias else 0)
        + (h if cfg.o_proj_bias else 0)
        + (2 * i + h if cfg.mlp_bias else 0)
    )
    vocab = 0
    if shard.has_embedding:
        vocab += v * h + 4 * v if quantize_embeddings else v * h * act
    if shard.has_lm_head:
        if quantize_embeddings:
            vocab += linear_with_copy(v, h)
        elif not (cfg.tie_word_embeddings and shard.has_embedding):
            vocab += v * h * act  # its own head, or with PP the last stage's copy of a tied one
        vocab += h * act  # the final norm
    return shard.layers(cfg.num_layers) * per_layer + vocab


def activation_reserve_bytes(
    cfg: ModelConfig, max_num_tokens: int, act_dtype: torch.dtype, shard: DeviceShard = WHOLE_MODEL
) -> int:
    """A bound on the transient memory of one forward of ``max_num_tokens`` rows.

    Per row, the live tensors of one layer at its widest point: residual, normed input,
    q/k/v, attention output, gate/up and the gated product (3 × intermediate), plus float32
    logits for every row (prompt logprobs may ask for all of them). With ``shard``, the head
    and intermediate widths are the TP rank's share; logits only on the last stage (gathered
    to the whole vocabulary).
    """
    tp = shard.tp_size
    q = q_heads_per_rank(cfg.num_q_heads, cfg.num_kv_heads, tp) * cfg.head_dim
    kv = kv_heads_per_rank(cfg.num_kv_heads, tp) * cfg.head_dim
    per_row = 4 * cfg.hidden_size + 2 * q + 2 * kv + 3 * math.ceil(cfg.intermediate_size / tp)
    logits = cfg.vocab_size * 4 if shard.has_lm_head else 0
    return max_num_tokens * (per_row * _dtype_bytes(act_dtype) + logits)


def device_total_bytes(device: torch.device | str) -> int:
    """Total memory of the device (GPU memory, or the machine's RAM for the CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                "device cuda requested but torch.cuda.is_available() is False (use --device cpu)"
            )
        return int(torch.cuda.mem_get_info(device)[1])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cpu_available_bytes() -> int:
    """``MemAvailable`` from /proc/meminfo (free RAM the kernel can hand out without swapping)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return device_total_bytes("cpu")


@dataclass(frozen=True)
class MemoryPlan:
    """How the memory budget splits into weights, activations and KV pages."""

    device: str
    kv_dtype: str
    act_dtype: str
    page_size: int
    budget_bytes: int  # everything radixserve may use on the device
    budget_source: str  # how budget_bytes was chosen, in words
    weight_bytes: int
    activation_reserve_bytes: int
    kv_fixed_bytes: int  # fp8 per-head scales
    kv_budget_bytes: int  # what is left for pages (>= 0)
    bytes_per_token: int
    bytes_per_page: int
    num_pages: int  # 0 when nothing fits: callers must check

    @property
    def max_tokens(self) -> int:
        """Tokens of KV the pool holds at once (all sequences together)."""
        return self.num_pages * self.page_size

    @property
    def pool_bytes(self) -> int:
        return self.num_pages * self.bytes_per_page + self.kv_fixed_bytes

    def pages_per_sequence(self, seq_len: int) -> int:
        return math.ceil(seq_len / self.page_size)

    def max_sequences(self, seq_len: int) -> int:
        """Sequences of ``seq_len`` tokens whose KV fits at once (no sharing of prefixes)."""
        return self.num_pages // self.pages_per_sequence(seq_len)


def plan_memory(
    cfg: ModelConfig,
    *,
    kv_dtype: KVCacheDtype | str = "auto",
    page_size: int = 16,
    act_dtype: torch.dtype = torch.float32,
    memory_budget: int | None = None,
    memory_utilization: float = 0.9,
    device: torch.device | str = "cpu",
    max_num_tokens: int = 2048,
    weights_dtype: torch.dtype | None = None,
    max_num_pages: int | None = None,
    quantization: str | None = None,
    quant_group_size: int | None = None,
    quantize_embeddings: bool = False,
    quant_dense_cache: bool = False,
    shard: DeviceShard = WHOLE_MODEL,
    device_total: int | None = None,
) -> MemoryPlan:
    """Size the KV pool: pages of ``page_size`` tokens that fit after weights and activations.

    ``memory_budget`` (bytes) is the total radixserve may use; without it the budget is the
    device's total memory × ``memory_utilization`` (on the CPU, no more than what is available
    now). ``weights_dtype`` defaults to ``act_dtype`` (the model runs in one dtype).
    ``max_num_pages`` caps the result: on a CPU the budget is the machine's RAM, far more KV
    than a small model serving a few requests needs (e.g. cap at what
    ``max_running_requests × max_model_len`` tokens take). ``quantization`` and its options
    size quantized weights (:func:`weight_bytes`): what they save goes to KV pages.
    ``shard`` plans one device of a TP × PP worker (its weights, its layers' and heads' KV);
    ``device_total`` (bytes) plans for a device other than this machine's (e.g. an 80 GB GPU).
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if not 0.0 < memory_utilization <= 1.0:
        raise ValueError(f"memory_utilization must be in (0, 1], got {memory_utilization}")
    dev = torch.device(device)
    if memory_budget is not None:
        if memory_budget < 0:
            raise ValueError(f"memory_budget must be >= 0, got {memory_budget}")
        budget, source = int(memory_budget), "--memory-budget"
    elif device_total is not None:
        budget = int(device_total * memory_utilization)
        source = f"device {format_bytes(device_total)} × utilization {memory_utilization:g}"
    else:
        total = device_total_bytes(dev)
        budget = int(total * memory_utilization)
        source = f"{dev.type} total {format_bytes(total)} × utilization {memory_utilization:g}"
        if dev.type == "cpu":
            avail = cpu_available_bytes()
            if avail < budget:
                budget = avail
                source = f"cpu RAM available now ({format_bytes(avail)}; total × {memory_utilization:g} is more)"
    fmt = kv_format(cfg, kv_dtype, act_dtype)
    per_token = kv_bytes_per_token(cfg, fmt.kv_dtype, act_dtype, shard)
    per_page = per_token * page_size
    weights = weight_bytes(
        cfg,
        weights_dtype or act_dtype,
        quantization,
        quant_group_size,
        quantize_embeddings,
        quant_dense_cache,
        shard,
    )
    activations = activation_reserve_bytes(cfg, max_num_tokens, act_dtype, shard)
    fixed = kv_fixed_bytes(cfg, fmt.kv_dtype, shard)
    kv_budget = max(0, budget - weights - activations - fixed)
    return MemoryPlan(
        device=str(dev),
        kv_dtype=fmt.kv_dtype.value,
        act_dtype=str(act_dtype).replace("torch.", ""),
        page_size=page_size,
        budget_bytes=budget,
        budget_source=source,
        weight_bytes=weights,
        activation_reserve_bytes=activations,
        kv_fixed_bytes=fixed,
        kv_budget_bytes=kv_budget,
        bytes_per_token=per_token,
        bytes_per_page=per_page,
        num_pages=kv_budget // per_page
        if max_num_pages is None
        else min(max_num_pages, kv_budget // per_page),
    )


@dataclass(frozen=True)
class MemorySnapshot:
    """Memory in use now. CUDA: the caching allocator's counters; CPU: the process's RSS."""

    device: str
    allocated_bytes: int  # CUDA: tensors alive; CPU: process RSS
    reserved_bytes: int  # CUDA: held by the caching allocator; CPU: process RSS
    total_bytes: int  # device memory (GPU) or machine RAM (CPU)
    rss_bytes: int  # resident set of this process (host memory), both cases
    pool_bytes: int  # the KV pool's size, as told by the caller


def process_rss_bytes() -> int:
    """Resident set size of this process (from /proc/self/statm; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def memory_snapshot(device: torch.device | str = "cpu", pool_bytes: int = 0) -> MemorySnapshot:
    """What is in use on ``device`` now (cheap: no device sync, for metrics)."""
    dev = torch.device(device)
    rss = process_rss_bytes()
    if dev.type == "cuda":
        return MemorySnapshot(
            device=str(dev),
            allocated_bytes=int(torch.cuda.memory_allocated(dev)),
            reserved_bytes=int(torch.cuda.memory_reserved(dev)),
            total_bytes=device_total_bytes(dev),
            rss_bytes=rss,
            pool_bytes=pool_bytes,
        )
    return MemorySnapshot(
        device=str(dev),
        allocated_bytes=rss,
        reserved_bytes=rss,
        total_bytes=device_total_bytes(dev),
        rss_bytes=rss,
        pool_bytes=pool_bytes,
    )


def format_bytes(n: float) -> str:
    """Binary units, e.g. ``2.00 GiB``, ``512.0 KiB``, ``278,528 B``."""
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    if abs(n) >= MiB:
        return f"{n / MiB:.1f} MiB"
    if abs(n) >= 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{int(n):,} B"


def parse_bytes(text: str) -> int:
    """``"24GiB"``, ``"80 GB"``, ``"512MiB"``, ``"1e9"`` -> bytes (GB = 10^9, GiB = 2^30)."""
    s = text.strip().replace(" ", "").replace("_", "")
    units = {
        "tib": 1 << 40, "gib": GiB, "mib": MiB, "kib": 1024,
        "tb": 10**12, "gb": 10**9, "mb": 10**6, "kb": 10**3,
        "t": 1 << 40, "g": GiB, "m": MiB, "k": 1024, "b": 1,
    }  # fmt: skip
    lower = s.lower()
    number, mult = lower, 1  # a bare number counts bytes
    for unit, unit_mult in units.items():
        if lower.endswith(unit):
            number, mult = lower[: -len(unit)], unit_mult
            break
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a size (e.g. 24GiB, 80GB, 512MiB)") from None
    if value < 0 or not math.isfinite(value):
        raise ValueError(f"size must be a non-negative number, got {text!r}")
    return int(value * mult)
