"""The engine flags shared by every command that builds an Engine (generate, demo, serve, worker).

No torch here: ``radixserve --help`` imports every command module.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

# EngineConfig fields exposed as flags: (flag, type, help). The rest: --engine-config JSON.
ENGINE_FLAGS: list[tuple[str, Any, str]] = [
    ("page-size", int, "tokens per KV page"),
    ("kv-cache-dtype", str, "auto | fp8_e4m3 | fp8_e5m2 | int8 | int4"),
    (
        "attention-backend",
        str,
        "torch | triton (default: triton on cuda, torch on cpu; triton on the CPU runs the interpreter, slow)",
    ),
    ("max-num-tokens", int, "per-step token budget (prefill chunk size)"),
    ("max-running-requests", int, "concurrent requests (per worker)"),
    ("num-pages", int, "KV pool size in pages (default: planned from memory)"),
    ("memory-budget", int, "bytes for the KV pool planner"),
    (
        "memory-utilization",
        float,
        "fraction of the device's memory the planner may use (default 0.9)",
    ),
    ("max-model-len", int, "context length cap"),
    ("schedule-policy", str, "lpm | fcfs"),
    ("eviction-policy", str, "lru | lfu | slru | priority | adaptive (least measured regret)"),
    (
        "session-leases",
        str,
        "on | off: keep a session's last turn cached through its pause (default on)",
    ),
    (
        "predicted-outputs",
        str,
        "on | off: draft from a request's prediction (OpenAI's predicted outputs), as "
        "speculative decoding does, without --speculative-algorithm too (default on)",
    ),
    ("session-lease-default-s", float, "a first lease while no session has paused yet (60)"),
    ("session-lease-cap-s", float, "longest session lease, seconds (600)"),
    ("dtype", str, "float32 | bfloat16 | float16 (default: bfloat16 on cuda, float32 on cpu)"),
    ("device", str, "cpu | cuda | cuda:N"),
    ("num-threads", int, "CPU threads (per worker; serve's default: cores / workers)"),
    (
        "overlap-schedule",
        str,
        "auto | on | off: plan the next step while the device runs this one (auto: on with CUDA)",
    ),
    (
        "decode-graphs",
        str,
        "auto | on | off: decode steps from static padded buffers, CUDA graphs (auto: on with CUDA)",
    ),
    (
        "quantization",
        str,
        "weight quantization: int8 | int4 | fp8 (fp8: CUDA, compute capability >= 8.9)",
    ),
    (
        "speculative-algorithm",
        str,
        "speculative decoding drafter: ngram (prompt lookup) | radix (continuations from the "
        "cache's sequences, per namespace) | draft (a smaller model of the same vocabulary, "
        "--speculative-draft-model); greedy and sampled requests, CPU (docs/speculative.md)",
    ),
    (
        "speculative-draft-model",
        str,
        "the draft model's checkpoint directory, for --speculative-algorithm draft (same "
        "tokenizer and vocabulary as the model; python -m radixserve.speculative.make_draft "
        "makes a layer-subset one)",
    ),
    (
        "speculative-num-tokens",
        int,
        "most tokens a request drafts per step, adapted per request from its acceptance (default 4)",
    ),
    (
        "speculative-disable-by-batch-size",
        int,
        "no drafting while more requests than this are running or waiting (default 8): a "
        "loaded CPU step is compute-bound, and verify rows then cost what decode rows do",
    ),
    (
        "quant-group-size",
        int,
        "int4 group size: 32 | 64 | 128 | 256 (default: largest dividing; 32 for GGUF)",
    ),
]


# SGLang's and vLLM's names for the same flags, so their launch commands carry over.
FLAG_ALIASES: dict[str, tuple[str, ...]] = {
    "max-model-len": ("context-length",),
    "memory-utilization": ("mem-fraction-static", "gpu-memory-utilization"),
    "max-num-tokens": ("chunked-prefill-size", "max-num-batched-tokens"),
    "max-running-requests": ("max-num-seqs",),
}


def add_engine_arguments(
    p: argparse.ArgumentParser, title: str = "engine", *, seed: bool = False
) -> None:
    """One flag per common EngineConfig field (with SGLang's and vLLM's names for it),
    ``--disable-radix-cache`` and ``--engine-config``; ``seed``: ``--seed`` too (the
    engine's, for the commands whose ``--seed`` is not a request's)."""
    g = p.add_argument_group(title)
    for flag, typ, help_ in ENGINE_FLAGS:
        names = [f"--{name}" for name in (flag, *FLAG_ALIASES.get(flag, ()))]
        g.add_argument(*names, dest=flag.replace("-", "_"), type=typ, default=None, help=help_)
    if seed:
        g.add_argument(
            "--seed",
            "--random-seed",
            dest="engine_seed",
            type=int,
            default=None,
            help="the engine's sampler seed (a request with a seed of its own still samples by it)",
        )
    g.add_argument(
        "--disable-radix-cache", action="store_true", help="no prefix caching (baseline)"
    )
    g.add_argument(
        "--quantize-embeddings",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also quantize the embedding and LM head (default: only for models of >= 1 B parameters)",
    )
    g.add_argument(
        "--quant-dense-cache",
        action="store_true",
        help="int8/int4: also keep each quantized weight decoded to bf16 for batches of 4+ rows "
        "(faster at concurrency on the CPU; on CUDA int8's dequantized-weights path for every "
        "batch, instead of the Triton GEMV; +2 bytes per quantized weight)",
    )
    g.add_argument(
        "--window-kv-ratio",
        type=float,
        default=None,
        help="sliding-window models: window layers' KV pool size per global page (default 0.5; "
        "0: full KV for every layer); their pages are freed as requests move past the window",
    )
    _hierarchical_cache_arguments(g)
    g.add_argument(
        "--disaggregation-mode",
        choices=("prefill", "decode"),
        default=None,
        help="prefill/decode disaggregation: this worker computes prompts and writes their KV "
        "to a decode worker (prefill), or receives it and decodes (decode); Mooncake's "
        "transfer engine moves the pages",
    )
    g.add_argument(
        "--disaggregation-ib-device",
        default=None,
        help="with --disaggregation-mode: the RDMA NICs for the transfer engine (e.g. "
        "mlx5_0,mlx5_1); unset: tcp",
    )
    g.add_argument(
        "--cache-report",
        action="store_true",
        help="every request's usage says where its prompt left the cached path and why "
        "(not only those asking with return_cache_report); feeds /metrics and cache-report",
    )
    g.add_argument("--engine-config", default="{}", help="more EngineConfig fields as JSON")
    add_lora_arguments(p)
    add_parallel_arguments(p)


def add_lora_arguments(p: argparse.ArgumentParser) -> None:
    """LoRA adapters served beside the model (SGLang's and vLLM's names; docs/lora.md)."""
    g = p.add_argument_group("LoRA adapters")
    g.add_argument(
        "--lora-paths",
        "--lora-modules",
        dest="lora_paths",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters to serve beside the model (PEFT's saved directories); a request "
        "names one as its model (OpenAI) or lora_path (SGLang)",
    )
    g.add_argument(
        "--max-lora-rank", type=int, default=None, help="the largest adapter rank accepted (64)"
    )
    g.add_argument(
        "--enable-lora",
        action="store_true",
        default=None,
        help="serve LoRA adapters loaded while serving (/load_lora_adapter), with or without "
        "--lora-paths",
    )
    g.add_argument(
        "--max-loaded-loras",
        type=int,
        default=None,
        help="the most adapters served at once, loaded at start-up or since (no bound)",
    )


def _hierarchical_cache_arguments(g: Any) -> None:
    """The L2/L3 tiers' flags (SGLang's names; docs/hierarchical-cache.md)."""
    g.add_argument(
        "--enable-hierarchical-cache",
        action="store_true",
        help="keep KV evicted from the pool in host memory (L2) and load it back on a hit",
    )
    g.add_argument(
        "--hicache-size",
        type=float,
        default=None,
        help="L2 host memory in GiB (default: 2x the KV pool)",
    )
    g.add_argument(
        "--hicache-dtype",
        choices=("auto", "bfloat16", "fp8_e4m3", "int8"),
        default=None,
        help="KV dtype of L2/L3 (default auto: L1's); a smaller one fits more prefixes, "
        "rounding each page once when it is demoted",
    )
    g.add_argument(
        "--hicache-storage-dir",
        default=None,
        help="L3: KV page files in this directory, shared across restarts and workers (implies the hierarchy)",
    )
    g.add_argument(
        "--hicache-storage-backend",
        choices=("file", "mooncake"),
        default=None,
        help="L3 backend: file (--hicache-storage-dir) or mooncake (a Mooncake Store shared by "
        "every worker of the cluster; implies the hierarchy). Default file",
    )
    g.add_argument(
        "--hicache-storage-backend-config",
        default=None,
        help="the Mooncake config file (JSON: master_server_address, metadata_server, "
        "protocol, device_name, global_segment_size, local_buffer_size, ...)",
    )
    g.add_argument(
        "--hicache-storage-backend-extra-config",
        default=None,
        help="the same fields as a JSON object, over the file's (e.g. "
        '\'{"master_server_address": "mooncake-master:50051"}\')',
    )


def add_parallel_arguments(p: argparse.ArgumentParser) -> None:
    """Tensor parallelism and multi-node flags (SGLang's names; docs/parallelism.md)."""
    g = p.add_argument_group("parallelism")
    g.add_argument(
        "--tensor-parallel-size",
        "--tp",
        "--tp-size",
        dest="tensor_parallel_size",
        type=int,
        default=None,
        help="ranks per worker, each holding a shard of every layer (default 1)",
    )
    g.add_argument(
        "--pipeline-parallel-size",
        "--pp",
        "--pp-size",
        dest="pipeline_parallel_size",
        type=int,
        default=None,
        help="pipeline stages per worker (contiguous layer ranges), each a group of "
        "--tensor-parallel-size ranks (default 1; one host)",
    )
    g.add_argument("--nnodes", type=int, default=None, help="hosts the worker's ranks span")
    g.add_argument(
        "--node-rank",
        type=int,
        default=None,
        help="this host's index (0: rank 0, the worker itself; others only run ranks)",
    )
    g.add_argument(
        "--dist-init-addr",
        default=None,
        metavar="HOST:PORT",
        help="rank 0's rendezvous address (default: a free loopback port; unauthenticated, "
        "keep it on a private network)",
    )
    g.add_argument(
        "--dist-timeout",
        type=float,
        default=None,
        help="seconds a collective may wait for a rank before the worker fails (default 60)",
    )
    g.add_argument(
        "--tp-graph-capture",
        action="store_true",
        help="capture CUDA decode graphs with tensor parallelism too, all-reduces inside "
        "(untried; default: those steps run eagerly)",
    )
    g.add_argument(
        "--expert-parallel",
        "--enable-expert-parallel",
        dest="expert_parallel",
        action="store_true",
        help="MoE models: spread whole experts over the tensor-parallel ranks (num_experts / "
        "tp each) instead of cutting every expert on its width",
    )
    try:  # serve has --insecure already (router, HTTP): it covers the rendezvous too
        g.add_argument(
            "--insecure",
            action="store_true",
            help="allow a wildcard --dist-init-addr (unauthenticated on every interface)",
        )
    except argparse.ArgumentError:
        pass


def engine_config(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig overrides the flags ask for.

    Call it before torch or triton is imported: the Triton backend on the CPU needs the
    interpreter, which Triton reads from ``TRITON_INTERPRET`` once, at import; setting it here
    also covers the worker processes that ``serve`` starts (they inherit the environment).
    """
    cfg: dict[str, Any] = json.loads(args.engine_config)
    for flag, _, _ in ENGINE_FLAGS:
        value = getattr(args, flag.replace("-", "_"))
        if value is not None:
            cfg[flag.replace("-", "_")] = value
    if args.disable_radix_cache:
        cfg["disable_radix_cache"] = True
    if getattr(args, "engine_seed", None) is not None:
        cfg["seed"] = args.engine_seed
    for name in (
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "nnodes",
        "node_rank",
        "dist_init_addr",
        "dist_timeout",
    ):
        if getattr(args, name, None) is not None:
            cfg[name] = getattr(args, name)
    if getattr(args, "tp_graph_capture", False):
        cfg["tp_graph_capture"] = True
    if getattr(args, "expert_parallel", False):
        cfg["expert_parallel"] = True
    if getattr(args, "insecure", False) and cfg.get("dist_init_addr"):
        cfg["dist_insecure"] = True
    if args.quantize_embeddings is not None:
        cfg["quantize_embeddings"] = args.quantize_embeddings
    if args.quant_dense_cache:
        cfg["quant_dense_cache"] = True
    if args.enable_hierarchical_cache:
        cfg["enable_hierarchical_cache"] = True
    if getattr(args, "cache_report", False):
        cfg["cache_report"] = True
    for name in (
        "window_kv_ratio",
        "hicache_size",
        "hicache_storage_dir",
        "hicache_dtype",
        "hicache_storage_backend",
        "hicache_storage_backend_config",
        "hicache_storage_backend_extra_config",
        "disaggregation_mode",
        "lora_paths",
        "max_lora_rank",
        "enable_lora",
        "max_loaded_loras",
    ):
        if getattr(args, name, None) is not None:
            cfg[name] = getattr(args, name)
    if getattr(args, "disaggregation_ib_device", None):
        cfg["disaggregation_ib_device"] = args.disaggregation_ib_device
        cfg["disaggregation_protocol"] = "rdma"
    if cfg.get("attention_backend") == "triton" and str(cfg.get("device", "cpu")).startswith("cpu"):
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return cfg
