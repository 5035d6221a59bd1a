"""``radixserve memory``: the KV memory calculator and pool planner, with its arithmetic shown."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from radixserve.cli import register

if TYPE_CHECKING:
    import torch

    from radixserve.memory.parallel_plan import ParallelMemoryPlan
    from radixserve.memory.planner import MemoryPlan
    from radixserve.model.config import ModelConfig

KV_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2", "int8", "int4")
QUANT_METHODS = (
    "int8",
    "int4",
    "fp8",
)  # radixserve.model.quant's (not imported: --help stays light)
# The article's KV-quantization table, as a fraction of FP16 (see docs/kv-memory.md for why these
# cannot be byte counts).
ARTICLE_RATIOS = {"int8": 0.375, "int4": 0.1875}


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="default",
        help="a preset name (llama-2-7b, llama-2-13b, llama-2-70b, smollm2-135m), a config.json, "
        "a checkpoint directory, or 'default' (the fetched SmolLM2-135M-Instruct)",
    )
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (default 4096)")
    p.add_argument("--batch-size", type=int, default=1, help="sequences held at once (default 1)")
    p.add_argument(
        "--dtype",
        default=None,
        help="weights/activation dtype: float32, bfloat16, float16 (default: the config's)",
    )
    p.add_argument(
        "--kv-cache-dtype", default="auto", choices=KV_DTYPES, help="KV-cache dtype for the plan"
    )
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    p.add_argument(
        "--memory-budget", default=None, help="total bytes radixserve may use, e.g. 80GiB, 24GB"
    )
    p.add_argument(
        "--device-memory",
        default=None,
        help="plan for devices of this size (e.g. 80GB) instead of the local device's; "
        "the budget is this x --memory-utilization",
    )
    p.add_argument(
        "--tensor-parallel-size",
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks per pipeline stage: show weights and KV per device",
    )
    p.add_argument(
        "--pipeline-parallel-size",
        "--pp",
        type=int,
        default=1,
        help="pipeline stages (contiguous layer ranges): show weights and KV per device",
    )
    p.add_argument(
        "--expert-parallel",
        action="store_true",
        help="MoE models with --tp: whole experts spread over the ranks (num_experts / tp each)",
    )
    p.add_argument(
        "--memory-utilization",
        type=float,
        default=0.9,
        help="fraction of device memory (default 0.9)",
    )
    p.add_argument(
        "--device", default=None, help="cpu or cuda[:N] (default: cuda if available, else cpu)"
    )
    p.add_argument(
        "--max-num-tokens",
        type=int,
        default=2048,
        help="rows per forward, for the activation reserve",
    )
    p.add_argument("--cache-dir", default=None, help="model cache root for --model default")
    p.add_argument(
        "--quantization",
        default=None,
        choices=QUANT_METHODS,
        help="weight quantization for the plan",
    )
    p.add_argument(
        "--quant-group-size",
        type=int,
        default=None,
        help="int4 group size (default: largest dividing)",
    )
    p.add_argument(
        "--quantize-embeddings",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also quantize the embedding and LM head (default: only for models of >= 1 B parameters)",
    )
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")


def load_config_for(spec: str, cache_dir: str | None = None) -> tuple[ModelConfig, str]:
    """``--model`` -> (ModelConfig, description of where it came from)."""
    from radixserve.model.config import ModelConfig
    from radixserve.model_store import DEFAULT_MODEL_ALIASES, resolve_model
    from radixserve.presets import list_presets, preset_path

    path = Path(spec).expanduser()
    if path.exists():
        return ModelConfig.from_pretrained(path), str(path)
    preset = preset_path(spec)
    if preset is not None:
        return ModelConfig.from_pretrained(preset), f"preset {preset.stem} ({preset})"
    if spec.lower() in DEFAULT_MODEL_ALIASES:
        resolved = resolve_model(spec, cache_dir)
        return ModelConfig.from_pretrained(resolved), f"default model ({resolved})"
    raise FileNotFoundError(
        f"model {spec!r} is not a path, a preset ({', '.join(list_presets())}) or 'default'"
    )


def memory_report(cfg: ModelConfig, args: argparse.Namespace) -> dict[str, Any]:
    """All numbers the command prints, as plain data (also the ``--json`` output)."""
    import torch

    from radixserve.memory.parallel_plan import plan_parallel_memory
    from radixserve.memory.planner import plan_memory
    from radixserve.memory.window_bound import window_bound
    from radixserve.model.loader import parse_dtype

    act = parse_dtype(args.dtype) if args.dtype else cfg.torch_dtype
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")

    def plan_for(method: str | None) -> MemoryPlan:
        return plan_memory(cfg, **_plan_kwargs(cfg, args, act, device, method))

    plan = plan_for(args.quantization)
    parallel = None
    if args.tensor_parallel_size * args.pipeline_parallel_size > 1:
        parallel = plan_parallel_memory(
            cfg,
            args.tensor_parallel_size,
            args.pipeline_parallel_size,
            expert_parallel=getattr(args, "expert_parallel", False),
            **_plan_kwargs(cfg, args, act, device, args.quantization),
        )
    per_token = plan.bytes_per_token
    mha_per_token = per_token // cfg.num_kv_heads * cfg.num_q_heads
    return {
        "act_dtype": str(act).replace("torch.", ""),
        "act_bytes": act.itemsize,
        "num_params": cfg.num_params,
        "num_active_params": cfg.num_active_params,
        "seq_len": args.seq_len,
        "max_num_tokens": args.max_num_tokens,
        "batch_size": args.batch_size,
        "kv_bytes_per_token": per_token,
        "kv_bytes_per_sequence": per_token * args.seq_len,
        "kv_bytes_batch": per_token * args.seq_len * args.batch_size,
        "mha_kv_bytes_per_sequence": mha_per_token * args.seq_len,
        "kv_dtypes": _kv_dtype_rows(cfg, act, args.seq_len),
        "quantization": args.quantization,
        "quantize_embeddings": bool(
            args.quantize_embeddings
            if args.quantize_embeddings is not None
            else cfg.num_params >= 1_000_000_000
        ),
        "weight_quantization": _weight_rows(cfg, args.seq_len, plan_for),
        "plan": plan,
        "pages_per_sequence": plan.pages_per_sequence(args.seq_len),
        "max_sequences": plan.max_sequences(args.seq_len),
        "batch_fits": plan.max_sequences(args.seq_len) >= args.batch_size,
        "parallel": parallel,
        "sliding_window": window_bound(cfg, per_token, args.seq_len, args.max_num_tokens),
    }


def _kv_dtype_rows(cfg: ModelConfig, act: torch.dtype, seq_len: int) -> list[dict[str, Any]]:
    """One row per KV dtype: bytes per token (data and scales), against fp16 and the article."""
    import torch

    from radixserve.memory.planner import kv_bytes_per_token

    fp16 = kv_bytes_per_token(cfg, "auto", torch.float16)
    rows = []
    for kd in KV_DTYPES:
        per_token = kv_bytes_per_token(cfg, kd, act)
        data_bits = {"auto": act.itemsize * 8, "fp8_e4m3": 8, "fp8_e5m2": 8, "int8": 8, "int4": 4}[
            kd
        ]
        data = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * data_bits // 8
        rows.append(
            {
                "kv_dtype": kd if kd != "auto" else f"auto ({str(act).replace('torch.', '')})",
                "data_bytes_per_token": data,
                "scale_bytes_per_token": per_token - data,
                "bytes_per_token": per_token,
                "fraction_of_fp16": per_token / fp16,
                "article_fraction": ARTICLE_RATIOS.get(kd),
                "bytes_per_sequence": per_token * seq_len,
            }
        )
    return rows


def _plan_kwargs(
    cfg: ModelConfig, args: argparse.Namespace, act: torch.dtype, device: str, method: str | None
) -> dict[str, Any]:
    """The planner's arguments from the command's flags, for weights quantized by ``method``."""
    from radixserve.memory.planner import parse_bytes
    from radixserve.model.quant.config import QuantConfig

    qc = (
        QuantConfig(
            method,
            args.quant_group_size if method == "int4" else None,
            args.quantize_embeddings,
        )
        if method
        else None
    )
    return dict(
        kv_dtype=args.kv_cache_dtype,
        page_size=args.page_size,
        act_dtype=act,
        memory_budget=parse_bytes(args.memory_budget) if args.memory_budget else None,
        device_total=parse_bytes(args.device_memory) if args.device_memory else None,
        memory_utilization=args.memory_utilization,
        device=device,
        max_num_tokens=args.max_num_tokens,
        quantization=method,
        quant_group_size=qc.resolve_group_size(_in_features(cfg))
        if qc and method == "int4"
        else None,
        quantize_embeddings=bool(qc and qc.embeddings_quantized(cfg.num_params)),
    )


def _weight_rows(
    cfg: ModelConfig, seq_len: int, plan_for: Callable[[str | None], MemoryPlan]
) -> list[dict[str, Any]]:
    """One row per weight quantization: weight bytes, the KV budget left, sequences that fit."""
    base = plan_for(None)
    rows = []
    for method in (None, *QUANT_METHODS):
        p = plan_for(method)
        rows.append(
            {
                "quantization": method or "none",
                "weight_bytes": p.weight_bytes,
                "bytes_per_param": p.weight_bytes / cfg.num_params,
                "kv_budget_bytes": p.kv_budget_bytes,
                "max_sequences": p.max_sequences(seq_len),
                "extra_sequences": p.max_sequences(seq_len) - base.max_sequences(seq_len),
            }
        )
    return rows


def _in_features(cfg: ModelConfig) -> list[int]:
    """Input sizes of the decoder linears (what an int4 group must divide)."""
    widths = [cfg.hidden_size, cfg.q_size, cfg.intermediate_size]
    return widths + ([cfg.moe.intermediate_size] if cfg.moe is not None else [])


def render(cfg: ModelConfig, source: str, r: dict[str, Any]) -> str:
    """The human-readable report: every number with the arithmetic that produced it."""
    out = [
        *_render_model(cfg, source, r),
        "",
        *_render_kv_dtypes(cfg, r),
        "",
        *_render_weight_quantization(r),
        "",
        *_render_plan(r),
    ]
    if r["parallel"] is not None:
        out += ["", *render_parallel(cfg, r)]
    return "\n".join(out)


def _render_model(cfg: ModelConfig, source: str, r: dict[str, Any]) -> list[str]:
    """The model, its weights and its KV cache per token and per sequence."""
    from radixserve.memory.planner import format_bytes as fb

    plan: MemoryPlan = r["plan"]
    L, H, D, B = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, r["act_bytes"]
    attn = (
        "MHA"
        if H == cfg.num_q_heads
        else ("MQA" if H == 1 else f"GQA, {cfg.num_q_heads // H} query heads per KV head")
    )
    out = [
        f"Model: {source}",
        f"  {cfg.architecture}: {L} layers, hidden {cfg.hidden_size}, {cfg.num_q_heads} query heads, "
        f"{H} KV heads ({attn}), head_dim {D}, {cfg.num_params / 1e9:.2f} B parameters",
        f"Weights ({r['act_dtype']}): {cfg.num_params:,} params x {B} B = {fb(cfg.num_params * B)}"
        + (f"; {r['quantization']}: {fb(plan.weight_bytes)}" if r["quantization"] else ""),
        *_moe_lines(cfg, B),
        "",
        f"KV cache per token = 2 (K,V) x {L} layers x {H} KV heads x {D} head_dim x {B} B "
        f"= {r['kv_bytes_per_token']:,} B ({fb(r['kv_bytes_per_token'])})",
        f"KV cache per sequence of {r['seq_len']} tokens = {r['kv_bytes_per_sequence']:,} B "
        f"({fb(r['kv_bytes_per_sequence'])}); batch {r['batch_size']}: {fb(r['kv_bytes_batch'])}",
    ]
    if r.get("sliding_window") is not None:
        out.append(r["sliding_window"].describe())
    if H < cfg.num_q_heads:
        out.append(
            f"  {attn}: {H} KV heads instead of {cfg.num_q_heads} -> {cfg.num_q_heads // H}x smaller than "
            f"multi-head attention ({fb(r['mha_kv_bytes_per_sequence'])} per sequence)"
        )
    else:
        out.append(
            "  MHA: one KV head per query head (GQA/MQA would divide this by the group size)"
        )
    return out


def _render_kv_dtypes(cfg: ModelConfig, r: dict[str, Any]) -> list[str]:
    """What each KV-cache dtype costs per token and per sequence."""
    from radixserve.memory.planner import format_bytes as fb

    L, H = cfg.num_layers, cfg.num_kv_heads
    out = [
        f"KV-cache dtypes (per token; % of a 16-bit cache; per sequence of {r['seq_len']} tokens):",
    ]
    out.append(
        f"  {'kv dtype':<16}{'data B':>12}{'+ scales B':>12}{'= B/token':>12}{'% fp16':>9}  {'per seq':>10}  note"
    )
    for row in r["kv_dtypes"]:
        kd = row["kv_dtype"]
        note = ""
        if kd.startswith("fp8"):
            note = f"+ static per-head scales ({2 * L * H * 4} B per pool)"
        elif kd in ("int8", "int4"):
            note = f"scales: 2 x {L} x {H} x 4 B (fp32 per token and head)"
            if row["article_fraction"] is not None:
                note += f"; article says {row['article_fraction'] * 100:g}%"
        out.append(
            f"  {kd:<16}{row['data_bytes_per_token']:>12,}{row['scale_bytes_per_token']:>12,}"
            f"{row['bytes_per_token']:>12,}{row['fraction_of_fp16'] * 100:>8.2f}%  "
            f"{fb(row['bytes_per_sequence']):>10}  {note}"
        )
    out.append(
        "  (8 bits of 16 is 50%, 4 bits is 25%, before scales: the article's 37.5% / 18.75% are not byte counts; "
        "see docs/kv-memory.md)"
    )
    return out


def _render_weight_quantization(r: dict[str, Any]) -> list[str]:
    """How many more sequences each weight quantization leaves room for."""
    from radixserve.memory.planner import format_bytes as fb

    out = [
        f"Weight quantization (same budget; sequences of {r['seq_len']} tokens whose KV fits):",
    ]
    out.append(
        f"  {'weights':<10}{'bytes':>12}{'B/param':>9}{'KV budget':>12}{'sequences':>11}{'vs none':>9}"
    )
    for row in r["weight_quantization"]:
        out.append(
            f"  {row['quantization']:<10}{fb(row['weight_bytes']):>12}{row['bytes_per_param']:>9.2f}"
            f"{fb(row['kv_budget_bytes']):>12}{row['max_sequences']:>11,}{row['extra_sequences']:>+9,}"
        )
    out.append(
        "  (int8: 1 B + a bf16 scale per output channel; int4: 0.5 B + bf16 scale and zero per group; fp8: 1 B + "
        "fp32 scale per channel; embeddings/LM head "
        + ("quantized too)" if r["quantize_embeddings"] else "kept in the activation dtype)")
    )
    return out


def _render_plan(r: dict[str, Any]) -> list[str]:
    """The budget, subtracted down to pages and sequences."""
    from radixserve.memory.planner import format_bytes as fb

    plan: MemoryPlan = r["plan"]
    out = [
        f"Plan on {plan.device} (kv dtype {plan.kv_dtype}, page size {plan.page_size}):",
        f"  budget            {fb(plan.budget_bytes):>12}   {plan.budget_source}",
        f"  - weights         {fb(plan.weight_bytes):>12}"
        + (f"   {r['quantization']}" if r["quantization"] else ""),
        f"  - activations     {fb(plan.activation_reserve_bytes):>12}   reserve for one forward of "
        f"{r['max_num_tokens']} rows (--max-num-tokens)",
    ]
    if plan.kv_fixed_bytes:
        out.append(f"  - fp8 scales      {fb(plan.kv_fixed_bytes):>12}")
    out += [
        f"  = KV budget       {fb(plan.kv_budget_bytes):>12}",
        f"  / page            {fb(plan.bytes_per_page):>12}   ({plan.page_size} tokens x {plan.bytes_per_token:,} B)",
        f"  = {plan.num_pages:,} pages = {plan.max_tokens:,} tokens of KV",
        f"  -> {r['max_sequences']:,} sequences of {r['seq_len']} tokens at once "
        f"({r['pages_per_sequence']} pages each); batch {r['batch_size']} "
        + ("fits" if r["batch_fits"] else "does NOT fit"),
    ]
    return out


def _moe_lines(cfg: ModelConfig, act_bytes: int) -> list[str]:
    """Total against active parameters of a mixture-of-experts model (none for a dense one)."""
    from radixserve.memory.planner import format_bytes as fb

    moe = cfg.moe
    if moe is None:
        return []
    sparse = cfg.num_layers - len(moe.dense_layers)
    active = cfg.num_active_params
    shared = ""
    if moe.shared_expert_size:
        gated = " (gated)" if moe.shared_expert_gate else ""
        shared = f"; a shared expert of width {moe.shared_expert_size}{gated} on every token"
    return [
        f"  Mixture of experts: {moe.num_experts} experts, {moe.top_k} per token, in {sparse} of "
        f"{cfg.num_layers} layers (expert width {moe.intermediate_size}{shared}): all {cfg.num_params:,} "
        f"params are held, {active:,} active per token ({active / cfg.num_params:.1%}; "
        f"{fb(active * act_bytes)} of weights read per decode step of one sequence)"
    ]


def _expert_note(cfg: ModelConfig, tp: int, expert_parallel: bool = False) -> list[str]:
    """How a TP rank holds a MoE model's experts (each cut on its MLP width, or whole ones
    with expert parallelism), or nothing."""
    if cfg.moe is None or tp == 1:
        return []
    width = cfg.moe.intermediate_size
    if expert_parallel:
        return [
            f"  experts (expert parallel): {cfg.moe.num_experts // tp} of {cfg.moe.num_experts} "
            f"whole experts per rank, width {width:,} (the router whole on every rank)"
        ] + _shared_expert_note(cfg, tp)
    return [
        f"  experts: all {cfg.moe.num_experts} on every rank, each cut on its MLP width: "
        f"{-(-width // tp):,} of {width:,} rows (the router whole on every rank)"
    ] + _shared_expert_note(cfg, tp)


def _shared_expert_note(cfg: ModelConfig, tp: int) -> list[str]:
    """How a TP rank holds a shared expert (cut on its width in either expert layout)."""
    shared = cfg.moe.shared_expert_size if cfg.moe is not None else 0
    if not shared:
        return []
    return [
        f"  shared expert: cut on its MLP width on every rank: {-(-shared // tp):,} of "
        f"{shared:,} rows (its gate whole)"
    ]


def render_parallel(cfg: ModelConfig, r: dict[str, Any]) -> list[str]:
    """The TP × PP section: what each device holds and the page count all of them agree on."""
    from radixserve.memory.planner import format_bytes as fb
    from radixserve.memory.sharding import kv_heads_per_rank, q_heads_per_rank

    par: ParallelMemoryPlan = r["parallel"]
    tp, pp = par.tp_size, par.pp_size
    first = par.stages[0]
    kvr = kv_heads_per_rank(cfg.num_kv_heads, tp)
    qr = q_heads_per_rank(cfg.num_q_heads, cfg.num_kv_heads, tp)
    if cfg.num_kv_heads >= tp:
        kv_note = f"{cfg.num_kv_heads} / {tp} = {kvr}" + (
            " (uneven: the first ranks take one more)" if cfg.num_kv_heads % tp else ""
        )
    else:
        replicas = -(-tp // cfg.num_kv_heads)
        kv_note = f"1 ({cfg.num_kv_heads} KV heads < {tp} ranks: each replicated on up to {replicas} ranks)"
    out = [
        f"Per device: tensor parallel {tp} x pipeline parallel {pp} = {par.num_devices} devices "
        f"(kv dtype {first.kv_dtype}, page size {first.page_size}, budget {first.budget_source}):",
        f"  per TP rank: {qr} of {cfg.num_q_heads} query heads, KV heads {kv_note}, "
        f"{-(-cfg.intermediate_size // tp):,} of {cfg.intermediate_size:,} MLP rows, "
        f"{-(-cfg.vocab_size // tp):,} of {cfg.vocab_size:,} vocabulary rows (embedding / LM head)",
        *_expert_note(cfg, tp, par.shards[0].expert_parallel),
        f"  {'stage':<6}{'layers':<11}{'also holds':<16}{'budget':>11}{'weights':>11}{'activ.':>11}"
        f"{'KV B/token':>11}{'own pages':>11}{'used':>11}",
    ]
    for s, (shard, plan) in enumerate(zip(par.shards, par.stages, strict=True)):
        holds = "+".join(
            x
            for x, on in (("embedding", shard.has_embedding), ("LM head", shard.has_lm_head))
            if on
        )
        out.append(
            f"  {s:<6}{f'[{shard.layer_start}, {shard.layer_end})':<11}{holds or '-':<16}"
            f"{fb(plan.budget_bytes):>11}{fb(plan.weight_bytes):>11}{fb(plan.activation_reserve_bytes):>11}"
            f"{plan.bytes_per_token:>11,}{plan.num_pages:>11,}{fb(par.device_used_bytes(s)):>11}"
        )
    seqs = par.max_sequences(r["seq_len"])
    out += [
        f"  = {par.num_pages:,} pages on every device (the smallest stage's count) = "
        f"{par.max_tokens:,} tokens of KV",
        f"  -> {seqs:,} sequences of {r['seq_len']} tokens at once; batch {r['batch_size']} "
        + ("fits" if seqs >= r["batch_size"] else "does NOT fit"),
        f"  all {par.num_devices} devices: {fb(par.total_used_bytes)} used of a {fb(par.total_budget_bytes)} "
        f"budget (weights {fb(par.total_weight_bytes)}, KV pool {fb(par.total_kv_bytes)})",
    ]
    return out


@register(
    "memory",
    help="KV-cache memory calculator: bytes per token/sequence, pages and sequences that fit",
    arguments=_arguments,
)
def memory(args: argparse.Namespace) -> int:
    if args.seq_len < 1 or args.batch_size < 1:
        raise ValueError("--seq-len and --batch-size must be >= 1")
    if args.tensor_parallel_size < 1 or args.pipeline_parallel_size < 1:
        raise ValueError("--tensor-parallel-size and --pipeline-parallel-size must be >= 1")
    cfg, source = load_config_for(args.model, args.cache_dir)
    if args.expert_parallel and cfg.moe is not None:
        tp = args.tensor_parallel_size
        if args.pipeline_parallel_size > 1:
            raise ValueError("expert parallelism is not supported with pipeline parallelism")
        if cfg.moe.num_experts % tp:
            raise ValueError(
                f"expert parallelism needs the {cfg.moe.num_experts} experts to divide evenly "
                f"over the {tp} tensor-parallel ranks (num_experts % tp == 0)"
            )
    r = memory_report(cfg, args)
    if args.json:
        plan = r.pop("plan")
        r["plan"] = {**plan.__dict__, "max_tokens": plan.max_tokens, "pool_bytes": plan.pool_bytes}
        if r["parallel"] is not None:
            r["parallel"] = {
                **r["parallel"].as_dict(),
                "max_sequences": r["parallel"].max_sequences(args.seq_len),
            }
        if r["sliding_window"] is not None:
            r["sliding_window"] = r["sliding_window"]._asdict()
        r["model"] = source
        print(json.dumps(r, indent=2))
    else:
        print(render(cfg, source, r))
    return 0
