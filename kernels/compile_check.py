"""Compile the kernels for a GPU architecture ahead of time, on a machine without a GPU.

The interpreter runs the kernels' Python semantics; it does not run Triton's compiler,
which is stricter (types of masked-load fill values, constexpr control flow, dot operand
shapes). This tool drives each public wrapper with small CPU tensors, captures the launch
instead of running it, and compiles the captured signature with ``triton.compile`` for a
``GPUTarget`` down to a cubin (``ptxas`` ships with triton), so compile errors show up in CI.

    TRITON_INTERPRET=0 python -m radixkernels.compile_check --arch 90 [--all]

Must run with the interpreter off (the kernels are defined at import time). Exits non-zero
on the first failure.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch

_TY = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",
    torch.int8: "i8",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.float8_e5m2: "fp8e5",
}


def _signature(
    fn: Any, args: tuple, kwargs: dict
) -> tuple[dict[str, str], dict[str, Any], dict[str, Any]]:
    """Triton signature / constexprs / launch options of one captured launch."""
    names = fn.arg_names
    bound = dict(zip(names, args))
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    bound.update(kwargs)
    sig: dict[str, str] = {}
    consts: dict[str, Any] = {}
    for i, name in enumerate(names):
        v = bound[name]
        if fn.params[i].is_constexpr:
            sig[name] = "constexpr"
            consts[name] = v
        elif isinstance(v, torch.Tensor):
            sig[name] = "*" + _TY[v.dtype]
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            sig[name] = "i32" if -(2**31) <= v < 2**31 else "i64"
        elif isinstance(v, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: cannot type argument {name}={v!r}")
    return sig, consts, options


@contextlib.contextmanager
def _capture(kernels: list[Any], into: list) -> Iterator[None]:
    """Replace each JITFunction's ``run`` so that launches are recorded, not executed."""
    saved = [k.__dict__.get("run") for k in kernels]
    for k in kernels:
        k.run = lambda *a, _k=k, grid=None, warmup=False, **kw: into.append((_k, a, dict(kw)))
    try:
        yield
    finally:
        for k, s in zip(kernels, saved):
            if s is None:
                del k.run
            else:
                k.run = s


def _cases(full: bool) -> list[tuple[str, str, torch.dtype, int, int, int]]:
    """(kernel, kv dtype, activation dtype, Hq, Hkv, head_dim) launches to compile."""
    kv = ["auto", "fp8_e4m3", "fp8_e5m2", "int8", "int4"]
    acts = [torch.float16, torch.bfloat16, torch.float32]
    if full:
        return [
            (k, d, a, 9, 3, 64) for k in ("store", "decode", "extend") for d in kv for a in acts
        ] + [(k, "auto", a, 9, 3, 64) for k in ("fused", "int8_gemv") for a in acts]
    return [
        ("store", "int4", torch.bfloat16, 9, 3, 64),
        ("store", "fp8_e4m3", torch.float16, 9, 3, 64),
        ("decode", "auto", torch.float16, 9, 3, 64),
        ("decode", "int4", torch.bfloat16, 32, 32, 128),
        ("decode", "fp8_e5m2", torch.float32, 4, 2, 16),
        ("extend", "int8", torch.float16, 9, 3, 64),
        ("extend", "fp8_e4m3", torch.bfloat16, 32, 32, 128),
        ("extend", "int4", torch.float32, 4, 1, 16),
        ("decode+sinks", "auto", torch.bfloat16, 8, 2, 64),  # gpt-oss: both stages' sinks
        ("extend+sinks", "fp8_e4m3", torch.bfloat16, 8, 2, 64),
        ("fused", "auto", torch.bfloat16, 9, 3, 64),
        ("fused", "auto", torch.float32, 4, 1, 16),
        ("int8_gemv", "auto", torch.bfloat16, 9, 3, 64),
    ]


