"""GPU benchmark of the radixkernels attention kernels (needs a CUDA GPU; run via gpu_check.sh).

Measures, in one run on one device:

1. copy bandwidth: ``dst.copy_(src)`` of a 2 GiB buffer, bytes read + written per second;
   the yardstick for "achieved bandwidth" below (what this device really streams).
2. paged decode attention at batch 64 x 4096 context for a SmolLM2-like head shape
   (9 q / 3 kv heads, head_dim 64) and a Llama-7B-like one (32 / 32, head_dim 128), per KV
   dtype, page size 16, pages scattered randomly over the pool: time, bytes the kernel must
   read (K/V data + scales + page table + q + out), achieved bandwidth and its fraction of the
   copy bandwidth (target >= 70% for the unquantized fp16 cache). The default split count
   and a sweep of explicit ones are reported; each output is checked against the torch
   reference at full size.
3. prefix-extend attention as a causal prefill (prefix 0) of 8 x 2048 tokens, TFLOP/s next to
   ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)`` on the same dense
   shape (K/V already contiguous for SDPA: a baseline with no paging at all), plus the same
   kernel for 512 new tokens after a 3584-token cached prefix.

Prints a table and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit(
        "bench_kernels_gpu: TRITON_INTERPRET is set; unset it (or export TRITON_INTERPRET=0) "
        "to benchmark compiled kernels"
    )
if not torch.cuda.is_available():
    sys.exit(
        f"bench_kernels_gpu: no CUDA GPU visible to torch (torch {torch.__version__}); "
        "this benchmark needs one"
    )

import triton  # noqa: E402
import triton.testing  # noqa: E402

from radixkernels import KVFormat, extend_attention, paged_decode_attention, store_kv  # noqa: E402
from radixkernels.decode import default_num_kv_splits  # noqa: E402
from radixkernels.reference import paged_decode_attention_ref  # noqa: E402

DEV = torch.device("cuda")
ACT = torch.float16
SHAPES = {"smollm2": (9, 3, 64), "llama7b": (32, 32, 128)}


def bench(fn: Callable[[], object]) -> float:
    """Median milliseconds of ``fn`` (triton's do_bench: warm-up, L2 flush between runs)."""
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEV).random_(0, 255)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3)


def make_pool(kv_dtype: str, hkv: int, d: int, num_tokens: int, page_size: int):
    """A pool holding ``num_tokens`` random tokens, written through the store kernel."""
    fmt = KVFormat.create(kv_dtype, ACT, d)
    num_pages = num_tokens // page_size
    shape = (num_pages, page_size, hkv, fmt.packed_head_dim)
    k_data = torch.empty(shape, dtype=fmt.storage_dtype, device=DEV)
    v_data = torch.empty_like(k_data)
    if fmt.kv_dtype.has_token_scales:
        k_scale = torch.empty(shape[:3], device=DEV)
        v_scale = torch.empty_like(k_scale)
    elif fmt.kv_dtype.has_head_scales:
        k_scale = torch.ones(hkv, device=DEV)
        v_scale = torch.ones(hkv, device=DEV)
    else:
        k_scale = v_scale = None
    chunk = 1 << 16
    for t0 in range(0, num_tokens, chunk):
        n = min(chunk, num_tokens - t0)
        k = torch.randn(n, hkv, d, device=DEV, dtype=ACT)
        v = torch.randn(n, hkv, d, device=DEV, dtype=ACT)
        store_kv(k_data, v_data, k_scale, v_scale, k, v, torch.arange(t0, t0 + n, device=DEV), fmt)
    return fmt, k_data, v_data, k_scale, v_scale


