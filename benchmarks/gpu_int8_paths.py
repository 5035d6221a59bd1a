"""int8 weight-only linears on CUDA at decode batch sizes: which path reads its weights fastest.

For SmolLM2-135M's and a 7B model's linear shapes, at 1 and 16 rows, the median time of:

    bf16      F.linear on the bf16 weight (the yardstick: int8 must be no slower at batch 1)
    triton    Int8Linear's CUDA default, radixkernels.int8_gemv (codes dequantized in registers)
    dequant   the weight kept decoded to bf16 (--quant-dense-cache on CUDA): bf16's speed
    int8pack  torch._weight_int8pack_mm (what CUDA used before)

Each path is timed with CUDA events over many calls after a warm-up; its output is checked
against the float32 reference. The last line printed is the JSON result (gpu_check's
quant_linear phase reads it). Needs a GPU.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = {  # (out, in)
    "smollm2 o_proj": (576, 576),
    "smollm2 gate_up": (3072, 576),
    "smollm2 down": (576, 1536),
    "7b qkv": (12288, 4096),
    "7b down": (4096, 11008),
}


def _median_ms(fn: Callable[[], object], reps: int = 100) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return statistics.median(times)


def main() -> int:
    from radixkernels.int8_gemv import int8_linear
    from radixserve.model.quant.formats import quantize_int8

    dev = torch.device("cuda")
    torch.manual_seed(0)
    rows_out = []
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
        q = quantize_int8(w.float(), scale_dtype=torch.bfloat16)
        codes, scale = q.qweight.contiguous(), q.scale.contiguous()
        dense = (codes.to(torch.bfloat16) * scale[:, None]).contiguous()
        for m in (1, 16):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = F.linear(x.float(), codes.float()) * scale.float()
            paths: dict[str, Callable[[], torch.Tensor]] = {
                "bf16": lambda: F.linear(x, w),
                "triton": lambda: int8_linear(x, codes, scale),
                "dequant": lambda: F.linear(x, dense),
                "int8pack": lambda: torch._weight_int8pack_mm(x, codes, scale),
            }
            row: dict[str, object] = {"layer": name, "rows": m, "shape": [n, k]}
            for path, fn in paths.items():
                try:
                    err = (fn().float() - ref).abs().max().item() / ref.abs().max().item()
                    row[f"{path}_ms"] = _median_ms(fn)
                    row[f"{path}_rel_err"] = err
                except Exception as e:  # a path that does not run here is reported, not fatal
                    row[f"{path}_error"] = f"{type(e).__name__}: {e}"[:200]
            times = {p: row[f"{p}_ms"] for p in paths if f"{p}_ms" in row}
            row["fastest_int8"] = min(
                (p for p in times if p != "bf16"), key=lambda p: times[p], default=None
            )
            print(
                f"{name:16s} rows {m:2d}: "
                + ", ".join(f"{p} {t:.4f} ms" for p, t in times.items()),
                flush=True,
            )
            rows_out.append(row)
    print(json.dumps(rows_out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
