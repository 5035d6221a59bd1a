"""GB/s of the CPU int4 linear kernels at decode row counts: torch's tinygemm
(``_weight_int4pack_mm_for_cpu``, what Int4Linear ran before) against cpu_gemv's int4 kernel.

SmolLM2's four layer shapes (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536), 30
layers' worth of distinct random weights so they stream from memory as in a decode step, not
from cache. GB/s counts the bytes each kernel reads: codes (K / 2 per output) plus its scales
and zeros (bf16, 4 bytes per group per output), the same for both kernels.

    python benchmarks/bench_int4_gemv.py --rows 1,2,4,8 --groups 32,64 --dense
"""

from __future__ import annotations

import radixserve  # noqa: F401  (before torch: it sets OMP_WAIT_POLICY / GOMP_SPINCOUNT)

# isort: split
import argparse

import torch
from timing import median_seconds

from radixserve.model import cpu_gemv
from radixserve.model.quant.formats import quantize_int4

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (N, K): qkv, o, gate_up, down


def _layers(group: int, n_layers: int) -> tuple[list[dict[str, torch.Tensor]], int]:
    """Per layer and shape: tinygemm's and cpu_gemv's buffers of one random weight; total bytes."""
    torch.manual_seed(0)
    out, total = [], 0
    for _ in range(n_layers):
        for n, k in SHAPES:
            q = quantize_int4(torch.randn(n, k) * 0.05, group, torch.bfloat16)
            out.append(
                {
                    "tg": torch._convert_weight_to_int4pack_for_cpu(q.codes.to(torch.int32), 1),
                    "tg_sz": torch.stack([q.scale.t(), q.zero.t()], dim=-1).contiguous(),
                    "gv": cpu_gemv.pack_int4(q.codes, group),
                    "gv_sz": cpu_gemv.int4_scales_zeros(q.scale, q.zero),
                    "bf16": torch.randn(n, k, dtype=torch.bfloat16),
                }
            )
            total += n * k // 2 + n * (k // group) * 4
    return out, total


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--groups", default="32,64")  # 128 does not divide SmolLM2's 576
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--dense", action="store_true", help="also the bf16 kernel on bf16 weights")
    args = ap.parse_args()
    if not cpu_gemv.available():
        raise SystemExit("cpu_gemv kernels unavailable (need AVX-512 bf16 and a compiler)")
    print(
        "| group | threads | rows | tinygemm GB/s | gemv GB/s | gemv / tinygemm | bf16 gemv GB/s |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    with torch.inference_mode():
        for group in (int(g) for g in args.groups.split(",")):
            layers, total = _layers(group, args.layers)
            dense_bytes = sum(lay["bf16"].numel() * 2 for lay in layers)
            xs = {
                m: {k: torch.randn(m, k, dtype=torch.bfloat16) for _, k in SHAPES}
                for m in (int(r) for r in args.rows.split(","))
            }
            for threads in (int(t) for t in args.threads.split(",")):
                torch.set_num_threads(threads)
                for m, xm in xs.items():

                    def tinygemm() -> None:
                        for (_, k), lay in zip(SHAPES * args.layers, layers):
                            torch._weight_int4pack_mm_for_cpu(xm[k], lay["tg"], group, lay["tg_sz"])

                    def gemv() -> None:
                        for (_, k), lay in zip(SHAPES * args.layers, layers):
                            cpu_gemv.int4_linear(xm[k], lay["gv"], lay["gv_sz"], group)

                    def dense() -> None:  # the bf16 kernel on bf16 weights: what memory allows
                        for (_, k), lay in zip(SHAPES * args.layers, layers):
                            cpu_gemv.linear(xm[k], lay["bf16"])

                    # Interleave the two so drift on a shared machine hits both alike.
                    t_tg, t_gv, t_bf = [], [], []
                    for _ in range(3):
                        t_tg.append(median_seconds(tinygemm, args.reps // 3 or 1))
                        t_gv.append(median_seconds(gemv, args.reps // 3 or 1))
                        if args.dense:
                            t_bf.append(median_seconds(dense, args.reps // 3 or 1))
                    a, b = total / min(t_tg) / 1e9, total / min(t_gv) / 1e9
                    c = f"{dense_bytes / min(t_bf) / 1e9:.1f}" if t_bf else "-"
                    print(
                        f"| {group} | {threads} | {m} | {a:.1f} | {b:.1f} | {b / a:.2f} | {c} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