def nbytes(*ts: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def bench_decode(
    name: str, kv_dtype: str, copy_bw: float, batch: int, ctx: int, page_size: int
) -> dict:
    hq, hkv, d = SHAPES[name]
    fmt, k_data, v_data, k_scale, v_scale = make_pool(kv_dtype, hkv, d, batch * ctx, page_size)
    pages_per_seq = ctx // page_size
    page_table = (
        torch.randperm(batch * pages_per_seq, device=DEV).to(torch.int32).view(batch, pages_per_seq)
    )
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    q = torch.randn(batch, hq, d, device=DEV, dtype=ACT)
    out = torch.empty_like(q)
    args = (q, k_data, v_data, k_scale, v_scale, fmt, page_table, seq_lens, page_size, d**-0.5)
    # Bytes the kernel must move at least once: all of the pool (every token is live), the
    # per-token scales, the page table, q and the output.
    moved = nbytes(k_data, v_data, page_table, q, out)
    if fmt.kv_dtype.has_token_scales:
        moved += nbytes(k_scale, v_scale)
    default_splits = default_num_kv_splits(batch, hkv, DEV)
    sweep = sorted({default_splits, 1, 2, 4, 8, 16})
    times = {
        s: bench(lambda s=s: paged_decode_attention(*args, num_kv_splits=s, out=out)) for s in sweep
    }
    paged_decode_attention(*args, num_kv_splits=default_splits, out=out)
    ref = paged_decode_attention_ref(*args)
    max_err = float((out.float() - ref.float()).abs().max())
    del ref
    best = min(times, key=times.get)
    res = {
        "shape": name,
        "kv_dtype": kv_dtype,
        "batch": batch,
        "context": ctx,
        "page_size": page_size,
        "q_heads": hq,
        "kv_heads": hkv,
        "head_dim": d,
        "bytes": moved,
        "default_splits": default_splits,
        "ms_default": times[default_splits],
        "best_splits": best,
        "ms_best": times[best],
        "gbps_default": moved / (times[default_splits] * 1e-3) / 1e9,
        "gbps_best": moved / (times[best] * 1e-3) / 1e9,
        "frac_copy_bw_default": moved / (times[default_splits] * 1e-3) / copy_bw,
        "frac_copy_bw_best": moved / (times[best] * 1e-3) / copy_bw,
        "ms_by_splits": times,
        "max_abs_err_vs_ref": max_err,
    }
    return res


def bench_extend(
    name: str, batch: int, prefix: int, new: int, page_size: int, with_sdpa: bool
) -> dict:
    hq, hkv, d = SHAPES[name]
    ctx = prefix + new
    fmt, k_data, v_data, k_scale, v_scale = make_pool("auto", hkv, d, batch * ctx, page_size)
    pages_per_seq = ctx // page_size
    page_table = torch.arange(batch * pages_per_seq, device=DEV, dtype=torch.int32).view(
        batch, pages_per_seq
    )
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    ext = torch.full((batch,), new, dtype=torch.int32, device=DEV)
    starts = torch.arange(batch, device=DEV, dtype=torch.int32) * new
    q = torch.randn(batch * new, hq, d, device=DEV, dtype=ACT)
    out = torch.empty_like(q)
    ms = bench(
        lambda: extend_attention(
            q,
            k_data,
            v_data,
            None,
            None,
            fmt,
            page_table,
            seq_lens,
            ext,
            starts,
            page_size,
            d**-0.5,
            max_extend_len=new,
            out=out,
        )
    )
    # Causal FLOPs: QK^T and PV over the allowed (query, key) pairs.
    pairs = batch * (new * prefix + new * (new + 1) / 2)
    flops = 4 * hq * d * pairs
    res = {
        "shape": name,
        "batch": batch,
        "prefix": prefix,
        "new_tokens": new,
        "page_size": page_size,
        "ms": ms,
        "tflops": flops / (ms * 1e-3) / 1e12,
    }
    if with_sdpa:
        assert prefix == 0
        qd = q.view(batch, new, hq, d).transpose(1, 2)
        kd = (
            k_data.view(batch, ctx, hkv, d)
            .transpose(1, 2)
            .repeat_interleave(hq // hkv, dim=1)
            .contiguous()
        )
        vd = (
            v_data.view(batch, ctx, hkv, d)
            .transpose(1, 2)
            .repeat_interleave(hq // hkv, dim=1)
            .contiguous()
        )
        sdpa = torch.nn.functional.scaled_dot_product_attention
        ms_sdpa = bench(lambda: sdpa(qd, kd, vd, is_causal=True, scale=d**-0.5))
        ref = sdpa(qd, kd, vd, is_causal=True, scale=d**-0.5).transpose(1, 2).reshape_as(out)
        res.update(
            ms_sdpa=ms_sdpa,
            tflops_sdpa=flops / (ms_sdpa * 1e-3) / 1e12,
            ratio_vs_sdpa=ms_sdpa / ms,
            max_abs_err_vs_sdpa=float((out.float() - ref.float()).abs().max()),
        )
    return res


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/kernels_gpu.json"))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--kv-dtypes", default="auto,fp8_e4m3,int8,int4")
    args = ap.parse_args()
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(DEV)
    copy_bw = copy_bandwidth()
    torch.cuda.empty_cache()
    print(
        f"device: {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, "
        f"triton {triton.__version__}"
    )
    print(f"copy bandwidth (read+write): {copy_bw / 1e9:.0f} GB/s")
    decode = []
    print(
        f"\npaged decode, batch {args.batch} x {args.context} ctx, page {args.page_size}, fp16 activations"
    )
    print(
        f"{'shape':8} {'kv':9} {'MB':>7} {'splits':>6} {'us':>8} {'GB/s':>7} {'%copy':>6} | "
        f"{'best':>4} {'us':>8} {'%copy':>6} {'err':>8}"
    )
    for name in SHAPES:
        for kvd in args.kv_dtypes.split(","):
            r = bench_decode(name, kvd, copy_bw, args.batch, args.context, args.page_size)
            torch.cuda.empty_cache()  # the pools of one case are gone before the next allocates
            decode.append(r)
            print(
                f"{name:8} {kvd:9} {r['bytes'] / 1e6:7.1f} {r['default_splits']:6d} {r['ms_default'] * 1e3:8.1f} "
                f"{r['gbps_default']:7.0f} {100 * r['frac_copy_bw_default']:5.1f}% | {r['best_splits']:4d} "
                f"{r['ms_best'] * 1e3:8.1f} {100 * r['frac_copy_bw_best']:5.1f}% {r['max_abs_err_vs_ref']:8.1e}"
            )
    extend = []
    print("\nprefix-extend attention (fp16, page 16) vs dense causal SDPA")
    for name in SHAPES:
        for batch, prefix, new in ((8, 0, 2048), (8, 3584, 512)):
            r = bench_extend(name, batch, prefix, new, args.page_size, with_sdpa=prefix == 0)
            torch.cuda.empty_cache()
            extend.append(r)
            line = (
                f"{name:8} b{batch} prefix {prefix:5d} new {new:5d}: {r['ms'] * 1e3:9.1f} us "
                f"{r['tflops']:6.1f} TFLOP/s"
            )
            if "tflops_sdpa" in r:
                line += (
                    f" | SDPA {r['tflops_sdpa']:6.1f} TFLOP/s (kernel/SDPA "
                    f"{r['ratio_vs_sdpa']:.2f}x) err {r['max_abs_err_vs_sdpa']:.1e}"
                )
            print(line)
    result = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_bandwidth_gbps": copy_bw / 1e9,
        "decode": decode,
        "extend": extend,
        "decode_target_frac": 0.7,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