def _launch(kind: str, kv_dtype: str, act: torch.dtype, hq: int, hkv: int, d: int) -> None:
    from radixkernels import KVFormat, extend_attention, paged_decode_attention, store_kv

    kind, _, extra = kind.partition("+")
    sinks = torch.zeros(hq) if extra == "sinks" else None  # the SINKS variants
    fmt = KVFormat.create(kv_dtype, act, d)
    pages, ps = 4, 16
    shape = (pages, ps, hkv, fmt.packed_head_dim)
    k_data = torch.zeros(shape, dtype=fmt.storage_dtype)
    v_data = torch.zeros_like(k_data)
    if fmt.kv_dtype.has_token_scales:
        k_scale, v_scale = torch.ones(shape[:3]), torch.ones(shape[:3])
    elif fmt.kv_dtype.has_head_scales:
        k_scale, v_scale = torch.ones(hkv), torch.ones(hkv)
    else:
        k_scale = v_scale = None
    pt = torch.arange(pages, dtype=torch.int32).view(2, 2)
    lens = torch.tensor([20, 30], dtype=torch.int32)
    if kind == "int8_gemv":  # one row (BLOCK_M 1) and five (BLOCK_M 4), SmolLM2's down_proj
        from radixkernels.int8_gemv import int8_linear

        codes = torch.zeros(576, 1536, dtype=torch.int8)
        for rows in (1, 5):
            int8_linear(torch.zeros(rows, 1536, dtype=act), codes, torch.ones(576, dtype=act))
    elif kind == "fused":
        from radixkernels.fused import rms_norm, rope_store_kv, silu_mul

        x = torch.zeros(3, 576, dtype=act)
        rms_norm(x, torch.ones(576, dtype=act), 1e-5)
        rms_norm(x, torch.ones(576, dtype=act), 1e-5, residual=torch.zeros_like(x))
        silu_mul(torch.zeros(3, 2 * 1536, dtype=act))
        qkv = torch.zeros(3, hq + 2 * hkv, d, dtype=act)
        cs = torch.zeros(3, 1, d, dtype=act)
        rope_store_kv(qkv, cs, cs, hq, k_data, v_data, torch.arange(3), fmt)
    elif kind == "store":
        x = torch.zeros(3, hkv, d, dtype=act)
        store_kv(k_data, v_data, k_scale, v_scale, x, x, torch.arange(3), fmt)
    elif kind == "decode":
        q = torch.zeros(2, hq, d, dtype=act)
        paged_decode_attention(
            q,
            k_data,
            v_data,
            k_scale,
            v_scale,
            fmt,
            pt,
            lens,
            ps,
            0.1,
            num_kv_splits=4,
            sinks=sinks,
        )
    else:
        q = torch.zeros(7, hq, d, dtype=act)
        ext = torch.tensor([3, 4], dtype=torch.int32)
        extend_attention(
            q,
            k_data,
            v_data,
            k_scale,
            v_scale,
            fmt,
            pt,
            lens,
            ext,
            torch.tensor([0, 3], dtype=torch.int32),
            ps,
            0.1,
            max_extend_len=4,
            sinks=sinks,
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--arch", type=int, default=90, help="CUDA compute capability as an int (90 = H100/H200)"
    )
    ap.add_argument("--all", action="store_true", help="every kernel x KV dtype x activation dtype")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print(
            "compile_check: run with TRITON_INTERPRET=0 (the kernels must be defined for the compiler)",
            file=sys.stderr,
        )
        return 2
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from radixkernels.variants import launched_kernels

    jit_fns = launched_kernels()
    target = GPUTarget("cuda", args.arch, 32)
    seen: set[tuple] = set()
    for case in _cases(args.all):
        launches: list = []
        with _capture(jit_fns, launches):
            _launch(*case)
        for fn, a, kw in launches:
            sig, consts, options = _signature(fn, a, kw)
            key = (fn.__name__, tuple(sorted(sig.items())), tuple(sorted(consts.items())))
            if key in seen:
                continue
            seen.add(key)
            t0 = time.perf_counter()
            try:
                compiled = triton.compile(
                    ASTSource(fn, sig, consts), target=target, options=options
                )
            except Exception as e:  # report which variant failed, then fail
                print(f"FAIL sm_{args.arch} {fn.__name__} {case}: {e}", file=sys.stderr)
                return 1
            # Shared memory per program as the compiler laid it out (tiles x pipeline stages):
            # what limits the programs resident on one SM (228 KB per SM on Hopper).
            smem = getattr(compiled.metadata, "shared", 0)
            print(
                f"ok   sm_{args.arch} {fn.__name__:22} {case[1]:9} {str(case[2]):15} "
                f"d{case[5]:<3} smem {smem / 1024:5.1f} KiB {time.perf_counter() - t0:5.1f}s"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
