"""EngineConfig: every knob of the offline engine, frozen and validated once."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch

from radixserve.scheduling.types import SchedulerConfig

if TYPE_CHECKING:
    from radixserve.model.quant.config import QuantConfig

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"``/``"bf16"``/``torch.bfloat16`` -> ``torch.bfloat16`` (and so on)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPES)}") from None


# The fields that take one of a few names, and the names each takes.
CHOICES: dict[str, tuple[str, ...]] = {
    "attention_backend": ("torch", "triton"),
    "decode_graphs": ("auto", "on", "off"),
    "overlap_schedule": ("auto", "on", "off"),
    "schedule_policy": ("lpm", "fcfs"),
    "eviction_policy": ("lru", "lfu", "slru", "priority", "adaptive"),
    "session_leases": ("on", "off"),
    "predicted_outputs": ("on", "off"),
    "hicache_dtype": ("auto", "bfloat16", "fp8_e4m3", "int8"),
    "hicache_storage_backend": ("file", "mooncake"),
}


_NOT_YET = "speculative decoding does not support {} yet"


@dataclass(frozen=True)
class EngineConfig:
    """Configuration of one :class:`~radixserve.engine.engine.Engine`.

    ``max_num_tokens`` is the per-step token budget: decode rows cost one token each and
    prompts longer than what is left are prefilled in chunks over several steps.
    ``num_pages`` sizes the KV pool directly; otherwise the memory planner sizes it from
    ``memory_budget`` (bytes) or from the device's free memory.
    """

    page_size: int = 16
    kv_cache_dtype: str = "auto"
    attention_backend: str | None = (
        None  # "torch" | "triton"; None: the device's default (engine.devices)
    )
    max_num_tokens: int = 2048
    max_running_requests: int = 64
    num_pages: int | None = None
    memory_budget: int | None = None
    memory_utilization: float = 0.9
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    disable_radix_cache: bool = False
    # Sliding-window models (Gemma 2/3, Mistral, windowed Qwen): the window layers' KV in a
    # pool of its own of this many pages per global page (memory.window_pool), freed as
    # requests move past it; 0: every layer keeps every token's KV, as a global layer does.
    window_kv_ratio: float = 0.5
    # Hierarchical cache: L1 evictions move to host memory (L2) and, with a storage dir, to
    # page files (L3) that survive restarts; a match loads them back. ``hicache_size`` is
    # L2's size in GiB (default: twice the L1 pool); a storage dir turns the hierarchy on.
    enable_hierarchical_cache: bool = False
    hicache_size: float | None = None
    hicache_storage_dir: str | None = None
    # L2 (and L3) KV dtype: "auto" (L1's), "bfloat16", "fp8_e4m3" or "int8": a smaller one
    # fits more prefixes in hicache_size; pages are rounded once, on demotion.
    hicache_dtype: str = "auto"
    # L3's backend: "file" (page files in hicache_storage_dir) or "mooncake" (a Mooncake Store
    # cluster, shared by workers on every host; memory.mooncake_store). Its settings: a config
    # file in Mooncake's format and/or a JSON object of the same fields (which wins).
    hicache_storage_backend: str = "file"
    hicache_storage_backend_config: str | None = None
    hicache_storage_backend_extra_config: str | None = None
    # Prefill/decode disaggregation (distributed.disagg): "prefill" computes prompts and
    # writes their KV into a decode engine's pool; "decode" receives it and decodes. The
    # transfer engine listens on this host (tcp; "rdma" with the NICs in _ib_device).
    disaggregation_mode: str | None = None
    disaggregation_hostname: str = "127.0.0.1"
    disaggregation_protocol: str = "tcp"
    disaggregation_ib_device: str = ""
    # Record KV cache events (vLLM's BlockStored/BlockRemoved/AllBlocksCleared); a serving
    # worker publishes them on a ZeroMQ XPUB bound here ("{worker}" -> the worker's id).
    kv_events_endpoint: str | None = None
    kv_events_topic: str = "kv-events"
    # At most this fraction of the KV pool may be pinned by requests' pin_ttl_s.
    pin_budget_fraction: float = 0.25
    # Session leases (memory.leases): a finished turn's path stays cached, evicted after
    # everything unleased, for a time learned from the session's own pauses (a default
    # before any was seen, at most the cap). "off": plain LRU.
    session_leases: str = "on"
    # Which evictable leaves go first: lru | lfu | slru | priority | adaptive (memory.eviction;
    # adaptive follows the candidate with the least regret on shadow caches).
    eviction_policy: str = "lru"
    session_lease_default_s: float = 60.0
    session_lease_cap_s: float = 600.0
    # Every request gets a cache report (where its prompt left the cached path, and why:
    # memory.miss_report), not only those that ask with return_cache_report.
    cache_report: bool = False
    # The scheduling knobs: their defaults and meaning are SchedulerConfig's (one source).
    schedule_policy: str = SchedulerConfig.schedule_policy  # "lpm" | "fcfs"
    lpm_max_bypass: int = SchedulerConfig.lpm_max_bypass
    lpm_max_queue: int = SchedulerConfig.lpm_max_queue
    defer_shared_prefix_tokens: int = SchedulerConfig.defer_shared_prefix_tokens
    init_new_token_ratio: float = SchedulerConfig.init_new_token_ratio
    min_new_token_ratio: float = SchedulerConfig.min_new_token_ratio
    new_token_ratio_decay: float = SchedulerConfig.new_token_ratio_decay
    dtype: str | None = None  # None: the device's default (bfloat16 on cuda, float32 on cpu)
    device: str = "cpu"
    seed: int = 0
    num_threads: int | None = None  # CPU: torch threads (default: all cores)
    # Pipeline parallelism: the layers split into this many stages, one rank process each
    # (rank 0 is this engine's process; radixserve.distributed.pipeline).
    pipeline_parallel_size: int = 1
    # Micro-batches a step is cut into down the pipe (None: one per stage; 1: none).
    pipeline_micro_batches: int | None = None
    # Weight quantization (vLLM's --quantization): None | "int8" | "int4" | "fp8".
    quantization: str | None = None
    quant_group_size: int | None = (
        None  # int4 group (32/64/128/256; default: largest dividing, 32 for GGUF)
    )
    # Quantize the embedding and LM head too (default: only for models of >= 1 B parameters).
    quantize_embeddings: bool | None = None
    # int8/int4: also keep each quantized weight decoded to bf16 for batches of a few rows or
    # more (the weight-only kernels are GEMV-shaped); +2 bytes per quantized weight.
    quant_dense_cache: bool = False

    # Decode-only steps from static buffers padded to batch-size buckets, captured as CUDA
    # graphs where the backend allows: "auto" (on with CUDA, off on the CPU, where padding
    # costs and nothing is captured), "on", "off".
    decode_graphs: str = "auto"

    # Overlap scheduling: plan step N+1 while step N runs, stop checks one step late. "auto":
    # on with CUDA; off on the CPU, where the device is the host and nothing runs meanwhile.
    overlap_schedule: str = "auto"

    # Tensor parallelism (distributed.ranks): this worker's ranks, on `nnodes` hosts meeting at
    # `dist_init_addr` (HOST:PORT; default a free loopback port, one host); `node_rank` says
    # which host this process is. A collective that takes longer than `dist_timeout` seconds
    # fails the worker. `dist_insecure` allows a wildcard rendezvous address.
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    dist_timeout: float = 60.0
    dist_insecure: bool = False
    # Capture the decode graphs with tensor parallelism too (their all-reduces inside the
    # graph): off by default, decode steps then run the static buffers eagerly. c10d's NCCL
    # collectives inside CUDA graphs are untried here (it needs two GPUs to try).
    tp_graph_capture: bool = False
    # Expert parallelism (MoE models): each tensor-parallel rank holds num_experts / N whole
    # experts instead of every expert cut on its width; the routed rows' partial outputs are
    # summed by the same all-reduce. num_experts must divide by tensor_parallel_size.
    expert_parallel: bool = False

    # Speculative decoding (radixserve.speculative): "ngram" (prompt lookup), "radix" (what
    # followed in the cache's sequences, per namespace) or "draft" (the smaller model of the
    # same vocabulary at `speculative_draft_model`); None: off. At most
    # `speculative_num_tokens` drafted per request and step (adapted per request); no
    # drafting while more than `speculative_disable_by_batch_size` requests are running or
    # waiting (SchedulerConfig's).
    speculative_algorithm: str | None = None
    speculative_num_tokens: int = 4
    speculative_disable_by_batch_size: int = SchedulerConfig.speculative_disable_by_batch_size
    speculative_draft_model: str | None = None
    # Predicted outputs (OpenAI's ``prediction``): a request's expected output is drafted from
    # and verified as speculative decoding's drafts are, with or without an algorithm above;
    # unused where speculative decoding cannot run (speculation_limits).
    predicted_outputs: str = "on"
    # LoRA adapters served beside the weights (radixserve.model.lora): ``name=path`` of PEFT's
    # saved directories (SGLang's --lora-paths); a request picks one by name or none. Ranks
    # above max_lora_rank are refused.
    lora_paths: tuple[str, ...] = ()
    max_lora_rank: int = 64
    # Adapters loaded and unloaded while serving (Engine.load_lora_adapter, SGLang's and
    # vLLM's /load_lora_adapter): on with lora_paths, or alone with enable_lora (SGLang's and
    # vLLM's --enable-lora). At most max_loaded_loras served at once (None: no bound).
    enable_lora: bool = False
    max_loaded_loras: int | None = None

    @property
    def lora_enabled(self) -> bool:
        """Whether LoRA adapters are served, from start-up or loaded later."""
        return self.enable_lora or bool(self.lora_paths)

    @property
    def use_overlap(self) -> bool:
        if self.overlap_schedule == "auto":
            return torch.device(self.device).type == "cuda"
        return self.overlap_schedule == "on"

    @property
    def use_decode_graphs(self) -> bool:
        if self.decode_graphs == "auto":
            # A decode graph's forward is fixed at capture: adapted rows run eagerly.
            return torch.device(self.device).type == "cuda" and not self.lora_enabled
        return self.decode_graphs == "on"

    @property
    def capture_decode_graphs(self) -> bool:
        """Whether the decode graphs may be captured (where the device and backend allow):
        not around tensor-parallel collectives unless ``tp_graph_capture`` asks for it."""
        return self.tensor_parallel_size == 1 or self.tp_graph_capture

    @property
    def hierarchical_cache(self) -> bool:
        """Whether L2/L3 are on (asked for, or implied by a storage directory)."""
        return (
            self.enable_hierarchical_cache
            or self.hicache_storage_dir is not None
            or self.hicache_storage_backend == "mooncake"
        )

    def __post_init__(self) -> None:
        self._resolve_device_defaults()
        object.__setattr__(self, "lora_paths", tuple(self.lora_paths))  # JSON gives a list
        errors = [
            *self._choice_errors(),
            *self._range_errors(),
            *self._dtype_errors(),
            *self._quant_errors(),
            *self._parallel_errors(),
            *self._speculative_errors(),
            *self._disaggregation_errors(),
            *self._lora_errors(),
        ]
        if errors:
            raise ValueError("invalid engine config: " + "; ".join(errors))

    def _resolve_device_defaults(self) -> None:
        """The device's dtype and attention backend where none was given (frozen: they go
        in once, here)."""
        from radixserve.engine.devices import device_defaults

        try:
            defaults = device_defaults(self.device)
        except ValueError as e:
            raise ValueError(f"invalid engine config: {e}") from None
        if self.dtype is None:
            object.__setattr__(self, "dtype", defaults.dtype)
        if self.attention_backend is None:
            object.__setattr__(self, "attention_backend", defaults.attention_backend)

    def _choice_errors(self) -> list[str]:
        return [
            f"{name} must be one of {', '.join(names)}, got {getattr(self, name)!r}"
            for name, names in CHOICES.items()
            if getattr(self, name) not in names
        ]

    def _range_errors(self) -> list[str]:
        errors: list[str] = []
        for name in ("page_size", "max_num_tokens", "max_running_requests", "num_pages"):
            value = getattr(self, name)
            if value is not None and value < 1:
                errors.append(f"{name} must be >= 1, got {value}")
        if self.max_model_len is not None and self.max_model_len < 2:
            errors.append(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not 0 < self.session_lease_default_s <= self.session_lease_cap_s:
            errors.append("session leases need 0 < session_lease_default_s <= session_lease_cap_s")
        for name in ("pin_budget_fraction", "window_kv_ratio"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                errors.append(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if not 0.0 < self.memory_utilization <= 1.0:
            errors.append(f"memory_utilization must be in (0, 1], got {self.memory_utilization}")
        if self.hicache_size is not None and self.hicache_size <= 0:
            errors.append(f"hicache_size must be > 0 GiB, got {self.hicache_size}")
        if self.disable_radix_cache and self.hierarchical_cache:
            errors.append("the hierarchical cache needs the radix cache (drop disable_radix_cache)")
        return errors

    def _dtype_errors(self) -> list[str]:
        from radixkernels.kv_format import KVCacheDtype

        errors: list[str] = []
        assert self.dtype is not None  # resolved first
        try:
            parse_dtype(self.dtype)
        except ValueError as e:
            errors.append(str(e))
        try:
            KVCacheDtype(self.kv_cache_dtype)
        except ValueError:
            errors.append(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}")
        return errors

    def _quant_errors(self) -> list[str]:
        if self.quantization is None:
            if self.quant_group_size is not None:
                return ["quant_group_size needs quantization='int4'"]
            if self.quant_dense_cache:
                return ["quant_dense_cache needs quantization='int8' or 'int4'"]
            return []
        from radixserve.model.quant.config import QuantConfig, check_device

        try:
            QuantConfig(
                self.quantization,
                self.quant_group_size,
                self.quantize_embeddings,
                self.quant_dense_cache,
            )
            check_device(self.quantization, self.device)
        except (ValueError, RuntimeError, AssertionError) as e:
            return [str(e)]
        return []

    def _disaggregation_errors(self) -> list[str]:
        mode = self.disaggregation_mode
        if mode not in (None, "prefill", "decode"):
            return [f"disaggregation_mode must be prefill or decode, got {mode!r}"]
        if mode is not None and self.pipeline_parallel_size > 1:
            # Each stage holds some layers in a process of its own, reached only through the
            # activations' channel; the transfer moves the tensor-parallel ranks' pools only.
            return [
                f"disaggregation_mode={mode} does not run with pipeline parallelism "
                f"(pipeline_parallel_size={self.pipeline_parallel_size}): the KV transfer moves "
                "each tensor-parallel rank's pool, not each stage's layers"
            ]
        return []

    def _lora_errors(self) -> list[str]:
        """What LoRA adapters do not run with yet (docs/lora.md)."""
        if not self.lora_enabled:
            return []
        errors: list[str] = []
        if not 1 <= self.max_lora_rank <= 1024:
            errors.append(f"max_lora_rank must be in [1, 1024], got {self.max_lora_rank}")
        if self.max_loaded_loras is not None and self.max_loaded_loras < max(
            1, len(self.lora_paths)
        ):
            errors.append(
                f"max_loaded_loras ({self.max_loaded_loras}) must be at least 1 and at least "
                f"the {len(self.lora_paths)} adapters of lora_paths"
            )
        unsupported = {
            "pipeline parallelism": self.pipeline_parallel_size > 1,
            "prefill/decode disaggregation": self.disaggregation_mode is not None,
            "decode graphs (decode_graphs=on)": self.decode_graphs == "on",
        }
        errors += [
            f"LoRA adapters do not run with {what} yet" for what, on in unsupported.items() if on
        ]
        return errors

    def _speculative_errors(self) -> list[str]:
        """Speculative settings that are wrong, and what an algorithm does not run with yet
        (docs/speculative.md)."""
        if (self.speculative_algorithm == "draft") != (self.speculative_draft_model is not None):
            return ["speculative_algorithm 'draft' and speculative_draft_model go together"]
        errors: list[str] = []
        if not 1 <= self.speculative_num_tokens <= 16:
            errors.append(
                f"speculative_num_tokens must be in [1, 16], got {self.speculative_num_tokens}"
            )
        if self.speculative_disable_by_batch_size < 1:
            errors.append(
                "speculative_disable_by_batch_size must be at least 1, got "
                f"{self.speculative_disable_by_batch_size}"
            )
        if self.speculative_algorithm is None:
            return errors
        from radixserve.speculative import ALGORITHMS

        if self.speculative_algorithm not in ALGORITHMS:
            return errors + [
                f"unknown speculative_algorithm {self.speculative_algorithm!r}; "
                f"expected one of {', '.join(ALGORITHMS)}"
            ]
        errors += self.speculation_limits()
        if self.tensor_parallel_size > 1 and self.speculative_algorithm == "draft":
            errors.append(_NOT_YET.format("tensor parallelism with a draft model"))
        if self.speculative_algorithm == "radix" and self.disable_radix_cache:
            errors.append(
                "speculative_algorithm 'radix' drafts from the radix cache (drop disable_radix_cache)"
            )
        return errors

    def speculation_limits(self) -> list[str]:
        """What in this config speculative decoding does not run with yet, whatever drafts:
        an algorithm is refused with it, and predicted outputs go unused."""
        limits: list[str] = []
        if torch.device(self.device).type != "cpu":
            limits.append(_NOT_YET.format(f"the {self.device} device (it runs on the CPU)"))
        if self.pipeline_parallel_size > 1:
            limits.append(_NOT_YET.format("pipeline parallelism"))
        if self.quantization not in (None, "int8", "int4"):
            limits.append(_NOT_YET.format(f"{self.quantization} weights (int8 and int4 only)"))
        if self.quantization is not None and self.quant_dense_cache:
            # Its decoded copy takes over from 4 rows (int4): a 4-row prefill chunk beside a
            # verify row would not get the kernel it runs alone.
            limits.append(_NOT_YET.format("quant_dense_cache"))
        if self.overlap_schedule == "on":
            limits.append(_NOT_YET.format("overlap scheduling"))
        if self.attention_backend != "torch":
            limits.append(_NOT_YET.format(f"the {self.attention_backend} attention backend"))
        return limits

    def _parallel_errors(self) -> list[str]:
        from radixserve.distributed.dist_addr import check_dist_addr

        errors: list[str] = []
        tp, nn = self.tensor_parallel_size, self.nnodes
        if tp < 1:
            errors.append(f"tensor_parallel_size must be >= 1, got {tp}")
        elif nn < 1 or tp % nn:
            errors.append(f"nnodes ({nn}) must divide tensor_parallel_size ({tp})")
        elif not 0 <= self.node_rank < nn:
            errors.append(f"node_rank must be in [0, {nn}), got {self.node_rank}")
        if nn > 1 and self.dist_init_addr is None:
            errors.append("several nodes need dist_init_addr (rank 0's host:port)")
        if self.dist_timeout <= 0:
            errors.append(f"dist_timeout must be > 0 seconds, got {self.dist_timeout}")
        pp = self.pipeline_parallel_size
        if pp < 1:
            errors.append(f"pipeline_parallel_size must be >= 1, got {pp}")
        elif pp > 1:
            if self.pipeline_micro_batches is not None and self.pipeline_micro_batches < 1:
                errors.append(
                    f"pipeline_micro_batches must be >= 1, got {self.pipeline_micro_batches}"
                )
            if nn > 1:
                errors.append("pipeline parallelism runs its ranks on one host (nnodes 1)")
            if self.expert_parallel:
                errors.append("expert parallelism is not supported with pipeline parallelism")
            if self.quantization is not None:
                errors.append(
                    "pipeline parallelism loads unquantized safetensors (no quantization)"
                )
            if self.hierarchical_cache:
                errors.append(
                    "the hierarchical cache is not supported with pipeline parallelism yet"
                )
        if tp > 1 and self.hierarchical_cache:
            errors.append("the hierarchical cache is not supported with tensor parallelism yet")
        try:
            check_dist_addr(self.dist_init_addr, self.dist_insecure)
        except ValueError as e:
            errors.append(str(e))
        return errors

    @property
    def torch_dtype(self) -> torch.dtype:
        assert self.dtype is not None  # resolved in __post_init__
        return parse_dtype(self.dtype)

    @property
    def resolved_attention_backend(self) -> str:
        """The attention backend's name, the device's default filled in."""
        assert self.attention_backend is not None  # resolved in __post_init__
        return self.attention_backend

    def quant_config(self) -> QuantConfig | None:
        """The :class:`~radixserve.model.quant.QuantConfig` asked for, or None."""
        if self.quantization is None:
            return None
        from radixserve.model.quant.config import QuantConfig

        return QuantConfig(
            self.quantization,
            self.quant_group_size,
            self.quantize_embeddings,
            self.quant_dense_cache,
        )

    def scheduling_fields(self) -> dict[str, Any]:
        """This config's values of the :class:`SchedulerConfig` fields it shares by name."""
        shared = {f.name for f in fields(SchedulerConfig)} & {f.name for f in fields(self)}
        return {name: getattr(self, name) for name in sorted(shared)}

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from keyword arguments, rejecting unknown names with the list of known ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine config option(s) {unknown}; known: {sorted(known)}")
        if isinstance(kwargs.get("dtype"), torch.dtype):
            kwargs["dtype"] = str(kwargs["dtype"]).removeprefix("torch.")
        return cls(**kwargs)
